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
            return bad(format!(
                "hidden size {} and FFN size {} must be multiples of 32 for the quantized kernels",
                self.hidden_size, self.intermediate_size
            ));
        }
        Ok(())
    }
}
