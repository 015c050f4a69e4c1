//! The group every packed weight layout shares (`packed`, `packed_k`, `packed_float`): eight
//! consecutive rows side by side, one per f32 lane of a 256-bit vector. Its own module so that
//! `packed_k` (the k-quant and 5-bit kernels) need not import `packed`, which dispatches to it.

/// Rows per group: the lanes of one 256-bit vector of f32.
pub const GROUP_ROWS: usize = 8;
