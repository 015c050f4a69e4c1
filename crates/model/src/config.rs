//! The hyper-parameters of a Llama-family model, read from GGUF metadata or config.json.

/// Shape and numerics of the model; everything the forward pass needs besides weights.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
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

    /// Checks the shape is self-consistent; the loader calls this once.
    pub fn validate(&self) -> Result<(), crate::ModelError> {
        let bad = |m: String| Err(crate::ModelError::Unsupported(m));
        if self.n_heads == 0 || self.n_kv_heads == 0 || self.n_heads % self.n_kv_heads != 0 {
            return bad(format!("{} attention heads cannot be grouped over {} KV heads", self.n_heads, self.n_kv_heads));
        }
        if self.head_dim % 2 != 0 {
            return bad(format!("head dimension {} is odd; RoPE needs pairs", self.head_dim));
        }
        if self.hidden_size % 32 != 0 || self.intermediate_size % 32 != 0 {
            return bad(format!("hidden size {} and FFN size {} must be multiples of 32 for the quantized kernels", self.hidden_size, self.intermediate_size));
        }
        if let Some(m) = &self.moe {
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
