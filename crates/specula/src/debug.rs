//! `specula debug ...`: machine-readable hooks for the Python oracles (tokenizer ids, logits).

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use specula_model::kv_store::KvStore;
use specula_model::{load_model, Arch, ForwardBatch, SeqSpan};
use std::io::Write;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DebugCmd {
    /// Tokenize a JSON list of strings: writes [{"ids": [...], "decoded": "..."}].
    Tokenize(IoArgs),
    /// Render the model's chat template for a JSON list of {"messages": [...], "tools": [...]?,
    /// "add_generation_prompt": bool}: writes {"renders": [{"text": ...} | {"error": ...}],
    /// "eos": [ids], "bos": id, "add_bos": bool}.
    RenderChat(RenderArgs),
    /// Logits at every position of each prompt in {"prompts": [[ids]]}: little-endian f32
    /// (`--nextn`: the file's prediction layer's, teacher-forced, one row fewer per prompt).
    Logits(IoArgs),
    /// Dequantize raw ggml blocks (one row of --cols elements per row) to little-endian f32.
    Dequant(DequantArgs),
    /// Write a tiny random mixture-of-experts GGUF (tests and oracles).
    WriteTinyMoe(TinyMoeArgs),
    /// Write a tiny random dense GGUF of one architecture (tests and oracles).
    WriteTiny(TinyArgs),
    /// Load a model as `serve` does (weights, tokenizer, chat template): exit 0 and a JSON
    /// summary, or exit 1 with a one-line error (the GGUF fuzz test).
    CheckModel(CheckModelArgs),
    /// KL divergence and top-1 agreement of each KV cache type against f32, teacher-forced over
    /// a long prompt, per range of positions.
    KvFidelity(crate::kv_fidelity::KvFidelityArgs),
    /// Write an untrained mtp head (random weights, shaped for --model) for timing speculation
    /// on generated files (`--speculative-method mtp --draft-model HEAD
    /// --speculative-force-accept`): its drafts are noise.
    WriteRandomHead(RandomHeadArgs),
}

#[derive(Args)]
pub struct RandomHeadArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub output: PathBuf,
    /// Tokens of the head's pruned vocabulary.
    #[arg(long, default_value_t = 4096)]
    pub vocab: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `--arch`: one of `Arch::ALL`'s names, which `--help` lists.
fn arch_parser() -> impl clap::builder::TypedValueParser<Value = Arch> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Arch::ALL.map(Arch::name)).try_map(|name| name.parse::<Arch>())
}

#[derive(Args)]
pub struct CheckModelArgs {
    pub model: PathBuf,
    /// Also run one token through every layer.
    #[arg(long)]
    pub forward: bool,
}

#[derive(Args)]
pub struct TinyArgs {
    #[arg(long)]
    pub output: PathBuf,
    /// The family (`general.architecture`), as `specula_model::Arch` describes it.
    #[arg(long, default_value = "llama", value_parser = arch_parser())]
    pub arch: Arch,
    /// Head width when not hidden / heads (gemma3 style).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// gemma3: sliding window and local/global period.
    #[arg(long, default_value_t = 4)]
    pub sliding_window: usize,
    #[arg(long, default_value_t = 2)]
    pub sliding_period: usize,
    /// Write Llama 3 RoPE scaling metadata (factor 8, low 1, high 4, original context 32).
    #[arg(long)]
    pub rope_llama3: bool,
    /// Dimensions of each head RoPE rotates (partial RoPE; default: all).
    #[arg(long)]
    pub rope_dims: Option<usize>,
    /// f32, f16, q4_0, q4_1, q8_0
    #[arg(long, default_value = "q8_0")]
    pub format: String,
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Append a multi-token-prediction block (`nextn`, as the hybrids ship).
    #[arg(long)]
    pub nextn: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Args)]
pub struct TinyMoeArgs {
    #[arg(long)]
    pub output: PathBuf,
    /// llama (Mixtral-style), qwen2moe (Q/K/V biases), qwen3moe (q/k norms) or gpt-oss (biases,
    /// attention sinks, sliding layers, YaRN, clamped SwiGLU)
    #[arg(long, default_value = "llama", value_parser = arch_parser())]
    pub arch: Arch,
    /// Head width when not hidden / heads (Qwen3-MoE: 128 with hidden 2048 and 32 heads).
    #[arg(long)]
    pub head_dim: Option<usize>,
    #[arg(long, default_value_t = 4)]
    pub experts: usize,
    #[arg(long, default_value_t = 2)]
    pub experts_used: usize,
    /// Width of each expert.
    #[arg(long, default_value_t = 64)]
    pub expert_ffn: usize,
    /// Width of a shared expert (Qwen2-MoE style); none by default.
    #[arg(long)]
    pub shared_ffn: Option<usize>,
    /// Written as llama.expert_weights_norm (absent: renormalise over the chosen experts).
    #[arg(long)]
    pub norm_topk: Option<bool>,
    /// f32, f16, q4_0, q4_1, q8_0
    #[arg(long, default_value = "q8_0")]
    pub format: String,
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Append a multi-token-prediction block (`nextn`, as the hybrids ship).
    #[arg(long)]
    pub nextn: bool,
    /// qwen3next: q, k, v and z fused per key head in `ssm_in`, as older files store them.
    #[arg(long)]
    pub fused_ssm_in: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Args)]
pub struct DequantArgs {
    /// f32, f16, bf16, q4_0, q4_1, q8_0, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl,
    /// iq4_xs, mxfp4
    #[arg(long)]
    pub format: String,
    #[arg(long)]
    pub cols: usize,
    #[arg(long)]
    pub input: PathBuf,
    #[arg(long)]
    pub output: PathBuf,
}

#[derive(Args)]
pub struct RenderArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub input: PathBuf,
    #[arg(long)]
    pub output: PathBuf,
    /// A Jinja template file to use instead of the model's own (bos/eos text from the model).
    #[arg(long)]
    pub template: Option<PathBuf>,
}

#[derive(Args)]
pub struct IoArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub input: PathBuf,
    #[arg(long)]
    pub output: PathBuf,
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Prefill chunk size (tokens per forward pass); 0 = whole prompt at once.
    #[arg(long, default_value_t = 0)]
    pub chunk: usize,
    /// The KV cache's type (as `serve --kv-cache-dtype`; the served default unless given).
    #[arg(long, value_enum, default_value_t = crate::engine_args::KvDtypeArg::Auto)]
    pub kv_cache_dtype: crate::engine_args::KvDtypeArg,
    /// Logits: the file's own multi-token-prediction layer's instead of the model's: row i pairs
    /// the final state of position i with token i + 1 (at position i + 1) and attends to rows
    /// 0..=i (llama.cpp's qwen35 MTP graph).
    #[arg(long)]
    pub nextn: bool,
}

pub fn run(cmd: DebugCmd) -> Result<()> {
    match cmd {
        DebugCmd::Tokenize(a) => {
            // The tokenizer only (GGUF metadata): works for any architecture.
            let (tokenizer, _) = specula_model::load_tokenizer(&crate::fetch::resolve_model(&a.model)?)?;
            let texts: Vec<String> = serde_json::from_str(&std::fs::read_to_string(&a.input)?).context("input must be a JSON list of strings")?;
            let mut out = Vec::new();
            for t in texts {
                let ids = tokenizer.encode(&t)?;
                let decoded = tokenizer.decode(&ids, false)?;
                out.push(serde_json::json!({"ids": ids, "decoded": decoded}));
            }
            std::fs::write(&a.output, serde_json::to_string(&out)?)?;
        }
        DebugCmd::RenderChat(a) => {
            let (tokenizer, mut template) = specula_model::load_tokenizer(&crate::fetch::resolve_model(&a.model)?)?;
            if let Some(path) = &a.template {
                let text = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
                let eos = text(tokenizer.eos.first().copied());
                template = Some(specula_model::ChatTemplate::new(&std::fs::read_to_string(path)?, &text(tokenizer.bos), &eos)?);
            }
            let cases: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&a.input)?).context("input must be a JSON list")?;
            let mut renders = Vec::new();
            for c in cases {
                let messages = c["messages"].as_array().cloned().unwrap_or_default();
                let tools = c.get("tools").filter(|t| !t.is_null());
                let agp = c["add_generation_prompt"].as_bool().unwrap_or(true);
                renders.push(match template.as_ref().map(|t| t.render_with(&messages, tools, agp)) {
                    None => serde_json::json!({"error": "no chat template"}),
                    Some(Ok(text)) => serde_json::json!({"text": text}),
                    Some(Err(e)) => serde_json::json!({"error": e.to_string()}),
                });
            }
            let out = serde_json::json!({"renders": renders, "eos": tokenizer.eos, "bos": tokenizer.bos, "add_bos": tokenizer.add_bos});
            std::fs::write(&a.output, serde_json::to_string(&out)?)?;
        }
        DebugCmd::Logits(a) => {
            // Token ids in, so the tokenizer is not needed (nor required to be supported).
            let path = crate::fetch::resolve_model(&a.model)?;
            let model = match path.extension().is_some_and(|e| e == "gguf") {
                true => specula_model::loader::load_gguf_weights(&path)?,
                false => load_model(&path)?.model,
            };
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&a.input)?)?;
            let prompts: Vec<Vec<u32>> = serde_json::from_value(v["prompts"].clone()).context("input must be {\"prompts\": [[ids]]}")?;
            let pool = rayon::ThreadPoolBuilder::new().num_threads(a.threads).build()?;
            let mut f = std::io::BufWriter::new(std::fs::File::create(&a.output)?);
            let nextn = match a.nextn {
                true => Some(specula_engine::speculative::mtp::MtpProposer::from_nextn(&model, &(0..model.config.vocab_size as u32).collect::<Vec<_>>())?),
                false => None,
            };
            for p in prompts {
                let logits = pool.install(|| -> Result<Vec<f32>> {
                    let Some(head) = &nextn else { return all_position_logits(&model, &p, a.chunk, a.kv_cache_dtype.into()) };
                    let (_, hidden) = all_position_forward(
                        &model,
                        &p,
                        a.chunk,
                        a.kv_cache_dtype.into(),
                        specula_engine::speculative::proposer::Proposer::hidden_layers(head),
                    )?;
                    Ok(head.teacher_forced(&p, &hidden)?)
                })?;
                for x in logits {
                    f.write_all(&x.to_le_bytes())?;
                }
            }
            f.flush()?;
        }
        #[cfg(feature = "testing")]
        DebugCmd::WriteTiny(a) => {
            use specula_model::testing::{write_tiny_llama, TinySpec};
            let spec = TinySpec {
                weight_format: tiny_format(&a.format)?,
                layers: a.layers,
                seed: a.seed,
                arch: a.arch,
                head_dim: a.head_dim,
                sliding_window: a.sliding_window,
                sliding_period: a.sliding_period,
                rope_llama3: a.rope_llama3,
                rope_dims: a.rope_dims,
                nextn: a.nextn,
                ..Default::default()
            };
            write_tiny_llama(&a.output, &spec)?;
        }
        #[cfg(feature = "testing")]
        DebugCmd::WriteTinyMoe(a) => {
            use specula_model::testing::{write_tiny_moe, TinyMoe, TinySpec};
            let format = tiny_format(&a.format)?;
            let moe = TinyMoe { experts: a.experts, used: a.experts_used, expert_ffn: a.expert_ffn, shared_ffn: a.shared_ffn, norm_topk: a.norm_topk };
            let spec = TinySpec {
                weight_format: format,
                layers: a.layers,
                seed: a.seed,
                moe: Some(moe),
                arch: a.arch,
                head_dim: a.head_dim,
                nextn: a.nextn,
                fused_ssm_in: a.fused_ssm_in,
                ..Default::default()
            };
            write_tiny_moe(&a.output, &spec)?;
        }
        #[cfg(not(feature = "testing"))]
        DebugCmd::WriteTiny(_) | DebugCmd::WriteTinyMoe(_) => {
            anyhow::bail!("this binary was built without the tiny GGUF writer: build it with `cargo build --release -p specula --features testing`")
        }
        DebugCmd::KvFidelity(a) => crate::kv_fidelity::run(a)?,
        DebugCmd::WriteRandomHead(a) => {
            let target = specula_model::loader::load_gguf_weights(&a.model)?;
            specula_engine::speculative::mtp_format::write_random_head(&a.output, &target, a.vocab, a.seed)?;
        }
        DebugCmd::CheckModel(a) => {
            let loaded = load_model(&a.model)?;
            let c = &loaded.model.config;
            if a.forward {
                // one token through every layer: the shapes the loader accepted must compute
                let logits = all_position_logits(&loaded.model, &[0], 0, specula_kernels::kv::KvDtype::default())?;
                anyhow::ensure!(logits.len() == c.vocab_size, "one token gave {} logits for a vocabulary of {}", logits.len(), c.vocab_size);
            }
            let summary = serde_json::json!({
                "arch": c.arch.name(), "layers": c.n_layers, "vocab": c.vocab_size, "hidden": c.hidden_size,
                "tokenizer_vocab": loaded.tokenizer.vocab_size(), "chat_template": loaded.chat_template.is_some(),
            });
            println!("{summary}");
        }
        DebugCmd::Dequant(a) => {
            use specula_kernels::WeightFormat as W;
            let format = match a.format.as_str() {
                "f32" => W::F32,
                "f16" => W::F16,
                "bf16" => W::BF16,
                "q4_0" => W::Q4_0,
                "q4_1" => W::Q4_1,
                "q8_0" => W::Q8_0,
                "q5_0" => W::Q5_0,
                "q5_1" => W::Q5_1,
                "q4_k" => W::Q4K,
                "q5_k" => W::Q5K,
                "q6_k" => W::Q6K,
                "q2_k" => W::Q2K,
                "q3_k" => W::Q3K,
                "iq4_nl" => W::IQ4NL,
                "iq4_xs" => W::IQ4XS,
                "mxfp4" => W::MXFP4,
                other => anyhow::bail!("unknown format '{other}'"),
            };
            if a.cols == 0 || a.cols % format.block_len() != 0 {
                anyhow::bail!("--cols {} is not a multiple of the {format:?} block length {}", a.cols, format.block_len());
            }
            let raw = std::fs::read(&a.input)?;
            let rb = format.row_bytes(a.cols);
            if raw.len() % rb != 0 {
                anyhow::bail!("{} bytes is not a whole number of {rb}-byte rows", raw.len());
            }
            let mut out = Vec::with_capacity(raw.len() / rb * a.cols * 4);
            let mut row = vec![0f32; a.cols];
            for r in raw.chunks_exact(rb) {
                specula_kernels::formats::dequantize_row(format, r, &mut row);
                row.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            }
            std::fs::write(&a.output, out)?;
        }
    }
    Ok(())
}

#[cfg(feature = "testing")]
fn tiny_format(name: &str) -> Result<specula_model::testing::GgmlDType> {
    use specula_model::testing::GgmlDType;
    Ok(match name {
        "f32" => GgmlDType::F32,
        "f16" => GgmlDType::F16,
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q8_0" => GgmlDType::Q8_0,
        other => anyhow::bail!("unknown format '{other}' (f32, f16, q4_0, q4_1, q8_0)"),
    })
}

/// Runs one prompt through a private contiguous KV cache of type `kv`, `chunk` tokens per pass.
pub fn all_position_logits(model: &specula_model::LlamaModel, prompt: &[u32], chunk: usize, kv_dtype: specula_kernels::kv::KvDtype) -> Result<Vec<f32>> {
    Ok(all_position_forward(model, prompt, chunk, kv_dtype, &[])?.0)
}

/// [`all_position_logits`], and every position's states after `hidden_layers` (as
/// `ForwardOutput::hidden` lays them out).
fn all_position_forward(
    model: &specula_model::LlamaModel,
    prompt: &[u32],
    chunk: usize,
    kv_dtype: specula_kernels::kv::KvDtype,
    hidden_layers: &[usize],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let c = &model.config;
    let layout = specula_kernels::attention::KvLayout { block_size: 16, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
    let blocks = prompt.len().div_ceil(16).max(1);
    let mut kv = KvStore::for_model(c, layout, blocks, kv_dtype, 1)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let chunk = if chunk == 0 { prompt.len() } else { chunk };
    let mut out = Vec::with_capacity(prompt.len() * c.vocab_size);
    let mut hidden = Vec::new();
    let mut done = 0;
    while done < prompt.len() {
        let n = chunk.min(prompt.len() - done);
        let seqs = [SeqSpan { q_start: 0, q_len: n, context_len: done + n, block_table: &table }];
        let slots: Vec<usize> = (done..done + n).collect();
        let rows: Vec<usize> = (0..n).collect();
        let o = model.forward(
            &ForwardBatch { tokens: &prompt[done..done + n], seqs: &seqs, slots: &slots, logits_rows: &rows, hidden_layers, state_slots: &[0] },
            &mut kv,
        )?;
        out.extend_from_slice(&o.logits);
        hidden.extend_from_slice(&o.hidden);
        done += n;
    }
    Ok((out, hidden))
}
