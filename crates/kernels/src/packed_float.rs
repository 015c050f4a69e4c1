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
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_f16<const G: usize, const N: usize>(w: &[u16], cols: usize, xs: [&[f32]; N], dst: [[*mut f32; N]; G]) {
        assert!(w.len() >= G * cols * GROUP_ROWS);
        let mut acc = [[_mm256_setzero_ps(); N]; G];
        let wp = w.as_ptr();
        for c in 0..cols {
            let x: [__m256; N] = std::array::from_fn(|n| _mm256_set1_ps(*xs[n].get_unchecked(c)));
            for j in 0..G {
                // SAFETY: c < cols, j < G; the slice holds G groups of cols columns of eight f16.
                let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add((j * cols + c) * GROUP_ROWS) as *const __m128i));
                for n in 0..N {
                    acc[j][n] = _mm256_fmadd_ps(wv, x[n], acc[j][n]);
                }
            }
        }
        for j in 0..G {
            for n in 0..N {
                _mm256_storeu_ps(dst[j][n], acc[j][n]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn group_f32<const G: usize, const N: usize>(w: &[f32], cols: usize, xs: [&[f32]; N], dst: [[*mut f32; N]; G]) {
        assert!(w.len() >= G * cols * GROUP_ROWS);
        let mut acc = [[_mm256_setzero_ps(); N]; G];
        let wp = w.as_ptr();
        for c in 0..cols {
            let x: [__m256; N] = std::array::from_fn(|n| _mm256_set1_ps(*xs[n].get_unchecked(c)));
            for j in 0..G {
                // SAFETY: as above, eight f32 per column.
                let wv = _mm256_loadu_ps(wp.add((j * cols + c) * GROUP_ROWS));
                for n in 0..N {
                    acc[j][n] = _mm256_fmadd_ps(wv, x[n], acc[j][n]);
                }
            }
        }
        for j in 0..G {
            for n in 0..N {
                _mm256_storeu_ps(dst[j][n], acc[j][n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::quantize_row;
    use rand::{Rng, SeedableRng};

    /// A random `rows x cols` matrix in format `f` (its raw rows and its packed form) and
    /// `n` activation rows.
    fn random_case(rng: &mut rand::rngs::StdRng, f: WeightFormat, rows: usize, cols: usize, n: usize) -> (Vec<u8>, PackedFloat, Vec<Vec<f32>>) {
        let mut raw = Vec::new();
        for _ in 0..rows {
            let row: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            raw.extend(quantize_row(f, &row));
        }
        let p = PackedFloat::pack(f, rows, cols, &raw).unwrap();
        let xs = (0..n).map(|_| (0..cols).map(|_| rng.gen_range(-2.0f32..2.0)).collect()).collect();
        (raw, p, xs)
    }

    #[test]
    fn packed_float_matches_the_float_dot_and_does_not_depend_on_the_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (rows, cols) = (13, 40);
        for f in [WeightFormat::F16, WeightFormat::BF16, WeightFormat::F32] {
            let (raw, p, xs) = random_case(&mut rng, f, rows, cols, 4);
            for g in 0..2 {
                let four = p.dot_group::<4>(g, [&xs[0], &xs[1], &xs[2], &xs[3]]);
                for (n, x) in xs.iter().enumerate() {
                    let one = p.dot_group::<1>(g, [x])[0];
                    assert_eq!(one.map(f32::to_bits), four[n].map(f32::to_bits), "{f:?}");
                    for lane in 0..GROUP_ROWS {
                        let r = g * GROUP_ROWS + lane;
                        if r >= rows {
                            assert_eq!(one[lane], 0.0);
                            continue;
                        }
                        let mut w = vec![0f32; cols];
                        dequantize_row(f, &raw[r * f.row_bytes(cols)..(r + 1) * f.row_bytes(cols)], &mut w);
                        let exact: f64 = w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
                        assert!((one[lane] as f64 - exact).abs() < 1e-4, "{f:?} row {r}: {} vs {exact}", one[lane]);
                    }
                }
            }
        }
    }

    #[test]
    fn groups_side_by_side_give_each_groups_fma_chain_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (rows, cols) = (40, 72);
        for f in [WeightFormat::F16, WeightFormat::BF16, WeightFormat::F32] {
            let (raw, p, xs) = random_case(&mut rng, f, rows, cols, 3);
            // the documented arithmetic: acc = fma(w[c], x[c], acc) over c in order, per row
            let reference = |r: usize, x: &[f32]| {
                let mut w = vec![0f32; cols];
                dequantize_row(f, &raw[r * f.row_bytes(cols)..(r + 1) * f.row_bytes(cols)], &mut w);
                w.iter().zip(x).fold(0f32, |acc, (a, b)| a.mul_add(*b, acc))
            };
            let mut out = [[[0f32; GROUP_ROWS]; 3]; 4];
            for (g0, n) in [(0, 1), (1, 1), (0, 2), (3, 2), (2, 3)] {
                let gs = if n == 1 { 4 } else { 2 };
                if g0 + gs > rows / GROUP_ROWS {
                    continue;
                }
                let dst: [[*mut f32; 3]; 4] = std::array::from_fn(|j| std::array::from_fn(|i| out[j][i].as_mut_ptr()));
                // SAFETY: every pointer addresses one row of `out`.
                unsafe {
                    match n {
                        1 => p.dot_groups_to::<4, 1>(g0, [&xs[0]], std::array::from_fn(|j| [dst[j][0]])),
                        2 => p.dot_groups_to::<2, 2>(g0, [&xs[0], &xs[1]], [[dst[0][0], dst[0][1]], [dst[1][0], dst[1][1]]]),
                        _ => p.dot_groups_to::<2, 3>(g0, [&xs[0], &xs[1], &xs[2]], [dst[0], dst[1]]),
                    }
                }
                for j in 0..gs {
                    for (i, x) in xs.iter().enumerate().take(n) {
                        for lane in 0..GROUP_ROWS {
                            let r = (g0 + j) * GROUP_ROWS + lane;
                            assert_eq!(out[j][i][lane].to_bits(), reference(r, x).to_bits(), "{f:?} g0 {g0} n {n} row {r}");
                        }
                        assert_eq!(out[j][i], p.dot_group::<1>(g0 + j, [x])[0]);
                    }
                }
            }
        }
    }
}
