//! Test support shared by the integer-kernel tests (`packed::k_tests`, `packed::iq`'s tests): the
//! random values, matrix shapes, activation rows and group slices every format's test needs.

use crate::formats::{WeightFormat, QK};
use crate::packed::PackedInt8;
use crate::q8::QuantizedActivations;
use rand::Rng;

pub(crate) fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

/// Odd row counts (a partial last group) and odd numbers of blocks.
pub(crate) fn shapes(f: WeightFormat) -> [(usize, usize); 4] {
    let k = f.block_len();
    [(3, k), (8, k), (13, 3 * k), (21, if k == QK { 576 } else { 1536 })]
}

/// Activation rows, each `quantize`d: random, and one at the ends of i8 (every element +-127
/// after quantization).
pub(crate) fn activation_rows(rng: &mut rand::rngs::StdRng, cols: usize, quantize: impl Fn(&[f32]) -> QuantizedActivations) -> Vec<QuantizedActivations> {
    let mut acts: Vec<_> = (0..4).map(|_| quantize(&rand_vec(rng, cols))).collect();
    acts.push(quantize(&(0..cols).map(|i| if i % 3 == 0 { -1.0 } else { 1.0 }).collect::<Vec<f32>>()));
    acts
}

/// Group `g`'s bytes of a packed matrix of `cols` columns whose group blocks take
/// `group_block_bytes` each, and its number of blocks.
pub(crate) fn group_bytes(p: &PackedInt8, g: usize, f: WeightFormat, cols: usize, group_block_bytes: usize) -> (&[u8], usize) {
    let blocks = cols / f.block_len();
    let len = blocks * group_block_bytes;
    (&p.bytes_for_tests()[g * len..(g + 1) * len], blocks)
}
