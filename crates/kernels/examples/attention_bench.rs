//! Microbenchmark of paged attention at depth, per KV type, on one layer of a model's shape.
//!
//! `cargo run --release -p specula-kernels --example attention_bench -- [depth] [threads,..] [heads,kv_heads,head_dim]`
//!
//! Decode: one query row at `depth` in each of `BENCH_LAYERS` (default 28, the 1.5B's count)
//! layers' caches in turn, as a decode step reads them (the cache read once per step: GB/s of KV;
//! with one layer a 16k cache of f16 fits a large L3 and the figure is the cache's, not memory's),
//! time per layer (`BENCH_TYPES=f16,q8_0` for some cache types only). Prefill: a chunk of
//! 512 rows at the end of a `depth`-token prompt (GFLOP/s, counting 2 x 2 x head_dim flops per
//! query-key pair: the scores and the weighted values). Default shape: Qwen2.5-Coder-1.5B (12
//! heads, 2 KV heads of 128). Median of several rounds. `BENCH_BS`: slots per KV block (16, the
//! engine's default `--block-size`). `BENCH_DECODE_ONLY=1`: no prefill chunk (a profile of the
//! decode alone).

use specula_kernels::attention::{paged_attention_windowed, KvLayout, SeqSpan};
use specula_kernels::kv::{KvDtype, KvPlane, KvRole};
use std::time::Instant;

/// The median; NaN (printed as such) for no rounds.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The count in environment variable `name`, or `default` when it is unset or not a number.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let depth: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(16384);
    let threads: Vec<usize> = args.get(1).map_or(vec![1, 2], |s| s.split(',').filter_map(|t| t.parse().ok()).collect());
    let shape: Vec<usize> = args.get(2).map_or(vec![12, 2, 128], |s| s.split(',').filter_map(|t| t.parse().ok()).collect());
    let bs = env_or("BENCH_BS", 16).max(1);
    let layout = KvLayout { block_size: bs, n_heads: shape[0], n_kv_heads: shape[1], head_dim: shape[2] };
    let kvw = layout.kv_width();
    let qw = layout.n_heads * layout.head_dim;
    let blocks = depth.div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let chunk = 512.min(depth);
    println!("attention at depth {depth}, {} heads / {} KV heads of {}", layout.n_heads, layout.n_kv_heads, layout.head_dim);
    println!("{:<6} {:>7} {:>12} {:>10} {:>14} {:>12}", "type", "threads", "decode ms", "KV GB/s", "prefill ms", "GFLOP/s");
    let layers: usize = env_or("BENCH_LAYERS", 28).max(1);
    println!("decode over {layers} layers' caches in turn (BENCH_LAYERS)");
    // BENCH_TYPES=f16,q8_0: only those cache types
    let types: Vec<KvDtype> = match std::env::var("BENCH_TYPES") {
        Ok(t) => t
            .split(',')
            .map(|t| {
                t.parse().unwrap_or_else(|e| {
                    eprintln!("BENCH_TYPES: {e}");
                    std::process::exit(2)
                })
            })
            .collect(),
        Err(_) => KvDtype::ALL.to_vec(),
    };
    for dtype in KvDtype::ALL.into_iter().filter(|d| types.contains(d)) {
        let row: Vec<f32> = (0..kvw).map(|i| (i as f32 * 0.37).sin()).collect();
        let planes: Vec<(KvPlane, KvPlane)> = (0..layers)
            .map(|_| {
                let mut k = KvPlane::new(KvRole::Keys, dtype, layout, blocks).expect("memory");
                let mut v = KvPlane::new(KvRole::Values, dtype, layout, blocks).expect("memory");
                for s in 0..blocks * bs {
                    k.write(s, &row);
                    v.write(s, &row);
                }
                (k, v)
            })
            .collect();
        let (k, v) = &planes[0];
        let kv_bytes = (k.bytes() + v.bytes()) as f64 * depth as f64 / (blocks * bs) as f64;
        for &t in &threads {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("pool");
            let q1: Vec<f32> = (0..qw).map(|i| (i as f32 * 0.013).cos()).collect();
            let mut o1 = vec![0f32; qw];
            let seq1 = [SeqSpan { q_start: 0, q_len: 1, context_len: depth, block_table: &table }];
            // BENCH_FLUSH_MB=35: that many MB read between two layers' attention (untimed), as a
            // decode step streams a layer's weights between them (a 1.5B Q4_K_M's 35 MB)
            let flush = vec![1u8; env_or("BENCH_FLUSH_MB", 0) << 20];
            let decode = median(
                (0..env_or("BENCH_DECODE_ROUNDS", 15))
                    .map(|_| {
                        let mut t = 0.0;
                        for (k, v) in &planes {
                            if !flush.is_empty() {
                                pool.install(|| std::hint::black_box(flush.chunks(64).fold(0u8, |a, c| a ^ c[0])));
                            }
                            let s = Instant::now();
                            pool.install(|| paged_attention_windowed(&q1, &mut o1, k.view(), v.view(), &layout, &seq1, 0.1, None, None));
                            t += s.elapsed().as_secs_f64();
                        }
                        t / layers as f64
                    })
                    .collect(),
            );
            let qn: Vec<f32> = (0..chunk * qw).map(|i| (i as f32 * 0.013).cos()).collect();
            let mut on = vec![0f32; chunk * qw];
            let seqn = [SeqSpan { q_start: 0, q_len: chunk, context_len: depth, block_table: &table }];
            // BENCH_DECODE_ONLY: no prefill chunk at all (a profile of the decode alone)
            let prefill_rounds = if std::env::var_os("BENCH_DECODE_ONLY").is_some() { 0 } else { 3 };
            let prefill = median(
                (0..prefill_rounds)
                    .map(|_| {
                        let s = Instant::now();
                        pool.install(|| paged_attention_windowed(&qn, &mut on, k.view(), v.view(), &layout, &seqn, 0.1, None, None));
                        s.elapsed().as_secs_f64()
                    })
                    .collect(),
            );
            let pairs = (0..chunk).map(|r| (depth - chunk + r + 1) as f64).sum::<f64>() * layout.n_heads as f64;
            let flops = pairs * 4.0 * layout.head_dim as f64;
            println!(
                "{:<6} {:>7} {:>12.3} {:>10.1} {:>14.1} {:>12.1}",
                dtype.name(),
                t,
                decode * 1e3,
                kv_bytes / decode / 1e9,
                prefill * 1e3,
                flops / prefill / 1e9
            );
        }
    }
}
