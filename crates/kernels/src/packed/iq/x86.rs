//! The x86 kernels of the Q2_K / Q3_K and table-format groups (AVX2, and AVX-512 VNNI where the
//! CPU has it), on `packed::k`'s lane helpers.

use super::*;
use crate::packed::k::x86::{
    bcast4, bcast4_512, bytes512, f16x8, halves512, join512, minus_offset_share, minus_offset_share512, pair_prefetch, prefetch_pair, store_pairs, vec, Avx2,
    Dot, Vnni, L1_ACT_BYTES, L2_AHEAD, LONG_ROW,
};
use std::arch::x86_64::*;

/// The table formats' exact dot products, on top of `Dot`: each path's form of a table's values
/// and of a weight vector against one row's activations.
trait DotTable: Dot {
    /// Whether the path takes the table offset by 128 to unsigned bytes (`table_bytes`).
    const OFFSET_TABLE: bool;
    /// A weight vector (the table's values, as `OFFSET_TABLE` says), prepared once for every
    /// activation row.
    unsafe fn weights(w: __m256i) -> [__m256i; 2];
    /// `acc` plus each 32-bit lane's four products of the prepared weights `w` and `a`.
    unsafe fn dot(acc: __m256i, w: [__m256i; 2], a: __m256i) -> __m256i;
    /// Where a block's sum of `dot`s against activation block `ab` starts, so it ends exact
    /// (with the offset table: minus the offset's share, `minus_offset_share`).
    unsafe fn start(ab: &BlockQ8) -> __m256i;
}
impl DotTable for Avx2 {
    const OFFSET_TABLE: bool = false;
    #[inline(always)]
    unsafe fn weights(w: __m256i) -> [__m256i; 2] {
        [_mm256_abs_epi8(w), w]
    }
    #[inline(always)]
    unsafe fn dot(acc: __m256i, [w_abs, w]: [__m256i; 2], a: __m256i) -> __m256i {
        // `|w|` against `a` with `w`'s sign; one pair is at most 2 x 127 x 127 = 32258:
        // widened at once (`maddubs` would saturate on the offset table's `241 x 127 x 2`)
        let p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w));
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }
    #[inline(always)]
    unsafe fn start(_: &BlockQ8) -> __m256i {
        _mm256_setzero_si256()
    }
}
impl DotTable for Vnni {
    // `w + 128` against `a`, less `128 sum(a)`: one `vpdpbusd` per weight vector and row, the
    // broadcast folded in, where `|w|` and `w`'s sign took a `vpsignb` more per vector and row
    // and an abs per vector. The same exact sums (each lane at most 8 x 4 x 255 x 127 besides
    // the offset's share).
    const OFFSET_TABLE: bool = true;
    #[inline(always)]
    unsafe fn weights(w: __m256i) -> [__m256i; 2] {
        [w, w]
    }
    #[inline(always)]
    unsafe fn dot(acc: __m256i, [w, _]: [__m256i; 2], a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, w, a)
    }
    #[inline(always)]
    unsafe fn start(ab: &BlockQ8) -> __m256i {
        minus_offset_share(ab, 128)
    }
}

const Q2K: u8 = 0;
const Q3K: u8 = 1;
const IQ4NL: u8 = 2;
const IQ4XS: u8 = 3;
const MXFP4: u8 = 4;

const fn format_of(f: u8) -> WeightFormat {
    match f {
        Q2K => WeightFormat::Q2K,
        Q3K => WeightFormat::Q3K,
        IQ4NL => WeightFormat::IQ4NL,
        IQ4XS => WeightFormat::IQ4XS,
        _ => WeightFormat::MXFP4,
    }
}

/// Eight bytes at `p` as i32 lanes (sign-extended when `SIGNED`).
#[inline(always)]
unsafe fn bytes8<const SIGNED: bool>(p: *const u8) -> __m256i {
    let x = _mm_loadl_epi64(p as *const __m128i);
    if SIGNED {
        _mm256_cvtepi8_epi32(x)
    } else {
        _mm256_cvtepu8_epi32(x)
    }
}

/// Two i32 lanes' low 16 bits as one lane's i16 pair (`lo` low half, `hi` high half).
#[inline(always)]
unsafe fn pair16(lo: __m256i, hi: __m256i) -> __m256i {
    _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32::<16>(hi))
}

/// The eight rows' E8M0 bytes at `p` as f32 halves (`e8m0_to_f32_half`, bit for bit).
#[inline(always)]
unsafe fn e8m0_half8(p: *const u8) -> __m256 {
    let e = bytes8::<false>(p);
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let below2 = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, below2))
}

/// The 16 table values plus `offset`, as bytes: unsigned for an offset of 128
/// (`DotTable::OFFSET_TABLE`) or MXFP4's 12, the values' own bytes for 0.
#[inline(always)]
fn table_bytes(t: &[i8; 16], offset: i32) -> [u8; 16] {
    t.map(|v| (v as i32 + offset) as u8)
}

/// `table_bytes` in every 128-bit lane (for `pshufb`).
#[inline(always)]
unsafe fn table(t: &[i8; 16], offset: i32) -> __m256i {
    let t = table_bytes(t, offset);
    _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr() as *const __m128i))
}

/// The exact sums of one table-format block of 32 (code vectors `q..q + 4`) against activation
/// block `ab[n]` of each row.
#[inline(always)]
unsafe fn table_block<D: DotTable, const N: usize>(tab: __m256i, q: *const u8, ab: [&BlockQ8; N]) -> [__m256i; N] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut s: [__m256i; N] = std::array::from_fn(|n| D::start(ab[n]));
    for v in 0..4 {
        let raw = vec(q, v);
        let lo = D::weights(_mm256_shuffle_epi8(tab, _mm256_and_si256(raw, m4)));
        let hi = D::weights(_mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4)));
        for n in 0..N {
            let a = ab[n].qs.as_ptr();
            s[n] = D::dot(s[n], lo, bcast4(a.add(4 * v)));
            s[n] = D::dot(s[n], hi, bcast4(a.add(16 + 4 * v)));
        }
    }
    s
}

/// What MXFP4's AVX2 table adds to every value (their largest magnitude): `0..=24`.
const MXFP4_OFFSET: i16 = 12;

/// `table_block` for MXFP4 on AVX2 (the table `tab12`: offset by `MXFP4_OFFSET`), the same
/// exact sums by fewer instructions. MXFP4's values
/// are at most 12 in magnitude: offset to `0..=24` they go into `maddubs` unsigned, as they are,
/// where the signed table takes a `sign` per vector and row (for `|w|`'s operand) and a widening
/// `madd` after every `maddubs`. A `maddubs` pair is at most 2 x 24 x 127 = 6096, so a row's four
/// low-nibble (and four high-nibble) products add up in i16 (at most 24 384) before one `madd`
/// widens them; each block's sum starts at `-12 sum(a)` (`minus_offset_share`), so it ends at `sum(w a)` exactly. Ours (no crate has it).
#[inline(always)]
unsafe fn mxfp4_block_avx2<const N: usize>(tab12: __m256i, q: *const u8, ab: [&BlockQ8; N]) -> [__m256i; N] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut lo16 = [_mm256_setzero_si256(); N];
    let mut hi16 = [_mm256_setzero_si256(); N];
    for v in 0..4 {
        let raw = vec(q, v);
        let lo = _mm256_shuffle_epi8(tab12, _mm256_and_si256(raw, m4));
        let hi = _mm256_shuffle_epi8(tab12, _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4));
        for n in 0..N {
            let a = ab[n].qs.as_ptr();
            lo16[n] = _mm256_add_epi16(lo16[n], _mm256_maddubs_epi16(lo, bcast4(a.add(4 * v))));
            hi16[n] = _mm256_add_epi16(hi16[n], _mm256_maddubs_epi16(hi, bcast4(a.add(16 + 4 * v))));
        }
    }
    let ones = _mm256_set1_epi16(1);
    let mut s = [_mm256_setzero_si256(); N];
    for n in 0..N {
        s[n] = _mm256_add_epi32(minus_offset_share(ab[n], MXFP4_OFFSET), _mm256_add_epi32(_mm256_madd_epi16(lo16[n], ones), _mm256_madd_epi16(hi16[n], ones)));
    }
    s
}

/// The kernel of one format (a const parameter: no format test inside the loop).
#[inline(always)]
unsafe fn group_impl<D: DotTable, const F: u8, const N: usize>(group: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
    let format = format_of(F);
    let gbb = group_block_bytes(format);
    let per = format.block_len() / QK;
    assert!(group.len() >= blocks * gbb);
    // Software prefetch by `packed::k`'s rules (measured there for Q4_K / Q5_K, whose rows
    // these super-block formats resemble): into L2 ahead on CPUs without `sw_prefetch`
    // (Zen 4) from five activation rows or on long rows; otherwise one group block ahead
    // into L1 where that paid.
    let features = crate::cpu::features();
    let row_len = blocks * format.block_len();
    let l2_ahead = !features.sw_prefetch && per > 1 && (N >= 5 || row_len >= LONG_ROW);
    let act_bytes = N * (row_len / QK) * std::mem::size_of::<BlockQ8>();
    let far = !l2_ahead && (features.sw_prefetch || N >= 6 || act_bytes > L1_ACT_BYTES);
    let ahead = features.prefetch_ahead.unwrap_or(gbb.max(1024));
    let gp = group.as_ptr();
    let m3 = _mm256_set1_epi8(3);
    let bit2 = _mm256_set1_epi8(4);
    let sign = _mm256_set1_ps(-0.0);
    let tab = table(if F == MXFP4 { &KVALUES_MXFP4 } else { &KVALUES_IQ4NL }, if D::OFFSET_TABLE { 128 } else { 0 });
    let tab12 = table(&KVALUES_MXFP4, MXFP4_OFFSET.into());
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
        match F {
            Q2K | Q3K => {
                let d = f16x8(blk);
                let qs = blk.add(if F == Q2K { off::Q2K_QS } else { off::Q3K_QS });
                for n in 0..2 {
                    for j in 0..4 {
                        let shift = _mm_cvtsi32_si128(2 * j as i32);
                        let hshift = _mm_cvtsi32_si128((4 * n + j) as i32);
                        // (a loop, not `array::from_fn`: a closure does not inherit the
                        // function's target features, and its intrinsics became calls)
                        let mut w = [_mm256_setzero_si256(); 8];
                        for (v, w) in w.iter_mut().enumerate() {
                            let low = _mm256_and_si256(_mm256_srl_epi16(vec(qs, 8 * n + v), shift), m3);
                            *w = if F == Q2K {
                                low
                            } else {
                                // bit 4n + j of the hmask byte, moved to bit 2
                                let h = _mm256_slli_epi16::<2>(_mm256_srl_epi16(vec(blk.add(off::Q3K_HM), v), hshift));
                                _mm256_or_si256(low, _mm256_and_si256(h, bit2))
                            };
                        }
                        let k = 8 * n + 2 * j;
                        // the two sub-blocks' scales (i32 lanes and i16 pairs) and the i16
                        // pair each lane multiplies the activations' half sums by
                        let (sc0, sc1, offs) = if F == Q2K {
                            let (r0, r1) = (bytes8::<false>(blk.add(off::Q2K_SC + 8 * k)), bytes8::<false>(blk.add(off::Q2K_SC + 8 * k + 8)));
                            let m4 = _mm256_set1_epi32(0xF);
                            (_mm256_and_si256(r0, m4), _mm256_and_si256(r1, m4), pair16(_mm256_srli_epi32::<4>(r0), _mm256_srli_epi32::<4>(r1)))
                        } else {
                            let (s0, s1) = (bytes8::<true>(blk.add(off::Q3K_SC + 8 * k)), bytes8::<true>(blk.add(off::Q3K_SC + 8 * k + 8)));
                            let z = _mm256_setzero_si256();
                            (s0, s1, pair16(_mm256_sub_epi32(z, _mm256_slli_epi32::<2>(s0)), _mm256_sub_epi32(z, _mm256_slli_epi32::<2>(s1))))
                        };
                        let (sc0_16, sc1_16) = (pair16(sc0, sc0), pair16(sc1, sc1));
                        let dmin = if F == Q2K { f16x8(blk.add(off::Q2K_DMIN)) } else { d };
                        for r in 0..N {
                            let ab = acts[r].get_unchecked(per * b + 4 * n + j);
                            let ap = ab.qs.as_ptr();
                            let z = _mm256_setzero_si256();
                            let s0 = D::dot2_q4(z, w[0], bcast4(ap), w[1], bcast4(ap.add(4)));
                            let s0 = D::dot2_q4(s0, w[2], bcast4(ap.add(8)), w[3], bcast4(ap.add(12)));
                            let s1 = D::dot2_q4(z, w[4], bcast4(ap.add(16)), w[5], bcast4(ap.add(20)));
                            let s1 = D::dot2_q4(s1, w[6], bcast4(ap.add(24)), w[7], bcast4(ap.add(28)));
                            let t = _mm256_add_epi32(D::scaled_q4(s0, sc0, sc0_16), D::scaled_q4(s1, sc1, sc1_16));
                            let hs = _mm256_set1_epi32((ab.h.as_ptr() as *const i32).read_unaligned());
                            let da = _mm256_set1_ps(ab.d);
                            if F == Q2K {
                                let m = D::madd_add(z, offs, hs);
                                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(t), acc[r]);
                                acc[r] = _mm256_fmadd_ps(_mm256_xor_ps(_mm256_mul_ps(dmin, da), sign), _mm256_cvtepi32_ps(m), acc[r]);
                            } else {
                                let t = D::madd_add(t, offs, hs);
                                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(t), acc[r]);
                            }
                        }
                    }
                }
            }
            IQ4NL | MXFP4 => {
                let (d, q) = if F == IQ4NL { (f16x8(blk), blk.add(off::IQ4NL_QS)) } else { (e8m0_half8(blk), blk.add(off::MXFP4_QS)) };
                let ab = std::array::from_fn(|n| acts[n].get_unchecked(b));
                let s = if F == MXFP4 && !D::OFFSET_TABLE { mxfp4_block_avx2::<N>(tab12, q, ab) } else { table_block::<D, N>(tab, q, ab) };
                for n in 0..N {
                    let da = _mm256_set1_ps(acts[n].get_unchecked(b).d);
                    acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(s[n]), acc[n]);
                }
            }
            _ => {
                let d = f16x8(blk);
                for ib in 0..8 {
                    let dl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(bytes8::<true>(blk.add(off::IQ4XS_SC + 8 * ib))));
                    let s = table_block::<D, N>(tab, blk.add(off::IQ4XS_QS + 128 * ib), std::array::from_fn(|n| acts[n].get_unchecked(per * b + ib)));
                    for n in 0..N {
                        let da = _mm256_set1_ps(acts[n].get_unchecked(per * b + ib).d);
                        acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(dl, da), _mm256_cvtepi32_ps(s[n]), acc[n]);
                    }
                }
            }
        }
    }
    for n in 0..N {
        // SAFETY: the caller gives N pointers to eight writable floats each.
        _mm256_storeu_ps(dst[n], acc[n]);
    }
}

/// One entry point per instruction set, each dispatching on the format.
macro_rules! group_fn {
    ($name:ident, $features:literal, $dot:ty) => {
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name<const N: usize>(format: WeightFormat, group: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
            match format {
                WeightFormat::Q2K => group_impl::<$dot, Q2K, N>(group, blocks, acts, dst),
                WeightFormat::Q3K => group_impl::<$dot, Q3K, N>(group, blocks, acts, dst),
                WeightFormat::IQ4NL => group_impl::<$dot, IQ4NL, N>(group, blocks, acts, dst),
                WeightFormat::IQ4XS => group_impl::<$dot, IQ4XS, N>(group, blocks, acts, dst),
                WeightFormat::MXFP4 => group_impl::<$dot, MXFP4, N>(group, blocks, acts, dst),
                _ => unreachable!("{format:?} is not a packed_iq format"),
            }
        }
    };
}
group_fn!(group_avx2, "avx2,fma,f16c", Avx2);
group_fn!(group_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", Vnni);

/// Two groups at once (`PackedInt8::dot_group_pair_to`) for the table formats (IQ4_NL,
/// IQ4_XS, MXFP4): one 512-bit vector holds a code vector of both groups (group `g`'s in the
/// low half), mapped through the offset table, so each unpack, broadcast and `vpdpbusd`
/// serves sixteen rows where `group_vnni` serves eight. Each lane's exact integer sums and
/// float steps are `group_impl::<Vnni, _, _>`'s in the same order: the same bits. Ours (no
/// crate has it).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C present; `format` is IQ4_NL, IQ4_XS or MXFP4; `g0`
/// and `g1` hold `blocks` group blocks of it, every activation row the matching blocks of 32;
/// every `dst[j][n]` is valid for eight writes no other thread makes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn pair_table<const N: usize>(format: WeightFormat, g0: &[u8], g1: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
    match format {
        WeightFormat::IQ4NL => pair_impl::<IQ4NL, N>(g0, g1, blocks, acts, dst),
        WeightFormat::IQ4XS => pair_impl::<IQ4XS, N>(g0, g1, blocks, acts, dst),
        WeightFormat::MXFP4 => pair_impl::<MXFP4, N>(g0, g1, blocks, acts, dst),
        _ => unreachable!("{format:?} has no two-group table kernel"),
    }
}

/// Both groups' E8M0 bytes as f32 halves (`e8m0_half8`'s steps on sixteen lanes).
#[inline(always)]
unsafe fn e8m0_half16(a: *const u8, b: *const u8) -> __m512 {
    let e = bytes512(a, b);
    let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
    let tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
    let below2 = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(2), e);
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(below2, normal, tiny))
}

/// Both groups' eight signed scale bytes as sixteen f32.
#[inline(always)]
unsafe fn scales16(a: *const u8, b: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(a as *const __m128i), _mm_loadl_epi64(b as *const __m128i))))
}

/// `table_block`'s offset sums for both groups' code vectors `q0..q0 + 4`, `q1..q1 + 4`.
#[inline(always)]
unsafe fn table_block512<const N: usize>(tab: __m512i, q0: *const u8, q1: *const u8, ab: [&BlockQ8; N]) -> [__m512i; N] {
    let m4 = _mm512_set1_epi8(0x0F);
    let mut s: [__m512i; N] = std::array::from_fn(|n| minus_offset_share512(ab[n]));
    for v in 0..4 {
        let raw = join512(q0.add(32 * v), q1.add(32 * v));
        let lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(raw, m4));
        let hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4));
        for n in 0..N {
            let a = ab[n].qs.as_ptr();
            s[n] = _mm512_dpbusd_epi32(s[n], lo, bcast4_512(a.add(4 * v)));
            s[n] = _mm512_dpbusd_epi32(s[n], hi, bcast4_512(a.add(16 + 4 * v)));
        }
    }
    s
}

#[inline(always)]
unsafe fn pair_impl<const F: u8, const N: usize>(g0: &[u8], g1: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
    let format = format_of(F);
    let gbb = group_block_bytes(format);
    let per = format.block_len() / QK;
    assert!(g0.len() >= blocks * gbb && g1.len() >= blocks * gbb);
    let (p0, p1) = (g0.as_ptr(), g1.as_ptr());
    let dist = pair_prefetch(gbb);
    let t = table_bytes(if F == MXFP4 { &KVALUES_MXFP4 } else { &KVALUES_IQ4NL }, 128);
    let tab = _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr() as *const __m128i));
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..blocks {
        // SAFETY (whole loop): b < blocks, both groups hold `blocks` group blocks of gbb bytes
        // and every activation row the matching blocks of 32 (checked by the caller). A
        // prefetch past the end of the matrix is a hint and never faults.
        let (b0, b1) = (p0.add(b * gbb), p1.add(b * gbb));
        prefetch_pair(b0, b1, gbb, dist);
        match F {
            IQ4NL | MXFP4 => {
                let (d, qo) = if F == IQ4NL { (halves512(b0, b1), off::IQ4NL_QS) } else { (e8m0_half16(b0, b1), off::MXFP4_QS) };
                let ab: [&BlockQ8; N] = std::array::from_fn(|n| acts[n].get_unchecked(b));
                let s = table_block512::<N>(tab, b0.add(qo), b1.add(qo), ab);
                for n in 0..N {
                    let da = _mm512_set1_ps(ab[n].d);
                    acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(s[n]), acc[n]);
                }
            }
            _ => {
                let d = halves512(b0, b1);
                for ib in 0..8 {
                    let so = off::IQ4XS_SC + 8 * ib;
                    let dl = _mm512_mul_ps(d, scales16(b0.add(so), b1.add(so)));
                    let qo = off::IQ4XS_QS + 128 * ib;
                    let ab: [&BlockQ8; N] = std::array::from_fn(|n| acts[n].get_unchecked(per * b + ib));
                    let s = table_block512::<N>(tab, b0.add(qo), b1.add(qo), ab);
                    for n in 0..N {
                        let da = _mm512_set1_ps(ab[n].d);
                        acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(dl, da), _mm512_cvtepi32_ps(s[n]), acc[n]);
                    }
                }
            }
        }
    }
    // SAFETY: the caller gives 2 x N pointers to eight writable floats each.
    store_pairs(&acc, dst);
}
