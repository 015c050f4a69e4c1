//! `bench offline --depth D[,D..]`: the long-context table. For each thread count and depth, a
//! D-token prompt prefilled in chunks of `--max-num-batched-tokens` (as the server schedules it),
//! then decode at batch 1 from that depth; beside llama.cpp's `llama-bench` on the same file
//! (flash attention on, its KV type set to ours where it has it: `-p D` and `-n N -d D`).

use anyhow::{Context, Result};
use specula_kernels::attention::KvLayout;
use specula_kernels::kv::KvDtype;
use specula_model::kv_store::KvStore;
use specula_model::llama::{ForwardBatch, SeqSpan};
use specula_model::LlamaModel;
use std::path::Path;
use std::time::Instant;

pub struct DepthRow {
    pub threads: usize,
    pub depth: usize,
    pub prefill: f64,
    pub decode: f64,
    pub llama_prefill: Option<f64>,
    pub llama_decode: Option<f64>,
}

/// Prompt tokens of the depth measurement: varied ids (not one repeated token), fixed.
fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| (100 + (i as u64 * 7919) % (vocab.saturating_sub(200).max(1) as u64)) as u32).collect()
}

/// Prefill of `depth` tokens in chunks of `chunk`, then `steps` greedy decode steps: (prefill
/// tok/s, decode tok/s). One sequence, its own KV store of the given type.
pub fn measure(model: &LlamaModel, depth: usize, chunk: usize, steps: usize, dtype: KvDtype) -> Result<(f64, f64)> {
    let c = &model.config;
    let bs = 16;
    let blocks = (depth + steps + 1).div_ceil(bs);
    let layout = KvLayout { block_size: bs, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
    let mut kv = KvStore::for_model(c, layout, blocks, dtype, 1)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let slot = |p: usize| table[p / bs] as usize * bs + p % bs;
    let tokens = prompt(depth, c.vocab_size);
    let start = Instant::now();
    let mut done = 0;
    let mut last = 0;
    while done < depth {
        let n = chunk.max(1).min(depth - done);
        let seqs = [SeqSpan { q_start: 0, q_len: n, context_len: done + n, block_table: &table }];
        let slots: Vec<usize> = (done..done + n).map(slot).collect();
        let o = model.forward(
            &ForwardBatch { tokens: &tokens[done..done + n], seqs: &seqs, slots: &slots, logits_rows: &[n - 1], hidden_layers: &[], state_slots: &[0] },
            &mut kv,
        )?;
        last = specula_engine::sampling::argmax(&o.logits).unwrap_or(0);
        done += n;
    }
    let prefill = depth as f64 / start.elapsed().as_secs_f64();
    let start = Instant::now();
    for step in 0..steps {
        let ctx = depth + step + 1;
        let seqs = [SeqSpan { q_start: 0, q_len: 1, context_len: ctx, block_table: &table }];
        let o = model.forward(
            &ForwardBatch { tokens: &[last], seqs: &seqs, slots: &[slot(ctx - 1)], logits_rows: &[0], hidden_layers: &[], state_slots: &[0] },
            &mut kv,
        )?;
        last = specula_engine::sampling::argmax(&o.logits).unwrap_or(0);
    }
    Ok((prefill, steps as f64 / start.elapsed().as_secs_f64()))
}

/// `llama-bench` prefill of `depth` tokens and decode of `steps` tokens at that depth, flash
/// attention on: (prefill tok/s, decode tok/s).
pub fn llama_bench(bin: &Path, model: &Path, threads: usize, depth: usize, steps: usize, batch: usize, dtype: KvDtype) -> Result<(f64, f64)> {
    let run = |extra: &[String]| -> Result<f64> {
        let mut cmd = std::process::Command::new(bin);
        cmd.arg("-m").arg(model).args(["-t", &threads.to_string(), "-fa", "1", "-r", "1", "-o", "json", "-ub", &batch.to_string()]);
        // our type names are llama.cpp's `-ctk` / `-ctv` names
        cmd.args(["-ctk", dtype.name(), "-ctv", dtype.name()]).args(extra);
        eprintln!("running {cmd:?} ...");
        let out = crate::baseline_tool::output(&mut cmd)?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("llama-bench printed no JSON")?;
        v.as_array().and_then(|a| a.first()).and_then(|e| e.get("avg_ts")).and_then(|x| x.as_f64()).context("llama-bench's JSON has no avg_ts")
    };
    let prefill = run(&["-p".into(), depth.to_string(), "-n".into(), "0".into()])?;
    let decode = run(&["-p".into(), "0".into(), "-n".into(), steps.to_string(), "-d".into(), depth.to_string()])?;
    Ok((prefill, decode))
}

/// Bytes one decode step at `depth` reads from the KV cache (every layer's keys and values).
pub fn kv_bytes_at(model: &LlamaModel, depth: usize, dtype: KvDtype) -> f64 {
    let c = &model.config;
    (depth * c.kv_bytes_per_token(dtype)) as f64
}

pub fn print(rows: &[DepthRow], model: &LlamaModel, weights_read: f64, dtype: KvDtype, chunk: usize) {
    println!("\nlong context: prompt prefilled in chunks of {chunk}, then decode batch 1 at that depth; KV cache {dtype}; llama.cpp flash attention on, the same KV type");
    println!(
        "{:>7} {:>7} {:>15} {:>15} {:>7} {:>14} {:>14} {:>7} {:>12} {:>8}",
        "threads", "depth", "prefill tok/s", "llama.cpp", "ratio", "decode tok/s", "llama.cpp", "ratio", "GB/token", "GB/s"
    );
    let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let ratio = |a: f64, b: Option<f64>| b.map_or("-".to_string(), |b| format!("{:.2}x", a / b));
    for r in rows {
        let gb = (weights_read + kv_bytes_at(model, r.depth, dtype)) / 1e9;
        println!(
            "{:>7} {:>7} {:>15.1} {:>15} {:>7} {:>14.2} {:>14} {:>7} {:>12.3} {:>8.1}",
            r.threads,
            r.depth,
            r.prefill,
            cell(r.llama_prefill),
            ratio(r.prefill, r.llama_prefill),
            r.decode,
            cell(r.llama_decode),
            ratio(r.decode, r.llama_decode),
            gb,
            gb * r.decode
        );
    }
}
