//! One step's compute job: the forward pass, sampling (or verification) of every sampled row, and
//! the next step's draft proposals. Everything after the forward pass that the next forward pass
//! depends on is here, and nothing else: detokenizing, stop strings and streaming are host work
//! (`crate::host`). The job touches only the compute state (the KV tensors, the sampler, the
//! proposer, and each sequence's record: history, random stream, grammar, drafts), so the engine
//! thread runs it with the same code whether the host work of the neighbouring steps runs inline
//! or on the async runner, and so produces the same tokens.

use super::execute;
use crate::constraint::{draft_after_forced, forced_prefix, masked_rows, TokenMask, JUMP_FORWARD_MAX_TOKENS};
use crate::error::{panic_message, StepError, StepFailure};
use crate::fault::{FaultInjection, FaultPhase};
use crate::record::{SeqRecord, SeqRecords};
use crate::sampling::{pack, ranked_logprob, ranked_logprobs, PackedLogprobs, RankedLogprob, Sampler, TokenHistory};
use crate::sequence::token_finish;
use crate::speculative::{verify, DraftCandidate, DraftRequest, SeqDrafting, Speculation};
use crate::step::{JobOutput, JobTimings, PromptLogprobsOut, PromptRows, SampleItem, SeqResult, StepJob};
use crate::types::{Draft, SeqId, TokenId};
use specula_model::{KvStore, LlamaModel, Tokenizer};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

/// Message flags of the packed per-step logprobs buffer.
pub(crate) const LOGPROBS_FLAG_PLAIN: u32 = 0;
pub(crate) const LOGPROBS_FLAG_VERIFIED: u32 = 1;

/// The read-only things a job needs, shared with the engine thread.
#[derive(Clone)]
pub(crate) struct JobContext {
    pub model: Arc<LlamaModel>,
    pub tokenizer: Arc<Tokenizer>,
    pub pool: Arc<rayon::ThreadPool>,
    pub max_model_len: usize,
    /// The test-only fault switch (`EngineConfig::fault_injection`).
    pub fault: Option<FaultInjection>,
    /// Forced tokens of constrained sequences are drafted (`EngineConfig::jump_forward`).
    pub jump_forward: bool,
    /// The engine's queue counters: requests submitted and not yet scheduled, read live.
    pub queue: Arc<crate::handle::QueueCounters>,
    /// Most sequences a step runs (`EngineConfig::max_num_seqs`).
    pub max_num_seqs: usize,
}

/// The mutable compute state a job takes from the engine and hands back with its result.
pub(crate) struct ComputeState {
    pub kv_store: KvStore,
    pub sampler: Sampler,
    pub spec: Option<Speculation>,
    /// Every live sequence's record (`crate::record`).
    pub records: SeqRecords,
}

impl ComputeState {
    /// Forgets a sequence the host removed: its record and the proposer's state for it.
    pub fn forget(&mut self, seq: SeqId) {
        self.records.forget(seq);
        if let Some(sp) = self.spec.as_mut() {
            sp.remove(seq);
        }
    }
}

/// Runs `job`, catching a panic anywhere in it; the error names the step. `while_forward` runs on
/// this thread once the forward pass is under way (see `execute`); it does not run if the job
/// fails before its forward pass starts.
pub(crate) fn run_job(ctx: &JobContext, state: &mut ComputeState, job: StepJob, while_forward: impl FnOnce()) -> Result<JobOutput, StepError> {
    let step = job.step;
    match catch_unwind(AssertUnwindSafe(|| run_job_inner(ctx, state, job, while_forward))) {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(failure)) => Err(StepError::Failed { step, failure }),
        Err(panic) => {
            let message = panic_message(&panic);
            tracing::error!("step {step} panicked: {message}");
            Err(StepError::Panicked { step, message })
        }
    }
}

fn run_job_inner(ctx: &JobContext, state: &mut ComputeState, job: StepJob, while_forward: impl FnOnce()) -> Result<JobOutput, StepFailure> {
    // the prefix-cache tiers' block copies and state restores, before anything reads or writes
    // the KV (`transfer`); the state saves after the forward pass
    let mut job = job;
    let ComputeState { kv_store, sampler, spec, records } = state;
    for (seq, rec) in std::mem::take(&mut job.admitted) {
        records.admit(seq, rec);
    }
    // every sampled sequence's record, in the items' order (looked up once per step): each agrees
    // with the step, and keeps the drafts it verifies
    let items = job.items;
    let mut recs = records.get_many_mut(&items.iter().map(|it| it.seq).collect::<Vec<_>>())?;
    for (it, rec) in items.iter().zip(recs.iter_mut()) {
        rec.check(it.seq, it.known(), it.num_drafts())?;
    }
    let state_saves = std::mem::take(&mut job.transfers.state_saves);
    let mut transfers = super::run_transfers(kv_store, job.transfers).map_err(|e| StepFailure::Invariant(e.to_string()))?;
    let mut inputs = job.inputs;
    inputs.hidden_layers = spec.as_ref().map(|sp| sp.proposer.hidden_layers().to_vec()).unwrap_or_default();
    let forward_start = Instant::now();
    // the grammar masks depend only on the records: computed on this thread while the forward
    // pass runs on the pool
    let mut masks = Vec::new();
    let out = execute(&ctx.model, kv_store, &ctx.pool, &inputs, || {
        while_forward();
        masks = grammar_masks(&items, &mut recs, ctx.fault, job.step);
    })?;
    FaultInjection::trip(ctx.fault, job.step, FaultPhase::Forward)?;
    transfers.states_saved = super::run_state_saves(kv_store, state_saves).map_err(|e| StepFailure::Invariant(e.to_string()))?;
    let forward_end = Instant::now();
    tracing::trace!(
        step = job.step,
        tokens = inputs.tokens.len(),
        logits_rows = inputs.logits_rows.len(),
        context = inputs.spans.iter().map(|s| s.context_len).max().unwrap_or(0),
        micros = (forward_end - forward_start).as_micros() as u64,
        "forward pass"
    );
    let (results, logprobs, prompt_logprobs) = sample(ctx, sampler, spec, job.step, &items, &mut recs, &masks, &job.prompt_rows, &out.logits)?;
    let sample_end = Instant::now();
    let results = propose(ctx, spec, job.step, &items, &mut recs, results, &out.hidden, job.pending_prefill);
    let timings = JobTimings { forward_start, forward_end, sample: sample_end - forward_end, propose: sample_end.elapsed() };
    Ok(JobOutput { results, logprobs, prompt_logprobs, timings, transfers, _spent: (inputs, out) })
}

/// One constrained item's masks for its verified rows, and how many of its draft tokens its
/// grammar was advanced over to compute them (`Grammar::verification_masks`); `None` for free
/// text; an error fails that item alone (its grammar's matcher failed at run time).
type ItemMasks = Result<Option<(Vec<TokenMask>, usize)>, StepFailure>;

/// The token masks of every constrained item (structured outputs), by item. A matcher that fails
/// (an error, or a panic inside llguidance) fails its own item only; the others are masked as usual.
fn grammar_masks(items: &[SampleItem], recs: &mut [&mut SeqRecord], fault: Option<FaultInjection>, step: u64) -> Vec<ItemMasks> {
    let start = Instant::now();
    let mut rows = 0;
    let masks: Vec<ItemMasks> = items.iter().zip(recs.iter_mut()).map(|(it, rec)| item_masks(it.seq, rec, fault, step, &mut rows)).collect();
    if rows > 0 {
        tracing::debug!(rows, micros = start.elapsed().as_micros() as u64, "grammar masks computed");
    }
    masks
}

/// One item's masks (see [`grammar_masks`]); `rows` counts the masks computed.
fn item_masks(seq: SeqId, rec: &mut SeqRecord, fault: Option<FaultInjection>, step: u64, rows: &mut usize) -> ItemMasks {
    match rec.grammar.as_mut() {
        None if rec.params.needs_grammar() => Err(StepFailure::Invariant(format!("{seq}: its constraint's grammar state is missing (an engine bug)"))),
        // a reasoning budget past its closing token constrains nothing more: free text
        Some(g) if g.is_free_text() => Ok(None),
        Some(g) => {
            let drafts = &rec.draft.tokens;
            let m = catch_unwind(AssertUnwindSafe(|| {
                FaultInjection::trip(fault, step, FaultPhase::Grammar)?;
                Ok(g.verification_masks(drafts)?)
            }))
            .unwrap_or_else(|p| Err(StepFailure::Grammar(crate::constraint::ConstraintError(format!("the grammar panicked: {}", panic_message(&p))))))?;
            *rows += m.0.len();
            Ok(Some(m))
        }
        None => Ok(None),
    }
}

/// The result of a constrained item whose grammar failed at run time (its masks, or consuming the
/// sampled tokens): logged, no tokens, and its request alone fails with the error.
fn grammar_failure(seq: SeqId, step: u64, error: impl std::fmt::Display) -> SeqResult {
    let message = format!("structured output failed: {error}");
    tracing::warn!(seq = %seq, "step {step}: {message}");
    SeqResult::failed(message)
}

/// What sampling returns: each item's result, the packed logprobs, and where prompt logprobs are
/// among them.
type Sampled = (Vec<SeqResult>, Option<PackedLogprobs>, Vec<PromptLogprobsOut>);

/// Per item: one sampled token, or with drafts the accepted prefix plus one token from the
/// rejection sampler; logprobs of every emitted token from the raw target logits of its row.
/// A constrained item samples and verifies its rows with the tokens its grammar forbids at
/// -inf (`masks`), then its grammar keeps the emitted tokens.
/// Appends the emitted tokens to each item's history for drafting. Prompt logprobs of
/// `prompt_rows` go into the same packed buffer, after the emitted tokens' rows.
#[allow(clippy::too_many_arguments)]
fn sample(
    ctx: &JobContext,
    sampler: &mut Sampler,
    spec: &mut Option<Speculation>,
    step: u64,
    items: &[SampleItem],
    recs: &mut [&mut SeqRecord],
    masks: &[ItemMasks],
    prompt_rows: &[PromptRows],
    logits: &[f32],
) -> Result<Sampled, StepFailure> {
    let vocab = ctx.model.config.vocab_size;
    // only the largest top-k any sequence of this batch asked for is computed
    let k_max = recs.iter().filter_map(|rec| rec.params.logprobs).chain(prompt_rows.iter().map(|p| p.k)).max();
    let force_accept = spec.as_ref().is_some_and(|sp| sp.cfg.force_accept);
    let mut lp_rows: Vec<RankedLogprob> = Vec::new();
    let mut verified = false;
    let mut results = Vec::with_capacity(items.len());
    let mut scratch = Vec::new();
    for (i, (it, rec)) in items.iter().zip(recs.iter_mut()).enumerate() {
        let block = logits
            .get(it.first_row * vocab..(it.first_row + it.rows) * vocab)
            .ok_or_else(|| StepFailure::Invariant(format!("{}: logits rows {}..{} out of range", it.seq, it.first_row, it.first_row + it.rows)))?;
        let num_drafts = it.num_drafts();
        let item_masks = match masks.get(i) {
            Some(Err(e)) => {
                results.push(grammar_failure(it.seq, step, e));
                continue;
            }
            Some(Ok(m)) => m.as_ref(),
            None => None,
        };
        // what sampling and verification read: the raw rows, or the rows masked by the grammar
        let rows = match item_masks {
            Some((ms, _)) => masked_rows(block, ms, vocab, &mut scratch),
            None => block,
        };
        let mut toks = match draw(ctx, sampler, force_accept, step, i == 0, rec, it.rows, rows) {
            Ok(toks) => toks,
            Err(message) => {
                tracing::error!(seq = %it.seq, "step {step}: {message}");
                results.push(SeqResult::failed(message));
                continue;
            }
        };
        verified |= num_drafts > 0;
        // drafts the rejection sampler accepted (for the acceptance counters)
        let accepted = toks.len() - 1;
        if let (Some(g), Some((_, consumed))) = (rec.grammar.as_mut(), item_masks) {
            if let Err(e) = g.accept(*consumed, &toks) {
                results.push(grammar_failure(it.seq, step, e));
                continue;
            }
            g.trim_completed(&mut toks);
        }
        let grammar_finished = rec.grammar.as_ref().is_some_and(|g| g.is_finished());
        let lp_first = match (rec.params.logprobs, k_max) {
            (Some(_), Some(k)) => Some(emitted_logprobs(block, &toks, vocab, k, &mut lp_rows)?),
            _ => None,
        };
        let forced = match item_masks {
            Some((ms, _)) if ctx.jump_forward => forced_prefix(&rec.draft.tokens, ms),
            _ => 0,
        };
        let kept_end = it.kept_end(num_drafts - (toks.len() - 1));
        Speculation::record_verification(spec.as_mut(), it.seq, &mut rec.spec, num_drafts, forced, accepted, kept_end);
        rec.tokens.extend_from_slice(&toks);
        rec.draft = Draft::default();
        results.push(SeqResult { tokens: toks, num_drafts, lp_first, grammar_finished, next_draft: Vec::new(), finished: false, failed: None });
        FaultInjection::trip(ctx.fault, step, FaultPhase::Sample)?;
    }
    let prompt_out = prompt_logprobs(ctx, logits, prompt_rows, k_max, &mut lp_rows)?;
    let logprobs = match k_max {
        Some(_) if !lp_rows.is_empty() => {
            let cols = (lp_rows[0].logprob.top.len() + 1) as u32;
            let flag = if verified { LOGPROBS_FLAG_VERIFIED } else { LOGPROBS_FLAG_PLAIN };
            Some(pack(&lp_rows, cols, flag)?)
        }
        _ => None,
    };
    Ok((results, logprobs, prompt_out))
}

/// One item's tokens: sampled from its row, or its drafts verified against its rows (the accepted
/// prefix and one more). A failure or panic here fails this sequence alone, not its neighbours:
/// the error is the text its request gets. `first`: the step's first sampled item (the test
/// switch's `SampleSequence` fault).
#[allow(clippy::too_many_arguments)]
fn draw(
    ctx: &JobContext,
    sampler: &mut Sampler,
    force_accept: bool,
    step: u64,
    first: bool,
    rec: &SeqRecord,
    n_rows: usize,
    rows: &[f32],
) -> Result<Vec<TokenId>, String> {
    let vocab = ctx.model.config.vocab_size;
    let drawn = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<TokenId>, StepFailure> {
        if first {
            FaultInjection::trip(ctx.fault, step, FaultPhase::SampleSequence)?;
        }
        let (prompt, output) = rec.tokens.split_at(rec.prompt_len);
        if n_rows == 1 {
            Ok(vec![sampler.sample(rows, &rec.params, TokenHistory { prompt, output }, &rec.rng)?])
        } else {
            Ok(verify(rows, vocab, &rec.draft, &rec.params, prompt, output, &rec.rng, force_accept)?.tokens)
        }
    }));
    match drawn {
        Ok(Ok(toks)) => Ok(toks),
        Ok(Err(e)) => Err(format!("sampling this sequence failed: {e}")),
        Err(panic) => Err(format!("sampling this sequence panicked: {}", panic_message(&panic))),
    }
}

/// The logprob rows (top `k`) of the emitted `toks`, from the raw target rows of `block`,
/// appended to `lp_rows`; returns where they start.
fn emitted_logprobs(block: &[f32], toks: &[TokenId], vocab: usize, k: usize, lp_rows: &mut Vec<RankedLogprob>) -> Result<usize, StepFailure> {
    let start = lp_rows.len();
    for (j, &tok) in toks.iter().enumerate() {
        lp_rows.push(ranked_logprob(&block[j * vocab..(j + 1) * vocab], tok, k)?);
    }
    Ok(start)
}

/// Every prompt row's logprob and top-k (`k_max`), appended to `lp_rows`, spread over the compute
/// pool (idle once the forward pass is done: scoring a prompt asks one per token); where each
/// sequence's rows are.
fn prompt_logprobs(
    ctx: &JobContext,
    logits: &[f32],
    prompt_rows: &[PromptRows],
    k_max: Option<usize>,
    lp_rows: &mut Vec<RankedLogprob>,
) -> Result<Vec<PromptLogprobsOut>, StepFailure> {
    let mut out = Vec::with_capacity(prompt_rows.len());
    let Some(k) = k_max else { return Ok(out) };
    let mut rows = Vec::with_capacity(prompt_rows.iter().map(|p| p.targets.len()).sum());
    for pr in prompt_rows {
        out.push(PromptLogprobsOut { seq: pr.seq, first_token: pr.first_token, lp_first: lp_rows.len() + rows.len(), count: pr.targets.len() });
        rows.extend(pr.targets.iter().enumerate().map(|(j, &tok)| (pr.first_row + j, tok)));
    }
    let vocab = ctx.model.config.vocab_size;
    lp_rows.extend(ctx.pool.install(|| ranked_logprobs(logits, vocab, &rows, k))?);
    Ok(out)
}

/// Drafts for the next step of every sequence that goes on decoding (not one that just emitted a
/// stop token or reached its length), from its history including this step's tokens: first the
/// tokens its grammar forces (jump-forward, structured outputs), then the proposer's draft after
/// them, cut at the first token the grammar forbids; together within the engine's k (without a
/// speculative method, [`JUMP_FORWARD_MAX_TOKENS`] forced tokens) and the sequence's room.
#[allow(clippy::too_many_arguments)]
fn propose(
    ctx: &JobContext,
    spec: &mut Option<Speculation>,
    step: u64,
    items: &[SampleItem],
    recs: &mut [&mut SeqRecord],
    mut results: Vec<SeqResult>,
    hidden: &[f32],
    pending_prefill: usize,
) -> Vec<(SeqId, SeqResult)> {
    let continuing = continuing(ctx, recs, &mut results);
    let decoding = continuing.iter().filter(|&&c| c).count();
    let room: Vec<usize> = recs.iter().map(|rec| room(ctx, rec)).collect();
    if let Some(sp) = spec.as_mut() {
        let context: usize = recs.iter().zip(&continuing).filter(|(_, &c)| c).map(|(rec, _)| rec.tokens.len()).sum();
        sp.set_context(context / decoding.max(1));
    }
    let forced = jump_forward(ctx, spec.as_ref(), recs, &mut results, &continuing, &room, decoding);
    if let Some(sp) = spec.as_mut() {
        let needs_hidden = sp.proposer.needs_hidden();
        if decoding > 0 && (sp.batch_k_limit(decoding) > 0 || needs_hidden) {
            // the proposer drafts after the forced tokens (one that reads the target's hidden
            // states cannot: it drafts only where nothing is forced)
            let extended: Vec<Option<Vec<TokenId>>> =
                recs.iter().zip(&forced).map(|(rec, f)| (!f.is_empty() && !needs_hidden).then(|| [&rec.tokens[..], &f[..]].concat())).collect();
            // each row's hidden states: one H-wide state per layer the proposer asked for; the
            // rows that produced the item's emitted tokens
            let h = ctx.model.config.hidden_size * sp.proposer.hidden_layers().len();
            let which: Vec<usize> = (0..items.len()).filter(|&i| continuing[i]).collect();
            let cands: Vec<DraftCandidate> = recs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| continuing[*i])
                .map(|(i, rec)| {
                    let it = &items[i];
                    let SeqRecord { tokens, prompt_len, params, rng, spec, .. } = &mut **rec;
                    DraftCandidate {
                        seq: it.seq,
                        tokens: extended[i].as_deref().unwrap_or(tokens),
                        known: tokens.len(),
                        prompt_len: *prompt_len,
                        params,
                        forced: forced[i].len(),
                        room: room[i],
                        hidden: hidden.get(it.first_row * h..(it.first_row + results[i].tokens.len()) * h),
                        rng,
                        spec,
                    }
                })
                .collect();
            let arrived = ctx.queue.waiting.load(std::sync::atomic::Ordering::Relaxed);
            let mut reqs = sp.plan_drafts(cands, pending_prefill, arrived, ctx.max_num_seqs);
            if needs_hidden || reqs.iter().any(|r| r.max_draft > 0) {
                let drafts = run_proposer(ctx, sp, step, &mut reqs);
                let vocab = ctx.model.config.vocab_size;
                for (i, d) in which.into_iter().zip(drafts.into_iter().flatten()) {
                    if d.tokens.iter().any(|&t| t as usize >= vocab) {
                        continue; // a proposer bug must not crash verification
                    }
                    if let Some(d) = draft_after_forced(items[i].seq, recs[i].grammar.as_mut(), &forced[i], d, vocab) {
                        results[i].next_draft.clone_from(&d.tokens);
                        recs[i].draft = d;
                    }
                }
            }
        }
    }
    items.iter().map(|it| it.seq).zip(results).collect()
}

/// Which items go on decoding: not failed, grammar not finished, no token of this step ending
/// the sequence (stop token, length, context); the others are marked finished.
fn continuing(ctx: &JobContext, recs: &[&mut SeqRecord], results: &mut [SeqResult]) -> Vec<bool> {
    recs.iter()
        .zip(results.iter_mut())
        .map(|(rec, r)| {
            let base = rec.tokens.len() - r.tokens.len();
            let ends = r
                .tokens
                .iter()
                .enumerate()
                .any(|(j, &t)| token_finish(&rec.params, &ctx.tokenizer, t, base + j + 1 - rec.prompt_len, base + j + 1, ctx.max_model_len).is_some());
            let goes_on = r.failed.is_none() && !r.grammar_finished && !ends;
            r.finished = !goes_on;
            goes_on
        })
        .collect()
}

/// Tokens a sequence may still get after the next one (its length and the context).
fn room(ctx: &JobContext, rec: &SeqRecord) -> usize {
    rec.params.max_tokens.saturating_sub(rec.output_len() + 1).min(ctx.max_model_len.saturating_sub(rec.tokens.len() + 1))
}

/// Jump-forward: the tokens each continuing constrained sequence's grammar forces next (within
/// the step's forced budget and its room), set as its draft; the proposer's draft goes after them.
fn jump_forward(
    ctx: &JobContext,
    spec: Option<&Speculation>,
    recs: &mut [&mut SeqRecord],
    results: &mut [SeqResult],
    continuing: &[bool],
    room: &[usize],
    decoding: usize,
) -> Vec<Vec<TokenId>> {
    let cap = match spec {
        _ if !ctx.jump_forward || decoding == 0 => 0,
        Some(sp) => sp.forced_limit(decoding),
        None => JUMP_FORWARD_MAX_TOKENS,
    };
    let mut forced: Vec<Vec<TokenId>> = vec![Vec::new(); results.len()];
    for (i, (rec, r)) in recs.iter_mut().zip(results.iter_mut()).enumerate() {
        if let (true, true, Some(g)) = (cap > 0, continuing[i], rec.grammar.as_mut()) {
            forced[i] = g.forced_tokens(cap.min(room[i]));
            r.next_draft.clone_from(&forced[i]);
            rec.draft = Draft { tokens: forced[i].clone(), probs: None };
        }
    }
    forced
}

/// Runs the proposer over `reqs`: their drafts, or `None` when it fails or panics. That costs this
/// step's drafts, never the step: the sequences decode without drafts next step and the proposer
/// forgets them, what it keeps and what their records keep for it (either may be half-updated),
/// so they catch up from their history.
fn run_proposer(ctx: &JobContext, sp: &mut Speculation, step: u64, reqs: &mut [DraftRequest]) -> Option<Vec<Draft>> {
    let proposed = catch_unwind(AssertUnwindSafe(|| {
        let drafts = sp.proposer.propose(reqs, &ctx.pool)?;
        FaultInjection::trip(ctx.fault, step, FaultPhase::Propose)?;
        Ok::<_, StepFailure>(drafts)
    }))
    .unwrap_or_else(|p| Err(StepFailure::Invariant(format!("the proposer panicked: {}", panic_message(&p)))));
    match proposed {
        Ok(drafts) => Some(drafts),
        Err(e) => {
            tracing::error!(step, sequences = reqs.len(), "speculative proposer failed; decoding without drafts next step: {e}");
            for r in reqs {
                *r.drafting = SeqDrafting::default();
                if catch_unwind(AssertUnwindSafe(|| sp.proposer.remove(r.seq))).is_err() {
                    tracing::error!(seq = %r.seq, "the proposer panicked again while forgetting the sequence");
                }
            }
            None
        }
    }
}
