//! One step's compute job: the forward pass, sampling (or verification) of every sampled row, and
//! the next step's draft proposals. Everything after the forward pass that the next forward pass
//! depends on is here, and nothing else: detokenizing, stop strings and streaming are host work
//! (`crate::host`). The job touches only the compute state (the KV tensors, the sampler, the
//! proposer) and what its items carry (each sampled sequence's random stream, history and
//! draft), so the engine thread runs it with the same code whether the host work of the
//! neighbouring steps runs inline or on the async runner, and so produces the same tokens.

use super::execute;
use crate::config::{FaultInjection, FaultPhase};
use crate::constraint::{TokenMask, JUMP_FORWARD_MAX_TOKENS};
use crate::error::{panic_message, StepError, StepFailure};
use crate::sampling::{pack, ranked_logprob, ranked_logprobs, PackedLogprobs, RankedLogprob, Sampler, SeqRng, TokenHistory};
use crate::sequence::token_finish;
use crate::speculative::{verify, CatchUp, Draft, DraftRequest, Speculation};
use crate::step::{JobOutput, JobTimings, PromptLogprobsOut, PromptRows, SampleItem, SeqResult, StepJob};
use crate::types::{SeqId, TokenId};
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
    let mut inputs = job.inputs;
    inputs.hidden_layers = state.spec.as_ref().map(|sp| sp.proposer.hidden_layers().to_vec()).unwrap_or_default();
    let forward_start = Instant::now();
    let mut items = job.items;
    // the grammar masks depend only on what the items carry: computed on this thread while the
    // forward pass runs on the pool
    let mut masks = Vec::new();
    let out = execute(&ctx.model, &mut state.kv_store, &ctx.pool, &inputs, || {
        while_forward();
        masks = grammar_masks(&mut items, ctx.fault, job.step);
    })?;
    FaultInjection::trip(ctx.fault, job.step, FaultPhase::Forward)?;
    let forward_end = Instant::now();
    tracing::trace!(
        step = job.step,
        tokens = inputs.tokens.len(),
        logits_rows = inputs.logits_rows.len(),
        context = inputs.spans.iter().map(|s| s.context_len).max().unwrap_or(0),
        micros = (forward_end - forward_start).as_micros() as u64,
        "forward pass"
    );
    let (results, logprobs, prompt_logprobs) = sample(ctx, state, job.step, &mut items, &masks, &job.prompt_rows, &out.logits)?;
    let sample_end = Instant::now();
    let results = propose(ctx, state, job.step, items, results, &out.hidden, job.pending_prefill)?;
    let timings = JobTimings { forward_start, forward_end, sample: sample_end - forward_end, propose: sample_end.elapsed() };
    Ok(JobOutput { results, logprobs, prompt_logprobs, timings, _spent: (inputs, out) })
}

/// One constrained item's masks for its verified rows, and how many of its draft tokens its
/// grammar was advanced over to compute them (`Grammar::verification_masks`); `None` for free
/// text; an error fails that item alone (its grammar's matcher failed at run time).
type ItemMasks = Result<Option<(Vec<TokenMask>, usize)>, StepFailure>;

/// The token masks of every constrained item (structured outputs), by item. A matcher that fails
/// (an error, or a panic inside llguidance) fails its own item only; the others are masked as usual.
fn grammar_masks(items: &mut [SampleItem], fault: Option<FaultInjection>, step: u64) -> Vec<ItemMasks> {
    let start = Instant::now();
    let mut rows = 0;
    let masks: Vec<ItemMasks> = items
        .iter_mut()
        .map(|it| match it.grammar.as_mut() {
            None if it.params.constraint.is_some() => {
                Err(StepFailure::Invariant(format!("{}: its constraint's grammar state is missing (an engine bug)", it.seq)))
            }
            Some(g) => {
                let m = catch_unwind(AssertUnwindSafe(|| {
                    FaultInjection::trip(fault, step, FaultPhase::Grammar)?;
                    Ok(g.verification_masks(&it.draft.tokens)?)
                }))
                .unwrap_or_else(|p| Err(StepFailure::Grammar(crate::constraint::ConstraintError(format!("the grammar panicked: {}", panic_message(&p))))))?;
                rows += m.0.len();
                Ok(Some(m))
            }
            None => Ok(None),
        })
        .collect();
    if rows > 0 {
        tracing::debug!(rows, micros = start.elapsed().as_micros() as u64, "grammar masks computed");
    }
    masks
}

/// The result of a constrained item whose grammar failed at run time (its masks, or consuming the
/// sampled tokens): logged, no tokens, and its request alone fails with the error.
fn grammar_failure(seq: SeqId, step: u64, rng: SeqRng, error: impl std::fmt::Display) -> SeqResult {
    let message = format!("structured output failed: {error}");
    tracing::warn!(seq = %seq, "step {step}: {message}");
    SeqResult::failed(rng, message)
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
fn sample(
    ctx: &JobContext,
    state: &mut ComputeState,
    step: u64,
    items: &mut [SampleItem],
    masks: &[ItemMasks],
    prompt_rows: &[PromptRows],
    logits: &[f32],
) -> Result<Sampled, StepFailure> {
    let vocab = ctx.model.config.vocab_size;
    let force_accept = state.spec.as_ref().is_some_and(|sp| sp.cfg.force_accept);
    // only the largest top-k any sequence of this batch asked for is computed
    let k_max = items.iter().filter_map(|it| it.params.logprobs).chain(prompt_rows.iter().map(|p| p.k)).max();
    let mut lp_rows: Vec<RankedLogprob> = Vec::new();
    let mut verified = false;
    let mut results = Vec::with_capacity(items.len());
    let mut masked = Vec::new();
    for (i, it) in items.iter_mut().enumerate() {
        let block = logits
            .get(it.first_row * vocab..(it.first_row + it.rows) * vocab)
            .ok_or_else(|| StepFailure::Invariant(format!("{}: logits rows {}..{} out of range", it.seq, it.first_row, it.first_row + it.rows)))?;
        let num_drafts = it.rows - 1;
        let rng = std::mem::replace(&mut it.rng, SeqRng::new(Some(0), 0));
        let item_masks = match masks.get(i) {
            Some(Err(e)) => {
                results.push(grammar_failure(it.seq, step, rng, e));
                continue;
            }
            Some(Ok(m)) => m.as_ref(),
            None => None,
        };
        // what sampling and verification read: the raw rows, or the rows masked by the grammar
        let rows: &[f32] = match item_masks {
            Some((ms, _)) => {
                masked.clear();
                masked.extend_from_slice(block);
                for (r, m) in ms.iter().enumerate() {
                    m.apply(&mut masked[r * vocab..(r + 1) * vocab]);
                }
                &masked
            }
            None => block,
        };
        // a panic while sampling or verifying this sequence fails it alone, not its neighbours
        let drawn = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<TokenId>, StepFailure> {
            if i == 0 {
                FaultInjection::trip(ctx.fault, step, FaultPhase::SampleSequence)?;
            }
            if num_drafts == 0 {
                let history = TokenHistory { prompt: &it.tokens[..it.prompt_len], output: &it.tokens[it.prompt_len..] };
                Ok(vec![state.sampler.sample(rows, &it.params, history, &rng)?])
            } else {
                let (prompt, output) = it.tokens.split_at(it.prompt_len);
                Ok(verify(rows, vocab, &it.draft, &it.params, prompt, output, &rng, force_accept)?.tokens)
            }
        }));
        let drawn = match drawn {
            Ok(Ok(toks)) => Ok(toks),
            Ok(Err(e)) => Err(format!("sampling this sequence failed: {e}")),
            Err(panic) => Err(format!("sampling this sequence panicked: {}", panic_message(&panic))),
        };
        let mut toks = match drawn {
            Ok(toks) => toks,
            Err(message) => {
                tracing::error!(seq = %it.seq, "step {step}: {message}");
                results.push(SeqResult::failed(rng, message));
                continue;
            }
        };
        verified |= num_drafts > 0;
        let mut grammar = it.grammar.take();
        if let (Some(g), Some((_, consumed))) = (grammar.as_mut(), item_masks) {
            if let Err(e) = g.accept(*consumed, &toks) {
                results.push(grammar_failure(it.seq, step, rng, e));
                continue;
            }
        }
        let grammar_finished = grammar.as_ref().is_some_and(|g| g.is_finished());
        // drafts the rejection sampler accepted (for the acceptance counters)
        let verified_accepted = toks.len() - 1;
        if grammar_finished && toks.len() > 1 && grammar.as_ref().is_some_and(|g| toks.last().is_some_and(|&t| g.is_eos(t))) {
            // an accepted draft completed the grammar, so the row after it could only give EOS:
            // the output ends at that draft token, as it does without speculation (no EOS token)
            toks.pop();
        }
        let lp_first = match (it.params.logprobs, k_max) {
            (Some(_), Some(k)) => {
                let start = lp_rows.len();
                for (j, &tok) in toks.iter().enumerate() {
                    lp_rows.push(ranked_logprob(&block[j * vocab..(j + 1) * vocab], tok, k)?);
                }
                Some(start)
            }
            _ => None,
        };
        // forced drafts (jump-forward): the leading draft tokens at positions whose mask allowed
        // only that token, counted apart from the proposer's
        let forced = match item_masks {
            Some((ms, _)) if ctx.jump_forward => it.draft.tokens.iter().zip(ms).take_while(|(&t, m)| m.allows(t) && m.num_allowed() == 1).count(),
            _ => 0,
        };
        let forced_accepted = verified_accepted.min(forced);
        if num_drafts > 0 {
            if let Some(sp) = state.spec.as_mut() {
                let accepted = toks.len() - 1;
                if forced > 0 {
                    sp.metrics.record_forced(forced, forced_accepted);
                }
                if num_drafts > forced {
                    sp.record(it.seq, num_drafts - forced, verified_accepted - forced_accepted);
                }
                // valid KV ends after the accepted drafts (the one rollback rule, `step::kept_end`)
                sp.proposer.rollback(it.seq, it.kept_end(num_drafts - accepted));
            } else {
                crate::speculative::metrics::record_forced(forced, forced_accepted);
            }
        }
        it.tokens.extend_from_slice(&toks);
        results.push(SeqResult {
            tokens: toks,
            num_drafts,
            lp_first,
            rng,
            grammar,
            grammar_finished,
            next_draft: Draft::default(),
            finished: false,
            failed: None,
        });
        FaultInjection::trip(ctx.fault, step, FaultPhase::Sample)?;
    }
    let mut prompt_out = Vec::with_capacity(prompt_rows.len());
    if let Some(k) = k_max {
        // every prompt row's logprob and top-k, spread over the compute pool (idle once the
        // forward pass is done): scoring a prompt asks one per token
        let mut rows = Vec::with_capacity(prompt_rows.iter().map(|p| p.targets.len()).sum());
        for pr in prompt_rows {
            prompt_out.push(PromptLogprobsOut { seq: pr.seq, first_token: pr.first_token, lp_first: lp_rows.len() + rows.len(), count: pr.targets.len() });
            rows.extend(pr.targets.iter().enumerate().map(|(j, &tok)| (pr.first_row + j, tok)));
        }
        lp_rows.extend(ctx.pool.install(|| ranked_logprobs(logits, vocab, &rows, k))?);
    }
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

/// Drafts for the next step of every sequence that goes on decoding (not one that just emitted a
/// stop token or reached its length), from its history including this step's tokens: first the
/// tokens its grammar forces (jump-forward, structured outputs), then the proposer's draft after
/// them, cut at the first token the grammar forbids; together within the engine's k (without a
/// speculative method, [`JUMP_FORWARD_MAX_TOKENS`] forced tokens) and the sequence's room.
fn propose(
    ctx: &JobContext,
    state: &mut ComputeState,
    step: u64,
    items: Vec<SampleItem>,
    mut results: Vec<SeqResult>,
    hidden: &[f32],
    pending_prefill: usize,
) -> Result<Vec<(SeqId, SeqResult)>, StepFailure> {
    let vocab = ctx.model.config.vocab_size;
    let continuing: Vec<bool> = items
        .iter()
        .zip(&results)
        .map(|(it, r)| {
            let base = it.tokens.len() - r.tokens.len();
            r.failed.is_none()
                && !r.grammar_finished
                && !r
                    .tokens
                    .iter()
                    .enumerate()
                    .any(|(j, &t)| token_finish(&it.params, &ctx.tokenizer, t, base + j + 1 - it.prompt_len, base + j + 1, ctx.max_model_len).is_some())
        })
        .collect();
    for (r, &c) in results.iter_mut().zip(&continuing) {
        r.finished = !c;
    }
    let decoding = continuing.iter().filter(|&&c| c).count();
    // tokens each sequence may still get after the next one (its length and the context)
    let room: Vec<usize> = items
        .iter()
        .map(|it| {
            let output_len = it.tokens.len() - it.prompt_len;
            it.params.max_tokens.saturating_sub(output_len + 1).min(ctx.max_model_len.saturating_sub(it.tokens.len() + 1))
        })
        .collect();
    // jump-forward: the tokens each constrained sequence's grammar forces next, drafted first
    let forced_cap = match state.spec.as_ref() {
        _ if !ctx.jump_forward || decoding == 0 => 0,
        Some(sp) => sp.forced_limit(decoding),
        None => JUMP_FORWARD_MAX_TOKENS,
    };
    let mut forced: Vec<Vec<TokenId>> = vec![Vec::new(); items.len()];
    for (i, r) in results.iter_mut().enumerate() {
        if let (true, true, Some(g)) = (forced_cap > 0, continuing[i], r.grammar.as_mut()) {
            forced[i] = g.forced_tokens(forced_cap.min(room[i]));
            r.next_draft = Draft { tokens: forced[i].clone(), probs: None };
        }
    }
    if let Some(sp) = state.spec.as_mut() {
        let k_limit = sp.batch_k_limit(decoding);
        // forced and proposed drafts together: at most the engine's k (what a decode scheduled
        // ahead reserved)
        let k_engine = sp.cfg.num_speculative_tokens;
        let needs_hidden = sp.proposer.needs_hidden();
        // each row's hidden states: one H-wide state per layer the proposer asked for
        let h = ctx.model.config.hidden_size * sp.proposer.hidden_layers().len();
        if decoding > 0 && (k_limit > 0 || needs_hidden) {
            // the proposer drafts after the forced tokens (one that reads the target's hidden
            // states cannot: it drafts only where nothing is forced)
            let extended: Vec<Option<Vec<TokenId>>> =
                items.iter().zip(&forced).map(|(it, f)| (!f.is_empty() && !needs_hidden).then(|| [&it.tokens[..], &f[..]].concat())).collect();
            let arrived = ctx.queue.waiting.load(std::sync::atomic::Ordering::Relaxed);
            let batch_soon = CatchUp::batch_soon(decoding, pending_prefill, arrived, ctx.max_num_seqs);
            let may_draft = |i: usize| continuing[i] && k_limit > 0 && !items[i].params.disable_speculation;
            let first_decode = |it: &SampleItem| it.tokens.len() - it.prompt_len <= 1;
            // what the proposer must process first for each sequence that may draft (0 for the others)
            let backlogs: Vec<usize> =
                items.iter().enumerate().map(|(i, it)| if may_draft(i) { sp.proposer.backlog(it.seq, it.tokens.len()) } else { 0 }).collect();
            let batch_backlog = CatchUp::batch_backlog(items.iter().zip(&backlogs).filter(|(it, _)| !first_decode(it)).map(|(_, &b)| b));
            let mut reqs = Vec::with_capacity(decoding);
            let mut which = Vec::with_capacity(decoding);
            // hidden rows follow the logits rows: the rows that produced the item's emitted tokens
            for (i, it) in items.iter().enumerate() {
                if !continuing[i] {
                    continue;
                }
                let k = if may_draft(i) {
                    let output_len = it.tokens.len() - it.prompt_len;
                    let catch_up =
                        CatchUp { backlog: backlogs[i], first_decode: first_decode(it), room: room[i], generated: output_len, batch_soon, batch_backlog };
                    let support = sp.proposer.support(it.seq, extended[i].as_deref().unwrap_or(&it.tokens), it.prompt_len);
                    sp.next_k(it.seq, k_limit, decoding, catch_up, support)
                } else {
                    0
                };
                let f = forced[i].len();
                let max_draft = if f > 0 && needs_hidden { 0 } else { k.min(room[i].saturating_sub(f)).min(k_engine.saturating_sub(f)) };
                let hidden = hidden.get(it.first_row * h..(it.first_row + results[i].tokens.len()) * h);
                reqs.push(DraftRequest {
                    seq: it.seq,
                    tokens: extended[i].as_deref().unwrap_or(&it.tokens),
                    prompt_len: it.prompt_len,
                    max_draft,
                    params: &it.params,
                    hidden,
                    rng: Some(&results[i].rng),
                });
                which.push(i);
            }
            if needs_hidden || reqs.iter().any(|r| r.max_draft > 0) {
                // a proposer that fails or panics costs this step's drafts, never the step: its
                // sequences decode without drafts next step and it forgets them (its state for
                // them may be half-updated), so they catch up from their history afterwards
                let proposed = catch_unwind(AssertUnwindSafe(|| {
                    let drafts = sp.proposer.propose(&reqs, &ctx.pool)?;
                    FaultInjection::trip(ctx.fault, step, FaultPhase::Propose)?;
                    Ok::<_, StepFailure>(drafts)
                }))
                .unwrap_or_else(|p| Err(StepFailure::Invariant(format!("the proposer panicked: {}", panic_message(&p)))));
                if proposed.is_err() {
                    for r in &reqs {
                        if catch_unwind(AssertUnwindSafe(|| sp.proposer.remove(r.seq))).is_err() {
                            tracing::error!(seq = %r.seq, "the proposer panicked again while forgetting the sequence");
                        }
                    }
                }
                match proposed {
                    Ok(drafts) => {
                        for (i, mut d) in which.into_iter().zip(drafts) {
                            if d.tokens.iter().any(|&t| t as usize >= vocab) {
                                continue; // a proposer bug must not crash verification
                            }
                            let f = &forced[i];
                            if let Some(g) = results[i].grammar.as_mut() {
                                // a draft ends at the first token the grammar forbids (none if
                                // the matcher fails: the next step's masks fail the sequence)
                                let n = g.valid_prefix_after(f, &d.tokens).unwrap_or_else(|e| {
                                    tracing::warn!(seq = %items[i].seq, "grammar failed on a draft: {e}");
                                    0
                                });
                                d.tokens.truncate(n);
                                if let Some(p) = d.probs.as_mut() {
                                    p.truncate(n);
                                }
                            }
                            if d.tokens.is_empty() {
                                continue; // the forced tokens alone, if any
                            }
                            if !f.is_empty() {
                                // the proposer's draft distributions get one-hot rows for the forced tokens
                                d.probs = d.probs.map(|p| f.iter().map(|&t| one_hot(t, vocab)).chain(p).collect());
                                d.tokens.splice(0..0, f.iter().copied());
                            }
                            results[i].next_draft = d;
                        }
                    }
                    Err(e) => tracing::error!(step, sequences = reqs.len(), "speculative proposer failed; decoding without drafts next step: {e}"),
                }
            }
        }
    }
    Ok(items.iter().map(|it| it.seq).zip(results).collect())
}

/// A draft distribution certain of `t`.
fn one_hot(t: TokenId, vocab: usize) -> Vec<f32> {
    let mut row = vec![0.0; vocab];
    row[t as usize] = 1.0;
    row
}
