//! Activation quantization: each matmul input row is quantized once to 8-bit blocks of 32
//! (scale `d`, and `s = d * sum(q)` for the offset term of Q4_1 / Q4_0), like ggml's Q8_1.
//! The rounding is fixed per element, so a row's quantization never depends on its batch.

use crate::formats::QK;

#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(8))]
pub struct BlockQ8 {
    pub d: f32,
    /// d * sum(qs)
    pub s: f32,
    pub qs: [i8; QK],
}

/// A batch of quantized activation rows, `blocks_per_row` blocks each.
#[derive(Clone, Debug, Default)]
pub struct QuantizedActivations {
    pub blocks: Vec<BlockQ8>,
    pub rows: usize,
    pub blocks_per_row: usize,
}

impl QuantizedActivations {
    #[inline]
    pub fn row(&self, r: usize) -> &[BlockQ8] {
        &self.blocks[r * self.blocks_per_row..(r + 1) * self.blocks_per_row]
    }
}

/// Quantizes `rows` rows of `cols` (a multiple of 32) f32 values.
pub fn quantize_rows(x: &[f32], cols: usize) -> QuantizedActivations {
    assert!(cols % QK == 0, "activation width {cols} is not a multiple of {QK}");
    let rows = x.len() / cols;
    let bpr = cols / QK;
    let mut blocks = vec![BlockQ8::default(); rows * bpr];
    for (b, xs) in blocks.iter_mut().zip(x.chunks_exact(QK)) {
        quantize_block(xs, b);
    }
    QuantizedActivations { blocks, rows, blocks_per_row: bpr }
}

#[inline]
fn quantize_block(xs: &[f32], b: &mut BlockQ8) {
    let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in b.qs.iter_mut().zip(xs) {
        let r = (v * id).round() as i32;
        *q = r as i8;
        sum += r;
    }
    b.d = d;
    b.s = d * sum as f32;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_block_reconstructs_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let q = quantize_rows(&x, 64);
        assert_eq!((q.rows, q.blocks_per_row), (1, 2));
        for (bi, b) in q.row(0).iter().enumerate() {
            let mut sum = 0i32;
            for j in 0..QK {
                let v = x[bi * QK + j];
                assert!((b.d * b.qs[j] as f32 - v).abs() <= b.d * 0.5 + 1e-6);
                sum += b.qs[j] as i32;
            }
            assert_eq!(b.s, b.d * sum as f32);
        }
    }

    #[test]
    fn zero_block_has_zero_scale() {
        let q = quantize_rows(&[0.0; 32], 32);
        assert_eq!(q.blocks[0].d, 0.0);
        assert!(q.blocks[0].qs.iter().all(|&v| v == 0));
    }
}
