//! Tests of the Q4_0 / Q4_1 / Q8_0 groups: every SIMD path against the scalar reference, bit for
//! bit, and the packed dot against the float dot of the dequantized rows.

use super::*;
use crate::formats::{dequantize_row, quantize_row};
use crate::q8::{quantize_rows, QuantizedActivations};
use rand::{Rng, SeedableRng};

fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

fn random_raw(rng: &mut rand::rngs::StdRng, f: WeightFormat, rows: usize, cols: usize) -> Vec<u8> {
    (0..rows).flat_map(|_| quantize_row(f, &rand_vec(rng, cols))).collect()
}

const FORMATS: [WeightFormat; 3] = [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0];

#[test]
fn simd_equals_the_scalar_reference_bitwise_for_any_number_of_activations() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for f in FORMATS {
        for (rows, cols) in [(8, 32), (13, 64), (24, 576)] {
            let p = PackedInt8::pack(f, rows, cols, &random_raw(&mut rng, f, rows, cols)).unwrap();
            let acts: Vec<_> = (0..4).map(|_| quantize_rows(&rand_vec(&mut rng, cols), cols)).collect();
            for g in 0..p.groups() {
                let four = p.dot_group::<4>(g, [acts[0].row(0), acts[1].row(0), acts[2].row(0), acts[3].row(0)]);
                let eight = p.dot_group::<8>(g, std::array::from_fn(|i| acts[i % 4].row(0)));
                let two = p.dot_group::<2>(g, [acts[2].row(0), acts[3].row(0)]);
                for (n, a) in acts.iter().enumerate() {
                    let one = p.dot_group::<1>(g, [a.row(0)])[0];
                    let reference = dot_group_scalar(f, &p.group_for_tests(g), p.blocks, a.row(0));
                    assert_eq!(one.map(f32::to_bits), reference.map(f32::to_bits), "{f:?} {rows}x{cols}");
                    assert_eq!(four[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?}: 4-row path differs");
                    assert_eq!(eight[n + 4].map(f32::to_bits), reference.map(f32::to_bits), "{f:?}: 8-row path differs");
                    if n >= 2 {
                        assert_eq!(two[n - 2].map(f32::to_bits), reference.map(f32::to_bits), "{f:?}: 2-row path differs");
                    }
                }
            }
        }
    }
}

/// A matrix large enough to pack in parallel has the bytes of packing its rows piecewise
/// (small matrices, packed on one thread), for every layout.
#[test]
fn parallel_packing_gives_the_sequential_layout() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for f in [WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4K, WeightFormat::Q6K] {
        let (rows, cols) = (2003, 1024);
        let raw: Vec<u8> = if k::handles(f) { k::random_raw(&mut rng, f, rows, cols) } else { random_raw(&mut rng, f, rows, cols) };
        let big = PackedInt8::pack(f, rows, cols, &raw).unwrap();
        assert!(big.bytes_for_tests().len() >= 1 << 20, "{f:?}: the test matrix takes the parallel path");
        let rb = f.row_bytes(cols);
        let mut pieces = Vec::new();
        for r in (0..rows).step_by(64) {
            let end = (r + 64).min(rows);
            let part = PackedInt8::pack(f, end - r, cols, &raw[r * rb..end * rb]).unwrap();
            assert!(part.bytes_for_tests().len() < 1 << 20);
            pieces.extend_from_slice(part.bytes_for_tests());
        }
        assert!(big.bytes_for_tests()[..] == pieces[..], "{f:?}");
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vnni_and_avx2_agree_bitwise() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    for f in FORMATS {
        let p = PackedInt8::pack(f, 16, 576, &random_raw(&mut rng, f, 16, 576)).unwrap();
        // extreme activations: every element at +-127 after quantization
        let x: Vec<f32> = (0..576).map(|i| if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
        let (a, b) = (quantize_rows(&rand_vec(&mut rng, 576), 576), quantize_rows(&x, 576));
        let Some((x2, vn)) = x86::both::<2>(&p, 1, [a.row(0), b.row(0)]) else {
            eprintln!("skipping: this CPU has no AVX-512 VNNI");
            return;
        };
        assert_eq!(x2.map(|r| r.map(f32::to_bits)), vn.map(|r| r.map(f32::to_bits)), "{f:?}");
    }
}

/// The two-group pass gives each group exactly the one-group kernel's bits (scalar reference),
/// for every format, several activation counts and a partial last group.
#[test]
fn group_pairs_equal_the_one_group_kernel_bitwise() {
    fn check<const N: usize>(p: &PackedInt8, acts: &[QuantizedActivations], f: WeightFormat) {
        let rows: [&[BlockQ8]; N] = std::array::from_fn(|i| acts[i % acts.len()].row(0));
        for g in 0..p.groups() - 1 {
            let mut out = [[[0f32; GROUP_ROWS]; N]; 2];
            let [o0, o1] = &mut out;
            // SAFETY: each pointer addresses one row of `out`.
            unsafe { p.dot_group_pair_to::<N>(g, rows, [o0.each_mut().map(|r| r.as_mut_ptr()), o1.each_mut().map(|r| r.as_mut_ptr())]) };
            let mut forced = None;
            #[cfg(target_arch = "x86_64")]
            if crate::cpu::features().avx512_vnni && PackedInt8::has_512_pair_for_tests(f) {
                // the 512-bit pair itself, also where the matmul does not take it (Zen 4)
                let mut out512 = [[[0f32; GROUP_ROWS]; N]; 2];
                let [a, b] = &mut out512;
                // SAFETY: as above; AVX-512 VNNI was detected.
                unsafe { p.dot_group_pair_512_for_tests::<N>(g, rows, [a.each_mut().map(|r| r.as_mut_ptr()), b.each_mut().map(|r| r.as_mut_ptr())]) };
                forced = Some(out512);
            }
            for (j, group_out) in out.iter().enumerate() {
                for (n, row) in rows.iter().enumerate() {
                    let reference = dot_group_scalar(f, &p.group_for_tests(g + j), p.blocks, row);
                    assert_eq!(group_out[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} group {} activation {n} of {N}", g + j);
                    if let Some(o) = &forced {
                        assert_eq!(o[j][n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} 512-bit pair, group {} activation {n} of {N}", g + j);
                    }
                }
            }
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for f in FORMATS {
        for (rows, cols) in [(16, 32), (29, 64), (40, 576)] {
            let p = PackedInt8::pack(f, rows, cols, &random_raw(&mut rng, f, rows, cols)).unwrap();
            let mut acts: Vec<_> = (0..5).map(|_| quantize_rows(&rand_vec(&mut rng, cols), cols)).collect();
            // extreme activations: every element at +-127 after quantization
            acts.push(quantize_rows(&(0..cols).map(|i| if i % 3 == 0 { -1.0 } else { 1.0 }).collect::<Vec<f32>>(), cols));
            check::<1>(&p, &acts, f);
            check::<2>(&p, &acts, f);
            check::<3>(&p, &acts, f);
            check::<4>(&p, &acts, f);
            check::<6>(&p, &acts, f);
            check::<8>(&p, &acts, f);
        }
    }
}

/// Independent oracle: the float dot of the dequantized ggml row with the dequantized
/// activations, within the error the 8-bit activations allow.
#[test]
fn packed_dot_approximates_the_float_dot_of_dequantized_weights() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (rows, cols) = (11, 576);
    let x = rand_vec(&mut rng, cols);
    let q = quantize_rows(&x, cols);
    for f in FORMATS {
        let raw = random_raw(&mut rng, f, rows, cols);
        let p = PackedInt8::pack(f, rows, cols, &raw).unwrap();
        for r in 0..rows {
            let mut wd = vec![0f32; cols];
            dequantize_row(f, &raw[r * f.row_bytes(cols)..(r + 1) * f.row_bytes(cols)], &mut wd);
            let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
            let got = p.dot_group::<1>(r / GROUP_ROWS, [q.row(0)])[0][r % GROUP_ROWS];
            // activation quantization error: |x_i - q_i| <= amax/254 per element
            let bound = wd.iter().map(|v| v.abs()).sum::<f32>() * 2.0 / 254.0 + 1e-4;
            assert!((exact - got).abs() <= bound, "{f:?} row {r}: {exact} vs {got} (bound {bound})");
        }
        // the padding lanes of the last group are zero
        let last = p.dot_group::<1>(p.groups() - 1, [q.row(0)])[0];
        assert!(last[rows % GROUP_ROWS..].iter().all(|&v| v == 0.0));
    }
}

/// Q8_0 bytes a quantizer never writes but a file may hold (-128, next to +127 and 0) against
/// activations at both ends: every path, one group or two, gives the scalar reference's bits.
#[test]
fn q8_0_weight_bytes_at_the_ends_of_i8_give_the_reference_sums() {
    let (rows, cols) = (16, 64);
    let f = WeightFormat::Q8_0;
    let bb = f.block_bytes();
    let mut raw = vec![0u8; rows * f.row_bytes(cols)];
    for (i, blk) in raw.chunks_exact_mut(bb).enumerate() {
        blk[..2].copy_from_slice(&f16::from_f32(0.01 * (1 + i % 5) as f32).to_le_bytes());
        for (j, q) in blk[2..].iter_mut().enumerate() {
            *q = [0x80u8, 0x7F, 0x00, 0x81][(i + j) % 4];
        }
    }
    let p = PackedInt8::pack(f, rows, cols, &raw).unwrap();
    let x: Vec<f32> = (0..cols).map(|i| if i % 2 == 0 { -1.0 } else { 1.0 }).collect();
    let ones = vec![1.0f32; cols];
    let (a, b) = (quantize_rows(&x, cols), quantize_rows(&ones, cols));
    let mut out = [[[0f32; GROUP_ROWS]; 2]; 2];
    let [o0, o1] = &mut out;
    // SAFETY: each pointer addresses one row of `out`.
    unsafe { p.dot_group_pair_to::<2>(0, [a.row(0), b.row(0)], [o0.each_mut().map(|r| r.as_mut_ptr()), o1.each_mut().map(|r| r.as_mut_ptr())]) };
    for (g, group_out) in out.iter().enumerate() {
        for (n, act) in [a.row(0), b.row(0)].into_iter().enumerate() {
            let reference = dot_group_scalar(f, &p.group_for_tests(g), p.blocks, act);
            assert_eq!(group_out[n].map(f32::to_bits), reference.map(f32::to_bits), "group {g} activation {n}");
            assert_eq!(p.dot_group::<1>(g, [act])[0].map(f32::to_bits), reference.map(f32::to_bits));
        }
    }
}

#[test]
fn extreme_weights_do_not_overflow_the_integer_sums() {
    // every weight at the top of its range (nibble 15 / byte +-127) against activations all at 127:
    // the largest integer sums there are, checked against the scalar reference's i32 sums
    let cols = 64;
    let x = vec![1.0f32; cols];
    let q = quantize_rows(&x, cols);
    let w: Vec<f32> = (0..cols).map(|i| if i % 32 == 0 { -1.0 } else { 1.0 }).collect();
    for f in FORMATS {
        let row = quantize_row(f, &w);
        let mut wd = vec![0f32; cols];
        dequantize_row(f, &row, &mut wd);
        let expected: f32 = wd.iter().sum();
        let raw: Vec<u8> = (0..8).flat_map(|_| row.clone()).collect();
        let p = PackedInt8::pack(f, 8, cols, &raw).unwrap();
        let got = p.dot_group::<1>(0, [q.row(0)])[0];
        let reference = dot_group_scalar(f, &p.group_for_tests(0), p.blocks, q.row(0));
        assert_eq!(got.map(f32::to_bits), reference.map(f32::to_bits), "{f:?}");
        assert!(got.iter().all(|v| (v - expected).abs() < 1e-3 * expected), "{f:?}: {got:?} vs {expected}");
    }
}
