//! A file's own multi-token-prediction layer (llama.cpp's `nextn` block, as Qwen3.5/3.6 and
//! Qwen3-Next ship it): one full-attention decoder block stored after the trunk
//! (`blk.{n_layers}.*`, counted in `block_count` and named by `nextn_predict_layers`) that
//! drafts the token after next from (the next token's embedding, the trunk's normed final state).
//!
//! Only the weights live here; the layer runs as a drafter in the engine's mtp proposer.

use crate::llama::{FeedForward, LayerExtras, LayerWeights, Mixer};
use crate::ModelConfig;
use crate::ModelError;
use specula_kernels::QMatrix;
use std::sync::Arc;

#[derive(Clone)]
pub struct NextnLayer {
    /// `[H, 2H]`: concat(enorm(embedding), hnorm(hidden)) -> the block's input.
    pub eh_proj: QMatrix,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// The decoder block (gated attention as the trunk's attention layers, the trunk's kind of
    /// FFN) and its q/k norms.
    pub layer: Arc<LayerWeights>,
    pub extras: LayerExtras,
    /// The norm before the output head: `nextn.shared_head_norm`, or the trunk's output norm.
    pub head_norm: Vec<f32>,
    /// The block's own embedding and output head where the file has them (`nextn.embed_tokens`,
    /// `nextn.shared_head_head`); `None`: the trunk's.
    pub embed: Option<QMatrix>,
    pub head: Option<QMatrix>,
}

impl NextnLayer {
    /// Checks every shape against the trunk's config (the block is one of its attention layers).
    pub fn check(&self, c: &ModelConfig) -> Result<(), ModelError> {
        let h = c.hidden_size;
        let bad = |name: &str, message: String| ModelError::BadTensor { name: format!("nextn {name}"), message };
        let matrix = |m: &QMatrix, rows: usize, cols: usize, name: &str| match (m.rows, m.cols) == (rows, cols) {
            true => Ok(()),
            false => Err(bad(name, format!("shape [{}, {}] but the model needs [{rows}, {cols}]", m.rows, m.cols))),
        };
        let vector = |v: &[f32], len: usize, name: &str| match v.len() == len {
            true => Ok(()),
            false => Err(bad(name, format!("{} values but the model needs {len}", v.len()))),
        };
        matrix(&self.eh_proj, h, 2 * h, "eh_proj")?;
        vector(&self.enorm, h, "enorm")?;
        vector(&self.hnorm, h, "hnorm")?;
        vector(&self.head_norm, h, "shared_head_norm")?;
        vector(&self.layer.attn_norm, h, "attn_norm")?;
        vector(&self.layer.ffn_norm, h, "ffn norm")?;
        let Mixer::Attention(a) = &self.layer.mixer else { return Err(bad("layer", "is recurrent; a prediction layer attends".into())) };
        matrix(&a.wq, c.q_proj_rows(), h, "attn_q")?;
        matrix(&a.wk, c.kv_width(), h, "attn_k")?;
        matrix(&a.wv, c.kv_width(), h, "attn_v")?;
        matrix(&a.wo, h, c.q_width(), "attn_output")?;
        for (v, name) in [(&self.extras.q_norm, "attn_q_norm"), (&self.extras.k_norm, "attn_k_norm")] {
            if let Some(v) = v {
                vector(v, c.head_dim, name)?;
            }
        }
        match (&self.layer.ffn, &c.moe) {
            (FeedForward::Dense(f), None) => f.check(h, c.intermediate_size, "nextn ffn")?,
            (FeedForward::Moe(m), Some(mc)) => m.check(h, mc, c.n_layers)?,
            _ => return Err(bad("ffn", "is not the trunk's kind (dense or mixture of experts)".into())),
        }
        for (m, name) in [(&self.embed, "embed_tokens"), (&self.head, "shared_head_head")] {
            if let Some(m) = m {
                matrix(m, c.vocab_size, h, name)?;
            }
        }
        Ok(())
    }
}
