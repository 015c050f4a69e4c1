//! Scheduler unit tests without a model: sequences, a KV block manager and the scheduler, with
//! each step's result faked (`land`). Every expected value is written out.

use super::*;
use crate::api::SamplingParams;
use crate::types::RequestId;

const BS: usize = 8;

struct Rig {
    sched: Scheduler,
    seqs: BTreeMap<SeqId, Sequence>,
    kv: KvCacheManager,
    // keeps every sequence's event channel open
    _rx: Vec<tokio::sync::mpsc::UnboundedReceiver<crate::api::RequestEvent>>,
}

impl Rig {
    fn new(max_num_seqs: usize, max_num_batched_tokens: usize, num_kv_blocks: usize) -> Self {
        let cfg = EngineConfig { max_num_seqs, max_num_batched_tokens, block_size: BS, num_kv_blocks, enable_prefix_caching: false, ..Default::default() };
        Self { sched: Scheduler::new(cfg), seqs: BTreeMap::new(), kv: KvCacheManager::new(num_kv_blocks, BS, false).unwrap(), _rx: Vec::new() }
    }

    fn add(&mut self, id: u64, prompt_len: usize) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let prompt = (0..prompt_len as u32).map(|t| 1 + t % 50).collect();
        self.seqs.insert(SeqId(id), Sequence::new(SeqId(id), RequestId(id), prompt, SamplingParams::greedy(100), tx));
        self.sched.add(SeqId(id));
        self._rx.push(rx);
    }

    fn schedule(&mut self) -> StepPlan {
        self.sched.schedule(&mut self.seqs, &mut self.kv, 0)
    }

    /// Plans a step while the last one planned is still computing (async scheduling).
    fn schedule_ahead(&mut self, spec_reserve: usize) -> StepPlan {
        self.sched.schedule(&mut self.seqs, &mut self.kv, spec_reserve)
    }

    /// What a step's result does to the host state, faked: every scheduled token is computed and
    /// every sampled sequence gets one new token (no drafts accepted).
    fn land(&mut self, plan: &StepPlan) {
        for sch in &plan.seqs {
            let s = self.seqs.get_mut(&sch.seq).unwrap();
            s.num_computed = sch.start + sch.num_tokens - sch.num_drafts;
            s.num_scheduled = s.num_computed;
            s.draft = Vec::new();
            if sch.sample {
                s.tokens.push(7);
            }
        }
    }
}

/// (seq, start, num_tokens, num_drafts, sample) of each scheduled sequence.
fn shape(plan: &StepPlan) -> Vec<(u64, usize, usize, usize, bool)> {
    plan.seqs.iter().map(|s| (s.seq.0, s.start, s.num_tokens, s.num_drafts, s.sample)).collect()
}

#[test]
fn prefills_are_chunked_to_the_token_budget_and_running_sequences_go_first() {
    let mut r = Rig::new(4, 10, 64);
    r.add(1, 6);
    r.add(2, 7);
    r.add(3, 3);
    let p1 = r.schedule();
    // 6 + 4 = the budget of 10: seq 2 is cut to a 4-token chunk, seq 3 waits
    assert_eq!(shape(&p1), vec![(1, 0, 6, 0, true), (2, 0, 4, 0, false)]);
    assert_eq!(p1.total_tokens, 10);
    assert_eq!(p1.newly_admitted, vec![SeqId(1), SeqId(2)]);
    assert_eq!((r.sched.num_running(), r.sched.num_waiting()), (2, 1));
    r.land(&p1);

    let p2 = r.schedule();
    // seq 1 decodes its sampled token, seq 2 finishes its prompt, seq 3 starts: 1 + 3 + 3
    assert_eq!(shape(&p2), vec![(1, 6, 1, 0, true), (2, 4, 3, 0, true), (3, 0, 3, 0, true)]);
    assert_eq!(p2.total_tokens, 7);
    assert_eq!(p2.newly_admitted, vec![SeqId(3)]);
    r.land(&p2);

    let p3 = r.schedule();
    assert_eq!(shape(&p3), vec![(1, 7, 1, 0, true), (2, 7, 1, 0, true), (3, 3, 1, 0, true)]);
    assert_eq!(p3.total_tokens, 3);
}

#[test]
fn max_num_seqs_caps_the_running_set() {
    let mut r = Rig::new(2, 100, 64);
    for id in 1..=3 {
        r.add(id, 5);
    }
    let p = r.schedule();
    assert_eq!(shape(&p), vec![(1, 0, 5, 0, true), (2, 0, 5, 0, true)]);
    assert_eq!((r.sched.num_running(), r.sched.num_waiting()), (2, 1));
    r.land(&p);
    let p = r.schedule();
    assert_eq!(shape(&p), vec![(1, 5, 1, 0, true), (2, 5, 1, 0, true)]);
}

#[test]
fn a_full_pool_preempts_the_last_admitted_sequence_and_admits_nobody_that_step() {
    // 3 blocks of 8 slots; two 8-token prompts take one block each
    let mut r = Rig::new(4, 100, 3);
    r.add(1, 8);
    r.add(2, 8);
    r.add(3, 2);
    let p1 = r.schedule();
    // seq 3 fits too (its 2 tokens take the third block)
    assert_eq!(shape(&p1), vec![(1, 0, 8, 0, true), (2, 0, 8, 0, true), (3, 0, 2, 0, true)]);
    assert_eq!(r.kv.num_free_blocks(), 0);
    r.land(&p1);

    // seq 1's decode at position 8 needs a second block: seq 3 (admitted last) is preempted for it;
    // seq 2 then needs one too and preempts itself
    let p2 = r.schedule();
    assert_eq!(shape(&p2), vec![(1, 8, 1, 0, true)]);
    assert_eq!(p2.preempted, vec![SeqId(3), SeqId(2)]);
    assert!(p2.newly_admitted.is_empty());
    assert_eq!(r.sched.running(), &[SeqId(1)]);
    assert_eq!(r.sched.waiting().copied().collect::<Vec<_>>(), vec![SeqId(2), SeqId(3)]);
    for id in [2, 3] {
        let s = &r.seqs[&SeqId(id)];
        assert_eq!((s.num_computed, s.num_preemptions, s.draft.len()), (0, 1, 0));
    }
    // seq 1 holds two blocks, seq 2's block is free again
    assert_eq!(r.kv.num_free_blocks(), 1);
    r.land(&p2);

    // nothing was preempted this time: seq 2 recomputes its 9 known tokens (two blocks: no room)
    let p3 = r.schedule();
    assert_eq!(shape(&p3), vec![(1, 9, 1, 0, true)]);
    assert!(p3.preempted.is_empty());
}

#[test]
fn drafts_are_verified_when_they_fit_and_dropped_when_they_do_not() {
    let mut r = Rig::new(4, 4, 64);
    r.add(1, 3);
    let p = r.schedule();
    r.land(&p);
    // 4 known tokens, 3 computed: a decode of 1 + 3 drafts fills the budget of 4 exactly
    r.seqs.get_mut(&SeqId(1)).unwrap().draft = vec![9, 9, 9];
    let p = r.schedule();
    assert_eq!(shape(&p), vec![(1, 3, 4, 3, true)]);
    assert_eq!(r.kv.capacity(SeqId(1)).unwrap(), BS);

    // 4 drafts: 5 tokens > the budget of 4, so this step is a plain decode and the drafts go
    let mut r = Rig::new(4, 4, 64);
    r.add(1, 3);
    let p = r.schedule();
    r.land(&p);
    r.seqs.get_mut(&SeqId(1)).unwrap().draft = vec![9, 9, 9, 9];
    let p = r.schedule();
    assert_eq!(shape(&p), vec![(1, 3, 1, 0, true)]);
    assert!(r.seqs[&SeqId(1)].draft.is_empty());
}

#[test]
fn scheduling_ahead_reserves_kv_for_one_plus_k_placeholders() {
    let mut r = Rig::new(4, 100, 64);
    r.add(1, 6);
    r.add(2, 20);
    let p1 = r.schedule();
    assert_eq!(shape(&p1), vec![(1, 0, 6, 0, true), (2, 0, 20, 0, true)]);
    // p1 is still computing: seq 1 samples in it and ends its KV at 6, seq 2 at 20
    assert!(r.seqs[&SeqId(1)].samples_in_flight() && r.seqs[&SeqId(2)].samples_in_flight());
    let p2 = r.schedule_ahead(3);
    assert_eq!(
        p2.seqs,
        vec![
            ScheduledSeq { seq: SeqId(1), start: 6, num_tokens: 4, num_drafts: 3, sample: true, placeholders: 4 },
            ScheduledSeq { seq: SeqId(2), start: 20, num_tokens: 4, num_drafts: 3, sample: true, placeholders: 4 },
        ]
    );
    assert_eq!(p2.total_tokens, 8);
    assert_eq!(r.seqs[&SeqId(1)].num_placeholders(), 4);
    assert_eq!(r.seqs[&SeqId(2)].num_placeholders(), 4);
    // KV for the worst case: 6 + 4 = 10 slots (2 blocks), 20 + 4 = 24 slots (3 blocks)
    assert_eq!(r.kv.capacity(SeqId(1)).unwrap(), 2 * BS);
    assert_eq!(r.kv.capacity(SeqId(2)).unwrap(), 3 * BS);
    // nothing is known of those tokens yet: the sequences' own state is untouched, but for
    // where their next step starts
    assert_eq!((r.seqs[&SeqId(1)].num_computed, r.seqs[&SeqId(1)].tokens.len()), (0, 6));
    assert_eq!((r.seqs[&SeqId(1)].num_scheduled, r.seqs[&SeqId(2)].num_scheduled), (10, 24));

    r.seqs.get_mut(&SeqId(1)).unwrap().land_placeholders(4);
    assert_eq!(r.seqs[&SeqId(1)].num_placeholders(), 0);
}

#[test]
fn a_budget_too_small_for_the_drafts_schedules_one_placeholder_ahead() {
    let mut r = Rig::new(4, 6, 64);
    r.add(1, 5);
    let p1 = r.schedule();
    assert_eq!(shape(&p1), vec![(1, 0, 5, 0, true)]);
    // 1 + 7 > 6: one token ahead, no drafts
    let p2 = r.schedule_ahead(7);
    assert_eq!(p2.seqs, vec![ScheduledSeq { seq: SeqId(1), start: 5, num_tokens: 1, num_drafts: 0, sample: true, placeholders: 1 }]);
    assert_eq!(r.seqs[&SeqId(1)].num_placeholders(), 1);
}

/// A prefill chunk in flight does not sample: the next chunk is scheduled ahead of it from where
/// it ends, with known tokens and no placeholders; the chunk that ends the prompt samples, so the
/// step after it is a placeholder decode.
#[test]
fn a_prefill_chunk_in_flight_is_followed_by_the_next_chunk_not_by_placeholders() {
    let mut r = Rig::new(4, 8, 64);
    r.add(1, 12);
    let p1 = r.schedule();
    assert_eq!(shape(&p1), vec![(1, 0, 8, 0, false)]);
    assert!(!r.seqs[&SeqId(1)].samples_in_flight());
    let p2 = r.schedule_ahead(3);
    assert_eq!(shape(&p2), vec![(1, 8, 4, 0, true)]);
    assert_eq!(r.seqs[&SeqId(1)].num_placeholders(), 0);
    // p1 lands (it is not the last planned step, so the sequence still starts at 12 next)
    r.seqs.get_mut(&SeqId(1)).unwrap().num_computed = 8;
    assert!(r.seqs[&SeqId(1)].samples_in_flight());
    let p3 = r.schedule_ahead(3);
    assert_eq!(p3.seqs, vec![ScheduledSeq { seq: SeqId(1), start: 12, num_tokens: 4, num_drafts: 3, sample: true, placeholders: 4 }]);
}

#[test]
#[should_panic(expected = "landing 2 placeholders but only 1 are reserved")]
fn placeholders_never_go_below_zero() {
    let mut r = Rig::new(4, 6, 64);
    r.add(1, 5);
    let s = r.seqs.get_mut(&SeqId(1)).unwrap();
    s.add_placeholders(1);
    s.land_placeholders(2);
}

/// `pending_prefill` counts the sequences still to join the decode batch (waiting, or with more
/// than their next token left to compute), at most the seats `max_num_seqs` leaves beside the
/// decoding ones, and the same whether the step before has landed (sync) or is still computing
/// (async, planned ahead).
#[test]
fn pending_prefill_counts_the_sequences_about_to_join_the_decode_batch_alike_sync_and_ahead() {
    let plan_both = |land_first: bool| {
        let mut r = Rig::new(3, 10, 64);
        r.add(1, 4);
        r.add(2, 9);
        r.add(3, 5);
        r.add(4, 5);
        let p1 = r.schedule();
        // seq 1 whole and 6 tokens of seq 2; seqs 3 and 4 wait, and one seat is left for them
        assert_eq!(shape(&p1), vec![(1, 0, 4, 0, true), (2, 0, 6, 0, false)]);
        assert_eq!(p1.pending_prefill, 2);
        if land_first {
            r.land(&p1);
        }
        let p2 = if land_first { r.schedule() } else { r.schedule_ahead(0) };
        // seq 1 decodes, seq 2 finishes its prompt, seq 3 takes the last seat and its first 5
        // tokens: nothing pends but seq 4, which has no seat (3 running)
        (shape(&p2).iter().map(|s| s.0).collect::<Vec<_>>(), p2.pending_prefill)
    };
    assert_eq!(plan_both(true), (vec![1, 2, 3], 0));
    assert_eq!(plan_both(false), (vec![1, 2, 3], 0));
}
