//! Float weights (F16, BF16, F32) repacked eight rows at a time for the matmul: column `c` of a
//! group is the eight rows' weights side by side (F16 stays F16, 16 bytes; BF16 and F32 become
//! F32, 32 bytes), so one conversion (`vcvtph2ps`), one broadcast of the activation and one FMA
//! advance eight output rows, and each converted column serves up to four activation rows. The
//! row-by-row path it replaces dequantized every row on every call (the mtp head is F16).
//!
//! Arithmetic (the same on every path): `acc[r] = fma(w[r][c], x[c], acc[r])` for `c` in order,
//! so a row's result never depends on the batch or the thread split.

use crate::formats::{dequantize_row, WeightFormat};
use half::f16;

pub use crate::group::GROUP_ROWS;
/// Activation rows per kernel call the matmul uses (accumulators for more would not fit AVX2's
/// 16 registers beside the weights).
pub const MAX_ACTS: usize = 4;

/// Groups one call reads side by side for `n` activation rows (see `dot_groups_to`): with one
/// activation row a group's eight sums form a single chain of dependent FMAs, so one group at a
/// time runs at the FMA's latency, not its throughput (a quarter of it); four groups' chains
/// interleave. Each row's arithmetic is unchanged.
pub const fn groups_side_by_side(n: usize) -> usize {
    match n {
        1 => 4,
        2 | 3 => 2,
        _ => 1,
    }
}

#[derive(Clone, Debug)]
enum Data {
    F16(Vec<u16>),
    F32(Vec<f32>),
}

#[derive(Clone, Debug)]
pub struct PackedFloat {
    rows: usize,
    cols: usize,
    data: Data,
}

impl PackedFloat {
    /// Repacks a float matrix; `None` for other formats.
    pub fn pack(format: WeightFormat, rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        let groups = rows.div_ceil(GROUP_ROWS);
        let row_bytes = format.row_bytes(cols);
        match format {
            WeightFormat::F16 => {
                let mut v = vec![0u16; groups * cols * GROUP_ROWS];
                for r in 0..rows {
                    let src = &raw[r * row_bytes..(r + 1) * row_bytes];
                    let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
                    for (c, b) in src.chunks_exact(2).enumerate() {
                        v[(g * cols + c) * GROUP_ROWS + lane] = u16::from_le_bytes([b[0], b[1]]);
                    }
                }
                Some(Self { rows, cols, data: Data::F16(v) })
            }
            WeightFormat::F32 | WeightFormat::BF16 => {
                let mut v = vec![0f32; groups * cols * GROUP_ROWS];
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    dequantize_row(format, &raw[r * row_bytes..(r + 1) * row_bytes], &mut row);
                    let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
                    for (c, &x) in row.iter().enumerate() {
                        v[(g * cols + c) * GROUP_ROWS + lane] = x;
                    }
                }
                Some(Self { rows, cols, data: Data::F32(v) })
            }
            _ => None,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows `8g..8g + 8` against `N` activation rows of `cols` floats, written at `dst[n]`.
    ///
    /// # Safety
    /// Every `dst[n]` must be valid for writes of eight `f32` that no other thread accesses.
    pub unsafe fn dot_group_to<const N: usize>(&self, g: usize, xs: [&[f32]; N], dst: [*mut f32; N]) {
        self.dot_groups_to::<1, N>(g, xs, [dst])
    }

    /// Groups `g0..g0 + G` (rows `8 g0..8 (g0 + G)`, all inside the packed matrix) against `N`
    /// activation rows; group `j`'s results for activation `n` are written at `dst[j][n]`. Each
    /// group's results are exactly `dot_group_to`'s: the groups only share the loop over columns.
    ///
    /// # Safety
    /// Every `dst[j][n]` must be valid for writes of eight `f32` that no other thread accesses.
    pub unsafe fn dot_groups_to<const G: usize, const N: usize>(&self, g0: usize, xs: [&[f32]; N], dst: [[*mut f32; N]; G]) {
        let cols = self.cols;
        for x in &xs {
            assert_eq!(x.len(), cols, "activation row has the wrong width");
        }
        let span = g0 * cols * GROUP_ROWS..(g0 + G) * cols * GROUP_ROWS;
        #[cfg(target_arch = "x86_64")]
        {
            if crate::cpu::features().avx2_fma {
                // SAFETY: AVX2, FMA and F16C were detected at run time; the span holds G groups
                // of cols columns of eight weights (indexing checks it) and every activation
                // row cols floats; dst as promised.
                match &self.data {
                    Data::F16(v) => return x86::group_f16::<G, N>(&v[span], cols, xs, dst),
                    Data::F32(v) => return x86::group_f32::<G, N>(&v[span], cols, xs, dst),
                }
            }
        }
        for (j, dj) in dst.iter().enumerate() {
            let start = span.start + j * cols * GROUP_ROWS;
            for (x, &d) in xs.iter().zip(dj) {
                let mut acc = [0f32; GROUP_ROWS];
                for (c, &xc) in x.iter().enumerate() {
                    for (lane, a) in acc.iter_mut().enumerate() {
                        let i = start + c * GROUP_ROWS + lane;
                        let w = match &self.data {
                            Data::F16(v) => f16::from_bits(v[i]).to_f32(),
                            Data::F32(v) => v[i],
                        };
                        *a = w.mul_add(xc, *a);
                    }
                }
                std::ptr::copy_nonoverlapping(acc.as_ptr(), d, GROUP_ROWS);
            }
        }
    }

    pub fn dot_group<const N: usize>(&self, g: usize, xs: [&[f32]; N]) -> [[f32; GROUP_ROWS]; N] {
        let mut out = [[0f32; GROUP_ROWS]; N];
        // SAFETY: each pointer addresses one row of `out`.
        unsafe { self.dot_group_to(g, xs, out.each_mut().map(|r| r.as_mut_ptr())) };
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
