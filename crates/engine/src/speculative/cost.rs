//! What speculation costs on this model and machine: the time of a forward pass over `n` new
//! tokens relative to one (the verify curve), and the time of one draft token relative to a
//! one-token target step. Measured once at start-up (`CostModel::measure`, a second or two) or
//! given as figures (`CostModel::linear`), then read by adaptive k ([`super::adaptive`]).
//!
//! Why measured: a 135M model on a 2-core CPU verifies a second token at 1.3x the cost of one (the
//! int8 kernels are bound by instructions), a 1.5B model at about 1.05x (bound by reading 1 GB of
//! weights), a GPU at about 1.0x. Constants tuned on one of them are wrong on the others.
//!
//! The verify curve is measured at a short context, where attention costs nothing. At depth it
//! does: every verified row attends to the whole context, and on a CPU that work is bound by
//! arithmetic, not by reading the cache once, so a step verifying `1 + k` rows at 16k tokens costs
//! about `1 + k` times a plain step's attention (Qwen2.5-1.5B on a Zen 3: 54 ms of attention per
//! row at 16k beside 35 ms of weights). So attention is measured apart, per key of context and
//! row count ([`time_attention`]), and the step cost is priced at the batch's mean context
//! ([`CostModel::set_context`]): speculation that pays at 500 tokens must not be kept at 64k.

use specula_kernels::attention::{paged_attention_windowed, KvLayout};
use specula_kernels::kv::KvDtype;
use specula_model::config::AttentionKind;
use specula_model::{ForwardBatch, KvStore, LlamaModel, ModelConfig, ModelError, SeqSpan};
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
    /// Attention, measured apart: (rows of one sequence, time of one layer's attention for those
    /// rows per key of context / the one-token step), rows ascending from 1. Empty: attention is
    /// taken as free (given figures, or a proposer's own cost model).
    attention: Vec<(usize, f64)>,
    /// The model's layers as attention sees them: `None` global, `Some(w)` a sliding window of `w`.
    layer_windows: Vec<Option<usize>>,
    /// The mean context of the sequences decoding now: where the step costs are priced.
    context: usize,
}

impl CostModel {
    /// Each verified token beyond the first costs `per_token` of a one-token step.
    pub fn linear(per_token: f64, draft: f64) -> Self {
        Self {
            curve: vec![(1, 1.0), (2, 1.0 + per_token)],
            draft,
            draft_curve: Vec::new(),
            measured: false,
            attention: Vec::new(),
            layer_windows: Vec::new(),
            context: 0,
        }
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
        Self { curve, draft, draft_curve: Vec::new(), measured: true, attention: Vec::new(), layer_windows: Vec::new(), context: 0 }
    }

    /// With attention's measured cost ([`time_attention`]: `(rows, seconds per key of context of
    /// one layer)`) relative to the one-token step of `target_one_token` seconds, for a model whose
    /// layers attend as `layer_windows` says.
    pub fn with_attention_times(mut self, times: &[(usize, f64)], target_one_token: f64, layer_windows: Vec<Option<usize>>) -> Self {
        let t1 = target_one_token.max(1e-12);
        self.attention = times.iter().map(|&(n, t)| (n, t / t1)).collect();
        for i in 1..self.attention.len() {
            self.attention[i].1 = self.attention[i].1.max(self.attention[i - 1].1);
        }
        self.layer_windows = layer_windows;
        self
    }

    /// Prices the steps that follow at a mean context of `tokens` per decoding sequence.
    pub fn set_context(&mut self, tokens: usize) {
        self.context = tokens;
    }

    /// Keys all layers' attention reads for one row at the current context.
    fn keys(&self) -> f64 {
        let c = self.context;
        self.layer_windows.iter().map(|w| w.map_or(c, |w| w.min(c)) as f64).sum()
    }

    /// Time of a step in which `batch` sequences each run `rows` rows, relative to the one-token
    /// step at a short context: the weights' verify curve over all the rows plus each sequence's
    /// attention at the current context.
    fn step_time(&self, batch: usize, rows: usize) -> f64 {
        let attention = if self.attention.is_empty() { 0.0 } else { batch as f64 * interpolate(&self.attention, rows) * self.keys() };
        self.relative(batch * rows) + attention
    }

    /// A plain step of `batch` sequences at the current context relative to the one-token step at
    /// a short context.
    pub fn plain_step(&self, batch: usize) -> f64 {
        self.step_time(batch.max(1), 1)
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

    /// Time of a forward pass over `rows` new tokens relative to one, at a short context.
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
    /// relative to the same batch's plain step, at the current context.
    pub fn step_cost(&self, batch: usize, k: usize) -> f64 {
        let batch = batch.max(1);
        (self.step_time(batch, 1 + k) + k as f64 * self.draft_step(batch)) / self.step_time(batch, 1)
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        let pts = |c: &[(usize, f64)]| c.iter().map(|(n, r)| format!("{n}:{r:.2}")).collect::<Vec<_>>().join(" ");
        let draft = if self.draft_curve.is_empty() { format!("{:.3}", self.draft) } else { pts(&self.draft_curve) };
        let mut line = format!(
            "{} verify cost (rows:relative) {}, draft step (sequences:relative) {draft}",
            if self.measured { "measured" } else { "given" },
            pts(&self.curve)
        );
        if !self.attention.is_empty() {
            let a: Vec<String> = self.attention_per_1k_tokens().map(|(r, t)| format!("{r}:{t:.3}")).collect();
            line.push_str(&format!(", attention per 1k tokens of context (rows:relative) {}", a.join(" ")));
        }
        line
    }

    /// Publishes the figures as gauges (`specula:spec_verify_relative_cost{rows}`,
    /// `specula:spec_draft_relative_cost`, the draft token at batch 1).
    pub fn publish(&self) {
        for &(n, r) in &self.curve {
            metrics::gauge!("specula:spec_verify_relative_cost", "rows" => n.to_string()).set(r);
        }
        metrics::gauge!("specula:spec_draft_relative_cost").set(self.draft);
        for (n, r) in self.attention_per_1k_tokens() {
            metrics::gauge!("specula:spec_attention_relative_cost_per_1k_tokens", "rows" => n.to_string()).set(r);
        }
    }

    /// What 1k tokens of context add to a step of one sequence's `rows` rows, relative to the
    /// one-token step (every layer's attention over 1k more keys, windows aside).
    fn attention_per_1k_tokens(&self) -> impl Iterator<Item = (usize, f64)> + '_ {
        let layers = self.layer_windows.len() as f64;
        self.attention.iter().map(move |&(n, r)| (n, r * layers * 1000.0))
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
    let mut kv = KvStore::for_model(c, layout, blocks, specula_kernels::kv::KvDtype::default(), 1)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let slot = |p: usize| table[p / block] as usize * block + p % block;
    let vocab = c.vocab_size as u32;
    let token = |i: usize| (100 + 7 * i as u32) % vocab;
    if context > 0 {
        let prompt: Vec<u32> = (0..context).map(token).collect();
        let seqs = [SeqSpan { q_start: 0, q_len: context, context_len: context, block_table: &table }];
        let slots: Vec<usize> = (0..context).map(slot).collect();
        model.forward(
            &ForwardBatch { tokens: &prompt, seqs: &seqs, slots: &slots, logits_rows: &[context - 1], hidden_layers: &[], state_slots: &[0] },
            &mut kv,
        )?;
    }
    let mut best = vec![f64::INFINITY; points.len()];
    for round in 0..=rounds {
        for (i, &n) in points.iter().enumerate() {
            let toks: Vec<u32> = (0..n).map(|j| token(context + j)).collect();
            let seqs = [SeqSpan { q_start: 0, q_len: n, context_len: context + n, block_table: &table }];
            let slots: Vec<usize> = (context..context + n).map(slot).collect();
            // verification needs every row's logits
            let rows: Vec<usize> = (0..n).collect();
            // every pass continues from the same position (a hybrid's state is taken as there)
            if let Some(r) = kv.recurrent.as_mut() {
                r.assume_position(0, context);
            }
            let start = Instant::now();
            model.forward(&ForwardBatch { tokens: &toks, seqs: &seqs, slots: &slots, logits_rows: &rows, hidden_layers: &[], state_slots: &[0] }, &mut kv)?;
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

/// Context at which attention's cost is measured: deep enough that the per-key work dominates
/// the per-call overhead, small enough to measure in milliseconds.
const ATTENTION_DEPTH: usize = 4096;

/// Bytes of keys and values the attention measurement cycles through, so that each timed call
/// reads its cache from memory as a deep layer does rather than from a cache the last call warmed.
const ATTENTION_BYTES: usize = 64 << 20;

/// The row counts attention is measured at for drafts of up to `max_k` tokens: one sequence's
/// `1 + k` rows (a batch's sequences each read their own context, so its attention is that many
/// times one sequence's), powers of two up to the first that holds them (interpolated between:
/// past a few rows the time grows about linearly with them).
pub fn attention_points(max_k: usize) -> Vec<usize> {
    let mut points = vec![1];
    while points[points.len() - 1] < 1 + max_k {
        points.push(2 * points[points.len() - 1]);
    }
    points
}

/// How each of the model's layers attends: `None` the whole context, `Some(w)` the last `w`
/// positions.
pub fn layer_windows(c: &ModelConfig) -> Vec<Option<usize>> {
    (0..c.n_layers)
        .map(|l| match c.attention_kind(l) {
            AttentionKind::Global => None,
            AttentionKind::Sliding { window } => Some(window),
        })
        .collect()
}

/// Seconds of one layer's attention per key of context, for one sequence running each row count
/// in `points` at a context of [`ATTENTION_DEPTH`] tokens, its keys and values stored as `dtype`
/// (the serving cache's type: the kernel reads each type at its own speed). The fastest of
/// `rounds` rounds after a warm-up, on the calling thread's rayon pool; the caches are scratch
/// planes of zeros (the kernel's work does not depend on the values).
pub fn time_attention(c: &ModelConfig, dtype: KvDtype, points: &[usize], rounds: usize) -> Result<Vec<(usize, f64)>, ModelError> {
    let block = 16;
    let layout = KvLayout { block_size: block, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
    if !dtype.supports_head_dim(c.head_dim) {
        return Ok(Vec::new());
    }
    let max_n = points.iter().copied().max().unwrap_or(1);
    let per_region = (ATTENTION_DEPTH + max_n).div_ceil(block);
    let region_bytes = 2 * dtype.bytes(layout.kv_width()) * per_region * block;
    let regions = ATTENTION_BYTES.div_ceil(region_bytes.max(1)).clamp(1, 16);
    let kv = KvStore::new(1, layout, regions * per_region, dtype)?;
    let (k, v) = (kv.k[0].view(), kv.v[0].view());
    let tables: Vec<Vec<u32>> = (0..regions).map(|r| (0..per_region).map(|b| (r * per_region + b) as u32).collect()).collect();
    let qw = c.n_heads * c.head_dim;
    let q: Vec<f32> = (0..max_n * qw).map(|i| ((i % 97) as f32 * 0.01).sin()).collect();
    let mut out = vec![0f32; max_n * qw];
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let mut best = vec![f64::INFINITY; points.len()];
    for round in 0..=rounds {
        for (i, &n) in points.iter().enumerate() {
            let start = Instant::now();
            for table in &tables {
                let seqs = [specula_kernels::attention::SeqSpan { q_start: 0, q_len: n, context_len: ATTENTION_DEPTH + n, block_table: table }];
                paged_attention_windowed(&q[..n * qw], &mut out[..n * qw], k, v, &layout, &seqs, scale, None, None);
            }
            if round > 0 {
                best[i] = best[i].min(start.elapsed().as_secs_f64() / regions as f64);
            }
        }
    }
    Ok(points.iter().copied().zip(best).map(|(n, t)| (n, t / (ATTENTION_DEPTH + n) as f64)).collect())
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
    fn attention_prices_each_row_at_the_context() {
        // weights: +0.05 per row; attention: 1e-4 of the one-token step per key and layer for one
        // row, 1.8e-4 for two (the read shared, the arithmetic not); two global layers, one
        // sliding over 1000 positions
        let mut m = CostModel::from_times(&[(1, 1.0), (2, 1.05), (3, 1.1)], 0.0).with_attention_times(
            &[(1, 1e-4), (2, 1.8e-4), (3, 2.6e-4)],
            1.0,
            vec![None, None, Some(1000)],
        );
        // at no context the weights alone
        assert!((m.step_cost(1, 1) - 1.05).abs() < 1e-12);
        m.set_context(4000);
        // keys: 4000 + 4000 + 1000 = 9000; plain 1 + 0.9, one draft 1.05 + 1.62
        assert!((m.plain_step(1) - 1.9).abs() < 1e-9);
        assert!((m.step_cost(1, 1) - 2.67 / 1.9).abs() < 1e-9, "{}", m.step_cost(1, 1));
        // two sequences: the weights over 4 rows (1.15, extended), attention twice
        assert!((m.step_cost(2, 1) - (1.15 + 2.0 * 1.62) / (1.05 + 2.0 * 0.9)).abs() < 1e-9);
        // a draft that paid at a short context (a = 0.2 against +0.05) does not at depth
        let mut shallow = m.clone();
        shallow.set_context(0);
        assert_eq!(crate::speculative::adaptive::best_k(0.2, 2, &shallow, 1), 1);
        assert_eq!(crate::speculative::adaptive::best_k(0.2, 2, &m, 1), 0);
    }

    #[test]
    fn attention_is_measured_per_key_and_grows_with_rows() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("tiny.gguf");
        specula_model::testing::write_tiny_llama(&path, &specula_model::testing::TinySpec::default()).expect("tiny model");
        let c = specula_model::load_model(&path).expect("tiny model").model.config;
        let t = time_attention(&c, KvDtype::F16, &[1, 4], 1).expect("scratch cache");
        assert_eq!(t.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 4]);
        assert!(t.iter().all(|&(_, s)| s > 0.0 && s < 1e-3), "{t:?}");
        assert_eq!(attention_points(3), vec![1, 2, 4]);
        assert_eq!(attention_points(4), vec![1, 2, 4, 8]);
        assert_eq!(attention_points(16), vec![1, 2, 4, 8, 16, 32]);
    }

    #[test]
    fn points_cover_the_largest_step_asked_for() {
        assert_eq!(curve_points(3, 1), vec![1, 2, 3, 4, 6, 8]);
        assert_eq!(curve_points(15, 1), vec![1, 2, 3, 4, 6, 8, 12, 16]);
        assert_eq!(curve_points(3, 8), CURVE_POINTS.to_vec());
        assert_eq!(curve_points(3, 3), vec![1, 2, 3, 4, 6, 8, 12]);
    }
}
