//! A Gated DeltaNet layer (the recurrent layers of Qwen3.5 hybrids, as llama.cpp's `qwen35`
//! builds them) and the per-sequence state it carries between steps (`RecurrentStore`).
//!
//! One layer, for the rows of a step: the mixed q/k/v projection through a short causal
//! convolution (SiLU), L2-normalised queries and keys, a per-head decay `g = softplus(alpha +
//! dt_bias) * a` (`a = -exp(A_log)`, as the file stores it) and write strength `beta =
//! sigmoid(..)`, the gated delta rule over each head's state, a gated RMSNorm (`norm(o) *
//! silu(z)`), and the output projection. A span that starts at position 0 starts from zero state.

use crate::config::RecurrentConfig;
use crate::ModelError;
use specula_kernels::attention::SeqSpan;
use specula_kernels::delta_net::{causal_conv1d_silu, gated_delta_rule, l2_norm_heads, DeltaInputs, DeltaSpan};
use specula_kernels::matmul::{matmul, matmul_many, MatmulInput};
use specula_kernels::ops::{rms_norm_in_place, sigmoid};
use specula_kernels::QMatrix;

/// One recurrent layer's weights (llama.cpp's tensor names in brackets).
pub struct DeltaNetWeights {
    /// `[conv_channels, hidden]`: queries, keys, values (`attn_qkv`).
    pub wqkv: QMatrix,
    /// `[value_width, hidden]`: the output gate `z` (`attn_gate`).
    pub wgate: QMatrix,
    /// `[v_heads, hidden]` each (`ssm_beta`, `ssm_alpha`).
    pub wbeta: QMatrix,
    pub walpha: QMatrix,
    /// `conv_channels x conv_kernel`, the oldest tap first (`ssm_conv1d`).
    pub conv: Vec<f32>,
    /// `[v_heads]` each (`ssm_dt.bias`, `ssm_a`).
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    /// `[head_dim]`: the gated RMSNorm's weight (`ssm_norm`).
    pub norm: Vec<f32>,
    /// `[hidden, value_width]` (`ssm_out`).
    pub wout: QMatrix,
}

impl DeltaNetWeights {
    /// Every tensor has the shape `r` and `hidden` need.
    pub fn check(&self, r: &RecurrentConfig, hidden: usize, layer: usize) -> Result<(), ModelError> {
        let m = |q: &QMatrix, rows: usize, cols: usize, what: &str| match q.rows == rows && q.cols == cols {
            true => Ok(()),
            false => Err(bad(layer, what, format!("shape [{}, {}] but the config needs [{rows}, {cols}]", q.rows, q.cols))),
        };
        let v = |x: &[f32], len: usize, what: &str| match x.len() == len {
            true => Ok(()),
            false => Err(bad(layer, what, format!("{} values but the config needs {len}", x.len()))),
        };
        m(&self.wqkv, r.conv_channels(), hidden, "attn_qkv")?;
        m(&self.wgate, r.value_width(), hidden, "attn_gate")?;
        m(&self.wbeta, r.v_heads, hidden, "ssm_beta")?;
        m(&self.walpha, r.v_heads, hidden, "ssm_alpha")?;
        m(&self.wout, hidden, r.value_width(), "ssm_out")?;
        v(&self.conv, r.conv_channels() * r.conv_kernel, "ssm_conv1d")?;
        v(&self.dt_bias, r.v_heads, "ssm_dt.bias")?;
        v(&self.a, r.v_heads, "ssm_a")?;
        v(&self.norm, r.head_dim, "ssm_norm")
    }

    /// The layer over a step's rows (`xn`: `rows x hidden`, normed), each span continuing from
    /// (and advancing) its sequence's state at `state_slots[i]` in `state`; writes `out`
    /// (`rows x hidden`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        r: &RecurrentConfig,
        eps: f32,
        xn: &[f32],
        hidden: usize,
        seqs: &[SeqSpan],
        state_slots: &[usize],
        state: LayerState,
        scratch: &mut DeltaScratch,
        out: &mut [f32],
    ) {
        let rows = xn.len() / hidden;
        let (c, kw, vw, hv, d) = (r.conv_channels(), r.key_width(), r.value_width(), r.v_heads, r.head_dim);
        let DeltaScratch { qkv, z, beta, alpha, mixed, q, k: k_, v, o } = scratch;
        let (qkv, z, beta, alpha, mixed, o) =
            (sized(qkv, rows * c), sized(z, rows * vw), sized(beta, rows * hv), sized(alpha, rows * hv), sized(mixed, rows * c), sized(o, rows * vw));
        let mats = [&self.wqkv, &self.wgate, &self.wbeta, &self.walpha];
        matmul_many(&MatmulInput::new(xn, hidden, &mats), &mats, &mut [&mut *qkv, &mut *z, &mut *beta, &mut *alpha]);

        let (conv_len, ssm_len) = (r.conv_state_len(), r.delta_shape().state_len());
        for (s, &slot) in seqs.iter().zip(state_slots) {
            let window = &mut state.conv[slot * conv_len..(slot + 1) * conv_len];
            let span = s.q_start * c..(s.q_start + s.q_len) * c;
            if kept_span(s.q_len) {
                // what rolling this span back needs: the state before it and its rows' inputs
                let k = &mut state.kept[slot];
                copy_into(&mut k.conv, window);
                copy_into(&mut k.ssm, &state.ssm[slot * ssm_len..(slot + 1) * ssm_len]);
                copy_into(&mut k.pre, &qkv[span.clone()]);
            }
            causal_conv1d_silu(&qkv[span.clone()], c, &self.conv, r.conv_kernel, window, &mut mixed[span]);
        }
        q.clear();
        k_.clear();
        v.clear();
        for row in mixed.chunks_exact(c) {
            q.extend_from_slice(&row[..kw]);
            k_.extend_from_slice(&row[kw..2 * kw]);
            v.extend_from_slice(&row[2 * kw..]);
        }
        l2_norm_heads(q, d, eps);
        l2_norm_heads(k_, d, eps);
        // the decay's log and the write strength, per row and value head
        for row in 0..rows {
            for h in 0..hv {
                let i = row * hv + h;
                alpha[i] = softplus(alpha[i] + self.dt_bias[h]) * self.a[h];
                beta[i] = sigmoid(beta[i]);
            }
        }
        for (s, &slot) in seqs.iter().zip(state_slots).filter(|(s, _)| kept_span(s.q_len)) {
            let (a, b) = (s.q_start, s.q_start + s.q_len);
            let k = &mut state.kept[slot];
            copy_into(&mut k.q, &q[a * kw..b * kw]);
            copy_into(&mut k.k, &k_[a * kw..b * kw]);
            copy_into(&mut k.v, &v[a * vw..b * vw]);
            copy_into(&mut k.g, &alpha[a * hv..b * hv]);
            copy_into(&mut k.beta, &beta[a * hv..b * hv]);
        }
        let spans: Vec<DeltaSpan> = seqs.iter().zip(state_slots).map(|(s, &slot)| DeltaSpan { start: s.q_start, len: s.q_len, state: slot }).collect();
        let inputs = DeltaInputs { q, k: k_, v, g: alpha, beta };
        gated_delta_rule(r.delta_shape(), &inputs, &spans, state.ssm, o);
        // gated RMSNorm per head: norm(o) * silu(z)
        rms_norm_in_place(o, &self.norm, eps);
        o.iter_mut().zip(z.iter()).for_each(|(x, &g)| *x *= g / (1.0 + (-g).exp()));
        matmul(&MatmulInput::new(o, vw, &[&self.wout]), &self.wout, out);
    }
}

/// A recurrent layer's working buffers, kept across the layers of a forward pass (a prompt's
/// would otherwise be allocated, faulted in and freed again in every layer).
#[derive(Default)]
pub struct DeltaScratch {
    qkv: Vec<f32>,
    z: Vec<f32>,
    beta: Vec<f32>,
    alpha: Vec<f32>,
    mixed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
}

/// `buf` as `n` values (contents unspecified: every user overwrites them all).
fn sized(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    buf.resize(n, 0.0);
    &mut buf[..n]
}

/// ggml's softplus: `ln(1 + e^x)`, `x` itself above 20.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn bad(layer: usize, what: &str, message: String) -> ModelError {
    ModelError::BadTensor { name: format!("blk.{layer}.{what}"), message }
}

/// A span of at most this many rows (a verify step's 1 + k, k drafts) keeps what rolling it back
/// needs; a longer one is a prefill chunk, which is never rolled back, and a single row never is.
const MAX_KEPT_ROWS: usize = 64;

fn kept_span(rows: usize) -> bool {
    (2..=MAX_KEPT_ROWS).contains(&rows)
}

fn copy_into(dst: &mut Vec<f32>, src: &[f32]) {
    dst.clear();
    dst.extend_from_slice(src);
}

/// One recurrent layer's states of every sequence slot, and what each slot kept of its last
/// short span.
pub struct LayerState<'a> {
    pub conv: &'a mut [f32],
    pub ssm: &'a mut [f32],
    kept: &'a mut [Kept],
}

/// What rolling back one slot's last short span in one layer needs: the convolution window and
/// head states before it, its rows' inputs to the convolution, and its rows' inputs to the delta
/// rule. Grown on first use and reused (only sequences that speculate fill it).
#[derive(Default)]
struct Kept {
    conv: Vec<f32>,
    ssm: Vec<f32>,
    pre: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

/// The recurrent state of every sequence slot, per recurrent layer: the convolution's window and
/// the delta rule's head states, f32. The engine gives each running sequence one slot
/// (`ForwardBatch::state_slots`). Each slot knows the position its state has reached, and a span
/// must start there, at 0 (a fresh sequence: zero state), or inside the slot's last short span
/// (a verify step whose drafts were rejected from there on): the state is then rolled back by
/// restoring it from before that span and replaying the accepted rows' kept inputs through the
/// delta rule (the same operations in the same order: the same bits as never having run the
/// rejected rows), so speculation over recurrent layers stays exact without a copy per position.
pub struct RecurrentStore {
    config: RecurrentConfig,
    slots: usize,
    conv_len: usize,
    ssm_len: usize,
    /// Per model layer: its index among the recurrent layers.
    index: Vec<Option<usize>>,
    conv: Vec<Vec<f32>>,
    ssm: Vec<Vec<f32>>,
    /// Per slot: the position its state has reached (`None`: never run).
    pos: Vec<Option<usize>>,
    /// Per slot: the first position and rows of its last span, when that span kept its inputs.
    last: Vec<Option<(usize, usize)>>,
    /// Per recurrent layer, per slot.
    kept: Vec<Vec<Kept>>,
    /// Copies of one slot's state at a position, by id (a hybrid's prefix cache: the engine
    /// decides which ids hold what); allocated on the first save to an id.
    checkpoints: Vec<Option<Checkpoint>>,
}

/// A slot's state at `position`: every recurrent layer's convolution window, then every layer's
/// head states.
struct Checkpoint {
    position: usize,
    conv: Vec<f32>,
    ssm: Vec<f32>,
}

impl RecurrentStore {
    /// `slots` sequences' state, written once so its pages are resident from the start.
    pub fn new(r: &RecurrentConfig, slots: usize) -> Self {
        let (conv_len, ssm_len) = (r.conv_state_len(), r.delta_shape().state_len());
        let index = crate::config::ranks_among(r.layers.iter().copied());
        let n = r.count();
        Self {
            config: r.clone(),
            slots,
            conv_len,
            ssm_len,
            index,
            conv: vec![vec![0f32; slots * conv_len]; n],
            ssm: vec![vec![0f32; slots * ssm_len]; n],
            pos: vec![None; slots],
            last: vec![None; slots],
            kept: (0..n).map(|_| (0..slots).map(|_| Kept::default()).collect()).collect(),
            checkpoints: Vec::new(),
        }
    }

    /// Copies slot `slot`'s state, which must be at `position`, into checkpoint `id` (replacing
    /// what it held).
    pub fn save_checkpoint(&mut self, slot: usize, id: usize, position: usize) -> Result<(), ModelError> {
        if self.pos.get(slot).copied().flatten() != Some(position) {
            return Err(ModelError::BadInput(format!("recurrent state slot {slot} is not at position {position}: no checkpoint of it there")));
        }
        if self.checkpoints.len() <= id {
            self.checkpoints.resize_with(id + 1, || None);
        }
        let (cl, sl) = (self.conv_len, self.ssm_len);
        let c = self.checkpoints[id].get_or_insert_with(|| Checkpoint { position, conv: Vec::new(), ssm: Vec::new() });
        c.position = position;
        c.conv.clear();
        c.ssm.clear();
        for (conv, ssm) in self.conv.iter().zip(&self.ssm) {
            c.conv.extend_from_slice(&conv[slot * cl..(slot + 1) * cl]);
            c.ssm.extend_from_slice(&ssm[slot * sl..(slot + 1) * sl]);
        }
        Ok(())
    }

    /// Puts checkpoint `id`, which must hold a state at `position`, into slot `slot`: the slot's
    /// next span continues from there.
    pub fn restore_checkpoint(&mut self, id: usize, slot: usize, position: usize) -> Result<(), ModelError> {
        let Some(c) = self.checkpoints.get(id).and_then(Option::as_ref).filter(|c| c.position == position) else {
            return Err(ModelError::BadInput(format!("recurrent state checkpoint {id} holds no state at position {position}")));
        };
        if slot >= self.slots {
            return Err(ModelError::BadInput(format!("recurrent state slot {slot} of {}", self.slots)));
        }
        let (cl, sl) = (self.conv_len, self.ssm_len);
        for (i, (conv, ssm)) in self.conv.iter_mut().zip(&mut self.ssm).enumerate() {
            conv[slot * cl..(slot + 1) * cl].copy_from_slice(&c.conv[i * cl..(i + 1) * cl]);
            ssm[slot * sl..(slot + 1) * sl].copy_from_slice(&c.ssm[i * sl..(i + 1) * sl]);
        }
        self.pos[slot] = Some(position);
        self.last[slot] = None;
        Ok(())
    }

    /// Sequence slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Layer `layer`'s states, `None` for an attention layer.
    pub fn layer(&mut self, layer: usize) -> Option<LayerState<'_>> {
        let i = (*self.index.get(layer)?)?;
        Some(LayerState { conv: &mut self.conv[i], ssm: &mut self.ssm[i], kept: &mut self.kept[i] })
    }

    /// Brings every span's slot to the position the span starts at, before a forward pass runs
    /// them: zero state at position 0, the state as it is where it already is, rolled back into
    /// its last kept span (see the type's docs); anything else is an error (the state for that
    /// position is gone). Then records where each slot will be after the pass.
    pub fn begin(&mut self, seqs: &[SeqSpan], state_slots: &[usize]) -> Result<(), ModelError> {
        for (s, &slot) in seqs.iter().zip(state_slots) {
            let start = s.context_len - s.q_len;
            match (self.pos[slot], self.last[slot]) {
                _ if start == 0 => self.reset(slot),
                (Some(p), _) if p == start => {}
                (Some(p), Some((from, rows))) if from <= start && start < p && start < from + rows => self.roll_back(slot, start - from),
                (p, _) => {
                    return Err(ModelError::BadInput(format!(
                        "recurrent state slot {slot} is at position {}; a span cannot continue it from position {start}",
                        p.map_or_else(|| "none".to_string(), |p| p.to_string())
                    )))
                }
            }
            self.pos[slot] = Some(s.context_len);
            self.last[slot] = kept_span(s.q_len).then_some((start, s.q_len));
        }
        Ok(())
    }

    /// Takes slot `slot`'s state as being at position `pos`, whatever it holds: for timing
    /// forward passes that repeat one position (`cost::time_forward`), never for outputs.
    pub fn assume_position(&mut self, slot: usize, pos: usize) {
        if let Some(p) = self.pos.get_mut(slot) {
            *p = Some(pos);
        }
    }

    fn reset(&mut self, slot: usize) {
        let (cl, sl) = (self.conv_len, self.ssm_len);
        for (conv, ssm) in self.conv.iter_mut().zip(&mut self.ssm) {
            conv[slot * cl..(slot + 1) * cl].iter_mut().for_each(|v| *v = 0.0);
            ssm[slot * sl..(slot + 1) * sl].iter_mut().for_each(|v| *v = 0.0);
        }
    }

    /// Slot `slot` back to `keep` rows into its last kept span, in every recurrent layer.
    fn roll_back(&mut self, slot: usize, keep: usize) {
        let r = &self.config;
        let (c, kw, vw, hv) = (r.conv_channels(), r.key_width(), r.value_width(), r.v_heads);
        let (cl, sl) = (self.conv_len, self.ssm_len);
        let mut scratch = vec![0f32; keep * vw];
        for ((conv, ssm), kept) in self.conv.iter_mut().zip(&mut self.ssm).zip(&self.kept) {
            let k = &kept[slot];
            // the window: the last width - 1 rows of the window before the span and the kept rows
            let mut rows = k.conv.clone();
            rows.extend_from_slice(&k.pre[..keep * c]);
            conv[slot * cl..(slot + 1) * cl].copy_from_slice(&rows[rows.len() - cl..]);
            ssm[slot * sl..(slot + 1) * sl].copy_from_slice(&k.ssm);
            let inputs = DeltaInputs { q: &k.q[..keep * kw], k: &k.k[..keep * kw], v: &k.v[..keep * vw], g: &k.g[..keep * hv], beta: &k.beta[..keep * hv] };
            gated_delta_rule(r.delta_shape(), &inputs, &[DeltaSpan { start: 0, len: keep, state: slot }], ssm, &mut scratch);
        }
    }
}
