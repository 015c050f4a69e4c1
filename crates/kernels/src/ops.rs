//! Element-wise and per-row operations of a transformer layer: RMSNorm, rotary position
//! embedding, SiLU- and GELU-gated multiply, bias and residual add, softmax. Row-local, so
//! batch-invariant.

use crate::exp::Gate;

/// out = x / rms(x) * weight, per row of `weight.len()` elements.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss = crate::dot::dot_f32(xr, xr);
        let scale = 1.0 / (ss / n as f32 + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// In-place [`rms_norm`] per row of `weight.len()` elements: with a `head_dim`-long weight over
/// `[tokens, heads * head_dim]`, the per-head query/key norm of Qwen3 and Gemma 3.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for xr in x.chunks_exact_mut(n) {
        let ss = crate::dot::dot_f32(xr, xr);
        let scale = 1.0 / (ss / n as f32 + eps).sqrt();
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// Adds `bias` to every row of `bias.len()` elements of `x` (the Q/K/V biases of Qwen2).
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// Rotary embedding parameters of a model.
#[derive(Clone, Debug)]
pub struct Rope {
    pub head_dim: usize,
    /// Number of leading dimensions rotated (usually head_dim).
    pub rot_dim: usize,
    /// theta_i = pos / (base^(2i/rot_dim) * freq_factor_i), divided by linear `scale`.
    inv_freq: Vec<f32>,
    pub neox: bool,
    /// Multiplier of cos and sin (llama.cpp's `attn_factor`; 1.0 but for LongRoPE).
    mscale: f32,
}

impl Rope {
    /// `freq_factors` (llama3-style per-dimension divisors) must have rot_dim/2 entries when given.
    pub fn new(head_dim: usize, rot_dim: usize, base: f32, linear_scale: f32, freq_factors: Option<&[f32]>, neox: bool) -> Self {
        let inv_freq = (0..rot_dim / 2)
            .map(|i| {
                let f = 1.0 / base.powf(2.0 * i as f32 / rot_dim as f32);
                let ff = freq_factors.map_or(1.0, |v| v[i]);
                f / ff / linear_scale
            })
            .collect();
        Self { head_dim, rot_dim, inv_freq, neox, mscale: 1.0 }
    }

    /// The same rotation with cos and sin multiplied by `mscale` (the rotated dimensions grow by
    /// that factor, the others do not), as ggml's `rope_ext` applies `attn_factor`.
    pub fn with_mscale(self, mscale: f32) -> Self {
        Self { mscale, ..self }
    }

    /// Rotates every head (`x.len()` a multiple of head_dim) of one token at `pos` in place.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.rot_dim / 2;
        let cs: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|f| {
                let t = pos as f32 * f;
                (t.cos() * self.mscale, t.sin() * self.mscale)
            })
            .collect();
        for head in x.chunks_exact_mut(self.head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = if self.neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// The logistic function, `1 / (1 + e^-x)` (gates: gated attention's output, a shared expert's,
/// DeltaNet's write strength).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Gated attention's query projection (`pairs`: per head `head_dim` queries, then `head_dim`
/// output-gate logits) split into the queries `q` and the gates `gate`, the sigmoid applied.
pub fn split_query_gate(pairs: &[f32], head_dim: usize, q: &mut [f32], gate: &mut [f32]) {
    for ((pair, qh), gh) in pairs.chunks_exact(2 * head_dim).zip(q.chunks_exact_mut(head_dim)).zip(gate.chunks_exact_mut(head_dim)) {
        qh.copy_from_slice(&pair[..head_dim]);
        gh.iter_mut().zip(&pair[head_dim..]).for_each(|(s, &g)| *s = sigmoid(g));
    }
}

/// out[i] = silu(gate[i]) * up[i]
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gate_mul_parallel(Gate::Silu, gate, up, out);
}

/// out[i] = gelu(gate[i]) * up[i], GELU in its tanh approximation (ggml_gelu; Gemma's
/// `gelu_pytorch_tanh`): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gate_mul_parallel(Gate::GeluTanh, gate, up, out);
}

/// Elements per task of a gated activation; a multiple of the eight SIMD lanes, so every element
/// goes through the same path whatever the split.
const GATE_CHUNK: usize = 8192;

/// A prompt's or a verify step's rows are shared by the pool (serial, the other core waited);
/// one decode row is not worth waking it.
fn gate_mul_parallel(kind: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "gated activation: buffers of different lengths");
    if out.len() < 4 * GATE_CHUNK {
        return crate::exp::gate_mul(kind, gate, up, out);
    }
    let (n, o) = (out.len(), crate::pool::DisjointOut::new(out));
    crate::pool::parallel_for(n.div_ceil(GATE_CHUNK), &|c| {
        let (a, b) = (c * GATE_CHUNK, ((c + 1) * GATE_CHUNK).min(n));
        // SAFETY: each task writes its own chunk only.
        let dst = unsafe { o.slice(a, b - a) };
        crate::exp::gate_mul(kind, &gate[a..b], &up[a..b], dst);
    });
}

/// out[i] = gpt-oss's clamped SwiGLU of gate[i] and up[i]: g = min(g, 7), u = clamp(u, -7, 7),
/// g * sigmoid(1.702 g) * (u + 1) (ggml's `swiglu_oai`).
pub fn swiglu_oai_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gate_mul_parallel(Gate::SwigluOai, gate, up, out);
}

/// x += y
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// In-place numerically stable softmax.
pub use crate::exp::{softmax, softmax_with_sink};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_constant_row_is_the_weight() {
        let mut out = [0f32; 4];
        rms_norm(&[2.0; 4], &[1.0, 2.0, 3.0, 4.0], 0.0, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let r = Rope::new(4, 4, 10000.0, 1.0, None, false);
        let mut x = [1.0, 2.0, 3.0, 4.0];
        r.apply(&mut x, 0);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0]);
        r.apply(&mut x, 7);
        let n: f32 = x.iter().map(|v| v * v).sum();
        assert!((n - 30.0).abs() < 1e-4);
        // first pair rotates by exactly pos radians (inv_freq[0] = 1)
        let mut y = [1.0, 0.0, 0.0, 0.0];
        r.apply(&mut y, 1);
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[1] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one_and_handles_large_values() {
        let mut x = [1000.0, 1000.0, -f32::INFINITY];
        softmax(&mut x);
        assert_eq!(x, [0.5, 0.5, 0.0]);
    }

    #[test]
    fn silu_mul_matches_definition() {
        let mut o = [0f32; 2];
        silu_mul(&[0.0, 1.0], &[3.0, 2.0], &mut o);
        assert_eq!(o[0], 0.0);
        assert!((o[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn gelu_tanh_mul_matches_known_values() {
        let mut o = [0f32; 4];
        gelu_tanh_mul(&[0.0, 1.0, -1.0, 3.0], &[1.0, 1.0, 2.0, 1.0], &mut o);
        // torch.nn.functional.gelu(x, approximate="tanh")
        for (a, b) in o.iter().zip([0.0, 0.841_192, 2.0 * -0.158_808, 2.996_363]) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn per_head_norm_normalises_each_head_on_its_own() {
        let mut x = [2.0, 2.0, 3.0, -3.0];
        rms_norm_in_place(&mut x, &[1.0, 0.5], 0.0);
        assert_eq!(x, [1.0, 0.5, 1.0, -0.5]);
        let mut y = [1.0, 2.0, 3.0, 4.0];
        add_bias(&mut y, &[10.0, 20.0]);
        assert_eq!(y, [11.0, 22.0, 13.0, 24.0]);
    }
}
