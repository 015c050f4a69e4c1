//! Building one step's flat batch, in two parts so that the first can run ahead of the step
//! before it (async scheduling):
//! - [`prepare`] captures what the scheduler decided, from the host state: each sequence's block
//!   table (KV reserved for the worst case), the input tokens already known, and, the first time a
//!   sequence is scheduled, its compute-side record (`crate::record`);
//! - [`finalize`] completes what only the step before can tell — for a decode scheduled ahead, the
//!   token that step sampled, how many of its drafts were accepted (so where this step starts) and
//!   the drafts proposed for it — drops the sequences that ended, and assembles the flat token ids,
//!   slot mapping, spans, logits rows and the sampled rows of each sequence. It reads only the
//!   prepared step and the step before's output, so the engine thread runs it between two forward
//!   passes in microseconds; what a sequence samples with (history, settings, random stream,
//!   grammar, draft distributions) is its record's, never copied here.
//!
//! Synchronously the two run back to back with nothing to complete.

use crate::error::StepFailure;
use crate::kv_cache::KvCacheManager;
use crate::record::SeqRecord;
use crate::sequence::Sequence;
use crate::step::{BatchInputs, Computed, PreparedSeq, PreparedStep, PromptRows, RowRange, SampleItem, SeqResult, StepJob, StepPlan};
use crate::types::SeqId;
use std::collections::{BTreeMap, BTreeSet};

/// Captures `plan`'s inputs from the host state (see the module docs); a sequence scheduled for
/// the first time hands its compute-side part over into its record.
pub(crate) fn prepare(plan: &StepPlan, seqs: &mut BTreeMap<SeqId, Sequence>, kv: &KvCacheManager) -> Result<Vec<PreparedSeq>, StepFailure> {
    let bs = kv.block_size();
    let mut out = Vec::with_capacity(plan.seqs.len());
    for sch in &plan.seqs {
        let s = seqs.get_mut(&sch.seq).ok_or_else(|| StepFailure::Invariant(format!("sequence {} vanished before its step", sch.seq)))?;
        let block_table: Vec<u32> = kv.block_table(sch.seq)?.iter().map(|b| b.0).collect();
        let end = sch.start + sch.num_tokens;
        if end > block_table.len() * bs {
            return Err(StepFailure::Invariant(format!("sequence {}: positions up to {end} have no KV slots ({} reserved)", sch.seq, block_table.len() * bs)));
        }
        let tokens = if sch.is_ahead() {
            Vec::new()
        } else {
            let known = s.tokens.len();
            (sch.start..end)
                .map(|pos| if pos < known { s.tokens.get(pos) } else { s.draft.get(pos - known) }.copied())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| StepFailure::Invariant(format!("sequence {}: step tokens {}..{end} are not known", sch.seq, sch.start)))?
        };
        let admitted = s.handoff.take().map(|h| SeqRecord::new(s.tokens.clone(), s.prompt_len, s.params.clone(), h.rng, h.grammar));
        // position p's logits give prompt token p + 1: rows start..min(end, prompt_len - 1)
        let prompt_rows = match s.params.prompt_logprobs {
            Some(k) if s.wants_prompt_logprobs() && !sch.is_ahead() && sch.start + 1 < s.prompt_len => {
                let last = end.min(s.prompt_len - 1);
                (sch.start < last).then(|| PromptRows {
                    seq: sch.seq,
                    first_row: 0,
                    first_token: sch.start + 1,
                    targets: s.tokens[sch.start + 1..last + 1].to_vec(),
                    k,
                })
            }
            _ => None,
        };
        out.push(PreparedSeq { block_table, state_slot: kv.state_slot(sch.seq)?, tokens, admitted, prompt_rows });
    }
    Ok(out)
}

/// Settles a prepared step from the output of the step before it (`before`, if it has not been
/// applied to the host state yet) and assembles its batch. `alive` says whether a sequence still
/// runs (not finished, aborted or failed since the step was prepared). Returns the plan as it will
/// run (every entry final) and its compute job; the plan may be empty.
pub(crate) fn finalize(p: PreparedStep, before: Option<&Computed>, alive: impl Fn(SeqId) -> bool, block_size: usize) -> (StepPlan, StepJob) {
    // a failed step's sequences are failed when it is applied: nothing of theirs runs
    let failed: BTreeSet<SeqId> = match before {
        Some(c) if c.outcome.is_err() => c.plan.seqs.iter().map(|s| s.seq).collect(),
        _ => BTreeSet::new(),
    };
    let results: BTreeMap<SeqId, &SeqResult> = match before.map(|c| &c.outcome) {
        Some(Ok(out)) => out.results.iter().map(|(id, r)| (*id, r)).collect(),
        _ => BTreeMap::new(),
    };
    let PreparedStep { step, plan, seqs, transfers } = p;
    let n_seqs = plan.seqs.len();
    let pending_prefill = plan.pending_prefill;
    let mut kept =
        StepPlan { seqs: Vec::with_capacity(n_seqs), preempted: plan.preempted, newly_admitted: plan.newly_admitted, pending_prefill, ..Default::default() };
    let mut inputs = BatchInputs {
        tokens: Vec::with_capacity(plan.total_tokens),
        slots: Vec::with_capacity(plan.total_tokens),
        spans: Vec::with_capacity(n_seqs),
        block_tables: Vec::with_capacity(n_seqs),
        logits_rows: Vec::with_capacity(plan.total_tokens),
        sample_rows: Vec::with_capacity(n_seqs),
        hidden_layers: Vec::new(),
        state_slots: Vec::new(),
    };
    let mut items = Vec::with_capacity(n_seqs);
    let mut admitted = Vec::new();
    let mut prompt_rows = Vec::new();
    for (mut sch, mut ps) in plan.seqs.into_iter().zip(seqs) {
        if !alive(sch.seq) || failed.contains(&sch.seq) {
            continue;
        }
        if sch.is_ahead() {
            // the step before sampled this sequence: no result means it did not run it after all
            let Some(r) = results.get(&sch.seq) else { continue };
            if r.finished {
                continue;
            }
            let Some(&last) = r.tokens.last() else { continue };
            // `start` assumed every draft of the step before accepted
            let rejected = r.num_rejected();
            let draft: &[_] = if r.next_draft.len() < sch.num_tokens { &r.next_draft } else { &[] };
            sch.start -= rejected;
            sch.num_drafts = draft.len();
            sch.num_tokens = 1 + sch.num_drafts;
            ps.tokens.clear();
            ps.tokens.push(last);
            ps.tokens.extend_from_slice(draft);
        }
        if let Some(rec) = ps.admitted.take() {
            admitted.push((sch.seq, rec));
        }
        let q_start = inputs.tokens.len();
        let n = sch.num_tokens;
        inputs.tokens.extend_from_slice(&ps.tokens);
        inputs.slots.extend((sch.start..sch.start + n).map(|pos| ps.block_table[pos / block_size] as usize * block_size + pos % block_size));
        inputs.spans.push(RowRange { q_start, q_len: n, context_len: sch.start + n });
        inputs.block_tables.push(ps.block_table);
        if let Some(slot) = ps.state_slot {
            inputs.state_slots.push(slot as usize);
        }
        if let Some(mut pr) = ps.prompt_rows.take() {
            // before the sampled rows, so logits rows stay in batch order
            let first = q_start + (pr.first_token - 1 - sch.start);
            pr.first_row = inputs.logits_rows.len();
            inputs.logits_rows.extend(first..first + pr.targets.len());
            prompt_rows.push(pr);
        }
        if sch.sample {
            let rows = 1 + sch.num_drafts;
            let first = q_start + n - rows;
            items.push(SampleItem { seq: sch.seq, first_row: inputs.logits_rows.len(), rows, start: sch.start, num_tokens: n });
            inputs.sample_rows.push((sch.seq, inputs.logits_rows.len(), rows));
            inputs.logits_rows.extend(first..first + rows);
        }
        kept.total_tokens += n;
        kept.seqs.push(sch);
    }
    (kept, StepJob { step, inputs, admitted, items, prompt_rows, pending_prefill, transfers })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::StepError;
    use crate::step::{JobOutput, JobTimings, ScheduledSeq};
    use crate::types::TokenId;
    use std::time::{Duration, Instant};

    const BS: usize = 4;

    /// A decode of `1 + k` tokens scheduled ahead: `start` assumes the step before accepted all.
    fn ahead(seq: u64, start: usize, k: usize, table: Vec<u32>) -> (ScheduledSeq, PreparedSeq) {
        let id = SeqId(seq);
        let sch = ScheduledSeq { seq: id, start, num_tokens: 1 + k, num_drafts: k, sample: true, placeholders: 1 + k };
        (sch, PreparedSeq { block_table: table, state_slot: None, tokens: Vec::new(), admitted: None, prompt_rows: None })
    }

    fn result(tokens: Vec<TokenId>, num_drafts: usize, next_draft: Vec<TokenId>, finished: bool) -> SeqResult {
        SeqResult { tokens, num_drafts, lp_first: None, grammar_finished: false, next_draft, finished, failed: None }
    }

    fn computed(plan_seqs: &[u64], results: Vec<(u64, SeqResult)>) -> Computed {
        let plan = StepPlan {
            seqs: plan_seqs.iter().map(|&s| ScheduledSeq { seq: SeqId(s), start: 0, num_tokens: 1, num_drafts: 0, sample: true, placeholders: 0 }).collect(),
            total_tokens: plan_seqs.len(),
            ..Default::default()
        };
        let now = Instant::now();
        let out = JobOutput {
            results: results.into_iter().map(|(s, r)| (SeqId(s), r)).collect(),
            logprobs: None,
            prompt_logprobs: Vec::new(),
            timings: JobTimings { forward_start: now, forward_end: now, sample: Duration::ZERO, propose: Duration::ZERO },
            transfers: Default::default(),
            _spent: (BatchInputs::default(), specula_model::ForwardOutput { logits: vec![], hidden: vec![] }),
        };
        Computed { step: 1, plan, outcome: Ok(out) }
    }

    /// Settling a step scheduled ahead from the step before's output: a sequence whose drafts
    /// were partly rejected starts where the accepted ones end and verifies the drafts proposed
    /// for it; one that finished, one that was aborted and one the step before did not sample
    /// are dropped; a prefill chunk is kept as prepared. The batch is built from what is left.
    #[test]
    fn finalize_completes_decodes_scheduled_ahead_and_drops_what_ended() {
        // seq 1: 6 tokens computed, the step before verified 3 drafts (positions 6..10 → start 10
        // assumed), accepted 1 and sampled 1: tokens 50, 51 → it starts at 8 with draft [60, 61].
        let (s1, p1) = ahead(1, 10, 3, vec![7, 3, 9, 4]);
        // seq 2 finished in the step before (length), seq 3 was aborted since, seq 4 has no result
        let (s2, p2) = ahead(2, 5, 3, vec![11, 12]);
        let (s3, p3) = ahead(3, 5, 3, vec![13, 14]);
        let (s4, p4) = ahead(4, 5, 3, vec![15, 16]);
        // seq 5: a first prefill chunk of 3 known tokens, not sampled, handing its record over
        let s5 = ScheduledSeq { seq: SeqId(5), start: 4, num_tokens: 3, num_drafts: 0, sample: false, placeholders: 0 };
        let rec = SeqRecord::new(vec![1, 2, 3, 4, 90, 91, 92], 7, crate::api::SamplingParams::greedy(8), crate::sampling::SeqRng::new(Some(1), 0), None);
        let p5 = PreparedSeq { block_table: vec![20, 21], state_slot: None, tokens: vec![90, 91, 92], admitted: Some(rec), prompt_rows: None };
        let plan = StepPlan { seqs: vec![s1, s2, s3, s4, s5], total_tokens: 4 * 4 + 3, ..Default::default() };
        let prepared = PreparedStep { step: 7, plan, seqs: vec![p1, p2, p3, p4, p5], transfers: Default::default() };
        let before = computed(
            &[1, 2, 3],
            vec![(1, result(vec![50, 51], 3, vec![60, 61], false)), (2, result(vec![70], 0, vec![], true)), (3, result(vec![71], 0, vec![], false))],
        );

        let (plan, job) = finalize(prepared, Some(&before), |id| id != SeqId(3), BS);

        assert_eq!(job.step, 7);
        let ids: Vec<u64> = plan.seqs.iter().map(|s| s.seq.0).collect();
        assert_eq!(ids, vec![1, 5]);
        // finalized: it runs 1 + 2 tokens from 8; the 4 tokens reserved are given back when applied
        assert_eq!(plan.seqs[0], ScheduledSeq { seq: SeqId(1), start: 8, num_tokens: 3, num_drafts: 2, sample: true, placeholders: 4 });
        assert_eq!(plan.total_tokens, 6);
        assert_eq!(plan.seqs.iter().filter(|s| s.is_ahead()).map(|s| s.seq).collect::<Vec<_>>(), vec![SeqId(1)]);
        let b = &job.inputs;
        assert_eq!(b.tokens, vec![51, 60, 61, 90, 91, 92]);
        // positions 8, 9, 10 of seq 1: block 2 of its table (id 9), offsets 0..3; seq 5: 4..7
        assert_eq!(b.slots, vec![9 * BS, 9 * BS + 1, 9 * BS + 2, 21 * BS, 21 * BS + 1, 21 * BS + 2]);
        assert_eq!(b.spans, vec![RowRange { q_start: 0, q_len: 3, context_len: 11 }, RowRange { q_start: 3, q_len: 3, context_len: 7 }]);
        assert_eq!(b.logits_rows, vec![0, 1, 2]);
        assert_eq!(b.sample_rows, vec![(SeqId(1), 0, 3)]);
        assert_eq!(b.block_tables, vec![vec![7, 3, 9, 4], vec![20, 21]]);
        let it = &job.items[0];
        assert_eq!(job.items, vec![SampleItem { seq: SeqId(1), first_row: 0, rows: 3, start: 8, num_tokens: 3 }]);
        // its record holds the 7 tokens before the step before and that step's 2
        assert_eq!((it.known(), it.num_drafts()), (9, 2));
        assert_eq!(job.admitted.iter().map(|(id, r)| (*id, r.tokens.len())).collect::<Vec<_>>(), vec![(SeqId(5), 7)]);
    }

    /// Drafts that do not fit the reservation are dropped (a plain decode), and a failed step
    /// before takes its sequences out of this one.
    #[test]
    fn finalize_drops_oversized_drafts_and_the_sequences_of_a_failed_step() {
        let (s1, p1) = ahead(1, 4, 1, vec![1, 2]);
        let prepared =
            PreparedStep { step: 1, plan: StepPlan { seqs: vec![s1], total_tokens: 2, ..Default::default() }, seqs: vec![p1], transfers: Default::default() };
        let before = computed(&[1], vec![(1, result(vec![8], 0, vec![60, 61, 62], false))]);
        let (plan, job) = finalize(prepared, Some(&before), |_| true, BS);
        assert_eq!((plan.seqs[0].start, plan.seqs[0].num_tokens, plan.seqs[0].num_drafts), (4, 1, 0));
        assert_eq!(job.inputs.tokens, vec![8]);
        assert_eq!((job.items[0].rows, job.items[0].known()), (1, 5));

        let (s1, p1) = ahead(1, 4, 1, vec![1, 2]);
        let prepared =
            PreparedStep { step: 2, plan: StepPlan { seqs: vec![s1], total_tokens: 2, ..Default::default() }, seqs: vec![p1], transfers: Default::default() };
        let failed = Computed { step: 1, plan: before.plan.clone(), outcome: Err(StepError::Failed { step: 1, failure: StepFailure::Injected }) };
        let (plan, job) = finalize(prepared, Some(&failed), |_| true, BS);
        assert!(plan.is_empty() && job.inputs.tokens.is_empty() && job.items.is_empty());
    }
}
