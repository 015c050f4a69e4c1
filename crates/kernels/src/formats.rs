//! Weight storage formats as laid out in GGUF files (ggml block layouts), with byte sizes and
//! scalar dequantization of one row. Dequantization is the reference for every fast path.

use half::{bf16, f16};

/// The tensor types specula can compute with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
    Q2K,
    Q3K,
    IQ4NL,
    IQ4XS,
    MXFP4,
}

/// IQ4_NL / IQ4_XS code points (ggml's `kvalues_iq4nl`): the 4-bit codes index these int8 values.
pub const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];
/// MXFP4's FP4 (e2m1) values doubled to integers (ggml's `kvalues_mxfp4`); the block scale is
/// halved to match (`e8m0_to_f32_half`).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the value of an E8M0 scale (`2^(e - 128)`), exactly as ggml's `ggml_e8m0_to_fp32_half`
/// (subnormal for `e < 2`).
#[inline]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e as u32) - 1) << 23 };
    f32::from_bits(bits)
}

/// The 16 signed 6-bit scales of a Q3_K block (`scales[12]`), minus 32 (ggml's `aux` unpacking):
/// scale `k` has its low nibble in byte `k % 8` (low half for `k < 8`) and its top two bits at
/// bits `2 (k / 4)` of byte `8 + k % 4`.
pub(crate) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    std::array::from_fn(|k| {
        let lo = (s[k % 8] >> (4 * (k / 8))) & 0xF;
        let hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        (lo | (hi << 4)) as i8 - 32
    })
}

/// The eight signed 6-bit scales of an IQ4_XS block (`scales_h` u16, `scales_l[4]`), minus 32.
pub(crate) fn iq4xs_scales(scales_h: u16, scales_l: &[u8]) -> [i8; 8] {
    std::array::from_fn(|ib| {
        let lo = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
        let hi = ((scales_h >> (2 * ib)) & 3) as u8;
        (lo | (hi << 4)) as i8 - 32
    })
}

pub const QK: usize = 32;
pub const QK_K: usize = 256;

impl WeightFormat {
    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 | Self::Q5_0 | Self::Q5_1 | Self::IQ4NL | Self::MXFP4 => QK,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q2K | Self::Q3K | Self::IQ4XS => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 2 + QK / 2,
            Self::Q4_1 => 4 + QK / 2,
            Self::Q8_0 => 2 + QK,
            Self::Q5_0 => 2 + 4 + QK / 2,
            Self::Q5_1 => 4 + 4 + QK / 2,
            Self::Q4K => 4 + 12 + QK_K / 2,
            Self::Q5K => 4 + 12 + QK_K / 8 + QK_K / 2,
            Self::Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            // scales[16], qs[64], d, dmin
            Self::Q2K => QK_K / 16 + QK_K / 4 + 4,
            // hmask[32], qs[64], scales[12], d
            Self::Q3K => QK_K / 8 + QK_K / 4 + 12 + 2,
            Self::IQ4NL => 2 + QK / 2,
            // d, scales_h, scales_l[4], qs[128]
            Self::IQ4XS => 2 + 2 + QK_K / 64 + QK_K / 2,
            // e (E8M0), qs[16]
            Self::MXFP4 => 1 + QK / 2,
        }
    }

    /// Bytes for one row of `cols` elements (`cols` must be a multiple of the block length).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_len() * self.block_bytes()
    }

    /// Whether the integer-dot fast path (activations quantized to 8-bit blocks of 32) applies.
    pub fn has_int8_dot(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }

    /// The ggml type name (as gguf files and llama.cpp print it).
    pub fn ggml_name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::IQ4NL => "IQ4_NL",
            Self::IQ4XS => "IQ4_XS",
            Self::MXFP4 => "MXFP4",
        }
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one row (`row.len() == format.row_bytes(out.len())`) into `out`.
pub fn dequantize_row(format: WeightFormat, row: &[u8], out: &mut [f32]) {
    assert_eq!(row.len(), format.row_bytes(out.len()));
    let bb = format.block_bytes();
    match format {
        WeightFormat::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WeightFormat::F16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        WeightFormat::BF16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        WeightFormat::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                for j in 0..QK / 2 {
                    let q = b[2 + j];
                    o[j] = d * ((q & 0xF) as i32 - 8) as f32;
                    o[j + QK / 2] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        WeightFormat::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..QK / 2 {
                    let q = b[4 + j];
                    o[j] = d * (q & 0xF) as f32 + m;
                    o[j + QK / 2] = d * (q >> 4) as f32 + m;
                }
            }
        }
        WeightFormat::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    o[j] = d * (b[2 + j] as i8) as f32;
                }
            }
        }
        WeightFormat::Q5_0 | WeightFormat::Q5_1 => {
            // ggml: element j's fifth bit is bit j of qh, element j + 16's bit j + 16
            let q5_1 = format == WeightFormat::Q5_1;
            let at = if q5_1 { 4 } else { 2 };
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let qs = &b[at + 4..at + 4 + QK / 2];
                for j in 0..QK / 2 {
                    let q0 = (qs[j] & 0xF) as i32 | (((qh >> j) & 1) << 4) as i32;
                    let q1 = (qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
                    if q5_1 {
                        let m = f16_at(b, 2);
                        o[j] = d * q0 as f32 + m;
                        o[j + QK / 2] = d * q1 as f32 + m;
                    } else {
                        o[j] = d * (q0 - 16) as f32;
                        o[j + QK / 2] = d * (q1 - 16) as f32;
                    }
                }
            }
        }
        // Q5_K is Q4_K plus a fifth bit per weight (`qh`, bit 2j / 2j+1 of byte l for sub-block
        // pair j); one loop serves both
        WeightFormat::Q4K | WeightFormat::Q5K => {
            let five = format == WeightFormat::Q5K;
            for (o, b) in out.chunks_exact_mut(QK_K).zip(row.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let dmin = f16_at(b, 2);
                let scales = &b[4..16];
                let (qh, qs) = if five { (&b[16..16 + QK_K / 8], &b[16 + QK_K / 8..16 + QK_K / 8 + QK_K / 2]) } else { (&b[0..0], &b[16..16 + QK_K / 2]) };
                for chunk in 0..4 {
                    let (sc1, m1) = scale_min_k4(2 * chunk, scales);
                    let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
                    let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                    let q = &qs[chunk * 32..chunk * 32 + 32];
                    let y = &mut o[chunk * 64..chunk * 64 + 64];
                    for l in 0..32 {
                        let (h1, h2) = if five { (((qh[l] >> (2 * chunk)) & 1) << 4, ((qh[l] >> (2 * chunk + 1)) & 1) << 4) } else { (0, 0) };
                        y[l] = d1 * ((q[l] & 0xF) | h1) as f32 - mm1;
                        y[l + 32] = d2 * ((q[l] >> 4) | h2) as f32 - mm2;
                    }
                }
            }
        }
        WeightFormat::Q6K => {
            for (o, b) in out.chunks_exact_mut(QK_K).zip(row.chunks_exact(bb)) {
                let ql_all = &b[0..QK_K / 2];
                let qh_all = &b[QK_K / 2..QK_K / 2 + QK_K / 4];
                let sc_all = &b[QK_K / 2 + QK_K / 4..QK_K / 2 + QK_K / 4 + QK_K / 16];
                let d = f16_at(b, QK_K / 2 + QK_K / 4 + QK_K / 16);
                for half in 0..2 {
                    let ql = &ql_all[half * 64..];
                    let qh = &qh_all[half * 32..];
                    let sc = &sc_all[half * 8..];
                    let y = &mut o[half * 128..half * 128 + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
        // element 128n + 32j + l: bits 2j of qs[32n + l], scale / min byte 8n + 2j + l / 16
        WeightFormat::Q2K => {
            for (o, b) in out.chunks_exact_mut(QK_K).zip(row.chunks_exact(bb)) {
                let (sc, qs) = (&b[0..16], &b[16..80]);
                let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
                for (e, y) in o.iter_mut().enumerate() {
                    let (n, j, l) = (e / 128, (e / 32) % 4, e % 32);
                    let s = sc[8 * n + 2 * j + l / 16];
                    let q = (qs[32 * n + l] >> (2 * j)) & 3;
                    *y = (d * (s & 0xF) as f32) * q as f32 - dmin * (s >> 4) as f32;
                }
            }
        }
        // element 128n + 32j + l: bits 2j of qs[32n + l], minus 4 unless bit 4n + j of hmask[l]
        WeightFormat::Q3K => {
            for (o, b) in out.chunks_exact_mut(QK_K).zip(row.chunks_exact(bb)) {
                let (hm, qs) = (&b[0..32], &b[32..96]);
                let sc = q3k_scales(&b[96..108]);
                let d = f16_at(b, 108);
                for (e, y) in o.iter_mut().enumerate() {
                    let (n, j, l) = (e / 128, (e / 32) % 4, e % 32);
                    let low = ((qs[32 * n + l] >> (2 * j)) & 3) as i32;
                    let high = ((hm[l] >> (4 * n + j)) & 1) as i32;
                    *y = (d * sc[e / 16] as f32) * (low - 4 * (1 - high)) as f32;
                }
            }
        }
        WeightFormat::IQ4NL | WeightFormat::MXFP4 => {
            let (table, at) = if format == WeightFormat::IQ4NL { (&KVALUES_IQ4NL, 2) } else { (&KVALUES_MXFP4, 1) };
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(bb)) {
                let d = if format == WeightFormat::IQ4NL { f16_at(b, 0) } else { e8m0_to_f32_half(b[0]) };
                for j in 0..QK / 2 {
                    o[j] = d * table[(b[at + j] & 0xF) as usize] as f32;
                    o[j + QK / 2] = d * table[(b[at + j] >> 4) as usize] as f32;
                }
            }
        }
        WeightFormat::IQ4XS => {
            for (o, b) in out.chunks_exact_mut(QK_K).zip(row.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let sc = iq4xs_scales(u16::from_le_bytes([b[2], b[3]]), &b[4..8]);
                for (ib, (y, qs)) in o.chunks_exact_mut(QK).zip(b[8..].chunks_exact(QK / 2)).enumerate() {
                    let dl = d * sc[ib] as f32;
                    for j in 0..QK / 2 {
                        y[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
                        y[j + QK / 2] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
                    }
                }
            }
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K / Q5_K block (ggml's `get_scale_min_k4`).
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Quantizes `x` (length a multiple of 32) to Q8_0 or Q4_1 bytes, round-to-nearest like ggml's
/// reference quantizers. Used to build test models and the tests of the fast paths.
pub fn quantize_row(format: WeightFormat, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(format.row_bytes(x.len()));
    match format {
        WeightFormat::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        WeightFormat::F16 => x.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        WeightFormat::BF16 => x.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        WeightFormat::Q8_0 => {
            for b in x.chunks_exact(QK) {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|v| ((v * id).round() as i8) as u8));
            }
        }
        WeightFormat::Q4_0 => {
            for b in x.chunks_exact(QK) {
                let mut max = 0f32;
                for &v in b {
                    if v.abs() > max.abs() {
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                for j in 0..QK / 2 {
                    let q0 = ((b[j] * id + 8.5) as i32).clamp(0, 15) as u8;
                    let q1 = ((b[j + QK / 2] * id + 8.5) as i32).clamp(0, 15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        WeightFormat::Q4_1 => {
            for b in x.chunks_exact(QK) {
                let min = b.iter().cloned().fold(f32::INFINITY, f32::min);
                let max = b.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                for j in 0..QK / 2 {
                    let q0 = (((b[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    let q1 = (((b[j + QK / 2] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q4K
        | WeightFormat::Q5K
        | WeightFormat::Q6K
        | WeightFormat::Q2K
        | WeightFormat::Q3K
        | WeightFormat::IQ4NL
        | WeightFormat::IQ4XS
        | WeightFormat::MXFP4 => {
            unreachable!("{format:?} quantization is not needed by specula (only dequantization)")
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(WeightFormat::Q4_0.block_bytes(), 18);
        assert_eq!(WeightFormat::Q4_1.block_bytes(), 20);
        assert_eq!(WeightFormat::Q8_0.block_bytes(), 34);
        assert_eq!(WeightFormat::Q4K.block_bytes(), 144);
        assert_eq!(WeightFormat::Q6K.block_bytes(), 210);
        assert_eq!(WeightFormat::Q5_0.block_bytes(), 22);
        assert_eq!(WeightFormat::Q5_1.block_bytes(), 24);
        assert_eq!(WeightFormat::Q5K.block_bytes(), 176);
        assert_eq!(WeightFormat::Q4_1.row_bytes(576), 18 * 20);
        // ggml-common.h: block_q2_K 84, block_q3_K 110, block_iq4_nl 18, block_iq4_xs 136, block_mxfp4 17
        assert_eq!(WeightFormat::Q2K.block_bytes(), 84);
        assert_eq!(WeightFormat::Q3K.block_bytes(), 110);
        assert_eq!(WeightFormat::IQ4NL.block_bytes(), 18);
        assert_eq!(WeightFormat::IQ4XS.block_bytes(), 136);
        assert_eq!(WeightFormat::MXFP4.block_bytes(), 17);
        assert_eq!(WeightFormat::IQ4XS.row_bytes(512), 272);
    }

    /// ggml_e8m0_to_fp32_half: 2^(e - 128), subnormal below e = 2, no NaN at 255.
    #[test]
    fn e8m0_half_scales_are_powers_of_two() {
        assert_eq!(e8m0_to_f32_half(128), 1.0);
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(130), 4.0);
        assert_eq!(e8m0_to_f32_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_to_f32_half(255), 2f32.powi(127));
    }

    /// Q3_K's 6-bit scales: the layout drawn in gguf-py (bytes 0-7 low nibbles of scales 0-7 then
    /// 8-15, bytes 8-11 two top bits each of scales k, k + 4, k + 8, k + 12).
    #[test]
    fn q3k_scale_unpacking_matches_ggml_layout() {
        let mut s = [0u8; 12];
        s[2] = 0x5A; // scale 2 low nibble 0xA, scale 10 low nibble 0x5
        s[10] = 0b1001_0011; // scale 2 top bits 3, scale 6: 0, scale 10: 1, scale 14: 2
        let sc = q3k_scales(&s);
        assert_eq!(sc[2], (0xA | (3 << 4)) - 32);
        assert_eq!(sc[10], (0x5 | (1 << 4)) - 32);
        assert_eq!(sc[14], (2 << 4) - 32);
        assert_eq!(sc[6], -32);
    }

    #[test]
    fn quantize_dequantize_round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13).collect();
        for f in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0, WeightFormat::F16, WeightFormat::BF16] {
            let q = quantize_row(f, &x);
            assert_eq!(q.len(), f.row_bytes(x.len()));
            let mut y = vec![0f32; x.len()];
            dequantize_row(f, &q, &mut y);
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let step = match f {
                WeightFormat::Q8_0 => amax / 127.0,
                // the range is [-8d, 7d]: a value of +amax when the extreme is -amax clips a full step
                WeightFormat::Q4_0 => 2.0 * amax / 8.0,
                WeightFormat::Q4_1 => 2.0 * amax / 15.0,
                _ => amax / 128.0,
            };
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= step * 0.51 + 1e-3, "{f:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn q4k_scale_min_unpacking_matches_ggml_layout() {
        // j < 4: low 6 bits of bytes j and j+4.
        let mut s = [0u8; 12];
        s[1] = 0b1100_0101; // scale 5 for j=1, top bits feed j=5's scale
        s[5] = 0b0100_0011; // min 3 for j=1, top bit feeds j=5's min
        s[9] = 0b0111_1010; // j=5: scale low nibble 0xA, min low nibble 0x7
        assert_eq!(scale_min_k4(1, &s), (5, 3));
        assert_eq!(scale_min_k4(5, &s), (0xA | (3 << 4), 0x7 | (1 << 4)));
    }
}
