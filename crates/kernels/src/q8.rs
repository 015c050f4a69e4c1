//! Activation quantization: each matmul input row is quantized once to 8-bit blocks of 32
//! (scale `d`, and `s = d * sum(q)` for the offset term of Q4_1 / Q4_0), like ggml's Q8_1.
//! The rounding is fixed per element, so a row's quantization never depends on its batch.

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

/// A batch of quantized activation rows, `blocks_per_row` blocks each.
#[derive(Clone, Debug, Default)]
pub struct QuantizedActivations {
    pub blocks: Vec<BlockQ8>,
    pub rows: usize,
    pub blocks_per_row: usize,
}

impl QuantizedActivations {
    #[inline]
    pub fn row(&self, r: usize) -> &[BlockQ8] {
        &self.blocks[r * self.blocks_per_row..(r + 1) * self.blocks_per_row]
    }
}

/// Quantizes `rows` rows of `cols` (a multiple of 32) f32 values.
pub fn quantize_rows(x: &[f32], cols: usize) -> QuantizedActivations {
    assert!(cols.is_multiple_of(QK), "activation width {cols} is not a multiple of {QK}");
    let rows = x.len() / cols;
    let bpr = cols / QK;
    let mut blocks = vec![BlockQ8::default(); rows * bpr];
    for (b, xs) in blocks.iter_mut().zip(x.chunks_exact(QK)) {
        quantize_block(xs, b);
    }
    QuantizedActivations { blocks, rows, blocks_per_row: bpr }
}

/// Quantizes one block of 32 (the fastest path this CPU has; every path gives the same bits).
#[inline]
fn quantize_block(xs: &[f32], b: &mut BlockQ8) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma {
            // SAFETY: AVX2 and FMA were detected at run time; xs holds QK values.
            return unsafe { x86::quantize_block(xs, b) };
        }
    }
    quantize_block_scalar(xs, b)
}

/// Scalar reference: `d = max|x| / 127`, `q = round_half_even(x / d)`.
fn quantize_block_scalar(xs: &[f32], b: &mut BlockQ8) {
    let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
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

    /// AVX2 quantization of one block (the scalar loop called libm's roundf per element and was a
    /// tenth of a batched decode step).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_block(xs: &[f32], b: &mut BlockQ8) {
        assert!(xs.len() >= QK);
        let p = xs.as_ptr();
        let sign = _mm256_set1_ps(-0.0);
        let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
        let mut m = _mm256_andnot_ps(sign, v[0]);
        for x in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *x));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let r = v.map(|x| _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, idv))));
        // the sums of the two halves of 16 integers, and of all 32
        let t = _mm256_hadd_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        let t = _mm256_hadd_epi32(t, t);
        let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        let (h0, h1) = (_mm_cvtsi128_si32(t), _mm_extract_epi32::<1>(t));
        let sum = h0 + h1;
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
        for (bi, b) in q.row(0).iter().enumerate() {
            let mut sum = 0i32;
            for j in 0..QK {
                let v = x[bi * QK + j];
                assert!((b.d * b.qs[j] as f32 - v).abs() <= b.d * 0.5 + 1e-6);
                sum += b.qs[j] as i32;
            }
            assert_eq!(b.s, b.d * sum as f32);
            let half: i32 = b.qs[..16].iter().map(|&q| q as i32).sum();
            assert_eq!((b.h[0] as i32, b.h[1] as i32), (half, sum - half));
        }
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
            quantize_block(block, &mut fast);
            quantize_block_scalar(block, &mut slow);
            assert_eq!(fast.qs, slow.qs, "block {i}");
            assert_eq!(fast.h, slow.h, "block {i}");
            assert_eq!((fast.d.to_bits(), fast.s.to_bits()), (slow.d.to_bits(), slow.s.to_bits()), "block {i}");
        }
    }

    #[test]
    fn zero_block_has_zero_scale() {
        let q = quantize_rows(&[0.0; 32], 32);
        assert_eq!(q.blocks[0].d, 0.0);
        assert!(q.blocks[0].qs.iter().all(|&v| v == 0));
    }
}
