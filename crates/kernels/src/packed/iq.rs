//! Group layouts and micro-kernels of the low-bit k-quants (Q2_K, Q3_K) and the table formats
//! (IQ4_NL, IQ4_XS, MXFP4) inside `PackedInt8`: the formats of big MoE downloads, imatrix quants
//! and gpt-oss's experts. The structure is `packed::k`'s: eight rows per group, quant arrays
//! interleaved four bytes per 32-bit lane (byte `t` of lane `r` of vector `u` is byte `4u + t` of
//! that array in row `r`'s ggml block), scales moved to per-lane arrays, the same int8 activation
//! blocks of 32, integer sums exact on every path and the float steps the same operations in the
//! same order, so AVX2, AVX-512 VNNI (256-bit `vpdpbusd`, and for the table formats two groups
//! per 512-bit pass, `x86::pair_table`) and the scalar reference give the same bits and a row's
//! result never depends on the batch or the thread split.
//!
//! The table formats store 4-bit codes of int8 values (IQ4: `KVALUES_IQ4NL`; MXFP4: the e2m1
//! values doubled, `KVALUES_MXFP4`, with the E8M0 scale halved): the kernels map the codes to
//! int8 through the table (`pshufb`) and take exact int8 dot products: on AVX2 `|w|` against the
//! activations with `w`'s sign; with VNNI the table offset by 128 to unsigned bytes against the
//! activations, less `128` times the block's activation sum (`BlockQ8::h`).
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

/// Whether `format` is laid out and computed here (rather than in `packed/mod.rs` / `packed/k.rs`).
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
pub(crate) mod x86;

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
mod tests;
