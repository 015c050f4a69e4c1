//! The group every packed weight layout shares (`packed`, `packed::k`, `packed::float`): eight
//! consecutive rows side by side, one per f32 lane of a 256-bit vector. Its own module so that
//! `packed::k` (the k-quant and 5-bit kernels) need not import `packed`, which dispatches to it.

/// Rows per group: the lanes of one 256-bit vector of f32.
pub const GROUP_ROWS: usize = 8;

/// Copies `src` four bytes at a time into lane `lane` of consecutive 32-byte vectors starting at
/// `dst[0]`: how one row's quants are laid beside its group's other seven (`packed::k`, `packed::iq`).
pub(crate) fn interleave(src: &[u8], lane: usize, dst: &mut [u8]) {
    for (u, chunk) in src.chunks_exact(4).enumerate() {
        dst[u * 32 + lane * 4..u * 32 + lane * 4 + 4].copy_from_slice(chunk);
    }
}
