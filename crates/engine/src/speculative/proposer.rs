//! The one interface every proposer implements, so the engine does not care which it runs.

use super::SpecError;
use crate::api::SamplingParams;
pub use crate::types::Draft;
use crate::types::{SeqId, Tenant, TokenId};

/// What a proposer keeps of one sequence between its calls, held in the sequence's compute-side
/// record (`crate::record::SeqRecord::spec`) and lent to the proposer with each request: it goes
/// when the sequence does, and a proposer keeps no map of its own for it. (What a proposer keeps
/// of a sequence as a cache, which other sequences read or which holds memory of its own, stays
/// the proposer's, keyed by the sequence's id and released by [`Proposer::remove`]: the n-gram
/// index other sequences' lookups read, a draft model's KV blocks, an mtp head's context rows.)
#[derive(Clone, Debug, Default)]
pub struct SeqDrafting {
    /// The proposer's own random stream for the sequence (a draft model or mtp head sampling a
    /// draft it proposes with its distribution), created at its first such draw.
    pub rng: Option<crate::sampling::SeqRng>,
    /// A combined proposer ([`super::combined`]): whether the next draft is the n-gram's (else
    /// the model's), as adaptive k chose this step.
    pub ngram_next: bool,
    /// The n-gram proposer's support lookup of this step with the start of its draft
    /// ([`super::ngram::Memo`]): the draft asked next is cut from it.
    pub ngram_memo: Option<super::ngram::Memo>,
}

/// One sequence asking for drafts this step.
pub struct DraftRequest<'a> {
    pub seq: SeqId,
    /// The sequence's known tokens (prompt + accepted output); the draft continues them.
    pub tokens: &'a [TokenId],
    pub prompt_len: usize,
    /// Most tokens to propose (0 = none this step).
    pub max_draft: usize,
    pub params: &'a SamplingParams,
    /// When the proposer needs them (mtp): the target's hidden states of the rows that emitted
    /// this step's tokens, in order, each row the states after every layer of
    /// [`Proposer::hidden_layers`] back to back (`rows * layers * H` values; the last row emitted
    /// the last known token). Requests with `max_draft == 0` still carry them, so a proposer that
    /// keeps per-sequence state sees every row.
    pub hidden: Option<&'a [f32]>,
    /// The sequence's random stream, when the engine drafts for it: a proposer that samples its
    /// token for position `pos` with `rng.uniform_at(pos, false)` (the draw the target samples
    /// that position with) and proposes it one-hot keeps seeded outputs those of plain decoding.
    pub rng: Option<&'a crate::sampling::SeqRng>,
    /// What the proposer keeps of the sequence (in its record).
    pub drafting: &'a mut SeqDrafting,
}

impl DraftRequest<'_> {
    /// The same request, its drafting state reborrowed (to pass on to another proposer).
    pub fn reborrow(&mut self) -> DraftRequest<'_> {
        DraftRequest {
            seq: self.seq,
            tokens: self.tokens,
            prompt_len: self.prompt_len,
            max_draft: self.max_draft,
            params: self.params,
            hidden: self.hidden,
            rng: self.rng,
            drafting: self.drafting,
        }
    }
}

/// How far a draft is backed ([`Proposer::support`]): the length of the match it continues, and
/// whether the match is in the sequence's own text or in the outputs of earlier requests
/// ([`super::corpus`]), which keep their own acceptance estimates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Support {
    pub len: usize,
    pub from_corpus: bool,
}

impl Support {
    /// A match of `len` tokens in the sequence's own text.
    pub fn own(len: usize) -> Self {
        Self { len, from_corpus: false }
    }

    /// Its acceptance band: [`super::adaptive::support_band`] of the length, the corpus's bands
    /// after the own text's.
    pub fn band(&self) -> usize {
        super::adaptive::support_band(self.len) + if self.from_corpus { super::adaptive::SUPPORT_BANDS } else { 0 }
    }
}

pub trait Proposer: Send {
    /// Drafts for each request, in order (`max_draft` tokens at most each).
    fn propose(&mut self, reqs: &mut [DraftRequest], pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError>;
    /// The sequence now has `kept` tokens whose target KV is valid: drop any draft state past it.
    fn rollback(&mut self, _seq: SeqId, _kept: usize) {}
    /// The sequence ended: release its state.
    fn remove(&mut self, _seq: SeqId) {}
    /// Tokens of the sequence (which has `known` tokens) that the proposer must process before
    /// it can draft, beyond the newest one: a draft model's KV lags by this much when it did not
    /// draft for the sequence for a while. Adaptive k weighs that catch-up against its gain.
    fn backlog(&self, _seq: SeqId, _known: usize) -> usize {
        0
    }
    /// How far this proposer's next draft for the sequence (whose known tokens are `tokens`, the
    /// first `prompt_len` its prompt; sent by `tenant`) is backed, where it can tell before
    /// drafting: the n-gram proposer gives the length of the match it would continue and where
    /// it found it, a length of 0 when it has nothing to draft. Adaptive k then keeps one
    /// acceptance estimate per band of it ([`Support::band`]) instead of the sequence's own: a
    /// match of 1 token is a guess, one of 40 a copy, and a single estimate over both drafts too
    /// much after the one and too little after the other. `None`: no such figure (the
    /// sequence's own estimate decides). `drafting` is the sequence's state, as in its requests.
    fn support(&mut self, _seq: SeqId, _tokens: &[TokenId], _prompt_len: usize, _tenant: Tenant, _drafting: &mut SeqDrafting) -> Option<Support> {
        None
    }
    /// A sequence of `tenant` finished with `output` (the cross-request index keeps it).
    fn finished(&mut self, _tenant: Tenant, _output: &[TokenId]) {}
    /// Whether this proposer drafts with the n-gram method beside a model
    /// ([`super::combined`]): adaptive k then picks, per sequence and step, which drafts.
    fn combined(&self) -> bool {
        false
    }
    /// The target layers whose hidden states `DraftRequest::hidden` carries, in order
    /// (`n_layers - 1`: the final hidden state before the output norm); empty: none.
    fn hidden_layers(&self) -> &[usize] {
        &[]
    }
    /// Whether `DraftRequest::hidden` must be filled.
    fn needs_hidden(&self) -> bool {
        !self.hidden_layers().is_empty()
    }
    /// Work of proposing one draft token relative to a plain step of `target` (adaptive k), as
    /// estimated from shapes.
    fn cost_per_draft_token(&self, _target: &specula_model::ModelConfig) -> f64 {
        0.0
    }
    /// Measured seconds of one draft step for each number of drafting sequences in `batches` (a
    /// draft model times its forward pass); None: use [`Proposer::cost_per_draft_token`].
    fn draft_step_seconds(&mut self, _batches: &[usize], _pool: &rayon::ThreadPool) -> Result<Option<Vec<(usize, f64)>>, SpecError> {
        Ok(None)
    }
    /// For leak checks: (free, total) blocks of a proposer-owned KV cache.
    fn kv_blocks(&self) -> Option<(usize, usize)> {
        None
    }
}
