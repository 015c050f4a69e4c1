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
        out: &mut [f32],
    ) {
        let rows = xn.len() / hidden;
        let (c, kw, vw, hv, d) = (r.conv_channels(), r.key_width(), r.value_width(), r.v_heads, r.head_dim);
        let (mut qkv, mut z, mut beta, mut alpha) = (vec![0f32; rows * c], vec![0f32; rows * vw], vec![0f32; rows * hv], vec![0f32; rows * hv]);
        let mats = [&self.wqkv, &self.wgate, &self.wbeta, &self.walpha];
        matmul_many(&MatmulInput::new(xn, hidden, &mats), &mats, &mut [&mut qkv, &mut z, &mut beta, &mut alpha]);

        let (conv_len, ssm_len) = (r.conv_state_len(), r.delta_shape().state_len());
        let mut mixed = vec![0f32; rows * c];
        for (s, &slot) in seqs.iter().zip(state_slots) {
            let window = &mut state.conv[slot * conv_len..(slot + 1) * conv_len];
            if s.context_len == s.q_len {
                window.iter_mut().for_each(|v| *v = 0.0);
                state.ssm[slot * ssm_len..(slot + 1) * ssm_len].iter_mut().for_each(|v| *v = 0.0);
            }
            let span = s.q_start * c..(s.q_start + s.q_len) * c;
            causal_conv1d_silu(&qkv[span.clone()], c, &self.conv, r.conv_kernel, window, &mut mixed[span]);
        }
        let (mut q, mut k, mut v) = (Vec::with_capacity(rows * kw), Vec::with_capacity(rows * kw), Vec::with_capacity(rows * vw));
        for row in mixed.chunks_exact(c) {
            q.extend_from_slice(&row[..kw]);
            k.extend_from_slice(&row[kw..2 * kw]);
            v.extend_from_slice(&row[2 * kw..]);
        }
        l2_norm_heads(&mut q, d, eps);
        l2_norm_heads(&mut k, d, eps);
        // the decay's log and the write strength, per row and value head
        for row in 0..rows {
            for h in 0..hv {
                let i = row * hv + h;
                alpha[i] = softplus(alpha[i] + self.dt_bias[h]) * self.a[h];
                beta[i] = 1.0 / (1.0 + (-beta[i]).exp());
            }
        }
        let spans: Vec<DeltaSpan> = seqs.iter().zip(state_slots).map(|(s, &slot)| DeltaSpan { start: s.q_start, len: s.q_len, state: slot }).collect();
        let mut o = vec![0f32; rows * vw];
        let inputs = DeltaInputs { q: &q, k: &k, v: &v, g: &alpha, beta: &beta };
        gated_delta_rule(r.delta_shape(), &inputs, &spans, state.ssm, &mut o);
        // gated RMSNorm per head: norm(o) * silu(z)
        for (oh, zh) in o.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
            let inv = 1.0 / (specula_kernels::dot::dot_f32(oh, oh) / d as f32 + eps).sqrt();
            for ((x, &w), &g) in oh.iter_mut().zip(&self.norm).zip(zh) {
                *x = *x * inv * w * (g / (1.0 + (-g).exp()));
            }
        }
        matmul(&MatmulInput::new(&o, vw, &[&self.wout]), &self.wout, out);
    }
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

/// One recurrent layer's states of every sequence slot.
pub struct LayerState<'a> {
    pub conv: &'a mut [f32],
    pub ssm: &'a mut [f32],
}

/// The recurrent state of every sequence slot, per recurrent layer: the convolution's window and
/// the delta rule's head states, f32. The engine gives each running sequence one slot
/// (`ForwardBatch::state_slots`); a span at position 0 starts its slot from zero.
pub struct RecurrentStore {
    slots: usize,
    conv_len: usize,
    ssm_len: usize,
    /// Per model layer: its index among the recurrent layers.
    index: Vec<Option<usize>>,
    conv: Vec<Vec<f32>>,
    ssm: Vec<Vec<f32>>,
}

impl RecurrentStore {
    /// `slots` sequences' state, written once so its pages are resident from the start.
    pub fn new(r: &RecurrentConfig, slots: usize) -> Self {
        let (conv_len, ssm_len) = (r.conv_state_len(), r.delta_shape().state_len());
        let mut n = 0;
        let index = r
            .layers
            .iter()
            .map(|&rec| {
                rec.then(|| {
                    n += 1;
                    n - 1
                })
            })
            .collect();
        Self { slots, conv_len, ssm_len, index, conv: vec![vec![0f32; slots * conv_len]; n], ssm: vec![vec![0f32; slots * ssm_len]; n] }
    }

    /// Sequence slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.conv.len() * self.slots * (self.conv_len + self.ssm_len) * std::mem::size_of::<f32>()
    }

    /// Layer `layer`'s states, `None` for an attention layer.
    pub fn layer(&mut self, layer: usize) -> Option<LayerState<'_>> {
        let i = (*self.index.get(layer)?)?;
        Some(LayerState { conv: &mut self.conv[i], ssm: &mut self.ssm[i] })
    }
}
