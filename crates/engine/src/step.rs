//! The data of one engine step, as it moves through the phases (docs/architecture.md, "One
//! step"): schedule -> prepare -> finalize -> compute (forward, sample, propose) -> apply ->
//! stream. Each phase imports its inputs and outputs from here and never another phase's module,
//! so this module imports no phase: only leaf types (types, sampling, the sequence record).
//!
//! Each type says which phase writes it and which phase reads it.

use crate::error::StepError;
use crate::kv_cache::transfer::{KvTransfers, TransfersDone};
use crate::record::SeqRecord;
use crate::sampling::PackedLogprobs;
use crate::types::{SeqId, TokenId};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// schedule

/// One sequence's share of a step. Written by the scheduler (and finalized by `batch::finalize`);
/// read by prepare, finalize, the compute job's bookkeeping and apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq: SeqId,
    /// Position of the first token computed this step (= tokens computed before it).
    pub start: usize,
    /// Tokens computed this step (a prefill chunk, 1 decode token, or 1 + k with drafts).
    pub num_tokens: usize,
    /// Draft tokens among them (the last `num_drafts` of the step's tokens).
    pub num_drafts: usize,
    /// Whether the step ends on the sequence's last known token, so logits are sampled.
    pub sample: bool,
    /// Scheduled ahead (async scheduling) while the step before was still running, with this many
    /// tokens reserved (1 + k; 0: not scheduled ahead). Until `batch::finalize` completes it,
    /// `start`, `num_tokens` and `num_drafts` are that worst case (KV slots and token budget);
    /// after, they are what runs, and `placeholders` says how much was reserved, which
    /// `Host::settle` gives back. The sequence's counter (`Sequence::num_placeholders`) holds the
    /// same amount until then.
    pub placeholders: usize,
}

/// The scheduler's decision for one step. `seqs` sums to `total_tokens`. Written by the scheduler
/// (late admissions by `Host::admit_late`, settling by `batch::finalize`); read by prepare,
/// finalize, compute (the batch shape) and apply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub seqs: Vec<ScheduledSeq>,
    pub total_tokens: usize,
    /// Sequences preempted while planning (already moved to the waiting queue).
    pub preempted: Vec<SeqId>,
    /// Sequences that left the waiting queue for the first time this step.
    pub newly_admitted: Vec<SeqId>,
    /// Sequences still to join the decode batch once the step has run: waiting, or with more
    /// of their prompt (or recompute) than the next token left to compute. Adaptive k weighs a
    /// proposer's catch-up against the batch they will make (`Speculation::next_k`).
    pub pending_prefill: usize,
}

/// Where a sequence's valid KV ends after a step that computed `num_tokens` from `start`, once
/// `rejected` of its drafts were rejected: the one rollback rule, read by the proposer's rollback
/// (`SampleItem::kept_end`), the host's (`ScheduledSeq::kept_end` in `Host::apply`) and the
/// settling of a step scheduled ahead (`batch::finalize` moves its start back by `rejected`).
pub fn kept_end(start: usize, num_tokens: usize, rejected: usize) -> usize {
    debug_assert!(rejected < num_tokens, "{rejected} drafts rejected of a step of {num_tokens} tokens");
    start + num_tokens - rejected
}

impl ScheduledSeq {
    /// Whether it was scheduled ahead of the step that samples its input tokens.
    pub fn is_ahead(&self) -> bool {
        self.placeholders > 0
    }

    /// Where the sequence's valid KV ends after this step, once `rejected` of its drafts were
    /// rejected (see [`kept_end`]).
    pub fn kept_end(&self, rejected: usize) -> usize {
        kept_end(self.start, self.num_tokens, rejected)
    }
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
    pub fn has_prefill(&self) -> bool {
        self.seqs.iter().any(|s| s.num_tokens > 1 + s.num_drafts)
    }
}

// ---------------------------------------------------------------------------------------------
// prepare and finalize

/// A sequence's rows in the flattened batch. Written by finalize; read by the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRange {
    pub q_start: usize,
    pub q_len: usize,
    /// Tokens in context after this step.
    pub context_len: usize,
}

/// Everything the forward pass reads, built before it runs. Written by finalize (the proposer's
/// `hidden_layers` by the compute job); read by `runner::execute` and sampling.
#[derive(Clone, Debug, Default)]
pub struct BatchInputs {
    /// `[total_tokens]` token ids, sequence after sequence.
    pub tokens: Vec<TokenId>,
    /// One per scheduled sequence, in plan order; q_starts tile `tokens`.
    pub spans: Vec<RowRange>,
    /// One per scheduled sequence: its block ids.
    pub block_tables: Vec<Vec<u32>>,
    /// `[total_tokens]` KV slot of each token.
    pub slots: Vec<usize>,
    /// Rows whose logits are needed, in order: for each sampling sequence its last
    /// `1 + num_drafts` rows.
    pub logits_rows: Vec<usize>,
    /// For each sampling sequence: (seq, first index into logits_rows, number of rows).
    pub sample_rows: Vec<(SeqId, usize, usize)>,
    /// Layers whose hidden states of the logits rows the forward pass returns (the proposer's
    /// `hidden_layers`; empty: none).
    pub hidden_layers: Vec<usize>,
    /// One per scheduled sequence: its recurrent-state slot (hybrid models; empty otherwise).
    pub state_slots: Vec<usize>,
}

/// One scheduled sequence, prepared. Written by prepare (from the host state); read by finalize.
pub(crate) struct PreparedSeq {
    pub block_table: Vec<u32>,
    /// Its recurrent-state slot (hybrid models).
    pub state_slot: Option<u32>,
    /// Its input tokens; empty for a decode scheduled ahead (the step before samples them).
    pub tokens: Vec<TokenId>,
    /// Its compute-side record, when this is the first step to schedule it (the host hands the
    /// sequence over once: `crate::record`).
    pub admitted: Option<SeqRecord>,
    /// Prompt logprobs this step computes for it, when it asks for them and the step covers prompt
    /// rows (`first_row` set by finalize).
    pub prompt_rows: Option<PromptRows>,
}

/// One sequence's prompt rows in a step: row `j` (position `first_token - 1 + j`) gives the
/// logprob of prompt token `first_token + j`, which is `targets[j]`. Written by prepare (and
/// `first_row`, the index into the step's logits rows, by finalize); read by the compute job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PromptRows {
    pub seq: SeqId,
    pub first_row: usize,
    pub first_token: usize,
    pub targets: Vec<TokenId>,
    /// The request's top-k.
    pub k: usize,
}

/// Where a sequence's prompt logprobs of one step are in the step's packed logprobs: rows
/// `lp_first..lp_first + count`, for prompt tokens `first_token..first_token + count`. Written by
/// the compute job; read by apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PromptLogprobsOut {
    pub seq: SeqId,
    pub first_token: usize,
    pub lp_first: usize,
    pub count: usize,
}

/// A step scheduled and prepared, waiting to be finalized and run. Written by `Host::prepare`
/// (late admissions by `Host::admit_late`); read by finalize.
pub(crate) struct PreparedStep {
    /// The step's number (from 1, in the order steps are prepared).
    pub step: u64,
    pub plan: StepPlan,
    pub seqs: Vec<PreparedSeq>,
    /// The KV block copies decided while it was scheduled (prefix-cache tiers).
    pub transfers: KvTransfers,
}

// ---------------------------------------------------------------------------------------------
// compute

/// A sequence whose logits are sampled this step: which rows, and where they are in its history.
/// Its sampling state is its record's (`crate::record`). Written by finalize; read by the compute job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SampleItem {
    pub seq: SeqId,
    /// Its rows among the step's logits rows (`1 +` the drafts it verifies).
    pub first_row: usize,
    pub rows: usize,
    /// Position of its first token in this step and how many it computes (for proposer rollback).
    pub start: usize,
    pub num_tokens: usize,
}

impl SampleItem {
    /// Where its valid KV ends after this step with `rejected` drafts rejected ([`kept_end`]).
    pub fn kept_end(&self, rejected: usize) -> usize {
        kept_end(self.start, self.num_tokens, rejected)
    }

    /// Draft tokens it verifies.
    pub fn num_drafts(&self) -> usize {
        self.rows - 1
    }

    /// Tokens of the sequence known before this step's emitted ones: its inputs end with the
    /// last known token, then its drafts.
    pub fn known(&self) -> usize {
        self.start + self.num_tokens - self.num_drafts()
    }
}

/// One step's compute job. Written by finalize; read by `runner::job::run_job`.
pub(crate) struct StepJob {
    pub step: u64,
    pub inputs: BatchInputs,
    /// Records of the sequences this step is the first to schedule (taken in before anything runs).
    pub admitted: Vec<(SeqId, SeqRecord)>,
    pub items: Vec<SampleItem>,
    /// Prompt rows whose logprobs are computed (their logits rows come before the sequence's
    /// sampled rows).
    pub prompt_rows: Vec<PromptRows>,
    /// The plan's `pending_prefill`.
    pub pending_prefill: usize,
    /// KV block copies to do before the forward pass (prefix-cache tiers).
    pub transfers: KvTransfers,
}

/// What one sampled sequence got this step. Written by the compute job (sample, propose); read by
/// the next step's finalize (async) and by apply.
pub(crate) struct SeqResult {
    /// Emitted tokens: the accepted drafts then one token from the target.
    pub tokens: Vec<TokenId>,
    pub num_drafts: usize,
    /// Rows `lp_first..lp_first + tokens.len()` of the step's packed logprobs, when asked for.
    pub lp_first: Option<usize>,
    /// The constraint's language allows nothing more after `tokens`: the output is complete
    /// (finish reason "stop", as if EOS had been sampled).
    pub grammar_finished: bool,
    /// Draft tokens for the next step (empty if none); their distributions stay in the record.
    pub next_draft: Vec<TokenId>,
    /// A token-level finish (stop token, length, finished grammar) among `tokens`: the sequence
    /// does not go on.
    pub finished: bool,
    /// This sequence alone failed in the step (its grammar's matcher failed at run time): it
    /// emitted nothing (`tokens` is empty) and apply fails its request with this message; the
    /// step's other sequences go on (invariant 5).
    pub failed: Option<String>,
}

impl SeqResult {
    /// A result for a sequence that failed in the step on its own (see `failed`).
    pub fn failed(message: String) -> Self {
        SeqResult { tokens: Vec::new(), num_drafts: 0, lp_first: None, grammar_finished: false, next_draft: Vec::new(), finished: true, failed: Some(message) }
    }

    pub fn num_accepted(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }

    /// Draft tokens the step verified and rejected: their KV slots hold nothing valid.
    pub fn num_rejected(&self) -> usize {
        self.num_drafts - self.num_accepted()
    }
}

/// When a compute job's parts ran. Written by the compute job; read by the engine's step timings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct JobTimings {
    pub forward_start: Instant,
    pub forward_end: Instant,
    pub sample: Duration,
    pub propose: Duration,
}

impl JobTimings {
    /// When the job's work ended (its forward pass, sampling and proposals).
    pub fn end(&self) -> Instant {
        self.forward_end + self.sample + self.propose
    }
}

/// A compute job's output. Written by the compute job; read by finalize (async) and apply.
pub(crate) struct JobOutput {
    pub results: Vec<(SeqId, SeqResult)>,
    /// Every emitted token's logprobs (the batch's largest top-k, computed once), packed.
    pub logprobs: Option<PackedLogprobs>,
    /// Prompt logprobs among `logprobs`' rows (after every emitted token's).
    pub prompt_logprobs: Vec<PromptLogprobsOut>,
    pub timings: JobTimings,
    /// What the step's KV block copies did (saved bytes, loaded blocks).
    pub transfers: TransfersDone,
    /// The step's input and logits buffers, freed with the output: by the host job when async,
    /// so not between two forward passes.
    pub _spent: (BatchInputs, specula_model::ForwardOutput),
}

/// A step's forward pass and sampling, done: its plan as it ran and what it produced. Written by
/// the engine after the compute job; read by the next step's finalize (async) and by apply.
pub(crate) struct Computed {
    pub step: u64,
    pub plan: StepPlan,
    pub outcome: Result<JobOutput, StepError>,
}

// ---------------------------------------------------------------------------------------------
// timings and stats

/// Where one step's time went. `forward`, `sample` and `propose` are the compute job; `finalize`
/// finalizes the step from the one before just before its forward pass. With async scheduling,
/// `schedule`, `prepare` and `update` are the host job that ran beside this step's forward pass
/// (the next step's schedule and prepare, the previous step's update). Written by the engine (and
/// the host job's [`HostWork`]); read by metrics, benchmarks and tests.
#[derive(Clone, Debug, Default)]
pub struct StepTimings {
    pub schedule: Duration,
    pub prepare: Duration,
    pub finalize: Duration,
    pub forward: Duration,
    pub sample: Duration,
    pub propose: Duration,
    /// Applying sampled tokens and streaming them (detokenize, stop strings, deltas).
    pub update: Duration,
    /// Time between the end of the previous forward pass and the start of this one (`None` for
    /// the first forward pass after the engine was idle). Includes sampling, which the next
    /// forward pass waits for whatever the scheduling.
    pub gap: Option<Duration>,
    /// Time between the end of the previous compute job (forward, sample, propose) and the start
    /// of this forward pass: the compute side waiting on host work.
    pub host_gap: Option<Duration>,
}

/// What one step did, for logs, benchmarks and tests. Written by `Engine::step`; read by its
/// callers (the engine loops, benchmarks, tests).
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    pub num_seqs: usize,
    pub num_tokens: usize,
    /// Tokens streamed to clients by this call (async: the previous step's).
    pub num_emitted: usize,
    pub has_prefill: bool,
    /// Whether this call ran a forward pass.
    pub ran_forward: bool,
    pub timings: StepTimings,
}

impl StepStats {
    pub(crate) fn add_host_work(&mut self, w: HostWork) {
        self.timings.schedule += w.schedule;
        self.timings.prepare += w.prepare;
        self.timings.update += w.update;
        self.num_emitted += w.emitted;
    }
}

/// Where a host job's time went, and what it streamed. Written by `Host::work`; read by the
/// engine into the step's [`StepStats`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HostWork {
    pub schedule: Duration,
    pub prepare: Duration,
    pub update: Duration,
    pub emitted: usize,
}
