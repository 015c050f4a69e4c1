//! A weight matrix as the kernels see it: a format, a shape and bytes that may live in a memory
//! map (the loader's) or in an owned buffer (tests, converted tensors).

// the matrix's bytes; the crate root re-exports them from here (`specula_kernels::WeightBytes`)
pub use crate::buffer::WeightBytes;
use crate::{formats::WeightFormat, packed::float::PackedFloat, packed::PackedInt8, KernelError};
use std::sync::Arc;

/// A row-major matrix of `rows` outputs by `cols` inputs; `y = W x` computes one output per row.
#[derive(Clone, Debug)]
pub struct QMatrix {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    bytes: WeightBytes,
    /// The matrix repacked eight rows at a time for the matmul kernels (the bytes above stay for
    /// row lookups such as embeddings); `None` for formats the kernels dequantize row by row.
    packed: Option<Packed>,
}

/// The repacked form of a matrix, by kind of kernel.
#[derive(Clone, Debug)]
pub enum Packed {
    /// Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q2_K-Q6_K / IQ4_NL / IQ4_XS / MXFP4: integer dot products against
    /// 8-bit activations (never dequantized to float at load).
    Int8(Arc<PackedInt8>),
    /// F16 / BF16 / F32: float FMAs.
    Float(Arc<PackedFloat>),
}

impl QMatrix {
    /// The matrix over `bytes`, repacked for the kernels (a copy in this process's memory).
    pub fn new(format: WeightFormat, rows: usize, cols: usize, bytes: WeightBytes, what: &str) -> Result<Self, KernelError> {
        Self::build(format, rows, cols, bytes, what, false)
    }

    /// The matrix over `bytes` read where they lie (a memory-mapped file's pages, no copy): the
    /// int8 kernels repack each group of eight rows as they read it (`PackedInt8::in_place`),
    /// with the same results. Formats without an int8 path are repacked as by `new`.
    pub fn new_in_place(format: WeightFormat, rows: usize, cols: usize, bytes: WeightBytes, what: &str) -> Result<Self, KernelError> {
        Self::build(format, rows, cols, bytes, what, true)
    }

    fn build(format: WeightFormat, rows: usize, cols: usize, bytes: WeightBytes, what: &str, in_place: bool) -> Result<Self, KernelError> {
        if !cols.is_multiple_of(format.block_len()) {
            return Err(KernelError::BlockMisaligned { what: what.to_string(), format, cols, block: format.block_len() });
        }
        let expected = rows * format.row_bytes(cols);
        if bytes.as_slice().len() != expected {
            return Err(KernelError::ByteLength { what: what.to_string(), expected, got: bytes.as_slice().len() });
        }
        let raw = bytes.as_slice();
        let int8 = match in_place {
            true => PackedInt8::in_place(format, rows, cols, bytes.clone()),
            false => PackedInt8::pack(format, rows, cols, raw),
        };
        let packed = int8.map(|p| Packed::Int8(Arc::new(p))).or_else(|| PackedFloat::pack(format, rows, cols, raw).map(|p| Packed::Float(Arc::new(p))));
        Ok(Self { format, rows, cols, bytes, packed })
    }

    /// Whether the kernels read this matrix in place (`new_in_place` of an int8 format).
    pub fn is_in_place(&self) -> bool {
        matches!(&self.packed, Some(Packed::Int8(p)) if p.is_in_place())
    }

    /// The repacked form the matmul kernels read, if the format has one.
    #[inline]
    pub fn packed(&self) -> Option<&Packed> {
        self.packed.as_ref()
    }

    #[inline]
    pub fn row_bytes(&self) -> usize {
        self.format.row_bytes(self.cols)
    }

    #[inline]
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes.as_slice()[r * rb..(r + 1) * rb]
    }

    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// A new matrix of these rows of this one, in this order (each row's bytes copied, then
    /// repacked): a draft model's output projection pruned to the tokens it may propose.
    pub fn select_rows(&self, rows: &[usize], what: &str) -> Result<Self, KernelError> {
        let rb = self.row_bytes();
        let mut bytes = Vec::with_capacity(rows.len() * rb);
        for &r in rows {
            if r >= self.rows {
                return Err(KernelError::ByteLength { what: format!("{what}: row {r} of {}", self.rows), expected: self.rows, got: r });
            }
            bytes.extend_from_slice(self.row(r));
        }
        Self::new(self.format, rows.len(), self.cols, WeightBytes::owned(bytes), what)
    }

    /// This matrix re-encoded as `format` (each row dequantized, then quantized round-to-nearest
    /// by `formats::quantize_row`, rows in parallel): a draft model made smaller than its file.
    /// `format` must be one `quantize_row` writes, and `cols` a multiple of its block.
    pub fn requantize(&self, format: WeightFormat, what: &str) -> Result<Self, KernelError> {
        use rayon::prelude::*;
        let rows: Vec<Vec<u8>> = (0..self.rows)
            .into_par_iter()
            .map(|r| {
                let mut x = vec![0f32; self.cols];
                self.dequantize_row_into(r, &mut x);
                crate::formats::quantize_row(format, &x)
            })
            .collect();
        Self::new(format, self.rows, self.cols, WeightBytes::owned(rows.concat()), what)
    }

    /// Dequantizes row `r` into `out` (length `cols`): embeddings lookups and reference paths.
    pub fn dequantize_row_into(&self, r: usize, out: &mut [f32]) {
        crate::formats::dequantize_row(self.format, self.row(r), out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{dequantize_row, quantize_row, QK};
    use rand::{Rng, SeedableRng};

    /// A Q8_0 matrix re-encoded as Q4_0: the format and shape change, every value lands within
    /// one Q4_0 step of its block (ggml's round-to-nearest; the value opposite the block's
    /// largest magnitude may clamp by up to a whole step), and the matmul reads the new bytes.
    #[test]
    fn requantize_stays_within_a_step_of_the_original() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (rows, cols) = (19, 96);
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let raw: Vec<u8> = x.chunks_exact(cols).flat_map(|r| quantize_row(WeightFormat::Q8_0, r)).collect();
        let m = QMatrix::new(WeightFormat::Q8_0, rows, cols, WeightBytes::owned(raw), "test").unwrap();
        let q = m.requantize(WeightFormat::Q4_0, "test q4_0").unwrap();
        assert_eq!((q.format, q.rows, q.cols), (WeightFormat::Q4_0, rows, cols));
        assert_eq!(q.bytes().len(), rows * WeightFormat::Q4_0.row_bytes(cols));
        let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..rows {
            m.dequantize_row_into(r, &mut a);
            dequantize_row(WeightFormat::Q4_0, q.row(r), &mut b);
            for (ab, bb) in a.chunks_exact(QK).zip(b.chunks_exact(QK)) {
                let step = ab.iter().fold(0f32, |s, v| s.max(v.abs())) / 8.0;
                for (u, v) in ab.iter().zip(bb) {
                    assert!((u - v).abs() <= step * 1.01, "row {r}: {u} vs {v} (step {step})");
                }
            }
        }
    }
}
