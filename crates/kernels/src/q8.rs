//! Activation quantization: each matmul input row is quantized once to 8-bit blocks of 32
//! (scale `d`, and `s = d * sum(q)` for the offset term of Q4_1 / Q4_0), like ggml's Q8_1.
//! The rounding is fixed per element, so a row's quantization never depends on its batch.
//!
//! A scale spans one block (`ActSpan::Block`, what every int8 kernel reads) or, for the Q4_K /
//! Q5_K kernels, a whole super-block of 256 (`ActSpan::Super`, like ggml's Q8_K): those kernels
//! then sum a super-block in integers and convert once instead of once per block, 4-16% faster
//! (see `packed::k`). One scale over 256 values is too coarse where a single value dwarfs the rest
//! (the massive activations of Qwen2.5's first position and of a few delimiter tokens: with super
//! scales everywhere a 1.5B model's logits moved 50x further from the float reference than with
//! block scales), so `quantize_rows_super` gives a row super scales only where no value carries
//! more than `SUPER_PEAK_ENERGY` of its super-block's energy, and block scales otherwise.

use crate::formats::QK;

#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(8))]
pub struct BlockQ8 {
    pub d: f32,
    /// d * sum(qs)
    pub s: f32,
    pub qs: [i8; QK],
    /// sum(qs[0..16]) and sum(qs[16..32]) (Q6_K's 16-element sub-blocks, like ggml's Q8_K bsums)
    pub h: [i16; 2],
}

/// How many values of an activation row share one scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActSpan {
    /// One scale per block of 32: every block its own `d`.
    Block,
    /// One scale per `SUPER_SPAN` values: the eight blocks of a super-block share one `d`.
    Super,
}

/// Values per scale of `ActSpan::Super` rows (a k-quant super-block).
pub const SUPER_SPAN: usize = 256;

/// A row gets super-block scales only where, in every super-block, `max x^2` is at most this
/// share of `sum x^2` (a peak at most ~13.9x the super-block's RMS). Measured with the NumPy
/// reference (`act_quant="q8k"` against block scales everywhere, KL from the float reference,
/// mean / max) on Qwen2.5-Coder-1.5B's two test prompts: 0.0019 / 0.061 and 0.020 / 0.29 against
/// 0.0016 / 0.052 and 0.021 / 0.31, with 6% of the Q4_K inputs' rows left on block scales (super
/// scales on every row: 0.100 / 3.39 and 0.374 / 5.60). A share of 0.3 left 23% of them and was
/// no more accurate; 0.1 left 86%.
pub const SUPER_PEAK_ENERGY: f32 = 0.75;

/// A batch of quantized activation rows, `blocks_per_row` blocks each.
#[derive(Clone, Debug, Default)]
pub struct QuantizedActivations {
    pub blocks: Vec<BlockQ8>,
    pub rows: usize,
    pub blocks_per_row: usize,
    /// Each row's scale span.
    pub spans: Vec<ActSpan>,
}

impl QuantizedActivations {
    #[inline]
    pub fn row(&self, r: usize) -> &[BlockQ8] {
        &self.blocks[r * self.blocks_per_row..(r + 1) * self.blocks_per_row]
    }

    /// Rows quantized one after the other, in order, as one batch.
    pub fn concat(parts: Vec<QuantizedActivations>) -> QuantizedActivations {
        let blocks_per_row = parts.first().map_or(0, |p| p.blocks_per_row);
        let mut out = QuantizedActivations { blocks_per_row, ..Default::default() };
        for p in parts {
            assert_eq!(p.blocks_per_row, blocks_per_row);
            out.rows += p.rows;
            out.blocks.extend_from_slice(&p.blocks);
            out.spans.extend_from_slice(&p.spans);
        }
        out
    }
}

/// Quantizes `rows` rows of `cols` (a multiple of 32) f32 values, one scale per block.
pub fn quantize_rows(x: &[f32], cols: usize) -> QuantizedActivations {
    quantize_with(x, cols, |_| ActSpan::Block)
}

/// Quantizes `rows` rows of `cols` (a multiple of `SUPER_SPAN`) f32 values for the Q4_K / Q5_K
/// kernels: one scale per super-block where the row's values allow it (`SUPER_PEAK_ENERGY`),
/// else one per block.
pub fn quantize_rows_super(x: &[f32], cols: usize) -> QuantizedActivations {
    assert!(cols.is_multiple_of(SUPER_SPAN), "activation width {cols} is not a multiple of {SUPER_SPAN}");
    quantize_with(x, cols, |row| if row.chunks_exact(SUPER_SPAN).all(fits_one_scale) { ActSpan::Super } else { ActSpan::Block })
}

fn quantize_with(x: &[f32], cols: usize, span_of: impl Fn(&[f32]) -> ActSpan) -> QuantizedActivations {
    assert!(cols.is_multiple_of(QK), "activation width {cols} is not a multiple of {QK}");
    let rows = x.len() / cols;
    let bpr = cols / QK;
    let mut blocks = vec![BlockQ8::default(); rows * bpr];
    let mut spans = Vec::with_capacity(rows);
    for (bs, xs) in blocks.chunks_exact_mut(bpr.max(1)).zip(x.chunks_exact(cols)) {
        let span = span_of(xs);
        let per_scale = if span == ActSpan::Super { SUPER_SPAN } else { QK };
        for (bs, xs) in bs.chunks_exact_mut(per_scale / QK).zip(xs.chunks_exact(per_scale)) {
            let amax = xs.chunks_exact(QK).fold(0f32, |m, c| m.max(block_amax(c)));
            for (b, xs) in bs.iter_mut().zip(xs.chunks_exact(QK)) {
                quantize_block(xs, amax, b);
            }
        }
        spans.push(span);
    }
    QuantizedActivations { blocks, rows, blocks_per_row: bpr, spans }
}

/// Whether one scale serves a super-block: no value holds more than `SUPER_PEAK_ENERGY` of its
/// energy. Eight running sums in a fixed order: the same answer on every CPU. The peak is kept
/// per lane too (a maximum does not round, so the answer is the same), which lets the compiler
/// keep both in vectors instead of chaining every element through one scalar maximum.
fn fits_one_scale(xs: &[f32]) -> bool {
    let mut sum = [0f32; 8];
    let mut peak = [0f32; 8];
    for c in xs.chunks_exact(8) {
        for i in 0..8 {
            let e = c[i] * c[i];
            sum[i] += e;
            peak[i] = if e > peak[i] { e } else { peak[i] };
        }
    }
    let energy = ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
    let peak = peak.iter().fold(0f32, |m, &e| if e > m { e } else { m });
    peak <= SUPER_PEAK_ENERGY * energy
}

/// `max |x|` of one block of 32 (exact on every path: a maximum does not round).
#[inline]
fn block_amax(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma {
            // SAFETY: AVX2 was detected at run time; xs holds QK values.
            return unsafe { x86::block_amax(xs) };
        }
    }
    xs.iter().fold(0f32, |a, v| a.max(v.abs()))
}

/// Quantizes one block of 32 with the scale of `amax` (the fastest path this CPU has; every path
/// gives the same bits).
#[inline]
fn quantize_block(xs: &[f32], amax: f32, b: &mut BlockQ8) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma {
            // SAFETY: AVX2 and FMA were detected at run time; xs holds QK values.
            return unsafe { x86::quantize_block(xs, amax, b) };
        }
    }
    quantize_block_scalar(xs, amax, b)
}

/// Scalar reference: `d = amax / 127`, `q = round_half_even(x / d)`.
fn quantize_block_scalar(xs: &[f32], amax: f32, b: &mut BlockQ8) {
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut h = [0i32; 2];
    for (i, (q, &v)) in b.qs.iter_mut().zip(xs).enumerate() {
        let r = (v * id).round_ties_even() as i32;
        *q = r as i8;
        h[i / 16] += r;
    }
    b.d = d;
    b.s = d * (h[0] + h[1]) as f32;
    b.h = [h[0] as i16, h[1] as i16];
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block_amax(xs: &[f32]) -> f32 {
        assert!(xs.len() >= QK);
        let p = xs.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_andnot_ps(sign, _mm256_loadu_ps(p));
        for i in 1..4 {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(8 * i))));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)))
    }

    /// AVX2 quantization of one block with the scale of `amax` (the scalar loop called libm's
    /// roundf per element and was a tenth of a batched decode step).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_block(xs: &[f32], amax: f32, b: &mut BlockQ8) {
        assert!(xs.len() >= QK);
        let p = xs.as_ptr();
        let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let r = v.map(|x| _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, idv))));
        // the sums of the two halves of 16 integers, and of all 32
        let t = _mm256_hadd_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        let t = _mm256_hadd_epi32(t, t);
        let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        let (h0, h1) = (_mm_cvtsi128_si32(t), _mm_extract_epi32::<1>(t));
        // wrapping: a non-finite activation (a broken file's garbage weights) converts to i32::MIN, and
        // must give garbage logits, not a panic in overflow-checked builds
        let sum = h0.wrapping_add(h1);
        b.h = [h0 as i16, h1 as i16];
        // i32 -> i8 (values are within +-127), packs interleave 128-bit lanes: undo with a permute
        let a = _mm256_packs_epi32(r[0], r[1]);
        let c = _mm256_packs_epi32(r[2], r[3]);
        let bytes = _mm256_packs_epi16(a, c);
        let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, ordered);
        b.d = d;
        b.s = d * sum as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_block_reconstructs_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let q = quantize_rows(&x, 64);
        assert_eq!((q.rows, q.blocks_per_row), (1, 2));
        for (b, xs) in q.row(0).iter().zip(x.chunks_exact(QK)) {
            assert_reconstructs(b, xs);
        }
    }

    /// `b` holds `xs` within half its step, and its sums `s` and `h` match its quants.
    fn assert_reconstructs(b: &BlockQ8, xs: &[f32]) {
        let mut sum = 0i32;
        for (&q, &v) in b.qs.iter().zip(xs) {
            assert!((b.d * q as f32 - v).abs() <= b.d * 0.5 + 1e-6);
            sum += q as i32;
        }
        assert_eq!(b.s, b.d * sum as f32);
        let half: i32 = b.qs[..16].iter().map(|&q| q as i32).sum();
        assert_eq!((b.h[0] as i32, b.h[1] as i32), (half, sum - half));
    }

    #[test]
    fn simd_quantization_equals_the_scalar_reference_bitwise() {
        let mut x: Vec<f32> = (0..32 * 64).map(|i| ((i as f32 * 0.731).sin() * 5.0) * if i % 97 == 0 { 40.0 } else { 1.0 }).collect();
        // exact halves (ties) and zeros
        for (i, v) in x[0..32].iter_mut().enumerate() {
            *v = i as f32 - 15.5;
        }
        x[32..64].fill(0.0);
        for (i, block) in x.chunks_exact(QK).enumerate() {
            let mut fast = BlockQ8::default();
            let mut slow = BlockQ8::default();
            let amax = block_amax(block);
            assert_eq!(amax, block.iter().fold(0f32, |a, v| a.max(v.abs())));
            quantize_block(block, amax, &mut fast);
            quantize_block_scalar(block, amax, &mut slow);
            assert_eq!(fast.qs, slow.qs, "block {i}");
            assert_eq!(fast.h, slow.h, "block {i}");
            assert_eq!((fast.d.to_bits(), fast.s.to_bits()), (slow.d.to_bits(), slow.s.to_bits()), "block {i}");
        }
    }

    #[test]
    fn a_super_span_shares_one_scale_and_reconstructs_within_half_its_step() {
        // peaks 9x the rest: within SUPER_PEAK_ENERGY, so super scales
        let x: Vec<f32> = (0..2 * SUPER_SPAN).map(|i| (i as f32 * 0.37).sin() * if i % 40 == 0 { 9.0 } else { 1.0 }).collect();
        let q = quantize_rows_super(&x, SUPER_SPAN);
        assert_eq!((q.rows, q.blocks_per_row), (2, 8));
        assert_eq!(q.spans, [ActSpan::Super, ActSpan::Super]);
        for (r, xs) in x.chunks_exact(SUPER_SPAN).enumerate() {
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (b, xs) in q.row(r).iter().zip(xs.chunks_exact(QK)) {
                assert_eq!(b.d, amax / 127.0);
                assert_reconstructs(b, xs);
            }
        }
    }

    #[test]
    fn a_row_with_one_dominant_value_keeps_block_scales_bit_for_bit() {
        // row 0: ones; row 1: ones and, in its second super-block, one value of 30
        // (900 / (900 + 255) = 78% of that super-block's energy, over SUPER_PEAK_ENERGY);
        // row 2: the same at 25 (625 / (625 + 255) = 71%: still one scale per super-block)
        let cols = 2 * SUPER_SPAN;
        let mut x = vec![1.0f32; 3 * cols];
        x[cols + SUPER_SPAN + 7] = 30.0;
        x[2 * cols + SUPER_SPAN + 7] = 25.0;
        let q = quantize_rows_super(&x, cols);
        assert_eq!(q.spans, [ActSpan::Super, ActSpan::Block, ActSpan::Super]);
        let blockwise = quantize_rows(&x[cols..2 * cols], cols);
        for (a, b) in q.row(1).iter().zip(blockwise.row(0)) {
            assert_eq!((a.d.to_bits(), a.s.to_bits(), a.qs, a.h), (b.d.to_bits(), b.s.to_bits(), b.qs, b.h));
        }
        assert!(q.row(2)[..8].iter().all(|b| b.d == 1.0 / 127.0) && q.row(2)[8..].iter().all(|b| b.d == 25.0 / 127.0));
        // the rule reads each row alone: the same bits in any batch
        let alone = quantize_rows_super(&x[2 * cols..], cols);
        assert_eq!(alone.spans, [ActSpan::Super]);
        assert!(alone.row(0).iter().zip(q.row(2)).all(|(a, b)| a.qs == b.qs && a.d.to_bits() == b.d.to_bits()));
    }

    #[test]
    fn zero_block_has_zero_scale() {
        let q = quantize_rows(&[0.0; 32], 32);
        assert_eq!(q.blocks[0].d, 0.0);
        assert!(q.blocks[0].qs.iter().all(|&v| v == 0));
    }
}
