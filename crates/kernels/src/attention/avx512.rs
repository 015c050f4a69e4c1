//! The AVX-512 kernels: the AVX2 kernels' arithmetic in registers twice as wide, lane for lane.
//!
//! Scores: a 512-bit accumulator holds two query vectors' eight lanes (the low half vector `2p`,
//! the high half `2p + 1`, from [`pack_queries`]) against one key whose eight values fill both
//! halves, so each lane is the same chain of fused multiply-adds as the AVX2 kernel's and the
//! horizontal sums are `avx2::hsum`'s: the scores have the AVX2 path's bits with half the
//! instructions. Weighted values: each output lane is its own chain of fused multiply-adds over
//! the keys in order, so sixteen lanes give the eight-lane kernel's bits.

use super::avx2::{hsum, hsum4, load8, prefetch_rows, row_ptr, Pace, Spread};
use super::{KeyGroup, KvView, DIMS_PER_PREFETCH, Q8_BLOCK, SCORE_VECTORS, TILE};
use std::arch::x86_64::*;

/// Query vectors `v0..v0 + n` (each `hd` floats at `q[offset(v)]`) laid out for [`scores`]: pair
/// `p` as `hd / 8` chunks of sixteen floats, vector `2p`'s eight then vector `2p + 1`'s (the last
/// vector repeated when `n` is odd).
pub(super) fn pack_queries(packed: &mut Vec<f32>, q: &[f32], n: usize, hd: usize, offset: impl Fn(usize) -> usize) {
    packed.clear();
    for p in 0..n.div_ceil(2) {
        let (a, b) = (offset(2 * p), offset((2 * p + 1).min(n - 1)));
        for c in (0..hd).step_by(8) {
            packed.extend_from_slice(&q[a + c..a + c + 8]);
            packed.extend_from_slice(&q[b + c..b + c + 8]);
        }
    }
}

/// `exp::exp_shifted_sum` compiled for AVX-512: the exponentials sixteen lanes at a time, the
/// same bits (elementwise, and the sum in its eight written lanes).
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn exp_shifted_sum(x: &mut [f32], m: f32) -> f32 {
    crate::exp::exp_shifted_sum(x, m)
}

/// Eight values from element `e0 + c` (a multiple of 8; `r` the row's [`row_ptr`]) in both
/// halves: `load8_row`'s, the plain types loaded twice and converted once.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn load8x2<const D: u8>(v: KvView, r: *const u8, e0: usize, c: usize) -> __m512 {
    match D {
        0 => _mm512_broadcast_f32x8(_mm256_loadu_ps(r.add(4 * c) as *const f32)),
        1 => _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128(r.add(2 * c) as *const __m128i))),
        2 => _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128(r.add(2 * c) as *const __m128i))), 16)),
        _ => _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(load8::<D>(v, e0 + c)))),
    }
}

/// Sixteen values from element `e` (a multiple of 16, so inside one 32-value block of the
/// quantized types) as f32: `load8`'s conversion, lane for lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn load16<const D: u8>(v: KvView, e: usize) -> __m512 {
    let p = v.data.as_ptr();
    match D {
        0 => _mm512_loadu_ps(p.add(4 * e) as *const f32),
        1 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * e) as *const __m256i)),
        2 => _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(2 * e) as *const __m256i)), 16)),
        3 => {
            let q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(e) as *const __m128i)));
            let d = _mm_cvtph_ps(_mm_cvtsi32_si128(*v.scales.get_unchecked(e / Q8_BLOCK) as i32));
            _mm512_mul_ps(q, _mm512_broadcastss_ps(d))
        }
        _ => {
            // values j and j + 16 of a block share byte j (low and high nibble)
            let (blk, r) = (e / Q8_BLOCK, e % Q8_BLOCK);
            let b = _mm_loadu_si128(p.add(blk * (Q8_BLOCK / 2)) as *const __m128i);
            let b = if r >= Q8_BLOCK / 2 { _mm_srli_epi16(b, 4) } else { b };
            let levels = _mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F)));
            let q = _mm512_cvtepi32_ps(_mm512_sub_epi32(levels, _mm512_set1_epi32(8)));
            let d = _mm_cvtph_ps(_mm_cvtsi32_si128(*v.scales.get_unchecked(e / Q8_BLOCK) as i32));
            _mm512_mul_ps(q, _mm512_broadcastss_ps(d))
        }
    }
}

/// `NP` query pairs (the first `nb` vectors valid) against `NK` keys from `offs[j]`: one
/// accumulator per (pair, key) over the head. Rows `pf[j..j + NK]` of the next tile are
/// prefetched on the way.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn score_block<const D: u8, const NP: usize, const NK: usize>(
    s: *mut f32,
    q: *const f32,
    nb: usize,
    k: KvView,
    offs: &[usize],
    j: usize,
    hd: usize,
    scale: f32,
    pf: &[usize],
) {
    prefetch_rows(k, pf, j, NK, hd);
    let mut acc = [[_mm512_setzero_ps(); NK]; NP];
    let ko: [usize; NK] = std::array::from_fn(|n| *offs.get_unchecked(j + n));
    let kp: [*const u8; NK] = std::array::from_fn(|n| row_ptr::<D>(k, ko[n]));
    for c in (0..hd).step_by(8) {
        let kv: [__m512; NK] = std::array::from_fn(|n| load8x2::<D>(k, kp[n], ko[n], c));
        for (p, row) in acc.iter_mut().enumerate() {
            let qv = _mm512_loadu_ps(q.add(p * 2 * hd + 2 * c));
            for n in 0..NK {
                row[n] = _mm512_fmadd_ps(qv, kv[n], row[n]);
            }
        }
    }
    if NK.is_multiple_of(4) {
        return store_key_quads::<NP, NK>(s, &acc, nb, j, scale);
    }
    // the halves of the valid vectors, four horizontal sums at a time (hsum4: hsum's bits)
    let mut halves = [[_mm256_setzero_ps(); NK]; 2]; // reused per pair
    let mut pending: [(__m256, usize); 4] = [(_mm256_setzero_ps(), 0); 4];
    let mut np = 0;
    for (p, row) in acc.iter().enumerate() {
        for n in 0..NK {
            halves[0][n] = _mm512_castps512_ps256(row[n]);
            halves[1][n] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(row[n])));
        }
        for (h, half) in halves.iter().enumerate() {
            let v = 2 * p + h;
            if v >= nb {
                continue;
            }
            for (n, &a) in half.iter().enumerate() {
                pending[np] = (a, v * TILE + j + n);
                np += 1;
                if np == 4 {
                    store_sums(s, &pending, np, scale);
                    np = 0;
                }
            }
        }
    }
    store_sums(s, &pending, np, scale);
}

/// The scores of `NP` pairs' accumulators against keys `j..j + NK` (`NK` a multiple of 4), each
/// `hsum`'s bits, sixteen at a time in 512-bit registers: two pairs' accumulators for one key
/// folded into one register (their 128-bit lanes 0 + 1 and 2 + 3: `fold`'s sums for four
/// vectors), then four keys' such registers transposed lane by lane within each 128-bit lane as
/// `hsum4` does, which leaves in 128-bit lane `L` vector `L`'s scores against the four keys: one
/// store each. About a third of the instructions of one `hsum4` per four scores.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn store_key_quads<const NP: usize, const NK: usize>(s: *mut f32, acc: &[[__m512; NK]; NP], nb: usize, j: usize, scale: f32) {
    let sc = _mm512_set1_ps(scale);
    let mut p = 0;
    while p < NP {
        // pairs p and p + 1 (the last pair with itself: its vectors again in lanes 2 and 3)
        let p1 = (p + 1).min(NP - 1);
        for q in (0..NK).step_by(4) {
            let f: [__m512; 4] = std::array::from_fn(|n| {
                let (a, b) = (acc[p][q + n], acc[p1][q + n]);
                // [a.L0, a.L2, b.L0, b.L2] + [a.L1, a.L3, b.L1, b.L3]
                _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b))
            });
            let (t0, t1) = (_mm512_unpacklo_ps(f[0], f[1]), _mm512_unpacklo_ps(f[2], f[3]));
            let (t2, t3) = (_mm512_unpackhi_ps(f[0], f[1]), _mm512_unpackhi_ps(f[2], f[3]));
            let pd = _mm512_castps_pd;
            let (r0, r1) = (_mm512_castpd_ps(_mm512_unpacklo_pd(pd(t0), pd(t1))), _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t0), pd(t1))));
            let (r2, r3) = (_mm512_castpd_ps(_mm512_unpacklo_pd(pd(t2), pd(t3))), _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t2), pd(t3))));
            let r = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(r0, r2), _mm512_add_ps(r1, r3)), sc);
            let lanes = if p1 == p { 2 } else { 4 };
            for l in 0..lanes {
                let v = 2 * p + l;
                if v >= nb {
                    break;
                }
                let x = match l {
                    0 => _mm512_castps512_ps128(r),
                    1 => _mm512_extractf32x4_ps::<1>(r),
                    2 => _mm512_extractf32x4_ps::<2>(r),
                    _ => _mm512_extractf32x4_ps::<3>(r),
                };
                _mm_storeu_ps(s.add(v * TILE + j + q), x);
            }
        }
        p += 2;
    }
}

/// The horizontal sums of the first `np` accumulators, times `scale`, each at its own index of
/// `s`: four at once through `hsum4`, fewer one by one (the same bits).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_sums(s: *mut f32, pending: &[(__m256, usize); 4], np: usize, scale: f32) {
    if np == 4 {
        let mut sums = [0f32; 4];
        _mm_storeu_ps(sums.as_mut_ptr(), _mm_mul_ps(hsum4(pending.map(|(a, _)| a)), _mm_set1_ps(scale)));
        for (x, v) in sums.into_iter().enumerate() {
            *s.add(pending[x].1) = v;
        }
    } else {
        for &(a, at) in &pending[..np] {
            *s.add(at) = hsum(a) * scale;
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_np<const D: u8, const NP: usize, const NK: usize>(
    s: &mut [f32],
    q: *const f32,
    nb: usize,
    k: KvView,
    offs: &[usize],
    x: usize,
    y: usize,
    hd: usize,
    scale: f32,
    pf: &[usize],
) {
    let sp = s.as_mut_ptr();
    let mut j = x;
    while j + NK <= y {
        score_block::<D, NP, NK>(sp, q, nb, k, offs, j, hd, scale, pf);
        j += NK;
    }
    while NK > 4 && j + 4 <= y {
        score_block::<D, NP, 4>(sp, q, nb, k, offs, j, hd, scale, pf);
        j += 4;
    }
    while j < y {
        score_block::<D, NP, 1>(sp, q, nb, k, offs, j, hd, scale, pf);
        j += 1;
    }
}

/// `s[i * TILE + j] = dot(q_i, k_j) * scale` for vectors `i < nb` (at most six, packed in pairs
/// from `q` by [`pack_queries`]) and keys `x..y` of the tile.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores<const D: u8>(
    s: &mut [f32],
    nb: usize,
    q: *const f32,
    k: KvView,
    offs: &[usize],
    x: usize,
    y: usize,
    hd: usize,
    scale: f32,
    pf: &[usize],
) {
    // NP x NK accumulators beside NK keys and a query pair in the 32 registers
    match nb.div_ceil(2) {
        1 => scores_np::<D, 1, 8>(s, q, nb, k, offs, x, y, hd, scale, pf),
        2 => scores_np::<D, 2, 8>(s, q, nb, k, offs, x, y, hd, scale, pf),
        _ => scores_np::<D, 3, 4>(s, q, nb, k, offs, x, y, hd, scale, pf),
    }
}

/// `NB` vectors' outputs, `NC` chunks of sixteen from dimension `d`: rescaled, then one fused
/// multiply-add per key in order. `pf` asks for the next tile's rows as the keys go
/// ([`Pace`]: `values_nb` spreads them over every pass).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn value_block<const D: u8, const NB: usize, const NC: usize, P: Pace>(
    acc: *mut f32,
    alpha: &[f32],
    w: *const f32,
    v: KvView,
    offs: &[usize],
    x: usize,
    y: usize,
    d: usize,
    hd: usize,
    mut pf: P,
) {
    let mut r = [[_mm512_setzero_ps(); NC]; NB];
    for i in 0..NB {
        let a = _mm512_set1_ps(alpha[i]);
        for c in 0..NC {
            r[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc.add(i * hd + d + 16 * c)), a);
        }
    }
    for j in x..y {
        pf.key(v, j, d, hd);
        let o = *offs.get_unchecked(j) + d;
        let wj: [__m512; NB] = std::array::from_fn(|i| _mm512_set1_ps(*w.add(i * TILE + j)));
        for c in 0..NC {
            let vv = load16::<D>(v, o + 16 * c);
            for i in 0..NB {
                r[i][c] = _mm512_fmadd_ps(wj[i], vv, r[i][c]);
            }
        }
    }
    for i in 0..NB {
        for c in 0..NC {
            _mm512_storeu_ps(acc.add(i * hd + d + 16 * c), r[i][c]);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn values_nb<const D: u8, const NB: usize>(
    acc: &mut [f32],
    alpha: &[f32],
    w: &[f32],
    v: KvView,
    offs: &[usize],
    x: usize,
    y: usize,
    hd: usize,
    pf: &[usize],
) {
    let (ap, wp) = (acc.as_mut_ptr(), w.as_ptr());
    // the next tile's rows `pf[x..y]` spread over both passes' keys, not a row beside each key
    // of the first pass: asked for in half the time they stalled the pass's own loads (`perf`:
    // the samples on the value loads' conversions); f16 at 16k from memory, Zen 5, two
    // threads: 0.63 -> 0.52 ms a layer
    let mut pf = Spread::new(pf, (x, y), (hd / 64 + hd % 64 / 16) * (y - x));
    let mut d = 0;
    while d + 64 <= hd {
        value_block::<D, NB, 4, _>(ap, alpha, wp, v, offs, x, y, d, hd, &mut pf);
        d += 64;
    }
    while d < hd {
        value_block::<D, NB, 1, _>(ap, alpha, wp, v, offs, x, y, d, hd, &mut pf);
        d += 16;
    }
}

/// `acc_i = acc_i * alpha_i + sum_j w[i * TILE + j] v_j` over keys `x..y` for `nb` (at most
/// [`super::VALUE_VECTORS_512`]) vectors; `hd` a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn weighted_values<const D: u8>(
    acc: &mut [f32],
    nb: usize,
    alpha: &[f32],
    w: &[f32],
    v: KvView,
    offs: &[usize],
    x: usize,
    y: usize,
    hd: usize,
    pf: &[usize],
) {
    // NB x 4 accumulators beside NB weights and a value chunk in the 32 registers
    match nb {
        1 => values_nb::<D, 1>(acc, alpha, w, v, offs, x, y, hd, pf),
        2 => values_nb::<D, 2>(acc, alpha, w, v, offs, x, y, hd, pf),
        3 => values_nb::<D, 3>(acc, alpha, w, v, offs, x, y, hd, pf),
        4 => values_nb::<D, 4>(acc, alpha, w, v, offs, x, y, hd, pf),
        5 => values_nb::<D, 5>(acc, alpha, w, v, offs, x, y, hd, pf),
        _ => values_nb::<D, 6>(acc, alpha, w, v, offs, x, y, hd, pf),
    }
}

/// `NB` vectors (`qt`: their values dimension by dimension, [`super::pack_queries_dim`]) against
/// four groups of sixteen dimension-major keys (a whole tile): one accumulator per (vector,
/// group), a fused multiply-add per dimension in order (the AVX2 kernel's chain in each lane, so
/// its bits); the scores stored masked to the groups' keys. The next tile's rows `pf` are
/// prefetched sixteen dimensions at a time.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn score_groups<const D: u8, const NB: usize>(
    s: *mut f32,
    qt: *const f32,
    k: KvView,
    g: [KeyGroup; 4],
    hd: usize,
    stride: usize,
    scale: f32,
    pf: &mut Spread,
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; NB];
    let (mut d, mut off) = (0, 0);
    while d < hd {
        pf.step(k, hd);
        let end = (d + DIMS_PER_PREFETCH).min(hd);
        while d < end {
            let kv: [__m512; 4] = std::array::from_fn(|n| load16::<D>(k, g[n].base + off));
            let qd = qt.add(d * SCORE_VECTORS);
            for (i, a) in acc.iter_mut().enumerate() {
                let qv = _mm512_set1_ps(*qd.add(i));
                for n in 0..4 {
                    a[n] = _mm512_fmadd_ps(qv, kv[n], a[n]);
                }
            }
            d += 1;
            off += stride;
        }
    }
    let sc = _mm512_set1_ps(scale);
    for (n, g) in g.iter().enumerate().filter(|(_, g)| g.mask != 0) {
        for (i, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(s.wrapping_offset((i * TILE) as isize + g.at), g.mask as u16, _mm512_mul_ps(a[n], sc));
        }
    }
}
