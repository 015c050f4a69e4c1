//! Speculative decoding settings, validated once at start-up.

use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup over the sequence's own tokens.
    Ngram,
    /// A smaller model with the same vocabulary.
    Draft,
    /// A one-layer EAGLE/MTP-style head on the target's hidden state.
    Mtp,
}

impl SpecMethod {
    pub const ALL: [SpecMethod; 3] = [SpecMethod::Ngram, SpecMethod::Draft, SpecMethod::Mtp];

    /// The name `--speculative-method` spells it with.
    pub fn name(self) -> &'static str {
        match self {
            SpecMethod::Ngram => "ngram",
            SpecMethod::Draft => "draft",
            SpecMethod::Mtp => "mtp",
        }
    }
}

impl std::str::FromStr for SpecMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| format!("unknown speculative method '{s}' (expected ngram, draft or mtp)"))
    }
}

/// `--speculative-method`: one method, or the n-gram method beside a model (`ngram,draft`,
/// `ngram,mtp`; [`super::combined`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MethodChoice {
    pub method: SpecMethod,
    /// The n-gram method drafts too, where it is expected to keep more (`method` is a model).
    pub with_ngram: bool,
}

impl std::fmt::Display for MethodChoice {
    /// As `--speculative-method` spells it (`ngram,draft` for the n-gram method beside a model).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.with_ngram {
            f.write_str("ngram,")?;
        }
        f.write_str(self.method.name())
    }
}

impl std::str::FromStr for MethodChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut methods: Vec<SpecMethod> = s.split(',').map(|m| m.trim().parse()).collect::<Result<_, _>>()?;
        methods.sort_by_key(|m| *m != SpecMethod::Ngram);
        methods.dedup();
        match methods[..] {
            [method] => Ok(Self { method, with_ngram: false }),
            [SpecMethod::Ngram, method] => Ok(Self { method, with_ngram: true }),
            _ => Err(format!("'{s}' combines two models; combine ngram with one of draft or mtp (ngram,draft or ngram,mtp)")),
        }
    }
}

/// How a draft model's projections are held in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftWeights {
    /// Re-encoded as Q4_0 at load where stored with more bits per weight (`LlamaModel::
    /// requantize_q4_0`). A draft token costs the bytes the draft reads, and the drafts barely
    /// change: Qwen2.5-Coder-0.5B's Q4_K_M file (Q5_0 / Q8_0 / Q6_K for most matrices) drafting
    /// for the 1.5B on the code edits at c1 (scripts/bench_spec_real.sh, two interleaved pairs,
    /// 2-core Zen 4) gave 34.1 and 33.5 tok/s against 31.8 and 30.9 as stored, acceptance 0.94
    /// and 0.92 against 0.93 and 0.93. Verification keeps the output exact either way.
    Q4_0,
    /// As the file stores them.
    Stored,
}

impl std::str::FromStr for DraftWeights {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "q4_0" => Ok(Self::Q4_0),
            "stored" => Ok(Self::Stored),
            other => Err(format!("unknown draft weights '{other}' (expected q4_0 or stored)")),
        }
    }
}

#[derive(Clone, Debug)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// Most draft tokens proposed per sequence per step.
    pub num_speculative_tokens: usize,
    /// Shortest earlier match of the text's suffix the ngram method drafts from.
    pub ngram_min: usize,
    /// With a model `method`: the n-gram method drafts beside it, per sequence where its match is
    /// expected to keep more ([`super::combined`]).
    pub with_ngram: bool,
    /// Tokens of finished outputs the ngram method's cross-request index keeps
    /// ([`super::corpus`]); 0: none.
    pub corpus_tokens: usize,
    /// Draft model (GGUF or folder) for `draft`, head file for `mtp`.
    pub draft_model: Option<PathBuf>,
    /// For `draft` and a file's own prediction layer (`mtp` without a head file): the draft
    /// proposes only the first n token ids (and end-of-sequence tokens), computing only those
    /// rows of its output projection; 0: the whole vocabulary. None: [`DEFAULT_DRAFT_VOCAB`] for
    /// vocabularies of more than twice that, else the whole one ([`draft_vocab_size`]).
    pub draft_vocab: Option<usize>,
    /// The target's end-of-sequence tokens: a restricted draft vocabulary of the target's own
    /// prediction layer keeps them (a draft model keeps its own tokenizer's).
    pub end_tokens: Vec<crate::types::TokenId>,
    /// For `draft`: the draft model's projections as stored or re-encoded smaller.
    pub draft_weights: DraftWeights,
    /// Accept every draft token (upper-bound benchmarks only: CHANGES THE OUTPUT).
    pub force_accept: bool,
    /// Let the engine shrink k (or skip speculation) when the batch is large or acceptance low.
    pub adaptive: bool,
    /// With `adaptive`, no speculation when more sequences than this decode in a step.
    pub max_batch_for_speculation: usize,
    /// With `adaptive`, at most this many tokens (drafts and the token after them) verified per
    /// step: k shrinks as the batch grows.
    pub max_step_tokens_for_speculation: usize,
    /// With `adaptive`, an mtp head's greedy draft ends at the first token the head itself gives
    /// less than this probability (softmax at temperature 1; 0 = never). Default
    /// [`DEFAULT_MTP_MIN_CONFIDENCE`].
    pub mtp_min_confidence: f32,
    /// With `adaptive`, the cost of verifying one more token relative to a one-token step
    /// (`adaptive::VERIFY_COST_PER_TOKEN` by default). None: measure the verify curve of the
    /// loaded target at start-up (`cost::CostModel`), and the draft model's token too.
    pub verify_cost_per_token: Option<f64>,
    /// With `adaptive`, one draft token's work relative to a one-token target step. None: the
    /// proposer's figure (measured for a draft model when the verify curve is measured, else its
    /// estimate from the models' shapes; 0 for n-gram).
    pub draft_cost: Option<f64>,
}

/// The mtp confidence gate's default. The shipped head is about calibrated on the held-out chat
/// prompts (a first draft it gives 0.5-0.65 is accepted 43% of the time, 0.65-0.8 56%, 0.8-0.9 74%,
/// above 0.9 95%, measured with head 6). With head 13, three paired benchmarks at concurrency 1,
/// k = 3 (32, 64 and 64 held-out requests, heads/README.md) gave against no speculation 1.038,
/// 1.040 and 1.032 for gate 0.5 (1.87 tokens per verify step, drafts at 29% of the steps) and
/// 1.007, 1.025 and 1.010 for 0.65 (1.99, 25%); 0.55 1.034, 0.4 1.027 (1.80).
pub const DEFAULT_MTP_MIN_CONFIDENCE: f32 = 0.5;

/// The draft vocabulary a large-vocabulary draft model is restricted to by default. Measured
/// (scripts/bench_spec_real.sh, Qwen2.5-Coder-1.5B verifying, 0.5B drafting, a code edit, c1,
/// 2-core Zen 4): the whole 151 936 tokens 23.2 tok/s (acceptance 1.00, 1.04x plain decoding),
/// 32 768 tokens 29.9 tok/s (acceptance 0.89, 1.34x); the first 32 768 ids cover 96.6% of the
/// code-edit prompts' tokens.
pub const DEFAULT_DRAFT_VOCAB: usize = 32_768;

/// The draft vocabulary `asked` (`SpecConfig::draft_vocab`) gives over a vocabulary of `vocab`.
pub fn draft_vocab_size(asked: Option<usize>, vocab: usize) -> usize {
    match asked {
        Some(0) => vocab,
        Some(n) => n.min(vocab),
        None if vocab > 2 * DEFAULT_DRAFT_VOCAB => DEFAULT_DRAFT_VOCAB,
        None => vocab,
    }
}

/// The first `n` ids of a vocabulary of `vocab` and the ids of `always` beyond them, increasing.
pub fn first_ids_and(n: usize, always: &[crate::types::TokenId], vocab: usize) -> Vec<crate::types::TokenId> {
    let n = n.min(vocab);
    let mut keep: Vec<crate::types::TokenId> = (0..n as crate::types::TokenId).collect();
    keep.extend(always.iter().copied().filter(|&t| t as usize >= n && (t as usize) < vocab));
    keep.sort_unstable();
    keep.dedup();
    keep
}

/// The cross-request index's default budget: 65 536 tokens (about 10 MB), some hundreds of
/// recent answers.
pub const DEFAULT_CORPUS_TOKENS: usize = 1 << 16;

/// Largest k accepted: verification cost grows with k and acceptance decays geometrically.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

impl SpecConfig {
    pub fn new(method: SpecMethod, k: usize) -> Self {
        Self {
            method,
            num_speculative_tokens: k,
            ngram_min: 1,
            with_ngram: false,
            corpus_tokens: DEFAULT_CORPUS_TOKENS,
            draft_model: None,
            draft_vocab: None,
            end_tokens: Vec::new(),
            draft_weights: DraftWeights::Q4_0,
            force_accept: false,
            adaptive: true,
            max_batch_for_speculation: 8,
            max_step_tokens_for_speculation: 8,
            mtp_min_confidence: DEFAULT_MTP_MIN_CONFIDENCE,
            verify_cost_per_token: Some(super::adaptive::VERIFY_COST_PER_TOKEN),
            draft_cost: None,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let k = self.num_speculative_tokens;
        if k == 0 || k > MAX_SPECULATIVE_TOKENS {
            return Err(format!("--num-speculative-tokens must be in 1..={MAX_SPECULATIVE_TOKENS}, got {k}"));
        }
        if self.ngram_min == 0 {
            return Err("--ngram-min must be at least 1".into());
        }
        if self.method == SpecMethod::Draft && self.draft_model.is_none() {
            return Err("--speculative-method draft needs --draft-model PATH".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_method_or_ngram_beside_a_model() {
        let parse = |s: &str| s.parse::<MethodChoice>();
        assert_eq!(parse("draft"), Ok(MethodChoice { method: SpecMethod::Draft, with_ngram: false }));
        assert_eq!(parse("ngram"), Ok(MethodChoice { method: SpecMethod::Ngram, with_ngram: false }));
        for s in ["ngram,draft", "draft,ngram", " ngram , draft "] {
            assert_eq!(parse(s), Ok(MethodChoice { method: SpecMethod::Draft, with_ngram: true }), "{s}");
        }
        assert_eq!(parse("ngram,mtp"), Ok(MethodChoice { method: SpecMethod::Mtp, with_ngram: true }));
        assert_eq!(parse("ngram,ngram"), Ok(MethodChoice { method: SpecMethod::Ngram, with_ngram: false }));
        assert!(parse("draft,mtp").unwrap_err().contains("combine ngram"));
        assert!(parse("ngram,eagle").unwrap_err().contains("unknown speculative method 'eagle'"));
    }
}
