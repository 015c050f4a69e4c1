//! The mixture-of-experts feed-forward (Mixtral, Qwen-MoE style) and its expert-parallel form.
//!
//! Each token's normalised hidden state goes through a router (`[n_experts x hidden]`, plus a
//! bias on gpt-oss), the softmax over all experts picks the top k (ties: the lower expert index),
//! and the chosen experts' gated outputs (SwiGLU; gpt-oss: clamped SwiGLU with biases) are summed
//! with those probabilities (renormalised over the k when `norm_topk`, which is the softmax over
//! the k chosen logits that gpt-oss and Mixtral define). The sum always runs in ascending expert index, and every expert output is a
//! row-independent matmul, so a token's result depends neither on the batch nor on which rank
//! computed which expert: DP=1 and any expert partition give the same bits.
//!
//! Expert parallel: rank r of N holds experts `[r*E/N, (r+1)*E/N)`. Per layer, two collectives
//! through an [`ExpertExchange`] (implemented by the engine over its communicator): an
//! all-gather of every rank's rows (hidden state + chosen expert ids, padded to the step's
//! agreed row count) and an all-to-all that returns each expert output to the rank that owns
//! the token. Not here: choosing the padded size or the group (the engine's lockstep loop).

use crate::config::Activation;
use crate::ModelError;
use specula_kernels::matmul::{matmul, matmul_grouped, MatmulInput};
use specula_kernels::ops::{add_bias, gelu_tanh_mul, silu_mul, swiglu_oai_mul};
use specula_kernels::pool::parallel_for;
use specula_kernels::QMatrix;
use std::borrow::Cow;
use std::sync::{Mutex, PoisonError};

/// The collectives an expert-parallel MoE layer makes, implemented by whoever owns the rank
/// group (the engine's lockstep data parallelism). Every rank calls every method in the same
/// order with equal lengths; a failure must reach every rank (no rank may be left waiting).
pub trait ExpertExchange: Send + Sync {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The lockstep loop's agreed row count for the step about to run (at least every rank's
    /// batch size); each rank contributes exactly this many rows to each exchange.
    fn begin_step(&self, rows: usize);
    /// The row count set by the last `begin_step`.
    fn step_rows(&self) -> usize;
    /// Exchanges made since the last `begin_step` (a complete forward pass makes
    /// [`crate::LlamaModel::exchanges_per_forward`]).
    fn exchanges_this_step(&self) -> usize;
    /// Time spent inside the exchanges so far, in nanoseconds (metrics; 0 if not measured).
    fn exchange_nanos(&self) -> u64 {
        0
    }
    /// `out[r * local.len()..][..local.len()]` receives rank r's `local`.
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), ExchangeError>;
    /// `send` holds `size()` equal chunks, chunk j for rank j; `recv` receives chunk i from rank i.
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), ExchangeError>;
    /// This rank cannot finish the exchanges of its forward pass (it panicked mid-way): every
    /// peer's pending and later exchanges must fail instead of waiting for it.
    fn abort(&self);
}

/// Up to this many rows in a step (decode, a verify of a few drafts), a mixture of experts runs all
/// its routed experts in two grouped regions (`DenseFfn::forward_grouped`); above, each expert
/// whole on one thread, the experts spread over the threads (`MoeFfn::run_spread`). On the
/// 12-layer Qwen3-30B-A3B shape (2 threads, AMD EPYC Zen 3, old and new alternating) grouping gave
/// decode 1.01-1.09x, and prefill 512 0.90-0.98x (every expert's buffers at once leave the
/// cache), hence the split; spreading the experts instead of one at a time with its rows split
/// (two parallel regions an expert) gave the layer 1.08-1.17x at 512 rows and 1.12-1.20x at 128
/// (`moe_bench`, alternated in one process, same Zen 3).
const GROUPED_MAX_ROWS: usize = 16;

/// One gated feed-forward: `down(act(gate x) * up x)`. A dense layer's FFN and each expert.
pub struct DenseFfn {
    /// `[ffn x hidden]`
    pub gate: QMatrix,
    /// `[ffn x hidden]`
    pub up: QMatrix,
    /// `[hidden x ffn]`
    pub down: QMatrix,
    /// Biases of the three projections (gpt-oss's experts); none elsewhere.
    pub bias: Option<FfnBias>,
}

/// The biases of a feed-forward's projections.
pub struct FfnBias {
    /// `[ffn]`
    pub gate: Vec<f32>,
    /// `[ffn]`
    pub up: Vec<f32>,
    /// `[hidden]`
    pub down: Vec<f32>,
}

impl DenseFfn {
    /// An FFN without biases.
    pub fn new(gate: QMatrix, up: QMatrix, down: QMatrix) -> Self {
        Self { gate, up, down, bias: None }
    }

    /// `out` (`rows x hidden`) = the FFN of `x` (`rows x hidden`), gated by `act`.
    pub fn forward(&self, x: &[f32], act: Activation, out: &mut [f32]) {
        Self::forward_grouped(&[self], &[x], act, &mut [out]);
    }

    /// `outs[i]` = the FFN `ffns[i]` of `xs[i]`, every FFN's gate and up in one parallel region and
    /// every down in a second (`matmul_grouped`): a mixture of experts' step runs two regions
    /// where one region a matrix ran 2k of them, with one thread left idle at the end of each.
    /// Each FFN's output is the bits of its own [`DenseFfn::forward`].
    pub fn forward_grouped(ffns: &[&DenseFfn], xs: &[&[f32]], act: Activation, outs: &mut [&mut [f32]]) {
        debug_assert!(ffns.len() == xs.len() && xs.len() == outs.len());
        // FFNs handed the same rows (the experts of a decode's one token) share one quantized
        // input: `firsts` holds the first FFN reading each distinct input, `reads` each FFN's
        let same = |a: &[f32], b: &[f32]| std::ptr::eq(a.as_ptr(), b.as_ptr()) && a.len() == b.len();
        let (mut firsts, mut reads) = (Vec::new(), Vec::with_capacity(xs.len()));
        for (i, x) in xs.iter().enumerate() {
            match firsts.iter().position(|&j: &usize| same(xs[j], x)) {
                Some(p) => reads.push(p),
                None => {
                    reads.push(firsts.len());
                    firsts.push(i);
                }
            }
        }
        let inputs: Vec<MatmulInput> = firsts
            .iter()
            .enumerate()
            .map(|(u, &j)| {
                let ws: Vec<&QMatrix> = ffns.iter().zip(&reads).filter(|&(_, &r)| r == u).flat_map(|(f, _)| [&f.gate, &f.up]).collect();
                MatmulInput::new(xs[j], ffns[j].gate.cols, &ws)
            })
            .collect();
        let (mut gates, mut ups): (Vec<Vec<f32>>, Vec<Vec<f32>>) = ffns
            .iter()
            .zip(&reads)
            .map(|(f, &r)| {
                let n = inputs[r].rows * f.gate.rows;
                (vec![0f32; n], vec![0f32; n])
            })
            .unzip();
        {
            let ws: Vec<&QMatrix> = ffns.iter().flat_map(|f| [&f.gate, &f.up]).collect();
            let reads: Vec<usize> = reads.iter().flat_map(|&r| [r, r]).collect();
            let mut gate_up: Vec<&mut [f32]> = gates.iter_mut().zip(ups.iter_mut()).flat_map(|(g, u)| [g.as_mut_slice(), u.as_mut_slice()]).collect();
            matmul_grouped(&inputs.iter().collect::<Vec<_>>(), &reads, &ws, &mut gate_up);
        }
        drop(inputs);
        let gated: Vec<Vec<f32>> = ffns
            .iter()
            .zip(gates.iter_mut().zip(ups.iter_mut()))
            .map(|(f, (gate, up))| {
                if let Some(b) = &f.bias {
                    add_bias(gate, &b.gate);
                    add_bias(up, &b.up);
                }
                let mut gated = vec![0f32; gate.len()];
                match act {
                    Activation::SiluGate => silu_mul(gate, up, &mut gated),
                    Activation::GeluTanhGate => gelu_tanh_mul(gate, up, &mut gated),
                    Activation::SwigluOai => swiglu_oai_mul(gate, up, &mut gated),
                }
                gated
            })
            .collect();
        drop((gates, ups));
        let inputs: Vec<MatmulInput> = ffns.iter().zip(&gated).map(|(f, g)| MatmulInput::new(g, f.down.cols, &[&f.down])).collect();
        let downs: Vec<&QMatrix> = ffns.iter().map(|f| &f.down).collect();
        let reads: Vec<usize> = (0..ffns.len()).collect();
        matmul_grouped(&inputs.iter().collect::<Vec<_>>(), &reads, &downs, outs);
        for (f, out) in ffns.iter().zip(outs.iter_mut()) {
            if let Some(b) = &f.bias {
                add_bias(out, &b.down);
            }
        }
    }

    pub(crate) fn check(&self, hidden: usize, ffn: usize, what: &str) -> Result<(), ModelError> {
        check_shape(&self.gate, ffn, hidden, &format!("{what} gate"))?;
        check_shape(&self.up, ffn, hidden, &format!("{what} up"))?;
        check_shape(&self.down, hidden, ffn, &format!("{what} down"))?;
        if let Some(b) = &self.bias {
            for (v, len, part) in [(&b.gate, ffn, "gate"), (&b.up, ffn, "up"), (&b.down, hidden, "down")] {
                if v.len() != len {
                    return Err(ModelError::BadTensor {
                        name: format!("{what} {part} bias"),
                        message: format!("{} entries but the config needs {len}", v.len()),
                    });
                }
            }
        }
        Ok(())
    }
}

/// Qwen2-MoE's shared expert: every token goes through it, scaled by `sigmoid(gate . x)`.
pub struct SharedExpert {
    pub ffn: DenseFfn,
    /// `[1 x hidden]`; absent: scale 1.
    pub gate: Option<QMatrix>,
}

/// One layer's mixture of experts.
pub struct MoeFfn {
    /// `[n_experts x hidden]`
    pub router: QMatrix,
    /// `[n_experts]`, added to the router's logits (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// The experts' gate (SwiGLU; gpt-oss's clamped SwiGLU).
    pub activation: Activation,
    /// By expert index; `None` for experts another rank holds (expert parallel).
    pub experts: Vec<Option<DenseFfn>>,
    /// Experts per token (top-k).
    pub n_used: usize,
    /// Renormalise the chosen probabilities to sum to 1.
    pub norm_topk: bool,
    pub shared: Option<SharedExpert>,
}

/// Each row's chosen experts, ascending by expert index, and their weights; `k` per row.
/// Inactive rows hold id -1 (no expert runs for them, their output is zero).
struct Routes {
    k: usize,
    ids: Vec<i32>,
    weights: Vec<f32>,
}

/// Whether expert `a` ranks before expert `b` in a row's router logits `l`: the larger logit
/// first, a tie (-0 and +0 included) to the lower index, a NaN after every number (a corrupt
/// router must not make the order inconsistent: the standard library's sorts and selections may
/// panic on one). A strict total order, so the top k are one set whatever algorithm picks them.
fn ranks_before(l: &[f32], a: usize, b: usize) -> std::cmp::Ordering {
    let key = |x: usize| (!l[x].is_nan(), if l[x].is_nan() { 0.0 } else { l[x] });
    let ((na, va), (nb, vb)) = (key(a), key(b));
    nb.cmp(&na).then(vb.partial_cmp(&va).unwrap_or(std::cmp::Ordering::Equal)).then(a.cmp(&b))
}

/// The router's buffers, kept per thread between layers and steps (a decode step routes every
/// MoE layer's one row: three allocations a layer before).
#[derive(Default)]
struct RouterScratch {
    logits: Vec<f32>,
    order: Vec<usize>,
    p: Vec<f32>,
}

/// The largest expert-output buffer (in floats) a thread keeps between layers: a 512-row prefill
/// chunk of a 30B-A3B (33.5 MB), so a prefill does not map, fault in and zero it every layer.
const SLOT_OUTPUTS_KEPT: usize = 1 << 24;

thread_local! {
    static ROUTER_SCRATCH: std::cell::RefCell<RouterScratch> = std::cell::RefCell::default();
    /// The expert outputs of [`MoeFfn::forward`], reused: by slot (`rows x k x hidden`) for a
    /// decode or verify step (64 KB a layer for a decode row of a 30B-A3B), packed by expert for a
    /// prefill.
    static SLOT_OUTPUTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `o += w * y`, element by element: the one form of a routed expert's share in its row, so the
/// prefill's running sum and the batch's weighted sum give the same bits.
fn add_weighted(o: &mut [f32], w: f32, y: &[f32]) {
    for (a, &b) in o.iter_mut().zip(y) {
        *a += w * b;
    }
}

/// An expert with more than `1 / (HOT_EXPERT_SHARE * threads)` of a prefill's routed rows splits
/// them over the threads; the others run whole, one a thread (`MoeFfn::run_spread`).
const HOT_EXPERT_SHARE: usize = 4;

/// Rows of the weighted sum a parallel task adds up.
const SUM_ROWS_PER_TASK: usize = 16;

/// `out` = every row's routed expert outputs (`slot_out(row * k + j)`) times their weights, summed
/// in ascending expert index (the slot order) with [`add_weighted`]; a large batch's rows spread
/// over the threads (a row's sum is the same either way).
fn weighted_sum<'y>(out: &mut [f32], routes: &Routes, h: usize, slot_out: impl Fn(usize) -> &'y [f32] + Sync) {
    let k = routes.k;
    let sum_rows = |r0: usize, rows: &mut [f32]| {
        rows.fill(0.0);
        for (i, o) in rows.chunks_exact_mut(h).enumerate() {
            let r = r0 + i;
            for j in (0..k).filter(|&j| routes.ids[r * k + j] >= 0) {
                add_weighted(o, routes.weights[r * k + j], slot_out(r * k + j));
            }
        }
    };
    let t = out.len() / h;
    if t <= SUM_ROWS_PER_TASK {
        return sum_rows(0, out);
    }
    let chunks: Vec<Mutex<&mut [f32]>> = out.chunks_mut(SUM_ROWS_PER_TASK * h).map(Mutex::new).collect();
    parallel_for(chunks.len(), &|c| sum_rows(c * SUM_ROWS_PER_TASK, &mut chunks[c].lock().unwrap_or_else(PoisonError::into_inner)));
}

/// `xs` = the rows of `x` (`hidden` wide) that slots `picks` (`row * k + j`) belong to, in order.
fn gather_rows(x: &[f32], h: usize, k: usize, picks: &[usize], xs: &mut Vec<f32>) {
    xs.clear();
    picks.iter().for_each(|&i| xs.extend_from_slice(&x[(i / k) * h..(i / k + 1) * h]));
}

/// Where the expert outputs of one rank's rows are computed: all here (no exchange) or spread
/// over the group.
enum Placement<'a> {
    Local,
    Parallel(&'a dyn ExpertExchange),
}

fn check_shape(m: &QMatrix, rows: usize, cols: usize, what: &str) -> Result<(), ModelError> {
    if m.rows != rows || m.cols != cols {
        return Err(ModelError::BadTensor { name: what.into(), message: format!("shape [{}, {}] but the config needs [{rows}, {cols}]", m.rows, m.cols) });
    }
    Ok(())
}

/// An expert exchange failed (the communicator's own error, as text: the model crate knows no
/// communicator).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ExchangeError(pub String);

fn exchange_err(what: &str, e: ExchangeError) -> ModelError {
    ModelError::Exchange(format!("{what}: {e}"))
}

impl MoeFfn {
    pub fn n_experts(&self) -> usize {
        self.experts.len()
    }

    /// Shapes against the config (every expert present, as loaded).
    pub(crate) fn check(&self, hidden: usize, cfg: &crate::config::MoeConfig, layer: usize) -> Result<(), ModelError> {
        check_shape(&self.router, cfg.n_experts, hidden, &format!("blk.{layer}.ffn_gate_inp (router)"))?;
        if self.router_bias.as_ref().is_some_and(|b| b.len() != cfg.n_experts) {
            return Err(ModelError::BadTensor {
                name: format!("blk.{layer}.ffn_gate_inp.bias"),
                message: format!("not one entry per expert ({})", cfg.n_experts),
            });
        }
        if self.experts.len() != cfg.n_experts {
            return Err(ModelError::BadTensor {
                name: format!("blk.{layer} experts"),
                message: format!("{} experts, the config says {}", self.experts.len(), cfg.n_experts),
            });
        }
        for (e, x) in self.experts.iter().enumerate() {
            if let Some(x) = x {
                x.check(hidden, cfg.expert_ffn, &format!("blk.{layer} expert {e}"))?;
            }
        }
        match (&self.shared, cfg.shared_ffn) {
            (Some(s), Some(ff)) => {
                s.ffn.check(hidden, ff, &format!("blk.{layer} shared expert"))?;
                if let Some(g) = &s.gate {
                    check_shape(g, 1, hidden, &format!("blk.{layer}.ffn_gate_inp_shexp"))?;
                }
            }
            (None, None) => {}
            _ => return Err(ModelError::BadTensor { name: format!("blk.{layer} shared expert"), message: "present in some layers only".into() }),
        }
        Ok(())
    }

    /// `out` (`rows x hidden`, overwritten) = this layer's MoE output for `xn` (`rows x hidden`,
    /// the normalised hidden states). Rows with `active[r] == false` (padding of dummy batches:
    /// no KV write, no logits) get zeros and cost no expert work. With an exchange, every rank
    /// must call this for every MoE layer of every step, whatever its batch (0 rows included).
    pub fn forward(&self, xn: &[f32], active: &[bool], exchange: Option<&dyn ExpertExchange>, out: &mut [f32]) -> Result<(), ModelError> {
        let h = self.router.cols;
        let t = active.len();
        debug_assert_eq!(xn.len(), t * h);
        debug_assert_eq!(out.len(), t * h);
        let routes = self.route(xn, active);
        let k = routes.k;
        // taken out of the thread's slot while in use (a forward nested on this thread, through
        // a parallel loop's work stealing, gets a fresh buffer instead of a borrow panic)
        let mut y = SLOT_OUTPUTS.take();
        let ran = if exchange.is_none() && t > GROUPED_MAX_ROWS {
            // a prefill's experts spread over the threads, their outputs packed by expert
            self.pick_experts(0..self.n_experts(), &routes.ids).map(|picked| {
                let n = picked.iter().map(|(_, p)| p.len()).sum::<usize>() * h;
                // every element is written before it is read: grown, never cleared
                if y.len() < n {
                    y.resize(n, 0.0);
                }
                let offsets = self.run_spread(&picked, xn, k, &mut y[..n]);
                let mut packed_at = vec![0usize; t * k];
                for ((_, picks), at) in picked.iter().zip(offsets) {
                    for (j, &slot) in picks.iter().enumerate() {
                        packed_at[slot] = at + j;
                    }
                }
                weighted_sum(out, &routes, h, |slot| &y[packed_at[slot] * h..(packed_at[slot] + 1) * h]);
            })
        } else {
            y.clear();
            y.resize(t * k * h, 0.0);
            let ran = match exchange.map_or(Placement::Local, Placement::Parallel) {
                Placement::Local => self.run_experts(0..self.n_experts(), xn, &routes.ids, k, &mut y),
                Placement::Parallel(ex) => self.exchange_experts(xn, &routes, ex, &mut y),
            };
            ran.map(|()| weighted_sum(out, &routes, h, |slot| &y[slot * h..(slot + 1) * h]))
        };
        // kept for the next layer unless it outgrew a prefill chunk's (or an expert-parallel
        // prefill made it large)
        if y.capacity() <= SLOT_OUTPUTS_KEPT {
            SLOT_OUTPUTS.set(y);
        }
        ran?;
        if let Some(s) = &self.shared {
            self.add_shared(s, xn, active, out);
        }
        Ok(())
    }

    /// Top-k of the router's softmax per active row, sorted by expert index.
    fn route(&self, xn: &[f32], active: &[bool]) -> Routes {
        let (h, e, k) = (self.router.cols, self.router.rows, self.n_used);
        let t = active.len();
        let mut ids = vec![-1i32; t * k];
        let mut weights = vec![0f32; t * k];
        // taken out while in use, as the slot outputs below (the router's matmul runs a parallel
        // loop; a thread that picked up another rank's layer meanwhile gets fresh buffers)
        let mut sc = ROUTER_SCRATCH.take();
        {
            let RouterScratch { logits, order, p } = &mut sc;
            logits.clear();
            logits.resize(t * e, 0.0);
            if t > 0 {
                matmul(&MatmulInput::new(xn, h, &[&self.router]), &self.router, logits);
                if let Some(b) = &self.router_bias {
                    add_bias(logits, b);
                }
            }
            for r in (0..t).filter(|&r| active[r]) {
                let l = &logits[r * e..(r + 1) * e];
                let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                p.clear();
                p.extend(l.iter().map(|&x| (x - max).exp()));
                let sum: f32 = p.iter().sum();
                order.clear();
                order.extend(0..e);
                // the k first in `ranks_before`'s strict order (descending logit, ties to the
                // lower index): one selection over the experts, then the k in index order
                if k < e {
                    order.select_nth_unstable_by(k, |&a, &b| ranks_before(l, a, b));
                }
                let chosen = &mut order[..k];
                chosen.sort_unstable();
                let norm = if self.norm_topk { chosen.iter().map(|&x| p[x]).sum::<f32>() } else { sum };
                for (j, &x) in chosen.iter().enumerate() {
                    ids[r * k + j] = x as i32;
                    weights[r * k + j] = p[x] / norm;
                }
            }
        }
        ROUTER_SCRATCH.set(sc);
        Routes { k, ids, weights }
    }

    /// Every expert in `picked` on its rows, the experts spread over the threads, each run whole
    /// by one (largest first, so the last to finish are small): no barrier per expert, and each
    /// expert's gathering, quantizing and gating run beside the other threads' work instead of
    /// between two parallel regions. Expert `i`'s outputs (`picks.len() x hidden`) land at
    /// `ys[offsets[i] * hidden..]`, `offsets` the running sum of the picks; each is the bits of
    /// that expert's own [`DenseFfn::forward`] (a row's arithmetic never depends on the thread).
    fn run_spread(&self, picked: &[(&DenseFfn, Vec<usize>)], x: &[f32], k: usize, ys: &mut [f32]) -> Vec<usize> {
        let h = self.router.cols;
        let mut offsets = Vec::with_capacity(picked.len());
        let mut regions = Vec::with_capacity(picked.len());
        let (mut rest, mut at) = (ys, 0);
        for (_, picks) in picked {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(picks.len() * h);
            offsets.push(at);
            regions.push(Mutex::new(mine));
            (rest, at) = (tail, at + picks.len());
        }
        let run = |i: usize| {
            let (expert, picks) = &picked[i];
            let mut xs = Vec::with_capacity(picks.len() * h);
            gather_rows(x, h, k, picks, &mut xs);
            let mut out = regions[i].lock().unwrap_or_else(PoisonError::into_inner);
            expert.forward(&xs, self.activation, &mut out);
        };
        // an expert holding a large share of the rows (a hot expert) would leave the other
        // threads idle at the end: it splits its rows over the threads itself, first
        let hot = at / (HOT_EXPERT_SHARE * rayon::current_num_threads().max(1));
        let mut order: Vec<usize> = (0..picked.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(picked[i].1.len()));
        let split = order.partition_point(|&i| picked[i].1.len() > hot.max(GROUPED_MAX_ROWS));
        order[..split].iter().for_each(|&i| run(i));
        parallel_for(order.len() - split, &|n| run(order[split + n]));
        offsets
    }

    /// The experts in `range` that rows were routed to, in index order, each with the slots
    /// (`row * k + j` into `ids`) routed to it, ascending; an error if one is not held here.
    fn pick_experts(&self, range: std::ops::Range<usize>, ids: &[i32]) -> Result<Vec<(&DenseFfn, Vec<usize>)>, ModelError> {
        // one pass over the slots (a prefill's 512 rows route 4096 of them among 128 experts)
        let mut buckets: Vec<Vec<usize>> = vec![Vec::new(); range.len()];
        for (i, &id) in ids.iter().enumerate() {
            if id >= 0 && range.contains(&(id as usize)) {
                buckets[id as usize - range.start].push(i);
            }
        }
        let mut picked = Vec::new();
        for (e, picks) in range.zip(buckets).filter(|(_, p)| !p.is_empty()) {
            let Some(expert) = &self.experts[e] else {
                return Err(ModelError::Exchange(format!("tokens were routed to expert {e}, which this rank does not hold")));
            };
            picked.push((expert, picks));
        }
        Ok(picked)
    }

    /// Runs experts `range` (in index order) over the rows routed to them: `x` is `rows x hidden`,
    /// `ids` its `rows x k` chosen experts; the output for row r, slot j lands at
    /// `y[(r * k + j) * hidden..]`. Rows routed to experts outside `range` are left alone.
    fn run_experts(&self, range: std::ops::Range<usize>, x: &[f32], ids: &[i32], k: usize, y: &mut [f32]) -> Result<(), ModelError> {
        let h = self.router.cols;
        let picked = self.pick_experts(range, ids)?;
        let gather = |picks: &[usize]| -> Vec<f32> {
            let mut xs = Vec::new();
            gather_rows(x, h, k, picks, &mut xs);
            xs
        };
        let mut scatter = |picks: &[usize], ys: &[f32]| {
            for (n, &i) in picks.iter().enumerate() {
                y[i * h..(i + 1) * h].copy_from_slice(&ys[n * h..(n + 1) * h]);
            }
        };
        if x.len() / h > GROUPED_MAX_ROWS {
            // a prefill's experts (of an expert-parallel group) spread over the threads
            let mut ys = vec![0f32; picked.iter().map(|(_, p)| p.len()).sum::<usize>() * h];
            let offsets = self.run_spread(&picked, x, k, &mut ys);
            for ((_, picks), at) in picked.iter().zip(offsets) {
                scatter(picks, &ys[at * h..(at + picks.len()) * h]);
            }
            return Ok(());
        }
        // an expert with one row borrows it, so experts sharing it (a decode's k experts of its one
        // token) are handed the same slice and quantize it once (`forward_grouped`)
        let xs: Vec<Cow<[f32]>> = picked
            .iter()
            .map(|(_, picks)| match picks[..] {
                [i] => Cow::Borrowed(&x[(i / k) * h..(i / k + 1) * h]),
                _ => Cow::Owned(gather(picks)),
            })
            .collect();
        let mut ys: Vec<Vec<f32>> = picked.iter().map(|(_, picks)| vec![0f32; picks.len() * h]).collect();
        let ffns: Vec<&DenseFfn> = picked.iter().map(|(f, _)| *f).collect();
        DenseFfn::forward_grouped(
            &ffns,
            &xs.iter().map(|x| &x[..]).collect::<Vec<_>>(),
            self.activation,
            &mut ys.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>(),
        );
        for ((_, picks), ys) in picked.iter().zip(&ys) {
            scatter(picks, ys);
        }
        Ok(())
    }

    /// The expert-parallel path: gather every rank's rows, run the local experts on the rows
    /// routed to them, send each output back to the rank owning the row.
    fn exchange_experts(&self, xn: &[f32], routes: &Routes, ex: &dyn ExpertExchange, y: &mut [f32]) -> Result<(), ModelError> {
        let (h, k, n) = (self.router.cols, routes.k, ex.size());
        let t = routes.ids.len() / k;
        let p = ex.step_rows();
        let per_rank = self.n_experts() / n;
        // A batch larger than the agreed size is a caller bug; still join both exchanges (with
        // no rows) so the peers are not left waiting, then fail.
        let too_big = t > p;
        let width = h + k;
        let mut send = vec![0f32; p * width];
        for r in 0..p {
            let row = &mut send[r * width..(r + 1) * width];
            if r < t && !too_big {
                row[..h].copy_from_slice(&xn[r * h..(r + 1) * h]);
                for j in 0..k {
                    row[h + j] = routes.ids[r * k + j] as f32;
                }
            } else {
                row[h..].fill(-1.0);
            }
        }
        let mut gathered = vec![0f32; n * p * width];
        ex.all_gather(&send, &mut gathered).map_err(|e| exchange_err("all-gather of expert inputs", e))?;
        drop(send);
        let mut xs = vec![0f32; n * p * h];
        let mut ids = vec![-1i32; n * p * k];
        for row in 0..n * p {
            let g = &gathered[row * width..(row + 1) * width];
            xs[row * h..(row + 1) * h].copy_from_slice(&g[..h]);
            for j in 0..k {
                ids[row * k + j] = g[h + j] as i32;
            }
        }
        drop(gathered);
        let mut back = vec![0f32; n * p * k * h];
        let me = ex.rank();
        let computed = self.run_experts(me * per_rank..(me + 1) * per_rank, &xs, &ids, k, &mut back);
        // join the second exchange even when the experts failed, then report
        let mut recv = vec![0f32; n * p * k * h];
        ex.all_to_all(&back, &mut recv).map_err(|e| exchange_err("all-to-all of expert outputs", e))?;
        computed?;
        if too_big {
            return Err(ModelError::Exchange(format!("batch of {t} rows exceeds the step's agreed {p} rows")));
        }
        for r in 0..t {
            for j in 0..k {
                let id = routes.ids[r * k + j];
                if id < 0 {
                    continue;
                }
                let owner = id as usize / per_rank;
                let src = ((owner * p + r) * k + j) * h;
                y[(r * k + j) * h..(r * k + j + 1) * h].copy_from_slice(&recv[src..src + h]);
            }
        }
        Ok(())
    }

    fn add_shared(&self, s: &SharedExpert, xn: &[f32], active: &[bool], out: &mut [f32]) {
        let h = self.router.cols;
        let live: Vec<usize> = (0..active.len()).filter(|&r| active[r]).collect();
        if live.is_empty() {
            return;
        }
        let mut xs = Vec::with_capacity(live.len() * h);
        live.iter().for_each(|&r| xs.extend_from_slice(&xn[r * h..(r + 1) * h]));
        let mut ys = vec![0f32; live.len() * h];
        s.ffn.forward(&xs, self.activation, &mut ys);
        let mut scale = vec![1f32; live.len()];
        if let Some(g) = &s.gate {
            matmul(&MatmulInput::new(&xs, h, &[g]), g, &mut scale);
            scale.iter_mut().for_each(|v| *v = specula_kernels::ops::sigmoid(*v));
        }
        for (i, &r) in live.iter().enumerate() {
            for (a, &b) in out[r * h..(r + 1) * h].iter_mut().zip(&ys[i * h..(i + 1) * h]) {
                *a += scale[i] * b;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_kernels::{WeightBytes, WeightFormat};

    /// A router over `e` experts whose rows are `rows(expert)`, with no experts loaded (routing
    /// only).
    fn router_only(e: usize, h: usize, k: usize, row: impl Fn(usize, usize) -> f32) -> MoeFfn {
        let bytes: Vec<u8> = (0..e * h).flat_map(|i| row(i / h, i % h).to_le_bytes()).collect();
        let router = QMatrix::new(WeightFormat::F32, e, h, WeightBytes::owned(bytes), "router").expect("an f32 router");
        MoeFfn {
            router,
            router_bias: None,
            activation: Activation::SiluGate,
            experts: (0..e).map(|_| None).collect(),
            n_used: k,
            norm_topk: true,
            shared: None,
        }
    }

    #[test]
    fn routing_picks_the_top_k_ties_to_the_lower_index() {
        let (e, h, k) = (128, 16, 8);
        // expert x's logit is (x % 10) times the row sum: ties among experts with equal x % 10
        let m = router_only(e, h, k, |x, _| (x % 10) as f32);
        let xn = vec![0.25f32; h];
        let r = m.route(&xn, &[true]);
        // the eight largest: the experts with x % 10 == 9 in index order (9, 19, ..., 79)
        assert_eq!(r.ids, (0..8).map(|i| 10 * i + 9).collect::<Vec<i32>>());
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn nan_router_logits_route_without_panicking() {
        // a hostile or corrupt file: NaN and infinite router rows among finite ones
        let (e, h, k) = (128, 16, 8);
        let m = router_only(e, h, k, |x, d| match x % 7 {
            0 => f32::NAN,
            3 if d == 0 => f32::INFINITY,
            5 if d == 0 => f32::NEG_INFINITY,
            _ => (x * 31 % 17) as f32 * 0.01,
        });
        let xn: Vec<f32> = (0..2 * h).map(|i| (i as f32 * 0.3).sin()).collect();
        let r = m.route(&xn, &[true, true]);
        for row in r.ids.chunks(k) {
            assert!(row.windows(2).all(|w| w[0] < w[1]), "k distinct experts in ascending order: {row:?}");
            assert!(row.iter().all(|&x| (0..e as i32).contains(&x)));
        }
    }

    fn random_f32(rng: &mut impl rand::Rng, rows: usize, cols: usize) -> QMatrix {
        let bytes: Vec<u8> = (0..rows * cols).flat_map(|_| rng.gen_range(-0.5f32..0.5).to_le_bytes()).collect();
        QMatrix::new(WeightFormat::F32, rows, cols, WeightBytes::owned(bytes), "w").expect("an f32 matrix")
    }

    #[test]
    fn a_prefill_spread_over_threads_gives_every_row_its_own_bits() {
        // 48 rows, 6 experts, top 2; the router's bias sends every row to expert 2 (a hot expert:
        // its rows split over the threads) and the rest spread, one expert a thread, with rows
        // left inactive. Each row's output must be the bits of that row run alone (the grouped
        // path of a decode step), whatever the thread count.
        use rand::{Rng, SeedableRng};
        let (e, h, ff, k, t) = (6, 32, 24, 2, 48);
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut m = router_only(e, h, k, |x, d| ((x * 7 + d * 3) % 11) as f32 * 0.1 - 0.5);
        m.router_bias = Some(vec![0.0, 0.0, 4.0, 0.0, 0.0, 0.0]);
        m.experts = (0..e).map(|_| Some(DenseFfn::new(random_f32(&mut rng, ff, h), random_f32(&mut rng, ff, h), random_f32(&mut rng, h, ff)))).collect();
        let xn: Vec<f32> = (0..t * h).map(|_| rng.gen_range(-1f32..1.0)).collect();
        let active: Vec<bool> = (0..t).map(|r| r % 13 != 5).collect();
        let routes = m.route(&xn, &active);
        assert!(routes.ids.chunks(k).zip(&active).all(|(r, &a)| !a || r.contains(&2)), "expert 2 is every active row's");
        let alone: Vec<f32> = (0..t)
            .flat_map(|r| {
                let mut o = vec![0f32; h];
                m.forward(&xn[r * h..(r + 1) * h], &active[r..r + 1], None, &mut o).expect("one row");
                o
            })
            .collect();
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");
            let mut out = vec![f32::NAN; t * h];
            pool.install(|| m.forward(&xn, &active, None, &mut out)).expect("the batch");
            assert!(out.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads: a row's output changed in the batch");
            assert!(out.chunks(h).zip(&active).all(|(o, &a)| a || o.iter().all(|&v| v == 0.0)), "inactive rows are zero");
        }
    }
}
