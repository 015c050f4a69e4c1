//! The f32 exponential as a fixed sequence of roundings (Cephes' range reduction and degree-5
//! polynomial, about 1 ulp, no fused multiply-adds) and the row-local operations built on it:
//! the gated activations (SiLU, GELU-tanh) and softmax. The loops are written as independent
//! lanes of branch-free code, so the compiler vectorises them (SSE2 everywhere, AVX2 where the
//! CPU has it, chosen at run time) and every path gives the same bits.
//!
//! Our own code, not libm's `expf`: that one is a scalar call, and with it SiLU over a prompt's
//! or a verify step's rows was a serial 5-10% of the forward pass while the other core waited.

use crate::cpu::features;

/// Inputs below this give 0 (the exact result would be subnormal).
const LO: f32 = -87.0;
/// Inputs above this give +inf (the exact result is finite up to 88.72, which nothing here needs).
const HI: f32 = 88.0;

/// e^x: 0 below -87 and for -inf, +inf above 88, NaN for NaN. Branch-free, so a loop of it vectorises.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two: n * C1 is exact for |n| <= 128
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // round(x / ln 2) by the 1.5 * 2^23 trick (no SSE4.1 rounding needed)
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    p = p * r * r + r + 1.0;
    // 2^n from the exponent bits (n in [-126, 127] here)
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        p * scale
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// Which gate `gate_mul` applies (`ops::silu_mul`, `ops::gelu_tanh_mul`, `ops::swiglu_oai_mul`).
/// All are `g * sigmoid(a) * u`: SiLU with a = g; GELU's tanh approximation 0.5 g (1 + tanh(y)) =
/// g * sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3); gpt-oss's clamped SwiGLU with g clamped
/// from above and u on both sides to [`SWIGLU_OAI_LIMIT`], a = [`SWIGLU_OAI_ALPHA`] g and u + 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    Silu,
    GeluTanh,
    SwigluOai,
}

/// gpt-oss's SwiGLU constants (fixed by the architecture; llama.cpp hard-codes them too).
pub const SWIGLU_OAI_ALPHA: f32 = 1.702;
pub const SWIGLU_OAI_LIMIT: f32 = 7.0;

#[inline(always)]
fn swiglu_oai_gate(g: f32, u: f32) -> f32 {
    let g = g.min(SWIGLU_OAI_LIMIT);
    let u = u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT);
    g / (1.0 + exp(-SWIGLU_OAI_ALPHA * g)) * (u + 1.0)
}

#[inline(always)]
fn silu_gate(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

#[inline(always)]
fn gelu_gate(g: f32, u: f32) -> f32 {
    let y2 = 2.0 * (SQRT_2_OVER_PI * (g + 0.044715 * g * g * g));
    g / (1.0 + exp(-y2)) * u
}

#[inline(always)]
fn gate_mul_lanes(kind: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let it = out.iter_mut().zip(gate).zip(up);
    match kind {
        Gate::Silu => it.for_each(|((o, &g), &u)| *o = silu_gate(g, u)),
        Gate::GeluTanh => it.for_each(|((o, &g), &u)| *o = gelu_gate(g, u)),
        Gate::SwigluOai => it.for_each(|((o, &g), &u)| *o = swiglu_oai_gate(g, u)),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gate_mul_avx2(kind: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    gate_mul_lanes(kind, gate, up, out)
}

/// out[i] = act(gate[i]) * up[i].
pub(crate) fn gate_mul(kind: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if features().avx2_fma {
        // SAFETY: the CPU has AVX2 and FMA (run-time detection).
        return unsafe { gate_mul_avx2(kind, gate, up, out) };
    }
    gate_mul_lanes(kind, gate, up, out)
}

/// `x[i] = exp(x[i] - max)`, then their sum in eight partial sums (element i into lane i % 8)
/// combined in a fixed order. Two loops, not one: the compiler vectorises a plain loop of `exp`,
/// not one fused with the lane sums.
#[inline(always)]
pub(crate) fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
    x.iter_mut().for_each(|v| *v = exp(*v - max));
    lane_sum(x)
}

/// Sum in eight partial sums (element i into lane i % 8), combined in a fixed order.
#[inline(always)]
fn lane_sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] += v;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `softmax_lanes` with an attention sink (gpt-oss): one more logit, `sink`, joins the maximum
/// and the sum but gets no output, so the outputs sum to less than 1 (ggml's `soft_max` with
/// sinks, the same order of operations).
#[inline(always)]
fn softmax_sink_lanes(x: &mut [f32], sink: f32) {
    let max = lane_max(x).max(sink);
    let inv = 1.0 / (exp_shifted_sum(x, max) + exp(sink - max));
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_sink_avx2(x: &mut [f32], sink: f32) {
    softmax_sink_lanes(x, sink)
}

/// In-place softmax over `x` and one more logit, `sink`, whose share is dropped: out_i =
/// exp(x_i - m) / (sum_j exp(x_j - m) + exp(sink - m)), m = max(max x, sink).
pub fn softmax_with_sink(x: &mut [f32], sink: f32) {
    #[cfg(target_arch = "x86_64")]
    if features().avx2_fma {
        // SAFETY: the CPU has AVX2 and FMA (run-time detection).
        return unsafe { softmax_sink_avx2(x, sink) };
    }
    softmax_sink_lanes(x, sink)
}

/// The maximum in eight lanes (a single running max is a serial chain of dependent compares;
/// max is exact, so the lanes give the same value).
#[inline(always)]
pub(crate) fn lane_max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            lanes[l] = lanes[l].max(c[l]);
        }
    }
    lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

#[inline(always)]
fn softmax_lanes(x: &mut [f32]) {
    let max = lane_max(x);
    let inv = 1.0 / exp_shifted_sum(x, max);
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(x: &mut [f32]) {
    softmax_lanes(x)
}

/// In-place softmax: the maximum, `exp(x - max)` summed in eight lanes, one multiply by the
/// inverse of the sum.
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if features().avx2_fma {
        // SAFETY: the CPU has AVX2 and FMA (run-time detection).
        return unsafe { softmax_avx2(x) };
    }
    softmax_lanes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (0..20_000).map(|i| (i as f32 - 10_000.0) * 0.0093).collect();
        v.extend([0.0, -0.0, 1e-30, -1e-30, LO, HI, LO - 0.01, HI + 0.01, -200.0, 200.0, f32::INFINITY, f32::NEG_INFINITY, 88.72, -86.9]);
        v
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        for x in inputs() {
            let want = (x as f64).exp();
            let got = exp(x);
            if x < LO {
                assert_eq!(got, 0.0, "{x}");
            } else if x > HI {
                assert_eq!(got, f32::INFINITY, "{x}");
            } else {
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!((got as f64 - want).abs() <= 2.0 * ulp as f64, "exp({x}) = {got}, want {want}");
            }
        }
    }

    #[test]
    fn every_path_gives_the_same_bits() {
        let xs = inputs();
        let up: Vec<f32> = xs.iter().map(|x| (x * 0.37).sin()).collect();
        for kind in [Gate::Silu, Gate::GeluTanh, Gate::SwigluOai] {
            let mut got = vec![0f32; xs.len()];
            gate_mul(kind, &xs, &up, &mut got);
            for (i, (&g, &u)) in xs.iter().zip(&up).enumerate() {
                let want = match kind {
                    Gate::Silu => silu_gate(g, u),
                    Gate::GeluTanh => gelu_gate(g, u),
                    Gate::SwigluOai => swiglu_oai_gate(g, u),
                };
                assert_eq!(got[i].to_bits(), want.to_bits(), "{kind:?}({g}) * {u}");
            }
        }
        // softmax: lengths around the eight lanes, with -inf entries (masked keys)
        for n in [1usize, 5, 8, 9, 16, 23, 300] {
            let row: Vec<f32> = (0..n).map(|i| if i % 7 == 3 { f32::NEG_INFINITY } else { (i as f32 * 1.7).sin() * 20.0 }).collect();
            let mut simd = row.clone();
            softmax(&mut simd);
            let mut want = row.clone();
            softmax_lanes(&mut want);
            assert_eq!(simd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "n = {n}");
            let sum: f32 = simd.iter().sum();
            assert!((sum - 1.0).abs() < 1e-5 && simd.iter().enumerate().all(|(i, &v)| (i % 7 == 3) == (v == 0.0)), "n = {n}: {simd:?}");
            // with a sink: the same bits on every path, and the sink's share missing from the sum
            let sink = 3.5f32;
            let mut simd = row.clone();
            softmax_with_sink(&mut simd, sink);
            let mut want = row.clone();
            softmax_sink_lanes(&mut want, sink);
            assert_eq!(simd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "n = {n}");
            let finite: Vec<f64> = row.iter().filter(|v| v.is_finite()).map(|&v| v as f64).collect();
            let m = finite.iter().cloned().fold(sink as f64, f64::max);
            let z: f64 = finite.iter().map(|v| (v - m).exp()).sum::<f64>() + (sink as f64 - m).exp();
            let sum: f64 = simd.iter().map(|&v| v as f64).sum();
            assert!((sum - (1.0 - (sink as f64 - m).exp() / z)).abs() < 1e-5, "n = {n}: sum {sum}");
        }
    }

    #[test]
    fn gates_match_their_definitions() {
        for g in [-30.0f32, -4.0, -1.0, -0.1, 0.0, 0.3, 1.0, 2.5, 12.0] {
            let mut o = [0f32];
            gate_mul(Gate::Silu, &[g], &[1.5], &mut o);
            let want = g as f64 / (1.0 + (-g as f64).exp()) * 1.5;
            assert!((o[0] as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3), "silu({g}): {} vs {want}", o[0]);
            gate_mul(Gate::GeluTanh, &[g], &[1.5], &mut o);
            let y = (2.0f64 / std::f64::consts::PI).sqrt() * (g as f64 + 0.044715 * (g as f64).powi(3));
            let want = 0.5 * g as f64 * (1.0 + y.tanh()) * 1.5;
            assert!((o[0] as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3), "gelu({g}): {} vs {want}", o[0]);
            for u in [-9.0f32, -0.5, 3.0, 8.0] {
                gate_mul(Gate::SwigluOai, &[g], &[u], &mut o);
                let (gc, uc) = ((g as f64).min(7.0), (u as f64).clamp(-7.0, 7.0));
                let want = gc / (1.0 + (-1.702 * gc).exp()) * (uc + 1.0);
                assert!((o[0] as f64 - want).abs() <= 2e-6 * want.abs().max(1e-3), "swiglu_oai({g}, {u}): {} vs {want}", o[0]);
            }
        }
    }
}
