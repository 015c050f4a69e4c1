//! Group layouts and micro-kernels of the 5-bit and k-quant formats (Q5_0, Q5_1, Q4_K, Q5_K,
//! Q6_K) inside `PackedInt8`: eight rows per group, the same int8 activation blocks of 32 as
//! Q4_0 / Q8_0, integer sums exact on every path, the float steps the same operations in the same
//! order, so AVX2, AVX-512 VNNI (256-bit `vpdpbusd`) and the scalar reference give the same bits
//! and a row's result never depends on the batch or the thread split.
//!
//! Every quant array is interleaved four bytes at a time: byte `t` of 32-bit lane `r` of vector
//! `u` is byte `4u + t` of that array in row `r`'s ggml block. Scales are moved to per-lane arrays
//! so that one load gives the eight rows' values. A group block is as large as the eight ggml
//! blocks, except Q4_K / Q5_K whose 6-bit scales and mins are unpacked to bytes (+32 bytes per
//! 1152 / 1408, under 3%).
//!
//! Layout of one group block (offsets in bytes; `d[8]` etc. are the eight rows' f16 values):
//! - Q5_0 (176): `d[8]`; `qh[8]` u32 with the fifth bits rearranged: byte `t` bit `v` is element
//!   `4v + t`'s, bit `4 + v` element `16 + 4v + t`'s; then Q4_0's four quant vectors.
//! - Q5_1 (192): `d[8]`, `m[8]`, then as Q5_0.
//! - Q4_K (1184): `d[8]`, `dmin[8]`, `sc[8][8]` (sub-block, lane) bytes, `mn[8][8]`, 32 vectors
//!   of `qs` (vector `8c + v`: low nibbles are sub-block `2c` elements `4v..4v+4`, high nibbles
//!   sub-block `2c + 1`'s).
//! - Q5_K (1440): as Q4_K with the 8 vectors of `qh` before `qs` (element `4v + t` of sub-block
//!   `j` has its fifth bit at bit `j` of byte `t` of vector `v`).
//! - Q6_K (1680): `d[8]`, `sc[16][8]` i8, 32 vectors of `ql`, 16 vectors of `qh`.
//!
//! Arithmetic per activation block of 32 (sub-blocks in index order, super-blocks in order):
//! - Q5_0 / Q5_1: `s` = exact sum of the unsigned 5-bit quants times the int8 activations;
//!   `acc = fma(d * d_a, s, acc)`, then `acc = fma(m, s_a, acc)` (Q5_0: `m = -16 d`).
//! - Q4_K / Q5_K: `s_j` likewise for sub-block `j`; `acc = fma((d * sc_j) * d_a, s_j, acc)`, then
//!   `acc = fma(-(dmin * m_j), s_a, acc)` (`d * sc_j` and `dmin * m_j` are exact in f32).
//! - Q4_K / Q5_K against `ActSpan::Super` rows (one scale `d_a` per super-block, ggml's Q8_K):
//!   with `B_j` block `j`'s activation sum, per super-block `T = sum_j sc_j s_j` and
//!   `M = sum_j m_j B_j` exact in i32, then `acc = fma(d * d_a, T, acc)` and
//!   `acc = fma(-(dmin * d_a), M, acc)`: two float steps per super-block instead of sixteen (the
//!   integer-to-float conversions and fmas were a fifth of the kernel's time).
//! - Q6_K: per half of 16, `s` over the unsigned 6-bit quants and `A` the activations' sum
//!   (`BlockQ8::h`);
//!   `t = sc_a (s_a - 32 A_a) + sc_b (s_b - 32 A_b)` exact in i32; `acc = fma(d * d_a, t, acc)`.
//!
//! On AVX2 `maddubs` pairs never saturate (quants <= 63 against |a| <= 127: two pairs stay under
//! 32767 and are widened to i32 every two vectors; Q4_K's quants <= 15 stay in i16 for a whole
//! sub-block of eight vectors, at most 16 x 15 x 127 = 30480).

use crate::formats::{scale_min_k4, WeightFormat, QK, QK_K};
use crate::group::{interleave, GROUP_ROWS};
use crate::q8::{ActSpan, BlockQ8};
use half::f16;

/// Whether `format` is laid out and computed here (rather than in `packed/mod.rs`).
pub(crate) fn handles(format: WeightFormat) -> bool {
    matches!(format, WeightFormat::Q5_0 | WeightFormat::Q5_1 | WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K)
}

/// Whether `format` has a kernel for `ActSpan::Super` activation rows.
pub(crate) fn reads_super_span(format: WeightFormat) -> bool {
    matches!(format, WeightFormat::Q4K | WeightFormat::Q5K)
}

/// Offsets inside a group block.
mod off {
    /// Q5_0 / Q5_1: the rearranged fifth bits, then the quant vectors.
    pub const Q5_0_QH: usize = 16;
    pub const Q5_1_QH: usize = 32;
    /// Q4_K / Q5_K
    pub const K_DMIN: usize = 16;
    pub const K_SC: usize = 32;
    pub const K_MN: usize = 96;
    pub const Q4K_QS: usize = 160;
    pub const Q5K_QH: usize = 160;
    pub const Q5K_QS: usize = 416;
    /// Q6_K
    pub const Q6K_SC: usize = 16;
    pub const Q6K_QL: usize = 144;
    pub const Q6K_QH: usize = 1168;
}

/// Bytes of one group block of `format` (one of `handles`).
pub(crate) fn group_block_bytes(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Q5_0 => 176,
        WeightFormat::Q5_1 => 192,
        WeightFormat::Q4K => 1184,
        WeightFormat::Q5K => 1440,
        WeightFormat::Q6K => 1680,
        _ => unreachable!("{format:?} is not a packed_k format"),
    }
}

/// Writes row `lane`'s ggml block `src` into its share of the group block `dst`.
pub(crate) fn pack_block(format: WeightFormat, src: &[u8], lane: usize, dst: &mut [u8]) {
    assert_eq!(src.len(), format.block_bytes());
    assert_eq!(dst.len(), group_block_bytes(format));
    dst[2 * lane..2 * lane + 2].copy_from_slice(&src[0..2]);
    match format {
        WeightFormat::Q5_0 | WeightFormat::Q5_1 => {
            let (at, qh_off) = if format == WeightFormat::Q5_1 {
                dst[16 + 2 * lane..16 + 2 * lane + 2].copy_from_slice(&src[2..4]);
                (4, off::Q5_1_QH)
            } else {
                (2, off::Q5_0_QH)
            };
            let qh = u32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]]);
            let mut word = [0u8; 4];
            for (t, byte) in word.iter_mut().enumerate() {
                for v in 0..4 {
                    *byte |= (((qh >> (4 * v + t)) & 1) << v) as u8;
                    *byte |= (((qh >> (16 + 4 * v + t)) & 1) << (4 + v)) as u8;
                }
            }
            dst[qh_off + 4 * lane..qh_off + 4 * lane + 4].copy_from_slice(&word);
            interleave(&src[at + 4..at + 4 + QK / 2], lane, &mut dst[qh_off + 32..]);
        }
        WeightFormat::Q4K | WeightFormat::Q5K => {
            dst[off::K_DMIN + 2 * lane..off::K_DMIN + 2 * lane + 2].copy_from_slice(&src[2..4]);
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, &src[4..16]);
                dst[off::K_SC + 8 * j + lane] = sc;
                dst[off::K_MN + 8 * j + lane] = mn;
            }
            if format == WeightFormat::Q4K {
                interleave(&src[16..16 + QK_K / 2], lane, &mut dst[off::Q4K_QS..]);
            } else {
                interleave(&src[16..16 + QK_K / 8], lane, &mut dst[off::Q5K_QH..off::Q5K_QS]);
                interleave(&src[16 + QK_K / 8..16 + QK_K / 8 + QK_K / 2], lane, &mut dst[off::Q5K_QS..]);
            }
        }
        WeightFormat::Q6K => {
            // ggml: ql[128], qh[64], scales[16], d
            dst[2 * lane..2 * lane + 2].copy_from_slice(&src[208..210]);
            for s in 0..16 {
                dst[off::Q6K_SC + 8 * s + lane] = src[192 + s];
            }
            interleave(&src[0..128], lane, &mut dst[off::Q6K_QL..off::Q6K_QH]);
            interleave(&src[128..192], lane, &mut dst[off::Q6K_QH..]);
        }
        _ => unreachable!("{format:?} is not a packed_k format"),
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Scalar reference (the arithmetic of the module header): one activation row (`8 * blocks`
/// blocks of 32 for the k-quants, `blocks` for Q5_0 / Q5_1) against the eight rows of a group.
pub(crate) fn dot_group_scalar(format: WeightFormat, span: ActSpan, group: &[u8], blocks: usize, a: &[BlockQ8]) -> [f32; GROUP_ROWS] {
    let gbb = group_block_bytes(format);
    let mut acc = [0f32; GROUP_ROWS];
    for b in 0..blocks {
        let blk = &group[b * gbb..(b + 1) * gbb];
        for (lane, acc) in acc.iter_mut().enumerate() {
            let d = f16_at(blk, 2 * lane);
            let q = |u: usize, t: usize, base: usize| blk[base + 32 * u + 4 * lane + t];
            match format {
                WeightFormat::Q5_0 | WeightFormat::Q5_1 => {
                    let ab = &a[b];
                    let qh_off = if format == WeightFormat::Q5_1 { off::Q5_1_QH } else { off::Q5_0_QH };
                    let mut s = 0i32;
                    for v in 0..4 {
                        for t in 0..4 {
                            let x = q(v, t, qh_off + 32);
                            let hb = blk[qh_off + 4 * lane + t];
                            let lo = (x & 0xF) | (((hb >> v) & 1) << 4);
                            let hi = (x >> 4) | (((hb >> (4 + v)) & 1) << 4);
                            s += lo as i32 * ab.qs[4 * v + t] as i32 + hi as i32 * ab.qs[16 + 4 * v + t] as i32;
                        }
                    }
                    *acc = (d * ab.d).mul_add(s as f32, *acc);
                    let m = if format == WeightFormat::Q5_1 { f16_at(blk, 16 + 2 * lane) } else { d * -16.0 };
                    *acc = m.mul_add(ab.s, *acc);
                }
                WeightFormat::Q4K | WeightFormat::Q5K => {
                    let dmin = f16_at(blk, off::K_DMIN + 2 * lane);
                    let qs_off = if format == WeightFormat::Q4K { off::Q4K_QS } else { off::Q5K_QS };
                    // ActSpan::Super: one activation scale for the super-block's eight blocks
                    let d_a = a[8 * b].d;
                    let (mut t, mut m) = (0i32, 0i32);
                    for j in 0..8 {
                        let (c, high) = (j / 2, j % 2 == 1);
                        let ab = &a[8 * b + j];
                        debug_assert!(span == ActSpan::Block || ab.d.to_bits() == d_a.to_bits(), "super-span activations need one scale per super-block");
                        let mut s = 0i32;
                        for v in 0..8 {
                            for t in 0..4 {
                                let x = q(8 * c + v, t, qs_off);
                                let mut x = if high { x >> 4 } else { x & 0xF };
                                if format == WeightFormat::Q5K {
                                    x |= ((q(v, t, off::Q5K_QH) >> j) & 1) << 4;
                                }
                                s += x as i32 * ab.qs[4 * v + t] as i32;
                            }
                        }
                        if span == ActSpan::Block {
                            let dsc = d * blk[off::K_SC + 8 * j + lane] as f32;
                            let mn = dmin * blk[off::K_MN + 8 * j + lane] as f32;
                            *acc = (dsc * ab.d).mul_add(s as f32, *acc);
                            *acc = (-mn).mul_add(ab.s, *acc);
                        } else {
                            t += blk[off::K_SC + 8 * j + lane] as i32 * s;
                            m += blk[off::K_MN + 8 * j + lane] as i32 * (ab.h[0] as i32 + ab.h[1] as i32);
                        }
                    }
                    if span == ActSpan::Super {
                        *acc = (d * d_a).mul_add(t as f32, *acc);
                        *acc = (-(dmin * d_a)).mul_add(m as f32, *acc);
                    }
                }
                WeightFormat::Q6K => {
                    for h in 0..2 {
                        for i in 0..4 {
                            let ab = &a[8 * b + 4 * h + i];
                            let mut tot = 0i32;
                            for sub in 0..2 {
                                let (mut s, mut asum) = (0i32, 0i32);
                                for v in 4 * sub..4 * sub + 4 {
                                    for t in 0..4 {
                                        let l = q(16 * h + 8 * (i & 1) + v, t, off::Q6K_QL);
                                        let l = if i < 2 { l & 0xF } else { l >> 4 };
                                        let hb = (q(8 * h + v, t, off::Q6K_QH) >> (2 * i)) & 3;
                                        let x = l | (hb << 4);
                                        let av = ab.qs[4 * v + t] as i32;
                                        s += x as i32 * av;
                                        asum += av;
                                    }
                                }
                                let sc = blk[off::Q6K_SC + 8 * (8 * h + 2 * i + sub) + lane] as i8 as i32;
                                tot += sc * (s - 32 * asum);
                            }
                            *acc = (d * ab.d).mul_add(tot as f32, *acc);
                        }
                    }
                }
                _ => unreachable!("{format:?} is not a packed_k format"),
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
pub(crate) unsafe fn dot_group_to<const N: usize>(format: WeightFormat, span: ActSpan, group: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        if f.avx512_vnni {
            // SAFETY: AVX2, FMA, F16C and AVX-512 VNNI/VL were detected at run time; sizes and dst
            // as the caller promised.
            return x86::group_vnni::<N>(format, span, group, blocks, acts, dst);
        }
        if f.avx2_fma {
            // SAFETY: AVX2, FMA and F16C were detected at run time; sizes and dst as promised.
            return x86::group_avx2::<N>(format, span, group, blocks, acts, dst);
        }
    }
    for (a, d) in acts.iter().zip(dst) {
        let y = dot_group_scalar(format, span, group, blocks, a);
        // SAFETY: d is valid for eight writes (the caller's promise).
        std::ptr::copy_nonoverlapping(y.as_ptr(), d, GROUP_ROWS);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// Random ggml blocks of `format` (any quant bytes, any 6-bit scales, sane f16 scales): the test
/// matrices of this module and of the matmul tests.
#[cfg(test)]
pub(crate) fn random_raw(rng: &mut rand::rngs::StdRng, format: WeightFormat, rows: usize, cols: usize) -> Vec<u8> {
    use rand::Rng;
    let bb = format.block_bytes();
    let mut raw: Vec<u8> = (0..rows * format.row_bytes(cols)).map(|_| rng.gen()).collect();
    // byte offsets of the f16 fields, and whether they may be negative
    let fields: &[(usize, bool)] = match format {
        WeightFormat::Q5_0 => &[(0, true)],
        WeightFormat::Q5_1 => &[(0, false), (2, true)],
        WeightFormat::Q4K | WeightFormat::Q5K => &[(0, false), (2, false)],
        WeightFormat::Q6K => &[(208, true)],
        _ => unreachable!("{format:?} is not a packed_k format"),
    };
    for blk in raw.chunks_exact_mut(bb) {
        for &(at, signed) in fields {
            let mut v = rng.gen_range(0.001f32..0.05);
            if signed && rng.gen() {
                v = -v;
            }
            blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    raw
}
