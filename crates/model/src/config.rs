//! The hyper-parameters of a model, read from GGUF metadata or config.json: the Llama shape,
//! plus the per-architecture switches (`ArchOptions`, from the family's `ArchDescriptor` and the
//! file) that make one forward pass serve every family of `Arch`.

pub use crate::arch::Activation;
use crate::arch::Arch;

/// Shape and numerics of the model; everything the forward pass needs besides weights.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family (`general.architecture`); the forward pass reads `arch_options`, never this.
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Linear RoPE scaling factor (1.0 = none).
    pub rope_linear_scale: f32,
    /// Whether the rotary pairs are halves of the head (HF/NeoX) or adjacent (GGUF llama).
    pub rope_neox: bool,
    /// Maximum context the model was trained for.
    pub context_length: usize,
    /// Output projection shares the token embedding.
    pub tied_embeddings: bool,
    /// Mixture-of-experts feed-forward (every layer); `None`: dense FFN of `intermediate_size`.
    pub moe: Option<MoeConfig>,
    /// What the architecture adds to or changes in the Llama block (default: nothing).
    pub arch_options: ArchOptions,
}

/// The per-architecture switches, read once at load. Each is data the forward pass applies
/// (a bias, a norm, a scale, a window), never a branch on the architecture's name.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchOptions {
    /// Biases on the Q/K/V projections (`attn_{q,k,v}.bias`: Qwen2).
    pub qkv_bias: bool,
    /// RMSNorm of every query and key head before RoPE (`attn_{q,k}_norm`: Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// A second RMSNorm on the attention and FFN outputs before each residual add
    /// (`post_attention_norm`, `post_ffw_norm`: Gemma 2/3 "sandwich" norms).
    pub post_norms: bool,
    /// The gate activation of the feed-forward.
    pub activation: Activation,
    /// Multiplier of the token embeddings on the way in (Gemma: sqrt(hidden)); 1.0 for Llama.
    pub embed_scale: f32,
    /// Attention score scale; `None`: 1/sqrt(head_dim).
    pub attn_scale: Option<f32>,
    /// Sliding-window layers (Gemma 3); `None`: every layer attends to its whole context.
    pub sliding: Option<SlidingWindow>,
    /// Llama 3.x RoPE frequency scaling, when the file carries its parameters but no
    /// `rope_freqs.weight` tensor (which, when present, wins: it holds the same factors).
    pub rope_llama3: Option<Llama3Rope>,
    /// Leading dimensions of each head that RoPE rotates (`rope.dimension_count`); `None`: all
    /// of them. Phi-3/4 rotate 96 of 128; the rest pass through unrotated.
    pub rope_dims: Option<usize>,
    /// Every `n`-th layer (1-based: layers n-1, 2n-1, ...) applies no RoPE at all (SmolLM3's
    /// NoPE layers, llama.cpp's `n_no_rope_layer_step`); `None`: every layer rotates.
    pub no_rope_period: Option<usize>,
    /// Multiplier of RoPE's cos and sin (llama.cpp's `attn_factor`, `rope.scaling.attn_factor`:
    /// Phi-3's LongRoPE); the unrotated dimensions are not scaled. 1.0 for everyone else.
    pub rope_mscale: f32,
    /// YaRN RoPE scaling (`rope.scaling.type = "yarn"`: gpt-oss, long-context Qwen3).
    pub rope_yarn: Option<YarnRope>,
    /// A bias on the attention output projection (`attn_output.bias`: gpt-oss).
    pub attn_out_bias: bool,
    /// One learned logit per query head that joins every attention softmax's denominator
    /// (`attn_sinks.weight`: gpt-oss).
    pub attn_sinks: bool,
    /// The query projection is twice as wide: each head's queries, then its output gate, and the
    /// attention output is multiplied by the gate's sigmoid (Qwen3.5 / Qwen3-Next).
    pub attn_output_gate: bool,
    /// Gated DeltaNet layers in place of attention in some layers (Qwen3.5 / Qwen3-Next hybrids).
    pub recurrent: Option<RecurrentConfig>,
}

impl Default for ArchOptions {
    fn default() -> Self {
        Self {
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            activation: Activation::SiluGate,
            embed_scale: 1.0,
            attn_scale: None,
            sliding: None,
            rope_llama3: None,
            rope_dims: None,
            no_rope_period: None,
            rope_mscale: 1.0,
            rope_yarn: None,
            attn_out_bias: false,
            attn_sinks: false,
            attn_output_gate: false,
            recurrent: None,
        }
    }
}

/// For each flag, its index among the set flags (`None` where unset): a layer's place among the
/// attention layers (its KV planes) or among the recurrent ones (its state).
pub fn ranks_among(flags: impl IntoIterator<Item = bool>) -> Vec<Option<usize>> {
    let mut next = 0;
    flags
        .into_iter()
        .map(|on| {
            on.then(|| {
                next += 1;
                next - 1
            })
        })
        .collect()
}

/// The Gated DeltaNet layers of a hybrid model, as llama.cpp reads them (`{arch}.ssm.*`): a short
/// causal convolution over the mixed q/k/v channels, then the gated delta rule over one
/// `head_dim x head_dim` state per value head. Each sequence keeps, per recurrent layer, the
/// convolution's last `conv_kernel - 1` inputs and the heads' states (`RecurrentStore`).
#[derive(Clone, Debug, PartialEq)]
pub struct RecurrentConfig {
    /// Taps of the causal convolution (`ssm.conv_kernel`).
    pub conv_kernel: usize,
    /// Query/key heads (`ssm.group_count`).
    pub k_heads: usize,
    /// Value heads (`ssm.time_step_rank`); a multiple of `k_heads`.
    pub v_heads: usize,
    /// Width of every head (`ssm.state_size`; `ssm.inner_size` = `v_heads * head_dim`).
    pub head_dim: usize,
    /// Whether each layer is recurrent (`attention.recurrent_layers`, or every layer but each
    /// `full_attention_interval`-th).
    pub layers: Vec<bool>,
    /// Each key head's value heads in a run (`DeltaShape::interleaved`, Qwen3-Next) rather than
    /// tiled (Qwen3.5).
    pub heads_interleaved: bool,
}

impl RecurrentConfig {
    pub fn key_width(&self) -> usize {
        self.k_heads * self.head_dim
    }
    pub fn value_width(&self) -> usize {
        self.v_heads * self.head_dim
    }
    /// Channels of the convolution: queries, keys, values.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }
    /// Floats of one sequence's convolution window in one layer.
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels()
    }
    pub fn delta_shape(&self) -> specula_kernels::delta_net::DeltaShape {
        specula_kernels::delta_net::DeltaShape { k_heads: self.k_heads, v_heads: self.v_heads, head_dim: self.head_dim, interleaved: self.heads_interleaved }
    }
    /// Recurrent layers.
    pub fn count(&self) -> usize {
        self.layers.iter().filter(|&&r| r).count()
    }
    /// Bytes one sequence's state takes over all recurrent layers.
    pub fn bytes_per_sequence(&self) -> usize {
        self.count() * (self.conv_state_len() + self.delta_shape().state_len()) * std::mem::size_of::<f32>()
    }
}

/// Sliding-window layers: of every `period` layers the first `period - 1` attend to the last
/// `window` positions only; the last one is global (Gemma 3: 5 of 6; gpt-oss: every other).
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    pub period: usize,
    /// The local layers' own RoPE base, unscaled (Gemma 3); `None`: the model's RoPE (gpt-oss).
    pub rope_theta: Option<f32>,
}

/// YaRN (`rope.scaling.type = "yarn"`), as ggml's `rope_yarn` computes it: frequency i is
/// interpolated (divided by `factor`) below the correction band, kept above it, ramped between;
/// cos and sin are scaled by `attn_factor * (1 + 0.1 ln factor)`.
#[derive(Clone, Debug, PartialEq)]
pub struct YarnRope {
    pub factor: f32,
    pub original_context_length: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub ext_factor: f32,
    /// llama.cpp's context `yarn_attn_factor` (1 unless `rope.scaling.yarn_log_multiplier` or
    /// `rope.scaling.attn_factor` say otherwise).
    pub attn_factor: f32,
}

impl YarnRope {
    /// The per-frequency divisors (as `rope_freqs.weight` would hold them) for `rot_dim / 2`
    /// frequencies of base `theta`: 1 / ((1 - mix) / factor + mix), mix = ramp * ext_factor.
    pub fn freq_factors(&self, rot_dim: usize, theta: f32) -> Vec<f32> {
        // ggml_rope_yarn_corr_dims, in f32 as ggml computes it
        let corr_dim = |beta: f32| rot_dim as f32 * (self.original_context_length as f32 / (beta * 2.0 * std::f32::consts::PI)).ln() / (2.0 * theta.ln());
        let low = corr_dim(self.beta_fast).floor().max(0.0);
        let high = corr_dim(self.beta_slow).ceil().min(rot_dim as f32 - 1.0);
        (0..rot_dim / 2)
            .map(|i| {
                let y = (i as f32 - low) / (high - low).max(0.001);
                let ramp = 1.0 - y.clamp(0.0, 1.0);
                let mix = ramp * self.ext_factor;
                1.0 / ((1.0 - mix) / self.factor + mix)
            })
            .collect()
    }

    /// The multiplier of cos and sin.
    pub fn mscale(&self) -> f32 {
        if self.ext_factor != 0.0 {
            self.attn_factor * (1.0 + 0.1 * self.factor.ln())
        } else {
            self.attn_factor
        }
    }
}

/// How one layer attends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AttentionKind {
    /// The whole causal context, rotated with the model's RoPE.
    Global,
    /// The last `window` positions (the query's own included), rotated with the local RoPE
    /// (`SlidingWindow::rope_theta`) when the model has one.
    Sliding { window: usize },
}

/// Llama 3.x RoPE scaling (`rope_type: "llama3"` in config.json): long wavelengths are
/// stretched by `factor`, short ones kept, the band between interpolated.
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context_length: usize,
}

impl Llama3Rope {
    /// The per-frequency divisors (`rope_freqs.weight` as llama.cpp's converter writes it) for
    /// `rot_dim / 2` frequencies of RoPE base `theta`: 1 for short wavelengths, `factor` for
    /// long ones, and 1 / ((1 - s) / factor + s) in between, s = (L / wavelen - low) / (high - low).
    pub fn freq_factors(&self, rot_dim: usize, theta: f32) -> Vec<f32> {
        let old = self.original_context_length as f64;
        let (low, high, factor) = (self.low_freq_factor as f64, self.high_freq_factor as f64, self.factor as f64);
        let (low_wavelen, high_wavelen) = (old / low, old / high);
        (0..rot_dim / 2)
            .map(|i| {
                let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / rot_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor as f32
                } else {
                    let s = (old / wavelen - low) / (high - low);
                    (1.0 / ((1.0 - s) / factor + s)) as f32
                }
            })
            .collect()
    }
}

/// Shape and routing of a mixture-of-experts feed-forward (Mixtral, Qwen-MoE style).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer (`{arch}.expert_count`).
    pub n_experts: usize,
    /// Experts each token is routed to (`{arch}.expert_used_count`, top-k).
    pub n_used: usize,
    /// Hidden width of each expert's gate/up projections.
    pub expert_ffn: usize,
    /// Renormalise the chosen experts' softmax probabilities to sum to 1 (Mixtral, where it
    /// equals a softmax over the chosen k logits; Qwen-MoE's `norm_topk_prob`). Off: the chosen
    /// experts keep their probabilities over all experts (Qwen1.5/Qwen2-MoE).
    pub norm_topk: bool,
    /// Hidden width of the shared expert every token also goes through (Qwen2-MoE), if any.
    pub shared_ffn: Option<usize>,
    /// Ranks the experts are spread over (1: every expert on this rank); set by
    /// `LlamaModel::enable_expert_parallel`, and part of the configuration ranks must agree on.
    pub expert_parallel_size: usize,
}

impl ModelConfig {
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Bytes one token's keys and values take over all layers in a KV cache of `dtype`
    /// (`KvStore::bytes_per_token` for this model).
    pub fn kv_bytes_per_token(&self, dtype: specula_kernels::kv::KvDtype) -> usize {
        2 * self.kv_layers() * dtype.bytes(self.kv_width())
    }

    /// Whether layer `layer` is a recurrent (Gated DeltaNet) layer rather than attention.
    pub fn is_recurrent(&self, layer: usize) -> bool {
        self.arch_options.recurrent.as_ref().is_some_and(|r| r.layers.get(layer).copied().unwrap_or(false))
    }

    /// Layers with a KV cache (the attention layers).
    pub fn kv_layers(&self) -> usize {
        (0..self.n_layers).filter(|&l| !self.is_recurrent(l)).count()
    }

    /// Rows of each attention layer's query projection: the queries, and in gated attention
    /// (`attn_output_gate`) each head's output gate beside them.
    pub fn q_proj_rows(&self) -> usize {
        self.q_width() * if self.arch_options.attn_output_gate { 2 } else { 1 }
    }

    /// How layer `layer` attends (global unless the model has sliding-window layers).
    pub fn attention_kind(&self, layer: usize) -> AttentionKind {
        match &self.arch_options.sliding {
            Some(s) if layer % s.period < s.period - 1 => AttentionKind::Sliding { window: s.window },
            _ => AttentionKind::Global,
        }
    }

    /// Leading dimensions of each head that RoPE rotates.
    pub fn rope_dims(&self) -> usize {
        self.arch_options.rope_dims.unwrap_or(self.head_dim)
    }

    /// Whether layer `layer` rotates its queries and keys (false on SmolLM3's NoPE layers).
    pub fn layer_uses_rope(&self, layer: usize) -> bool {
        self.arch_options.no_rope_period.is_none_or(|n| !(layer + 1).is_multiple_of(n))
    }

    /// The attention score scale.
    pub fn attn_scale(&self) -> f32 {
        self.arch_options.attn_scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Checks the shape is self-consistent and inside the documented bounds (`limits`); the
    /// loaders call this before anything is sized from the config.
    pub fn validate(&self) -> Result<(), crate::ModelError> {
        let bad = |m: String| Err(crate::ModelError::Unsupported(m));
        let within = |what: &str, v: usize, min: usize, max: usize| -> Result<(), crate::ModelError> {
            if v < min || v > max {
                return bad(format!("{what} is {v}; specula supports {min} to {max}"));
            }
            Ok(())
        };
        within("block_count (layers)", self.n_layers, 1, limits::MAX_LAYERS)?;
        within("the vocabulary size", self.vocab_size, 1, limits::MAX_VOCAB)?;
        within("embedding_length (hidden size)", self.hidden_size, 1, limits::MAX_HIDDEN)?;
        within("feed_forward_length", self.intermediate_size, 0, limits::MAX_FFN)?;
        within("the attention head count", self.n_heads, 1, limits::MAX_HEADS)?;
        within("the KV head count", self.n_kv_heads, 1, limits::MAX_HEADS)?;
        within("the head dimension", self.head_dim, 2, limits::MAX_HEAD_DIM)?;
        within("context_length", self.context_length, 1, limits::MAX_CONTEXT)?;
        if self.moe.is_none() && self.intermediate_size == 0 {
            return bad("feed_forward_length is 0 in a dense model".into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!("{} attention heads cannot be grouped over {} KV heads", self.n_heads, self.n_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dimension {} is odd; RoPE needs pairs", self.head_dim));
        }
        if let Some(r) = self.arch_options.rope_dims {
            if r == 0 || r > self.head_dim || !r.is_multiple_of(2) {
                return bad(format!("RoPE over {r} of {} dimensions per head (must be even, 2..=head dimension)", self.head_dim));
            }
        }
        if self.arch_options.no_rope_period == Some(0) {
            return bad("a NoPE layer period of 0".into());
        }
        if !self.hidden_size.is_multiple_of(32) || !self.intermediate_size.is_multiple_of(32) {
            return bad(format!("hidden size {} and FFN size {} must be multiples of 32 for the quantized kernels", self.hidden_size, self.intermediate_size));
        }
        let positive = |what: &str, x: f32| -> Result<(), crate::ModelError> {
            if !(x.is_finite() && x > 0.0) {
                return bad(format!("{what} is {x}; it must be a positive finite number"));
            }
            Ok(())
        };
        positive("the RMS norm epsilon", self.rms_eps)?;
        positive("the RoPE base (rope.freq_base)", self.rope_theta)?;
        positive("the RoPE linear scaling factor", self.rope_linear_scale)?;
        positive("the embedding scale", self.arch_options.embed_scale)?;
        if let Some(a) = self.arch_options.attn_scale {
            positive("attention.scale", a)?;
        }
        if let Some(s) = &self.arch_options.sliding {
            if s.window == 0 || s.period == 0 || s.window > limits::MAX_CONTEXT || s.period > limits::MAX_LAYERS {
                return bad(format!("sliding window of {} positions every {} layers", s.window, s.period));
            }
            if let Some(theta) = s.rope_theta {
                positive("the local RoPE base (rope.local.freq_base)", theta)?;
            }
        }
        if let Some(y) = &self.arch_options.rope_yarn {
            positive("rope.scaling.factor", y.factor)?;
            positive("rope.scaling.yarn_beta_fast", y.beta_fast)?;
            positive("rope.scaling.yarn_beta_slow", y.beta_slow)?;
            positive("the YaRN attention factor", y.attn_factor)?;
            if !y.ext_factor.is_finite() {
                return bad(format!("rope.scaling.yarn_ext_factor is {}", y.ext_factor));
            }
            within("rope.scaling.original_context_length", y.original_context_length, 1, limits::MAX_CONTEXT)?;
        }
        if let Some(r) = &self.arch_options.rope_llama3 {
            positive("rope.scaling.factor", r.factor)?;
            positive("rope.scaling.low_freq_factor", r.low_freq_factor)?;
            positive("rope.scaling.high_freq_factor", r.high_freq_factor)?;
            if r.high_freq_factor <= r.low_freq_factor {
                return bad(format!("rope.scaling.high_freq_factor {} must be above low_freq_factor {}", r.high_freq_factor, r.low_freq_factor));
            }
            within("rope.scaling.original_context_length", r.original_context_length, 1, limits::MAX_CONTEXT)?;
        }
        if let Some(r) = &self.arch_options.recurrent {
            within("ssm.conv_kernel", r.conv_kernel, 1, 64)?;
            within("ssm.group_count", r.k_heads, 1, limits::MAX_HEADS)?;
            within("ssm.time_step_rank", r.v_heads, 1, limits::MAX_HEADS)?;
            within("ssm.state_size", r.head_dim, 1, limits::MAX_HEAD_DIM)?;
            if !r.v_heads.is_multiple_of(r.k_heads) {
                return bad(format!("{} DeltaNet value heads cannot share {} key heads", r.v_heads, r.k_heads));
            }
            if r.layers.len() != self.n_layers {
                return bad(format!("{} recurrent-layer flags for {} layers", r.layers.len(), self.n_layers));
            }
        }
        if let Some(m) = &self.moe {
            within("expert_count", m.n_experts, 1, limits::MAX_EXPERTS)?;
            within("expert_feed_forward_length", m.expert_ffn, 1, limits::MAX_FFN)?;
            if let Some(f) = m.shared_ffn {
                within("the shared expert's width", f, 1, limits::MAX_FFN)?;
            }
            if self.arch_options.activation == Activation::GeluTanhGate {
                return bad(format!("mixture-of-experts layers with {:?} are not supported (SwiGLU experts only)", self.arch_options.activation));
            }
            if m.n_used == 0 || m.n_used > m.n_experts {
                return bad(format!("{} experts used per token out of {} experts", m.n_used, m.n_experts));
            }
            if m.expert_ffn % 32 != 0 || m.shared_ffn.is_some_and(|f| f % 32 != 0) {
                return bad(format!("expert FFN size {} (shared {:?}) must be a multiple of 32 for the quantized kernels", m.expert_ffn, m.shared_ffn));
            }
        }
        Ok(())
    }
}

/// Bounds on the hyper-parameters a model file may declare, checked by `ModelConfig::validate`
/// before anything is allocated from them. Each is well above every published model (so a
/// real model is never refused) and low enough that sizing from it cannot exhaust memory.
pub mod limits {
    /// Layers (the deepest published models have ~130).
    pub const MAX_LAYERS: usize = 1024;
    /// Vocabulary entries (largest published: 262 144).
    pub const MAX_VOCAB: usize = 1 << 22;
    /// Hidden size (largest published: 16 384-25 600).
    pub const MAX_HIDDEN: usize = 1 << 17;
    /// Feed-forward width, dense or per expert.
    pub const MAX_FFN: usize = 1 << 20;
    /// Attention heads, query or key/value.
    pub const MAX_HEADS: usize = 1024;
    /// Width of one head (published: 64 to 256; MLA's 576).
    pub const MAX_HEAD_DIM: usize = 1024;
    /// Trained context length (largest published: 10M).
    pub const MAX_CONTEXT: usize = 1 << 24;
    /// Experts per layer (largest published: 384).
    pub const MAX_EXPERTS: usize = 1024;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.1's published factors (factor 8, low 1, high 4, original context 8192, theta
    /// 500000, head_dim 128), as llama.cpp's converter writes them into rope_freqs.weight.
    #[test]
    fn llama3_freq_factors_match_the_llama_3_1_recipe() {
        let r = Llama3Rope { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_context_length: 8192 };
        let f = r.freq_factors(128, 500000.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0); // wavelength 2*pi: kept
        assert_eq!(f[63], 8.0); // longest wavelengths: stretched by the factor
                                // the band between is monotone and strictly inside (1, 8)
        let mid: Vec<f32> = f.iter().copied().filter(|&x| x > 1.0 && x < 8.0).collect();
        assert!(!mid.is_empty() && mid.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
        // frequency 31: wavelen = 2 pi * 500000^(62/128) ~ 3680, between 2048 and 8192
        let wl = 2.0 * std::f64::consts::PI * 500000f64.powf(62.0 / 128.0);
        let s = (8192.0 / wl - 1.0) / 3.0;
        assert!(f[31] > 1.0 && f[31] < 8.0 && (f[31] as f64 - 1.0 / ((1.0 - s) / 8.0 + s)).abs() < 1e-5, "{}", f[31]);
    }

    fn tiny() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 10,
            hidden_size: 64,
            intermediate_size: 64,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            rms_eps: 1e-6,
            rope_theta: 1e4,
            rope_linear_scale: 1.0,
            rope_neox: false,
            context_length: 100,
            tied_embeddings: true,
            moe: None,
            arch_options: ArchOptions::default(),
        }
    }

    #[test]
    fn validate_refuses_counts_outside_the_limits_and_non_finite_numbers() {
        assert!(tiny().validate().is_ok());
        type Case = (fn(&mut ModelConfig), &'static str);
        let cases: Vec<Case> = vec![
            (|c| c.n_layers = u32::MAX as usize, "block_count"),
            (|c| c.n_layers = 0, "block_count"),
            (|c| c.vocab_size = limits::MAX_VOCAB + 1, "vocabulary"),
            (|c| c.hidden_size = 0, "hidden size"),
            (|c| c.n_heads = 0, "head count"),
            (|c| c.n_kv_heads = 3, "grouped"),
            (|c| c.head_dim = 4096, "head dimension"),
            (|c| c.context_length = u32::MAX as usize, "context_length"),
            (|c| c.rms_eps = f32::NAN, "epsilon"),
            (|c| c.rope_theta = -1.0, "RoPE base"),
            (
                |c| c.moe = Some(MoeConfig { n_experts: 1 << 20, n_used: 2, expert_ffn: 64, norm_topk: true, shared_ffn: None, expert_parallel_size: 1 }),
                "expert_count",
            ),
        ];
        for (mutate, want) in cases {
            let mut c = tiny();
            mutate(&mut c);
            let e = c.validate().expect_err(want).to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{want}: {e}");
        }
    }

    #[test]
    fn gemma3_layers_are_sliding_except_every_sixth() {
        let mut c = ModelConfig {
            arch: Arch::Gemma3,
            vocab_size: 10,
            hidden_size: 64,
            intermediate_size: 64,
            n_layers: 12,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 16,
            rms_eps: 1e-6,
            rope_theta: 1e6,
            rope_linear_scale: 1.0,
            rope_neox: true,
            context_length: 100,
            tied_embeddings: true,
            moe: None,
            arch_options: ArchOptions::default(),
        };
        assert!((0..12).all(|l| c.attention_kind(l) == AttentionKind::Global));
        assert_eq!(c.attn_scale(), 0.25);
        c.arch_options.sliding = Some(SlidingWindow { window: 512, period: 6, rope_theta: Some(1e4) });
        let global: Vec<usize> = (0..12).filter(|&l| c.attention_kind(l) == AttentionKind::Global).collect();
        assert_eq!(global, [5, 11]);
        assert_eq!(c.attention_kind(0), AttentionKind::Sliding { window: 512 });
    }
}
