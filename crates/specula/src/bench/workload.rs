//! What a benchmark sends and when: random word prompts of a chosen length or the lines of a JSONL
//! file, and the times at which requests arrive (all at once, or a Poisson process).
//!
//! A file line is a prompt (`{"prompt": "...", "max_tokens": N}`) or a chat turn of a
//! conversation (`{"messages": [...], "max_tokens": N, "conversation": "c1", "kind": "edit"}`):
//! consecutive lines of one conversation are its turns, each line's messages the conversation up
//! to the turn the server writes (an agent trace: the earlier answers and tool results as they
//! were recorded, so every server answers the same prompts). `kind` names the turn for the
//! per-kind table.
//!
//! Random prompts are drawn from a list of common English words. Each word, with its leading space,
//! is a single token in the BPE vocabularies we meet (GPT-2, Llama, SmolLM, Qwen), so a prompt of
//! N words is about N tokens; the server's `usage.prompt_tokens` gives the exact count in results.

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// One request's worth of work.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// The prompt (a chat endpoint sends it as one user message), or the first message's text for
    /// a chat turn (`messages`).
    pub text: String,
    /// A chat turn's messages, sent as they are.
    pub messages: Option<serde_json::Value>,
    /// The conversation it is a turn of: its turns go one after another, the next sent when the
    /// previous one has finished (a conversation holds one concurrency slot throughout).
    pub conversation: Option<String>,
    /// What kind of turn it is (a file's `kind`), for the per-kind table.
    pub kind: Option<String>,
    /// Sent as `max_tokens`.
    pub max_tokens: usize,
    /// Word count: the input-token estimate used when a server reports no `usage`.
    pub approx_tokens: usize,
}

/// Common English words, each one token (with its leading space) in GPT-2/Llama-style vocabularies.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "that", "on", "with", "as", "by", "at", "from", "his", "her", "they", "this", "which", "be", "are",
    "have", "had", "not", "but", "or", "an", "were", "all", "their", "she", "he", "one", "you", "it", "we", "can", "more", "has", "been", "would", "will",
    "there", "so", "if", "no", "what", "when", "who", "them", "other", "its", "into", "about", "than", "some", "could", "then", "only", "out", "also", "time",
    "up", "new", "like", "may", "these", "two", "first", "any", "people", "over", "such", "after", "most", "very", "made", "many", "where", "our", "use",
    "just", "even", "much", "way", "state", "each", "well", "did", "your", "how", "between", "year", "because", "both", "those", "through", "during", "world",
    "own", "life", "same", "work", "still", "being", "here", "while", "before", "last", "make", "under", "three", "again", "never", "might", "home", "part",
    "since", "against", "off", "day", "great", "back", "place", "long", "show", "good", "end", "city", "old", "small", "high", "large", "water", "school",
    "house", "family", "group", "number", "game", "name", "book", "line", "found", "called", "known", "used", "become", "left", "right", "down", "around",
    "came", "went", "take", "took", "give", "gave", "find", "think", "know", "see", "look", "come", "want", "need", "read", "write", "open", "run", "play",
    "move", "live", "turn", "start", "keep", "hand", "head", "eye", "face", "room", "road", "car", "war", "music", "art", "film", "team", "light", "night",
    "power", "money", "story", "heart", "mind", "body", "land", "sea", "river", "tree", "fire", "food", "king", "law", "court", "market", "field", "system",
    "order", "form", "point", "level", "area", "side", "kind", "best", "real", "free", "full", "young", "black", "white", "red", "green", "blue", "early",
    "late", "next", "few", "every", "another", "without", "along", "often", "always", "together", "himself",
];

/// `n` prompts of about `input_len` words asking for `output_len` tokens each; with `range_ratio`
/// r > 0 each length is drawn uniformly from [len * (1 - r), len * (1 + r)] as vLLM's random dataset
/// does. The same seed gives the same prompts.
pub fn random_prompts(n: usize, input_len: usize, output_len: usize, range_ratio: f64, seed: u64) -> Vec<Prompt> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let words = jitter(&mut rng, input_len, range_ratio);
            let max_tokens = jitter(&mut rng, output_len, range_ratio);
            let text: Vec<&str> = (0..words).map(|_| *WORDS.choose(&mut rng).expect("word list is not empty")).collect();
            Prompt { text: text.join(" "), max_tokens, approx_tokens: words, messages: None, conversation: None, kind: None }
        })
        .collect()
}

fn jitter(rng: &mut StdRng, len: usize, ratio: f64) -> usize {
    let lo = ((len as f64) * (1.0 - ratio)).floor().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + ratio)).ceil().max(lo as f64) as usize;
    rng.gen_range(lo..=hi)
}

/// `n` prompts from a JSONL file of `{"prompt": "...", "max_tokens": 64}` lines (`max_tokens`
/// optional, `default_max_tokens` otherwise; blank lines skipped). Takes the first `n` lines, and
/// goes round the file again when it has fewer.
pub fn file_prompts(path: &Path, n: usize, default_max_tokens: usize) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read --dataset-path {}", path.display()))?;
    parse_prompts(&text, &path.display().to_string(), n, default_max_tokens)
}

/// [`file_prompts`] on text already read; `source` names it in errors.
pub fn parse_prompts(text: &str, source: &str, n: usize, default_max_tokens: usize) -> Result<Vec<Prompt>> {
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{source}:{}", i + 1);
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{}: not a JSON object", at()))?;
        let messages = v.get("messages").filter(|m| m.as_array().is_some_and(|a| !a.is_empty())).cloned();
        let prompt = match (&messages, v.get("prompt").and_then(|p| p.as_str())) {
            (Some(m), _) => m.as_array().into_iter().flatten().filter_map(|m| m.get("content")?.as_str()).collect::<Vec<_>>().join("\n"),
            (None, Some(p)) => p.to_string(),
            (None, None) => {
                bail!("{}: expected {{\"prompt\": \"...\", \"max_tokens\": N}} or {{\"messages\": [...], ...}} (max_tokens optional), found {line:.80}", at())
            }
        };
        let label = |key: &str| v.get(key).and_then(|c| c.as_str()).map(str::to_string);
        let max_tokens = match v.get("max_tokens") {
            None | Some(serde_json::Value::Null) => default_max_tokens,
            Some(m) => m.as_u64().filter(|&m| m > 0).with_context(|| format!("{}: max_tokens must be a positive integer", at()))? as usize,
        };
        let approx_tokens = prompt.split_whitespace().count();
        lines.push(Prompt { text: prompt, max_tokens, approx_tokens, messages, conversation: label("conversation"), kind: label("kind") });
    }
    if lines.is_empty() {
        bail!("--dataset-path {source} has no prompts");
    }
    Ok(lines.iter().cycle().take(n).cloned().collect())
}

/// The prompts' indices grouped into what runs one after another: each conversation's consecutive
/// turns in order, every other prompt alone.
pub fn sequences(prompts: &[Prompt]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        match (&p.conversation, out.last_mut()) {
            (Some(c), Some(last)) if prompts[last[0]].conversation.as_ref() == Some(c) => last.push(i),
            _ => out.push(vec![i]),
        }
    }
    out
}

/// Send times, in seconds from the start, of `n` requests arriving as a Poisson process of `rate`
/// requests/s (exponential gaps; the first at 0), or all at 0 when `rate` is `None`.
pub fn arrival_times(n: usize, rate: Option<f64>, seed: u64) -> Vec<f64> {
    let Some(rate) = rate else { return vec![0.0; n] };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                let u: f64 = rng.gen();
                t += -(1.0 - u).ln() / rate;
            }
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn random_prompts_have_the_asked_word_count_and_repeat_with_the_seed() {
        let a = random_prompts(3, 50, 16, 0.0, 7);
        assert_eq!(a.len(), 3);
        for p in &a {
            assert_eq!(p.text.split(' ').count(), 50);
            assert_eq!(p.approx_tokens, 50);
            assert_eq!(p.max_tokens, 16);
        }
        assert_eq!(a, random_prompts(3, 50, 16, 0.0, 7));
        assert_ne!(a, random_prompts(3, 50, 16, 0.0, 8));
        assert_ne!(a[0].text, a[1].text);
    }

    #[test]
    fn chat_turns_of_a_conversation_run_in_sequence() {
        let text = r#"{"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "a b"}], "max_tokens": 8, "conversation": "c1", "kind": "tool"}
{"messages": [{"role": "user", "content": "x"}], "conversation": "c1", "kind": "edit"}
{"prompt": "alone"}
{"messages": [{"role": "user", "content": "y"}], "conversation": "c2"}
{"messages": [{"role": "user", "content": "z"}], "conversation": "c1"}"#;
        let p = parse_prompts(text, "t", 5, 16).unwrap();
        assert_eq!(p[0].messages.as_ref().unwrap()[1]["content"], "a b");
        assert_eq!((p[0].text.as_str(), p[0].approx_tokens, p[0].max_tokens), ("sys\na b", 3, 8));
        assert_eq!((p[1].kind.as_deref(), p[1].conversation.as_deref(), p[1].max_tokens), (Some("edit"), Some("c1"), 16));
        assert_eq!((p[2].messages.as_ref(), p[2].conversation.as_ref()), (None, None));
        // consecutive turns of one conversation run one after another; a conversation that
        // comes back later is a sequence of its own
        assert_eq!(sequences(&p), vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        assert!(parse_prompts(r#"{"messages": []}"#, "t", 1, 16).is_err());
    }

    #[test]
    fn range_ratio_keeps_lengths_within_bounds() {
        for p in random_prompts(200, 100, 10, 0.5, 1) {
            assert!((50..=150).contains(&p.approx_tokens), "{}", p.approx_tokens);
            assert!((5..=15).contains(&p.max_tokens), "{}", p.max_tokens);
        }
    }

    #[test]
    fn file_prompts_read_jsonl_cycle_and_default_max_tokens() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "{{\"prompt\": \"copy this passage\", \"max_tokens\": 5}}\n\n{{\"prompt\": \"hello\"}}").unwrap();
        let p = file_prompts(f.path(), 3, 9).unwrap();
        assert_eq!(
            p.iter().map(|p| (p.text.as_str(), p.max_tokens)).collect::<Vec<_>>(),
            vec![("copy this passage", 5), ("hello", 9), ("copy this passage", 5)]
        );
        assert_eq!(p[0].approx_tokens, 3);
    }

    #[test]
    fn file_prompt_errors_name_the_line() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "{{\"prompt\": \"ok\"}}\n{{\"text\": \"wrong key\"}}").unwrap();
        let e = file_prompts(f.path(), 1, 9).unwrap_err().to_string();
        assert!(e.contains(":2: expected"), "{e}");
    }

    #[test]
    fn poisson_arrivals_start_at_zero_rise_and_average_one_over_rate() {
        assert_eq!(arrival_times(3, None, 0), vec![0.0, 0.0, 0.0]);
        let t = arrival_times(20_001, Some(4.0), 3);
        assert_eq!(t[0], 0.0);
        assert!(t.windows(2).all(|w| w[1] >= w[0]));
        let mean_gap = t[20_000] / 20_000.0;
        assert!((mean_gap - 0.25).abs() < 0.01, "mean gap {mean_gap}");
        assert_eq!(t, arrival_times(20_001, Some(4.0), 3));
    }
}
