//! `specula debug kv-fidelity`: what storing the KV cache in a smaller type costs, teacher-forced.
//! One long prompt (real text) runs chunk by chunk through an f32 cache and, beside it, through a
//! cache of each type asked for; at every position the KL divergence of the type's next-token
//! distribution from the f32 one and whether their top tokens agree, reported per range of
//! positions (where a long context's errors would accumulate). With `--llama-perplexity PATH`,
//! llama.cpp's own caches of the same types against its f32 cache on the same text and length
//! (`llama-perplexity --kl-divergence`, which scores the second half of its window; its f32 run
//! without flash attention, which would round an f32 cache to f16) print beside.

use anyhow::{Context, Result};
use clap::Args;
use specula_kernels::attention::KvLayout;
use specula_kernels::kv::KvDtype;
use specula_model::kv_store::KvStore;
use specula_model::{ForwardBatch, LlamaModel, SeqSpan};
use std::path::PathBuf;

#[derive(Args)]
pub struct KvFidelityArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Text to run (default: this machine's Python standard library sources, concatenated).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Types to compare against f32.
    #[arg(long, value_delimiter = ',', default_value = "f16,bf16,q8_0,q4_0")]
    pub types: Vec<String>,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// llama.cpp's `llama-perplexity` (scripts/build_llama_cpp.sh builds it): its KL for the same
    /// types on the same text, over positions tokens/2..tokens, beside ours.
    #[arg(long)]
    pub llama_perplexity: Option<PathBuf>,
}

/// Python sources of this machine's standard library, in a fixed order, until `bytes` are read.
fn default_text(bytes: usize) -> Result<String> {
    let out = std::process::Command::new("python3").args(["-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"]).output()?;
    let dir = PathBuf::from(String::from_utf8(out.stdout)?.trim());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "py"))
        .collect();
    files.sort();
    let mut text = String::new();
    for f in files {
        if text.len() >= bytes {
            break;
        }
        text.push_str(&std::fs::read_to_string(&f).unwrap_or_default());
    }
    Ok(text)
}

/// log-softmax of a row, in f64.
fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - z).collect()
}

struct Runner<'a> {
    model: &'a LlamaModel,
    kv: KvStore,
}

impl Runner<'_> {
    fn chunk(&mut self, tokens: &[u32], done: usize) -> Result<Vec<f32>> {
        let n = tokens.len();
        let table: Vec<u32> = (0..self.kv.num_blocks as u32).collect();
        let seqs = [SeqSpan { q_start: 0, q_len: n, context_len: done + n, block_table: &table }];
        let slots: Vec<usize> = (done..done + n).collect();
        let rows: Vec<usize> = (0..n).collect();
        Ok(self
            .model
            .forward(&ForwardBatch { tokens, seqs: &seqs, slots: &slots, logits_rows: &rows, hidden_layers: &[], state_slots: &[0] }, &mut self.kv)?
            .logits)
    }
}

pub fn run(a: KvFidelityArgs) -> Result<()> {
    let path = crate::fetch::resolve_model(&a.model)?;
    let loaded = specula_model::load_model(&path)?;
    let model = &loaded.model;
    let text = match &a.text {
        Some(p) => std::fs::read_to_string(p)?,
        None => default_text(a.tokens * 6)?,
    };
    let mut ids = loaded.tokenizer.encode(&text)?;
    anyhow::ensure!(ids.len() >= a.tokens, "the text has {} tokens, fewer than --tokens {}", ids.len(), a.tokens);
    ids.truncate(a.tokens);
    let types: Vec<KvDtype> = a.types.iter().map(|t| t.parse::<KvDtype>()).collect::<Result<_, _>>()?;
    let c = &model.config;
    let layout = KvLayout { block_size: 16, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
    let blocks = a.tokens.div_ceil(16);
    let store = |d| KvStore::for_model(c, layout, blocks, d, 1);
    let mut base = Runner { model, kv: store(KvDtype::F32)? };
    let mut others: Vec<Runner> = types.iter().map(|&d| Ok(Runner { model, kv: store(d)? })).collect::<Result<_>>()?;
    // position ranges: doubling from 512
    let mut edges = vec![0usize];
    let mut e = 512;
    while e < a.tokens {
        edges.push(e);
        e *= 2;
    }
    edges.push(a.tokens);
    let ranges = edges.len() - 1;
    // per type and range: (sum of KL, top-1 agreements, positions)
    let mut acc = vec![vec![(0f64, 0usize, 0usize); ranges]; types.len()];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(a.threads).build()?;
    let vocab = c.vocab_size;
    let bar = indicatif::ProgressBar::new(a.tokens as u64);
    let mut done = 0;
    while done < a.tokens {
        let n = a.chunk.max(1).min(a.tokens - done);
        let chunk = &ids[done..done + n];
        let want = pool.install(|| base.chunk(chunk, done))?;
        for (ti, r) in others.iter_mut().enumerate() {
            let got = pool.install(|| r.chunk(chunk, done))?;
            for i in 0..n {
                let (p, q) = (&want[i * vocab..(i + 1) * vocab], &got[i * vocab..(i + 1) * vocab]);
                let (lp, lq) = (log_softmax(p), log_softmax(q));
                let kl: f64 = lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum();
                let range = edges.windows(2).position(|w| done + i < w[1]).unwrap_or(ranges - 1);
                let slot = &mut acc[ti][range];
                slot.0 += kl.max(0.0);
                slot.1 += (specula_engine::sampling::argmax(p) == specula_engine::sampling::argmax(q)) as usize;
                slot.2 += 1;
            }
        }
        done += n;
        bar.set_position(done as u64);
    }
    bar.finish_and_clear();
    println!("KV cache fidelity against f32, teacher-forced over {} tokens of text ({}), chunks of {}", a.tokens, loaded.name, a.chunk);
    println!("{:<6} {:>13} {:>14} {:>10}", "type", "positions", "mean KL", "top-1 same");
    for (ti, d) in types.iter().enumerate() {
        for (ri, &(kl, same, n)) in acc[ti].iter().enumerate() {
            println!(
                "{:<6} {:>13} {:>14.3e} {:>9.2}%",
                d.name(),
                format!("{}-{}", edges[ri], edges[ri + 1]),
                kl / n.max(1) as f64,
                100.0 * same as f64 / n.max(1) as f64
            );
        }
    }
    if let Some(bin) = &a.llama_perplexity {
        llama_rows(bin, &path, &text, a.tokens, a.threads, &types)?;
    }
    Ok(())
}

/// llama.cpp's KL of each type's cache against its f32 cache, one window of `tokens` of `text`,
/// printed as rows of the same table (its positions: the window's second half).
fn llama_rows(bin: &std::path::Path, model: &std::path::Path, text: &str, tokens: usize, threads: usize, types: &[KvDtype]) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("specula-kv-fidelity-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = llama_rows_in(&dir, bin, model, text, tokens, threads, types);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn llama_rows_in(
    dir: &std::path::Path,
    bin: &std::path::Path,
    model: &std::path::Path,
    text: &str,
    tokens: usize,
    threads: usize,
    types: &[KvDtype],
) -> Result<()> {
    let (file, base) = (dir.join("text.txt"), dir.join("base.kld"));
    std::fs::write(&file, text)?;
    let run = |ty: &str, compare: bool| -> Result<String> {
        let mut cmd = std::process::Command::new(bin);
        // the f32 reference without flash attention: with it, llama.cpp casts an f32 cache to f16
        // (llama-graph.cpp, build_attn_mha), and its quantized caches need it
        let fa = if compare { "on" } else { "off" };
        cmd.arg("-m").arg(model).arg("-f").arg(&file).args(["-c", &tokens.to_string(), "--chunks", "1", "-fa", fa]);
        cmd.args(["-t", &threads.to_string(), "-ctk", ty, "-ctv", ty, "--kl-divergence-base"]).arg(&base);
        if compare {
            cmd.arg("--kl-divergence");
        }
        eprintln!("running {cmd:?} ...");
        let out = crate::baseline_tool::output(&mut cmd)?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    run("f32", false)?;
    let field = |log: &str, key: &str| -> Result<f64> {
        let line = log.lines().find(|l| l.starts_with(key)).with_context(|| format!("llama-perplexity printed no '{key}'"))?;
        line[key.len()..].split_whitespace().next().and_then(|v| v.parse().ok()).with_context(|| format!("cannot read '{line}'"))
    };
    for t in types {
        let log = run(t.name(), true)?;
        let (kl, same) = (field(&log, "Mean    KLD:")?, field(&log, "Same top p:")?);
        println!("{:<6} {:>13} {:>14.3e} {:>9.2}%   (llama.cpp)", t.name(), format!("{}-{}", tokens / 2, tokens), kl, same);
    }
    Ok(())
}
