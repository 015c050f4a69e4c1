//! Group layouts and micro-kernels of the low-bit k-quants (Q2_K, Q3_K) and the table formats
//! (IQ4_NL, IQ4_XS, MXFP4) inside `PackedInt8`: the formats of big MoE downloads, imatrix quants
//! and gpt-oss's experts. The structure is `packed_k`'s: eight rows per group, quant arrays
//! interleaved four bytes per 32-bit lane (byte `t` of lane `r` of vector `u` is byte `4u + t` of
//! that array in row `r`'s ggml block), scales moved to per-lane arrays, the same int8 activation
//! blocks of 32, integer sums exact on every path and the float steps the same operations in the
//! same order, so AVX2, AVX-512 VNNI (256-bit `vpdpbusd`) and the scalar reference give the same
//! bits and a row's result never depends on the batch or the thread split.
//!
//! The table formats store 4-bit codes of int8 values (IQ4: `KVALUES_IQ4NL`; MXFP4: the e2m1
//! values doubled, `KVALUES_MXFP4`, with the E8M0 scale halved): the kernels map the codes to
//! int8 through the table (`pshufb`) and take signed int8 dot products (`|w|` against the
//! activations with `w`'s sign, the products exact).
//!
//! Layout of one group block (offsets in bytes; `d[8]` etc. are the eight rows' values):
//! - Q2_K (672, as the ggml blocks): `d[8]` f16, `dmin[8]` f16, `sc[16][8]` ggml's scale bytes
//!   (low nibble scale, high nibble min), 16 vectors of `qs`.
//! - Q3_K (912): `d[8]` f16, `sc[16][8]` i8 (the 6-bit scales minus 32), 8 vectors of `hmask`,
//!   16 vectors of `qs`.
//! - IQ4_NL (144): `d[8]` f16, 4 vectors of `qs` (low nibbles elements `4v + t`, high `16 + 4v + t`).
//! - IQ4_XS (1104): `d[8]` f16, `sc[8][8]` i8 (the 6-bit scales minus 32), 32 vectors of `qs`
//!   (block `ib`'s in vectors `4ib..4ib + 4`, as IQ4_NL's).
//! - MXFP4 (136): `e[8]` E8M0 bytes, 4 vectors of `qs` (as IQ4_NL's).
//!
//! Arithmetic per activation block of 32 (`A_0`, `A_1`: its halves' activation sums, `BlockQ8::h`):
//! - Q2_K (block `4n + j` of a super-block: bits `2j` of `qs[32n..32n + 32]`, sub-blocks
//!   `k = 8n + 2j`, `k + 1`): `s_0`, `s_1` the halves' sums of the 2-bit quants times the
//!   activations; `T = sc_k s_0 + sc_{k+1} s_1`, `M = m_k A_0 + m_{k+1} A_1` exact in i32;
//!   `acc = fma(d * d_a, T, acc)`, then `acc = fma(-(dmin * d_a), M, acc)`.
//! - Q3_K: as Q2_K with the 3-bit quants `q = low2 | hbit << 2` (the value is `q - 4`) and signed
//!   scales: `T = sc_k (s_0 - 4 A_0) + sc_{k+1} (s_1 - 4 A_1)`; `acc = fma(d * d_a, T, acc)`.
//! - IQ4_NL / MXFP4: `s` the exact sum of the table values times the activations;
//!   `acc = fma(d * d_a, s, acc)` (MXFP4: `d = 2^(e - 128)`).
//! - IQ4_XS: likewise per block `ib` with `dl = d * sc_ib` (exact in f32):
//!   `acc = fma(dl * d_a, s, acc)`.
//!
//! On AVX2 `maddubs` pairs never saturate: Q2_K / Q3_K quants <= 7 stay in i16 for a half block
//! (8 x 7 x 127 = 7112 per lane) before the scale multiplies them in `madd`; the table formats'
//! `|w| <= 127` products are widened to i32 every vector (two are 2 x 127 x 127 = 32258).

use crate::formats::{e8m0_to_f32_half, iq4xs_scales, q3k_scales, WeightFormat, KVALUES_IQ4NL, KVALUES_MXFP4, QK, QK_K};
use crate::group::{interleave, GROUP_ROWS};
use crate::q8::BlockQ8;
use half::f16;

/// Whether `format` is laid out and computed here (rather than in `packed.rs` / `packed_k.rs`).
pub(crate) fn handles(format: WeightFormat) -> bool {
    matches!(format, WeightFormat::Q2K | WeightFormat::Q3K | WeightFormat::IQ4NL | WeightFormat::IQ4XS | WeightFormat::MXFP4)
}

/// Offsets inside a group block.
mod off {
    pub const Q2K_DMIN: usize = 16;
    pub const Q2K_SC: usize = 32;
    pub const Q2K_QS: usize = 160;
    pub const Q3K_SC: usize = 16;
    pub const Q3K_HM: usize = 144;
    pub const Q3K_QS: usize = 400;
    pub const IQ4NL_QS: usize = 16;
    pub const IQ4XS_SC: usize = 16;
    pub const IQ4XS_QS: usize = 80;
    pub const MXFP4_QS: usize = 8;
}

/// Bytes of one group block of `format` (one of `handles`).
pub(crate) fn group_block_bytes(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Q2K => 672,
        WeightFormat::Q3K => 912,
        WeightFormat::IQ4NL => 144,
        WeightFormat::IQ4XS => 1104,
        WeightFormat::MXFP4 => 136,
        _ => unreachable!("{format:?} is not a packed_iq format"),
    }
}

/// Writes row `lane`'s ggml block `src` into its share of the group block `dst`.
pub(crate) fn pack_block(format: WeightFormat, src: &[u8], lane: usize, dst: &mut [u8]) {
    assert_eq!(src.len(), format.block_bytes());
    assert_eq!(dst.len(), group_block_bytes(format));
    match format {
        WeightFormat::Q2K => {
            // ggml: scales[16], qs[64], d, dmin
            dst[2 * lane..2 * lane + 2].copy_from_slice(&src[80..82]);
            dst[off::Q2K_DMIN + 2 * lane..off::Q2K_DMIN + 2 * lane + 2].copy_from_slice(&src[82..84]);
            for k in 0..16 {
                dst[off::Q2K_SC + 8 * k + lane] = src[k];
            }
            interleave(&src[16..80], lane, &mut dst[off::Q2K_QS..]);
        }
        WeightFormat::Q3K => {
            // ggml: hmask[32], qs[64], scales[12], d
            dst[2 * lane..2 * lane + 2].copy_from_slice(&src[108..110]);
            for (k, sc) in q3k_scales(&src[96..108]).into_iter().enumerate() {
                dst[off::Q3K_SC + 8 * k + lane] = sc as u8;
            }
            interleave(&src[0..32], lane, &mut dst[off::Q3K_HM..off::Q3K_QS]);
            interleave(&src[32..96], lane, &mut dst[off::Q3K_QS..]);
        }
        WeightFormat::IQ4NL => {
            dst[2 * lane..2 * lane + 2].copy_from_slice(&src[0..2]);
            interleave(&src[2..18], lane, &mut dst[off::IQ4NL_QS..]);
        }
        WeightFormat::IQ4XS => {
            // ggml: d, scales_h, scales_l[4], qs[128]
            dst[2 * lane..2 * lane + 2].copy_from_slice(&src[0..2]);
            for (ib, sc) in iq4xs_scales(u16::from_le_bytes([src[2], src[3]]), &src[4..8]).into_iter().enumerate() {
                dst[off::IQ4XS_SC + 8 * ib + lane] = sc as u8;
            }
            interleave(&src[8..8 + QK_K / 2], lane, &mut dst[off::IQ4XS_QS..]);
        }
        WeightFormat::MXFP4 => {
            dst[lane] = src[0];
            interleave(&src[1..17], lane, &mut dst[off::MXFP4_QS..]);
        }
        _ => unreachable!("{format:?} is not a packed_iq format"),
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Scalar reference (the arithmetic of the module header): one activation row (`blocks` times
/// the format's blocks of 32) against the eight rows of a group.
pub(crate) fn dot_group_scalar(format: WeightFormat, group: &[u8], blocks: usize, a: &[BlockQ8]) -> [f32; GROUP_ROWS] {
    let gbb = group_block_bytes(format);
    let per = format.block_len() / QK;
    let mut acc = [0f32; GROUP_ROWS];
    for b in 0..blocks {
        let blk = &group[b * gbb..(b + 1) * gbb];
        for (lane, acc) in acc.iter_mut().enumerate() {
            let q = |base: usize, u: usize, t: usize| blk[base + 32 * u + 4 * lane + t];
            // the exact sum of a table format's values (codes in vectors `base + v`) times block `ab`
            let table_sum = |table: &[i8; 16], base: usize, ab: &BlockQ8| {
                let mut s = 0i32;
                for v in 0..4 {
                    for t in 0..4 {
                        let x = q(base, v, t);
                        s += table[(x & 0xF) as usize] as i32 * ab.qs[4 * v + t] as i32;
                        s += table[(x >> 4) as usize] as i32 * ab.qs[16 + 4 * v + t] as i32;
                    }
                }
                s
            };
            match format {
                WeightFormat::Q2K | WeightFormat::Q3K => {
                    let q2 = format == WeightFormat::Q2K;
                    let d = f16_at(blk, 2 * lane);
                    for n in 0..2 {
                        for j in 0..4 {
                            let ab = &a[per * b + 4 * n + j];
                            let mut s = [0i32; 2];
                            for v in 0..8 {
                                for t in 0..4 {
                                    let mut x = (q(if q2 { off::Q2K_QS } else { off::Q3K_QS }, 8 * n + v, t) >> (2 * j)) & 3;
                                    if !q2 {
                                        x |= ((q(off::Q3K_HM, v, t) >> (4 * n + j)) & 1) << 2;
                                    }
                                    s[v / 4] += x as i32 * ab.qs[4 * v + t] as i32;
                                }
                            }
                            let k = 8 * n + 2 * j;
                            let h = [ab.h[0] as i32, ab.h[1] as i32];
                            if q2 {
                                let sc = [blk[off::Q2K_SC + 8 * k + lane], blk[off::Q2K_SC + 8 * (k + 1) + lane]];
                                let t = (sc[0] & 0xF) as i32 * s[0] + (sc[1] & 0xF) as i32 * s[1];
                                let m = (sc[0] >> 4) as i32 * h[0] + (sc[1] >> 4) as i32 * h[1];
                                let dmin = f16_at(blk, off::Q2K_DMIN + 2 * lane);
                                *acc = (d * ab.d).mul_add(t as f32, *acc);
                                *acc = (-(dmin * ab.d)).mul_add(m as f32, *acc);
                            } else {
                                let sc = [blk[off::Q3K_SC + 8 * k + lane] as i8 as i32, blk[off::Q3K_SC + 8 * (k + 1) + lane] as i8 as i32];
                                let t = sc[0] * (s[0] - 4 * h[0]) + sc[1] * (s[1] - 4 * h[1]);
                                *acc = (d * ab.d).mul_add(t as f32, *acc);
                            }
                        }
                    }
                }
                WeightFormat::IQ4NL => {
                    let ab = &a[b];
                    let s = table_sum(&KVALUES_IQ4NL, off::IQ4NL_QS, ab);
                    *acc = (f16_at(blk, 2 * lane) * ab.d).mul_add(s as f32, *acc);
                }
                WeightFormat::MXFP4 => {
                    let ab = &a[b];
                    let s = table_sum(&KVALUES_MXFP4, off::MXFP4_QS, ab);
                    *acc = (e8m0_to_f32_half(blk[lane]) * ab.d).mul_add(s as f32, *acc);
                }
                WeightFormat::IQ4XS => {
                    let d = f16_at(blk, 2 * lane);
                    for ib in 0..8 {
                        let ab = &a[per * b + ib];
                        let s = table_sum(&KVALUES_IQ4NL, off::IQ4XS_QS + 128 * ib, ab);
                        let dl = d * blk[off::IQ4XS_SC + 8 * ib + lane] as i8 as f32;
                        *acc = (dl * ab.d).mul_add(s as f32, *acc);
                    }
                }
                _ => unreachable!("{format:?} is not a packed_iq format"),
            }
        }
    }
    acc
}

/// The fastest path this CPU has: `dst[n]` receives activation `n`'s eight results.
///
/// # Safety
/// `group` holds `blocks` group blocks, every activation row the matching number of blocks of 32
/// (checked by the caller), and every `dst[n]` is valid for eight writes no other thread makes.
#[inline]
pub(crate) unsafe fn dot_group_to<const N: usize>(format: WeightFormat, group: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        if f.avx512_vnni {
            // SAFETY: AVX2, FMA, F16C and AVX-512 VNNI/VL were detected at run time; sizes and dst
            // as the caller promised.
            return x86::group_vnni::<N>(format, group, blocks, acts, dst);
        }
        if f.avx2_fma {
            // SAFETY: AVX2, FMA and F16C were detected at run time; sizes and dst as promised.
            return x86::group_avx2::<N>(format, group, blocks, acts, dst);
        }
    }
    for (a, d) in acts.iter().zip(dst) {
        let y = dot_group_scalar(format, group, blocks, a);
        // SAFETY: d is valid for eight writes (the caller's promise).
        std::ptr::copy_nonoverlapping(y.as_ptr(), d, GROUP_ROWS);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::*;
    use crate::packed_k::x86::{bcast4, f16x8, vec, Avx2, Dot, Vnni, L1_ACT_BYTES, L2_AHEAD, LONG_ROW};
    use std::arch::x86_64::*;

    /// Signed int8 weights against int8 activations, on top of `Dot`.
    trait DotSigned: Dot {
        /// `acc` plus each 32-bit lane's four products `w * a` (`w_abs = |w|`, `|w| <= 127`),
        /// exact, as `|w| * (a with w's sign)`.
        unsafe fn dot_s8(acc: __m256i, w_abs: __m256i, w: __m256i, a: __m256i) -> __m256i;
    }
    impl DotSigned for Avx2 {
        #[inline(always)]
        unsafe fn dot_s8(acc: __m256i, w_abs: __m256i, w: __m256i, a: __m256i) -> __m256i {
            // one pair is at most 2 x 127 x 127 = 32258: widened at once
            let p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w));
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }
    impl DotSigned for Vnni {
        #[inline(always)]
        unsafe fn dot_s8(acc: __m256i, w_abs: __m256i, w: __m256i, a: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(acc, w_abs, _mm256_sign_epi8(a, w))
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

    /// The 16 int8 table values in both 128-bit halves (for `pshufb`).
    #[inline(always)]
    unsafe fn table(t: &[i8; 16]) -> __m256i {
        _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr() as *const __m128i))
    }

    /// `s[n]` plus the exact sums of one table-format block of 32 (code vectors `q..q + 4`)
    /// against activation block `ab[n]` of each row.
    #[inline(always)]
    unsafe fn table_block<D: DotSigned, const N: usize>(tab: __m256i, q: *const u8, ab: [*const i8; N]) -> [__m256i; N] {
        let m4 = _mm256_set1_epi8(0x0F);
        let mut s = [_mm256_setzero_si256(); N];
        for v in 0..4 {
            let raw = vec(q, v);
            let lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(raw, m4));
            let hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4));
            let (lo_abs, hi_abs) = (_mm256_abs_epi8(lo), _mm256_abs_epi8(hi));
            for n in 0..N {
                s[n] = D::dot_s8(s[n], lo_abs, lo, bcast4(ab[n].add(4 * v)));
                s[n] = D::dot_s8(s[n], hi_abs, hi, bcast4(ab[n].add(16 + 4 * v)));
            }
        }
        s
    }

    /// The kernel of one format (a const parameter: no format test inside the loop).
    #[inline(always)]
    unsafe fn group_impl<D: DotSigned, const F: u8, const N: usize>(group: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
        let format = format_of(F);
        let gbb = group_block_bytes(format);
        let per = format.block_len() / QK;
        assert!(group.len() >= blocks * gbb);
        // Software prefetch by `packed_k`'s rules (measured there for Q4_K / Q5_K, whose rows
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
        let tab = table(if F == MXFP4 { &KVALUES_MXFP4 } else { &KVALUES_IQ4NL });
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
                    let s = table_block::<D, N>(tab, q, std::array::from_fn(|n| acts[n].get_unchecked(b).qs.as_ptr()));
                    for n in 0..N {
                        let da = _mm256_set1_ps(acts[n].get_unchecked(b).d);
                        acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(s[n]), acc[n]);
                    }
                }
                _ => {
                    let d = f16x8(blk);
                    for ib in 0..8 {
                        let dl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(bytes8::<true>(blk.add(off::IQ4XS_SC + 8 * ib))));
                        let s = table_block::<D, N>(
                            tab,
                            blk.add(off::IQ4XS_QS + 128 * ib),
                            std::array::from_fn(|n| acts[n].get_unchecked(per * b + ib).qs.as_ptr()),
                        );
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
}

/// Random ggml blocks of `format` (any quant bytes and 4/6-bit scales, sane f16 scales, E8M0
/// scales between 2^-10 and 4): the test matrices of this module and of the matmul tests.
#[cfg(test)]
pub(crate) fn random_raw(rng: &mut rand::rngs::StdRng, format: WeightFormat, rows: usize, cols: usize) -> Vec<u8> {
    use rand::Rng;
    let bb = format.block_bytes();
    let mut raw: Vec<u8> = (0..rows * format.row_bytes(cols)).map(|_| rng.gen()).collect();
    // byte offsets of the f16 fields, and whether they may be negative
    let fields: &[(usize, bool)] = match format {
        WeightFormat::Q2K => &[(80, false), (82, false)],
        WeightFormat::Q3K => &[(108, true)],
        WeightFormat::IQ4NL | WeightFormat::IQ4XS => &[(0, true)],
        WeightFormat::MXFP4 => &[],
        _ => unreachable!("{format:?} is not a packed_iq format"),
    };
    for blk in raw.chunks_exact_mut(bb) {
        for &(at, signed) in fields {
            let mut v = rng.gen_range(0.001f32..0.05);
            if signed && rng.gen() {
                v = -v;
            }
            blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        if format == WeightFormat::MXFP4 {
            blk[0] = rng.gen_range(118..=130);
        }
    }
    raw
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::dequantize_row;
    use crate::packed::PackedInt8;
    use crate::packed_test_rows::{self as test_rows, activation_rows, rand_vec, shapes};
    use crate::q8::{quantize_rows, QuantizedActivations};
    use rand::SeedableRng;

    pub(crate) const FORMATS: [WeightFormat; 5] = [WeightFormat::Q2K, WeightFormat::Q3K, WeightFormat::IQ4NL, WeightFormat::IQ4XS, WeightFormat::MXFP4];

    /// Activation rows: random, and one at the ends of i8.
    fn activations(rng: &mut rand::rngs::StdRng, cols: usize) -> Vec<QuantizedActivations> {
        activation_rows(rng, cols, |x| quantize_rows(x, x.len()))
    }

    fn group_bytes(p: &PackedInt8, g: usize, f: WeightFormat, cols: usize) -> (&[u8], usize) {
        test_rows::group_bytes(p, g, f, cols, group_block_bytes(f))
    }

    /// Every path this CPU has (the dispatched one at 1..8 activation rows, and AVX2 and VNNI
    /// called directly) gives the scalar reference's bits. Says which paths ran; under CI, a path
    /// the CPU has and the environment did not switch off must have run (`cpu::expected_paths`).
    #[test]
    fn simd_equals_the_scalar_reference_bitwise() {
        fn check<const N: usize>(
            p: &PackedInt8,
            f: WeightFormat,
            cols: usize,
            acts: &[QuantizedActivations],
            ran: &mut std::collections::BTreeSet<&'static str>,
        ) {
            let rows: [&[BlockQ8]; N] = std::array::from_fn(|i| acts[(i * 3 + N) % acts.len()].row(0));
            for g in 0..p.groups() {
                let (group, blocks) = group_bytes(p, g, f, cols);
                let got = p.dot_group::<N>(g, rows);
                #[allow(unused_mut)]
                let mut paths = vec![("dispatched", got)];
                #[cfg(target_arch = "x86_64")]
                {
                    let feat = crate::cpu::features();
                    let mut run = |name, vnni: bool| {
                        let mut out = [[0f32; GROUP_ROWS]; N];
                        let dst = out.each_mut().map(|r| r.as_mut_ptr());
                        // SAFETY: the features were detected; sizes as in dot_group; dst holds N x 8 floats.
                        unsafe {
                            if vnni {
                                x86::group_vnni::<N>(f, group, blocks, rows, dst)
                            } else {
                                x86::group_avx2::<N>(f, group, blocks, rows, dst)
                            }
                        }
                        paths.push((name, out));
                    };
                    if feat.avx2_fma {
                        run(crate::cpu::PATH_AVX2, false);
                    }
                    if feat.avx512_vnni {
                        run(crate::cpu::PATH_VNNI, true);
                    }
                }
                for (name, out) in paths {
                    for (n, a) in rows.iter().enumerate() {
                        let reference = dot_group_scalar(f, group, blocks, a);
                        assert_eq!(out[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} {name} group {g} activation {n} of {N}");
                    }
                    ran.insert(if name == "dispatched" { crate::cpu::dispatched_path() } else { name });
                }
            }
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        let mut ran = std::collections::BTreeSet::new();
        for f in FORMATS {
            for (rows, cols) in shapes(f) {
                let p = PackedInt8::pack(f, rows, cols, &random_raw(&mut rng, f, rows, cols)).unwrap();
                let acts = activations(&mut rng, cols);
                check::<1>(&p, f, cols, &acts, &mut ran);
                check::<2>(&p, f, cols, &acts, &mut ran);
                check::<3>(&p, f, cols, &acts, &mut ran);
                check::<4>(&p, f, cols, &acts, &mut ran);
                check::<5>(&p, f, cols, &acts, &mut ran);
                check::<6>(&p, f, cols, &acts, &mut ran);
                check::<7>(&p, f, cols, &acts, &mut ran);
                check::<8>(&p, f, cols, &acts, &mut ran);
            }
        }
        eprintln!("packed_iq kernel paths compared with the scalar reference: {ran:?}");
        crate::cpu::assert_expected_paths_ran(&ran);
    }

    /// Independent oracle: the float dot of the dequantized ggml row (`dequantize_row`, itself
    /// checked against gguf-py by python/tests/test_kquant_oracle.py) with the f32 activations,
    /// within what the 8-bit activations allow (each activation off by at most `amax / 254` of
    /// its block), plus float rounding; and against the dequantized activations within float
    /// rounding only.
    #[test]
    fn packed_dot_approximates_the_float_dot_of_dequantized_weights() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for f in FORMATS {
            let (rows, cols) = (11, if f.block_len() == QK { 576 } else { 1024 });
            let raw = random_raw(&mut rng, f, rows, cols);
            let p = PackedInt8::pack(f, rows, cols, &raw).unwrap();
            for _ in 0..3 {
                let x = rand_vec(&mut rng, cols);
                let q = quantize_rows(&x, cols);
                for r in 0..rows {
                    let mut wd = vec![0f32; cols];
                    dequantize_row(f, &raw[r * f.row_bytes(cols)..(r + 1) * f.row_bytes(cols)], &mut wd);
                    let exact: f64 = wd.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let got = p.dot_group::<1>(r / GROUP_ROWS, [q.row(0)])[0][r % GROUP_ROWS];
                    let mut bound = 0f64;
                    let mut mag = 0f64;
                    for (wb, xb) in wd.chunks_exact(QK).zip(x.chunks_exact(QK)) {
                        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                        bound += amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>();
                        mag += wb.iter().zip(xb).map(|(a, b)| (a * b).abs() as f64).sum::<f64>();
                    }
                    let bound = bound * 1.0001 + mag * 1e-5 + 1e-6;
                    assert!((exact - got as f64).abs() <= bound, "{f:?} row {r}: {exact} vs {got} (bound {bound})");
                    let mut exact_q = 0f64;
                    let mut scale = 0f64;
                    for (wb, ab) in wd.chunks_exact(QK).zip(q.row(0)) {
                        for (w, &a) in wb.iter().zip(&ab.qs) {
                            exact_q += *w as f64 * (ab.d as f64 * a as f64);
                        }
                        scale += wb.iter().map(|v| v.abs() as f64).sum::<f64>() * ab.d as f64 * 127.0;
                    }
                    assert!((exact_q - got as f64).abs() <= scale * 1e-5, "{f:?} row {r}: {exact_q} vs {got} (scale {scale})");
                }
                // the padding lanes of the last group are zero
                let last = p.dot_group::<1>(p.groups() - 1, [q.row(0)])[0];
                assert!(last[rows % GROUP_ROWS..].iter().all(|&v| v == 0.0));
            }
        }
    }

    /// Every quant byte at one extreme (all bits set, or all clear: IQ4's -127, Q3_K's -4), the
    /// 6-bit scales at both ends, against activations all at +-127: the largest integer sums, on
    /// every path, against the reference and the dequantized float dot.
    #[test]
    fn extreme_quants_do_not_overflow_the_integer_sums() {
        for f in FORMATS {
            for fill in [0x00u8, 0xFF, 0x88] {
                let cols = 2 * f.block_len();
                let mut raw = vec![fill; 8 * f.row_bytes(cols)];
                let scale = f16::from_f32(0.01).to_le_bytes();
                for blk in raw.chunks_exact_mut(f.block_bytes()) {
                    match f {
                        WeightFormat::Q2K => {
                            blk[80..82].copy_from_slice(&scale);
                            blk[82..84].copy_from_slice(&scale);
                        }
                        WeightFormat::Q3K => blk[108..110].copy_from_slice(&scale),
                        WeightFormat::MXFP4 => blk[0] = 127,
                        _ => blk[0..2].copy_from_slice(&scale),
                    }
                }
                let p = PackedInt8::pack(f, 8, cols, &raw).unwrap();
                for x in [vec![1.0f32; cols], vec![-1.0f32; cols], (0..cols).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect()] {
                    let q = quantize_rows(&x, cols);
                    let (group, blocks) = group_bytes(&p, 0, f, cols);
                    let reference = dot_group_scalar(f, group, blocks, q.row(0));
                    let got = p.dot_group::<4>(0, [q.row(0); 4]);
                    for o in got {
                        assert_eq!(o.map(f32::to_bits), reference.map(f32::to_bits), "{f:?} fill {fill:#x}");
                    }
                    let mut wd = vec![0f32; cols];
                    dequantize_row(f, &raw[..f.row_bytes(cols)], &mut wd);
                    let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
                    assert!(
                        (got[0][0] - exact).abs() <= 1e-4 * wd.iter().map(|v| v.abs()).sum::<f32>() + 1e-6,
                        "{f:?} fill {fill:#x}: {} vs {exact}",
                        got[0][0]
                    );
                }
            }
        }
    }
}
