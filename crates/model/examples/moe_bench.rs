//! Microbenchmark of one mixture-of-experts layer on the Qwen3-30B-A3B shape (128 experts, hidden
//! 2048, expert FFN 768, top 8; gate and up Q4_K, down Q6_K as in its Q4_K_M file), random weights.
//!
//! `cargo run --release -p specula-model --example moe_bench -- [rows,..] [threads,..] [rounds]`
//!
//! Prints, per (rows, threads), the median and fastest time of `MoeFfn::forward` and the experts'
//! multiply-adds per second beside the machine's int8 dot peak measured in the same run. On a
//! shared machine compare builds or configurations inside one process, not across sessions.

use rand::{Rng, SeedableRng};
use specula_kernels::{QMatrix, WeightBytes, WeightFormat};
use specula_model::arch::Activation;
use specula_model::{DenseFfn, MoeFfn};
use std::time::Instant;

const EXPERTS: usize = 128;
const HIDDEN: usize = 2048;
const EXPERT_FFN: usize = 768;
const TOP_K: usize = 8;

/// A matrix of random blocks with sane f16 scales (k-quant layouts).
fn random_matrix(rng: &mut rand::rngs::StdRng, f: WeightFormat, rows: usize, cols: usize) -> QMatrix {
    let mut raw: Vec<u8> = (0..rows * f.row_bytes(cols)).map(|_| rng.gen()).collect();
    let scale_at: &[usize] = if f == WeightFormat::Q6K { &[208] } else { &[0, 2] };
    for blk in raw.chunks_exact_mut(f.block_bytes()) {
        for &at in scale_at {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(rng.gen_range(0.001f32..0.05)).to_le_bytes());
        }
    }
    QMatrix::new(f, rows, cols, WeightBytes::owned(raw), "expert").expect("a well-formed random matrix")
}

fn list(arg: Option<&String>, default: &[usize]) -> Vec<usize> {
    arg.map_or(default.to_vec(), |s| s.split(',').map(|v| v.parse().expect("a number")).collect())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rows_list = list(args.get(1), &[128, 512]);
    let threads_list = list(args.get(2), &[1, 2]);
    let rounds: usize = args.get(3).map_or(8, |s| s.parse().expect("a number of rounds"));
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let router_bytes: Vec<u8> = (0..EXPERTS * HIDDEN).flat_map(|_| rng.gen_range(-1f32..1.0).to_le_bytes()).collect();
    let router = QMatrix::new(WeightFormat::F32, EXPERTS, HIDDEN, WeightBytes::owned(router_bytes), "router").expect("an f32 router");
    let experts = (0..EXPERTS)
        .map(|_| {
            let gate = random_matrix(&mut rng, WeightFormat::Q4K, EXPERT_FFN, HIDDEN);
            let up = random_matrix(&mut rng, WeightFormat::Q4K, EXPERT_FFN, HIDDEN);
            Some(DenseFfn::new(gate, up, random_matrix(&mut rng, WeightFormat::Q6K, HIDDEN, EXPERT_FFN)))
        })
        .collect();
    let moe = MoeFfn { router, router_bias: None, activation: Activation::SiluGate, experts, n_used: TOP_K, norm_topk: true, shared: None };
    println!("{:>6} {:>8} {:>10} {:>10} {:>10} {:>16} {:>7}", "rows", "threads", "median ms", "min ms", "GMAC/s", "int8 peak GMAC/s", "share");
    for &threads in &threads_list {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
        // one thread's peak times the threads (each core has its own vector units)
        let peak = specula_kernels::peak::int8_macs_per_second(0.3) * threads as f64 / 1e9;
        for &rows in &rows_list {
            let x: Vec<f32> = (0..rows * HIDDEN).map(|_| rng.gen_range(-1f32..1.0)).collect();
            let active = vec![true; rows];
            let mut out = vec![0f32; rows * HIDDEN];
            let mut times: Vec<f64> = pool.install(|| {
                (0..rounds + 1)
                    .map(|_| {
                        let s = Instant::now();
                        moe.forward(&x, &active, None, &mut out).expect("the layer runs");
                        s.elapsed().as_secs_f64()
                    })
                    .skip(1)
                    .collect()
            });
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            let macs = (rows * TOP_K * 3 * EXPERT_FFN * HIDDEN) as f64;
            let rate = macs / median / 1e9;
            println!("{rows:>6} {threads:>8} {:>10.2} {:>10.2} {rate:>10.1} {peak:>16.1} {:>6.0}%", median * 1e3, times[0] * 1e3, 100.0 * rate / peak);
        }
    }
}
