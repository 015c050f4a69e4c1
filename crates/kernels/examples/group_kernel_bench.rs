//! One group kernel call after another on data that stays in L1 (one group of eight weight rows,
//! `N` activation rows), against the machine's int8 dot peak (`specula_kernels::peak`): how much
//! of a compute-bound step the kernel's own instructions lose, apart from the memory hierarchy
//! (`matmul_bench` measures whole matmuls).
//!
//! `cargo run --release -p specula-kernels --example group_kernel_bench -- [cols]`
//! (`BENCH_FORMATS=Q6K,Q4K`: only those formats, by their `WeightFormat` names)

use rand::{Rng, SeedableRng};
use specula_kernels::packed::PackedInt8;
use specula_kernels::{quantize_rows, quantize_rows_super, ActSpan, WeightFormat};
use std::time::Instant;

fn main() {
    let cols: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1536);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let peak = specula_kernels::peak::int8_macs_per_second(0.3);
    println!("int8 dot peak, one thread: {:.1} GMAC/s; {cols} columns, data in L1", peak / 1e9);
    println!("{:<6} {:>6} {:>4} {:>10} {:>8}", "format", "span", "acts", "GMAC/s", "of peak");
    let only = std::env::var("BENCH_FORMATS").ok();
    for format in [WeightFormat::Q4K, WeightFormat::Q6K, WeightFormat::Q8_0, WeightFormat::Q5_0] {
        if only.as_ref().is_some_and(|o| !o.split(',').any(|f| f == format!("{format:?}"))) {
            continue;
        }
        let bb = format.block_bytes();
        let mut raw: Vec<u8> = (0..8 * format.row_bytes(cols)).map(|_| rng.gen()).collect();
        // sane f16 scales (d, and dmin for Q4_K) in every block
        let scale_at: &[usize] = match format {
            WeightFormat::Q4K => &[0, 2],
            WeightFormat::Q6K => &[208],
            _ => &[0],
        };
        for blk in raw.chunks_exact_mut(bb) {
            for &at in scale_at {
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
        }
        let p = PackedInt8::pack(format, 8, cols, &raw).expect("an int8 format");
        let x: Vec<f32> = (0..8 * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let spans: &[ActSpan] = if p.reads_super_span() { &[ActSpan::Super] } else { &[ActSpan::Block] };
        for &span in spans {
            let q = if span == ActSpan::Super { quantize_rows_super(&x, cols) } else { quantize_rows(&x, cols) };
            macro_rules! run {
                ($n:literal) => {{
                    let acts: [&[specula_kernels::BlockQ8]; $n] = std::array::from_fn(|i| q.row(i));
                    let mut out = [[0f32; 8]; $n];
                    let mut calls = 1000usize;
                    let mut best = f64::MAX;
                    for round in 0..6 {
                        let t = Instant::now();
                        for _ in 0..calls {
                            // SAFETY: each pointer addresses eight writable floats.
                            unsafe { p.dot_group_span_to::<$n>(0, span, std::hint::black_box(acts), out.each_mut().map(|r| r.as_mut_ptr())) };
                        }
                        let e = t.elapsed().as_secs_f64() / calls as f64;
                        if round == 0 {
                            calls = ((0.05 / e) as usize).max(1);
                        } else {
                            best = best.min(e);
                        }
                    }
                    std::hint::black_box(out);
                    let rate = (8 * $n * cols) as f64 / best;
                    println!("{:<6} {:>6} {:>4} {:>10.1} {:>7.0}%", format!("{format:?}"), format!("{span:?}"), $n, rate / 1e9, 100.0 * rate / peak);
                }};
            }
            run!(1);
            run!(2);
            run!(4);
            run!(8);
        }
    }
}
