//! Continuous batching. Each step: running sequences first (decodes and the rest of chunked
//! prefills, so streams keep flowing), then waiting ones in arrival order while the token budget
//! and `max_num_seqs` allow. When the KV pool runs dry the most recently admitted sequence is
//! preempted (its blocks freed, recomputed later from its tokens): never an error, never a hang.

use crate::config::EngineConfig;
use crate::constraint::JUMP_FORWARD_MAX_TOKENS;
use crate::kv_cache::{KvCacheError, KvCacheManager};
use crate::sequence::Sequence;
use crate::types::{SeqId, TokenId};
use std::collections::{BTreeMap, VecDeque};

pub use crate::step::{ScheduledSeq, StepPlan};

pub struct Scheduler {
    cfg: EngineConfig,
    /// Arrival order; preempted sequences go back to the front.
    waiting: VecDeque<SeqId>,
    /// Admission order (the last is the first preemption victim).
    running: Vec<SeqId>,
}

impl Scheduler {
    pub fn new(cfg: EngineConfig) -> Self {
        Self { cfg, waiting: VecDeque::new(), running: Vec::new() }
    }

    pub fn add(&mut self, id: SeqId) {
        self.waiting.push_back(id);
    }

    /// Forgets a sequence wherever it is (finished or aborted). Its KV blocks are freed by the caller.
    pub fn remove(&mut self, id: SeqId) {
        self.waiting.retain(|&s| s != id);
        self.running.retain(|&s| s != id);
    }

    /// Sends every running sequence back to the front of the waiting queue, in admission order
    /// (their KV is gone and they recompute from their tokens).
    pub fn requeue_all(&mut self) {
        for id in self.running.drain(..).rev() {
            self.waiting.push_front(id);
        }
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }
    pub fn running(&self) -> &[SeqId] {
        &self.running
    }
    pub fn waiting(&self) -> impl Iterator<Item = &SeqId> {
        self.waiting.iter()
    }

    /// Plans the next step. What a sequence gets follows from its counters alone: it runs from
    /// `num_scheduled` (its computed tokens, plus those of a step still running, with async
    /// scheduling) to the end of its known tokens and drafts. When the step running samples it
    /// (`Sequence::samples_in_flight`), its next input is not known yet: it gets a decode of
    /// `1 + spec_reserve` placeholder tokens scheduled ahead, its KV reserved for the worst case
    /// (every in-flight draft accepted), counted in `Sequence::num_placeholders`; the engine
    /// finalizes it from the running step's output and `Host::settle` gives the unused slots back.
    /// Synchronously nothing is in flight and `spec_reserve` is never used.
    pub fn schedule(&mut self, seqs: &mut BTreeMap<SeqId, Sequence>, kv: &mut KvCacheManager, spec_reserve: usize) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_num_batched_tokens;

        // 1. running sequences, oldest first
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(s) = seqs.get_mut(&id) else {
                self.running.remove(i);
                continue;
            };
            let ahead = s.samples_in_flight();
            let base = s.num_scheduled;
            // a constrained sequence may get forced drafts without a speculative method (jump-forward)
            let reserve = if spec_reserve == 0 && self.cfg.jump_forward && s.params.constraint.is_some() { JUMP_FORWARD_MAX_TOKENS } else { spec_reserve };
            let n = if ahead {
                if reserve < budget {
                    1 + reserve
                } else {
                    1
                }
            } else {
                if s.pending_tokens() > budget && !s.draft.is_empty() {
                    s.draft = Default::default(); // not enough room to verify: plain decode this step
                }
                // a hybrid's prefill chunk stops where its state is checkpointed
                kv.chunk_len(id, base, (s.tokens.len() + s.draft.len()).saturating_sub(base).min(budget))
            };
            if n == 0 {
                i += 1;
                continue;
            }
            let mut preempted_self = false;
            while kv.ensure_capacity(id, base + n).is_err() {
                let victim = self.running.pop().expect("running holds at least this sequence");
                if let Some(v) = seqs.get_mut(&victim) {
                    Self::preempt(v, kv);
                }
                plan.preempted.push(victim);
                self.waiting.push_front(victim);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            let s = seqs.get_mut(&id).expect("present above");
            if !ahead {
                kv.note_scheduled(id, &s.tokens, base, n);
            }
            let sch = if ahead {
                s.add_placeholders(n);
                ScheduledSeq { seq: id, start: base, num_tokens: n, num_drafts: n - 1, sample: true, placeholders: n }
            } else {
                let num_drafts = if base + n == s.tokens.len() + s.draft.len() { s.draft.len() } else { 0 };
                ScheduledSeq { seq: id, start: base, num_tokens: n, num_drafts, sample: base + n >= s.tokens.len(), placeholders: 0 }
            };
            s.num_scheduled = base + n;
            plan.seqs.push(sch);
            budget -= n;
            i += 1;
        }

        plan.total_tokens = plan.seqs.iter().map(|s| s.num_tokens).sum();
        // 2. waiting sequences in arrival order
        self.admit_waiting(&mut plan, seqs, kv);
        plan
    }

    /// Adds waiting sequences to `plan`, in arrival order, while its token budget,
    /// `max_num_seqs` and the KV pool allow; none if the plan preempted anything (the preempted
    /// go first next time). Also used on a step prepared ahead, for requests that arrived since
    /// (async scheduling), so they do not wait a step longer than without it.
    pub fn admit_waiting(&mut self, plan: &mut StepPlan, seqs: &mut BTreeMap<SeqId, Sequence>, kv: &mut KvCacheManager) {
        let mut budget = self.cfg.max_num_batched_tokens.saturating_sub(plan.total_tokens);
        while plan.preempted.is_empty() && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let Some(s) = seqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            s.draft = Default::default();
            // A request that wants prompt logprobs needs logits for every prompt row, which cached
            // KV blocks do not give: it ignores the prefix cache (recomputes) until they are sent.
            let lookup: &[TokenId] = if s.wants_prompt_logprobs() { &[] } else { &s.tokens };
            match kv.allocate_prompt(id, lookup) {
                Ok(cached) => {
                    s.num_computed = cached;
                    s.num_scheduled = cached;
                    if !s.admitted {
                        s.cached_prompt_tokens = cached.min(s.prompt_len);
                    }
                }
                Err(KvCacheError::SeqExists(_)) => {}
                Err(_) => break,
            }
            let n = kv.chunk_len(id, s.num_computed, (s.tokens.len() - s.num_computed).min(budget));
            if kv.ensure_capacity(id, s.num_computed + n).is_err() {
                kv.release(id);
                s.num_computed = 0;
                s.num_scheduled = 0;
                break;
            }
            kv.note_scheduled(id, &s.tokens, s.num_computed, n);
            self.waiting.pop_front();
            self.running.push(id);
            if !s.admitted {
                s.admitted = true;
                plan.newly_admitted.push(id);
            }
            s.num_scheduled = s.num_computed + n;
            plan.seqs.push(ScheduledSeq {
                seq: id,
                start: s.num_computed,
                num_tokens: n,
                num_drafts: 0,
                sample: s.num_computed + n == s.tokens.len(),
                placeholders: 0,
            });
            plan.total_tokens += n;
            budget -= n;
        }
        // the decode batch they join holds at most max_num_seqs
        let prefilling = self.running.iter().filter(|id| seqs.get(id).is_some_and(|s| s.num_scheduled + 1 < s.tokens.len())).count();
        let decoding = self.running.len() - prefilling;
        plan.pending_prefill = (prefilling + self.waiting.len()).min(self.cfg.max_num_seqs.saturating_sub(decoding));
    }

    fn preempt(s: &mut Sequence, kv: &mut KvCacheManager) {
        kv.release(s.id);
        s.num_computed = 0;
        s.num_scheduled = 0;
        s.draft = Default::default();
        s.num_preemptions += 1;
        metrics::counter!("specula:num_preemptions_total").increment(1);
        tracing::debug!(seq = %s.id, "preempted (KV cache full); will recompute");
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
