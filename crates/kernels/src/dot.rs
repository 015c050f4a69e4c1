//! f32 vector kernels (dot products, weighted row sums) with a fixed reduction order: attention and
//! the row-by-row matmul of K-quant weights. The other formats' matmul kernels live in `packed`
//! and `packed::float`.

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

/// `out[p] = dot_f32(q, rows[offsets[p]..]) * scale` for every `p`, with the same bits as that
/// expression: attention's scores, eight keys at a time (the eight horizontal sums share one
/// transpose instead of one shuffle chain each).
pub fn scaled_dots(out: &mut [f32], q: &[f32], rows: &[f32], offsets: &[usize], scale: f32) {
    assert_eq!(out.len(), offsets.len());
    let n = q.len();
    assert!(offsets.iter().all(|&o| o + n <= rows.len()), "scaled_dots: a row is out of bounds");
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma && n.is_multiple_of(8) {
            // SAFETY: AVX2 and FMA were detected at run time; every row is in bounds (asserted).
            return unsafe { avx2::scaled_dots(out, q, rows, offsets, scale) };
        }
    }
    for (o, &off) in out.iter_mut().zip(offsets) {
        *o = dot_f32(q, &rows[off..off + n]) * scale;
    }
}

/// [`scaled_dots`] for the `heads` query heads that share one KV head (grouped-query attention):
/// `qs` holds them one after the other (`heads * n` floats) and `out` gets head `j`'s scores at
/// `out[j * keys..(j + 1) * keys]`, each the bits `scaled_dots` gives it alone. Three heads at a
/// time read each key vector once for all three (one load per 1.7 FMAs instead of one per FMA).
pub fn scaled_dots_heads(out: &mut [f32], qs: &[f32], heads: usize, rows: &[f32], offsets: &[usize], scale: f32) {
    let keys = offsets.len();
    assert!(heads > 0 && qs.len().is_multiple_of(heads) && out.len() == heads * keys);
    let n = qs.len() / heads;
    if n == 0 {
        return out.fill(0.0);
    }
    assert!(offsets.iter().all(|&o| o + n <= rows.len()), "scaled_dots_heads: a row is out of bounds");
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma && n.is_multiple_of(8) {
            let mut h = 0;
            while h < heads {
                let (o, q) = (&mut out[h * keys..], &qs[h * n..]);
                // SAFETY: AVX2 and FMA were detected at run time; every row is in bounds (asserted),
                // `o` holds the scores of the heads from h on and `q` their queries.
                h += unsafe {
                    match heads - h {
                        1 => avx2::scaled_dots_heads::<1>(o, q, n, rows, offsets, scale),
                        2 | 4 => avx2::scaled_dots_heads::<2>(o, q, n, rows, offsets, scale),
                        _ => avx2::scaled_dots_heads::<3>(o, q, n, rows, offsets, scale),
                    }
                };
            }
            return;
        }
    }
    for (o, q) in out.chunks_exact_mut(keys.max(1)).zip(qs.chunks_exact(n)) {
        scaled_dots(o, q, rows, offsets, scale);
    }
}

/// `acc[i] += ws[p] * rows[offsets[p] + i]` for every `p` in order (a multiply then an add per
/// term, no fused rounding, so every path gives the same bits): attention's weighted sum of value
/// rows, with the accumulator kept in registers across all rows.
pub fn weighted_rows_sum(acc: &mut [f32], ws: &[f32], rows: &[f32], offsets: &[usize]) {
    assert_eq!(ws.len(), offsets.len());
    let n = acc.len();
    assert!(offsets.iter().all(|&o| o + n <= rows.len()), "weighted_rows_sum: a row is out of bounds");
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::features().avx2_fma && n.is_multiple_of(8) {
            // SAFETY: AVX2 was detected at run time; every row is in bounds (asserted).
            return unsafe { avx2::weighted_rows_sum(acc, ws, rows, offsets) };
        }
    }
    for (&w, &o) in ws.iter().zip(offsets) {
        for (a, &v) in acc.iter_mut().zip(&rows[o..o + n]) {
            *a += w * v;
        }
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
    use std::arch::x86_64::*;

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

    /// An accumulator's two halves added (`hsum`'s first step).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn fold_halves(a: __m256) -> __m128 {
        _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1))
    }

    /// The horizontal sums of four folded accumulators at once, each as `hsum` adds its lanes:
    /// (x0 + x2) + (x1 + x3); one transpose instead of four shuffle chains.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum4(x0: __m128, x1: __m128, x2: __m128, x3: __m128) -> __m128 {
        let (t0, t1) = (_mm_unpacklo_ps(x0, x1), _mm_unpacklo_ps(x2, x3));
        let (t2, t3) = (_mm_unpackhi_ps(x0, x1), _mm_unpackhi_ps(x2, x3));
        let (r0, r1) = (_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0));
        let (r2, r3) = (_mm_movelh_ps(t2, t3), _mm_movehl_ps(t3, t2));
        _mm_add_ps(_mm_add_ps(r0, r2), _mm_add_ps(r1, r3))
    }

    /// `H` heads (queries `qs[h * n..]`) against four keys per pass, scores of head `h` at
    /// `out[h * keys..]` (`keys = offsets.len()`); each key's accumulator and horizontal sum
    /// follow `dot_f32` exactly. Returns `H`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scaled_dots_heads<const H: usize>(out: &mut [f32], qs: &[f32], n: usize, rows: &[f32], offsets: &[usize], scale: f32) -> usize {
        let (pq, pr) = (qs.as_ptr(), rows.as_ptr());
        let keys = offsets.len();
        let sv = _mm_set1_ps(scale);
        let mut k0 = 0;
        while k0 + 4 <= keys {
            let mut acc = [[_mm256_setzero_ps(); 4]; H];
            // SAFETY: k0 + 4 <= keys.
            let offs: [usize; 4] = std::array::from_fn(|k| *offsets.get_unchecked(k0 + k));
            let mut c = 0;
            while c < n {
                for (h, a) in acc.iter_mut().enumerate() {
                    // SAFETY: the caller passes H heads of n floats; c + 8 <= n.
                    let qv = _mm256_loadu_ps(pq.add(h * n + c));
                    for k in 0..4 {
                        // SAFETY: offs[k] + n <= rows.len() (checked by the caller).
                        a[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(pr.add(offs[k] + c)), a[k]);
                    }
                }
                c += 8;
            }
            for (h, a) in acc.iter().enumerate() {
                let v = _mm_mul_ps(hsum4(fold_halves(a[0]), fold_halves(a[1]), fold_halves(a[2]), fold_halves(a[3])), sv);
                // SAFETY: out holds H rows of `keys` scores; k0 + 4 <= keys.
                _mm_storeu_ps(out.as_mut_ptr().add(h * keys + k0), v);
            }
            k0 += 4;
        }
        for h in 0..H {
            for k in k0..keys {
                let o = offsets[k];
                out[h * keys + k] = dot_f32(&qs[h * n..(h + 1) * n], &rows[o..o + n]) * scale;
            }
        }
        H
    }

    /// Eight keys per pass; each key's accumulator and horizontal sum follow `dot_f32` exactly
    /// (lanes added as (x0 + x2) + (x1 + x3) after folding the two halves).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scaled_dots(out: &mut [f32], q: &[f32], rows: &[f32], offsets: &[usize], scale: f32) {
        let n = q.len();
        let (pq, pr) = (q.as_ptr(), rows.as_ptr());
        let keys = offsets.len();
        let mut k0 = 0;
        while k0 + 8 <= keys {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < n {
                let qv = _mm256_loadu_ps(pq.add(c));
                for (k, a) in acc.iter_mut().enumerate() {
                    // SAFETY: offsets[k0 + k] + n <= rows.len() (checked by the caller), c + 8 <= n.
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(pr.add(*offsets.get_unchecked(k0 + k) + c)), *a);
                }
                c += 8;
            }
            let x = acc.map(|a| fold_halves(a));
            let lo = hsum4(x[0], x[1], x[2], x[3]);
            let hi = hsum4(x[4], x[5], x[6], x[7]);
            let v = _mm256_mul_ps(_mm256_set_m128(hi, lo), _mm256_set1_ps(scale));
            _mm256_storeu_ps(out.as_mut_ptr().add(k0), v);
            k0 += 8;
        }
        for k in k0..keys {
            let o = offsets[k];
            out[k] = dot_f32(q, &rows[o..o + n]) * scale;
        }
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn weighted_rows_sum(acc: &mut [f32], ws: &[f32], rows: &[f32], offsets: &[usize]) {
        const R: usize = 8; // registers of 8 floats per pass: 64 columns
        let n = acc.len();
        let pr = rows.as_ptr();
        let mut c0 = 0;
        while c0 < n {
            let regs = ((n - c0) / 8).min(R);
            let mut a = [_mm256_setzero_ps(); R];
            for (r, a) in a.iter_mut().enumerate().take(regs) {
                *a = _mm256_loadu_ps(acc.as_ptr().add(c0 + 8 * r));
            }
            for (&w, &o) in ws.iter().zip(offsets) {
                let wv = _mm256_set1_ps(w);
                let row = pr.add(o + c0);
                for (r, a) in a.iter_mut().enumerate().take(regs) {
                    // SAFETY: o + n <= rows.len() (checked by the caller) and c0 + 8r + 8 <= n.
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, _mm256_loadu_ps(row.add(8 * r))));
                }
            }
            for (r, a) in a.iter().enumerate().take(regs) {
                _mm256_storeu_ps(acc.as_mut_ptr().add(c0 + 8 * r), *a);
            }
            c0 += 8 * regs;
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
    #[test]
    fn scaled_dots_equal_dot_f32_bitwise() {
        let rows: Vec<f32> = (0..40 * 64).map(|i| (i as f32 * 0.23).sin() * 3.0).collect();
        let q: Vec<f32> = (0..64).map(|i| (i as f32 * 0.41).cos()).collect();
        let offsets: Vec<usize> = (0..19).map(|k| (k * 7 % 39) * 64).collect();
        let mut fast = vec![0f32; offsets.len()];
        scaled_dots(&mut fast, &q, &rows, &offsets, 0.125);
        for (k, &o) in offsets.iter().enumerate() {
            assert_eq!(fast[k].to_bits(), (dot_f32(&q, &rows[o..o + 64]) * 0.125).to_bits(), "key {k}");
        }
    }

    #[test]
    fn scores_of_grouped_heads_equal_one_head_at_a_time_bitwise() {
        let n = 64;
        let rows: Vec<f32> = (0..40 * n).map(|i| (i as f32 * 0.23).sin() * 3.0).collect();
        for heads in 1..=7 {
            let qs: Vec<f32> = (0..heads * n).map(|i| (i as f32 * 0.41).cos()).collect();
            for keys in [0usize, 1, 3, 4, 5, 8, 19] {
                let offsets: Vec<usize> = (0..keys).map(|k| (k * 7 % 39) * n).collect();
                let mut grouped = vec![0f32; heads * keys];
                scaled_dots_heads(&mut grouped, &qs, heads, &rows, &offsets, 0.125);
                for h in 0..heads {
                    let mut one = vec![0f32; keys];
                    scaled_dots(&mut one, &qs[h * n..(h + 1) * n], &rows, &offsets, 0.125);
                    let got = &grouped[h * keys..(h + 1) * keys];
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{heads} heads, {keys} keys, head {h}"
                    );
                }
            }
        }
    }

    #[test]
    fn weighted_rows_sum_equals_the_scalar_loop_bitwise() {
        let rows: Vec<f32> = (0..10 * 80).map(|i| (i as f32 * 0.19).sin()).collect();
        let offsets = [0usize, 160, 80, 720, 400];
        let ws = [0.3f32, -0.2, 0.05, 0.7, 0.15];
        for n in [8usize, 64, 80] {
            let mut fast: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
            let mut slow = fast.clone();
            weighted_rows_sum(&mut fast, &ws, &rows, &offsets);
            for (w, o) in ws.iter().zip(offsets) {
                for (i, a) in slow.iter_mut().enumerate() {
                    *a += w * rows[o + i];
                }
            }
            assert_eq!(fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "n {n}");
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
