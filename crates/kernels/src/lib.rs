//! specula-kernels: the CPU hot loops of the engine — quantized matrix multiplication, paged
//! attention, RMSNorm, RoPE, SiLU-mul, softmax. Knows nothing of requests or models.
//!
//! Every SIMD kernel has a scalar reference beside it and a test comparing the two. Every kernel
//! reduces each output element in a fixed order that does not depend on the batch size or the
//! thread count, which is what makes the engine batch-invariant.

pub mod attention;
pub mod bandwidth;
pub mod buffer;
pub mod cpu;
pub mod delta_net;
pub mod dot;
pub mod exp;
pub mod formats;
pub mod group;
pub mod kv;
pub mod logits;
pub mod matmul;
pub mod ops;
pub mod packed;
pub mod peak;
pub mod pool;
pub mod q8;
pub mod weights;

pub use formats::WeightFormat;
pub use matmul::{matmul, matmul_grouped, matmul_many};
pub use q8::{quantize_rows, quantize_rows_super, ActSpan, BlockQ8, QuantizedActivations, SUPER_SPAN};
pub use weights::{QMatrix, WeightBytes};

/// Errors raised when weights or shapes handed to a kernel do not fit.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{what}: expected {expected} bytes, got {got}")]
    ByteLength { what: String, expected: usize, got: usize },
    #[error("{what}: {cols} columns is not a multiple of the {format:?} block size {block}")]
    BlockMisaligned { what: String, format: WeightFormat, cols: usize, block: usize },
}
