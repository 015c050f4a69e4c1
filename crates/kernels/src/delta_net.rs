//! The recurrent half of a Gated DeltaNet layer (Qwen3.5 / Qwen3-Next hybrids): the short causal
//! convolution over the mixed q/k/v channels with its rolling window, and the gated delta rule
//! over a per-head state matrix, one token after another. Our own loops: the state update is a
//! row-wise scale, dot, axpy and dot that fit in one pass over each state row (the state of a
//! head, 64 KiB at head width 128, stays in L2), which no crate offers.
//!
//! Layout of one head's state (`head_dim x head_dim`, as ggml's `gated_delta_net` keeps it): row
//! `j` (a value dimension) holds `S[i][j]` over the key dimensions `i`, so every product below
//! reads a row contiguously. Each output element is reduced in a fixed order whatever the
//! thread count, so results do not depend on how the heads are spread.

use crate::dot::dot_f32;
use crate::pool::{parallel_for, DisjointOut};

/// Heads of a Gated DeltaNet layer: `k_heads` query/key heads shared by `v_heads` value heads,
/// all `head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    pub k_heads: usize,
    pub v_heads: usize,
    pub head_dim: usize,
    /// Which key head value head `h` reads: `h / (v_heads / k_heads)` (each key head's value heads
    /// in a run, Qwen3-Next's repeat-interleave) when set, else `h % k_heads` (Qwen3.5's tiling).
    pub interleaved: bool,
}

impl DeltaShape {
    /// The query/key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        match self.interleaved {
            true => h / (self.v_heads / self.k_heads),
            false => h % self.k_heads,
        }
    }

    /// Floats of one sequence's state in one layer.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.head_dim * self.head_dim
    }
}

/// One sequence's rows of a step and where its state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaSpan {
    /// First row in the flattened batch and number of rows.
    pub start: usize,
    pub len: usize,
    /// Index of the sequence's state in the layer's state buffer (`state_len` floats each).
    pub state: usize,
}

/// The inputs of the delta rule for a batch of rows: `q`, `k` (`rows x k_heads*head_dim`, both
/// L2-normalised per head), `v` (`rows x v_heads*head_dim`), the log of the decay `g` and the
/// write strength `beta` (`rows x v_heads`).
pub struct DeltaInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// Runs every span's rows through the gated delta rule, one task per (span, value head):
/// `S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(head_dim)`, updating the spans'
/// states in `states` in place and writing `out` (`rows x v_heads*head_dim`). The spans' states
/// must be distinct (each task writes its own).
pub fn gated_delta_rule(shape: DeltaShape, x: &DeltaInputs, spans: &[DeltaSpan], states: &mut [f32], out: &mut [f32]) {
    let DeltaShape { k_heads, v_heads, head_dim: d, .. } = shape;
    let (kw, vw) = (k_heads * d, v_heads * d);
    let rows = out.len() / vw.max(1);
    assert!(k_heads > 0 && v_heads.is_multiple_of(k_heads), "delta rule: {v_heads} value heads over {k_heads} key heads");
    assert!(x.q.len() == rows * kw && x.k.len() == rows * kw && x.v.len() == rows * vw, "delta rule: input widths");
    assert!(x.g.len() == rows * v_heads && x.beta.len() == rows * v_heads, "delta rule: gate widths");
    for s in spans {
        assert!(s.start + s.len <= rows && (s.state + 1) * shape.state_len() <= states.len(), "delta rule: span {s:?} out of bounds");
    }
    for (i, a) in spans.iter().enumerate() {
        assert!(spans[..i].iter().all(|b| b.state != a.state), "delta rule: two spans share state {}", a.state);
    }
    let scale = 1.0 / (d as f32).sqrt();
    let (st, o) = (DisjointOut::new(states), DisjointOut::new(out));
    parallel_for(spans.len() * v_heads, &|task| {
        let (span, h) = (spans[task / v_heads], task % v_heads);
        let kh = shape.key_head(h);
        // SAFETY: task (span, h) alone touches head h of its span's state (states are distinct,
        // asserted) and head h's columns of its span's output rows.
        let m = unsafe { st.slice((span.state * v_heads + h) * d * d, d * d) };
        for r in span.start..span.start + span.len {
            let q = &x.q[r * kw + kh * d..][..d];
            let k = &x.k[r * kw + kh * d..][..d];
            let v = &x.v[r * vw + h * d..][..d];
            let (decay, beta) = (x.g[r * v_heads + h].exp(), x.beta[r * v_heads + h]);
            // SAFETY: as above.
            let o_row = unsafe { o.slice(r * vw + h * d, d) };
            for (j, row) in m.chunks_exact_mut(d).enumerate() {
                o_row[j] = row_step(row, k, q, decay, v[j], beta) * scale;
            }
        }
    });
}

/// One state row's update for one token: `row *= decay; row += k (beta (v - row . k))`, and
/// returns `row . q` (the updated row's query product).
#[inline]
fn row_step(row: &mut [f32], k: &[f32], q: &[f32], decay: f32, v: f32, beta: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma && row.len().is_multiple_of(16) && k.len() == row.len() && q.len() == row.len() {
            // SAFETY: AVX2 and FMA were detected at run time; the three slices have one length, a
            // multiple of 16 (checked).
            return unsafe { avx2::row_step(row, k, q, decay, v, beta) };
        }
    }
    row_step_scalar(row, k, q, decay, v, beta)
}

/// [`row_step`]'s reference.
fn row_step_scalar(row: &mut [f32], k: &[f32], q: &[f32], decay: f32, v: f32, beta: f32) -> f32 {
    row.iter_mut().for_each(|s| *s *= decay);
    let delta = (v - dot_f32(row, k)) * beta;
    row.iter_mut().zip(k).for_each(|(s, &kv)| *s += delta * kv);
    dot_f32(row, q)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Two passes over the row, each with two accumulators (lanes 0-7 of even and odd eight-value
    /// chunks), added in a fixed order.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn row_step(row: &mut [f32], k: &[f32], q: &[f32], decay: f32, v: f32, beta: f32) -> f32 {
        let n = row.len();
        let (pr, pk, pq) = (row.as_mut_ptr(), k.as_ptr(), q.as_ptr());
        let dv = _mm256_set1_ps(decay);
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < n {
            let r0 = _mm256_mul_ps(_mm256_loadu_ps(pr.add(i)), dv);
            let r1 = _mm256_mul_ps(_mm256_loadu_ps(pr.add(i + 8)), dv);
            _mm256_storeu_ps(pr.add(i), r0);
            _mm256_storeu_ps(pr.add(i + 8), r1);
            a0 = _mm256_fmadd_ps(r0, _mm256_loadu_ps(pk.add(i)), a0);
            a1 = _mm256_fmadd_ps(r1, _mm256_loadu_ps(pk.add(i + 8)), a1);
            i += 16;
        }
        let delta = _mm256_set1_ps((v - hsum(_mm256_add_ps(a0, a1))) * beta);
        let (mut b0, mut b1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        i = 0;
        while i < n {
            let r0 = _mm256_fmadd_ps(delta, _mm256_loadu_ps(pk.add(i)), _mm256_loadu_ps(pr.add(i)));
            let r1 = _mm256_fmadd_ps(delta, _mm256_loadu_ps(pk.add(i + 8)), _mm256_loadu_ps(pr.add(i + 8)));
            _mm256_storeu_ps(pr.add(i), r0);
            _mm256_storeu_ps(pr.add(i + 8), r1);
            b0 = _mm256_fmadd_ps(r0, _mm256_loadu_ps(pq.add(i)), b0);
            b1 = _mm256_fmadd_ps(r1, _mm256_loadu_ps(pq.add(i + 8)), b1);
            i += 16;
        }
        hsum(_mm256_add_ps(b0, b1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

/// The causal depthwise convolution of one sequence's rows (`rows x channels`) with a kernel of
/// `width` taps per channel (`weight`: `channels x width`, the oldest tap first), continuing from
/// `window` (the previous `width - 1` rows, oldest first), which it advances to the last `width - 1`
/// rows seen. `out` gets SiLU of each sum.
pub fn causal_conv1d_silu(x: &[f32], channels: usize, weight: &[f32], width: usize, window: &mut [f32], out: &mut [f32]) {
    let keep = width.saturating_sub(1);
    assert!(width > 0 && weight.len() == channels * width && window.len() == keep * channels, "conv1d: shapes");
    assert!(x.len().is_multiple_of(channels) && out.len() == x.len(), "conv1d: rows");
    let rows = x.len() / channels;
    // the rows the taps read: the window, then this step's
    let mut all = Vec::with_capacity((keep + rows) * channels);
    all.extend_from_slice(window);
    all.extend_from_slice(x);
    for t in 0..rows {
        let o = &mut out[t * channels..(t + 1) * channels];
        o.iter_mut().for_each(|v| *v = 0.0);
        for tap in 0..width {
            let src = &all[(t + tap) * channels..][..channels];
            for ((acc, &xv), w) in o.iter_mut().zip(src).zip(weight.chunks_exact(width)) {
                *acc += xv * w[tap];
            }
        }
        o.iter_mut().for_each(|v| *v = *v / (1.0 + (-*v).exp()));
    }
    window.copy_from_slice(&all[rows * channels..]);
}

/// Each `width`-long head of `x` divided by its L2 norm: `x / sqrt(sum x^2 + eps)` (ggml's
/// `rms_norm(x, eps / n) / sqrt(n)`, as llama.cpp normalises DeltaNet's queries and keys).
pub fn l2_norm_heads(x: &mut [f32], width: usize, eps: f32) {
    for h in x.chunks_exact_mut(width) {
        let inv = 1.0 / (dot_f32(h, h) + eps).sqrt();
        h.iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule as written in the papers, in f64, one matrix `S[i][j]` per head.
    fn reference(shape: DeltaShape, x: &DeltaInputs, rows: usize, s: &mut [Vec<f64>]) -> Vec<f64> {
        let DeltaShape { k_heads, v_heads, head_dim: d, interleaved } = shape;
        let mut out = vec![0f64; rows * v_heads * d];
        for r in 0..rows {
            for h in 0..v_heads {
                let kh = if interleaved { h / (v_heads / k_heads) } else { h % k_heads };
                let q: Vec<f64> = x.q[r * k_heads * d + kh * d..][..d].iter().map(|&v| v as f64).collect();
                let k: Vec<f64> = x.k[r * k_heads * d + kh * d..][..d].iter().map(|&v| v as f64).collect();
                let v = &x.v[r * v_heads * d + h * d..][..d];
                let (decay, beta) = ((x.g[r * v_heads + h] as f64).exp(), x.beta[r * v_heads + h] as f64);
                let m = &mut s[h];
                m.iter_mut().for_each(|e| *e *= decay);
                for j in 0..d {
                    let sk: f64 = (0..d).map(|i| m[i * d + j] * k[i]).sum();
                    let delta = (v[j] as f64 - sk) * beta;
                    (0..d).for_each(|i| m[i * d + j] += k[i] * delta);
                }
                for j in 0..d {
                    out[r * v_heads * d + h * d + j] = (0..d).map(|i| m[i * d + j] * q[i]).sum::<f64>() / (d as f64).sqrt();
                }
            }
        }
        out
    }

    fn rand(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut z = seed;
        (0..n)
            .map(|_| {
                z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }

    #[test]
    fn the_rule_matches_the_f64_reference_and_splits_into_steps_with_the_same_bits() {
        for interleaved in [false, true] {
            rule_matches_reference(DeltaShape { k_heads: 2, v_heads: 4, head_dim: 16, interleaved });
        }
    }

    fn rule_matches_reference(shape: DeltaShape) {
        let rows = 7;
        let (kw, vw) = (2 * 16, 4 * 16);
        let mut q = rand(rows * kw, 1, 2.0);
        let mut k = rand(rows * kw, 2, 2.0);
        l2_norm_heads(&mut q, 16, 1e-6);
        l2_norm_heads(&mut k, 16, 1e-6);
        let v = rand(rows * vw, 3, 2.0);
        let g: Vec<f32> = rand(rows * 4, 4, 1.0).iter().map(|x| -x.abs()).collect();
        let beta: Vec<f32> = rand(rows * 4, 5, 1.0).iter().map(|x| 0.5 + x).collect();
        let x = DeltaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let mut states = vec![0f32; 2 * shape.state_len()];
        let mut out = vec![0f32; rows * vw];
        // the same rows as one sequence (state 1) in one call
        gated_delta_rule(shape, &x, &[DeltaSpan { start: 0, len: rows, state: 1 }], &mut states, &mut out);
        let mut s64 = vec![vec![0f64; 16 * 16]; 4];
        let want = reference(shape, &x, rows, &mut s64);
        for (i, (&a, &b)) in out.iter().zip(&want).enumerate() {
            assert!((a as f64 - b).abs() < 1e-4, "row {} col {}: {a} vs {b}", i / vw, i % vw);
        }
        assert!(states[..shape.state_len()].iter().all(|&v| v == 0.0), "state 0 untouched");
        // one row at a time (decode steps) from state 0: the same bits
        let mut out1 = vec![0f32; rows * vw];
        for r in 0..rows {
            gated_delta_rule(shape, &x, &[DeltaSpan { start: r, len: 1, state: 0 }], &mut states, &mut out1);
        }
        assert_eq!(out, out1);
        let (s0, s1) = states.split_at(shape.state_len());
        assert_eq!(s0, s1);
    }

    #[test]
    fn the_row_step_agrees_with_its_reference() {
        for d in [16, 32, 128] {
            let (k, q) = (rand(d, 11, 1.0), rand(d, 12, 1.0));
            let mut a = rand(d, 13, 2.0);
            let mut b = a.clone();
            let x = row_step(&mut a, &k, &q, 0.9, 0.7, 0.4);
            let y = row_step_scalar(&mut b, &k, &q, 0.9, 0.7, 0.4);
            assert!((x - y).abs() < 1e-5 * (1.0 + y.abs()), "d {d}: {x} vs {y}");
            assert!(a.iter().zip(&b).all(|(u, w)| (u - w).abs() < 1e-5), "d {d}");
        }
    }

    #[test]
    fn the_convolution_continues_across_calls() {
        let (c, w) = (5, 4);
        let x = rand(9 * c, 7, 2.0);
        let weight = rand(c * w, 8, 1.0);
        let mut win = vec![0f32; (w - 1) * c];
        let mut whole = vec![0f32; x.len()];
        causal_conv1d_silu(&x, c, &weight, w, &mut win, &mut whole);
        // direct: zero history, then silu(sum of the taps)
        for t in 0..9 {
            for ch in 0..c {
                let s: f32 = (0..w).filter(|&tap| t + tap >= w - 1).map(|tap| x[(t + tap - (w - 1)) * c + ch] * weight[ch * w + tap]).sum();
                let want = s / (1.0 + (-s).exp());
                assert!((whole[t * c + ch] - want).abs() < 1e-5, "t {t} ch {ch}");
            }
        }
        let mut win2 = vec![0f32; (w - 1) * c];
        let mut parts = vec![0f32; x.len()];
        for (a, b) in [(0, 2), (2, 3), (3, 9)] {
            causal_conv1d_silu(&x[a * c..b * c], c, &weight, w, &mut win2, &mut parts[a * c..b * c]);
        }
        assert_eq!(whole, parts);
        assert_eq!(win, win2);
    }
}
