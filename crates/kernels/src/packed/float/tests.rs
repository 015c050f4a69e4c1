//! Tests of the float groups against the float dot.

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
