//! Choosing how many tokens to draft per sequence and step, so speculation never makes serving
//! slower. Each sequence keeps an estimate of its per-position acceptance `a`; a step with `k`
//! drafts then emits `1 + a + ... + a^k` tokens on average and costs
//! [`CostModel::step_cost`] plain steps (the target's verify curve at this batch size, measured at
//! start-up or given, plus the proposer's own work per draft token). The tracker picks
//! the k with the best tokens per cost, none when no k beats a plain step, with a one-token probe
//! every few steps so a sequence whose text turns predictable can recover. A new sequence starts
//! from the engine-wide acceptance, so a workload the proposer does not predict never pays for a
//! warm-up at full k. Large batches get fewer drafts per sequence (a step-wide token budget): the
//! verification of many sequences' drafts is compute-bound on a CPU.

use super::cost::CostModel;
use specula_model::ModelConfig;

/// Extra cost of verifying one more token in a batch-1 step, relative to the step. Measured in
/// the engine (`specula serve`, per-phase step times of `/metrics`, the held-out chat prompts,
/// default model, 2 threads): a plain step's forward pass 5.9-6.3 ms, one verifying 1 + 1
/// tokens 7.8-8.5 ms (1.25-1.38x: the int8 matmul kernels at one activation row are bound by
/// their instructions, not only by reading the weights, so a second row is not free). The verify
/// curve (`specula bench offline --verify-curve`) gives 1.8, 0.9 and 1.6 ms for the 2nd, 3rd and
/// 4th token. Was 0.13, from that curve's ratios alone; with it the mtp head drafted at
/// acceptances that do not repay the step (134 against 148 tok/s for 0.28, same run).
pub const VERIFY_COST_PER_TOKEN: f64 = 0.28;

/// Steps a paused sequence waits before probing with one draft token.
pub const PROBE_EVERY: u32 = 8;

/// How fast old observations fade (per verify step).
const DECAY: f64 = 0.8;

/// Weights of the engine-wide estimate and of the prior a new sequence starts from.
const GLOBAL_DECAY: f64 = 0.98;
const PRIOR_WEIGHT: f64 = 2.0;

/// Acceptance as success / failure counts of draft positions (a rejection at position `i + 1`
/// after `i` accepted is `i` successes and one failure; all `k` accepted is `k` successes).
#[derive(Clone, Debug)]
pub struct AcceptanceTracker {
    succ: f64,
    fail: f64,
    decay: f64,
    steps_since_probe: u32,
}

impl Default for AcceptanceTracker {
    /// Optimistic until measured: acceptance 0.7 with the weight of two observations.
    fn default() -> Self {
        Self::with_prior(0.7, PRIOR_WEIGHT, DECAY)
    }
}

impl AcceptanceTracker {
    pub fn with_prior(alpha: f64, weight: f64, decay: f64) -> Self {
        let a = alpha.clamp(0.0, 1.0);
        Self { succ: a * weight, fail: (1.0 - a) * weight, decay, steps_since_probe: 0 }
    }

    /// The engine-wide tracker: a slow average over every sequence.
    pub fn global() -> Self {
        Self::with_prior(0.7, PRIOR_WEIGHT, GLOBAL_DECAY)
    }

    /// A new sequence's tracker, starting from the engine-wide estimate.
    pub fn from_global(global: &AcceptanceTracker) -> Self {
        Self::with_prior(global.alpha(), PRIOR_WEIGHT, DECAY)
    }

    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.succ = self.succ * self.decay + accepted.min(proposed) as f64;
        self.fail = self.fail * self.decay + if accepted < proposed { 1.0 } else { 0.0 };
    }

    /// Estimated probability that a draft token is accepted given the ones before it were.
    pub fn alpha(&self) -> f64 {
        let n = self.succ + self.fail;
        if n <= 0.0 {
            0.0
        } else {
            self.succ / n
        }
    }

    /// Draft length for the next step of a sequence decoding among `batch`: the best `k <= k_max`
    /// by expected tokens per cost, or 0 (with a one-token probe every `PROBE_EVERY` steps while
    /// paused).
    pub fn next_k(&mut self, k_max: usize, cost: &CostModel, batch: usize) -> usize {
        if k_max == 0 {
            return 0;
        }
        let k = best_k(self.alpha(), k_max, cost, batch);
        if k > 0 {
            self.steps_since_probe = 0;
            return k;
        }
        self.steps_since_probe += 1;
        if self.steps_since_probe >= PROBE_EVERY {
            self.steps_since_probe = 0;
            return 1;
        }
        0
    }
}

/// Expected tokens emitted by a step with `k` drafts at per-position acceptance `alpha`.
pub fn expected_tokens(alpha: f64, k: usize) -> f64 {
    (0..=k).map(|i| alpha.powi(i as i32)).sum()
}

/// The `k` in `0..=k_max` with the most expected tokens per unit of step cost, for a sequence
/// decoding among `batch`.
pub fn best_k(alpha: f64, k_max: usize, cost: &CostModel, batch: usize) -> usize {
    best_k_gain(alpha, k_max, cost, batch).0
}

/// [`best_k`] and its expected tokens per unit of step cost (1 for k = 0: a plain step).
pub fn best_k_gain(alpha: f64, k_max: usize, cost: &CostModel, batch: usize) -> (usize, f64) {
    let mut best = (0, 1.0);
    for k in 1..=k_max {
        let gain = expected_tokens(alpha, k) / cost.step_cost(batch, k);
        // a longer draft must beat the shorter one clearly, not by rounding
        if gain > best.1 * 1.01 {
            best = (k, gain);
        }
    }
    best
}

/// Bands of a proposer's support (`Proposer::support`: the n-gram match length) that keep
/// their own acceptance estimate: 1, 2, 3-4, 5-8, 9-16, 17 and more tokens. On the code-edit
/// set (Qwen2.5-Coder-1.5B, greedy) a draft's first token was kept 32% of the time after a
/// 1-token match, and 13.5 of 16 drafts were kept after matches of 12 and more.
pub const SUPPORT_BANDS: usize = 6;

/// The band of a support of `len` >= 1 tokens.
pub fn support_band(len: usize) -> usize {
    match len {
        0..=2 => len.saturating_sub(1),
        3..=4 => 2,
        5..=8 => 3,
        9..=16 => 4,
        _ => 5,
    }
}

/// Tokens a sequence is expected to still generate when its `max_tokens` allows more and no
/// finished output says otherwise: the gain a proposer's catch-up is weighed against
/// (`catch_up_pays`).
pub const CATCH_UP_HORIZON: usize = 256;

/// The output lengths of the last `OutputLengths::WINDOW` sequences that finished: how much a
/// running sequence is expected to still generate (its mean residual length), which a catch-up
/// is weighed against. `max_tokens` alone overstated it: at concurrency 8 a draft model caught up
/// with sequences about to end, its catch-ups cost 6.1 s of a run to save 5.2 s of target time.
#[derive(Clone, Debug, Default)]
pub struct OutputLengths {
    recent: std::collections::VecDeque<usize>,
}

impl OutputLengths {
    pub const WINDOW: usize = 256;
    /// Finished outputs longer than a sequence's current length needed before they are trusted.
    pub const MIN_SAMPLES: usize = 4;

    pub fn record(&mut self, len: usize) {
        if self.recent.len() == Self::WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(len);
    }

    /// Tokens a sequence that has generated `generated` and may generate `room` more is expected
    /// to still generate: the mean of `L - generated` over the finished lengths `L > generated`
    /// (at least `MIN_SAMPLES` of them; else `CATCH_UP_HORIZON`), at most `room` and the horizon.
    pub fn expected_remaining(&self, generated: usize, room: usize) -> usize {
        let cap = room.min(CATCH_UP_HORIZON);
        let (n, sum) = self.recent.iter().filter(|&&l| l > generated).fold((0usize, 0usize), |(n, s), &l| (n + 1, s + (l - generated)));
        if n < Self::MIN_SAMPLES {
            return cap;
        }
        cap.min(sum.div_ceil(n))
    }
}

/// Whether drafting `k` tokens per step for a sequence decoding among `batch`, at acceptance
/// `alpha`, repays a catch-up over `backlog` tokens first (a draft model that did not draft for
/// the sequence while the batch was too large for speculation to pay, and must now feed its
/// prompt and everything generated since): the plain steps saved over the next `remaining`
/// tokens against the catch-up's cost, both in target one-token steps.
pub fn catch_up_pays(alpha: f64, k: usize, cost: &CostModel, batch: usize, backlog: usize, remaining: usize) -> bool {
    let gain = expected_tokens(alpha, k) / cost.step_cost(batch, k);
    let saved = remaining as f64 * (1.0 - 1.0 / gain).max(0.0) * cost.plain_step(batch);
    saved > cost.catch_up(backlog)
}

/// Most drafts per sequence in a step where `decoding` sequences decode: none above `max_batch`
/// sequences, and at most `max_step_tokens` tokens verified in the step.
pub fn batch_k_limit(decoding: usize, k: usize, max_batch: usize, max_step_tokens: usize) -> usize {
    if decoding == 0 || decoding > max_batch {
        return 0;
    }
    (max_step_tokens / decoding).saturating_sub(1).min(k)
}

/// Multiply-adds of one Llama decoder layer per token (q/k/v/o projections and a gated FFN).
pub fn layer_matmul_cost(hidden: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, ffn: usize) -> f64 {
    let (h, hd) = (hidden as f64, head_dim as f64);
    let attn = h * (n_heads + 2 * n_kv_heads) as f64 * hd + n_heads as f64 * hd * h;
    attn + 3.0 * h * ffn as f64
}

/// Multiply-adds of a dense Llama-shaped model per token (its matmuls), for cost ratios.
pub fn matmul_cost(c: &ModelConfig) -> f64 {
    let layer = layer_matmul_cost(c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size);
    c.n_layers as f64 * layer + (c.vocab_size * c.hidden_size) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(c: f64) -> CostModel {
        CostModel::linear(c, 0.0)
    }

    #[test]
    fn expected_remaining_is_the_mean_residual_of_finished_lengths() {
        let mut l = OutputLengths::default();
        // nothing finished yet: max_tokens' room, up to the horizon
        assert_eq!(l.expected_remaining(10, 1000), CATCH_UP_HORIZON);
        assert_eq!(l.expected_remaining(10, 40), 40);
        for len in [100, 200, 220, 240, 260] {
            l.record(len);
        }
        // at 150 tokens: (50 + 70 + 90 + 110) / 4 = 80
        assert_eq!(l.expected_remaining(150, 1000), 80);
        assert_eq!(l.expected_remaining(150, 30), 30);
        // at 0: the mean, 204
        assert_eq!(l.expected_remaining(0, 1000), CATCH_UP_HORIZON.min(204));
        // past all but one finished length: too few to say, the room again
        assert_eq!(l.expected_remaining(250, 1000), CATCH_UP_HORIZON);
        // the window keeps the newest
        for _ in 0..OutputLengths::WINDOW {
            l.record(10);
        }
        assert_eq!(l.expected_remaining(0, 1000), 10);
    }

    #[test]
    fn expected_tokens_is_the_geometric_sum() {
        assert_eq!(expected_tokens(0.5, 0), 1.0);
        assert_eq!(expected_tokens(0.5, 3), 1.875);
        assert_eq!(expected_tokens(1.0, 4), 5.0);
    }

    #[test]
    fn k_follows_acceptance_and_cost() {
        // cheap drafts (n-gram) at high acceptance: all of them
        assert_eq!(best_k(0.9, 4, &linear(VERIFY_COST_PER_TOKEN), 1), 4);
        // a = 0.7: 1 + a + a^2 = 2.19 for 1.56 beats k = 1 (1.7 / 1.28) and k = 3 (2.533 / 1.84)
        assert_eq!(best_k(0.7, 4, &linear(VERIFY_COST_PER_TOKEN), 1), 2);
        // a = 0.5: one draft (1.5 / 1.28 against 1.75 / 1.56)
        assert_eq!(best_k(0.5, 4, &linear(VERIFY_COST_PER_TOKEN), 1), 1);
        // low acceptance with a proposer that costs as much again: nothing pays
        assert_eq!(best_k(0.14, 4, &linear(VERIFY_COST_PER_TOKEN + 0.06), 1), 0);
        // break-even: 1 + a > 1 + c  <=>  a > c
        assert_eq!(best_k(0.10, 3, &linear(0.13), 1), 0);
        assert_eq!(best_k(0.20, 3, &linear(0.13), 1), 1);
    }

    #[test]
    fn low_acceptance_pauses_drafting_with_probes_and_recovers() {
        let mut t = AcceptanceTracker::default();
        // the optimistic prior (0.7): k = 2
        assert_eq!(t.next_k(4, &linear(VERIFY_COST_PER_TOKEN), 1), 2);
        for _ in 0..6 {
            t.record(4, 0);
        }
        assert!(t.alpha() < 0.1, "{}", t.alpha());
        let ks: Vec<usize> = (0..PROBE_EVERY as usize).map(|_| t.next_k(4, &linear(VERIFY_COST_PER_TOKEN), 1)).collect();
        assert_eq!(ks, [vec![0; PROBE_EVERY as usize - 1], vec![1]].concat());
        for _ in 0..20 {
            t.record(1, 1);
        }
        assert!(t.alpha() > 0.95, "{}", t.alpha());
        assert_eq!(t.next_k(4, &linear(VERIFY_COST_PER_TOKEN), 1), 4);
    }

    #[test]
    fn a_rejection_counts_as_one_failure_after_the_accepted_positions() {
        let mut t = AcceptanceTracker::with_prior(0.5, 0.0, 1.0);
        t.record(4, 2); // 2 accepted, rejected at the 3rd
        t.record(4, 4); // all accepted
        assert_eq!(t.alpha(), 6.0 / 7.0);
    }

    #[test]
    fn new_sequences_start_from_the_engine_wide_acceptance() {
        let mut g = AcceptanceTracker::global();
        for _ in 0..200 {
            g.record(3, 0);
        }
        let mut t = AcceptanceTracker::from_global(&g);
        assert!(t.alpha() < 0.05);
        // no full-k warm-up for a workload the proposer cannot predict
        assert_eq!(t.next_k(3, &linear(VERIFY_COST_PER_TOKEN), 1), 0);
    }

    #[test]
    fn support_bands_split_guesses_from_copies() {
        let bands: Vec<usize> = (1..=20).map(support_band).collect();
        assert_eq!(bands, [0, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5]);
        assert!(bands.iter().all(|&b| b < SUPPORT_BANDS));
    }

    #[test]
    fn a_catch_up_must_be_repaid_by_the_steps_it_saves() {
        // verify: +0.1 per row; a draft step over n rows costs 0.02 n (a draft model)
        let cost = CostModel::from_times(&[(1, 1.0), (2, 1.1), (32, 4.1)], 0.0).with_draft_times(&[(1, 0.02), (32, 0.64)], 1.0);
        assert!((cost.catch_up(500) - 10.0).abs() < 1e-9, "{}", cost.catch_up(500));
        // a = 0.9, k = 4: 4.1 tokens for 1.4 + 0.08 -> gain 2.77, saves 64% of each plain step
        assert!(catch_up_pays(0.9, 4, &cost, 1, 500, 256));
        assert!(!catch_up_pays(0.9, 4, &cost, 1, 500, 10));
        // little gain (a = 0.3, k = 1: 1.3 / 1.12): a long backlog does not pay
        assert!(!catch_up_pays(0.3, 1, &cost, 1, 2000, 256));
        // nothing to catch up: any gain pays
        assert!(catch_up_pays(0.3, 1, &cost, 1, 0, 256));
        // no gain at all: nothing pays
        assert!(!catch_up_pays(0.0, 1, &cost, 1, 0, 256));
    }

    #[test]
    fn large_batches_draft_less_or_not_at_all() {
        assert_eq!(batch_k_limit(1, 3, 8, 16), 3);
        assert_eq!(batch_k_limit(4, 3, 8, 16), 3);
        assert_eq!(batch_k_limit(5, 3, 8, 16), 2);
        assert_eq!(batch_k_limit(8, 3, 8, 16), 1);
        assert_eq!(batch_k_limit(9, 3, 8, 16), 0);
        assert_eq!(batch_k_limit(0, 3, 8, 16), 0);
    }
}
