//! Tests of the Q2_K / Q3_K and table-format groups against the scalar reference and the
//! dequantized float dot.

use super::*;
use crate::formats::dequantize_row;
use crate::packed::test_rows::{self as test_rows, activation_rows, rand_vec, shapes};
use crate::packed::PackedInt8;
use crate::q8::{quantize_rows, QuantizedActivations};
use rand::SeedableRng;

pub(crate) const FORMATS: [WeightFormat; 5] = [WeightFormat::Q2K, WeightFormat::Q3K, WeightFormat::IQ4NL, WeightFormat::IQ4XS, WeightFormat::MXFP4];

/// Activation rows: random, and one at the ends of i8.
fn activations(rng: &mut rand::rngs::StdRng, cols: usize) -> Vec<QuantizedActivations> {
    activation_rows(rng, cols, |x| quantize_rows(x, x.len()))
}

fn group_bytes(p: &PackedInt8, g: usize, f: WeightFormat, cols: usize) -> (&[u8], usize) {
    test_rows::group_bytes(p, g, f, cols, group_block_bytes(f))
}

/// Every path this CPU has (the dispatched one at 1..8 activation rows, and AVX2 and VNNI
/// called directly) gives the scalar reference's bits. Says which paths ran; under CI, a path
/// the CPU has and the environment did not switch off must have run (`cpu::expected_paths`).
#[test]
fn simd_equals_the_scalar_reference_bitwise() {
    fn check<const N: usize>(p: &PackedInt8, f: WeightFormat, cols: usize, acts: &[QuantizedActivations], ran: &mut std::collections::BTreeSet<&'static str>) {
        let rows: [&[BlockQ8]; N] = std::array::from_fn(|i| acts[(i * 3 + N) % acts.len()].row(0));
        for g in 0..p.groups() {
            let (group, blocks) = group_bytes(p, g, f, cols);
            let got = p.dot_group::<N>(g, rows);
            #[allow(unused_mut)]
            let mut paths = vec![("dispatched", got)];
            #[cfg(target_arch = "x86_64")]
            {
                let feat = crate::cpu::features();
                let mut run = |name, vnni: bool| {
                    let mut out = [[0f32; GROUP_ROWS]; N];
                    let dst = out.each_mut().map(|r| r.as_mut_ptr());
                    // SAFETY: the features were detected; sizes as in dot_group; dst holds N x 8 floats.
                    unsafe {
                        if vnni {
                            x86::group_vnni::<N>(f, group, blocks, rows, dst)
                        } else {
                            x86::group_avx2::<N>(f, group, blocks, rows, dst)
                        }
                    }
                    paths.push((name, out));
                };
                if feat.avx2_fma {
                    run(crate::cpu::PATH_AVX2, false);
                }
                if feat.avx512_vnni {
                    run(crate::cpu::PATH_VNNI, true);
                }
            }
            for (name, out) in paths {
                for (n, a) in rows.iter().enumerate() {
                    let reference = dot_group_scalar(f, group, blocks, a);
                    assert_eq!(out[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} {name} group {g} activation {n} of {N}");
                }
                ran.insert(if name == "dispatched" { crate::cpu::dispatched_path() } else { name });
            }
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let mut ran = std::collections::BTreeSet::new();
    for f in FORMATS {
        for (rows, cols) in shapes(f) {
            let p = PackedInt8::pack(f, rows, cols, &random_raw(&mut rng, f, rows, cols)).unwrap();
            let acts = activations(&mut rng, cols);
            check::<1>(&p, f, cols, &acts, &mut ran);
            check::<2>(&p, f, cols, &acts, &mut ran);
            check::<3>(&p, f, cols, &acts, &mut ran);
            check::<4>(&p, f, cols, &acts, &mut ran);
            check::<5>(&p, f, cols, &acts, &mut ran);
            check::<6>(&p, f, cols, &acts, &mut ran);
            check::<7>(&p, f, cols, &acts, &mut ran);
            check::<8>(&p, f, cols, &acts, &mut ran);
        }
    }
    eprintln!("packed_iq kernel paths compared with the scalar reference: {ran:?}");
    crate::cpu::assert_expected_paths_ran(&ran);
}

/// The table formats' two-group pass (dispatched, and the 512-bit kernel forced where the CPU
/// has it, whatever the matmul's row threshold) gives each group the scalar reference's bits:
/// random blocks and every code at one extreme, random and +-127 activations, 1..8 rows, a
/// partial last group.
#[test]
fn table_pairs_equal_the_scalar_reference_bitwise() {
    fn check<const N: usize>(p: &PackedInt8, f: WeightFormat, cols: usize, acts: &[QuantizedActivations]) {
        let rows: [&[BlockQ8]; N] = std::array::from_fn(|i| acts[(i * 3 + N) % acts.len()].row(0));
        for g in 0..p.groups() - 1 {
            let mut outs = Vec::new();
            let mut run = |forced: bool| {
                let mut out = [[[0f32; GROUP_ROWS]; N]; 2];
                let [o0, o1] = &mut out;
                let dst = [o0.each_mut().map(|r| r.as_mut_ptr()), o1.each_mut().map(|r| r.as_mut_ptr())];
                // SAFETY: each pointer addresses one row of `out`; the forced kernel only where
                // AVX-512 VNNI was detected.
                unsafe {
                    if forced {
                        #[cfg(target_arch = "x86_64")]
                        p.dot_group_pair_512_for_tests::<N>(g, rows, dst);
                    } else {
                        p.dot_group_pair_to::<N>(g, rows, dst);
                    }
                }
                outs.push((forced, out));
            };
            run(false);
            if cfg!(target_arch = "x86_64") && crate::cpu::features().avx512_vnni {
                run(true);
            }
            for (forced, out) in outs {
                for (j, group_out) in out.iter().enumerate() {
                    let (group, blocks) = group_bytes(p, g + j, f, cols);
                    for (n, a) in rows.iter().enumerate() {
                        let reference = dot_group_scalar(f, group, blocks, a);
                        assert_eq!(group_out[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} forced {forced} group {} activation {n} of {N}", g + j);
                    }
                }
            }
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(43);
    for f in [WeightFormat::IQ4NL, WeightFormat::IQ4XS, WeightFormat::MXFP4] {
        for (rows, cols) in [(16, f.block_len()), (29, 3 * f.block_len()), (21, if f.block_len() == QK { 576 } else { 1536 })] {
            let mut raws = vec![random_raw(&mut rng, f, rows, cols)];
            for fill in [0x00u8, 0xFF, 0x88, 0x77] {
                // every code at one extreme (IQ4: -127 or 113; MXFP4: -12 or 12), scales kept
                let mut raw = random_raw(&mut rng, f, rows, cols);
                for blk in raw.chunks_exact_mut(f.block_bytes()) {
                    let at = match f {
                        WeightFormat::IQ4NL => 2,
                        WeightFormat::IQ4XS => 8,
                        _ => 1,
                    };
                    blk[at..].fill(fill);
                }
                raws.push(raw);
            }
            for raw in raws {
                let p = PackedInt8::pack(f, rows, cols, &raw).unwrap();
                let acts = activations(&mut rng, cols);
                check::<1>(&p, f, cols, &acts);
                check::<2>(&p, f, cols, &acts);
                check::<3>(&p, f, cols, &acts);
                check::<4>(&p, f, cols, &acts);
                check::<5>(&p, f, cols, &acts);
                check::<6>(&p, f, cols, &acts);
                check::<7>(&p, f, cols, &acts);
                check::<8>(&p, f, cols, &acts);
            }
        }
    }
}

/// Independent oracle: the float dot of the dequantized ggml row (`dequantize_row`, itself
/// checked against gguf-py by python/tests/test_kquant_oracle.py) with the f32 activations,
/// within what the 8-bit activations allow (each activation off by at most `amax / 254` of
/// its block), plus float rounding; and against the dequantized activations within float
/// rounding only.
#[test]
fn packed_dot_approximates_the_float_dot_of_dequantized_weights() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for f in FORMATS {
        let (rows, cols) = (11, if f.block_len() == QK { 576 } else { 1024 });
        let raw = random_raw(&mut rng, f, rows, cols);
        let p = PackedInt8::pack(f, rows, cols, &raw).unwrap();
        for _ in 0..3 {
            let x = rand_vec(&mut rng, cols);
            let q = quantize_rows(&x, cols);
            for r in 0..rows {
                let mut wd = vec![0f32; cols];
                dequantize_row(f, &raw[r * f.row_bytes(cols)..(r + 1) * f.row_bytes(cols)], &mut wd);
                let exact: f64 = wd.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let got = p.dot_group::<1>(r / GROUP_ROWS, [q.row(0)])[0][r % GROUP_ROWS];
                let mut bound = 0f64;
                let mut mag = 0f64;
                for (wb, xb) in wd.chunks_exact(QK).zip(x.chunks_exact(QK)) {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    bound += amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>();
                    mag += wb.iter().zip(xb).map(|(a, b)| (a * b).abs() as f64).sum::<f64>();
                }
                let bound = bound * 1.0001 + mag * 1e-5 + 1e-6;
                assert!((exact - got as f64).abs() <= bound, "{f:?} row {r}: {exact} vs {got} (bound {bound})");
                let mut exact_q = 0f64;
                let mut scale = 0f64;
                for (wb, ab) in wd.chunks_exact(QK).zip(q.row(0)) {
                    for (w, &a) in wb.iter().zip(&ab.qs) {
                        exact_q += *w as f64 * (ab.d as f64 * a as f64);
                    }
                    scale += wb.iter().map(|v| v.abs() as f64).sum::<f64>() * ab.d as f64 * 127.0;
                }
                assert!((exact_q - got as f64).abs() <= scale * 1e-5, "{f:?} row {r}: {exact_q} vs {got} (scale {scale})");
            }
            // the padding lanes of the last group are zero
            let last = p.dot_group::<1>(p.groups() - 1, [q.row(0)])[0];
            assert!(last[rows % GROUP_ROWS..].iter().all(|&v| v == 0.0));
        }
    }
}

/// Every quant byte at one extreme (all bits set, or all clear: IQ4's -127, Q3_K's -4; 0x77:
/// MXFP4's +12, the largest unsigned byte of its AVX2 offset table), the
/// 6-bit scales at both ends, against activations all at +-127: the largest integer sums, on
/// every path, against the reference and the dequantized float dot.
#[test]
fn extreme_quants_do_not_overflow_the_integer_sums() {
    for f in FORMATS {
        for fill in [0x00u8, 0xFF, 0x88] {
            let cols = 2 * f.block_len();
            let mut raw = vec![fill; 8 * f.row_bytes(cols)];
            let scale = f16::from_f32(0.01).to_le_bytes();
            for blk in raw.chunks_exact_mut(f.block_bytes()) {
                match f {
                    WeightFormat::Q2K => {
                        blk[80..82].copy_from_slice(&scale);
                        blk[82..84].copy_from_slice(&scale);
                    }
                    WeightFormat::Q3K => blk[108..110].copy_from_slice(&scale),
                    WeightFormat::MXFP4 => blk[0] = 127,
                    _ => blk[0..2].copy_from_slice(&scale),
                }
            }
            let p = PackedInt8::pack(f, 8, cols, &raw).unwrap();
            for x in [vec![1.0f32; cols], vec![-1.0f32; cols], (0..cols).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect()] {
                let q = quantize_rows(&x, cols);
                let (group, blocks) = group_bytes(&p, 0, f, cols);
                let reference = dot_group_scalar(f, group, blocks, q.row(0));
                let got = p.dot_group::<4>(0, [q.row(0); 4]);
                for o in got {
                    assert_eq!(o.map(f32::to_bits), reference.map(f32::to_bits), "{f:?} fill {fill:#x}");
                }
                let mut wd = vec![0f32; cols];
                dequantize_row(f, &raw[..f.row_bytes(cols)], &mut wd);
                let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
                assert!((got[0][0] - exact).abs() <= 1e-4 * wd.iter().map(|v| v.abs()).sum::<f32>() + 1e-6, "{f:?} fill {fill:#x}: {} vs {exact}", got[0][0]);
            }
        }
    }
}
