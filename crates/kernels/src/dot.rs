//! Dot products of one quantized weight row with up to four quantized activation rows.
//!
//! Each (weight row, activation row) pair is reduced block by block in index order into an
//! accumulator whose lane layout is the same whether 1 or 4 activation rows are processed, so
//! the result of a pair never depends on what else is in the batch. The AVX2 path is ours
//! because candle's CPU Q4_1 dot product is a scalar loop; the scalar path is the reference.

use crate::formats::{WeightFormat, QK};
use crate::q8::BlockQ8;
use half::f16;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Scalar reference: dot of one weight row (Q4_0, Q4_1 or Q8_0 bytes) with one activation row.
pub fn dot_q8_scalar(format: WeightFormat, w: &[u8], a: &[BlockQ8]) -> f32 {
    let bb = format.block_bytes();
    let mut acc = 0f32;
    for (wb, ab) in w.chunks_exact(bb).zip(a) {
        match format {
            WeightFormat::Q4_1 => {
                let (d, m) = (f16_at(wb, 0), f16_at(wb, 2));
                let mut s = 0i32;
                for j in 0..QK / 2 {
                    let q = wb[4 + j];
                    s += (q & 0xF) as i32 * ab.qs[j] as i32 + (q >> 4) as i32 * ab.qs[j + QK / 2] as i32;
                }
                acc += d * ab.d * s as f32 + m * ab.s;
            }
            WeightFormat::Q4_0 => {
                let d = f16_at(wb, 0);
                let mut s = 0i32;
                for j in 0..QK / 2 {
                    let q = wb[2 + j];
                    s += (q & 0xF) as i32 * ab.qs[j] as i32 + (q >> 4) as i32 * ab.qs[j + QK / 2] as i32;
                }
                acc += d * ab.d * s as f32 - 8.0 * d * ab.s;
            }
            WeightFormat::Q8_0 => {
                let d = f16_at(wb, 0);
                let mut s = 0i32;
                for j in 0..QK {
                    s += (wb[2 + j] as i8) as i32 * ab.qs[j] as i32;
                }
                acc += d * ab.d * s as f32;
            }
            _ => unreachable!("{format:?} has no int8 dot path"),
        }
    }
    acc
}

/// Dot of one weight row with `N` activation rows (N in 1..=4), the fastest path this CPU has.
#[inline]
pub fn dot_q8_rows<const N: usize>(format: WeightFormat, w: &[u8], acts: [&[BlockQ8]; N]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        if f.avx512_vnni {
            // SAFETY: AVX2, FMA, F16C and AVX-512 VNNI/VL were detected at run time.
            return unsafe { avx2::dot_rows_vnni::<N>(format, w, acts) };
        }
        if f.avx2_fma {
            // SAFETY: AVX2, FMA and F16C were detected at run time.
            return unsafe { avx2::dot_rows::<N>(format, w, acts) };
        }
    }
    acts.map(|a| dot_q8_scalar(format, w, a))
}

/// f32 dot product with 8 independent partial sums combined in a fixed order (deterministic,
/// and vectorizable by the compiler without fast-math).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma {
            // SAFETY: AVX2 and FMA were detected at run time.
            return unsafe { avx2::dot_f32(a, b) };
        }
    }
    dot_f32_scalar(a, b)
}

/// `acc += w * x`, element by element (a multiply then an add, no fused rounding, so every path
/// gives the scalar loop's bits).
#[inline]
pub fn axpy_f32(acc: &mut [f32], w: f32, x: &[f32]) {
    assert_eq!(acc.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma {
            // SAFETY: AVX2 was detected at run time; the lengths are equal (asserted).
            return unsafe { avx2::axpy_f32(acc, w, x) };
        }
    }
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += w * v;
    }
}

pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        for l in 0..8 {
            acc[l] += a[i + l] * b[i + l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// How far ahead of the current weight block to prefetch (a few rows of a small matrix).
    const PREFETCH_BYTES: usize = 2048;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Generates one dot kernel per instruction set. `$mulsum(w_u8, a_i8)` returns the eight i32
    /// sums of four u8*i8 products each; maddubs+madd (AVX2) and dpbusd (AVX-512 VNNI) give the
    /// same integers, so both kernels produce bitwise-identical results.
    macro_rules! dot_kernels {
        ($name:ident, $features:literal, $mulsum:ident) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name<const N: usize>(format: WeightFormat, w: &[u8], acts: [&[BlockQ8]; N]) -> [f32; N] {
                let nb = acts[0].len();
                let bb = format.block_bytes();
                debug_assert!(w.len() >= nb * bb);
                let m4 = _mm_set1_epi8(0x0F);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut sacc = [0f32; N];
                let wp = w.as_ptr();
                match format {
                    WeightFormat::Q4_1 | WeightFormat::Q4_0 => {
                        let q4_1 = format == WeightFormat::Q4_1;
                        let off = if q4_1 { 4 } else { 2 };
                        for b in 0..nb {
                            // SAFETY: b < nb and w holds nb blocks of bb bytes (checked by QMatrix::new).
                            let blk = wp.add(b * bb);
                            // weights stream from memory once per step: fetch well ahead of use
                            _mm_prefetch::<_MM_HINT_T0>(blk.add(PREFETCH_BYTES) as *const i8);
                            // d (and m for Q4_1) are the leading f16s of the block: convert both at once.
                            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
                            let d = _mm_cvtss_f32(dm);
                            let m = if q4_1 { _mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 1)) } else { -8.0 * d };
                            let qs = _mm_loadu_si128(blk.add(off) as *const __m128i);
                            let lo = _mm_and_si128(qs, m4);
                            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
                            let wq = _mm256_set_m128i(hi, lo);
                            for n in 0..N {
                                let ab = acts[n].get_unchecked(b);
                                let a = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                                let p = $mulsum(wq, a);
                                acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * ab.d), _mm256_cvtepi32_ps(p), acc[n]);
                                sacc[n] += m * ab.s;
                            }
                        }
                    }
                    WeightFormat::Q8_0 => {
                        for b in 0..nb {
                            // SAFETY: as above.
                            let blk = wp.add(b * bb);
                            _mm_prefetch::<_MM_HINT_T0>(blk.add(PREFETCH_BYTES) as *const i8);
                            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const u16).read_unaligned() as i32)));
                            let wq = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                            let aw = _mm256_sign_epi8(wq, wq);
                            for n in 0..N {
                                let ab = acts[n].get_unchecked(b);
                                let a = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                                let p = $mulsum(aw, _mm256_sign_epi8(a, wq));
                                acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * ab.d), _mm256_cvtepi32_ps(p), acc[n]);
                            }
                        }
                    }
                    _ => unreachable!("{format:?} has no int8 dot path"),
                }
                let mut out = [0f32; N];
                for n in 0..N {
                    out[n] = hsum(acc[n]) + sacc[n];
                }
                out
            }
        };
    }

    #[inline(always)]
    unsafe fn mulsum_avx2(w: __m256i, a: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1))
    }

    #[inline(always)]
    unsafe fn mulsum_vnni(w: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a)
    }

    dot_kernels!(dot_rows, "avx2,fma,f16c", mulsum_avx2);
    dot_kernels!(dot_rows_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", mulsum_vnni);

    #[target_feature(enable = "avx2")]
    pub unsafe fn axpy_f32(acc: &mut [f32], w: f32, x: &[f32]) {
        let n = acc.len();
        let n8 = n / 8 * 8;
        let wv = _mm256_set1_ps(w);
        let (pa, px) = (acc.as_mut_ptr(), x.as_ptr());
        let mut i = 0;
        while i < n8 {
            // SAFETY: i + 8 <= n8 <= both lengths.
            let v = _mm256_add_ps(_mm256_loadu_ps(pa.add(i)), _mm256_mul_ps(wv, _mm256_loadu_ps(px.add(i))));
            _mm256_storeu_ps(pa.add(i), v);
            i += 8;
        }
        for j in n8..n {
            acc[j] += w * x[j];
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let n8 = n / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut i = 0;
        while i < n8 {
            // SAFETY: i + 8 <= n8 <= len of both slices.
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc);
            i += 8;
        }
        let mut s = hsum(acc);
        for j in n8..n {
            s += a[j] * b[j];
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{dequantize_row, quantize_row};
    use crate::q8::quantize_rows;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
    }

    #[test]
    fn simd_matches_scalar_reference_for_every_int8_format() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for f in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            for cols in [32, 64, 576, 1536] {
                let w = quantize_row(f, &rand_vec(&mut rng, cols));
                let acts: Vec<_> = (0..4).map(|_| quantize_rows(&rand_vec(&mut rng, cols), cols)).collect();
                let four = dot_q8_rows::<4>(f, &w, [acts[0].row(0), acts[1].row(0), acts[2].row(0), acts[3].row(0)]);
                for (n, a) in acts.iter().enumerate() {
                    let one = dot_q8_rows::<1>(f, &w, [a.row(0)])[0];
                    assert_eq!(one.to_bits(), four[n].to_bits(), "{f:?} cols {cols}: 1-row and 4-row paths differ");
                    let reference = dot_q8_scalar(f, &w, a.row(0));
                    assert!((one - reference).abs() <= 1e-4 * (1.0 + reference.abs()), "{f:?}: {one} vs {reference}");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_and_avx2_kernels_agree_bitwise() {
        let f = crate::cpu::features();
        if !(f.avx2_fma && f.avx512_vnni) {
            eprintln!("skipping: this CPU has no AVX-512 VNNI");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for fmt in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let w = quantize_row(fmt, &rand_vec(&mut rng, 576));
            let a = quantize_rows(&rand_vec(&mut rng, 576), 576);
            // SAFETY: features checked above.
            let (x, y) = unsafe { (avx2::dot_rows::<1>(fmt, &w, [a.row(0)]), avx2::dot_rows_vnni::<1>(fmt, &w, [a.row(0)])) };
            assert_eq!(x[0].to_bits(), y[0].to_bits(), "{fmt:?}");
        }
    }

    #[test]
    fn int8_dot_approximates_the_float_dot_of_dequantized_weights() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let cols = 576;
        let x = rand_vec(&mut rng, cols);
        for f in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let w = quantize_row(f, &rand_vec(&mut rng, cols));
            let mut wd = vec![0f32; cols];
            dequantize_row(f, &w, &mut wd);
            let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
            let got = dot_q8_rows::<1>(f, &w, [quantize_rows(&x, cols).row(0)])[0];
            // activation quantization error: |x_i - q_i| <= amax/254 per element
            let bound = wd.iter().map(|v| v.abs()).sum::<f32>() * 2.0 / 254.0;
            assert!((exact - got).abs() <= bound, "{f:?}: {exact} vs {got} (bound {bound})");
        }
    }

    #[test]
    fn axpy_equals_the_scalar_loop_bitwise() {
        for n in [1, 8, 13, 64] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.77).sin()).collect();
            let mut fast: Vec<f32> = (0..n).map(|i| (i as f32 * 0.31).cos()).collect();
            let mut slow = fast.clone();
            axpy_f32(&mut fast, 0.173, &x);
            for (a, v) in slow.iter_mut().zip(&x) {
                *a += 0.173 * v;
            }
            assert_eq!(fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn f32_dot_handles_tails() {
        for n in [1, 7, 8, 9, 64, 67] {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_f32(&a, &b) as f64 - exact).abs() < 1e-3 * (1.0 + exact.abs()));
            assert!((dot_f32_scalar(&a, &b) as f64 - exact).abs() < 1e-3 * (1.0 + exact.abs()));
        }
    }
}
