//! Test support shared by every crate's tests: a tiny random Llama written as a real GGUF file
//! (so tests exercise the same loader, tokenizer and kernels as production), and the one place
//! that finds the real default model for the tests that need it. Not for production code paths.

use crate::arch::Arch;
use crate::ModelError;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};

pub use crate::arch::tiny_chat::{HARMONY_TEMPLATE, HARMONY_TOKENS, PHI3_TEMPLATE, PHI3_TOKENS, QWEN3_TEMPLATE, SMOLLM3_TEMPLATE};
pub use candle_core::quantized::GgmlDType;

/// Id of `<|endoftext|>` in the tiny vocabulary (after the 256 byte tokens).
pub const TINY_ENDOFTEXT: u32 = 256;
/// Id of `<|im_start|>`: the tiny model's BOS.
pub const TINY_IM_START: u32 = 257;
/// Id of `<|im_end|>`: the tiny model's EOS.
pub const TINY_IM_END: u32 = 258;
/// 256 byte tokens + 3 control tokens.
pub const TINY_VOCAB: usize = 259;
/// The control tokens after the byte tokens, in id order from `TINY_ENDOFTEXT`.
const TINY_CONTROL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Shape and numerics of a tiny random Llama. The vocabulary is fixed: token `b` (0..256) is the
/// single byte `b` in GPT-2's byte-to-unicode spelling, so the byte-level BPE tokenizer needs no
/// merges, followed by the three ChatML control tokens.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub context_length: usize,
    /// Format of the 2-D weights (norms are always F32).
    pub weight_format: GgmlDType,
    /// Per-tensor format overrides, e.g. `("blk.0.attn_q.weight", Q5_0)` to write an unsupported type.
    pub tensor_formats: Vec<(String, GgmlDType)>,
    /// Whether the output projection is the embedding (no `output.weight` tensor), as in SmolLM2.
    pub tied_embeddings: bool,
    /// Same seed, same file, byte for byte.
    pub seed: u64,
    /// Mixture-of-experts FFN in every layer instead of the dense one (`write_tiny_moe`).
    pub moe: Option<TinyMoe>,
    /// `general.architecture` (default Llama): the tensors and metadata its
    /// `ArchDescriptor` asks for (biases, norms, fused projections, sliding layers, LongRoPE,
    /// YaRN, ...) and its chat format (`ArchDescriptor::tiny`). gpt-oss is meant for
    /// `write_tiny_moe`.
    pub arch: Arch,
    /// Head width when it is not hidden / heads (written as `attention.key_length`).
    pub head_dim: Option<usize>,
    /// Families with sliding-window layers: the window, and (where `TinyFiles::sliding_pattern_key`:
    /// Gemma 3) the period of the local/global pattern (written as
    /// `attention.sliding_window_pattern`; every `period`-th layer is global).
    pub sliding_window: usize,
    pub sliding_period: usize,
    /// Writes Llama 3.x RoPE scaling metadata (`rope.scaling.type = "llama3"`, factor 8, low 1,
    /// high 4, original context 32) instead of none.
    pub rope_llama3: bool,
    /// Tensors left out of the file (to test the missing-tensor error).
    pub omit_tensors: Vec<String>,
    /// Dimensions of each head RoPE rotates, written as `rope.dimension_count` (default: all).
    pub rope_dims: Option<usize>,
    /// Append a multi-token-prediction block after the trunk (llama.cpp's `nextn` tensors and
    /// `nextn_predict_layers`; the hybrids ship one).
    pub nextn: bool,
    /// qwen3next: q, k, v and z in one `ssm_in` per key head, as older files store them (else
    /// `attn_qkv` and `attn_gate`).
    pub fused_ssm_in: bool,
}

/// The MoE part of a tiny model, written with llama.cpp's tensor names: `ffn_gate_inp`
/// (router, F32 as llama.cpp's quantizer keeps it), `ffn_{gate,up,down}_exps` stacks in the
/// model's weight format, optional `*_shexp` shared expert.
#[derive(Clone, Debug)]
pub struct TinyMoe {
    pub experts: usize,
    pub used: usize,
    /// Width of each expert (also written as `feed_forward_length`, as Mixtral files do).
    pub expert_ffn: usize,
    /// Width of a Qwen2-MoE style shared expert (with its sigmoid gate), if any.
    pub shared_ffn: Option<usize>,
    /// Written as `llama.expert_weights_norm` when set (absent: renormalise, the Mixtral rule).
    pub norm_topk: Option<bool>,
}

impl Default for TinyMoe {
    fn default() -> Self {
        Self { experts: 4, used: 2, expert_ffn: 64, shared_ffn: None, norm_topk: None }
    }
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            hidden: 64,
            ffn: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            context_length: 512,
            weight_format: GgmlDType::Q4_1,
            tensor_formats: Vec::new(),
            tied_embeddings: true,
            seed: 0,
            moe: None,
            arch: Arch::Llama,
            head_dim: None,
            sliding_window: 4,
            sliding_period: 2,
            rope_llama3: false,
            omit_tensors: Vec::new(),
            rope_dims: None,
            nextn: false,
            fused_ssm_in: false,
        }
    }
}

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the rest to code points from 256 up.
pub fn byte_token(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("code points 256..324 are valid")
}

/// Writes a tiny random mixture-of-experts model: `spec` with its `moe` (default: 4 experts,
/// top-2, when `spec.moe` is `None`).
pub fn write_tiny_moe(path: &Path, spec: &TinySpec) -> Result<(), ModelError> {
    let spec = TinySpec { moe: Some(spec.moe.clone().unwrap_or_default()), ..spec.clone() };
    write_tiny_llama(path, &spec)
}

/// Writes the tiny model described by `spec` to `path`.
pub fn write_tiny_llama(path: &Path, spec: &TinySpec) -> Result<(), ModelError> {
    let mut rng = Normal::new(spec.seed);
    let h = spec.hidden;
    let ff = spec.moe.as_ref().map_or(spec.ffn, |m| m.expert_ffn);
    let head_dim = spec.head_dim.unwrap_or(h / spec.heads.max(1));
    let (qw, kvw) = (spec.heads * head_dim, spec.kv_heads * head_dim);
    let arch = spec.arch;
    let d = arch.descriptor();
    let format_of = |name: &str| spec.tensor_formats.iter().find(|(n, _)| n == name).map(|(_, f)| *f).unwrap_or(spec.weight_format);

    // name, shape [rows, cols] (or [n] for norms), std of the random values, mean (norms ~1)
    // the chat format's control tokens (harmony's, Phi-4-mini's) come after the tiny vocabulary
    let extra_tokens = d.tiny.chat.extra_tokens;
    let vocab = TINY_VOCAB + extra_tokens.len();
    let mut plan: Vec<(String, Vec<usize>, f32, f32)> = vec![("token_embd.weight".into(), vec![vocab, h], 0.2, 0.0)];
    // a hybrid's recurrent layers: every layer but each `interval`-th, heads as the attention's
    let tiny_ssm = TinySsm { conv_kernel: 4, k_heads: spec.kv_heads, v_heads: spec.heads, head_dim };
    // (the prediction block after the trunk attends)
    let recurrent = |i: usize| i < spec.layers && d.hybrid.is_some_and(|hy| !(i + 1).is_multiple_of(hy.default_interval as usize));
    let blocks = spec.layers + usize::from(spec.nextn);
    for i in 0..blocks {
        let t = |n: &str| format!("blk.{i}.{n}.weight");
        if i == spec.layers {
            plan.push((t("nextn.eh_proj"), vec![h, 2 * h], 0.15, 0.0));
            plan.push((t("nextn.enorm"), vec![h], 0.05, 1.0));
            plan.push((t("nextn.hnorm"), vec![h], 0.05, 1.0));
            plan.push((t("nextn.shared_head_norm"), vec![h], 0.05, 1.0));
        }
        plan.push((t("attn_norm"), vec![h], 0.05, 1.0));
        if recurrent(i) {
            let TinySsm { conv_kernel, v_heads, head_dim: sd, .. } = tiny_ssm;
            let (kw, vw) = (tiny_ssm.k_heads * sd, v_heads * sd);
            // qwen3next fuses per key head: beta and alpha always, q, k, v and z in older files
            let next = d.hybrid.is_some_and(|hy| hy.next_layout);
            if next && spec.fused_ssm_in {
                plan.push((t("ssm_in"), vec![2 * kw + 2 * vw, h], 0.15, 0.0));
            } else {
                plan.push((t("attn_qkv"), vec![2 * kw + vw, h], 0.15, 0.0));
                plan.push((t("attn_gate"), vec![vw, h], 0.15, 0.0));
            }
            if next {
                plan.push((t("ssm_ba"), vec![2 * v_heads, h], 0.15, 0.0));
            } else {
                plan.push((t("ssm_beta"), vec![v_heads, h], 0.15, 0.0));
                plan.push((t("ssm_alpha"), vec![v_heads, h], 0.15, 0.0));
            }
            plan.push((t("ssm_conv1d"), vec![2 * kw + vw, conv_kernel], 0.3, 0.0));
            plan.push((format!("blk.{i}.ssm_dt.bias"), vec![v_heads], 0.5, 0.0));
            // a = -exp(A_log): negative, so that the state decays
            plan.push((format!("blk.{i}.ssm_a"), vec![v_heads], 0.3, -1.0));
            plan.push((t("ssm_norm"), vec![sd], 0.05, 1.0));
            plan.push((t("ssm_out"), vec![h, vw], 0.1, 0.0));
        } else if d.fused_qkv {
            plan.push((t("attn_qkv"), vec![qw + 2 * kvw, h], 0.15, 0.0));
        } else {
            // gated attention: each head's queries, then its output gate
            let q_rows = if d.hybrid.is_some() { 2 * qw } else { qw };
            plan.push((t("attn_q"), vec![q_rows, h], 0.15, 0.0));
            plan.push((t("attn_k"), vec![kvw, h], 0.15, 0.0));
            plan.push((t("attn_v"), vec![kvw, h], 0.15, 0.0));
        }
        if !recurrent(i) {
            plan.push((t("attn_output"), vec![h, qw], 0.1, 0.0));
        }
        plan.push((t(d.ffn_norm), vec![h], 0.05, 1.0));
        if d.attn_out_bias {
            plan.push((format!("blk.{i}.attn_output.bias"), vec![h], 0.3, 0.0));
        }
        if d.attn_sinks {
            plan.push((t("attn_sinks"), vec![spec.heads], 1.0, 0.5));
        }
        if d.qkv_bias {
            for (n, w) in [("attn_q", qw), ("attn_k", kvw), ("attn_v", kvw)] {
                plan.push((format!("blk.{i}.{n}.bias"), vec![w], 0.3, 0.0));
            }
        }
        if d.qk_norm && !recurrent(i) {
            plan.push((t("attn_q_norm"), vec![head_dim], 0.1, 1.0));
            plan.push((t("attn_k_norm"), vec![head_dim], 0.1, 1.0));
        }
        if d.post_norms {
            plan.push((t("post_attention_norm"), vec![h], 0.05, 1.0));
            plan.push((t("post_ffw_norm"), vec![h], 0.05, 1.0));
        }
        match &spec.moe {
            None if d.fused_gate_up => {
                plan.push((t("ffn_up"), vec![2 * ff, h], 0.15, 0.0));
                plan.push((t("ffn_down"), vec![h, ff], 0.1, 0.0));
            }
            None => {
                plan.push((t("ffn_gate"), vec![ff, h], 0.15, 0.0));
                plan.push((t("ffn_up"), vec![ff, h], 0.15, 0.0));
                plan.push((t("ffn_down"), vec![h, ff], 0.1, 0.0));
            }
            Some(m) => {
                let e = m.experts;
                plan.push((t("ffn_gate_inp"), vec![e, h], 0.15, 0.0));
                plan.push((t("ffn_gate_exps"), vec![e, ff, h], 0.15, 0.0));
                plan.push((t("ffn_up_exps"), vec![e, ff, h], 0.15, 0.0));
                plan.push((t("ffn_down_exps"), vec![e, h, ff], 0.1, 0.0));
                if d.tiny.expert_biases {
                    plan.push((format!("blk.{i}.ffn_gate_inp.bias"), vec![e], 0.3, 0.0));
                    plan.push((format!("blk.{i}.ffn_gate_exps.bias"), vec![e, ff], 0.3, 0.0));
                    plan.push((format!("blk.{i}.ffn_up_exps.bias"), vec![e, ff], 0.3, 0.0));
                    plan.push((format!("blk.{i}.ffn_down_exps.bias"), vec![e, h], 0.3, 0.0));
                }
                if let Some(sf) = m.shared_ffn {
                    plan.push((t("ffn_gate_inp_shexp"), vec![h], 0.15, 0.0));
                    plan.push((t("ffn_gate_shexp"), vec![sf, h], 0.15, 0.0));
                    plan.push((t("ffn_up_shexp"), vec![sf, h], 0.15, 0.0));
                    plan.push((t("ffn_down_shexp"), vec![h, sf], 0.1, 0.0));
                }
            }
        }
    }
    let rot = spec.rope_dims.unwrap_or(head_dim);
    if d.long_rope {
        // LongRoPE's per-frequency divisors (1 for the fast pairs up to ~4 for the slow ones)
        plan.push(("rope_factors_short.weight".into(), vec![rot / 2], 0.0, 0.0));
        plan.push(("rope_factors_long.weight".into(), vec![rot / 2], 0.0, 0.0));
    }
    plan.push(("output_norm.weight".into(), vec![h], 0.05, 1.0));
    if !spec.tied_embeddings || d.tiny.own_output {
        plan.push(("output.weight".into(), vec![vocab, h], 0.2, 0.0));
    }

    plan.retain(|(name, ..)| !spec.omit_tensors.contains(name));
    let mut tensors = Vec::with_capacity(plan.len());
    for (name, shape, std, mean) in &plan {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = if name.starts_with("rope_factors_") {
            let top = if name.contains("long") { 8.0 } else { 4.0 };
            (0..n).map(|i| 1.0 + (top - 1.0) * i as f32 / n.saturating_sub(1).max(1) as f32).collect()
        } else {
            (0..n).map(|_| mean + std * rng.next()).collect()
        };
        let bad = |e: candle_core::Error| ModelError::BadTensor { name: name.clone(), message: e.to_string() };
        let t = Tensor::from_vec(data, shape.as_slice(), &Device::Cpu).map_err(bad)?;
        let router = name.ends_with("ffn_gate_inp.weight");
        // the convolution's taps stay F32, as llama.cpp's converter and quantizer keep them
        let f32_only = router || name.ends_with(".bias") || name.contains("ssm_conv1d");
        let dtype = if shape.len() == 1 || f32_only { GgmlDType::F32 } else { format_of(name) };
        tensors.push((name.clone(), QTensor::quantize(&t, dtype).map_err(bad)?));
    }

    let controls: Vec<&str> = TINY_CONTROL.iter().chain(extra_tokens).copied().collect();
    let tokens: Vec<Value> = (0..=255u8).map(|b| Value::String(byte_token(b).to_string())).chain(controls.iter().map(|&s| Value::String(s.into()))).collect();
    let token_types: Vec<Value> = (0..vocab).map(|i| Value::I32(if i < 256 { 1 } else { 3 })).collect();
    // the chat format's template (none: the loader falls back to ChatML), BOS and EOS
    let chat = &d.tiny.chat;
    let id_of = |text: &str| -> Result<u32, ModelError> {
        match controls.iter().position(|&c| c == text) {
            Some(i) => Ok((TINY_ENDOFTEXT as usize + i) as u32),
            None => Err(ModelError::BadInput(format!("{arch}'s tiny chat format names {text}, which is not in the tiny vocabulary"))),
        }
    };
    let (template, bos, eos) = (chat.template, id_of(chat.bos)?, id_of(chat.eos)?);
    let s = |x: &str| Value::String(x.into());
    let k = |key: &str| format!("{arch}.{key}");
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(arch.name())),
        ("general.name".into(), s(if spec.moe.is_some() { "tiny-random-moe" } else { "tiny-random-llama" })),
        ("general.alignment".into(), Value::U32(32)),
        (k("context_length"), Value::U32(spec.context_length as u32)),
        (k("embedding_length"), Value::U32(h as u32)),
        (k("block_count"), Value::U32(blocks as u32)),
        (k("feed_forward_length"), Value::U32(ff as u32)),
        (k("attention.head_count"), Value::U32(spec.heads as u32)),
        (k("attention.head_count_kv"), Value::U32(spec.kv_heads as u32)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (k("rope.freq_base"), Value::F32(10000.0)),
        (k("rope.dimension_count"), Value::U32(rot as u32)),
        (k("vocab_size"), Value::U32(vocab as u32)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("default")),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(token_types)),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    if spec.nextn {
        metadata.push((k("nextn_predict_layers"), Value::U32(1)));
    }
    if spec.head_dim.is_some() {
        metadata.push((k("attention.key_length"), Value::U32(head_dim as u32)));
        metadata.push((k("attention.value_length"), Value::U32(head_dim as u32)));
    }
    if let Some(t) = template {
        metadata.push(("tokenizer.chat_template".into(), s(t)));
    }
    if d.long_rope {
        metadata.push((k("rope.scaling.attn_factor"), Value::F32(1.1902381)));
        metadata.push((k("rope.scaling.original_context_length"), Value::U32(spec.context_length as u32)));
    }
    if d.sliding.is_some() {
        metadata.push((k("attention.sliding_window"), Value::U32(spec.sliding_window as u32)));
        if d.tiny.sliding_pattern_key {
            metadata.push((k("attention.sliding_window_pattern"), Value::U32(spec.sliding_period as u32)));
        }
    }
    if spec.rope_llama3 {
        metadata.push((k("rope.scaling.type"), s("llama3")));
        metadata.push((k("rope.scaling.factor"), Value::F32(8.0)));
        metadata.push((k("rope.scaling.low_freq_factor"), Value::F32(1.0)));
        metadata.push((k("rope.scaling.high_freq_factor"), Value::F32(4.0)));
        metadata.push((k("rope.scaling.original_context_length"), Value::U32(32)));
    }
    if d.tiny.yarn {
        // YaRN as gpt-oss's (factor 32 over 4096), scaled down
        metadata.push((k("rope.scaling.type"), s("yarn")));
        metadata.push((k("rope.scaling.factor"), Value::F32(4.0)));
        metadata.push((k("rope.scaling.original_context_length"), Value::U32(64)));
    }
    if d.hybrid.is_some() {
        let TinySsm { conv_kernel, k_heads, v_heads, head_dim: sd } = tiny_ssm;
        metadata.push((k("ssm.conv_kernel"), Value::U32(conv_kernel as u32)));
        metadata.push((k("ssm.state_size"), Value::U32(sd as u32)));
        metadata.push((k("ssm.group_count"), Value::U32(k_heads as u32)));
        metadata.push((k("ssm.time_step_rank"), Value::U32(v_heads as u32)));
        metadata.push((k("ssm.inner_size"), Value::U32((v_heads * sd) as u32)));
        metadata.push((k("full_attention_interval"), Value::U32(d.hybrid.map_or(4, |hy| hy.default_interval))));
    }
    if d.hybrid.is_some_and(|hy| !hy.next_layout) {
        // Qwen3.5's proportions ([11, 11, 10, 0] over 32 pairs)
        let pairs = rot / 2;
        let a = pairs.div_ceil(3);
        let sections = [a, a, pairs.saturating_sub(2 * a), 0];
        metadata.push((k("rope.dimension_sections"), Value::Array(sections.iter().map(|&x| Value::I32(x as i32)).collect())));
    }
    if d.tiny.expert_ffn_key {
        metadata.push((k("expert_feed_forward_length"), Value::U32(ff as u32)));
    }
    if let Some(m) = &spec.moe {
        metadata.push((k("expert_count"), Value::U32(m.experts as u32)));
        metadata.push((k("expert_used_count"), Value::U32(m.used as u32)));
        if let Some(n) = m.norm_topk {
            metadata.push((k("expert_weights_norm"), Value::Bool(n)));
        }
    }
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();

    let io = |e: std::io::Error| ModelError::Io { path: path.display().to_string(), source: e };
    let mut bytes = Vec::new();
    gguf_file::write(&mut std::io::Cursor::new(&mut bytes), &md, &ts).map_err(|e| io(std::io::Error::other(e.to_string())))?;
    type_empty_merges_as_strings(&mut bytes);
    std::fs::write(path, &bytes).map_err(io)
}

/// The recurrent layers of a tiny hybrid: DeltaNet heads shaped as the attention's (key heads as
/// its KV heads, value heads as its query heads, the head width).
#[derive(Clone, Copy)]
struct TinySsm {
    conv_kernel: usize,
    k_heads: usize,
    v_heads: usize,
    head_dim: usize,
}

/// candle writes an empty array with element type u32; llama.cpp refuses a `merges` array that
/// is not typed string (even an empty one), so the tiny files (no merges: every token is one
/// byte) get the type of their empty merges array set to string, for llama.cpp to load them.
fn type_empty_merges_as_strings(bytes: &mut [u8]) {
    const KEY: &[u8] = b"tokenizer.ggml.merges";
    const ARRAY: u32 = 9;
    const U32: u32 = 4;
    const STRING: u32 = 8;
    let Some(at) = bytes.windows(KEY.len()).position(|w| w == KEY) else { return };
    let t = at + KEY.len();
    let word = |b: &[u8], i: usize| b.get(i..i + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]));
    let count = bytes.get(t + 8..t + 16).map(|s| u64::from_le_bytes(s.try_into().unwrap_or([1; 8])));
    if word(bytes, t) == Some(ARRAY) && word(bytes, t + 4) == Some(U32) && count == Some(0) {
        bytes[t + 4..t + 8].copy_from_slice(&STRING.to_le_bytes());
    }
}

/// SplitMix64: no dependency, same on every platform, so a seed names one sequence (tiny models
/// here, header mutations in the GGUF fuzz test).
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Deterministic standard normal draws (SplitMix64 + Box-Muller), so a seed names one model.
struct Normal {
    state: SplitMix64,
    spare: Option<f32>,
}

impl Normal {
    fn new(seed: u64) -> Self {
        Self { state: SplitMix64(seed ^ 0x5DEE_CE66_D1CE_4E5B), spare: None }
    }

    fn uniform(&mut self) -> f64 {
        let z = self.state.next();
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64 // in (0, 1): ln never sees 0
    }

    fn next(&mut self) -> f32 {
        if let Some(x) = self.spare.take() {
            return x;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let a = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some((r * a.sin()) as f32);
        (r * a.cos()) as f32
    }
}

/// The real model for tests that need it, from `SPECULA_MODEL` (scripts/test.sh sets it).
/// Unset: prints a skip note naming `test` and returns `None` so the test can return early —
/// unless `CI` is set, where it panics, so that CI can never skip silently. Set but missing on
/// disk: panics either way (a wrong path is a mistake, not a skip).
pub fn model_for_tests(test: &str) -> Option<PathBuf> {
    match std::env::var_os("SPECULA_MODEL").filter(|v| !v.is_empty()) {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(p.exists(), "SPECULA_MODEL={} does not exist (run `specula fetch-model --print-path`)", p.display());
            Some(p)
        }
        None if ci_is_set() => panic!("{test}: SPECULA_MODEL is not set and CI is: the model tests must run in CI (scripts/test.sh sets it)"),
        None => {
            eprintln!("skipping {test}: SPECULA_MODEL is not set (scripts/test.sh sets it; `specula fetch-model --print-path` prints it)");
            None
        }
    }
}

fn ci_is_set() -> bool {
    std::env::var("CI").map(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false")).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_are_gpt2_bytes_to_unicode() {
        assert_eq!(byte_token(b'a'), 'a');
        assert_eq!(byte_token(b' '), '\u{120}'); // 'Ġ'
        assert_eq!(byte_token(b'\n'), '\u{10A}'); // 'Ċ'
        assert_eq!(byte_token(0), '\u{100}');
        assert_eq!(byte_token(0xAD), '\u{143}'); // the last remapped byte
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_token).collect();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn same_seed_writes_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"), dir.path().join("c.gguf"));
        write_tiny_llama(&a, &TinySpec { seed: 3, ..Default::default() }).unwrap();
        write_tiny_llama(&b, &TinySpec { seed: 3, ..Default::default() }).unwrap();
        write_tiny_llama(&c, &TinySpec { seed: 4, ..Default::default() }).unwrap();
        let (a, b, c) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap(), std::fs::read(c).unwrap());
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
