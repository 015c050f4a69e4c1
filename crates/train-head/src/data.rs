//! `specula-train-head data`: self-distillation data for the mtp head. The target answers each
//! prompt (chat template applied) through the engine, batched, with temperature sampling for the
//! training split and greedy for the held-out split; then one teacher-forced pass over
//! prompt + answer records, for every answer position, exactly what the mtp proposer receives at
//! inference: the target's hidden states after the feature layers (by default EAGLE-3's low, middle
//! and final layers; the final one is the state before the output norm), the token that follows,
//! and the target's top tokens and probabilities there (the training labels).
//!
//! Output: `DIR/{train,heldout}-NNNN.safetensors` shards (resumable: a finished shard is kept),
//! `DIR/heldout-prompts.txt`. `--answer-pass N` (N >= 1) answers the same training prompts again
//! with a seed stream of its own into `DIR/train-pN-NNNN.safetensors`, beside the pass-0 shards,
//! which it never touches (no held-out shards: those stay the greedy pass-0 answers); `fit` reads
//! every `train-*` shard. Shard tensors, R rows, S sequences:
//! `hidden [R, F * H] F16` (the F feature layers' states back to back; metadata `feature_layers`),
//! `next_token [R] I32` (-1 on each sequence's last row), `top_ids [R, T] I32`,
//! `top_probs [R, T] F32`, `seq_offsets [S + 1] I64` (row ranges of the sequences).

use crate::prompts::{self, Split};
use crate::shard::{Shard, TOP_K};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use specula_engine::{spawn_engine, EngineConfig, GenerateRequest, RequestEvent, SamplingParams};
use specula_kernels::attention::{KvLayout, SeqSpan};
use specula_model::{load_model, ChatMessage, ForwardBatch, KvStore, LlamaModel};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct DataArgs {
    /// Target model: a GGUF file or model folder (`specula fetch-model --print-path` prints the
    /// default one's).
    #[arg(long, env = "SPECULA_MODEL")]
    pub model: PathBuf,
    /// Output folder for the shards.
    #[arg(long, default_value = "target/mtp-data")]
    pub out: PathBuf,
    /// Training prompts (the split has over 2000; the shipped head used 2048, heads/README.md).
    #[arg(long, default_value_t = 448)]
    pub num_prompts: usize,
    /// Held-out prompts answered greedily (the evaluation set).
    #[arg(long, default_value_t = 96)]
    pub num_heldout: usize,
    /// Most answer tokens per prompt.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature of the training answers (held-out answers are greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Prompts per shard (and per engine batch).
    #[arg(long, default_value_t = 64)]
    pub shard_size: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// 0: the first answers (train-NNNN and heldout-NNNN shards). N >= 1: further sampled answers
    /// to the same training prompts, seeded apart from every other pass, as train-pN-NNNN shards.
    #[arg(long, default_value_t = 0)]
    pub answer_pass: u32,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Target layers (0-based) whose hidden states each row keeps, comma-separated; a head can
    /// be trained on any of them that includes the last (default: 1, n_layers / 2 - 1 and
    /// n_layers - 1, EAGLE-3's low, middle and final features). Every shard of a folder must
    /// keep the same layers.
    #[arg(long, value_delimiter = ',')]
    pub feature_layers: Option<Vec<usize>>,
}

/// EAGLE-3's choice of features for an `n`-layer target: after the second layer, after the middle
/// one and the final state (fewer, distinct, for very shallow targets).
pub fn default_feature_layers(n: usize) -> Vec<usize> {
    let mut v = vec![1.min(n - 1), (n / 2).saturating_sub(1), n - 1];
    v.sort_unstable();
    v.dedup();
    v
}

pub fn run(a: DataArgs) -> Result<()> {
    let path = crate::target_model(&a.model)?.to_path_buf();
    let loaded = load_model(&path)?;
    let template = loaded.chat_template.context("the target has no chat template; the head is distilled on chat answers")?;
    let tokenizer = Arc::new(loaded.tokenizer);
    // the engine takes its model by value; the teacher-forced pass uses a second (mapped) copy
    let teacher = load_model(&path)?.model;
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    std::fs::create_dir_all(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
    let fingerprint = specula_engine::speculative::mtp_format::target_fingerprint(&teacher);
    let n_layers = teacher.config.n_layers;
    let layers = a.feature_layers.clone().unwrap_or_else(|| default_feature_layers(n_layers));
    if layers.is_empty() || layers.iter().any(|&l| l >= n_layers) || !layers.windows(2).all(|w| w[0] < w[1]) {
        bail!("--feature-layers must be increasing layer indices below the target's {n_layers} layers, got {layers:?}");
    }

    let render = |p: &str| -> Result<Vec<u32>> {
        let text = template.render(&[ChatMessage { role: "user".into(), content: p.to_string() }], true)?;
        Ok(tokenizer.encode(&text)?)
    };
    let train = prompts::prompts(Split::Train, a.num_prompts, a.seed)?;
    let held = prompts::prompts(Split::HeldOut, a.num_heldout, a.seed)?;
    if train.len() < a.num_prompts {
        tracing::warn!("the training split has only {} prompts (asked for {})", train.len(), a.num_prompts);
    }
    if a.answer_pass == 0 {
        std::fs::write(a.out.join("heldout-prompts.txt"), held.iter().map(|p| format!("{}\n", p.replace('\n', " "))).collect::<String>())?;
    }

    let cfg = EngineConfig {
        max_num_seqs: a.shard_size.max(1),
        max_num_batched_tokens: 2048,
        max_model_len: 2048,
        block_size: 16,
        num_kv_blocks: (a.shard_size.max(1) * 512).div_ceil(16),
        enable_prefix_caching: true,
        threads,
        max_waiting: a.shard_size.max(1) * 2,
        shutdown_grace: std::time::Duration::from_secs(1),
        ..Default::default()
    };
    let (handle, join) = spawn_engine(loaded.model, tokenizer.clone(), cfg, None)?;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;

    // later answer passes add training answers only: the held-out set stays the pass-0 one
    let held_jobs = if a.answer_pass == 0 { held.chunks(a.shard_size.max(1)).collect() } else { Vec::new() };
    let jobs: Vec<(Split, usize, &[String])> = held_jobs
        .into_iter()
        .enumerate()
        .map(|(i, c)| (Split::HeldOut, i, c))
        .chain(train.chunks(a.shard_size.max(1)).enumerate().map(|(i, c)| (Split::Train, i, c)))
        .collect();
    let bar = ProgressBar::new(jobs.iter().map(|j| j.2.len() as u64).sum());
    bar.set_style(ProgressStyle::with_template("{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} prompts (eta {eta})")?);
    for (split, index, batch) in jobs {
        let name = shard_path(&a.out, split, a.answer_pass, index);
        if let Some(done) = name.exists().then(|| Shard::read(&name).ok()).flatten() {
            if done.feature_layers != layers {
                bail!("{} keeps layers {:?}, not {layers:?}: use another --out folder or the same --feature-layers", name.display(), done.feature_layers);
            }
            bar.inc(batch.len() as u64);
            continue;
        }
        bar.set_message(format!("{} shard {index}", split_name(split)));
        let first_prompt = index * a.shard_size.max(1);
        let mut rxs = Vec::new();
        let mut prompts_tok = Vec::new();
        for (j, p) in batch.iter().enumerate() {
            let prompt = render(p)?;
            let params = SamplingParams {
                temperature: if split == Split::Train { a.temperature } else { 0.0 },
                seed: Some(request_seed(a.seed, a.answer_pass, first_prompt + j)),
                max_tokens: a.max_tokens,
                ..Default::default()
            };
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            handle.submit(GenerateRequest { id: handle.next_request_id(), prompt: prompt.clone(), params, events: tx, grammar: None })?;
            rxs.push(rx);
            prompts_tok.push(prompt);
        }
        let mut shard = Shard::new(teacher.config.hidden_size, &layers);
        for (prompt, mut rx) in prompts_tok.into_iter().zip(rxs) {
            let answer = collect_answer(&mut rx)?;
            if answer.len() >= 2 {
                let (hidden, top) = pool.install(|| teacher_forced(&teacher, &prompt, &answer, &layers))?;
                shard.push_sequence(&hidden, &answer, &top);
            }
            bar.inc(1);
        }
        shard.write(&name, &fingerprint, split_name(split))?;
        // a line per shard also when stderr is a log file (the bar only draws on a terminal)
        bar.suspend(|| eprintln!("wrote {} ({} sequences, {} rows)", name.display(), shard.num_sequences(), shard.rows()));
    }
    bar.finish_with_message("done");
    drop(handle);
    let _ = join.join();
    eprintln!("wrote shards to {}", a.out.display());
    Ok(())
}

pub fn split_name(s: Split) -> &'static str {
    match s {
        Split::Train => "train",
        Split::HeldOut => "heldout",
    }
}

/// `DIR/train-0003.safetensors` for pass 0, `DIR/train-p2-0003.safetensors` for pass 2.
pub fn shard_path(dir: &Path, split: Split, pass: u32, index: usize) -> PathBuf {
    if pass == 0 {
        dir.join(format!("{}-{index:04}.safetensors", split_name(split)))
    } else {
        dir.join(format!("{}-p{pass}-{index:04}.safetensors", split_name(split)))
    }
}

/// The sampling seed of prompt `prompt_index`'s answer in answer pass `pass`. Pass 0 keeps the
/// seeds the first shards were made with; a later pass mixes the pass into them (splitmix64), so
/// its answers are drawn apart from every other pass's.
pub fn request_seed(seed: u64, pass: u32, prompt_index: usize) -> u64 {
    let base = seed.wrapping_mul(1_000_003).wrapping_add(prompt_index as u64);
    if pass == 0 {
        base
    } else {
        splitmix64(base ^ splitmix64(u64::from(pass)))
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn collect_answer(rx: &mut tokio::sync::mpsc::UnboundedReceiver<RequestEvent>) -> Result<Vec<u32>> {
    let mut answer = Vec::new();
    loop {
        match rx.blocking_recv() {
            Some(RequestEvent::Delta { tokens, .. }) => answer.extend(tokens),
            Some(RequestEvent::Finished { .. }) => return Ok(answer),
            Some(RequestEvent::Failed { message }) => bail!("generation failed: {message}"),
            Some(RequestEvent::PromptLogprobs { .. }) => {}
            None => bail!("the engine stopped unexpectedly"),
        }
    }
}

/// One pass over prompt + answer: for rows p-1 ..= L-1 (every position that produced an answer
/// token, and the last), the hidden states after `layers` and the target's top tokens with their
/// probabilities (temperature 1).
fn teacher_forced(model: &LlamaModel, prompt: &[u32], answer: &[u32], layers: &[usize]) -> Result<(Vec<f32>, Vec<TopTokens>)> {
    let c = &model.config;
    let tokens: Vec<u32> = prompt.iter().chain(answer).copied().collect();
    let layout = KvLayout { block_size: 16, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
    let blocks = tokens.len().div_ceil(16);
    let mut kv = KvStore::for_model(c, layout, blocks, specula_kernels::kv::KvDtype::F32, 1)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let seqs = [SeqSpan { q_start: 0, q_len: tokens.len(), context_len: tokens.len(), block_table: &table }];
    let slots: Vec<usize> = (0..tokens.len()).collect();
    let rows: Vec<usize> = (prompt.len() - 1..tokens.len()).collect();
    let out =
        model.forward(&ForwardBatch { tokens: &tokens, seqs: &seqs, slots: &slots, logits_rows: &rows, hidden_layers: layers, state_slots: &[0] }, &mut kv)?;
    let v = c.vocab_size;
    let top = out.logits.chunks_exact(v).map(top_probs).collect();
    Ok((out.hidden, top))
}

/// One position's labels: (target id, probability), most probable first.
type TopTokens = [(u32, f32); TOP_K];

/// The `TOP_K` most probable tokens of one logits row under softmax (temperature 1).
fn top_probs(row: &[f32]) -> TopTokens {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| f64::from((l - max).exp())).sum();
    let mut best = [(0u32, f32::NEG_INFINITY); TOP_K];
    for (i, &l) in row.iter().enumerate() {
        if l > best[TOP_K - 1].1 {
            let mut j = TOP_K - 1;
            while j > 0 && l > best[j - 1].1 {
                best[j] = best[j - 1];
                j -= 1;
            }
            best[j] = (i as u32, l);
        }
    }
    best.map(|(i, l)| (i, ((l - max).exp() as f64 / sum) as f32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_passes_have_their_own_shard_names_and_seeds() {
        let d = Path::new("data");
        assert_eq!(shard_path(d, Split::Train, 0, 3), PathBuf::from("data/train-0003.safetensors"));
        assert_eq!(shard_path(d, Split::HeldOut, 0, 0), PathBuf::from("data/heldout-0000.safetensors"));
        assert_eq!(shard_path(d, Split::Train, 2, 17), PathBuf::from("data/train-p2-0017.safetensors"));
        // pass 0 keeps the formula the shipped head's shards were made with
        assert_eq!(request_seed(1, 0, 5), 1_000_008);
        assert_eq!(request_seed(7, 0, 0), 7_000_021);
        // every (pass, prompt) of a run draws with its own seed, the same one on every run
        let mut seen = std::collections::HashSet::new();
        for pass in 0..6 {
            for i in 0..4096 {
                assert!(seen.insert(request_seed(1, pass, i)), "pass {pass} prompt {i} repeats a seed");
            }
        }
        assert_eq!(request_seed(1, 3, 100), request_seed(1, 3, 100));
        assert_ne!(request_seed(1, 1, 100), request_seed(2, 1, 100));
    }

    #[test]
    fn default_features_are_low_middle_and_final() {
        assert_eq!(default_feature_layers(30), vec![1, 14, 29]);
        assert_eq!(default_feature_layers(2), vec![0, 1]);
        assert_eq!(default_feature_layers(1), vec![0]);
    }

    #[test]
    fn top_probs_are_sorted_softmax_values() {
        let row = [0.0f32, 2.0, 1.0, -1.0, 3.0, 0.5, 0.25, 1.5, -2.0, 0.1];
        let top = top_probs(&row);
        let z: f64 = row.iter().map(|&l| (l as f64).exp()).sum();
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>()[..4], [4, 1, 7, 2]);
        for (i, p) in top {
            assert!((p as f64 - (row[i as usize] as f64).exp() / z).abs() < 1e-6);
        }
    }
}
