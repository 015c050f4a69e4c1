//! The instruction prompts the head is distilled on: templates x topics over code, maths, lists,
//! prose, questions, editing and several languages, assembled here (nothing is downloaded). The
//! tables are data, `data/prompts.json` (three pools of topic and template lists, built into the
//! binary); this module is their one loader and holds the rules that combine them. Every prompt
//! belongs to the training split or the held-out split by its *topic* (every fifth topic of a
//! list, index 4, 9, ..., is held out), so a held-out prompt never shares its subject with a
//! training prompt. Deterministic: the same seed gives the same lists.
//!
//! A pool added later comes after every prompt of the earlier ones, so their order (and every
//! shard already written from them) is unchanged: edit a pool's lists only by adding a new pool.

use anyhow::{Context, Result};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use std::collections::HashSet;

/// The prompt tables, built into the binary.
const TABLES_JSON: &str = include_str!("../data/prompts.json");

/// Which split a prompt belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    HeldOut,
}

/// Every 5th topic of each list (index 4, 9, ...) is held out.
fn split_of(topic_index: usize) -> Split {
    if topic_index % 5 == 4 {
        Split::HeldOut
    } else {
        Split::Train
    }
}

/// `data/prompts.json`. Templates name their slot in braces (`{task}`, `{lang}`, `{t}`, ...).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Tables {
    pool_1: Pool1,
    pool_2: Pool2,
    pool_3: Pool3,
}

/// The first pool (the shipped head's first training runs).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Pool1 {
    code_tasks: Vec<String>,
    code_langs: Vec<String>,
    code_templates: Vec<String>,
    /// `{a}`, `{b}`, `{c}`, `{sq}`: numbers drawn from the seed; the template index decides the split.
    math_templates: Vec<String>,
    list_things: Vec<String>,
    list_templates: Vec<String>,
    prose_subjects: Vec<String>,
    prose_templates: Vec<String>,
    concepts: Vec<String>,
    concept_templates: Vec<String>,
    email_templates: Vec<String>,
    email_who: Vec<String>,
    email_what: Vec<String>,
    foreign: Vec<Group>,
    translate_langs: Vec<String>,
    sentences: Vec<String>,
}

/// The second pool (the second training run of the shipped head): more topics and templates,
/// some combined with the first pool's lists.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Pool2 {
    code_tasks: Vec<String>,
    code_templates: Vec<String>,
    howto_tasks: Vec<String>,
    howto_templates: Vec<String>,
    list_things: Vec<String>,
    list_templates: Vec<String>,
    prose_subjects: Vec<String>,
    prose_templates: Vec<String>,
    concepts: Vec<String>,
    concept_templates: Vec<String>,
    compare_pairs: Vec<String>,
    compare_templates: Vec<String>,
    foreign: Vec<Group>,
    sentences: Vec<String>,
}

/// The third pool (the fused-feature heads): topics the first two lack (sciences, history,
/// geography, cooking, health, travel, work, money, technology, nature, everyday advice, writing
/// forms, editing, SQL/shell/web code, word problems, more languages).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Pool3 {
    groups: Vec<Group>,
    /// `{a}`, `{b}`, `{c}`: numbers drawn from the seed; the template index decides the split.
    math_templates: Vec<String>,
}

/// Templates with `{t}` x topics.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Group {
    templates: Vec<String>,
    topics: Vec<String>,
}

fn tables() -> Result<Tables> {
    serde_json::from_str(TABLES_JSON).context("the built-in prompt tables (crates/train-head/data/prompts.json) are malformed")
}

/// The items of `list` whose index falls in `split`.
fn of_split(list: &[String], split: Split) -> impl Iterator<Item = (usize, &String)> {
    list.iter().enumerate().filter(move |(i, _)| split_of(*i) == split)
}

/// `template` with `{a}`, `{b}`, `{c}` (and `{sq}` when `sq` is given) replaced.
fn arithmetic(template: &str, a: u32, b: u32, c: u32, sq: Option<u32>) -> String {
    let s = template.replace("{a}", &a.to_string()).replace("{b}", &b.to_string()).replace("{c}", &c.to_string());
    match sq {
        Some(sq) => s.replace("{sq}", &sq.to_string()),
        None => s,
    }
}

const SQUARES: [u32; 12] = [16, 25, 36, 49, 64, 81, 100, 121, 144, 169, 196, 225];

/// Every prompt of `groups` (each topic with each of its group's templates) in `split`.
/// "Translate into {lang}" for each of `split`'s sentences, every language in turn.
fn translations(out: &mut Vec<String>, sentences: &[String], langs: &[String], split: Split) {
    for (_, sentence) in of_split(sentences, split) {
        for lang in langs {
            out.push(format!("Translate into {lang}: \"{sentence}\""));
        }
    }
}

fn groups(out: &mut Vec<String>, groups: &[Group], split: Split) {
    for g in groups {
        for (_, t) in of_split(&g.topics, split) {
            for tmpl in &g.templates {
                out.push(tmpl.replace("{t}", t));
            }
        }
    }
}

/// Every prompt of the first pool in one split, in a fixed order before shuffling.
fn candidates_1(t: &Tables, split: Split, rng: &mut ChaCha8Rng) -> Vec<String> {
    let p = &t.pool_1;
    let mut out = Vec::new();
    for (i, task) in of_split(&p.code_tasks, split) {
        for (j, tmpl) in p.code_templates.iter().enumerate() {
            for lang in p.code_langs.iter().skip((i + j) % 3).step_by(2) {
                out.push(tmpl.replace("{lang}", lang).replace("{task}", task));
            }
        }
    }
    for (_, tmpl) in of_split(&p.math_templates, split) {
        for _ in 0..40 {
            let (a, b) = (rng.gen_range(2..60u32), rng.gen_range(2..40u32));
            let c = rng.gen_range(a + b..400);
            let sq = SQUARES[rng.gen_range(0..12)];
            out.push(arithmetic(tmpl, a, b, c, Some(sq)));
        }
    }
    for (_, thing) in of_split(&p.list_things, split) {
        for tmpl in &p.list_templates {
            for n in [3, 5, 7, 10] {
                out.push(tmpl.replace("{n}", &n.to_string()).replace("{thing}", thing));
            }
        }
    }
    for (_, s) in of_split(&p.prose_subjects, split) {
        for tmpl in &p.prose_templates {
            out.push(tmpl.replace("{s}", s));
        }
    }
    for (_, c) in of_split(&p.concepts, split) {
        for tmpl in &p.concept_templates {
            out.push(tmpl.replace("{c}", c));
        }
    }
    for (i, what) in of_split(&p.email_what, split) {
        for (j, tmpl) in p.email_templates.iter().enumerate() {
            for who in p.email_who.iter().skip((i + j) % 3).step_by(3) {
                out.push(tmpl.replace("{who}", who).replace("{what}", what));
            }
        }
    }
    groups(&mut out, &p.foreign, split);
    translations(&mut out, &p.sentences, &p.translate_langs, split);
    out
}

/// The second pool's prompts of one split (new topics with the first pool's templates and new
/// ones, and the first pool's topics with the new templates).
fn candidates_2(t: &Tables, split: Split, rng: &mut ChaCha8Rng) -> Vec<String> {
    let (p1, p) = (&t.pool_1, &t.pool_2);
    let mut out = Vec::new();
    for (i, task) in of_split(&p.code_tasks, split) {
        for (j, tmpl) in p1.code_templates.iter().chain(&p.code_templates).enumerate() {
            for lang in p1.code_langs.iter().skip((i + j) % 3).step_by(3) {
                out.push(tmpl.replace("{lang}", lang).replace("{task}", task));
            }
        }
    }
    for (i, task) in of_split(&p1.code_tasks, split) {
        for (j, tmpl) in p.code_templates.iter().enumerate() {
            for lang in p1.code_langs.iter().skip((i + j) % 2).step_by(2) {
                out.push(tmpl.replace("{lang}", lang).replace("{task}", task));
            }
        }
    }
    for (_, task) in of_split(&p.howto_tasks, split) {
        for tmpl in &p.howto_templates {
            out.push(tmpl.replace("{t}", task));
        }
    }
    // maths: new numbers for the first pool's templates
    for (_, tmpl) in of_split(&p1.math_templates, split) {
        for _ in 0..15 {
            let (a, b) = (rng.gen_range(2..90u32), rng.gen_range(2..50u32));
            let c = rng.gen_range(a + b..600);
            let sq = SQUARES[rng.gen_range(0..12)];
            out.push(arithmetic(tmpl, a, b, c, Some(sq)));
        }
    }
    for (_, thing) in of_split(&p.list_things, split) {
        for tmpl in p1.list_templates.iter().chain(&p.list_templates) {
            for n in [3, 5, 8] {
                out.push(tmpl.replace("{n}", &n.to_string()).replace("{thing}", thing));
            }
        }
    }
    for (_, thing) in of_split(&p1.list_things, split) {
        for tmpl in &p.list_templates {
            for n in [4, 6] {
                out.push(tmpl.replace("{n}", &n.to_string()).replace("{thing}", thing));
            }
        }
    }
    for (_, s) in of_split(&p.prose_subjects, split) {
        for tmpl in p1.prose_templates.iter().chain(&p.prose_templates) {
            out.push(tmpl.replace("{s}", s));
        }
    }
    for (_, s) in of_split(&p1.prose_subjects, split) {
        for tmpl in &p.prose_templates {
            out.push(tmpl.replace("{s}", s));
        }
    }
    for (_, c) in of_split(&p.concepts, split) {
        for tmpl in p1.concept_templates.iter().chain(&p.concept_templates) {
            out.push(tmpl.replace("{c}", c));
        }
    }
    for (_, c) in of_split(&p1.concepts, split) {
        for tmpl in &p.concept_templates {
            out.push(tmpl.replace("{c}", c));
        }
    }
    for (_, pair) in of_split(&p.compare_pairs, split) {
        for tmpl in &p.compare_templates {
            out.push(tmpl.replace("{p}", pair));
        }
    }
    groups(&mut out, &p.foreign, split);
    translations(&mut out, &p.sentences, &p1.translate_langs, split);
    out
}

/// The third pool's prompts of one split.
fn candidates_3(t: &Tables, split: Split, rng: &mut ChaCha8Rng) -> Vec<String> {
    let p = &t.pool_3;
    let mut out = Vec::new();
    groups(&mut out, &p.groups, split);
    for (_, tmpl) in of_split(&p.math_templates, split) {
        for _ in 0..20 {
            let (a, b) = (rng.gen_range(3..70u32), rng.gen_range(2..30u32));
            let c = rng.gen_range(a + b..900);
            out.push(arithmetic(tmpl, a, b, c, None));
        }
    }
    out
}

/// `n` prompts of `split` (fewer if the split has fewer), deterministic in `seed`. The first
/// pool comes first, shuffled so any prefix mixes every kind of prompt, then the second pool and
/// the third (each shuffled the same way, without prompts an earlier pool already has): a larger
/// `n` only appends prompts, so the shards of a smaller run stay valid.
pub fn prompts(split: Split, n: usize, seed: u64) -> Result<Vec<String>> {
    let t = tables()?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ if split == Split::Train { 0x0074_7261_696E } else { 0x6865_6C64 });
    let mut all = candidates_1(&t, split, &mut rng);
    all.sort();
    all.dedup();
    all.shuffle(&mut rng);
    // later pools, each shuffled with a stream of its own, without prompts already taken
    type Pool = fn(&Tables, Split, &mut ChaCha8Rng) -> Vec<String>;
    let later: [(Pool, u64, u64); 2] = [(candidates_2, 0x0074_7261_6932, 0x6865_6C32), (candidates_3, 0x0074_7261_6933, 0x6865_6C33)];
    for (pool, train_key, held_key) in later {
        if all.len() >= n {
            break;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ if split == Split::Train { train_key } else { held_key });
        let mut more = pool(&t, split, &mut rng);
        more.sort();
        more.dedup();
        let seen: HashSet<&String> = all.iter().collect();
        more.retain(|p| !seen.contains(p));
        more.shuffle(&mut rng);
        all.extend(more);
    }
    all.truncate(n);
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest;

    fn sha256_of_lines(p: &[String]) -> String {
        sha2::Sha256::digest(p.join("\n").as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn splits_are_disjoint_deterministic_and_varied() {
        let train = prompts(Split::Train, usize::MAX, 1).unwrap();
        let held = prompts(Split::HeldOut, usize::MAX, 1).unwrap();
        assert!(train.len() >= 3200, "only {} training prompts", train.len());
        assert!(held.len() >= 300, "only {} held-out prompts", held.len());
        let train_set: HashSet<&String> = train.iter().collect();
        assert_eq!(train_set.len(), train.len(), "duplicate training prompts");
        assert!(held.iter().all(|p| !train_set.contains(p)));
        assert_eq!(prompts(Split::Train, 50, 1).unwrap(), prompts(Split::Train, 50, 1).unwrap());
        assert_ne!(prompts(Split::Train, 50, 1).unwrap(), prompts(Split::Train, 50, 2).unwrap());
        let first = &train[..200];
        assert!(first.iter().any(|p| p.contains("function")) && first.iter().any(|p| p.contains("Explique") || p.contains("Explica") || p.contains("Erkläre")));
    }

    #[test]
    fn a_larger_count_only_appends_prompts() {
        let all = prompts(Split::Train, usize::MAX, 1).unwrap();
        for n in [448, 1000, 1500, 2048, 2500] {
            assert_eq!(prompts(Split::Train, n, 1).unwrap()[..], all[..n]);
        }
    }

    /// The shipped head's data was made from the first 2048 training prompts: a pool added later
    /// must leave them as they are (sha256 of the prompts joined by newlines).
    #[test]
    fn the_first_2048_training_prompts_stay_those_the_shipped_data_used() {
        let p = prompts(Split::Train, 2048, 1).unwrap();
        assert_eq!(sha256_of_lines(&p), "4a4e2a42359cb26c940492b8c6b51c917ede76d9e1a0c36f60e2b8f5b05a912d");
    }

    #[test]
    fn the_shipped_heldout_prompts_are_the_first_64_of_the_heldout_split() {
        // heads/heldout-prompts.txt was written by `specula-train-head data --num-heldout 64 --seed 1`
        // before the second pool existed: the held-out figures must stay comparable
        let file = include_str!("../../../heads/heldout-prompts.txt");
        let shipped: Vec<&str> = file.lines().collect();
        assert_eq!(shipped.len(), 64);
        assert_eq!(prompts(Split::HeldOut, 64, 1).unwrap(), shipped);
    }

    /// Every prompt of both splits (seeds 1 and 7) is the one the tables gave when they were Rust
    /// constants (sha256 of the lists that code produced, before the tables became
    /// `data/prompts.json`): the move changed no prompt, no order and no drawn number. A new pool
    /// appends prompts and changes these (the first 2048 above must not change).
    #[test]
    fn the_data_file_gives_every_prompt_the_rust_tables_gave() {
        for (split, seed, len, hash) in [
            (Split::Train, 1, 3676, "073d2b52ae5009705cfee38b5097d312567926b8dce86404c4e50ddec7091bfa"),
            (Split::HeldOut, 1, 919, "d20a352dc361f1352009d295abb1a5a84ac710734e03e3efe574336ab0ca30c4"),
            (Split::Train, 7, 3673, "98259d179fa0c7220dabd204547ad67cbed5f14168dd59f2fc0c9c71f8f12e66"),
        ] {
            let p = prompts(split, usize::MAX, seed).unwrap();
            assert_eq!((p.len(), sha256_of_lines(&p).as_str()), (len, hash), "{split:?} seed {seed}");
        }
    }

    /// No prompt keeps a slot its template names but the rules did not fill (a typo in the data
    /// file, or a template moved to a list of another slot).
    #[test]
    fn every_template_slot_is_filled() {
        let slots = ["{t}", "{task}", "{lang}", "{a}", "{b}", "{c}", "{sq}", "{n}", "{thing}", "{s}", "{who}", "{what}", "{p}"];
        for split in [Split::Train, Split::HeldOut] {
            for p in prompts(split, usize::MAX, 1).unwrap() {
                assert!(!slots.iter().any(|s| p.contains(s)), "unfilled slot in {p:?}");
            }
        }
    }
}
