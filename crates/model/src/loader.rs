//! Turns a path into a ready model: a `.gguf` file or a Hugging Face folder (config.json +
//! *.safetensors + tokenizer.json). Reports how long loading took.

use crate::arch::{Arch, NormTopK};
use crate::chat::{ChatTemplate, CHATML};
use crate::config::YarnRope;
use crate::config::{Activation, ArchOptions, Llama3Rope, ModelConfig, MoeConfig, RecurrentConfig, SlidingWindow};
use crate::delta_net::DeltaNetWeights;
use crate::gguf::GgufFile;
use crate::gguf_reader::Value;
use crate::llama::{AttentionWeights, FeedForward, LayerExtras, LayerWeights, LlamaModel, Mixer, NextnLayer};
pub use crate::loaded::LoadedModel;
use crate::loaded::{ExpertWeights, LoadOptions};
use crate::moe::{DenseFfn, FfnBias, MoeFfn, SharedExpert};
use crate::tokenizer::{GgufTokenizerSpec, Tokenizer};
use crate::ModelError;
use specula_kernels::QMatrix;
use std::path::Path;
use std::time::Instant;

pub fn load_model(path: &Path) -> Result<LoadedModel, ModelError> {
    load_model_with(path, &LoadOptions::default())
}

pub fn load_model_with(path: &Path, options: &LoadOptions) -> Result<LoadedModel, ModelError> {
    let start = Instant::now();
    let mut loaded = if path.is_dir() { crate::safetensors_folder::load(path)? } else { load_gguf(path, options)? };
    loaded.load_time = start.elapsed();
    tracing::info!(
        model = %loaded.name,
        weights_mb = loaded.weight_bytes / 1_000_000,
        in_place_mb = loaded.model.in_place_bytes() / 1_000_000,
        ms = loaded.load_time.as_millis() as u64,
        "model loaded"
    );
    Ok(loaded)
}

/// The model alone (no tokenizer or chat template) from a `.gguf` file: for tools that feed
/// token ids (the logits oracle), and for files whose tokenizer is not supported yet.
pub fn load_gguf_weights(path: &Path) -> Result<LlamaModel, ModelError> {
    Ok(gguf_model(&GgufFile::open(path)?, true)?.0)
}

/// What `arch` changes in the Llama block: its descriptor's switches, and the values of them the
/// file gives under the keys the descriptor names (llama.cpp's conventions and defaults).
fn arch_options(f: &GgufFile, arch: Arch, hidden: usize) -> Result<ArchOptions, ModelError> {
    let d = arch.descriptor();
    let key = |k: &str| format!("{arch}.{k}");
    let mut o = ArchOptions {
        qkv_bias: d.qkv_bias,
        qk_norm: d.qk_norm,
        post_norms: d.post_norms,
        activation: d.activation,
        embed_scale: d.embed_scale.factor(hidden),
        attn_scale: f.meta_f32_opt(&key("attention.scale"))?,
        no_rope_period: d.no_rope_period,
        attn_out_bias: d.attn_out_bias,
        attn_sinks: d.attn_sinks,
        ..Default::default()
    };
    // fused attn_qkv / ffn_up are split at load (`attention_weights`, `dense_ffn`); LongRoPE's
    // factors are the `rope_factors_*` tensors and its attention factor scales cos and sin
    if d.long_rope {
        o.rope_mscale = f.meta_f32_or(&key("rope.scaling.attn_factor"), 1.0)?;
    }
    if let Some(s) = d.sliding {
        let window = f.meta_u32(&key("attention.sliding_window"))? as usize;
        let period = f.meta_u32_or(&key("attention.sliding_window_pattern"), s.default_period)? as usize;
        let rope_theta = match s.local_rope_base {
            Some(base) => Some(f.meta_f32_or(&key("rope.local.freq_base"), base)?),
            None => None,
        };
        o.sliding = Some(SlidingWindow { window, period, rope_theta });
    }
    if let Some(hy) = d.hybrid {
        o.attn_output_gate = true;
        let layers = trunk_layers(f, arch)?;
        let recurrent = match f.meta(&key("attention.recurrent_layers")) {
            Some(Value::Array(flags)) => {
                let flags: Option<Vec<bool>> = flags
                    .iter()
                    .map(|v| match v {
                        Value::Bool(b) => Some(*b),
                        other => other.as_i64().map(|x| x != 0),
                    })
                    .collect();
                let Some(mut flags) = flags else {
                    return Err(ModelError::MissingMetadata(format!("{} in {} holds a value that is not a flag", key("attention.recurrent_layers"), f.path)));
                };
                // the list may cover the MTP layers too, which are never recurrent
                flags.resize(layers, false);
                flags
            }
            Some(_) => return Err(ModelError::MissingMetadata(format!("{} in {} is not an array", key("attention.recurrent_layers"), f.path))),
            None => {
                let interval = f.meta_u32_or(&key("full_attention_interval"), hy.default_interval)?.max(1) as usize;
                (0..layers).map(|i| !(i + 1).is_multiple_of(interval)).collect()
            }
        };
        let head_dim = f.meta_u32(&key("ssm.state_size"))? as usize;
        let v_heads = f.meta_u32(&key("ssm.time_step_rank"))? as usize;
        let inner = f.meta_u32(&key("ssm.inner_size"))? as usize;
        if inner != v_heads * head_dim {
            return Err(ModelError::Unsupported(format!("{}: ssm.inner_size {inner} is not ssm.time_step_rank {v_heads} x ssm.state_size {head_dim}", f.path)));
        }
        o.recurrent = Some(RecurrentConfig {
            conv_kernel: f.meta_u32(&key("ssm.conv_kernel"))? as usize,
            k_heads: f.meta_u32(&key("ssm.group_count"))? as usize,
            v_heads,
            head_dim,
            layers: recurrent,
            heads_interleaved: hy.next_layout,
        });
    }
    Ok(o)
}

/// Layers of the trunk: `block_count` less the multi-token-prediction layers stored after it
/// (`nextn_predict_layers`, which the main pass does not run).
fn trunk_layers(f: &GgufFile, arch: Arch) -> Result<usize, ModelError> {
    let all = f.meta_u32(&format!("{arch}.block_count"))?;
    let nextn = f.meta_u32_or(&format!("{arch}.nextn_predict_layers"), 0)?;
    match all.checked_sub(nextn) {
        Some(n) => Ok(n as usize),
        None => Err(ModelError::Unsupported(format!("{}: {nextn} prediction layers but block_count is {all}", f.path))),
    }
}

/// The per-frequency divisors of interleaved multi-section RoPE (ggml's IMROPE) for text, where
/// the first three sections' positions are the token's and the fourth's is 0: a pair the rule
/// gives the fourth section does not rotate (an infinite divisor), every other rotates as NeoX's.
fn imrope_factors(sections: [usize; 4], rot: usize) -> Vec<f32> {
    let total: usize = sections.iter().sum();
    (0..rot / 2)
        .map(|i| {
            let s = i % total.max(1);
            let text = (s % 3 == 1 && s < 3 * sections[1]) || (s % 3 == 2 && s < 3 * sections[2]) || (s.is_multiple_of(3) && s < 3 * sections[0]);
            if text {
                1.0
            } else {
                f32::INFINITY
            }
        })
        .collect()
}

fn load_gguf(path: &Path, options: &LoadOptions) -> Result<LoadedModel, ModelError> {
    let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let available = crate::kv_store::available_memory();
    let mapped = options.expert_weights.settle(file_bytes, available) == ExpertWeights::Mapped;
    let mut f = GgufFile::open_with(path, mapped)?;
    f.experts_in_place = mapped && f.has_tensor("blk.0.ffn_gate_inp.weight");
    if f.experts_in_place {
        tracing::info!(
            "expert weights read in place from the map ({:?}: file {:.1} GB, {:.1} GB available)",
            options.expert_weights,
            file_bytes as f64 / 1e9,
            available.unwrap_or(0) as f64 / 1e9
        );
    }
    let (model, weight_bytes) = gguf_model(&f, options.nextn)?;

    let (tokenizer, chat_template) = gguf_tokenizer(&f)?;
    f.release_resident_pages();
    // every token the tokenizer can produce must have an embedding row (the embedding may be
    // padded past the vocabulary, never short of it)
    if tokenizer.vocab_size() > model.config.vocab_size {
        return Err(ModelError::BadTensor {
            name: "token_embd.weight".into(),
            message: format!("has {} rows but the tokenizer of {} has {} tokens", model.config.vocab_size, f.path, tokenizer.vocab_size()),
        });
    }
    let name = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "model".into());
    Ok(LoadedModel { model, tokenizer, chat_template, load_time: Default::default(), weight_bytes, name })
}

/// Only the tokenizer and chat template of a model (a GGUF file's metadata, without reading
/// its weights; a folder is loaded whole).
pub fn load_tokenizer(path: &Path) -> Result<(Tokenizer, Option<ChatTemplate>), ModelError> {
    if path.is_dir() {
        let m = load_model(path)?;
        return Ok((m.tokenizer, m.chat_template));
    }
    gguf_tokenizer(&GgufFile::open(path)?)
}

/// The tokenizer (`tokenizer.ggml.*`) and chat template (`tokenizer.chat_template`) of a GGUF.
fn gguf_tokenizer(f: &GgufFile) -> Result<(Tokenizer, Option<ChatTemplate>), ModelError> {
    let tokens = f.meta_strings("tokenizer.ggml.tokens")?;
    let token_types = f.meta_i32s("tokenizer.ggml.token_type").unwrap_or_else(|_| vec![1; tokens.len()]);
    let bos = f.meta_u32("tokenizer.ggml.bos_token_id").ok();
    let eos = f.meta_u32("tokenizer.ggml.eos_token_id").ok();
    let unk = f.meta_u32("tokenizer.ggml.unknown_token_id").ok();
    // a special id outside the vocabulary would index past the embedding later
    for (what, id) in [("bos", bos), ("eos", eos), ("unknown", unk)] {
        if let Some(id) = id.filter(|&i| i as usize >= tokens.len()) {
            return Err(ModelError::Tokenizer(format!("{}: the {what} token id {id} is outside the vocabulary of {} tokens", f.path, tokens.len())));
        }
    }
    if token_types.len() != tokens.len() {
        return Err(ModelError::Tokenizer(format!("{}: {} token types for {} tokens", f.path, token_types.len(), tokens.len())));
    }
    let tok_model = f.meta_str("tokenizer.ggml.model")?.to_string();
    let mut tokenizer = Tokenizer::from_gguf(GgufTokenizerSpec {
        model: &tok_model,
        pre: f.meta_str("tokenizer.ggml.pre").ok(),
        tokens: tokens.clone(),
        token_types,
        merges: f.meta_strings("tokenizer.ggml.merges").unwrap_or_default(),
        scores: f.meta_f32s("tokenizer.ggml.scores").unwrap_or_default(),
        bos,
        eos,
        unk,
        add_bos: f.meta_bool("tokenizer.ggml.add_bos_token").unwrap_or(false),
        // llama.cpp's default for SentencePiece models is to add the prefix space.
        add_space_prefix: f.meta_bool("tokenizer.ggml.add_space_prefix").unwrap_or(tok_model == "llama"),
    })?;
    // Stop where the chat format ends a turn (<|im_end|>, <end_of_turn>, <|eot_id|>, <|end|>, ...).
    tokenizer.add_end_of_turn_tokens();
    let tok_text = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize).cloned()).unwrap_or_default();
    let chat_template = match f.meta_str("tokenizer.chat_template") {
        Ok(src) => Some(ChatTemplate::new(src, &tok_text(bos), &tok_text(eos))?),
        Err(_) if tokenizer.token_to_id("<|im_start|>").is_some() => Some(ChatTemplate::new(CHATML, "", "")?),
        Err(_) => None,
    };
    Ok((tokenizer, chat_template))
}

/// The model and the bytes of weights it maps, from an open GGUF file; with `nextn`, its
/// multi-token-prediction layer too where the file has one.
fn gguf_model(f: &GgufFile, nextn: bool) -> Result<(LlamaModel, usize), ModelError> {
    let name = f.meta_str("general.architecture")?;
    let Some(arch) = Arch::from_name(name) else {
        return Err(ModelError::Unsupported(format!(
            "architecture '{}' in {} is not supported (supported: {})",
            crate::gguf_reader::shown(name).trim_matches('"'),
            f.path,
            Arch::supported_names()
        )));
    };
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = f.meta_u32(&key("embedding_length"))? as usize;
    let context = f.meta_u32_or(&key("context_length"), 2048)? as usize;
    let n_heads = f.meta_u32(&key("attention.head_count"))? as usize;
    let n_kv_heads = f.meta_u32_or(&key("attention.head_count_kv"), n_heads as u32)? as usize;
    let head_dim = f.meta_u32_or(&key("attention.key_length"), (hidden / n_heads.max(1)) as u32)? as usize;
    let embed = f.matrix("token_embd.weight")?;
    let tied = !f.has_tensor("output.weight");
    let mut arch_options = arch_options(f, arch, hidden)?;
    // partial RoPE: the leading `rot` dimensions of each head rotate, the rest pass through
    if let Ok(rot) = f.meta_u32(&key("rope.dimension_count")) {
        if rot as usize != head_dim {
            arch_options.rope_dims = Some(rot as usize);
        }
    }
    let linear_scale = match f.meta_str(&key("rope.scaling.type")) {
        Ok("linear") => f.meta_f32_or(&key("rope.scaling.factor"), 1.0)?,
        // Llama 3.x; a `rope_freqs.weight` tensor, when present, carries the same factors.
        Ok("llama3") => {
            arch_options.rope_llama3 = Some(Llama3Rope {
                factor: f.meta_f32_or(&key("rope.scaling.factor"), 8.0)?,
                low_freq_factor: f.meta_f32_or(&key("rope.scaling.low_freq_factor"), 1.0)?,
                high_freq_factor: f.meta_f32_or(&key("rope.scaling.high_freq_factor"), 4.0)?,
                original_context_length: f.meta_u32_or(&key("rope.scaling.original_context_length"), 8192)? as usize,
            });
            1.0
        }
        Ok("yarn") => {
            arch_options.rope_yarn = Some(yarn_rope(f, arch, context)?);
            1.0
        }
        // Phi-3's LongRoPE: per-frequency factors in `rope_factors_{short,long}.weight`
        Ok("none") | Ok("longrope") | Err(_) => 1.0,
        Ok(other) => return Err(ModelError::Unsupported(format!("RoPE scaling '{other}' in {} is not supported (linear, llama3, yarn, longrope)", f.path))),
    };
    let config = ModelConfig {
        arch,
        vocab_size: embed.rows,
        hidden_size: hidden,
        intermediate_size: f.meta_u32(&key("feed_forward_length"))? as usize,
        n_layers: trunk_layers(f, arch)?,
        n_heads,
        n_kv_heads,
        head_dim,
        rms_eps: f.meta_f32(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta: f.meta_f32_or(&key("rope.freq_base"), 10000.0)?,
        rope_linear_scale: linear_scale,
        rope_neox: arch.descriptor().rope_neox,
        context_length: context,
        tied_embeddings: tied,
        moe: moe_config(f, arch)?,
        arch_options,
    };
    // Nothing is sized from the config before it is checked (a block_count of 2^32 - 1 must be
    // an error, not an allocation failure).
    config.validate().map_err(|e| in_file(f, e))?;
    check_layer_tensors(f, f.meta_u32(&key("block_count"))? as usize)?;
    let (mut layers, mut extras) = (Vec::with_capacity(config.n_layers), Vec::with_capacity(config.n_layers));
    for i in 0..config.n_layers {
        let (l, e) = layer_weights(f, i, &config)?;
        layers.push(l);
        extras.push(e);
        // this layer's weights are repacked: its pages of the file need not stay mapped
        f.release_resident_pages();
    }
    let lm_head = if tied { embed.clone() } else { f.matrix("output.weight")? };
    let final_norm = f.vector("output_norm.weight")?;
    // Llama 3's factors, or LongRoPE's short ones (the long ones, which llama.cpp takes for a
    // context beyond `rope.scaling.original_context_length`, are swapped in by `fit_context`)
    let rope_freqs = match ["rope_freqs.weight", "rope_factors_short.weight"].into_iter().find(|n| f.has_tensor(n)) {
        Some(name) => Some(f.vector(name)?),
        None if arch.descriptor().hybrid.is_some() && f.meta(&key("rope.dimension_sections")).is_some() => {
            let s = f.meta_i32s(&key("rope.dimension_sections"))?;
            let at = |i: usize| s.get(i).map_or(0, |&v| v.max(0) as usize);
            Some(imrope_factors([at(0), at(1), at(2), at(3)], config.rope_dims()))
        }
        None => None,
    };
    let weight_bytes = usize::try_from(f.tensor_bytes()).unwrap_or(usize::MAX);
    let nextn = match nextn && trunk_layers(f, arch)? < f.meta_u32(&key("block_count"))? as usize {
        true => Some(nextn_layer(f, &config, &final_norm)?),
        false => None,
    };
    let mut model = LlamaModel::with_extras(config, embed, layers, extras, final_norm, lm_head, rope_freqs)?;
    if let Some(n) = nextn {
        model.set_nextn(n).map_err(|e| in_file(f, e))?;
    }
    if f.has_tensor("rope_factors_long.weight") {
        let original = f.meta_u32_or(&key("rope.scaling.original_context_length"), context as u32)? as usize;
        model.set_long_rope_factors(&f.vector("rope_factors_long.weight")?, original)?;
    }
    Ok((model, weight_bytes))
}

/// YaRN's parameters as llama.cpp reads them: the factor and original context from the file, the
/// betas and extrapolation factor from the file when present (default 32, 1, 1), and the
/// context's attention factor: get_mscale(factor) / get_mscale(factor, log_mul) (1 without
/// `yarn_log_multiplier`), divided by the 1 + 0.1 ln(factor) that ggml multiplies back in, times
/// `rope.scaling.attn_factor`.
fn yarn_rope(f: &GgufFile, arch: Arch, context: usize) -> Result<YarnRope, ModelError> {
    let key = |k: &str| format!("{arch}.{k}");
    let factor = f.meta_f32(&key("rope.scaling.factor"))?;
    let mscale = |scale: f32, m: f32| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let log_mul = f.meta_f32_or(&key("rope.scaling.yarn_log_multiplier"), 0.0)?;
    let base = if log_mul != 0.0 { mscale(factor, 1.0) / mscale(factor, log_mul) } else { mscale(factor, 1.0) };
    let attn_factor = base / (1.0 + 0.1 * factor.ln()) * f.meta_f32_or(&key("rope.scaling.attn_factor"), 1.0)?;
    Ok(YarnRope {
        factor,
        original_context_length: f.meta_u32_or(&key("rope.scaling.original_context_length"), context as u32)? as usize,
        beta_fast: f.meta_f32_or(&key("rope.scaling.yarn_beta_fast"), 32.0)?,
        beta_slow: f.meta_f32_or(&key("rope.scaling.yarn_beta_slow"), 1.0)?,
        ext_factor: f.meta_f32_or(&key("rope.scaling.yarn_ext_factor"), 1.0)?,
        attn_factor,
    })
}

/// Layer `i`'s weights (a trunk layer, or the attention block of a prediction layer after it).
fn layer_weights(f: &GgufFile, i: usize, config: &ModelConfig) -> Result<(LayerWeights, LayerExtras), ModelError> {
    let t = |n: &str| format!("blk.{i}.{n}.weight");
    let ffn = match &config.moe {
        None => FeedForward::Dense(dense_ffn(f, i, config.intermediate_size)?),
        Some(m) => FeedForward::Moe(moe_layer(f, i, m, config.hidden_size, config.arch_options.activation)?),
    };
    let mixer = if let (true, Some(r)) = (config.is_recurrent(i), &config.arch_options.recurrent) {
        Mixer::DeltaNet(Box::new(delta_net_weights(f, i, r)?))
    } else {
        let (wq, wk, wv) = attention_weights(f, i, config.q_proj_rows(), config.kv_width())?;
        Mixer::Attention(AttentionWeights { wq, wk, wv, wo: f.matrix(&t("attn_output"))? })
    };
    let layer = LayerWeights { attn_norm: f.vector(&t("attn_norm"))?, mixer, ffn_norm: f.vector(&t(config.arch.descriptor().ffn_norm))?, ffn };
    let extras = if config.is_recurrent(i) { LayerExtras::default() } else { layer_extras(f, i, &config.arch_options)? };
    Ok((layer, extras))
}

/// The first prediction layer after the trunk (`blk.{n_layers}`, llama.cpp's names); a file with
/// several drafts with the first, as llama.cpp's qwen35 does.
fn nextn_layer(f: &GgufFile, config: &ModelConfig, final_norm: &[f32]) -> Result<NextnLayer, ModelError> {
    let i = config.n_layers;
    let t = |n: &str| format!("blk.{i}.nextn.{n}.weight");
    let (layer, extras) = layer_weights(f, i, config)?;
    let optional = |n: &str| match f.has_tensor(&t(n)) {
        true => f.matrix(&t(n)).map(Some),
        false => Ok(None),
    };
    Ok(NextnLayer {
        eh_proj: f.matrix(&t("eh_proj"))?,
        enorm: f.vector(&t("enorm"))?,
        hnorm: f.vector(&t("hnorm"))?,
        head_norm: if f.has_tensor(&t("shared_head_norm")) { f.vector(&t("shared_head_norm"))? } else { final_norm.to_vec() },
        layer: std::sync::Arc::new(layer),
        extras,
        embed: optional("embed_tokens")?,
        head: optional("shared_head_head")?,
    })
}

/// Layer `i`'s Q, K and V projections: three tensors, or one fused `attn_qkv` (Phi-3) whose rows
/// are Q's, then K's, then V's.
fn attention_weights(f: &GgufFile, i: usize, q_width: usize, kv_width: usize) -> Result<(QMatrix, QMatrix, QMatrix), ModelError> {
    let t = |n: &str| format!("blk.{i}.{n}.weight");
    let fused = t("attn_qkv");
    if !f.has_tensor(&fused) {
        return Ok((f.matrix(&t("attn_q"))?, f.matrix(&t("attn_k"))?, f.matrix(&t("attn_v"))?));
    }
    Ok((f.matrix_rows(&fused, 0, q_width)?, f.matrix_rows(&fused, q_width, kv_width)?, f.matrix_rows(&fused, q_width + kv_width, kv_width)?))
}

/// Row indices of part `part` of every group, for a matrix whose rows come in `groups` groups of
/// parts `sizes` rows each (llama.cpp's `qwen3next` fuses per key head).
fn grouped_rows(groups: usize, sizes: &[usize], part: usize) -> Vec<usize> {
    let (width, start) = (sizes.iter().sum::<usize>(), sizes[..part].iter().sum::<usize>());
    (0..groups).flat_map(|g| g * width + start..g * width + start + sizes[part]).collect()
}

/// Layer `i`'s Gated DeltaNet: llama.cpp's `qwen35` tensor names, or `qwen3next`'s fused ones
/// (`ssm_ba`, and in older files `ssm_in`), split into the same matrices at load.
fn delta_net_weights(f: &GgufFile, i: usize, r: &RecurrentConfig) -> Result<DeltaNetWeights, ModelError> {
    let w = |n: &str| format!("blk.{i}.{n}.weight");
    // value heads per key head
    let (g, per) = (r.k_heads, r.v_heads / r.k_heads.max(1));
    // the fused tensor read once, its parts' rows gathered from it
    let pick = |m: &QMatrix, name: &str, sizes: &[usize], parts: &[usize]| -> Result<QMatrix, ModelError> {
        let rows: Vec<usize> = parts.iter().flat_map(|&p| grouped_rows(g, sizes, p)).collect();
        m.select_rows(&rows, name).map_err(|e| ModelError::BadTensor { name: name.into(), message: e.to_string() })
    };
    let (wbeta, walpha) = match f.has_tensor(&w("ssm_ba")) {
        true => {
            let (name, sizes) = (w("ssm_ba"), [per, per]);
            let ba = f.matrix(&name)?;
            (pick(&ba, &name, &sizes, &[0])?, pick(&ba, &name, &sizes, &[1])?)
        }
        false => (f.matrix(&w("ssm_beta"))?, f.matrix(&w("ssm_alpha"))?),
    };
    let (wqkv, wgate) = match f.has_tensor(&w("ssm_in")) && !f.has_tensor(&w("attn_qkv")) {
        true => {
            let (d, vd) = (r.head_dim, per * r.head_dim);
            let (name, sizes) = (w("ssm_in"), [d, d, vd, vd]);
            let qkvz = f.matrix(&name)?;
            (pick(&qkvz, &name, &sizes, &[0, 1, 2])?, pick(&qkvz, &name, &sizes, &[3])?)
        }
        false => (f.matrix(&w("attn_qkv"))?, f.matrix(&w("attn_gate"))?),
    };
    Ok(DeltaNetWeights {
        wqkv,
        wgate,
        wbeta,
        walpha,
        conv: f.vector(&w("ssm_conv1d"))?,
        dt_bias: f.vector(&format!("blk.{i}.ssm_dt.bias"))?,
        a: f.vector(&format!("blk.{i}.ssm_a"))?,
        norm: f.vector(&w("ssm_norm"))?,
        wout: f.matrix(&w("ssm_out"))?,
    })
}

/// Layer `i`'s dense SwiGLU: gate, up and down tensors, or (Phi-3) no `ffn_gate` and an
/// `ffn_up` of twice the width whose first half is the gate (ggml's `swiglu` split).
fn dense_ffn(f: &GgufFile, i: usize, ffn: usize) -> Result<DenseFfn, ModelError> {
    let t = |n: &str| format!("blk.{i}.{n}.weight");
    let (gate, up) = if f.has_tensor(&t("ffn_gate")) {
        (f.matrix(&t("ffn_gate"))?, f.matrix(&t("ffn_up"))?)
    } else {
        (f.matrix_rows(&t("ffn_up"), 0, ffn)?, f.matrix_rows(&t("ffn_up"), ffn, ffn)?)
    };
    Ok(DenseFfn::new(gate, up, f.matrix(&t("ffn_down"))?))
}

/// A config error with the file it came from.
fn in_file(f: &GgufFile, e: ModelError) -> ModelError {
    match e {
        ModelError::Unsupported(m) => ModelError::Unsupported(format!("{}: {m}", f.path)),
        other => other,
    }
}

/// Every `blk.N.*` tensor must belong to one of the `n_layers` layers (`block_count`, the
/// prediction layers after the trunk included): a file whose `block_count` disagrees with its
/// tensors is inconsistent, not a smaller model.
fn check_layer_tensors(f: &GgufFile, n_layers: usize) -> Result<(), ModelError> {
    for t in &f.header.tensors {
        let Some(rest) = t.name.strip_prefix("blk.") else { continue };
        let layer = rest.split('.').next().and_then(|n| n.parse::<usize>().ok());
        match layer {
            Some(l) if l < n_layers => {}
            _ => {
                return Err(ModelError::BadTensor {
                    name: crate::gguf_reader::shown(&t.name).trim_matches('"').to_string(),
                    message: format!("is not in one of the {n_layers} layers that block_count gives {}", f.path),
                })
            }
        }
    }
    Ok(())
}

/// Layer `i`'s weights beyond Llama's, as `o` asks for them (a missing one names its tensor).
fn layer_extras(f: &GgufFile, i: usize, o: &ArchOptions) -> Result<LayerExtras, ModelError> {
    let opt = |on: bool, name: &str| -> Result<Option<Vec<f32>>, ModelError> {
        if on {
            f.vector(&format!("blk.{i}.{name}")).map(Some)
        } else {
            Ok(None)
        }
    };
    Ok(LayerExtras {
        q_bias: opt(o.qkv_bias, "attn_q.bias")?,
        k_bias: opt(o.qkv_bias, "attn_k.bias")?,
        v_bias: opt(o.qkv_bias, "attn_v.bias")?,
        q_norm: opt(o.qk_norm, "attn_q_norm.weight")?,
        k_norm: opt(o.qk_norm, "attn_k_norm.weight")?,
        post_attn_norm: opt(o.post_norms, "post_attention_norm.weight")?,
        post_ffn_norm: opt(o.post_norms, "post_ffw_norm.weight")?,
        o_bias: opt(o.attn_out_bias, "attn_output.bias")?,
        sinks: opt(o.attn_sinks, "attn_sinks.weight")?,
    })
}

/// The MoE shape from `{arch}.expert_count` / `expert_used_count` (None for a dense model).
fn moe_config(f: &GgufFile, arch: Arch) -> Result<Option<MoeConfig>, ModelError> {
    let key = |k: &str| format!("{arch}.{k}");
    let n_experts = match f.meta_u32(&key("expert_count")) {
        Ok(n) if n > 0 => n as usize,
        _ if f.has_tensor("blk.0.ffn_gate_inp.weight") => {
            return Err(ModelError::MissingMetadata(format!(
                "{} has expert router tensors (blk.0.ffn_gate_inp.weight) but no {} in its metadata",
                f.path,
                key("expert_count")
            )))
        }
        _ => return Ok(None),
    };
    let n_used = f.meta_u32(&key("expert_used_count"))? as usize;
    let expert_ffn = match f.meta_u32(&key("expert_feed_forward_length")) {
        Ok(n) => n as usize,
        Err(_) => f.meta_u32(&key("feed_forward_length"))? as usize,
    };
    let shared_ffn = match f.has_tensor("blk.0.ffn_up_shexp.weight") {
        true => Some(f.matrix("blk.0.ffn_up_shexp.weight")?.rows),
        false => None,
    };
    // llama.cpp fixes the rule for some families (Qwen2-MoE keeps the chosen experts' softmax
    // weights as they are, Qwen3-MoE renormalises them); the others follow the file (Mixtral: on)
    let norm_topk = match arch.descriptor().norm_topk {
        NormTopK::Fixed(on) => on,
        NormTopK::FromFile => f.meta_bool(&key("expert_weights_norm")).unwrap_or(true),
    };
    Ok(Some(MoeConfig { n_experts, n_used, expert_ffn, norm_topk, shared_ffn, expert_parallel_size: 1 }))
}

/// One layer's router and experts: the 3-D `ffn_{gate,up,down}_exps` stacks, or (older GGUF
/// files) one `ffn_{gate,up,down}.{e}` tensor per expert; plus the shared expert if present.
fn moe_layer(f: &GgufFile, i: usize, m: &MoeConfig, hidden: usize, activation: Activation) -> Result<MoeFfn, ModelError> {
    let t = |n: &str| format!("blk.{i}.{n}.weight");
    let experts: Vec<DenseFfn> = if f.has_tensor(&t("ffn_gate_exps")) || !f.has_tensor(&format!("blk.{i}.ffn_gate.0.weight")) {
        let gate = f.matrix_stack(&t("ffn_gate_exps"), m.n_experts)?;
        let up = f.matrix_stack(&t("ffn_up_exps"), m.n_experts)?;
        let down = f.matrix_stack(&t("ffn_down_exps"), m.n_experts)?;
        let mut biases = expert_biases(f, i, m, hidden)?;
        gate.into_iter().zip(up).zip(down).map(|((gate, up), down)| DenseFfn { gate, up, down, bias: biases.next() }).collect()
    } else {
        (0..m.n_experts)
            .map(|e| {
                let te = |n: &str| format!("blk.{i}.{n}.{e}.weight");
                Ok(DenseFfn::new(f.expert_matrix(&te("ffn_gate"))?, f.expert_matrix(&te("ffn_up"))?, f.expert_matrix(&te("ffn_down"))?))
            })
            .collect::<Result<_, ModelError>>()?
    };
    let shared = match m.shared_ffn {
        None => None,
        Some(_) => Some(SharedExpert {
            ffn: DenseFfn::new(f.matrix(&t("ffn_gate_shexp"))?, f.matrix(&t("ffn_up_shexp"))?, f.matrix(&t("ffn_down_shexp"))?),
            gate: if f.has_tensor(&t("ffn_gate_inp_shexp")) { Some(f.matrix(&t("ffn_gate_inp_shexp"))?) } else { None },
        }),
    };
    let router_bias = match f.has_tensor(&format!("blk.{i}.ffn_gate_inp.bias")) {
        true => Some(f.vector(&format!("blk.{i}.ffn_gate_inp.bias"))?),
        false => None,
    };
    Ok(MoeFfn {
        router: f.matrix(&t("ffn_gate_inp"))?,
        router_bias,
        activation,
        experts: experts.into_iter().map(Some).collect(),
        n_used: m.n_used,
        norm_topk: m.norm_topk,
        shared,
    })
}

/// Layer `i`'s per-expert biases (`ffn_{gate,up,down}_exps.bias`, `[n_experts, width]` each:
/// gpt-oss), one `FfnBias` per expert in order; none when the file has none.
fn expert_biases(f: &GgufFile, i: usize, m: &MoeConfig, hidden: usize) -> Result<std::vec::IntoIter<FfnBias>, ModelError> {
    let name = |p: &str| format!("blk.{i}.ffn_{p}_exps.bias");
    if !f.has_tensor(&name("gate")) {
        return Ok(Vec::new().into_iter());
    }
    let stack = |p: &str, width: usize| -> Result<Vec<Vec<f32>>, ModelError> {
        let v = f.vector(&name(p))?;
        if v.len() != m.n_experts * width {
            return Err(ModelError::BadTensor { name: name(p), message: format!("{} values, expected {} experts x {width}", v.len(), m.n_experts) });
        }
        Ok(v.chunks_exact(width).map(<[f32]>::to_vec).collect())
    };
    let (gate, up, down) = (stack("gate", m.expert_ffn)?, stack("up", m.expert_ffn)?, stack("down", hidden)?);
    let biases: Vec<FfnBias> = gate.into_iter().zip(up).zip(down).map(|((gate, up), down)| FfnBias { gate, up, down }).collect();
    Ok(biases.into_iter())
}
