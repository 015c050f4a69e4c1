//! The AVX2 + FMA + F16C kernels: eight f32 lanes, one per dimension of a head chunk.

use super::{KeyGroup, KvView, DIMS_PER_PREFETCH, Q8_BLOCK, SCORE_VECTORS, TILE};
use std::arch::x86_64::*;

/// Asks for rows `pf[j..j + n]` (where `pf` has them: element indices of the next tile's keys or
/// values) to be brought into L2, with their scales for the quantized types. The kernels call it
/// a key or two at a time inside their loops over this tile, so the next tile's lines are asked
/// for at the pace this one is read: asked for all at once at a tile's start, they filled the
/// core's miss buffers and stalled it (f16 at depth 16k from memory: 1.5 ms a layer against
/// 1.1, two threads, Zen 5).
#[inline(always)]
pub(super) unsafe fn prefetch_rows(v: KvView, pf: &[usize], j: usize, n: usize, hd: usize) {
    let bytes = v.dtype.data_bytes(hd);
    for r in j..(j + n).min(pf.len()) {
        let e = *pf.get_unchecked(r);
        let base = v.data.as_ptr().wrapping_add(v.dtype.data_bytes(e));
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(o) as *const i8);
            o += 64;
        }
        if v.dtype.has_scales() {
            _mm_prefetch::<_MM_HINT_T1>(v.scales.as_ptr().wrapping_add(e / Q8_BLOCK) as *const i8);
        }
    }
}

/// Prefetches rows `pf[x..y]` (those `pf` has: the next tile may be shorter) spread evenly over
/// `steps` calls of [`Self::step`]: the
/// dimension-major scores read a whole tile's keys dimension by dimension, and one row's values
/// ([`row_values`]) pass over a tile's keys eight times, so there is no "key at a time" to pace
/// the next tile's rows by; asked for all at once they would fill the miss buffers. The scores
/// call it every [`DIMS_PER_PREFETCH`] dimensions, the row's values every key of every pass.
pub(super) struct Spread<'a> {
    pf: &'a [usize],
    next: usize,
    end: usize,
    rows: usize,
    acc: usize,
    steps: usize,
}

impl<'a> Spread<'a> {
    pub(super) fn new(pf: &'a [usize], (x, y): (usize, usize), steps: usize) -> Self {
        let (r0, r1) = (x.min(pf.len()), y.min(pf.len()));
        let end = r1.max(r0);
        Self { pf, next: r0, end, rows: end - r0, acc: 0, steps: steps.max(1) }
    }

    /// One of the `steps` calls: the rows due by now.
    #[inline(always)]
    pub(super) unsafe fn step(&mut self, k: KvView, hd: usize) {
        self.acc += self.rows;
        while self.acc >= self.steps && self.next < self.end {
            prefetch_rows(k, self.pf, self.next, 1, hd);
            self.next += 1;
            self.acc -= self.steps;
        }
    }
}

/// How a values pass asks for the next tile's rows as it reads key `j` of a pass from dimension
/// `d`: [`FirstPass`], or a [`Spread`] that lives across the passes. Passed by value, so the
/// first (a slice) stays in registers as a plain slice argument did.
pub(super) trait Pace {
    unsafe fn key(&mut self, v: KvView, j: usize, d: usize, hd: usize);
}

/// Row `j` of the next tile beside key `j` of the first pass (`d == 0`), the rows `pf[x..y]`
/// of a pass over keys `x..y`.
#[derive(Clone, Copy)]
pub(super) struct FirstPass<'a>(pub(super) &'a [usize]);

impl Pace for FirstPass<'_> {
    #[inline(always)]
    unsafe fn key(&mut self, v: KvView, j: usize, d: usize, hd: usize) {
        if d == 0 {
            prefetch_rows(v, self.0, j, 1, hd);
        }
    }
}

impl Pace for &mut Spread<'_> {
    #[inline(always)]
    unsafe fn key(&mut self, v: KvView, _j: usize, _d: usize, hd: usize) {
        self.step(v, hd)
    }
}

/// `NB` vectors (`qt`, `pack_queries_dim`) against two groups of eight dimension-major keys: one
/// accumulator per (vector, group), a fused multiply-add per dimension in order
/// (`dot_dim_ref`'s chain in each lane); the scores stored masked to the groups' keys.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn score_groups<const D: u8, const NB: usize>(
    s: *mut f32,
    qt: *const f32,
    k: KvView,
    g: [KeyGroup; 2],
    hd: usize,
    stride: usize,
    scale: f32,
    pf: &mut Spread,
) {
    let kp = [row_ptr::<D>(k, g[0].base), row_ptr::<D>(k, g[1].base)];
    let step = k.dtype.data_bytes(stride);
    let mut acc = [[_mm256_setzero_ps(); 2]; NB];
    let (mut d, mut off) = (0, 0);
    while d < hd {
        pf.step(k, hd);
        let end = (d + DIMS_PER_PREFETCH).min(hd);
        while d < end {
            let kv = [load8_row::<D>(k, kp[0].add(off), 0, 0), load8_row::<D>(k, kp[1].add(off), 0, 0)];
            let qd = qt.add(d * SCORE_VECTORS);
            for (i, a) in acc.iter_mut().enumerate() {
                let qv = _mm256_broadcast_ss(&*qd.add(i));
                a[0] = _mm256_fmadd_ps(qv, kv[0], a[0]);
                a[1] = _mm256_fmadd_ps(qv, kv[1], a[1]);
            }
            d += 1;
            off += step;
        }
    }
    let sc = _mm256_set1_ps(scale);
    let lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (n, g) in g.iter().enumerate().filter(|(_, g)| g.mask != 0) {
        if g.mask == 0xff {
            // a whole group (every group of a decode step's inner tiles): plain stores, as
            // AMD's masked stores cost several times a store (Zen 3)
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(s.wrapping_offset((i * TILE) as isize + g.at), _mm256_mul_ps(a[n], sc));
            }
            continue;
        }
        // lane l stored where bit l of the mask is set
        let m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(g.mask as i32), lane), lane);
        for (i, a) in acc.iter().enumerate() {
            _mm256_maskstore_ps(s.wrapping_offset((i * TILE) as isize + g.at), m, _mm256_mul_ps(a[n], sc));
        }
    }
}

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn lane_max(x: &[f32]) -> f32 {
    crate::exp::lane_max(x)
}

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_shifted_sum(x: &mut [f32], m: f32) -> f32 {
    crate::exp::exp_shifted_sum(x, m)
}

/// Eight values from element `e` (a multiple of 8) of a view of type `D` (0 f32, 1 f16,
/// 2 bf16, 3 q8_0, 4 q4_0) as f32: the exact conversion `KvView::get` makes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load8<const D: u8>(v: KvView, e: usize) -> __m256 {
    match D {
        // the plain types' conversions are written once, in `load8_row`
        0..=2 => load8_row::<D>(v, row_ptr::<D>(v, e), e, 0),
        _ => load8_scaled::<D>(v, e, block_scale(v, e)),
    }
}

/// The scale of the quantized block holding element `e`, in every lane.
#[inline(always)]
unsafe fn block_scale(v: KvView, e: usize) -> __m256 {
    _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(*v.scales.get_unchecked(e / Q8_BLOCK) as i32)))
}

/// [`load8`] of a quantized type (3 q8_0, 4 q4_0) given its block's scale ([`block_scale`]):
/// the levels as floats times the scale. A kernel that reads a block's four chunks in a row
/// converts the scale once for them (the same product, so the same bits).
#[inline(always)]
unsafe fn load8_scaled<const D: u8>(v: KvView, e: usize, d: __m256) -> __m256 {
    let p = v.data.as_ptr();
    let q = if D == 3 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(e) as *const __m128i)))
    } else {
        // values j and j + 16 of a block share byte j (low and high nibble)
        let (blk, r) = (e / Q8_BLOCK, e % Q8_BLOCK);
        let b = _mm_loadl_epi64(p.add(blk * (Q8_BLOCK / 2) + r % (Q8_BLOCK / 2)) as *const __m128i);
        let b = if r >= Q8_BLOCK / 2 { _mm_srli_epi16(b, 4) } else { b };
        let levels = _mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F)));
        _mm256_cvtepi32_ps(_mm256_sub_epi32(levels, _mm256_set1_epi32(8)))
    };
    _mm256_mul_ps(q, d)
}

/// Where the row whose first element is `e0` starts in a view of type `D`, for [`load8_row`]: the
/// plain types by constant arithmetic, so the kernels' loops over keys compute no type-dependent
/// (and overflow-checked) byte offset per load.
#[inline(always)]
pub(super) unsafe fn row_ptr<const D: u8>(v: KvView, e0: usize) -> *const u8 {
    match D {
        0 => v.data.as_ptr().add(4 * e0),
        1 | 2 => v.data.as_ptr().add(2 * e0),
        _ => v.data.as_ptr().add(v.dtype.data_bytes(e0)),
    }
}

/// [`load8`] of element `e0 + c` given the row's start `r` ([`row_ptr`] of `e0`): the plain types
/// by pointer, so a block of keys keeps one address register a key with the chunk as an index
/// (from element offsets the compiler kept the keys' addresses in a vector register and moved
/// them out one at a time every chunk); the quantized types through their scales as `load8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load8_row<const D: u8>(v: KvView, r: *const u8, e0: usize, c: usize) -> __m256 {
    match D {
        0 => _mm256_loadu_ps(r.add(4 * c) as *const f32),
        1 => _mm256_cvtph_ps(_mm_loadu_si128(r.add(2 * c) as *const __m128i)),
        2 => _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(r.add(2 * c) as *const __m128i)), 16)),
        _ => load8::<D>(v, e0 + c),
    }
}

/// The lanes summed: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), `dot_ref`'s order.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// An accumulator's two halves added (`hsum`'s first step).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fold(v: __m256) -> __m128 {
    _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
}

/// Four accumulators' horizontal sums, each in `hsum`'s order: (l0 + l4) + (l2 + l6) and
/// (l1 + l5) + (l3 + l7), then their sum.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn hsum4(v: [__m256; 4]) -> __m128 {
    let (x0, x1, x2, x3) = (fold(v[0]), fold(v[1]), fold(v[2]), fold(v[3]));
    let (t0, t1) = (_mm_unpacklo_ps(x0, x1), _mm_unpacklo_ps(x2, x3));
    let (t2, t3) = (_mm_unpackhi_ps(x0, x1), _mm_unpackhi_ps(x2, x3));
    // r_l: lane l of each of the four
    let (r0, r1) = (_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0));
    let (r2, r3) = (_mm_movelh_ps(t2, t3), _mm_movehl_ps(t3, t2));
    _mm_add_ps(_mm_add_ps(r0, r2), _mm_add_ps(r1, r3))
}

/// `NB` queries against `NK` keys: one accumulator per (query, key) over the head, so each
/// score has the same bits whatever the blocking. Rows `pf[j..j + NK]` of the next tile are
/// prefetched on the way.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn score_block<const D: u8, const NB: usize, const NK: usize>(
    s: *mut f32,
    q: [*const f32; SCORE_VECTORS],
    k: KvView,
    offs: &[usize],
    j: usize,
    hd: usize,
    scale: f32,
    pf: &[usize],
) {
    prefetch_rows(k, pf, j, NK, hd);
    let mut acc = [[_mm256_setzero_ps(); NK]; NB];
    let ko: [usize; NK] = std::array::from_fn(|n| *offs.get_unchecked(j + n));
    let kp: [*const u8; NK] = std::array::from_fn(|n| row_ptr::<D>(k, ko[n]));
    for c in (0..hd).step_by(8) {
        let kv: [__m256; NK] = std::array::from_fn(|n| load8_row::<D>(k, kp[n], ko[n], c));
        for i in 0..NB {
            let qv = _mm256_loadu_ps(q[i].add(c));
            for n in 0..NK {
                acc[i][n] = _mm256_fmadd_ps(qv, kv[n], acc[i][n]);
            }
        }
    }
    // four horizontal sums at a time share one transpose (hsum4: the same bits as hsum)
    let mut k = 0;
    while k + 4 <= NB * NK {
        let a: [__m256; 4] = std::array::from_fn(|x| acc[(k + x) / NK][(k + x) % NK]);
        let mut sums = [0f32; 4];
        _mm_storeu_ps(sums.as_mut_ptr(), _mm_mul_ps(hsum4(a), _mm_set1_ps(scale)));
        for (x, v) in sums.into_iter().enumerate() {
            *s.add((k + x) / NK * TILE + j + (k + x) % NK) = v;
        }
        k += 4;
    }
    while k < NB * NK {
        *s.add(k / NK * TILE + j + k % NK) = hsum(acc[k / NK][k % NK]) * scale;
        k += 1;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_nb<const D: u8, const NB: usize, const NK: usize>(
    s: &mut [f32],
    q: [*const f32; SCORE_VECTORS],
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
        score_block::<D, NB, NK>(sp, q, k, offs, j, hd, scale, pf);
        j += NK;
    }
    while j < y {
        score_block::<D, NB, 1>(sp, q, k, offs, j, hd, scale, pf);
        j += 1;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores<const D: u8>(
    s: &mut [f32],
    nb: usize,
    q: [*const f32; SCORE_VECTORS],
    k: KvView,
    offs: &[usize],
    x: usize,
    y: usize,
    hd: usize,
    scale: f32,
    pf: &[usize],
) {
    // at most 12 accumulators (NB x NK) beside NK keys and a query in the 16 registers
    match nb {
        1 => scores_nb::<D, 1, 6>(s, q, k, offs, x, y, hd, scale, pf),
        2 => scores_nb::<D, 2, 4>(s, q, k, offs, x, y, hd, scale, pf),
        3 => scores_nb::<D, 3, 3>(s, q, k, offs, x, y, hd, scale, pf),
        4 => scores_nb::<D, 4, 3>(s, q, k, offs, x, y, hd, scale, pf),
        5 => scores_nb::<D, 5, 2>(s, q, k, offs, x, y, hd, scale, pf),
        _ => scores_nb::<D, 6, 2>(s, q, k, offs, x, y, hd, scale, pf),
    }
}

/// `NB` vectors' outputs, `NC` chunks of eight from dimension `d`: rescaled, then one fused
/// multiply-add per key in order (each output lane's chain is the same whatever the blocking).
/// `pf` asks for the next tile's rows as the keys go ([`Pace`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
    let mut r = [[_mm256_setzero_ps(); NC]; NB];
    for i in 0..NB {
        let a = _mm256_set1_ps(alpha[i]);
        for c in 0..NC {
            r[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc.add(i * hd + d + 8 * c)), a);
        }
    }
    for j in x..y {
        pf.key(v, j, d, hd);
        let o = *offs.get_unchecked(j) + d;
        if D >= 3 || NB > NC {
            // the key's chunks converted first, then one broadcast weight at a time: a quantized
            // block's four chunks (`values_nb` passes over whole blocks) with its scale converted
            // once, or more vectors than chunks (`row_values`: NC + 1 registers beside the
            // accumulators, 15 at NB = 6, NC = 2)
            let vv: [__m256; NC] = if D >= 3 {
                debug_assert!(NC * 8 <= Q8_BLOCK && o.is_multiple_of(Q8_BLOCK), "a pass within one quantized block");
                let sc = block_scale(v, o);
                std::array::from_fn(|c| load8_scaled::<D>(v, o + 8 * c, sc))
            } else {
                std::array::from_fn(|c| load8::<D>(v, o + 8 * c))
            };
            for i in 0..NB {
                let wi = _mm256_broadcast_ss(&*w.add(i * TILE + j));
                for c in 0..NC {
                    r[i][c] = _mm256_fmadd_ps(wi, vv[c], r[i][c]);
                }
            }
            continue;
        }
        let wj: [__m256; NB] = std::array::from_fn(|i| _mm256_broadcast_ss(&*w.add(i * TILE + j)));
        for c in 0..NC {
            let vv = load8::<D>(v, o + 8 * c);
            for i in 0..NB {
                r[i][c] = _mm256_fmadd_ps(wj[i], vv, r[i][c]);
            }
        }
    }
    for i in 0..NB {
        for c in 0..NC {
            _mm256_storeu_ps(acc.add(i * hd + d + 8 * c), r[i][c]);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
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
    let pf = FirstPass(pf);
    if D >= 3 {
        // a quantized head is whole blocks: a pass a block (eight accumulators, four chunks)
        for d in (0..hd).step_by(Q8_BLOCK) {
            value_block::<D, NB, 4, _>(ap, alpha, wp, v, offs, x, y, d, hd, pf);
        }
        return;
    }
    // six chunks (48 dimensions) a pass where the head has them: 12 accumulators, NB = 2
    // broadcast weights and one value vector fill the 16 registers without a spill (three vectors
    // by four chunks spilled an accumulator every key: its chain waited on a store and a reload)
    let mut d = 0;
    while d + 48 <= hd {
        value_block::<D, NB, 6, _>(ap, alpha, wp, v, offs, x, y, d, hd, pf);
        d += 48;
    }
    while d + 32 <= hd {
        value_block::<D, NB, 4, _>(ap, alpha, wp, v, offs, x, y, d, hd, pf);
        d += 32;
    }
    while d + 16 <= hd {
        value_block::<D, NB, 2, _>(ap, alpha, wp, v, offs, x, y, d, hd, pf);
        d += 16;
    }
    while d < hd {
        value_block::<D, NB, 1, _>(ap, alpha, wp, v, offs, x, y, d, hd, pf);
        d += 8;
    }
}

/// [`weighted_values`] of one query row's group (three to six vectors) over plain values
/// (`D` <= 2), a decode step's: passes of two chunks with every vector, so each value is
/// converted once a tile (in passes of two vectors, three times for a group of six), and the next
/// tile's rows spread over every pass's keys (asked for in the first pass alone, four lines a key,
/// they filled the miss buffers and stalled it: see [`prefetch_rows`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn row_values<const D: u8, const NB: usize>(
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
    // rows `pf[x..y]` (the caller asks for the others at once, as for the scores)
    let mut pf = Spread::new(pf, (x, y), hd.div_ceil(16) * (y - x));
    let mut d = 0;
    while d + 16 <= hd {
        value_block::<D, NB, 2, _>(ap, alpha, wp, v, offs, x, y, d, hd, &mut pf);
        d += 16;
    }
    if d < hd {
        value_block::<D, NB, 1, _>(ap, alpha, wp, v, offs, x, y, d, hd, &mut pf);
    }
}

/// `acc_i = acc_i * alpha_i + sum_j w[i * TILE + j] v_j` for `nb` vectors: one query row's group
/// through [`row_values`] (plain values, three to six vectors), else [`values_nb`] (at most two
/// vectors); either asks for the next tile's rows `pf[x..y]`.
#[target_feature(enable = "avx2,fma,f16c")]
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
    match nb {
        1 => values_nb::<D, 1>(acc, alpha, w, v, offs, x, y, hd, pf),
        2 => values_nb::<D, 2>(acc, alpha, w, v, offs, x, y, hd, pf),
        3 => row_values::<D, 3>(acc, alpha, w, v, offs, x, y, hd, pf),
        4 => row_values::<D, 4>(acc, alpha, w, v, offs, x, y, hd, pf),
        5 => row_values::<D, 5>(acc, alpha, w, v, offs, x, y, hd, pf),
        _ => row_values::<D, 6>(acc, alpha, w, v, offs, x, y, hd, pf),
    }
}
