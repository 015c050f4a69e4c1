//! A weight matrix as the kernels see it: a format, a shape and bytes that may live in a memory
//! map (the loader's) or in an owned buffer (tests, converted tensors).

use crate::{formats::WeightFormat, KernelError};
use std::sync::Arc;

/// Bytes of one tensor: a window into a shared owner (usually a memory-mapped file).
#[derive(Clone)]
pub struct WeightBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl WeightBytes {
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= (*owner).as_ref().len());
        Self { owner, start, len }
    }

    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self { owner: Arc::new(bytes), start: 0, len }
    }

    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.len)
    }
}

/// A row-major matrix of `rows` outputs by `cols` inputs; `y = W x` computes one output per row.
#[derive(Clone, Debug)]
pub struct QMatrix {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    bytes: WeightBytes,
}

impl QMatrix {
    pub fn new(format: WeightFormat, rows: usize, cols: usize, bytes: WeightBytes, what: &str) -> Result<Self, KernelError> {
        if cols % format.block_len() != 0 {
            return Err(KernelError::BlockMisaligned { what: what.to_string(), format, cols, block: format.block_len() });
        }
        let expected = rows * format.row_bytes(cols);
        if bytes.as_slice().len() != expected {
            return Err(KernelError::ByteLength { what: what.to_string(), expected, got: bytes.as_slice().len() });
        }
        Ok(Self { format, rows, cols, bytes })
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

    /// Dequantizes row `r` into `out` (length `cols`): embeddings lookups and reference paths.
    pub fn dequantize_row_into(&self, r: usize, out: &mut [f32]) {
        crate::formats::dequantize_row(self.format, self.row(r), out)
    }
}
