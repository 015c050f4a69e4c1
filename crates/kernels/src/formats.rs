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
}

pub const QK: usize = 32;
pub const QK_K: usize = 256;

impl WeightFormat {
    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 | Self::Q5_0 | Self::Q5_1 => QK,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
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
        }
    }

    /// Bytes for one row of `cols` elements (`cols` must be a multiple of the block length).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_len() * self.block_bytes()
    }

    /// Whether the integer-dot fast path (activations quantized to 8-bit blocks of 32) applies.
    pub fn has_int8_dot(self) -> bool {
        matches!(self, Self::Q4_0 | Self::Q4_1 | Self::Q8_0 | Self::Q5_0 | Self::Q5_1 | Self::Q4K | Self::Q5K | Self::Q6K)
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
        }
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one row (`row.len() == format.row_bytes(out.len())`) into `out`.
pub fn dequantize_row(format: WeightFormat, row: &[u8], out: &mut [f32]) {
    debug_assert_eq!(row.len(), format.row_bytes(out.len()));
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
        WeightFormat::Q5_0 | WeightFormat::Q5_1 | WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K => {
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
