//! What speculation costs on this model and machine: the time of a forward pass over `n` new
//! tokens relative to one (the verify curve), and the time of one draft token relative to a
//! one-token target step. Measured once at start-up (`CostModel::measure`, a second or two) or
//! given as figures (`CostModel::linear`), then read by adaptive k ([`super::adaptive`]).
//!
//! Why measured: a 135M model on a 2-core CPU verifies a second token at 1.3x the cost of one (the
//! int8 kernels are bound by instructions), a 1.5B model at about 1.05x (bound by reading 1 GB of
//! weights), a GPU at about 1.0x. Constants tuned on one of them are wrong on the others.

use specula_kernels::attention::KvLayout;
use specula_model::{ForwardBatch, KvStore, LlamaModel, ModelError, SeqSpan};
use std::time::Instant;

/// Rows (new tokens in one forward pass) at which the verify curve is measured; between them it is
/// interpolated, past the last one extended along the last segment's slope (the compute-bound
/// regime, where time grows linearly with rows).
const CURVE_POINTS: [usize; 9] = [1, 2, 3, 4, 6, 8, 12, 16, 32];

/// Context the measured sequence already holds: about a short chat prompt.
const MEASURE_CONTEXT: usize = 64;

/// Timed rounds; each round times every point once (so drift hits them alike) and the fastest
/// round of each point is kept (the least disturbed by other work on the machine).
const MEASURE_ROUNDS: usize = 2;

/// Relative costs of a step, from measurement or given.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// (rows, time of a forward pass over that many new tokens / time of one), rows ascending,
    /// starting at (1, 1.0).
    curve: Vec<(usize, f64)>,
    /// One draft token's work relative to a one-token target step (0 for n-gram lookups), at
    /// batch 1.
    pub draft: f64,
    /// Measured draft steps: (sequences drafting, time of one draft step for them / the target's
    /// one-token step). Empty: a draft step for B sequences costs `draft` x the target's step for
    /// B (the draft scales like the target).
    draft_curve: Vec<(usize, f64)>,
    /// Whether the figures were measured here (else given).
    pub measured: bool,
}

impl CostModel {
    /// Each verified token beyond the first costs `per_token` of a one-token step.
    pub fn linear(per_token: f64, draft: f64) -> Self {
        Self { curve: vec![(1, 1.0), (2, 1.0 + per_token)], draft, draft_curve: Vec::new(), measured: false }
    }

    /// From measured seconds per forward pass at each row count (`(rows, seconds)`, rows
    /// ascending, the first row count 1).
    pub fn from_times(times: &[(usize, f64)], draft: f64) -> Self {
        let t1 = times.first().map_or(1.0, |&(_, t)| t).max(1e-12);
        let mut curve: Vec<(usize, f64)> = times.iter().map(|&(n, t)| (n, t / t1)).collect();
        // time never falls with more rows: what looks like it is noise
        for i in 1..curve.len() {
            curve[i].1 = curve[i].1.max(curve[i - 1].1);
        }
        Self { curve, draft, draft_curve: Vec::new(), measured: true }
    }

    /// With a draft model's measured step times (`(sequences, seconds)`, ascending, from 1),
    /// relative to this model's one-token step of `target_one_token` seconds.
    pub fn with_draft_times(mut self, times: &[(usize, f64)], target_one_token: f64) -> Self {
        let t1 = target_one_token.max(1e-12);
        self.draft_curve = times.iter().map(|&(n, t)| (n, t / t1)).collect();
        for i in 1..self.draft_curve.len() {
            self.draft_curve[i].1 = self.draft_curve[i].1.max(self.draft_curve[i - 1].1);
        }
        if let Some(&(_, d)) = self.draft_curve.first() {
            self.draft = d;
        }
        self
    }

    /// Time of a forward pass over `rows` new tokens relative to one.
    pub fn relative(&self, rows: usize) -> f64 {
        interpolate(&self.curve, rows)
    }

    /// The same verify curve with drafts that cost nothing (an n-gram lookup's).
    pub fn without_drafts(&self) -> Self {
        Self { draft: 0.0, draft_curve: Vec::new(), ..self.clone() }
    }

    /// One draft step for `batch` sequences relative to the target's one-token step.
    fn draft_step(&self, batch: usize) -> f64 {
        if self.draft_curve.is_empty() {
            self.draft * self.relative(batch)
        } else {
            interpolate(&self.draft_curve, batch)
        }
    }

    /// A proposer's catch-up over `tokens` tokens of one sequence (a draft model feeding what it
    /// missed) relative to the target's one-token step: a draft step over that many rows.
    pub fn catch_up(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            0.0
        } else {
            self.draft_step(tokens)
        }
    }

    /// Cost of a step in which `batch` sequences each verify `k` drafts (and propose them),
    /// relative to the same batch's plain step.
    pub fn step_cost(&self, batch: usize, k: usize) -> f64 {
        let batch = batch.max(1);
        let plain = self.relative(batch);
        (self.relative(batch * (1 + k)) + k as f64 * self.draft_step(batch)) / plain
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        let pts = |c: &[(usize, f64)]| c.iter().map(|(n, r)| format!("{n}:{r:.2}")).collect::<Vec<_>>().join(" ");
        let draft = if self.draft_curve.is_empty() { format!("{:.3}", self.draft) } else { pts(&self.draft_curve) };
        format!(
            "{} verify cost (rows:relative) {}, draft step (sequences:relative) {draft}",
            if self.measured { "measured" } else { "given" },
            pts(&self.curve)
        )
    }

    /// Publishes the figures as gauges (`specula:spec_verify_relative_cost{rows}`,
    /// `specula:spec_draft_relative_cost`, the draft token at batch 1).
    pub fn publish(&self) {
        for &(n, r) in &self.curve {
            metrics::gauge!("specula:spec_verify_relative_cost", "rows" => n.to_string()).set(r);
        }
        metrics::gauge!("specula:spec_draft_relative_cost").set(self.draft);
    }
}

/// A piecewise-linear curve through `c` (ascending, from row count 1), extended past its last
/// point along its last segment's slope.
fn interpolate(c: &[(usize, f64)], rows: usize) -> f64 {
    let rows = rows.max(1);
    if let Some(i) = c.iter().position(|&(n, _)| n >= rows) {
        if c[i].0 == rows || i == 0 {
            return c[i].1;
        }
        let ((n0, r0), (n1, r1)) = (c[i - 1], c[i]);
        return r0 + (r1 - r0) * (rows - n0) as f64 / (n1 - n0) as f64;
    }
    let ((n0, r0), (n1, r1)) = if c.len() >= 2 { (c[c.len() - 2], c[c.len() - 1]) } else { ((0, 0.0), c[0]) };
    r1 + (r1 - r0) / (n1 - n0) as f64 * (rows - n1) as f64
}

/// The row counts measured for drafts of up to `max_k` tokens at up to `max_batch` sequences.
pub fn curve_points(max_k: usize, max_batch: usize) -> Vec<usize> {
    let need = (max_batch.max(1) * (1 + max_k)).max(8);
    let last = CURVE_POINTS.iter().position(|&n| n >= need).unwrap_or(CURVE_POINTS.len() - 1);
    CURVE_POINTS[..=last].to_vec()
}

/// Seconds per forward pass of `model` over `n` new tokens of one sequence holding `context`
/// tokens, for each `n` in `points`: the fastest of `rounds` interleaved rounds (after one warm-up
/// round). Runs on the calling thread's rayon pool. Uses its own small KV store.
pub fn time_forward(model: &LlamaModel, points: &[usize], context: usize, rounds: usize) -> Result<Vec<(usize, f64)>, ModelError> {
    let c = &model.config;
    let max_n = points.iter().copied().max().unwrap_or(1);
    let block = 16;
    let blocks = (context + max_n).div_ceil(block);
    let layout = KvLayout { block_size: block, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
    let mut kv = KvStore::new(c.n_layers, layout, blocks, specula_kernels::kv::KvDtype::default())?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let slot = |p: usize| table[p / block] as usize * block + p % block;
    let vocab = c.vocab_size as u32;
    let token = |i: usize| (100 + 7 * i as u32) % vocab;
    if context > 0 {
        let prompt: Vec<u32> = (0..context).map(token).collect();
        let seqs = [SeqSpan { q_start: 0, q_len: context, context_len: context, block_table: &table }];
        let slots: Vec<usize> = (0..context).map(slot).collect();
        model.forward(&ForwardBatch { tokens: &prompt, seqs: &seqs, slots: &slots, logits_rows: &[context - 1], hidden_layers: &[] }, &mut kv)?;
    }
    let mut best = vec![f64::INFINITY; points.len()];
    for round in 0..=rounds {
        for (i, &n) in points.iter().enumerate() {
            let toks: Vec<u32> = (0..n).map(|j| token(context + j)).collect();
            let seqs = [SeqSpan { q_start: 0, q_len: n, context_len: context + n, block_table: &table }];
            let slots: Vec<usize> = (context..context + n).map(slot).collect();
            // verification needs every row's logits
            let rows: Vec<usize> = (0..n).collect();
            let start = Instant::now();
            model.forward(&ForwardBatch { tokens: &toks, seqs: &seqs, slots: &slots, logits_rows: &rows, hidden_layers: &[] }, &mut kv)?;
            if round > 0 {
                best[i] = best[i].min(start.elapsed().as_secs_f64());
            }
        }
    }
    Ok(points.iter().copied().zip(best).collect())
}

/// Measures `model`'s verify curve for drafts of up to `max_k` tokens at up to `max_batch`
/// sequences; `draft` is the draft token's relative cost (see [`measure_draft`]).
pub fn measure(model: &LlamaModel, max_k: usize, max_batch: usize, pool: &rayon::ThreadPool) -> Result<Vec<(usize, f64)>, ModelError> {
    measure_steps(model, &curve_points(max_k, max_batch), pool)
}

/// Seconds of a forward pass of `model` (a draft model) over each row count in `rows`, measured
/// like the verify curve (one sequence's rows stand for as many sequences' one token each: the
/// matmuls, which dominate, are the same).
pub fn measure_steps(model: &LlamaModel, rows: &[usize], pool: &rayon::ThreadPool) -> Result<Vec<(usize, f64)>, ModelError> {
    pool.install(|| time_forward(model, rows, MEASURE_CONTEXT, MEASURE_ROUNDS))
}

/// The batch sizes a draft model's step is measured at: up to `max_batch`, and up to the last
/// curve point in any case, so the curve's last segment has the slope of a compute-bound pass
/// over many rows (what a catch-up over a sequence's missed tokens costs, [`CostModel::catch_up`]).
pub fn draft_batches(max_batch: usize) -> Vec<usize> {
    let last = CURVE_POINTS[CURVE_POINTS.len() - 1];
    CURVE_POINTS.iter().copied().filter(|&n| n <= max_batch.max(last)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_curve_interpolates_and_extends_along_its_last_slope() {
        let m = CostModel::from_times(&[(1, 10.0), (2, 11.0), (4, 13.0), (8, 21.0)], 0.0);
        assert_eq!(m.relative(1), 1.0);
        assert_eq!(m.relative(2), 1.1);
        assert!((m.relative(3) - 1.2).abs() < 1e-12);
        assert!((m.relative(6) - 1.7).abs() < 1e-12);
        // past 8: +0.2 per row
        assert!((m.relative(10) - 2.5).abs() < 1e-12);
    }

    #[test]
    fn noise_never_makes_more_rows_cheaper() {
        let m = CostModel::from_times(&[(1, 10.0), (2, 9.0), (3, 12.0)], 0.0);
        assert_eq!(m.relative(2), 1.0);
        assert_eq!(m.relative(3), 1.2);
    }

    #[test]
    fn linear_figures_and_batch_step_cost() {
        let m = CostModel::linear(0.25, 0.1);
        assert_eq!(m.relative(1), 1.0);
        assert_eq!(m.relative(3), 1.5);
        // one sequence, 2 drafts: 3 rows (1.5) + 2 draft tokens (0.2)
        assert!((m.step_cost(1, 2) - 1.7).abs() < 1e-12);
        // 4 sequences, 1 draft each: 8 rows against 4
        assert!((m.step_cost(4, 1) - (2.75 / 1.75 + 0.1)).abs() < 1e-12);
    }

    #[test]
    fn points_cover_the_largest_step_asked_for() {
        assert_eq!(curve_points(3, 1), vec![1, 2, 3, 4, 6, 8]);
        assert_eq!(curve_points(15, 1), vec![1, 2, 3, 4, 6, 8, 12, 16]);
        assert_eq!(curve_points(3, 8), CURVE_POINTS.to_vec());
        assert_eq!(curve_points(3, 3), vec![1, 2, 3, 4, 6, 8, 12]);
    }
}
