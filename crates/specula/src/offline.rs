//! `specula bench offline`: engine throughput without HTTP — prefill tokens/s on a long prompt
//! and decode tokens/s at several batch sizes and thread counts — printed beside candle's own
//! quantized Llama (candle-transformers, llama-family files only; built with the `candle-baseline`
//! feature) and, with `--llama-bench`,
//! llama.cpp's `llama-bench` (prefill and decode at batch 1) on the same GGUF in the same run; with
//! `--ik-bench`, ik_llama.cpp's (`-rtr 1 -fmoe 1`) beside it.
//! Decode at batch 1 is also given as a share of this machine's memory bound: the bytes a decode
//! step reads (every weight but the embedding table's unused rows) at the read bandwidth
//! measured in the same run (the fastest of `specula_kernels::bandwidth`'s read kernels).

use anyhow::{Context, Result};
use clap::Args;
use specula_kernels::attention::KvLayout;
use specula_kernels::bandwidth::ReadKernel;
use specula_model::kv_store::KvStore;
use specula_model::{load_model_with, Arch, ForwardBatch, LlamaModel, SeqSpan};
use std::path::PathBuf;
use std::time::Instant;

// candle's own quantized Llama, the first baseline: compiled only with the `candle-baseline`
// feature, so that the default binary does not compile candle-transformers
#[cfg(feature = "candle-baseline")]
mod candle_baseline;
#[cfg(not(feature = "candle-baseline"))]
mod candle_baseline {
    //! Stand-in without the `candle-baseline` feature: `AVAILABLE` is false, so nothing calls it.
    use anyhow::{bail, Result};
    use std::path::Path;

    pub const AVAILABLE: bool = false;
    const MISSING: &str = "this specula was built without the candle-baseline feature";

    pub fn prefill_tps(_path: &Path, _prompt: &[u32]) -> Result<f64> {
        bail!(MISSING)
    }

    pub fn decode_tps(_path: &Path, _batch: usize, _steps: usize) -> Result<f64> {
        bail!(MISSING)
    }
}

#[derive(Args, Debug)]
pub struct OfflineArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Thread counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Decode batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub batch: Vec<usize>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prefill_len: usize,
    /// Decode steps per measurement.
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Skip the candle baseline (only measured by a binary built with `--features candle-baseline`).
    #[arg(long)]
    pub no_baseline: bool,
    /// A `llama-bench` binary (llama.cpp) to run on the same file and thread counts as a second
    /// baseline: its pp{prefill-len} and tg{decode-steps} beside our prefill and decode at batch 1.
    #[arg(long)]
    pub llama_bench: Option<PathBuf>,
    /// ik_llama.cpp's `llama-bench` (scripts/build_ik_llama.sh builds it), run with run-time
    /// repacking and fused MoE (`-rtr 1 -fmoe 1`) on the same file and thread counts: a third
    /// baseline beside llama.cpp's.
    #[arg(long)]
    pub ik_bench: Option<PathBuf>,
    /// Timed repetitions of each measurement after one warm-up (the mean is reported, as
    /// llama-bench does).
    #[arg(long, default_value_t = 2)]
    pub reps: usize,
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// How a mixture-of-experts model's expert weights are held (as `serve --expert-weights`).
    #[arg(long, value_enum, default_value_t = crate::engine_args::ExpertWeightsArg::Auto)]
    pub expert_weights: crate::engine_args::ExpertWeightsArg,
    /// Also print the cost of verifying 1 + k tokens (k = 0..=8) of one sequence relative to 1.
    #[arg(long)]
    pub verify_curve: bool,
    /// Instead of the kernel-level table: the engine decoding --async-batch copy-passage requests
    /// with n-gram speculation, with and without --async-scheduling, per-phase step times.
    #[arg(long)]
    pub async_compare: bool,
    #[arg(long, default_value_t = 8)]
    pub async_batch: usize,
    #[arg(long, default_value_t = 128)]
    pub async_max_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub async_k: usize,
    /// Interleaved sync/async pairs per thread count (machine drift hits both modes alike; the
    /// summary gives the mean of the pairwise ratios).
    #[arg(long, default_value_t = 1)]
    pub async_repeat: usize,
    /// Instead of the kernel-level table: the long-context table, a prompt of each of these
    /// lengths prefilled in chunks of --max-num-batched-tokens, then --decode-steps at batch 1
    /// from that depth (beside llama-bench's `-p D` and `-n N -d D` with flash attention).
    #[arg(long, value_delimiter = ',')]
    pub depth: Vec<usize>,
    /// The KV cache's type for the measurements (as `serve --kv-cache-dtype`).
    #[arg(long, value_enum, default_value_t = crate::engine_args::KvDtypeArg::Auto)]
    pub kv_cache_dtype: crate::engine_args::KvDtypeArg,
    /// Prefill chunk of the long-context table (the server's --max-num-batched-tokens).
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
}

struct Row {
    what: String,
    threads: usize,
    ours: f64,
    candle: Option<f64>,
    llama_cpp: Option<f64>,
    ik: Option<f64>,
}

/// One warm-up call of `f`, then the mean of `reps` timed calls (each returns tokens/s).
fn mean_tps(reps: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    f()?;
    let reps = reps.max(1);
    let mut sum = 0.0;
    for _ in 0..reps {
        sum += f()?;
    }
    Ok(sum / reps as f64)
}

/// llama-bench's tokens/s per (threads, n_prompt, n_gen) for the file, from its JSON output.
fn run_llama_bench(
    bin: &std::path::Path,
    model: &std::path::Path,
    threads: &[usize],
    prefill: &str,
    decode: usize,
    reps: usize,
    extra: &[&str],
) -> Result<Vec<(usize, usize, usize, f64)>> {
    let t = threads.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    eprintln!("running {} on {} (threads {t}) ...", bin.display(), model.display());
    let out = crate::baseline_tool::output(
        std::process::Command::new(bin)
            .arg("-m")
            .arg(model)
            .args(["-t", &t, "-p", prefill, "-n", &decode.to_string(), "-r", &reps.max(1).to_string(), "-o", "json"])
            .args(extra),
    )?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("llama-bench printed no JSON")?;
    let entries = v.as_array().context("llama-bench's JSON is not a list")?;
    Ok(entries
        .iter()
        .filter_map(|e| {
            let n = |k: &str| e.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
            Some((n("n_threads")?, n("n_prompt")?, n("n_gen")?, e.get("avg_ts")?.as_f64()?))
        })
        .collect())
}

pub fn run(args: OfflineArgs) -> Result<()> {
    let path = crate::fetch::resolve_model(&args.model)?;
    if args.async_compare {
        let rows = crate::offline_async::run(&path, &args.threads, args.async_batch, args.async_max_tokens, args.async_k, args.async_repeat.max(1))?;
        if let Some(p) = args.output_json {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            let j: Vec<_> = rows
                .iter()
                .map(|r| {
                    let m = &r.mean;
                    serde_json::json!({"threads": r.threads, "async_scheduling": r.async_scheduling, "output_tok_s": r.output_tok_s, "decode_steps": r.steps,
                        "ms": {"schedule": ms(m.schedule), "prepare": ms(m.prepare), "finalize": ms(m.finalize), "forward": ms(m.forward), "sample": ms(m.sample), "propose": ms(m.propose), "update": ms(m.update), "gap": ms(m.gap.unwrap_or_default()), "idle_gap": ms(m.host_gap.unwrap_or_default()), "step": ms(r.step_wall)}})
                })
                .collect();
            std::fs::write(&p, serde_json::to_string_pretty(&j)?)?;
        }
        return Ok(());
    }
    // llama.cpp first, before our copy of the weights is resident: a 30B MoE file is most of
    // the machine's memory, and both at once would page
    let bench = |bin: &Option<PathBuf>, extra: &[&str]| match bin {
        Some(b) if args.depth.is_empty() => run_llama_bench(b, &path, &args.threads, &args.prefill_len.to_string(), args.decode_steps, args.reps, extra),
        _ => Ok(Vec::new()),
    };
    let llama_runs = bench(&args.llama_bench, &[])?;
    let ik_runs = bench(&args.ik_bench, &["-rtr", "1", "-fmoe", "1"])?;
    let llama_verify = match (&args.llama_bench, args.verify_curve) {
        (Some(b), true) => llama_verify_curve(b, &path, &args.threads, VERIFY_MAX_K)?,
        _ => Vec::new(),
    };
    // the file's prediction layer, when it has one, is timed beside the verify curve
    let options = specula_model::LoadOptions { expert_weights: args.expert_weights.into(), nextn: args.verify_curve };
    let loaded = load_model_with(&path, &options)?;
    let model = &loaded.model;
    let in_place = model.in_place_bytes();
    if in_place > 0 {
        eprintln!("expert weights read in place from the map: {:.2} GB", in_place as f64 / 1e9);
    }
    eprintln!("{}", specula_kernels::cpu::describe());
    let prompt: Vec<u32> = (0..args.prefill_len).map(|i| 100 + (i as u32 * 7919) % 40000).collect();
    // candle-transformers' quantized_llama reads llama-family files only
    let candle_ok = !args.no_baseline && matches!(model.config.arch, Arch::Llama | Arch::Mistral) && model.config.moe.is_none();
    if candle_ok && !candle_baseline::AVAILABLE {
        eprintln!("no candle column: this binary was built without the candle baseline (cargo build --release -p specula --features candle-baseline)");
    }
    let candle_ok = candle_ok && candle_baseline::AVAILABLE;
    let at =
        |runs: &[(usize, usize, usize, f64)], threads: usize, p: usize, n: usize| runs.iter().find(|e| e.0 == threads && e.1 == p && e.2 == n).map(|e| e.3);
    if !args.depth.is_empty() {
        return run_depths(&args, &path, &loaded);
    }
    let mut rows = Vec::new();
    // the memory bound first, so its 1 GiB is gone before the model is timed
    let stream = bandwidth_buffer();
    let bounds = per_thread_count(&args.threads, |pool| pool.install(|| read_bandwidth(&stream)))?;
    drop(stream);
    // and the int8 dot peak, each of the pool's threads running it at once
    let peaks = per_thread_count(&args.threads, |pool| pool.broadcast(|_| specula_kernels::peak::int8_macs_per_second(0.3)).iter().sum::<f64>())?;
    for &threads in &args.threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
        let ours = pool.install(|| mean_tps(args.reps, || prefill_tps(model, &prompt)))?;
        let candle = if candle_ok { Some(pool.install(|| candle_baseline::prefill_tps(&path, &prompt))?) } else { None };
        let (llama_cpp, ik) = (at(&llama_runs, threads, prompt.len(), 0), at(&ik_runs, threads, prompt.len(), 0));
        rows.push(Row { what: format!("prefill {} tok", prompt.len()), threads, ours, candle, llama_cpp, ik });
        let score = pool.install(|| mean_tps(args.reps, || score_tps(model, &prompt, SCORE_TOP_K)))?;
        eprintln!("scoring at {threads} thread(s): {:.2}x plain prefill", score / ours);
        rows.push(Row { what: format!("score {} tok, top-{SCORE_TOP_K}", prompt.len()), threads, ours: score, candle: None, llama_cpp: None, ik: None });
        for &b in &args.batch {
            let ours = pool.install(|| mean_tps(args.reps, || decode_tps(model, b, args.decode_steps)))?;
            let candle = if candle_ok { Some(pool.install(|| candle_baseline::decode_tps(&path, b, args.decode_steps))?) } else { None };
            let (llama_cpp, ik) =
                if b == 1 { (at(&llama_runs, threads, 0, args.decode_steps), at(&ik_runs, threads, 0, args.decode_steps)) } else { (None, None) };
            rows.push(Row { what: format!("decode batch {b}"), threads, ours, candle, llama_cpp, ik });
        }
    }
    println!("\nspecula bench offline — {} ({})", loaded.name, specula_kernels::cpu::describe());
    println!("weights mapped: {:.2} GB", loaded.weight_bytes as f64 / 1e9);
    println!(
        "{:<22} {:>7} {:>14} {:>14} {:>8} {:>14} {:>8} {:>14} {:>8}",
        "measurement", "threads", "specula tok/s", "candle tok/s", "ratio", "llama.cpp tok/s", "ratio", "ik_llama tok/s", "ratio"
    );
    let cell = |base: Option<f64>, ours: f64| match base {
        Some(c) => (format!("{c:.1}"), format!("{:.2}x", ours / c)),
        None => ("-".into(), "-".into()),
    };
    for r in &rows {
        let (c, cr) = cell(r.candle, r.ours);
        let (l, lr) = cell(r.llama_cpp, r.ours);
        let (k, kr) = cell(r.ik, r.ours);
        println!("{:<22} {:>7} {:>14.1} {:>14} {:>8} {:>14} {:>8} {:>14} {:>8}", r.what, r.threads, r.ours, c, cr, l, lr, k, kr);
    }
    let per_token = decode_bytes(model, loaded.weight_bytes);
    println!("\nmemory bound of decode batch 1: {:.2} GB read per token", per_token / 1e9);
    println!("{:>7} {:>16} {:>12} {:>14} {:>8}  fastest read kernel", "threads", "read GB/s", "bound tok/s", "specula tok/s", "share");
    for (threads, per_kernel) in &bounds {
        let ours = rows.iter().find(|r| r.threads == *threads && r.what == "decode batch 1").map(|r| r.ours);
        let (kernel, bw) = best_read(per_kernel);
        let bound = bw / per_token;
        let (o, share) = rate_and_share(ours, bound);
        println!("{:>7} {:>16.1} {:>12.1} {:>14} {:>8}  {}", threads, bw / 1e9, bound, o, share, kernel.name());
    }
    println!("read GB/s by kernel:");
    for (threads, per_kernel) in &bounds {
        let each: Vec<String> = per_kernel.iter().map(|(k, bw)| format!("{} {:.1}", k.name(), bw / 1e9)).collect();
        println!("  {threads} thread(s): {}", each.join("; "));
    }
    let macs = prefill_macs(model);
    if peaks.iter().any(|&(_, p)| p > 0.0) {
        println!("\ncompute bound of prefill: {:.2} GMAC per token (the weight matmuls; attention's products not counted) at the int8 dot peak", macs / 1e9);
        println!(
            "{:>7} {:>16} {:>12} {:>14} {:>8} {:>16} {:>8} {:>14} {:>8}",
            "threads", "int8 peak GMAC/s", "bound tok/s", "specula tok/s", "share", "llama.cpp tok/s", "share", "ik_llama tok/s", "share"
        );
        let prefill = format!("prefill {} tok", prompt.len());
        for &(threads, peak) in &peaks {
            let bound = peak / macs;
            let row = rows.iter().find(|r| r.threads == threads && r.what == prefill);
            let (o, os) = rate_and_share(row.map(|r| r.ours), bound);
            let (l, ls) = rate_and_share(row.and_then(|r| r.llama_cpp), bound);
            let (k, ks) = rate_and_share(row.and_then(|r| r.ik), bound);
            println!("{:>7} {:>16.1} {:>12.1} {:>14} {:>8} {:>16} {:>8} {:>14} {:>8}", threads, peak / 1e9, bound, o, os, l, ls, k, ks);
        }
    }
    if args.verify_curve {
        println!("\nverify cost curve (one sequence, context {VERIFY_CONTEXT}, fastest of {VERIFY_ROUNDS} interleaved rounds): time of a 1 + k token step relative to a 1-token step");
        println!("{:>3} {:>8} {:>10} {:>8} {:>16} {:>16}", "k", "threads", "step ms", "relative", "llama.cpp ms", "llama.cpp rel.");
        for &threads in &args.threads {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
            let times = pool.install(|| verify_curve(model, VERIFY_MAX_K))?;
            let theirs: Vec<f64> = llama_verify.iter().filter(|r| r.0 == threads).map(|r| r.2).collect();
            for (k, t) in times.iter().enumerate() {
                let (l, lr) = match (theirs.get(k), theirs.first()) {
                    (Some(&l), Some(&l0)) => (format!("{:.2}", l * 1e3), format!("{:.2}", l / l0)),
                    _ => ("-".into(), "-".into()),
                };
                println!("{:>3} {:>8} {:>10.2} {:>8.2} {:>16} {:>16}", k, threads, t * 1e3, t / times[0], l, lr);
            }
            if model.nextn.is_some() {
                let vocab = model.config.vocab_size;
                let cut = specula_engine::speculative::config::draft_vocab_size(None, vocab);
                for keep in [vocab, cut].into_iter().collect::<std::collections::BTreeSet<_>>().into_iter().rev() {
                    let ids: Vec<u32> = (0..keep as u32).collect();
                    let t = pool.install(|| nextn_draft_step(model, &ids))?;
                    println!(
                        "the file's prediction layer (nextn), one draft token over {keep} output rows: {:.2} ms, {:.3} of a 1-token step ({threads} threads)",
                        t * 1e3,
                        t / times[0]
                    );
                }
            }
        }
    }
    if let Some(p) = args.output_json {
        let j: Vec<_> =
            rows.iter().map(|r| serde_json::json!({"measurement": r.what, "threads": r.threads, "specula_tok_s": r.ours, "candle_tok_s": r.candle, "llama_cpp_tok_s": r.llama_cpp, "ik_llama_cpp_tok_s": r.ik})).collect();
        std::fs::write(&p, serde_json::to_string_pretty(&j)?)?;
    }
    Ok(())
}

/// The long-context table (`--depth`): llama.cpp's runs first for each thread count and depth
/// would page against our copy of a large model, so a small file is assumed here (both resident).
fn run_depths(args: &OfflineArgs, path: &std::path::Path, loaded: &specula_model::LoadedModel) -> Result<()> {
    use crate::offline_depth as d;
    let dtype = specula_kernels::kv::KvDtype::from(args.kv_cache_dtype);
    let model = &loaded.model;
    let mut rows = Vec::new();
    for &threads in &args.threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
        for &depth in &args.depth {
            let (llama_prefill, llama_decode) = match &args.llama_bench {
                Some(b) => {
                    let (p, dd) = d::llama_bench(b, path, threads, depth, args.decode_steps, args.max_num_batched_tokens, dtype)?;
                    (Some(p), Some(dd))
                }
                None => (None, None),
            };
            let (prefill, decode) = pool.install(|| d::measure(model, depth, args.max_num_batched_tokens, args.decode_steps, dtype))?;
            eprintln!("threads {threads} depth {depth}: prefill {prefill:.1} tok/s, decode {decode:.2} tok/s");
            rows.push(d::DepthRow { threads, depth, prefill, decode, llama_prefill, llama_decode });
        }
    }
    println!("\nspecula bench offline --depth — {} ({})", loaded.name, specula_kernels::cpu::describe());
    d::print(&rows, model, decode_bytes(model, loaded.weight_bytes), dtype, args.max_num_batched_tokens);
    if let Some(p) = &args.output_json {
        let j: Vec<_> = rows
            .iter()
            .map(|r| serde_json::json!({"threads": r.threads, "depth": r.depth, "kv_cache_dtype": dtype.name(), "prefill_tok_s": r.prefill, "decode_tok_s": r.decode, "llama_cpp_prefill_tok_s": r.llama_prefill, "llama_cpp_decode_tok_s": r.llama_decode}))
            .collect();
        std::fs::write(p, serde_json::to_string_pretty(&j)?)?;
    }
    Ok(())
}

/// `measure` on a pool of each of `threads`' sizes: (threads, its result).
fn per_thread_count<T>(threads: &[usize], measure: impl Fn(&rayon::ThreadPool) -> T) -> Result<Vec<(usize, T)>> {
    threads.iter().map(|&t| Ok((t, measure(&rayon::ThreadPoolBuilder::new().num_threads(t).build()?)))).collect()
}

/// A measured rate and its share of `bound`, as table cells ("-" for both where not measured).
fn rate_and_share(rate: Option<f64>, bound: f64) -> (String, String) {
    rate.map_or(("-".into(), "-".into()), |v| (format!("{v:.1}"), format!("{:.0}%", 100.0 * v / bound)))
}

/// Multiply-accumulates of the weight matmuls one prompt token costs: every layer's projections,
/// of a mixture of experts the router, the routed experts (k of them, at the held experts' mean
/// size) and a shared expert; not the embedding (a lookup), nor the output projection (prefill
/// scores its last token only), nor attention's own products (they grow with the context).
fn prefill_macs(model: &LlamaModel) -> f64 {
    use specula_model::llama::FeedForward;
    let mm = |m: &specula_kernels::QMatrix| (m.rows * m.cols) as f64;
    let dense = |d: &specula_model::moe::DenseFfn| mm(&d.gate) + mm(&d.up) + mm(&d.down);
    let ffn = |f: &FeedForward| match f {
        FeedForward::Dense(d) => dense(d),
        FeedForward::Moe(m) => {
            let held: Vec<f64> = m.experts.iter().flatten().map(dense).collect();
            let mean = held.iter().sum::<f64>() / held.len().max(1) as f64;
            let shared = m.shared.as_ref().map_or(0.0, |s| dense(&s.ffn) + s.gate.as_ref().map_or(0.0, mm));
            mm(&m.router) + m.n_used as f64 * mean + shared
        }
    };
    model.layers.iter().map(|l| l.mixer_matrices().into_iter().map(mm).sum::<f64>() + ffn(&l.ffn)).sum()
}

/// Bytes one decode step of one sequence reads: every weight, less the embedding table (one row
/// of it is read) unless it is the output projection too, and of a mixture of experts only the
/// k experts a token is routed to (on average k / E of the experts' bytes).
fn decode_bytes(model: &LlamaModel, weight_bytes: usize) -> f64 {
    let embed = model.embed.rows * model.embed.row_bytes();
    let tied = std::ptr::eq(model.embed.row(0).as_ptr(), model.lm_head.row(0).as_ptr());
    let mut unread = 0f64;
    for l in &model.layers {
        if let specula_model::llama::FeedForward::Moe(m) = &l.ffn {
            let experts: usize = m.experts.iter().flatten().map(|e| e.gate.bytes().len() + e.up.bytes().len() + e.down.bytes().len()).sum();
            unread += experts as f64 * (1.0 - m.n_used as f64 / m.n_experts().max(1) as f64);
        }
    }
    (weight_bytes - if tied { 0 } else { embed }) as f64 - unread
}

/// What `read_bandwidth` streams: 1 GiB, huge-page backed as the packed weights are, every page
/// written once (so none is a shared zero page). Made once for every thread count.
fn bandwidth_buffer() -> specula_kernels::buffer::Buffer {
    use rayon::prelude::*;
    let mut buf = specula_kernels::buffer::Buffer::zeroed(1 << 30);
    buf.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| c.fill(i as u8 | 1));
    buf
}

/// Bytes read per second by the current pool's threads streaming `buf`, each its own contiguous
/// share, with each read kernel this CPU runs (`specula_kernels::bandwidth`): the fastest of 3
/// passes of each, kernels interleaved pass by pass so a noisy neighbour hits them alike.
fn read_bandwidth(buf: &[u8]) -> Vec<(ReadKernel, f64)> {
    use rayon::prelude::*;
    let share = buf.len().div_ceil(rayon::current_num_threads());
    let kernels = ReadKernel::available();
    let mut best = vec![f64::MAX; kernels.len()];
    let mut check = 0u64;
    for _ in 0..3 {
        for (k, b) in kernels.iter().zip(best.iter_mut()) {
            let t = Instant::now();
            check = check.wrapping_add(buf.par_chunks(share).map(|c| k.read(c)).reduce(|| 0, u64::wrapping_add));
            *b = b.min(t.elapsed().as_secs_f64());
        }
    }
    std::hint::black_box(check);
    kernels.into_iter().zip(best).map(|(k, t)| (k, buf.len() as f64 / t)).collect()
}

/// The fastest kernel's figure.
fn best_read(per_kernel: &[(ReadKernel, f64)]) -> (ReadKernel, f64) {
    per_kernel.iter().copied().fold((ReadKernel::OneStream, 0.0), |b, k| if k.1 > b.1 { k } else { b })
}

fn kv_for(model: &LlamaModel, tokens_per_seq: usize, seqs: usize) -> Result<(KvStore, Vec<Vec<u32>>)> {
    let c = &model.config;
    let layout = KvLayout { block_size: 16, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
    let per = tokens_per_seq.div_ceil(16);
    let kv = KvStore::for_model(c, layout, per * seqs, specula_kernels::kv::KvDtype::default(), seqs)?;
    let tables = (0..seqs).map(|s| ((s * per) as u32..((s + 1) * per) as u32).collect()).collect();
    Ok((kv, tables))
}

/// One sequence's whole prompt in one forward pass into a fresh cache, with logits for `rows`;
/// the logits and when the pass started.
fn prefill(model: &LlamaModel, prompt: &[u32], rows: &[usize]) -> Result<(Vec<f32>, Instant)> {
    let (mut kv, tables) = kv_for(model, prompt.len(), 1)?;
    let seqs = [SeqSpan { q_start: 0, q_len: prompt.len(), context_len: prompt.len(), block_table: &tables[0] }];
    let slots: Vec<usize> = (0..prompt.len()).map(|p| tables[0][p / 16] as usize * 16 + p % 16).collect();
    let start = Instant::now();
    let out = model.forward(&ForwardBatch { tokens: prompt, seqs: &seqs, slots: &slots, logits_rows: rows, hidden_layers: &[], state_slots: &[0] }, &mut kv)?;
    Ok((out.logits, start))
}

fn prefill_tps(model: &LlamaModel, prompt: &[u32]) -> Result<f64> {
    let (_, start) = prefill(model, prompt, &[prompt.len() - 1])?;
    Ok(prompt.len() as f64 / start.elapsed().as_secs_f64())
}

/// Top-k alternatives the scoring measurement asks for (lm-evaluation-harness asks 1; 5 is a
/// common `logprobs` setting).
const SCORE_TOP_K: usize = 5;

/// Prompt scoring (what `echo` + `logprobs` and `prompt_logprobs` cost): the prefill with logits
/// for every prompt row, then each row's log-softmax at the next prompt token and its top-k, as
/// the engine's compute job does (`ranked_logprobs`, over the pool's threads). Prompt tokens per second.
fn score_tps(model: &LlamaModel, prompt: &[u32], k: usize) -> Result<f64> {
    let rows: Vec<usize> = (0..prompt.len() - 1).collect();
    let (logits, start) = prefill(model, prompt, &rows)?;
    let targets: Vec<(usize, u32)> = rows.iter().map(|&r| (r, prompt[r + 1])).collect();
    std::hint::black_box(specula_engine::sampling::ranked_logprobs(&logits, model.config.vocab_size, &targets, k)?);
    Ok(prompt.len() as f64 / start.elapsed().as_secs_f64())
}

/// The engine's greedy choice (lowest id on ties); 0 for an all-NaN row.
fn argmax(x: &[f32]) -> u32 {
    specula_engine::sampling::argmax(x).unwrap_or(0)
}

fn decode_tps(model: &LlamaModel, batch: usize, steps: usize) -> Result<f64> {
    let prompt_len = 16;
    let (mut kv, tables) = kv_for(model, prompt_len + steps + 1, batch)?;
    let vocab = model.config.vocab_size;
    // prefill each sequence (different prompts) then decode in lockstep
    let mut last = Vec::new();
    for (s, table) in tables.iter().enumerate() {
        let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| 200 + i * 13 + s as u32).collect();
        let seqs = [SeqSpan { q_start: 0, q_len: prompt_len, context_len: prompt_len, block_table: table }];
        let slots: Vec<usize> = (0..prompt_len).map(|p| table[p / 16] as usize * 16 + p % 16).collect();
        let o = model.forward(
            &ForwardBatch { tokens: &prompt, seqs: &seqs, slots: &slots, logits_rows: &[prompt_len - 1], hidden_layers: &[], state_slots: &[s] },
            &mut kv,
        )?;
        last.push(argmax(&o.logits));
    }
    let start = Instant::now();
    for step in 0..steps {
        let ctx = prompt_len + step + 1;
        let seqs: Vec<SeqSpan> = tables.iter().enumerate().map(|(s, t)| SeqSpan { q_start: s, q_len: 1, context_len: ctx, block_table: t }).collect();
        let slots: Vec<usize> = tables.iter().map(|t| t[(ctx - 1) / 16] as usize * 16 + (ctx - 1) % 16).collect();
        let rows: Vec<usize> = (0..batch).collect();
        let o =
            model.forward(&ForwardBatch { tokens: &last, seqs: &seqs, slots: &slots, logits_rows: &rows, hidden_layers: &[], state_slots: &rows }, &mut kv)?;
        last = o.logits.chunks_exact(vocab).map(argmax).collect();
    }
    Ok((batch * steps) as f64 / start.elapsed().as_secs_f64())
}

/// Context of the verify-cost measurement: about a chat prompt and half its answer.
const VERIFY_CONTEXT: usize = 128;
/// Rounds of the verify-cost measurement; each round times every k once, so the machine's drift
/// (10-15% over a minute on these shared hosts) hits all k alike, and the fastest is reported.
const VERIFY_ROUNDS: usize = 24;

/// Largest k of the verify-cost curve.
const VERIFY_MAX_K: usize = 8;

/// llama.cpp's verify curve: llama-bench's time for a batch of 1 + k tokens at depth
/// `VERIFY_CONTEXT` (what its speculative verification computes), k = 0..=max_k, per thread
/// count: (threads, k, seconds).
fn llama_verify_curve(bin: &std::path::Path, model: &std::path::Path, threads: &[usize], max_k: usize) -> Result<Vec<(usize, usize, f64)>> {
    let sizes = (1..=max_k + 1).map(|n| n.to_string()).collect::<Vec<_>>().join(",");
    let runs = run_llama_bench(bin, model, threads, &sizes, 0, 5, &["-d", &VERIFY_CONTEXT.to_string()])?;
    let mut rows: Vec<(usize, usize, f64)> = runs
        .into_iter()
        .filter(|&(_, tokens, _, ts)| tokens >= 1 && ts > 0.0)
        .map(|(threads, tokens, _, ts)| (threads, tokens - 1, tokens as f64 / ts))
        .collect();
    rows.sort_by_key(|r| (r.0, r.1));
    Ok(rows)
}

/// Seconds of one draft token of the file's prediction layer proposing `keep` (fastest of 20):
/// one row through it at the start of a sequence (its attention over one row).
fn nextn_draft_step(model: &LlamaModel, keep: &[u32]) -> Result<f64> {
    let head = specula_engine::speculative::mtp::MtpProposer::from_nextn(model, keep)?;
    let hidden = vec![0.5f32; model.config.hidden_size];
    let mut best = f64::INFINITY;
    for _ in 0..20 {
        let t = std::time::Instant::now();
        std::hint::black_box(head.teacher_forced(&[1, 2], &hidden)?);
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Seconds per step of one sequence at context `VERIFY_CONTEXT` computing 1 + k new tokens,
/// k = 0..=max_k (the engine's start-up measurement, `speculative::cost`, with more rounds).
fn verify_curve(model: &LlamaModel, max_k: usize) -> Result<Vec<f64>> {
    let points: Vec<usize> = (1..=max_k + 1).collect();
    Ok(specula_engine::speculative::cost::time_forward(model, &points, VERIFY_CONTEXT, VERIFY_ROUNDS)?.into_iter().map(|(_, t)| t).collect())
}
