//! Tests of the Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K kernels of `packed::k`, through the `PackedInt8`
//! that holds their groups: every SIMD path against the scalar reference, bit for bit, and the
//! packed dot against the float dot of the dequantized rows. A module of its own (beside
//! `packed/k.rs`) so that `packed::k` does not import `packed`, which dispatches to it.

use crate::formats::dequantize_row;
use crate::formats::{WeightFormat, QK};
use crate::group::GROUP_ROWS;
#[cfg(target_arch = "x86_64")]
use crate::packed::k::x86;
use crate::packed::k::{dot_group_scalar, group_block_bytes, random_raw, reads_super_span};
use crate::packed::test_rows::{self as test_rows, activation_rows, rand_vec, shapes};
use crate::packed::PackedInt8;
use crate::q8::{quantize_rows, quantize_rows_super, QuantizedActivations, SUPER_SPAN};
use crate::q8::{ActSpan, BlockQ8};
use half::f16;
use rand::SeedableRng;

pub(crate) const FORMATS: [WeightFormat; 5] = [WeightFormat::Q5_0, WeightFormat::Q5_1, WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K];

/// Every kernel: each format against block-scaled rows, Q4_K / Q5_K against super-scaled too.
fn cases() -> Vec<(WeightFormat, ActSpan)> {
    let mut c: Vec<_> = FORMATS.iter().map(|&f| (f, ActSpan::Block)).collect();
    c.extend(FORMATS.iter().filter(|&&f| reads_super_span(f)).map(|&f| (f, ActSpan::Super)));
    c
}

/// `x` (one row) quantized with scale span `span`.
fn quantize(x: &[f32], span: ActSpan) -> QuantizedActivations {
    let q = if span == ActSpan::Super { quantize_rows_super(x, x.len()) } else { quantize_rows(x, x.len()) };
    assert_eq!(q.spans, [span], "a test row that does not take {span:?} scales");
    q
}

/// Values that share one scale.
fn span_len(span: ActSpan) -> usize {
    if span == ActSpan::Super {
        SUPER_SPAN
    } else {
        QK
    }
}

/// Activation rows with scale span `span`: random, and one at the ends of i8.
fn activations(rng: &mut rand::rngs::StdRng, cols: usize, span: ActSpan) -> Vec<QuantizedActivations> {
    activation_rows(rng, cols, |x| quantize(x, span))
}

fn group_bytes(p: &PackedInt8, g: usize, f: WeightFormat, cols: usize) -> (&[u8], usize) {
    test_rows::group_bytes(p, g, f, cols, group_block_bytes(f))
}

/// Every path this CPU has (the dispatched one at 1..8 activation rows, and AVX2 and VNNI
/// called directly) gives the scalar reference's bits. Says which paths ran; under CI, a path
/// the CPU has and the environment did not switch off must have run (`cpu::expected_paths`).
#[test]
fn simd_equals_the_scalar_reference_bitwise() {
    fn check<const N: usize>(
        p: &PackedInt8,
        f: WeightFormat,
        span: ActSpan,
        cols: usize,
        acts: &[QuantizedActivations],
        ran: &mut std::collections::BTreeSet<&'static str>,
    ) {
        let rows: [&[BlockQ8]; N] = std::array::from_fn(|i| acts[(i * 3 + N) % acts.len()].row(0));
        for g in 0..p.groups() {
            let (group, blocks) = group_bytes(p, g, f, cols);
            let got = p.dot_group_span::<N>(g, span, rows);
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
                            x86::group_vnni::<N>(f, span, group, blocks, rows, dst)
                        } else {
                            x86::group_avx2::<N>(f, span, group, blocks, rows, dst)
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
                    let reference = dot_group_scalar(f, span, group, blocks, a);
                    assert_eq!(out[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} {span:?} {name} group {g} activation {n} of {N}");
                }
                ran.insert(if name == "dispatched" { crate::cpu::dispatched_path() } else { name });
            }
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let mut ran = std::collections::BTreeSet::new();
    for (f, span) in cases() {
        for (rows, cols) in shapes(f) {
            let p = PackedInt8::pack(f, rows, cols, &random_raw(&mut rng, f, rows, cols)).unwrap();
            let acts = activations(&mut rng, cols, span);
            check::<1>(&p, f, span, cols, &acts, &mut ran);
            check::<2>(&p, f, span, cols, &acts, &mut ran);
            check::<3>(&p, f, span, cols, &acts, &mut ran);
            check::<4>(&p, f, span, cols, &acts, &mut ran);
            check::<8>(&p, f, span, cols, &acts, &mut ran);
        }
    }
    eprintln!("packed_k kernel paths compared with the scalar reference: {ran:?}");
    crate::cpu::assert_expected_paths_ran(&ran);
}

/// The two-group passes (`pair_k` where this CPU runs them, two one-group calls elsewhere) of
/// Q4_K against super-scaled rows and Q6_K against block-scaled ones give each group the
/// scalar reference's bits, at 1-8 activation rows (past four a second pass) and with a
/// partial last group.
#[test]
fn k_quant_group_pairs_equal_the_scalar_reference_bitwise() {
    fn check<const N: usize>(p: &PackedInt8, f: WeightFormat, span: ActSpan, cols: usize, acts: &[QuantizedActivations]) {
        let rows: [&[BlockQ8]; N] = std::array::from_fn(|i| acts[(i * 3 + N) % acts.len()].row(0));
        for g in 0..p.groups() - 1 {
            let mut out = [[[0f32; GROUP_ROWS]; N]; 2];
            let [o0, o1] = &mut out;
            // SAFETY: each pointer addresses one row of `out`; g + 1 < groups.
            unsafe { p.dot_group_pair_span_to::<N>(g, span, rows, [o0.each_mut().map(|r| r.as_mut_ptr()), o1.each_mut().map(|r| r.as_mut_ptr())]) };
            for (j, group_out) in out.iter().enumerate() {
                let (group, blocks) = group_bytes(p, g + j, f, cols);
                for (n, a) in rows.iter().enumerate() {
                    let reference = dot_group_scalar(f, span, group, blocks, a);
                    assert_eq!(group_out[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} group {} activation {n} of {N}", g + j);
                }
            }
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(33);
    for (f, span) in [(WeightFormat::Q4K, ActSpan::Super), (WeightFormat::Q6K, ActSpan::Block)] {
        for (rows, cols) in [(16, 256), (21, 1536), (40, 768)] {
            let p = PackedInt8::pack(f, rows, cols, &random_raw(&mut rng, f, rows, cols)).unwrap();
            let acts = activations(&mut rng, cols, span);
            check::<1>(&p, f, span, cols, &acts);
            check::<2>(&p, f, span, cols, &acts);
            check::<3>(&p, f, span, cols, &acts);
            check::<4>(&p, f, span, cols, &acts);
            check::<5>(&p, f, span, cols, &acts);
            check::<8>(&p, f, span, cols, &acts);
        }
    }
}

/// Independent oracle: the float dot of the dequantized ggml row (`dequantize_row`) with the
/// f32 activations, within what the 8-bit activations allow: each activation is off by at most
/// half a step, `amax / 254` of the values sharing its scale (a block of 32, or a super-block),
/// so the dot is off by at most `sum_blocks (amax_b / 254) * sum_{i in b} |w_i|`, plus float
/// rounding (relative 1e-5).
#[test]
fn packed_dot_approximates_the_float_dot_of_dequantized_weights() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for (f, span) in cases() {
        let (rows, cols) = (11, if f.block_len() == QK { 576 } else { 1024 });
        let raw = random_raw(&mut rng, f, rows, cols);
        let p = PackedInt8::pack(f, rows, cols, &raw).unwrap();
        for _ in 0..3 {
            let x = rand_vec(&mut rng, cols);
            let q = quantize(&x, span);
            for r in 0..rows {
                let mut wd = vec![0f32; cols];
                dequantize_row(f, &raw[r * f.row_bytes(cols)..(r + 1) * f.row_bytes(cols)], &mut wd);
                let exact: f64 = wd.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let got = p.dot_group_span::<1>(r / GROUP_ROWS, span, [q.row(0)])[0][r % GROUP_ROWS];
                let mut bound = 0f64;
                let mut mag = 0f64;
                for (i, (wb, xb)) in wd.chunks_exact(QK).zip(x.chunks_exact(QK)).enumerate() {
                    let shared = &x[i * QK / span_len(span) * span_len(span)..][..span_len(span)];
                    let amax = shared.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    bound += amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>();
                    mag += wb.iter().zip(xb).map(|(a, b)| (a * b).abs() as f64).sum::<f64>();
                }
                let bound = bound * 1.0001 + mag * 1e-5 + 1e-6;
                assert!((exact - got as f64).abs() <= bound, "{f:?} {span:?} row {r}: {exact} vs {got} (bound {bound})");
                // tighter: against the dequantized activations `d_a * q_a` only float rounding
                // remains (a few ulps of the terms' magnitude, far under the activation error)
                let mut exact_q = 0f64;
                let mut scale = 0f64;
                for (wb, ab) in wd.chunks_exact(QK).zip(q.row(0)) {
                    for (w, &a) in wb.iter().zip(&ab.qs) {
                        exact_q += *w as f64 * (ab.d as f64 * a as f64);
                    }
                    scale += wb.iter().map(|v| v.abs() as f64).sum::<f64>() * ab.d as f64 * 127.0;
                }
                assert!((exact_q - got as f64).abs() <= scale * 1e-5, "{f:?} {span:?} row {r}: {exact_q} vs {got} (scale {scale})");
            }
            // the padding lanes of the last group are zero
            let last = p.dot_group_span::<1>(p.groups() - 1, span, [q.row(0)])[0];
            assert!(last[rows % GROUP_ROWS..].iter().all(|&v| v == 0.0));
        }
    }
}

/// Every quant at the top of its range (all bits set; Q6_K scales at -128 and +127) against
/// activations all at +-127: the largest integer sums, on every path, against the reference
/// and against the dequantized float dot.
#[test]
fn extreme_quants_do_not_overflow_the_integer_sums() {
    for (f, span) in cases() {
        let cols = 2 * f.block_len();
        let mut raw = vec![0xFFu8; 8 * f.row_bytes(cols)];
        for (i, blk) in raw.chunks_exact_mut(f.block_bytes()).enumerate() {
            let scale = f16::from_f32(0.01).to_le_bytes();
            match f {
                WeightFormat::Q5_0 => blk[0..2].copy_from_slice(&scale),
                WeightFormat::Q5_1 | WeightFormat::Q4K | WeightFormat::Q5K => {
                    blk[0..2].copy_from_slice(&scale);
                    blk[2..4].copy_from_slice(&scale);
                }
                _ => {
                    blk[208..210].copy_from_slice(&scale);
                    for (s, b) in blk[192..208].iter_mut().enumerate() {
                        *b = if (s + i) % 2 == 0 { 0x80 } else { 0x7F };
                    }
                }
            }
        }
        let p = PackedInt8::pack(f, 8, cols, &raw).unwrap();
        for x in [vec![1.0f32; cols], vec![-1.0f32; cols], (0..cols).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect()] {
            let q = quantize(&x, span);
            let (group, blocks) = group_bytes(&p, 0, f, cols);
            let reference = dot_group_scalar(f, span, group, blocks, q.row(0));
            let got = p.dot_group_span::<4>(0, span, [q.row(0); 4]);
            for o in got {
                assert_eq!(o.map(f32::to_bits), reference.map(f32::to_bits), "{f:?} {span:?}");
            }
            let mut wd = vec![0f32; cols];
            dequantize_row(f, &raw[..f.row_bytes(cols)], &mut wd);
            let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
            assert!((got[0][0] - exact).abs() <= 1e-4 * wd.iter().map(|v| v.abs()).sum::<f32>(), "{f:?} {span:?}: {} vs {exact}", got[0][0]);
        }
    }
}

/// The eight-row repacking (transposes) writes the bytes of `pack_block` lane by lane, on
/// random blocks with every scale byte random (all 6-bit scale and min combinations reached).
#[cfg(target_arch = "x86_64")]
#[test]
fn eight_row_repacking_writes_the_lane_by_lane_bytes() {
    use rand::Rng;
    if !crate::cpu::features().avx2_fma {
        eprintln!("skipping: no AVX2");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    for f in [WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K] {
        assert!(x86::packs_eight(f));
        for _ in 0..50 {
            let src: Vec<Vec<u8>> = (0..GROUP_ROWS).map(|_| (0..f.block_bytes()).map(|_| rng.gen()).collect()).collect();
            let mut want = vec![0u8; group_block_bytes(f)];
            for (lane, s) in src.iter().enumerate() {
                crate::packed::k::pack_block(f, s, lane, &mut want);
            }
            let mut got = vec![0xAAu8; group_block_bytes(f)];
            // SAFETY: AVX2 checked above; each source holds one block, `got` one group block.
            unsafe { x86::pack_block8(f, std::array::from_fn(|r| src[r].as_ptr()), got.as_mut_ptr()) };
            assert!(got == want, "{f:?}: first difference at byte {:?}", got.iter().zip(&want).position(|(a, b)| a != b));
        }
    }
}
