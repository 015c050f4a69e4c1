//! Microbenchmark of the packed int8 matmul on the shapes of the Qwen2.5-Coder models.
//!
//! `cargo run --release -p specula-kernels --example matmul_bench -- [filter] [rows,rows,..] [threads,..]`
//!
//! For each (format, shape): one activation row against enough copies of the matrix to total
//! ~160 MB (env BENCH_MB), rotated so the weights stream from memory as in decode (GB/s of weights), and many
//! rows against one copy (prefill: rows x weight elements / s, "Gw/s"; BENCH_ROTATE=1 streams every
//! row count from memory). Reports the median of several rounds; on a shared machine compare
//! builds interleaved, not across sessions. BENCH_IN_PLACE=1 reads the matrices in place
//! (`QMatrix::new_in_place`: each group repacked as it is read) instead of repacked at load.

use rand::{Rng, SeedableRng};
use specula_kernels::matmul::{matmul, MatmulInput};
use specula_kernels::{QMatrix, WeightBytes, WeightFormat};
use std::time::Instant;

fn random_raw(rng: &mut rand::rngs::StdRng, f: WeightFormat, rows: usize, cols: usize) -> Vec<u8> {
    let bb = f.block_bytes();
    let mut raw: Vec<u8> = (0..rows * f.row_bytes(cols)).map(|_| rng.gen()).collect();
    let fields: &[usize] = match f {
        WeightFormat::Q4_0 | WeightFormat::Q8_0 | WeightFormat::Q5_0 | WeightFormat::IQ4NL | WeightFormat::IQ4XS => &[0],
        WeightFormat::Q2K => &[80, 82],
        WeightFormat::Q3K => &[108],
        WeightFormat::Q4_1 | WeightFormat::Q5_1 | WeightFormat::Q4K | WeightFormat::Q5K => &[0, 2],
        WeightFormat::Q6K => &[208],
        _ => &[],
    };
    for blk in raw.chunks_exact_mut(bb) {
        for &at in fields {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(rng.gen_range(0.001f32..0.05)).to_le_bytes());
        }
        if f == WeightFormat::MXFP4 {
            // E8M0 scale: 2^-10 .. 4
            blk[0] = rng.gen_range(118..=130);
        }
    }
    raw
}

/// CPU time of the calling thread: on a shared machine a 1-thread run's CPU time is far less
/// noisy than its wall time.
fn thread_cpu_s() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: CLOCK_THREAD_CPUTIME_ID (3) and a valid out pointer.
    unsafe { clock_gettime(3, &mut t) };
    t.sec as f64 + t.nsec as f64 * 1e-9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let filter = args.get(1).cloned().unwrap_or_default();
    let row_counts: Vec<usize> = args.get(2).map(|s| s.split(',').map(|x| x.parse().unwrap()).collect()).unwrap_or(vec![1, 8, 64, 512]);
    let threads: Vec<usize> = args.get(3).map(|s| s.split(',').map(|x| x.parse().unwrap()).collect()).unwrap_or(vec![1, 2]);
    let shapes: &[(&str, WeightFormat, usize, usize)] = &[
        ("q/o Q4K", WeightFormat::Q4K, 1536, 1536),
        ("k Q4K", WeightFormat::Q4K, 256, 1536),
        ("v Q6K", WeightFormat::Q6K, 256, 1536),
        ("gate/up Q4K", WeightFormat::Q4K, 8960, 1536),
        ("down Q6K", WeightFormat::Q6K, 1536, 8960),
        ("down Q4K", WeightFormat::Q4K, 1536, 8960),
        ("lm_head Q6K", WeightFormat::Q6K, 151936, 1536),
        ("gate/up Q4_0", WeightFormat::Q4_0, 8960, 1536),
        ("gate/up Q4_1", WeightFormat::Q4_1, 8960, 1536),
        ("gate/up Q8_0", WeightFormat::Q8_0, 8960, 1536),
        ("0.5B up Q5_0", WeightFormat::Q5_0, 4864, 896),
        ("0.5B lm Q8_0", WeightFormat::Q8_0, 151936, 896),
        ("gate/up Q5K", WeightFormat::Q5K, 8960, 1536),
        ("gate/up Q2K", WeightFormat::Q2K, 8960, 1536),
        ("gate/up Q3K", WeightFormat::Q3K, 8960, 1536),
        ("gate/up IQ4XS", WeightFormat::IQ4XS, 8960, 1536),
        ("gate/up IQ4NL", WeightFormat::IQ4NL, 8960, 1536),
        ("gate/up MXFP4", WeightFormat::MXFP4, 8960, 1536),
        ("30B-A3B expert gate Q4K", WeightFormat::Q4K, 768, 2048),
        ("gpt-oss q Q8_0", WeightFormat::Q8_0, 4096, 2880),
        ("gpt-oss expert MXFP4", WeightFormat::MXFP4, 2880, 2880),
        ("30B-A3B expert down Q6K", WeightFormat::Q6K, 2048, 768),
    ];
    // BENCH_IN_PLACE=1: the matrices read in place (each group repacked as it is read)
    let in_place = std::env::var("BENCH_IN_PLACE").is_ok_and(|v| v == "1");
    let build = |f, rows, cols, raw: Vec<u8>, name: &str| match in_place {
        true => QMatrix::new_in_place(f, rows, cols, WeightBytes::owned(raw), name).unwrap(),
        false => QMatrix::new(f, rows, cols, WeightBytes::owned(raw), name).unwrap(),
    };
    let rotate = std::env::var("BENCH_ROTATE").is_ok_and(|v| v == "1");
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    println!("{:<14} {:>6} {:>4} {:>10} {:>9} {:>9}", "shape", "rows", "thr", "us/call", "GB/s", "Gw/s");
    println!("(last column at 1 thread: CPU us/call of the calling thread)");
    for &(name, f, rows, cols) in shapes {
        if !name.contains(filter.as_str()) {
            continue;
        }
        let raw = random_raw(&mut rng, f, rows, cols);
        let bytes = raw.len();
        let t = Instant::now();
        let m = build(f, rows, cols, raw.clone(), name);
        let pack_s = t.elapsed().as_secs_f64();
        let budget: usize = std::env::var("BENCH_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(160);
        let copies = (budget * 1_000_000 / bytes).clamp(1, 64);
        let mut ms = vec![m];
        for _ in 1..copies {
            ms.push(build(f, rows, cols, raw.clone(), name));
        }
        println!("{name:<14} pack {:.0} MB/s ({} MB, {} copies)", bytes as f64 / pack_s / 1e6, bytes / 1_000_000, copies);
        for &n in &row_counts {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
            let mut out = vec![0f32; n * rows];
            for &th in &threads {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(th).build().unwrap();
                let (per_call, cpu) = pool.install(|| {
                    // BENCH_ROTATE=1: every row count streams its weights from memory (a verify
                    // step of a few rows reads each layer's weights once, as decode does)
                    let set = if n <= 2 || rotate { &ms[..] } else { &ms[..1] };
                    // calls per round: ~30 ms of work
                    let mut calls = 1usize;
                    let mut times = Vec::new();
                    let mut cpu = Vec::new();
                    let mut k = 0;
                    for round in 0..9 {
                        let t = Instant::now();
                        let c = thread_cpu_s();
                        for _ in 0..calls {
                            let w = &set[k % set.len()];
                            k += 1;
                            let inp = MatmulInput::new(&x, cols, &[w]);
                            matmul(&inp, w, &mut out);
                        }
                        let e = t.elapsed().as_secs_f64();
                        cpu.push((thread_cpu_s() - c) / calls as f64);
                        if round == 0 {
                            calls = ((0.03 / (e / calls as f64)) as usize).max(1);
                        } else {
                            times.push(e / calls as f64);
                        }
                    }
                    cpu.remove(0);
                    (median(times), median(cpu))
                });
                // one thread: the caller's CPU time per call (less noisy on a shared machine)
                let t1 = if th == 1 { format!("{:>10.1}", cpu * 1e6) } else { String::new() };
                println!(
                    "{name:<14} {n:>6} {th:>4} {:>10.1} {:>9.2} {:>9.2} {t1}",
                    per_call * 1e6,
                    bytes as f64 / per_call / 1e9,
                    (n * rows * cols) as f64 / per_call / 1e9
                );
            }
        }
    }
}
