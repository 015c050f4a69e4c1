//! Lossless sampling (docs/architecture.md invariant 2), checked statistically through the whole engine:
//! the tokens a speculating engine emits are distributed as plain sampling's, for a draft model
//! (stochastic q) and for n-gram drafts (one-hot q). Each request generates 1 + k + 1 tokens:
//! the first is sampled at prefill (no drafts yet), the next come from one verification of k
//! drafts (accepted prefix, then a resampled or bonus token), so positions 1..=k+1 are compared
//! with a two-sample chi-square test against plain sampling. A deliberately biased acceptance
//! rule (`force_accept`) must fail the same check, which shows the check has power.
//!
//! Tiny random models written by the test (259-token vocabulary), and the default model with the
//! mtp head shipped for it (heads/). Every request is seeded from a fixed list, so the test is
//! deterministic.

mod spec_support;

use spec_support::{spec_config, tiny_model, End, Rig};
use specula_engine::speculative::{SpecConfig, SpecMethod};
use specula_engine::{EngineConfig, FinishReason, SamplingParams};
use specula_model::testing::{model_for_tests, write_tiny_llama, TinySpec, TINY_VOCAB};
use specula_model::{load_model, ChatMessage};
use std::path::{Path, PathBuf};

/// Draft tokens per step.
const K: usize = 2;
/// 1 prefill token + one verification step of K drafts and the bonus/resampled token.
const MAX_TOKENS: usize = 1 + K + 1;
/// Requests in flight at once.
const BATCH: usize = 250;

fn config() -> EngineConfig {
    EngineConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 4096,
        max_model_len: 512,
        block_size: 16,
        num_kv_blocks: 1024,
        enable_prefix_caching: true,
        threads: 1,
        ..Default::default()
    }
}

/// The default model is ~500x the tiny one's compute: both cores.
fn default_model_config() -> EngineConfig {
    EngineConfig { threads: 2, ..config() }
}

/// Every token once (control tokens too), in a scrambled order: whatever token the target samples
/// first, the n-gram proposer (1-grams allowed) finds it in the prompt and drafts what followed
/// it, which the random target rarely agrees with: this mostly checks rejection and the residual.
fn all_tokens_prompt() -> Vec<u32> {
    let v = TINY_VOCAB as u32; // 259 = 7 * 37, coprime with 97: a permutation
    (0..v).map(|i| (i * 97 + 13) % v).collect()
}

/// The target's own greedy continuation of one token, 200 tokens long: this target (seed 61)
/// falls into repeating one token, and at temperature 0.7 keeps repeating it often enough that
/// most n-gram drafts are accepted, so this checks the acceptance branch.
fn self_repeating_prompt(target: &Path) -> Vec<u32> {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(200) };
    let mut prompt = vec![7];
    prompt.extend(Rig::new(target, config(), None).run_batch(&[(prompt.clone(), params)]).remove(0).tokens);
    prompt
}

/// One sample: `n` requests for `prompt` at `temperature`, seeded `first_seed..`, on an engine
/// speculating with `spec` (or not).
struct Arm<'a> {
    /// Target vocabulary size (histogram bins).
    vocab: usize,
    engine: EngineConfig,
    n: u64,
    prompt: &'a [u32],
    temperature: f32,
    spec: Option<SpecConfig>,
    first_seed: u64,
}

/// Token histograms of an arm, one per output position.
fn histograms(target: &Path, arm: Arm) -> Vec<Vec<u64>> {
    // the draft model and the mtp head always propose; so does the n-gram on the all-tokens prompt
    let always_drafts = arm.spec.as_ref().is_some_and(|s| matches!(s.method, SpecMethod::Draft | SpecMethod::Mtp)) || arm.prompt.len() == TINY_VOCAB;
    let mut rig = Rig::new(target, arm.engine.clone(), arm.spec);
    let mut hist = vec![vec![0u64; arm.vocab]; MAX_TOKENS];
    let n = arm.n;
    let seeds: Vec<u64> = (arm.first_seed..arm.first_seed + n).collect();
    for chunk in seeds.chunks(BATCH) {
        let reqs: Vec<(Vec<u32>, SamplingParams)> = chunk
            .iter()
            .map(|&seed| {
                let params = SamplingParams { temperature: arm.temperature, seed: Some(seed), max_tokens: MAX_TOKENS, ignore_eos: true, ..Default::default() };
                (arm.prompt.to_vec(), params)
            })
            .collect();
        for o in rig.run_batch(&reqs) {
            assert_eq!(o.end, End::Finished(FinishReason::Length));
            assert_eq!(o.tokens.len(), MAX_TOKENS);
            for (pos, &t) in o.tokens.iter().enumerate() {
                hist[pos][t as usize] += 1;
            }
        }
    }
    rig.assert_no_leaks();
    if let Some(m) = rig.engine.spec_metrics() {
        eprintln!("{m:?} acceptance rate {:?}", m.acceptance_rate());
        // every request verified at least one draft right after its prefill (the draft model
        // always proposes, and the all-tokens prompt holds every token the n-gram looks up)
        assert!(!always_drafts || m.num_drafts >= n, "{m:?}");
        assert!(m.num_drafts > n / 2, "too few requests were speculated on: {m:?}");
    }
    hist
}

/// Two-sample chi-square test of homogeneity for equal sample sizes:
/// X^2 = sum_i (a_i - b_i)^2 / (a_i + b_i), with bins whose expected count per sample is below 5
/// (a_i + b_i < 10) pooled into one. Returns (X^2, degrees of freedom).
fn chi_square(a: &[u64], b: &[u64]) -> (f64, usize) {
    assert_eq!(a.iter().sum::<u64>(), b.iter().sum::<u64>());
    let mut bins: Vec<(u64, u64)> = Vec::new();
    let (mut ra, mut rb) = (0, 0);
    for (&x, &y) in a.iter().zip(b) {
        if x + y >= 10 {
            bins.push((x, y));
        } else {
            ra += x;
            rb += y;
        }
    }
    if ra + rb > 0 {
        bins.push((ra, rb));
    }
    let x2 = bins.iter().map(|&(x, y)| (x as f64 - y as f64).powi(2) / (x + y) as f64).sum();
    (x2, bins.len() - 1)
}

/// Upper 0.001 quantile of chi-square with `df` degrees of freedom, by the Wilson-Hilferty
/// approximation (within 1% of the exact value for df >= 10, which every check here has).
/// p = 0.001 per check: with 3 checked positions per arm a correct sampler fails an arm for an
/// unlucky seed list at most 0.3% of the time, while a biased one fails by orders of magnitude
/// (the force-accept controls exceed it many times over); the fixed seeds make it repeatable.
fn critical_value_p001(df: usize) -> f64 {
    let z = 3.090_232; // standard normal upper 0.001 quantile
    let d = df as f64;
    let c = 2.0 / (9.0 * d);
    d * (1.0 - c + z * c.sqrt()).powi(3)
}

/// For each speculated position (1..MAX_TOKENS: position 0 is sampled at prefill, without
/// drafts): (position, X^2, critical value).
fn compare(plain: &[Vec<u64>], spec: &[Vec<u64>]) -> Vec<(usize, f64, f64)> {
    (1..MAX_TOKENS)
        .map(|pos| {
            let (x2, df) = chi_square(&plain[pos], &spec[pos]);
            eprintln!("position {pos}: chi-square {x2:.1}, {df} degrees of freedom");
            (pos, x2, critical_value_p001(df))
        })
        .collect()
}

fn models() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_model(dir.path(), 61);
    // The draft is the target cut after its first layer: the same seed draws the same embedding
    // and layer-0 weights, then a final norm of its own. Related but different distributions
    // (about 44% of draft tokens accepted), as with a real small draft model.
    let draft = dir.path().join("draft.gguf");
    write_tiny_llama(&draft, &TinySpec { seed: 61, layers: 1, ..Default::default() }).expect("write draft model");
    (dir, target, draft)
}

fn assert_lossless(name: &str, results: &[(usize, f64, f64)]) {
    eprintln!("{name}: {results:?}");
    for &(pos, x2, crit) in results {
        assert!(x2 < crit, "{name}: position {pos}: chi-square {x2:.1} exceeds the p=0.001 critical value {crit:.1}");
    }
}

fn assert_biased(name: &str, results: &[(usize, f64, f64)]) {
    eprintln!("{name}: {results:?}");
    // the first drafted position is the draft's (or the n-gram's) choice, not the target's
    let (pos, x2, crit) = results[0];
    assert!(x2 > crit, "{name}: position {pos}: chi-square {x2:.1} below the critical value {crit:.1}: the check cannot see a biased sampler");
}

/// Every arm uses its own seeds, so the two samples of each test are independent.
#[test]
fn draft_model_speculation_samples_the_target_distribution() {
    let (_dir, target, draft) = models();
    let prompt: Vec<u32> = (100..116).collect();
    // 10 000 requests per arm: enough to see a sampler that, on rejection, draws from p instead
    // of the residual max(0, p - q) (chi-square about 440 against a critical value of 334 at
    // position 1, measured); 3 000 are not.
    let arm =
        |spec: Option<SpecConfig>, first_seed| Arm { vocab: TINY_VOCAB, engine: config(), n: 10_000, prompt: &prompt, temperature: 1.0, spec, first_seed };
    let plain = histograms(&target, arm(None, 0));
    let spec = spec_config(SpecMethod::Draft, K, Some(&draft));
    let lossless = histograms(&target, arm(Some(spec.clone()), 1_000_000));
    assert_lossless("draft", &compare(&plain, &lossless));
    let forced = histograms(&target, arm(Some(SpecConfig { force_accept: true, ..spec }), 2_000_000));
    assert_biased("draft, force_accept", &compare(&plain, &forced));
}

#[test]
fn ngram_speculation_samples_the_target_distribution() {
    let (_dir, target, _) = models();
    let spec = SpecConfig { ngram_min: 1, ..spec_config(SpecMethod::Ngram, K, None) };
    let bytes = all_tokens_prompt();
    let arm = |spec: Option<SpecConfig>, first_seed| Arm { vocab: TINY_VOCAB, engine: config(), n: 3000, prompt: &bytes, temperature: 1.0, spec, first_seed };
    let plain = histograms(&target, arm(None, 0));
    let lossless = histograms(&target, arm(Some(spec.clone()), 3_000_000));
    assert_lossless("ngram, all-tokens prompt", &compare(&plain, &lossless));
    let forced = histograms(&target, arm(Some(SpecConfig { force_accept: true, ..spec.clone() }), 4_000_000));
    assert_biased("ngram, all-tokens prompt, force_accept", &compare(&plain, &forced));

    let run = self_repeating_prompt(&target);
    // here the same mistake (drawing from p, x not removed, on rejection) is plain to see with
    // 3 000 requests: chi-square about 167 against 82 at position 1, measured
    let arm = |spec: Option<SpecConfig>, first_seed| Arm { vocab: TINY_VOCAB, engine: config(), n: 3000, prompt: &run, temperature: 0.7, spec, first_seed };
    let plain = histograms(&target, arm(None, 5_000_000));
    let lossless = histograms(&target, arm(Some(spec), 6_000_000));
    assert_lossless("ngram, self-repeating prompt", &compare(&plain, &lossless));
}

/// The head shipped for the default model (heads/README.md), trained on its own answers: its q is
/// close to the target's p, so most drafts are accepted and this checks the acceptance branch
/// with a real, stochastic q over a pruned vocabulary (tokens outside it only ever come from the
/// residual). Forcing acceptance must show up: the head's q is not the target's p.
#[test]
fn mtp_speculation_with_the_shipped_head_samples_the_target_distribution() {
    let Some(model) = model_for_tests("spec_statistics (shipped mtp head)") else { return };
    let head = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../heads/smollm2-135m-instruct-q4_1.mtp.safetensors");
    let loaded = load_model(&model).expect("load default model");
    let template = loaded.chat_template.expect("the default model ships a chat template");
    let msgs = [ChatMessage { role: "user".into(), content: "Write a short poem about the sea.".into() }];
    let prompt = loaded.tokenizer.encode(&template.render(&msgs, true).expect("render chat")).expect("encode");
    let vocab = loaded.model.config.vocab_size;
    let spec = spec_config(SpecMethod::Mtp, K, Some(&head));
    // 600 requests per arm (the default model is costly): measured chi-square 10.9 against a
    // critical value of 31.4 at position 1 for the real sampler, 288 against 39 with force-accept
    let arm = |spec: Option<SpecConfig>, first_seed| Arm { vocab, engine: default_model_config(), n: 600, prompt: &prompt, temperature: 1.0, spec, first_seed };
    let plain = histograms(&model, arm(None, 7_000_000));
    let lossless = histograms(&model, arm(Some(spec.clone()), 8_000_000));
    assert_lossless("mtp (shipped head)", &compare(&plain, &lossless));
    let forced = histograms(&model, arm(Some(SpecConfig { force_accept: true, ..spec }), 9_000_000));
    assert_biased("mtp (shipped head), force_accept", &compare(&plain, &forced));
}
