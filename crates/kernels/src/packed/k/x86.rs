//! The x86 kernels of the Q5_0 / Q5_1 and k-quant groups (AVX2, and AVX-512 VNNI where the CPU
//! has it), their packing with 8 x 8 transposes, and the lane helpers the other families share.

use super::*;
use std::arch::x86_64::*;

/// Exact i32 per-lane sums of u8 (<= 63) x i8 products, two weight vectors at a time.
pub(crate) trait Dot {
    /// Activation rows up to which Q6_K unpacks each weight vector once for four activation
    /// blocks (more accumulators live: worth it only with 32 vector registers).
    const Q6K_SHARED_UNPACK: usize;
    /// Whether Q6_K multiplies each half's pair sums by its scale in the widening `madd`
    /// (`q6k_half_scaled`) instead of the i32 sums after (two `vpmulld` a block and row, and
    /// both halves' sums live at once: with 16 registers the accumulators spilled).
    const Q6K_SCALE_IN_MADD: bool;
    unsafe fn dot2(acc: __m256i, w0: __m256i, a0: __m256i, w1: __m256i, a1: __m256i) -> __m256i;
    /// As `dot2` for 4-bit quants (<= 15), in a partial form (AVX2: i16 lanes, which eight
    /// vectors' products fit: 16 x 15 x 127 = 30480) that `finish4` or `scaled_q4` turns into
    /// i32 sums.
    unsafe fn dot2_q4(acc: __m256i, w0: __m256i, a0: __m256i, w1: __m256i, a1: __m256i) -> __m256i;
    unsafe fn finish4(acc: __m256i) -> __m256i;
    /// `acc` plus the i16 pair products of `a` and `b` summed per i32 lane (exact).
    unsafe fn madd_add(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
    /// The i32 sums of a Q4_K sub-block (`dot2_q4`'s partial form, not yet `finish4`ed) times
    /// the lanes' scales (`sc32`: i32 lanes; `sc16`: the same in both i16 halves of a lane).
    unsafe fn scaled_q4(acc: __m256i, sc32: __m256i, sc16: __m256i) -> __m256i;
}
pub(crate) struct Avx2;
pub(crate) struct Vnni;
impl Dot for Avx2 {
    const Q6K_SHARED_UNPACK: usize = 0;
    const Q6K_SCALE_IN_MADD: bool = true;
    #[inline(always)]
    unsafe fn dot2(acc: __m256i, w0: __m256i, a0: __m256i, w1: __m256i, a1: __m256i) -> __m256i {
        // each maddubs pair is at most 2 x 63 x 127 = 16002: two of them fit i16
        let p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, a0), _mm256_maddubs_epi16(w1, a1));
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }
    #[inline(always)]
    unsafe fn dot2_q4(acc: __m256i, w0: __m256i, a0: __m256i, w1: __m256i, a1: __m256i) -> __m256i {
        _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(w0, a0), _mm256_maddubs_epi16(w1, a1)))
    }
    #[inline(always)]
    unsafe fn finish4(acc: __m256i) -> __m256i {
        _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
    }
    #[inline(always)]
    unsafe fn madd_add(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
    }
    #[inline(always)]
    unsafe fn scaled_q4(acc: __m256i, _sc32: __m256i, sc16: __m256i) -> __m256i {
        // the i16 partial sums (<= 30480) times the scale (<= 63), pairs added: exact in i32
        _mm256_madd_epi16(acc, sc16)
    }
}
impl Dot for Vnni {
    const Q6K_SHARED_UNPACK: usize = 2;
    const Q6K_SCALE_IN_MADD: bool = false;
    #[inline(always)]
    unsafe fn dot2(acc: __m256i, w0: __m256i, a0: __m256i, w1: __m256i, a1: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, w0, a0), w1, a1)
    }
    #[inline(always)]
    unsafe fn dot2_q4(acc: __m256i, w0: __m256i, a0: __m256i, w1: __m256i, a1: __m256i) -> __m256i {
        Self::dot2(acc, w0, a0, w1, a1)
    }
    #[inline(always)]
    unsafe fn finish4(acc: __m256i) -> __m256i {
        acc
    }
    #[inline(always)]
    unsafe fn madd_add(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpwssd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn scaled_q4(acc: __m256i, sc32: __m256i, _sc16: __m256i) -> __m256i {
        _mm256_mullo_epi32(acc, sc32)
    }
}

/// Whether `pack_block8` repacks `format`.
pub(crate) fn packs_eight(format: WeightFormat) -> bool {
    matches!(format, WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K)
}

/// The group block `dst` of Q4_K / Q5_K / Q6_K from the eight rows' ggml blocks `src[r]`:
/// the bytes `pack_block` writes lane by lane, with 8 x 8 transposes of 32-bit words (the
/// quants) and of bytes (the scales). Ours: a matrix read in place is repacked a group at a
/// time whenever a kernel reads it, so this must cost a fraction of the kernel (the scalar
/// `pack_block` cost twice the kernel's time).
///
/// # Safety
/// AVX2 available; each `src[r]` valid for `format.block_bytes()` reads and `dst` for
/// `group_block_bytes(format)` writes; `packs_eight(format)`.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn pack_block8(format: WeightFormat, src: [*const u8; 8], dst: *mut u8) {
    match format {
        WeightFormat::Q4K | WeightFormat::Q5K => {
            let (mut sc, mut mn) = ([0u64; 8], [0u64; 8]);
            for r in 0..8 {
                std::ptr::copy_nonoverlapping(src[r], dst.add(2 * r), 2);
                std::ptr::copy_nonoverlapping(src[r].add(2), dst.add(off::K_DMIN + 2 * r), 2);
                (sc[r], mn[r]) = scales_mins_k4(src[r].add(4));
            }
            transpose_bytes8(sc, dst.add(off::K_SC));
            transpose_bytes8(mn, dst.add(off::K_MN));
            if format == WeightFormat::Q4K {
                transpose_words(src, 16, QK_K / 2, dst.add(off::Q4K_QS));
            } else {
                transpose_words(src, 16, QK_K / 8, dst.add(off::Q5K_QH));
                transpose_words(src, 16 + QK_K / 8, QK_K / 2, dst.add(off::Q5K_QS));
            }
        }
        WeightFormat::Q6K => {
            let (mut lo, mut hi) = ([0u64; 8], [0u64; 8]);
            for r in 0..8 {
                std::ptr::copy_nonoverlapping(src[r].add(208), dst.add(2 * r), 2);
                lo[r] = (src[r].add(192) as *const u64).read_unaligned();
                hi[r] = (src[r].add(200) as *const u64).read_unaligned();
            }
            transpose_bytes8(lo, dst.add(off::Q6K_SC));
            transpose_bytes8(hi, dst.add(off::Q6K_SC + 64));
            transpose_words(src, 0, 128, dst.add(off::Q6K_QL));
            transpose_words(src, 128, 64, dst.add(off::Q6K_QH));
        }
        _ => unreachable!("{format:?} has no eight-row repacking"),
    }
}

/// The eight 6-bit scales and mins of a Q4_K / Q5_K block (its 12 scale bytes at `q`) as the
/// bytes of two words, sub-block `j` in byte `j`: `scale_min_k4` for every `j` at once.
#[inline(always)]
unsafe fn scales_mins_k4(q: *const u8) -> (u64, u64) {
    let w = |i: usize| (q.add(4 * i) as *const u32).read_unaligned();
    let (u0, u1, u2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    let sc = (u0 & LOW6) as u64 | ((((u2 & LOW4) | (((u0 >> 6) & TOP2) << 4)) as u64) << 32);
    let mn = (u1 & LOW6) as u64 | (((((u2 >> 4) & LOW4) | (((u1 >> 6) & TOP2) << 4)) as u64) << 32);
    (sc, mn)
}

/// A kernel over rows read where they lie (`rows_q4k_super_vnni`, `rows_q6k_vnni`).
pub(crate) type RowsKernel = unsafe fn(&[*const u8], usize, &[BlockQ8], &mut [f32]);

/// Rows of Q4_K ggml blocks (`blocks` super-blocks each, at `rows[i]`) against one activation
/// row with super-block scales, read where they lie: a matrix read in place at one
/// activation row (decode), where repacking each group before the kernel reads it cost more
/// than the kernel. The arithmetic of `dot_group_scalar` for `ActSpan::Super`, in its order
/// (exact i32 `T` and `M` per super-block, then the same two fused multiply-adds), so the
/// same bits. Returns each row's result.
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512 VNNI/VL available; each `rows[i]` valid for `blocks` Q4_K
/// blocks; `act` holds `8 * blocks` blocks, one scale per eight.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(crate) unsafe fn rows_q4k_super_vnni(rows: &[*const u8], blocks: usize, act: &[BlockQ8], out: &mut [f32]) {
    let nib = _mm256_set1_epi8(0x0F);
    // each activation block's sum (what the mins multiply), once for all the rows
    let sums: Vec<i32> = act[..8 * blocks].iter().map(|a| a.h[0] as i32 + a.h[1] as i32).collect();
    for (&row, out) in rows.iter().zip(out.iter_mut()) {
        let mut acc = 0f32;
        for b in 0..blocks {
            let blk = row.add(b * 144);
            if b + 1 < blocks {
                _mm_prefetch::<_MM_HINT_T0>(blk.add(144 + 64) as *const i8);
            }
            let d = f16_at_ptr(blk);
            let dmin = f16_at_ptr(blk.add(2));
            let (sc, mn) = scales_mins_k4(blk.add(4));
            let a = &act[8 * b..8 * b + 8];
            let mut t = _mm256_setzero_si256();
            // M = sum_j m_j B_j: the eight mins against the eight block sums
            let mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64));
            let mv = _mm256_mullo_epi32(mins, _mm256_loadu_si256(sums.as_ptr().add(8 * b) as *const __m256i));
            for c in 0..4 {
                let q = _mm256_loadu_si256(blk.add(16 + 32 * c) as *const __m256i);
                for (j, w) in [(2 * c, _mm256_and_si256(q, nib)), (2 * c + 1, _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib))] {
                    let av = _mm256_loadu_si256(a[j].qs.as_ptr() as *const __m256i);
                    // u8 x i8 pairs summed to i16 (at most 2 x 15 x 127), then times the
                    // sub-block's scale and summed into i32 lanes: exact
                    let p = _mm256_maddubs_epi16(w, av);
                    t = _mm256_dpwssd_epi32(t, p, _mm256_set1_epi16(((sc >> (8 * j)) & 0xFF) as i16));
                }
            }
            let (t, m) = (hsum_epi32(t), hsum_epi32(mv));
            let d_a = a[0].d;
            acc = (d * d_a).mul_add(t as f32, acc);
            acc = (-(dmin * d_a)).mul_add(m as f32, acc);
        }
        *out = acc;
    }
}

/// As `rows_q4k_super_vnni` for Q6_K rows against an activation row with block scales:
/// `dot_group_scalar`'s Q6_K arithmetic (per activation block `t = sum over its two halves of
/// sc (s - 32 A)` exact in i32, then one fused multiply-add), in its order.
///
/// # Safety
/// As `rows_q4k_super_vnni`, for Q6_K blocks and `8 * blocks` block-scaled activation blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(crate) unsafe fn rows_q6k_vnni(rows: &[*const u8], blocks: usize, act: &[BlockQ8], out: &mut [f32]) {
    let (nib, two) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    for (&row, out) in rows.iter().zip(out.iter_mut()) {
        let mut acc = 0f32;
        for b in 0..blocks {
            let blk = row.add(b * 210);
            if b + 1 < blocks {
                _mm_prefetch::<_MM_HINT_T0>(blk.add(210 + 64) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(blk.add(210 + 128) as *const i8);
            }
            let d = f16_at_ptr(blk.add(208));
            let sc = blk.add(192) as *const i8;
            for h in 0..2 {
                let ql = [_mm256_loadu_si256(blk.add(64 * h) as *const __m256i), _mm256_loadu_si256(blk.add(64 * h + 32) as *const __m256i)];
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * h) as *const __m256i);
                let mut v = [_mm256_setzero_si256(); 4];
                for (i, v) in v.iter_mut().enumerate() {
                    let ab = &act[8 * b + 4 * h + i];
                    let low = if i < 2 { _mm256_and_si256(ql[i & 1], nib) } else { _mm256_and_si256(_mm256_srli_epi16::<4>(ql[i & 1]), nib) };
                    let high = _mm256_and_si256(_mm256_srlv_epi16_bytes(qh, 2 * i as i32), two);
                    let w = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
                    // u8 (<= 63) x i8 pairs to i16 (at most 2 x 63 x 127), then the two
                    // halves' scales: exact i32
                    let p = _mm256_maddubs_epi16(w, _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i));
                    let (s0, s1) = (*sc.add(8 * h + 2 * i) as i16, *sc.add(8 * h + 2 * i + 1) as i16);
                    *v = _mm256_madd_epi16(p, _mm256_setr_epi16(s0, s0, s0, s0, s0, s0, s0, s0, s1, s1, s1, s1, s1, s1, s1, s1));
                }
                // the four blocks' lane sums at once (exact), then their float steps in order
                let a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                let mut sums = [0i32; 4];
                _mm_storeu_si128(sums.as_mut_ptr() as *mut __m128i, _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a)));
                for (i, s) in sums.into_iter().enumerate() {
                    let ab = &act[8 * b + 4 * h + i];
                    let (s0, s1) = (*sc.add(8 * h + 2 * i) as i32, *sc.add(8 * h + 2 * i + 1) as i32);
                    let t = s - 32 * (s0 * ab.h[0] as i32 + s1 * ab.h[1] as i32);
                    acc = (d * ab.d).mul_add(t as f32, acc);
                }
            }
        }
        *out = acc;
    }
}

/// Each byte of `v` shifted right by `bits` (0, 2, 4 or 6; the bytes' own bits only).
#[inline(always)]
unsafe fn _mm256_srlv_epi16_bytes(v: __m256i, bits: i32) -> __m256i {
    match bits {
        0 => v,
        2 => _mm256_srli_epi16::<2>(v),
        4 => _mm256_srli_epi16::<4>(v),
        _ => _mm256_srli_epi16::<6>(v),
    }
}

/// The sum of the eight i32 lanes of `v` (exact: integer addition in any order gives it).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let h = _mm_add_epi32(h, _mm_shuffle_epi32::<0b01_00_11_10>(h));
    _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32::<0b10_11_00_01>(h)))
}

#[inline(always)]
unsafe fn f16_at_ptr(p: *const u8) -> f32 {
    f16::from_bits((p as *const u16).read_unaligned()).to_f32()
}

/// `dst[8 j + r]` = byte `j` of `rows[r]`: an 8 x 8 byte transpose.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn transpose_bytes8(rows: [u64; 8], dst: *mut u8) {
    let pair = |a: u64, b: u64| _mm_set_epi64x(b as i64, a as i64);
    let (ab, cd) = (pair(rows[0], rows[1]), pair(rows[2], rows[3]));
    let (ef, gh) = (pair(rows[4], rows[5]), pair(rows[6], rows[7]));
    // bytes of rows 0,1 interleaved (a0 b0 a1 b1 ...), etc.
    let (ab, cd) = (_mm_unpacklo_epi8(ab, _mm_srli_si128::<8>(ab)), _mm_unpacklo_epi8(cd, _mm_srli_si128::<8>(cd)));
    let (ef, gh) = (_mm_unpacklo_epi8(ef, _mm_srli_si128::<8>(ef)), _mm_unpacklo_epi8(gh, _mm_srli_si128::<8>(gh)));
    let (abcd_lo, abcd_hi) = (_mm_unpacklo_epi16(ab, cd), _mm_unpackhi_epi16(ab, cd));
    let (efgh_lo, efgh_hi) = (_mm_unpacklo_epi16(ef, gh), _mm_unpackhi_epi16(ef, gh));
    let d = dst as *mut __m128i;
    _mm_storeu_si128(d, _mm_unpacklo_epi32(abcd_lo, efgh_lo));
    _mm_storeu_si128(d.add(1), _mm_unpackhi_epi32(abcd_lo, efgh_lo));
    _mm_storeu_si128(d.add(2), _mm_unpacklo_epi32(abcd_hi, efgh_hi));
    _mm_storeu_si128(d.add(3), _mm_unpackhi_epi32(abcd_hi, efgh_hi));
}

/// `interleave` of `len` bytes (a multiple of 32) at `at` in each of the eight rows at once:
/// 32-bit word `u` of row `r` to lane `r` of vector `u` at `dst`, eight vectors per 8 x 8
/// transpose.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn transpose_words(src: [*const u8; 8], at: usize, len: usize, dst: *mut u8) {
    for c in 0..len / 32 {
        let r: [__m256i; 8] = std::array::from_fn(|i| _mm256_loadu_si256(src[i].add(at + 32 * c) as *const __m256i));
        let t = |a: __m256i, b: __m256i| (_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
        let ((t0, t1), (t2, t3), (t4, t5), (t6, t7)) = (t(r[0], r[1]), t(r[2], r[3]), t(r[4], r[5]), t(r[6], r[7]));
        let q = |a: __m256i, b: __m256i| (_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
        // u_k: word k (low lane) and k + 4 (high lane) of rows 0-3, v_k of rows 4-7
        let ((u0, u1), (u2, u3), (v0, v1), (v2, v3)) = (q(t0, t2), q(t1, t3), q(t4, t6), q(t5, t7));
        let d = dst.add(256 * c) as *mut __m256i;
        for (k, (u, v)) in [(u0, v0), (u1, v1), (u2, v2), (u3, v3)].into_iter().enumerate() {
            _mm256_storeu_si256(d.add(k), _mm256_permute2x128_si256::<0x20>(u, v));
            _mm256_storeu_si256(d.add(k + 4), _mm256_permute2x128_si256::<0x31>(u, v));
        }
    }
}

#[inline(always)]
pub(crate) unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

#[inline(always)]
pub(crate) unsafe fn vec(p: *const u8, u: usize) -> __m256i {
    _mm256_loadu_si256(p.add(32 * u) as *const __m256i)
}

/// Eight f16 at `p` as f32.
#[inline(always)]
pub(crate) unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Eight bytes at `p` (unsigned) as f32.
#[inline(always)]
unsafe fn u8x8(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)))
}

/// Eight unsigned bytes at `p` (the lanes' 6-bit scales or mins of one sub-block) as i32
/// lanes, and as the same value in both i16 halves of each lane.
#[inline(always)]
unsafe fn sc_lanes(p: *const u8) -> (__m256i, __m256i) {
    let x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    (x, _mm256_or_si256(x, _mm256_slli_epi32::<16>(x)))
}

/// Q6_K's scales of one activation block (sub-blocks `s` and `s + 1` of a super-block) for
/// the eight rows: as i32 lanes, and as the i16 pair (-32 sc_0, -32 sc_1) of each lane.
struct Q6kScales {
    sc0: __m256i,
    sc1: __m256i,
    neg32: __m256i,
}

impl Q6kScales {
    #[inline(always)]
    unsafe fn load(sc: *const u8, s: usize) -> Self {
        let sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.add(8 * s) as *const __m128i));
        let sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.add(8 * s + 8) as *const __m128i));
        let pair = _mm256_or_si256(_mm256_and_si256(sc0, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32::<16>(sc1));
        // -32 sc fits i16 (|sc| <= 128)
        let neg32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16::<5>(pair));
        Self { sc0, sc1, neg32 }
    }

    /// Each lane's scale of half 0 and of half 1 in both of its i16 halves (`madd`'s operand).
    #[inline(always)]
    unsafe fn pairs16(&self) -> (__m256i, __m256i) {
        let low = _mm256_set1_epi32(0xFFFF);
        let p0 = _mm256_or_si256(_mm256_and_si256(self.sc0, low), _mm256_slli_epi32::<16>(self.sc0));
        (p0, _mm256_or_si256(_mm256_and_si256(self.sc1, low), _mm256_slli_epi32::<16>(self.sc1)))
    }

    /// `add_block` from the halves' sums already scaled and added (`t = sc_0 s_0 + sc_1 s_1`,
    /// exact): the same integer total, the same float steps.
    #[inline(always)]
    unsafe fn add_scaled_block<D: Dot>(&self, acc: __m256, d: __m256, t: __m256i, a: &BlockQ8) -> __m256 {
        let hs = _mm256_set1_epi32((a.h.as_ptr() as *const i32).read_unaligned());
        let tot = D::madd_add(t, self.neg32, hs);
        _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.d)), _mm256_cvtepi32_ps(tot), acc)
    }

    /// `acc` plus the block: `fma(d * d_a, tot, acc)` with the exact integer total
    /// `tot = sc_0 (s_0 - 32 A_0) + sc_1 (s_1 - 32 A_1)` from the halves' quant sums `s0`,
    /// `s1` and the activations' half sums `A` (`BlockQ8::h`, one 32-bit broadcast for both),
    /// computed as `sc_0 s_0 + sc_1 s_1 + (-32 sc_0) A_0 + (-32 sc_1) A_1`.
    #[inline(always)]
    unsafe fn add_block<D: Dot>(&self, acc: __m256, d: __m256, s0: __m256i, s1: __m256i, a: &BlockQ8) -> __m256 {
        let t = _mm256_add_epi32(_mm256_mullo_epi32(self.sc0, s0), _mm256_mullo_epi32(self.sc1, s1));
        self.add_scaled_block::<D>(acc, d, t, a)
    }
}

/// Activation bytes of a pass past which its weights are prefetched ahead at any number of
/// rows (a 32 KiB L1 data cache).
pub(crate) const L1_ACT_BYTES: usize = 32 * 1024;
/// How far ahead the k-quant kernels prefetch their weights into L2 (see `group_impl`):
/// 4 KiB was slower than 8, 16 KiB no faster.
pub(crate) const L2_AHEAD: usize = 8 * 1024;
/// Rows (input columns) this long are prefetched into L2 at any activation row count.
pub(crate) const LONG_ROW: usize = 4096;
const Q5_0: u8 = 0;
const Q5_1: u8 = 1;
const Q4K: u8 = 2;
const Q5K: u8 = 3;
const Q6K: u8 = 4;
/// Q4_K / Q5_K against activations with one scale per super-block (`q8::SUPER_SPAN`).
const Q4K_S: u8 = 5;
const Q5K_S: u8 = 6;

const fn format_of(f: u8) -> WeightFormat {
    match f {
        Q5_0 => WeightFormat::Q5_0,
        Q5_1 => WeightFormat::Q5_1,
        Q4K | Q4K_S => WeightFormat::Q4K,
        Q5K | Q5K_S => WeightFormat::Q5K,
        _ => WeightFormat::Q6K,
    }
}

/// The kernel of one format (a const parameter: no format test inside the loop).
#[inline(always)]
unsafe fn group_impl<D: Dot, const F: u8, const N: usize>(group: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
    let gbb = group_block_bytes(format_of(F));
    assert!(group.len() >= blocks * gbb);
    // Software prefetch of the weights, two ways (all measured with matmul_bench,
    // BENCH_ROTATE=1, weights streamed from memory, 2 threads, interleaved):
    // - Into L2, `L2_AHEAD` bytes ahead, on Zen 4 for the k-quants: always for Q6_K, from five
    //   activation rows on for Q4_K/Q5_K, and at any row count for long rows (`LONG_ROW`,
    //   a 1.5B model's ffn_down). Without it the time of a pass streamed from memory was its
    //   memory time *plus* its compute time (Q4_K ffn_down at 5 rows, 1 thread: 883 us = 414
    //   at 1 row + 488 in cache); with it the two overlap: 3 rows 1.5-1.7x faster, 5 rows 1.4-1.6x,
    //   8 rows 1.1-1.3x; Q6_K at 1 row 1.3-1.8x (the lm_head 5.4-9.0 ms -> 3.5-6.0). Q4_K with
    //   short rows was 10-28% slower with it at one or two rows (the hardware prefetcher
    //   already keeps up) and no faster at three or four: those rows take no prefetch. Q5_0
    //   was slower at 1-5 rows: Q5_0/Q5_1 keep the rules below. One group block ahead into
    //   L1 (the `_MM_HINT_T0` below) did not give the overlap.
    // - Otherwise one group block (at least 1 KB) ahead into L1 where that pays, else none:
    //   - `CpuFeatures::sw_prefetch` CPUs (not Zen 4): always, at every format.
    //   - Zen 4, Q5_0/Q5_1: from six activation rows on (fewer: the stream slowed), and
    //     where a pass's activations outgrow L1 (`L1_ACT_BYTES`).
    let features = crate::cpu::features();
    let row_len = blocks * format_of(F).block_len();
    let l2_ahead = !features.sw_prefetch && matches!(F, Q4K | Q5K | Q4K_S | Q5K_S | Q6K) && (F == Q6K || N >= 5 || row_len >= LONG_ROW);
    let act_bytes = N * (row_len / QK) * std::mem::size_of::<BlockQ8>();
    let far = !l2_ahead && (features.sw_prefetch || N >= 6 || act_bytes > L1_ACT_BYTES);
    let ahead = features.prefetch_ahead.unwrap_or(gbb.max(1024));
    let gp = group.as_ptr();
    let m4 = _mm256_set1_epi8(0x0F);
    let b16 = _mm256_set1_epi8(0x10);
    let sign = _mm256_set1_ps(-0.0);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..blocks {
        // SAFETY (whole loop): b < blocks, the group holds `blocks` group blocks of gbb bytes and
        // every activation row the matching blocks of 32 (checked by the caller). A prefetch
        // past the end of the matrix is a hint and never faults.
        let blk = gp.add(b * gbb);
        let mut line = 0;
        while l2_ahead && line < gbb {
            _mm_prefetch::<_MM_HINT_T1>(blk.wrapping_add(L2_AHEAD + line) as *const i8);
            line += 64;
        }
        while far && line < gbb {
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(ahead + line) as *const i8);
            line += 64;
        }
        let d = f16x8(blk);
        match F {
            Q5_0 | Q5_1 => {
                let qh_off = if F == Q5_1 { off::Q5_1_QH } else { off::Q5_0_QH };
                let mut h = _mm256_loadu_si256(blk.add(qh_off) as *const __m256i);
                let q = blk.add(qh_off + 32);
                let mut isum = [_mm256_setzero_si256(); N];
                for v in 0..4 {
                    let raw = vec(q, v);
                    let lo = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(h), b16));
                    let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4), _mm256_and_si256(h, b16));
                    h = _mm256_srli_epi16::<1>(h);
                    for n in 0..N {
                        let ap = acts[n].get_unchecked(b).qs.as_ptr();
                        isum[n] = D::dot2(isum[n], lo, bcast4(ap.add(4 * v)), hi, bcast4(ap.add(16 + 4 * v)));
                    }
                }
                let m = if F == Q5_1 { f16x8(blk.add(16)) } else { _mm256_mul_ps(d, _mm256_set1_ps(-16.0)) };
                for n in 0..N {
                    let ab = acts[n].get_unchecked(b);
                    acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(ab.d)), _mm256_cvtepi32_ps(isum[n]), acc[n]);
                    acc[n] = _mm256_fmadd_ps(m, _mm256_set1_ps(ab.s), acc[n]);
                }
            }
            Q4K | Q5K => {
                let dmin = f16x8(blk.add(off::K_DMIN));
                let qs = blk.add(if F == Q4K { off::Q4K_QS } else { off::Q5K_QS });
                let qh = blk.add(off::Q5K_QH);
                for c in 0..4 {
                    let (mut s_lo, mut s_hi) = k_pair_sums::<D, F, N>(qs, qh, c, b, &acts);
                    if F == Q4K {
                        for n in 0..N {
                            s_lo[n] = D::finish4(s_lo[n]);
                            s_hi[n] = D::finish4(s_hi[n]);
                        }
                    }
                    for (k, sums) in [(0, &s_lo), (1, &s_hi)] {
                        let j = 2 * c + k;
                        let dsc = _mm256_mul_ps(d, u8x8(blk.add(off::K_SC + 8 * j)));
                        let neg_mn = _mm256_xor_ps(_mm256_mul_ps(dmin, u8x8(blk.add(off::K_MN + 8 * j))), sign);
                        for n in 0..N {
                            let ab = acts[n].get_unchecked(8 * b + j);
                            acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(dsc, _mm256_set1_ps(ab.d)), _mm256_cvtepi32_ps(sums[n]), acc[n]);
                            acc[n] = _mm256_fmadd_ps(neg_mn, _mm256_set1_ps(ab.s), acc[n]);
                        }
                    }
                }
            }
            Q4K_S | Q5K_S => {
                // T = sum_j sc_j s_j per activation row, exact in i32 (see the module header)
                let qs = blk.add(if F == Q4K_S { off::Q4K_QS } else { off::Q5K_QS });
                let qh = blk.add(off::Q5K_QH);
                let mut t = [_mm256_setzero_si256(); N];
                for c in 0..4 {
                    let (s_lo, s_hi) = k_pair_sums::<D, F, N>(qs, qh, c, b, &acts);
                    let sc = [sc_lanes(blk.add(off::K_SC + 16 * c)), sc_lanes(blk.add(off::K_SC + 16 * c + 8))];
                    for n in 0..N {
                        let (lo, hi) = if F == Q4K_S {
                            (D::scaled_q4(s_lo[n], sc[0].0, sc[0].1), D::scaled_q4(s_hi[n], sc[1].0, sc[1].1))
                        } else {
                            (_mm256_mullo_epi32(s_lo[n], sc[0].0), _mm256_mullo_epi32(s_hi[n], sc[1].0))
                        };
                        t[n] = _mm256_add_epi32(t[n], _mm256_add_epi32(lo, hi));
                    }
                }
                // M = sum_j m_j B_j: each lane's (m_j, m_j) against the block's half sums
                let mn: [__m256i; 8] = std::array::from_fn(|j| sc_lanes(blk.add(off::K_MN + 8 * j)).1);
                let dmin = f16x8(blk.add(off::K_DMIN));
                for n in 0..N {
                    let mut m = _mm256_setzero_si256();
                    for (j, mn) in mn.iter().enumerate() {
                        let h = acts[n].get_unchecked(8 * b + j).h.as_ptr() as *const i32;
                        m = D::madd_add(m, *mn, _mm256_set1_epi32(h.read_unaligned()));
                    }
                    let d_a = _mm256_set1_ps(acts[n].get_unchecked(8 * b).d);
                    acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(d, d_a), _mm256_cvtepi32_ps(t[n]), acc[n]);
                    acc[n] = _mm256_fmadd_ps(_mm256_xor_ps(_mm256_mul_ps(dmin, d_a), sign), _mm256_cvtepi32_ps(m), acc[n]);
                }
            }
            _ if N <= D::Q6K_SHARED_UNPACK => {
                // few activation rows: each ql / qh vector is loaded and unpacked once for
                // the four activation blocks it serves (the same integer sums, the same
                // float steps in the same order as below)
                for h in 0..2 {
                    let a: [[*const i8; N]; 4] = std::array::from_fn(|i| std::array::from_fn(|n| acts[n].get_unchecked(8 * b + 4 * h + i).qs.as_ptr()));
                    let mut s0 = [[_mm256_setzero_si256(); N]; 4];
                    q6k_shared_pair::<D, N>(blk, h, 0, &a, &mut s0);
                    q6k_shared_pair::<D, N>(blk, h, 2, &a, &mut s0);
                    let mut s1 = [[_mm256_setzero_si256(); N]; 4];
                    q6k_shared_pair::<D, N>(blk, h, 4, &a, &mut s1);
                    q6k_shared_pair::<D, N>(blk, h, 6, &a, &mut s1);
                    for i in 0..4 {
                        let scales = Q6kScales::load(blk.add(off::Q6K_SC), 8 * h + 2 * i);
                        for n in 0..N {
                            acc[n] = scales.add_block::<D>(acc[n], d, s0[i][n], s1[i][n], acts[n].get_unchecked(8 * b + 4 * h + i));
                        }
                    }
                }
            }
            _ => {
                for h in 0..2 {
                    q6k_act_block::<D, N, 0>(blk, b, h, d, &acts, &mut acc);
                    q6k_act_block::<D, N, 1>(blk, b, h, d, &acts, &mut acc);
                    q6k_act_block::<D, N, 2>(blk, b, h, d, &acts, &mut acc);
                    q6k_act_block::<D, N, 3>(blk, b, h, d, &acts, &mut acc);
                }
            }
        }
    }
    for n in 0..N {
        // SAFETY: the caller gives N pointers to eight writable floats each.
        _mm256_storeu_ps(dst[n], acc[n]);
    }
}

/// The integer sums of Q4_K / Q5_K sub-blocks `2c` (low nibbles) and `2c + 1` (high) of
/// super-block `b` against each activation row (Q4_K: `dot2_q4`'s partial form), shared by the
/// kernels for block and for super-block activation scales.
#[inline(always)]
unsafe fn k_pair_sums<D: Dot, const F: u8, const N: usize>(
    qs: *const u8,
    qh: *const u8,
    c: usize,
    b: usize,
    acts: &[&[BlockQ8]; N],
) -> ([__m256i; N], [__m256i; N]) {
    let q5 = matches!(F, Q5K | Q5K_S);
    let m4 = _mm256_set1_epi8(0x0F);
    let b16 = _mm256_set1_epi8(0x10);
    let (mut s_lo, mut s_hi) = ([_mm256_setzero_si256(); N], [_mm256_setzero_si256(); N]);
    let shift = _mm_cvtsi32_si128(2 * c as i32);
    for v in (0..8).step_by(2) {
        let (r0, r1) = (vec(qs, 8 * c + v), vec(qs, 8 * c + v + 1));
        let (mut lo0, mut hi0) = (_mm256_and_si256(r0, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(r0), m4));
        let (mut lo1, mut hi1) = (_mm256_and_si256(r1, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(r1), m4));
        if q5 {
            // bits 2c and 2c + 1 of each qh byte, moved to bit 4
            let h0 = _mm256_srl_epi16(vec(qh, v), shift);
            let h1 = _mm256_srl_epi16(vec(qh, v + 1), shift);
            lo0 = _mm256_or_si256(lo0, _mm256_and_si256(_mm256_slli_epi16::<4>(h0), b16));
            hi0 = _mm256_or_si256(hi0, _mm256_and_si256(_mm256_slli_epi16::<3>(h0), b16));
            lo1 = _mm256_or_si256(lo1, _mm256_and_si256(_mm256_slli_epi16::<4>(h1), b16));
            hi1 = _mm256_or_si256(hi1, _mm256_and_si256(_mm256_slli_epi16::<3>(h1), b16));
        }
        for n in 0..N {
            let a_lo = acts[n].get_unchecked(8 * b + 2 * c).qs.as_ptr();
            let a_hi = acts[n].get_unchecked(8 * b + 2 * c + 1).qs.as_ptr();
            if !q5 {
                s_lo[n] = D::dot2_q4(s_lo[n], lo0, bcast4(a_lo.add(4 * v)), lo1, bcast4(a_lo.add(4 * v + 4)));
                s_hi[n] = D::dot2_q4(s_hi[n], hi0, bcast4(a_hi.add(4 * v)), hi1, bcast4(a_hi.add(4 * v + 4)));
            } else {
                s_lo[n] = D::dot2(s_lo[n], lo0, bcast4(a_lo.add(4 * v)), lo1, bcast4(a_lo.add(4 * v + 4)));
                s_hi[n] = D::dot2(s_hi[n], hi0, bcast4(a_hi.add(4 * v)), hi1, bcast4(a_hi.add(4 * v + 4)));
            }
        }
    }
    (s_lo, s_hi)
}

/// Q6_K weight vector `u` of half `h` unpacked for activation block `4h + I`: its 6-bit quants
/// (the low or high nibble of `ql`, bits `2I, 2I + 1` of `qh` moved to bits 4, 5).
#[inline(always)]
unsafe fn q6k_unpack<const I: usize>(blk: *const u8, h: usize, u: usize) -> __m256i {
    q6k_unpack_from::<__m256i, I>(vec(blk.add(off::Q6K_QL), 16 * h + 8 * (I & 1) + u), vec(blk.add(off::Q6K_QH), 8 * h + u))
}

/// The byte operations of the Q6_K unpack, at 256 bits (one group) and 512 (two), so that
/// both unpack with one body.
trait QuantBytes: Copy {
    unsafe fn splat(x: i8) -> Self;
    unsafe fn and(a: Self, b: Self) -> Self;
    unsafe fn or(a: Self, b: Self) -> Self;
    /// Shifts of the 16-bit lanes.
    unsafe fn shl2(a: Self) -> Self;
    unsafe fn shl4(a: Self) -> Self;
    unsafe fn shr2(a: Self) -> Self;
    unsafe fn shr4(a: Self) -> Self;
}

impl QuantBytes for __m256i {
    #[inline(always)]
    unsafe fn splat(x: i8) -> Self {
        _mm256_set1_epi8(x)
    }
    #[inline(always)]
    unsafe fn and(a: Self, b: Self) -> Self {
        _mm256_and_si256(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: Self, b: Self) -> Self {
        _mm256_or_si256(a, b)
    }
    #[inline(always)]
    unsafe fn shl2(a: Self) -> Self {
        _mm256_slli_epi16::<2>(a)
    }
    #[inline(always)]
    unsafe fn shl4(a: Self) -> Self {
        _mm256_slli_epi16::<4>(a)
    }
    #[inline(always)]
    unsafe fn shr2(a: Self) -> Self {
        _mm256_srli_epi16::<2>(a)
    }
    #[inline(always)]
    unsafe fn shr4(a: Self) -> Self {
        _mm256_srli_epi16::<4>(a)
    }
}

impl QuantBytes for __m512i {
    #[inline(always)]
    unsafe fn splat(x: i8) -> Self {
        _mm512_set1_epi8(x)
    }
    #[inline(always)]
    unsafe fn and(a: Self, b: Self) -> Self {
        _mm512_and_si512(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: Self, b: Self) -> Self {
        _mm512_or_si512(a, b)
    }
    #[inline(always)]
    unsafe fn shl2(a: Self) -> Self {
        _mm512_slli_epi16::<2>(a)
    }
    #[inline(always)]
    unsafe fn shl4(a: Self) -> Self {
        _mm512_slli_epi16::<4>(a)
    }
    #[inline(always)]
    unsafe fn shr2(a: Self) -> Self {
        _mm512_srli_epi16::<2>(a)
    }
    #[inline(always)]
    unsafe fn shr4(a: Self) -> Self {
        _mm512_srli_epi16::<4>(a)
    }
}

/// Q6_K's 6-bit quants for activation block `4h + I` from a loaded `ql` vector (its low or
/// high nibbles) and `qh` vector (bits `2I, 2I + 1` moved to bits 4, 5).
#[inline(always)]
unsafe fn q6k_unpack_from<V: QuantBytes, const I: usize>(ql: V, qh: V) -> V {
    let m4 = V::splat(0x0F);
    let l = if I < 2 { V::and(ql, m4) } else { V::and(V::shr4(ql), m4) };
    let hb = match I {
        0 => V::shl4(qh),
        1 => V::shl2(qh),
        2 => qh,
        _ => V::shr2(qh),
    };
    V::or(l, V::and(hb, V::splat(0x30)))
}

/// Q6_K with few activation rows: weight vectors `v, v + 1` of half `h`, each unpacked once for
/// the four activation blocks `4h + i` it serves, added to `s[i][n]` (`a[i][n]`: block
/// `4h + i`'s quants of activation row `n`).
#[inline(always)]
unsafe fn q6k_shared_pair<D: Dot, const N: usize>(blk: *const u8, h: usize, v: usize, a: &[[*const i8; N]; 4], s: &mut [[__m256i; N]; 4]) {
    let w0 = [q6k_unpack::<0>(blk, h, v), q6k_unpack::<1>(blk, h, v), q6k_unpack::<2>(blk, h, v), q6k_unpack::<3>(blk, h, v)];
    let w1 = [q6k_unpack::<0>(blk, h, v + 1), q6k_unpack::<1>(blk, h, v + 1), q6k_unpack::<2>(blk, h, v + 1), q6k_unpack::<3>(blk, h, v + 1)];
    for i in 0..4 {
        for n in 0..N {
            s[i][n] = D::dot2(s[i][n], w0[i], bcast4(a[i][n].add(4 * v)), w1[i], bcast4(a[i][n].add(4 * v + 4)));
        }
    }
}

/// Q6_K's quant sums of one half (16 elements: weight vectors `v0..v0 + 4`) of activation
/// block `4h + I` against each activation row's `a[n]` (that block's quants).
#[inline(always)]
unsafe fn q6k_half<D: Dot, const N: usize, const I: usize>(blk: *const u8, h: usize, v0: usize, a: &[*const i8; N]) -> [__m256i; N] {
    let w = q6k_quad::<I>(blk, h, v0);
    let mut s = [_mm256_setzero_si256(); N];
    for n in 0..N {
        let p = a[n].add(4 * v0);
        s[n] = D::dot2(s[n], w[0], bcast4(p), w[1], bcast4(p.add(4)));
        s[n] = D::dot2(s[n], w[2], bcast4(p.add(8)), w[3], bcast4(p.add(12)));
    }
    s
}

/// The four weight vectors `v0..v0 + 4` of half `h` of a Q6_K group block, unpacked.
#[inline(always)]
unsafe fn q6k_quad<const I: usize>(blk: *const u8, h: usize, v0: usize) -> [__m256i; 4] {
    [q6k_unpack::<I>(blk, h, v0), q6k_unpack::<I>(blk, h, v0 + 1), q6k_unpack::<I>(blk, h, v0 + 2), q6k_unpack::<I>(blk, h, v0 + 3)]
}

/// As `q6k_half` on AVX2, added to `t`, with each lane's half scale `sc16` (in both i16 halves)
/// as the widening `madd`'s operand: the sums come out times the scale, exact (two `maddubs`
/// pairs <= 32004 in i16, times |sc| <= 128: a lane sums eight such products over both halves,
/// under 2^25).
#[inline(always)]
unsafe fn q6k_half_scaled<const N: usize, const I: usize>(t: &mut [__m256i; N], blk: *const u8, h: usize, v0: usize, a: &[*const i8; N], sc16: __m256i) {
    let w = q6k_quad::<I>(blk, h, v0);
    for n in 0..N {
        let p = a[n].add(4 * v0);
        t[n] = _mm256_add_epi32(t[n], q6k_pair_scaled(w[0], p, w[1], p.add(4), sc16));
        t[n] = _mm256_add_epi32(t[n], q6k_pair_scaled(w[2], p.add(8), w[3], p.add(12), sc16));
    }
}

/// Two weight vectors' `maddubs` against their activation bytes, added in i16 and widened by
/// `madd` with the scale pairs `sc16`.
#[inline(always)]
unsafe fn q6k_pair_scaled(w0: __m256i, a0: *const i8, w1: __m256i, a1: *const i8, sc16: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(a0)), _mm256_maddubs_epi16(w1, bcast4(a1))), sc16)
}

/// Q6_K with many activation rows: activation block `4h + I` of super-block `b` (each weight
/// vector unpacked once for all N rows) added to `acc`. `I` is a constant so that the nibble
/// and bit selection are fixed shifts and every accumulator stays in a register (a loop over
/// `I` was compiled with the sums on the stack).
#[inline(always)]
unsafe fn q6k_act_block<D: Dot, const N: usize, const I: usize>(blk: *const u8, b: usize, h: usize, d: __m256, acts: &[&[BlockQ8]; N], acc: &mut [__m256; N]) {
    let k = 8 * b + 4 * h + I;
    let a: [*const i8; N] = std::array::from_fn(|n| acts[n].get_unchecked(k).qs.as_ptr());
    // each activation block loads its weight vectors afresh (from L1): without the barrier
    // the compiler keeps the vectors two or four blocks share live across them, spills them
    // and streams the weights from memory at half the speed (lm_head, 3 rows)
    let blk = std::hint::black_box(blk);
    let scales = Q6kScales::load(blk.add(off::Q6K_SC), 8 * h + 2 * I);
    if D::Q6K_SCALE_IN_MADD {
        let (sc16_0, sc16_1) = scales.pairs16();
        let mut t = [_mm256_setzero_si256(); N];
        q6k_half_scaled::<N, I>(&mut t, blk, h, 0, &a, sc16_0);
        q6k_half_scaled::<N, I>(&mut t, blk, h, 4, &a, sc16_1);
        for n in 0..N {
            acc[n] = scales.add_scaled_block::<D>(acc[n], d, t[n], acts[n].get_unchecked(k));
        }
        return;
    }
    let s0 = q6k_half::<D, N, I>(blk, h, 0, &a);
    let s1 = q6k_half::<D, N, I>(blk, h, 4, &a);
    for n in 0..N {
        acc[n] = scales.add_block::<D>(acc[n], d, s0[n], s1[n], acts[n].get_unchecked(k));
    }
}

/// Two groups at once (`PackedInt8::dot_group_pair_span_to`) for Q4_K against super-scaled
/// activation rows and Q6_K against block-scaled ones: one 512-bit vector holds a weight
/// vector of both groups (group `g`'s in the low half), so each unpack, broadcast and
/// `vpdpbusd` serves sixteen rows where the one-group kernel serves eight. Each lane's integer
/// sums and float steps are those of `group_impl::<Vnni, _, _>` for the format, in the same
/// order: the same bits. Ours (no crate has it).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C present; `format` is Q4_K (`span` Super) or Q6_K
/// (`span` Block); `g0` and `g1` hold `blocks` group blocks of it, every activation row
/// `8 * blocks` blocks of 32 of that span; every `dst[j][n]` is valid for eight writes no other
/// thread makes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn pair_k<const N: usize>(format: WeightFormat, g0: &[u8], g1: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
    // four activation rows a pass at most: each keeps three or four 512-bit accumulators
    // live and there are 32 registers; more rows take another pass over the same weights,
    // now in L1
    let mut n0 = 0;
    while n0 < N {
        let m = (N - n0).min(4);
        let a = |i: usize| acts[n0 + (i % m)];
        let d = |j: usize, i: usize| dst[j][n0 + (i % m)];
        macro_rules! pass {
            ($m:literal) => {{
                let (a, d): ([&[BlockQ8]; $m], [[*mut f32; $m]; 2]) = (std::array::from_fn(a), std::array::from_fn(|j| std::array::from_fn(|i| d(j, i))));
                if format == WeightFormat::Q4K {
                    pair_q4k_super_impl::<$m>(g0, g1, blocks, a, d)
                } else {
                    pair_q6k_impl::<$m>(g0, g1, blocks, a, d)
                }
            }};
        }
        match m {
            1 => pass!(1),
            2 => pass!(2),
            3 => pass!(3),
            _ => pass!(4),
        }
        n0 += m;
    }
}

/// The distance of the pair kernels' L1 prefetch ahead of each stream, where software
/// prefetch pays (`CpuFeatures::sw_prefetch`, `prefetch_ahead`), as the one-group kernel
/// does: on Zen 5 one block ahead left the pair slower than the one-group kernel at one to
/// four rows, 12 blocks (14 KiB) made it 1.2x faster at eight. None elsewhere.
#[inline(always)]
pub(crate) fn pair_prefetch(gbb: usize) -> Option<usize> {
    let f = crate::cpu::features();
    f.sw_prefetch.then_some(f.prefetch_ahead.unwrap_or(gbb))
}

/// Both groups' block `b` prefetched `dist` bytes ahead.
#[inline(always)]
pub(crate) unsafe fn prefetch_pair(blk0: *const u8, blk1: *const u8, gbb: usize, dist: Option<usize>) {
    let Some(dist) = dist else { return };
    let mut line = 0;
    while line < gbb {
        _mm_prefetch::<_MM_HINT_T0>(blk0.wrapping_add(dist + line) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(blk1.wrapping_add(dist + line) as *const i8);
        line += 64;
    }
}

/// Q6_K weight vector `u` of half `h` of both groups, unpacked for activation block `4h + I`
/// (as `q6k_unpack`).
#[inline(always)]
unsafe fn q6k_unpack512<const I: usize>(blk0: *const u8, blk1: *const u8, h: usize, u: usize) -> __m512i {
    let (l, hb) = (off::Q6K_QL + 32 * (16 * h + 8 * (I & 1) + u), off::Q6K_QH + 32 * (8 * h + u));
    q6k_unpack_from::<__m512i, I>(join512(blk0.add(l), blk1.add(l)), join512(blk0.add(hb), blk1.add(hb)))
}

/// Q6_K's quant sums of one half (weight vectors `v0..v0 + 4`) of activation block `4h + I`
/// for both groups, as `q6k_half`.
#[inline(always)]
unsafe fn q6k_half512<const N: usize, const I: usize>(blk0: *const u8, blk1: *const u8, h: usize, v0: usize, a: &[*const i8; N]) -> [__m512i; N] {
    let w = [
        q6k_unpack512::<I>(blk0, blk1, h, v0),
        q6k_unpack512::<I>(blk0, blk1, h, v0 + 1),
        q6k_unpack512::<I>(blk0, blk1, h, v0 + 2),
        q6k_unpack512::<I>(blk0, blk1, h, v0 + 3),
    ];
    let mut s = [_mm512_setzero_si512(); N];
    for n in 0..N {
        let p = a[n].add(4 * v0);
        s[n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[n], w[0], bcast4_512(p)), w[1], bcast4_512(p.add(4)));
        s[n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[n], w[2], bcast4_512(p.add(8))), w[3], bcast4_512(p.add(12)));
    }
    s
}

/// Q6_K's signed scales of sub-block `s` of both groups as sixteen i32 lanes.
#[inline(always)]
unsafe fn q6k_scales512(blk0: *const u8, blk1: *const u8, s: usize) -> __m512i {
    let at = off::Q6K_SC + 8 * s;
    _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(blk0.add(at) as *const __m128i), _mm_loadl_epi64(blk1.add(at) as *const __m128i)))
}

/// Q6_K for two groups: activation block `4h + I` of super-block `b` added to `acc`, as
/// `q6k_act_block` (the sums of both halves of 16, then `Q6kScales::add_block`'s steps).
#[inline(always)]
unsafe fn q6k_act_block512<const N: usize, const I: usize>(
    blk0: *const u8,
    blk1: *const u8,
    b: usize,
    h: usize,
    d: __m512,
    acts: &[&[BlockQ8]; N],
    acc: &mut [__m512; N],
) {
    let k = 8 * b + 4 * h + I;
    let mut a = [std::ptr::null::<i8>(); N];
    for n in 0..N {
        a[n] = acts[n].get_unchecked(k).qs.as_ptr();
    }
    // (no closures here: they would not inherit the target features, and each intrinsic
    // would be a call)
    let s0 = q6k_half512::<N, I>(blk0, blk1, h, 0, &a);
    let s1 = q6k_half512::<N, I>(blk0, blk1, h, 4, &a);
    // the scales of sub-blocks 8h + 2I and + 1, as `Q6kScales::load`
    let (sc0, sc1) = (q6k_scales512(blk0, blk1, 8 * h + 2 * I), q6k_scales512(blk0, blk1, 8 * h + 2 * I + 1));
    let pair = _mm512_or_si512(_mm512_and_si512(sc0, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32::<16>(sc1));
    let neg32 = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16::<5>(pair));
    for n in 0..N {
        let ab = acts[n].get_unchecked(k);
        let hs = _mm512_set1_epi32((ab.h.as_ptr() as *const i32).read_unaligned());
        let t = _mm512_add_epi32(_mm512_mullo_epi32(sc0, s0[n]), _mm512_mullo_epi32(sc1, s1[n]));
        let tot = _mm512_dpwssd_epi32(t, neg32, hs);
        acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(ab.d)), _mm512_cvtepi32_ps(tot), acc[n]);
    }
}

#[inline(always)]
unsafe fn pair_q6k_impl<const N: usize>(g0: &[u8], g1: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
    let gbb = group_block_bytes(WeightFormat::Q6K);
    assert!(g0.len() >= blocks * gbb && g1.len() >= blocks * gbb);
    let dist = pair_prefetch(gbb);
    let (p0, p1) = (g0.as_ptr(), g1.as_ptr());
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..blocks {
        // SAFETY (whole loop): b < blocks, both groups hold `blocks` group blocks and every
        // activation row the matching blocks of 32 (the caller's promise).
        let (blk0, blk1) = (p0.add(b * gbb), p1.add(b * gbb));
        prefetch_pair(blk0, blk1, gbb, dist);
        let d = halves512(blk0, blk1);
        for h in 0..2 {
            // each block loads its weight vectors afresh, as `q6k_act_block` explains
            let (blk0, blk1) = (std::hint::black_box(blk0), std::hint::black_box(blk1));
            q6k_act_block512::<N, 0>(blk0, blk1, b, h, d, &acts, &mut acc);
            q6k_act_block512::<N, 1>(blk0, blk1, b, h, d, &acts, &mut acc);
            q6k_act_block512::<N, 2>(blk0, blk1, b, h, d, &acts, &mut acc);
            q6k_act_block512::<N, 3>(blk0, blk1, b, h, d, &acts, &mut acc);
        }
    }
    // SAFETY: the caller gives 2 x N pointers to eight writable floats each.
    store_pairs(&acc, dst);
}

#[inline(always)]
unsafe fn pair_q4k_super_impl<const N: usize>(g0: &[u8], g1: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
    let gbb = group_block_bytes(WeightFormat::Q4K);
    assert!(g0.len() >= blocks * gbb && g1.len() >= blocks * gbb);
    let dist = pair_prefetch(gbb);
    let (p0, p1) = (g0.as_ptr(), g1.as_ptr());
    let m4 = _mm512_set1_epi8(0x0F);
    // the sign bit, flipped with an integer xor (the float one is AVX-512 DQ)
    let sign = _mm512_set1_epi32(i32::MIN);
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..blocks {
        // SAFETY (whole loop): b < blocks, both groups hold `blocks` group blocks and every
        // activation row the matching blocks of 32 (the caller's promise); a prefetch past
        // the end is a hint and never faults.
        let (blk0, blk1) = (p0.add(b * gbb), p1.add(b * gbb));
        prefetch_pair(blk0, blk1, gbb, dist);
        let (qs0, qs1) = (blk0.add(off::Q4K_QS), blk1.add(off::Q4K_QS));
        let mut t = [_mm512_setzero_si512(); N];
        for c in 0..4 {
            let (mut s_lo, mut s_hi) = ([_mm512_setzero_si512(); N], [_mm512_setzero_si512(); N]);
            for v in (0..8).step_by(2) {
                let r0 = join512(qs0.add(32 * (8 * c + v)), qs1.add(32 * (8 * c + v)));
                let r1 = join512(qs0.add(32 * (8 * c + v + 1)), qs1.add(32 * (8 * c + v + 1)));
                let (lo0, hi0) = (_mm512_and_si512(r0, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(r0), m4));
                let (lo1, hi1) = (_mm512_and_si512(r1, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(r1), m4));
                for n in 0..N {
                    let a_lo = acts[n].get_unchecked(8 * b + 2 * c).qs.as_ptr();
                    let a_hi = acts[n].get_unchecked(8 * b + 2 * c + 1).qs.as_ptr();
                    s_lo[n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s_lo[n], lo0, bcast4_512(a_lo.add(4 * v))), lo1, bcast4_512(a_lo.add(4 * v + 4)));
                    s_hi[n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s_hi[n], hi0, bcast4_512(a_hi.add(4 * v))), hi1, bcast4_512(a_hi.add(4 * v + 4)));
                }
            }
            let sc_lo = bytes512(blk0.add(off::K_SC + 16 * c), blk1.add(off::K_SC + 16 * c));
            let sc_hi = bytes512(blk0.add(off::K_SC + 16 * c + 8), blk1.add(off::K_SC + 16 * c + 8));
            for n in 0..N {
                t[n] = _mm512_add_epi32(t[n], _mm512_add_epi32(_mm512_mullo_epi32(s_lo[n], sc_lo), _mm512_mullo_epi32(s_hi[n], sc_hi)));
            }
        }
        // M = sum_j m_j B_j: each lane's (m_j, m_j) against the block's half sums
        let mn: [__m512i; 8] = std::array::from_fn(|j| {
            let x = bytes512(blk0.add(off::K_MN + 8 * j), blk1.add(off::K_MN + 8 * j));
            _mm512_or_si512(x, _mm512_slli_epi32::<16>(x))
        });
        let d = halves512(blk0, blk1);
        let dmin = halves512(blk0.add(off::K_DMIN), blk1.add(off::K_DMIN));
        for n in 0..N {
            let mut m = _mm512_setzero_si512();
            for (j, mn) in mn.iter().enumerate() {
                let h = acts[n].get_unchecked(8 * b + j).h.as_ptr() as *const i32;
                m = _mm512_dpwssd_epi32(m, *mn, _mm512_set1_epi32(h.read_unaligned()));
            }
            let d_a = _mm512_set1_ps(acts[n].get_unchecked(8 * b).d);
            acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(d, d_a), _mm512_cvtepi32_ps(t[n]), acc[n]);
            let neg_min = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, d_a)), sign));
            acc[n] = _mm512_fmadd_ps(neg_min, _mm512_cvtepi32_ps(m), acc[n]);
        }
    }
    // SAFETY: the caller gives 2 x N pointers to eight writable floats each.
    store_pairs(&acc, dst);
}

/// The two groups' results of each activation row: group 0's (the low half) to `dst[0][n]`,
/// group 1's to `dst[1][n]`. Shared with `packed`'s two-group kernels.
///
/// # Safety
/// AVX-512 F present; every `dst[j][n]` is valid for eight writes.
#[inline(always)]
pub(crate) unsafe fn store_pairs<const N: usize>(acc: &[__m512; N], dst: [[*mut f32; N]; 2]) {
    for n in 0..N {
        _mm256_storeu_ps(dst[0][n], _mm512_castps512_ps256(acc[n]));
        _mm256_storeu_ps(dst[1][n], _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[n]))));
    }
}

/// `-offset (h_0 + h_1)` of an activation block in every 32-bit lane: where a kernel's exact sum
/// starts when it multiplies weights offset to unsigned bytes (`w + offset` against `a`: 128 for
/// the VNNI kernels, 12 for MXFP4 on AVX2), so the offset's share is gone without a subtraction
/// at the end. One `vpmaddwd` of the block's two i16 half sums (`BlockQ8::h`) broadcast as a
/// pair, instead of their sum made in scalar registers and broadcast.
#[inline(always)]
pub(crate) unsafe fn minus_offset_share(ab: &BlockQ8, offset: i16) -> __m256i {
    _mm256_madd_epi16(_mm256_set1_epi32((ab.h.as_ptr() as *const i32).read_unaligned()), _mm256_set1_epi16(-offset))
}

/// `minus_offset_share` in sixteen lanes.
#[inline(always)]
pub(crate) unsafe fn minus_offset_share512(ab: &BlockQ8) -> __m512i {
    _mm512_madd_epi16(_mm512_set1_epi32((ab.h.as_ptr() as *const i32).read_unaligned()), _mm512_set1_epi16(-128))
}

/// Four activation bytes broadcast to every 32-bit lane of a 512-bit vector.
#[inline(always)]
pub(crate) unsafe fn bcast4_512(p: *const i8) -> __m512i {
    _mm512_set1_epi32((p as *const i32).read_unaligned())
}

/// 32 bytes of each group, group 0's in the low half.
#[inline(always)]
pub(crate) unsafe fn join512(a: *const u8, b: *const u8) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(a as *const __m256i)), _mm256_loadu_si256(b as *const __m256i))
}

/// Eight unsigned bytes of each group as sixteen i32 lanes, group 0's in the low half.
#[inline(always)]
pub(crate) unsafe fn bytes512(a: *const u8, b: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(a as *const __m128i), _mm_loadl_epi64(b as *const __m128i)))
}

/// Eight f16 of each group as sixteen f32, group 0's in the low half.
#[inline(always)]
pub(crate) unsafe fn halves512(a: *const u8, b: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(_mm_loadu_si128(a as *const __m128i)), _mm_loadu_si128(b as *const __m128i)))
}

/// One entry point per instruction set, each dispatching on the format.
macro_rules! group_fn {
    ($name:ident, $features:literal, $dot:ty) => {
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name<const N: usize>(
            format: WeightFormat,
            span: ActSpan,
            group: &[u8],
            blocks: usize,
            acts: [&[BlockQ8]; N],
            dst: [*mut f32; N],
        ) {
            match (format, span) {
                (WeightFormat::Q4K, ActSpan::Super) => group_impl::<$dot, Q4K_S, N>(group, blocks, acts, dst),
                (WeightFormat::Q5K, ActSpan::Super) => group_impl::<$dot, Q5K_S, N>(group, blocks, acts, dst),
                (_, ActSpan::Super) => unreachable!("{format:?} reads activations with one scale per block"),
                (WeightFormat::Q5_0, _) => group_impl::<$dot, Q5_0, N>(group, blocks, acts, dst),
                (WeightFormat::Q5_1, _) => group_impl::<$dot, Q5_1, N>(group, blocks, acts, dst),
                (WeightFormat::Q4K, _) => group_impl::<$dot, Q4K, N>(group, blocks, acts, dst),
                (WeightFormat::Q5K, _) => group_impl::<$dot, Q5K, N>(group, blocks, acts, dst),
                (WeightFormat::Q6K, _) => group_impl::<$dot, Q6K, N>(group, blocks, acts, dst),
                _ => unreachable!("{format:?} is not a packed_k format"),
            }
        }
    };
}
group_fn!(group_avx2, "avx2,fma,f16c", Avx2);
group_fn!(group_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", Vnni);
