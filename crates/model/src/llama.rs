//! The Llama-family transformer, read top to bottom: weights, then one forward pass over a
//! flattened batch of variable-length sequences (prefill chunks and decode tokens alike) that
//! writes keys/values into a paged cache and returns logits only for the rows asked for.
//!
//! Qwen2, Qwen3 and Gemma 3 are the same block with extras, each applied when its weights or
//! config say so (see `ArchOptions`): Q/K/V biases, per-head q/k norms, post-attention and
//! post-FFN norms, GeGLU, an embedding scale, and sliding-window layers with their own RoPE.

use crate::config::{Activation, AttentionKind, ModelConfig};
use crate::delta_net::DeltaNetWeights;
use crate::kv_store::KvStore;
use crate::moe::{DenseFfn, ExpertExchange, MoeFfn};
use crate::ModelError;
use specula_kernels::attention::paged_attention_windowed;
use specula_kernels::matmul::{matmul, matmul_many, MatmulInput};
use specula_kernels::ops::{add_assign, add_bias, gelu_tanh_mul, rms_norm, rms_norm_in_place, silu_mul, split_query_gate, swiglu_oai_mul, Rope};
use specula_kernels::{QMatrix, WeightFormat};
use std::sync::Arc;

pub use specula_kernels::attention::SeqSpan;

/// Slot value meaning "do not write this token's keys/values" (dummy batches).
pub const NO_SLOT: usize = usize::MAX;

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// What mixes the positions: attention, or a Gated DeltaNet (hybrids' recurrent layers).
    pub mixer: Mixer,
    pub ffn_norm: Vec<f32>,
    pub ffn: FeedForward,
}

/// A layer's token mixer.
// one per layer, built once and never moved on the step path: the variants' sizes do not matter
#[allow(clippy::large_enum_variant)]
pub enum Mixer {
    Attention(AttentionWeights),
    DeltaNet(Box<DeltaNetWeights>),
}

/// The attention projections. In gated attention (`ArchOptions::attn_output_gate`) `wq` has
/// twice the rows: per head its queries, then its output gate.
pub struct AttentionWeights {
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub wo: QMatrix,
}

impl LayerWeights {
    /// The attention projections, `None` for a recurrent layer.
    pub fn attention(&self) -> Option<&AttentionWeights> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) => None,
        }
    }

    /// Every matrix of the layer's mixer.
    pub fn mixer_matrices(&self) -> Vec<&QMatrix> {
        match &self.mixer {
            Mixer::Attention(a) => vec![&a.wq, &a.wk, &a.wv, &a.wo],
            Mixer::DeltaNet(d) => vec![&d.wqkv, &d.wgate, &d.wbeta, &d.walpha, &d.wout],
        }
    }
}

/// A layer's weights beyond Llama's, each present when the architecture has it (all `None`
/// for Llama and Mistral).
#[derive(Clone, Debug, Default)]
pub struct LayerExtras {
    /// `[q_width]`, `[kv_width]`, `[kv_width]`: added to the projections (Qwen2).
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    /// `[head_dim]`: RMSNorm of each query / key head before RoPE (Qwen3, Gemma 3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// `[hidden]`: RMSNorm of the attention / FFN output before its residual add (Gemma 3).
    pub post_attn_norm: Option<Vec<f32>>,
    pub post_ffn_norm: Option<Vec<f32>>,
    /// `[hidden]`: added to the attention output projection (gpt-oss).
    pub o_bias: Option<Vec<f32>>,
    /// `[n_heads]`: each query head's attention sink logit (gpt-oss).
    pub sinks: Option<Vec<f32>>,
}

/// A file's own multi-token-prediction layer (llama.cpp's `nextn` block, as Qwen3.5/3.6 and
/// Qwen3-Next ship it): one full-attention decoder block stored after the trunk
/// (`blk.{n_layers}.*`, counted in `block_count` and named by `nextn_predict_layers`) that
/// drafts the token after next from (the next token's embedding, the trunk's normed final state).
/// Only the weights live here; the layer runs as a drafter in the engine's mtp proposer.
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

/// A layer's feed-forward block: one SwiGLU MLP, or a routed mixture of them.
// one per layer, built once and never moved on the step path: the variants' sizes do not matter
#[allow(clippy::large_enum_variant)]
pub enum FeedForward {
    Dense(DenseFfn),
    Moe(MoeFfn),
}

pub struct LlamaModel {
    pub config: ModelConfig,
    pub embed: QMatrix,
    pub layers: Vec<LayerWeights>,
    /// One per layer, beside `layers`.
    pub extras: Vec<LayerExtras>,
    pub final_norm: Vec<f32>,
    /// The output projection (the embedding matrix itself when tied).
    pub lm_head: QMatrix,
    pub rope: Rope,
    /// The RoPE of the sliding-window layers, when they have their own base (Gemma 3).
    pub rope_sliding: Option<Rope>,
    /// LongRoPE's long factors (Phi-3/4) and the context beyond which llama.cpp takes them
    /// (`rope.scaling.original_context_length`); [`LlamaModel::fit_context`] swaps them in.
    rope_long: Option<(usize, Rope)>,
    /// The rank group's collectives when the experts are spread over ranks (expert parallel).
    expert_exchange: Option<Arc<dyn ExpertExchange>>,
    /// Per layer: its planes in the KV store (attention layers only; `None` for recurrent ones).
    kv_index: Vec<Option<usize>>,
    /// The file's own multi-token-prediction layer, when it has one and it was asked for
    /// (`LoadOptions::nextn`): the mtp proposer's drafter; the forward never runs it.
    pub nextn: Option<NextnLayer>,
}

/// One step's flattened input. Token i of sequence s sits at row `s.q_start + i`, position
/// `s.context_len - s.q_len + i`, and its keys/values go to `slots[row]`.
pub struct ForwardBatch<'a> {
    pub tokens: &'a [u32],
    pub seqs: &'a [SeqSpan<'a>],
    pub slots: &'a [usize],
    /// Rows whose logits are computed (sampled or verified positions), in output order.
    pub logits_rows: &'a [usize],
    /// One per entry of `seqs`: the sequence's slot in the store's recurrent state (hybrid
    /// models; empty for the others).
    pub state_slots: &'a [usize],
    /// Also return, for every row of `logits_rows`, the hidden states (residual stream) after
    /// each of these layers, in this order (`n_layers - 1` is the final hidden state, before the
    /// output norm). Empty: none.
    pub hidden_layers: &'a [usize],
}

pub struct ForwardOutput {
    /// `logits_rows.len() x vocab`.
    pub logits: Vec<f32>,
    /// `logits_rows.len() x (hidden_layers.len() * hidden)`: row j holds the states of
    /// `logits_rows[j]` after each asked-for layer, back to back; empty when none were asked for.
    pub hidden: Vec<f32>,
}

/// The RoPE of the global layers with these per-frequency divisors (`rope_dims / 2` of them):
/// the model's base, linear scale and pairing, cos and sin scaled by YaRN's and LongRoPE's factors.
fn main_rope(c: &ModelConfig, freq_factors: Option<&[f32]>) -> Rope {
    let o = &c.arch_options;
    let mscale = o.rope_yarn.as_ref().map_or(1.0, |r| r.mscale()) * o.rope_mscale;
    Rope::new(c.head_dim, c.rope_dims(), c.rope_theta, c.rope_linear_scale, freq_factors, c.rope_neox).with_mscale(mscale)
}

/// A norm weight must have one entry per hidden unit: `rms_norm` takes its row length from the
/// weight, so a wrong length would silently normalise the wrong spans.
fn check_norm(v: &[f32], hidden: usize, what: &str) -> Result<(), ModelError> {
    if v.len() != hidden {
        return Err(ModelError::BadTensor { name: what.into(), message: format!("{} entries but the config needs {hidden}", v.len()) });
    }
    Ok(())
}

impl LlamaModel {
    /// A model whose layers have no extras (Llama, Mistral).
    pub fn new(
        config: ModelConfig,
        embed: QMatrix,
        layers: Vec<LayerWeights>,
        final_norm: Vec<f32>,
        lm_head: QMatrix,
        rope_freqs: Option<Vec<f32>>,
    ) -> Result<Self, ModelError> {
        let extras = vec![LayerExtras::default(); layers.len()];
        Self::with_extras(config, embed, layers, extras, final_norm, lm_head, rope_freqs)
    }

    /// A model with every layer's extras (one per layer), checked against the config: each
    /// switch of `config.arch_options` must come with its weights, of the right length.
    pub fn with_extras(
        config: ModelConfig,
        embed: QMatrix,
        layers: Vec<LayerWeights>,
        extras: Vec<LayerExtras>,
        final_norm: Vec<f32>,
        lm_head: QMatrix,
        rope_freqs: Option<Vec<f32>>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let c = &config;
        let check = |m: &QMatrix, rows: usize, cols: usize, what: &str| {
            if m.rows != rows || m.cols != cols {
                Err(ModelError::BadTensor { name: what.into(), message: format!("shape [{}, {}] but the config needs [{rows}, {cols}]", m.rows, m.cols) })
            } else {
                Ok(())
            }
        };
        check(&embed, c.vocab_size, c.hidden_size, "token embedding")?;
        check(&lm_head, c.vocab_size, c.hidden_size, "output projection")?;
        for (i, l) in layers.iter().enumerate() {
            match (&l.mixer, &c.arch_options.recurrent) {
                (Mixer::Attention(a), _) if !c.is_recurrent(i) => {
                    check(&a.wq, c.q_proj_rows(), c.hidden_size, &format!("layer {i} attn_q"))?;
                    check(&a.wk, c.kv_width(), c.hidden_size, &format!("layer {i} attn_k"))?;
                    check(&a.wv, c.kv_width(), c.hidden_size, &format!("layer {i} attn_v"))?;
                    check(&a.wo, c.hidden_size, c.q_width(), &format!("layer {i} attn_output"))?;
                }
                (Mixer::DeltaNet(d), Some(r)) if c.is_recurrent(i) => d.check(r, c.hidden_size, i)?,
                _ => {
                    return Err(ModelError::BadTensor {
                        name: format!("layer {i}"),
                        message: "its mixer (attention or recurrent) is not what the config says".into(),
                    })
                }
            }
            match (&l.ffn, &c.moe) {
                (FeedForward::Dense(f), None) => f.check(c.hidden_size, c.intermediate_size, &format!("layer {i} ffn"))?,
                (FeedForward::Moe(m), Some(mc)) => m.check(c.hidden_size, mc, i)?,
                (FeedForward::Dense(_), Some(_)) => {
                    return Err(ModelError::BadTensor { name: format!("layer {i} ffn"), message: "dense FFN in a mixture-of-experts model".into() })
                }
                (FeedForward::Moe(_), None) => {
                    return Err(ModelError::BadTensor { name: format!("layer {i} ffn"), message: "mixture of experts in a dense model".into() })
                }
            }
            check_norm(&l.attn_norm, c.hidden_size, &format!("layer {i} attn_norm"))?;
            check_norm(&l.ffn_norm, c.hidden_size, &format!("layer {i} ffn_norm"))?;
        }
        check_norm(&final_norm, c.hidden_size, "output norm")?;
        if layers.len() != c.n_layers || extras.len() != c.n_layers {
            return Err(ModelError::BadTensor {
                name: "layers".into(),
                message: format!("found {} layers ({} extras), config says {}", layers.len(), extras.len(), c.n_layers),
            });
        }
        let o = &c.arch_options;
        for (i, e) in extras.iter().enumerate() {
            // a recurrent layer has none of attention's extras
            let attends = !c.is_recurrent(i);
            let want = |v: &Option<Vec<f32>>, on: bool, len: usize, what: &str| match (v, on && attends) {
                (Some(v), true) => check_norm(v, len, &format!("layer {i} {what}")),
                (None, false) => Ok(()),
                (None, true) => Err(ModelError::BadTensor { name: format!("layer {i} {what}"), message: format!("missing, but {} needs it", c.arch) }),
                (Some(_), false) => Err(ModelError::BadTensor { name: format!("layer {i} {what}"), message: format!("present, but {} has none", c.arch) }),
            };
            want(&e.q_bias, o.qkv_bias, c.q_width(), "attn_q.bias")?;
            want(&e.k_bias, o.qkv_bias, c.kv_width(), "attn_k.bias")?;
            want(&e.v_bias, o.qkv_bias, c.kv_width(), "attn_v.bias")?;
            want(&e.q_norm, o.qk_norm, c.head_dim, "attn_q_norm")?;
            want(&e.k_norm, o.qk_norm, c.head_dim, "attn_k_norm")?;
            want(&e.post_attn_norm, o.post_norms, c.hidden_size, "post_attention_norm")?;
            want(&e.post_ffn_norm, o.post_norms, c.hidden_size, "post_ffw_norm")?;
            want(&e.o_bias, o.attn_out_bias, c.hidden_size, "attn_output.bias")?;
            want(&e.sinks, o.attn_sinks, c.n_heads, "attn_sinks")?;
        }
        let rot = c.rope_dims();
        let llama3 = o.rope_llama3.as_ref().map(|r| r.freq_factors(rot, c.rope_theta));
        let yarn = o.rope_yarn.as_ref().map(|r| r.freq_factors(rot, c.rope_theta));
        let freq_factors = rope_freqs.or(llama3).or(yarn);
        if let Some(f) = &freq_factors {
            if f.len() != rot / 2 {
                return Err(ModelError::BadTensor { name: "rope_freqs".into(), message: format!("{} entries, expected {}", f.len(), rot / 2) });
            }
        }
        let rope = main_rope(c, freq_factors.as_deref());
        // Gemma 3's sliding layers keep the unscaled RoPE of their own base (llama.cpp:
        // rope_freq_scale_train_swa = 1); gpt-oss's rotate like the global ones.
        let rope_sliding = o.sliding.as_ref().and_then(|s| s.rope_theta).map(|theta| Rope::new(c.head_dim, rot, theta, 1.0, None, c.rope_neox));
        let kv_index = crate::config::ranks_among((0..c.n_layers).map(|l| !c.is_recurrent(l)));
        Ok(Self { config, embed, layers, extras, final_norm, lm_head, rope, rope_sliding, rope_long: None, expert_exchange: None, kv_index, nextn: None })
    }

    /// Attaches the file's prediction layer, checked against this model's shapes.
    pub fn set_nextn(&mut self, layer: NextnLayer) -> Result<(), ModelError> {
        layer.check(&self.config)?;
        self.nextn = Some(layer);
        Ok(())
    }

    /// LongRoPE's long factors (`rope_factors_long.weight`, `rope_dims / 2` divisors), used
    /// instead of the short ones when the served context exceeds `original_context`.
    pub fn set_long_rope_factors(&mut self, factors: &[f32], original_context: usize) -> Result<(), ModelError> {
        let c = &self.config;
        let rot = c.rope_dims();
        if factors.len() != rot / 2 {
            return Err(ModelError::BadTensor { name: "rope_factors_long".into(), message: format!("{} entries, expected {}", factors.len(), rot / 2) });
        }
        self.rope_long = Some((original_context, main_rope(c, Some(factors))));
        Ok(())
    }

    /// Chooses what depends on the context the model is served with, as llama.cpp does from its
    /// context size: LongRoPE's long factors beyond the original context, the short ones within.
    pub fn fit_context(&mut self, max_model_len: usize) {
        if let Some((original, long)) = &self.rope_long {
            if max_model_len > *original {
                tracing::info!(max_model_len, original_context = original, "serving beyond the original context: LongRoPE's long factors");
                self.rope = long.clone();
            }
        }
    }

    /// Spreads the experts over the ranks of `exchange`'s group: this rank keeps experts
    /// `[r*E/N, (r+1)*E/N)` only (the others are released) and every MoE layer exchanges tokens
    /// with the peers. Fails, before any collective, for a dense model or when N does not divide
    /// the expert count (the same on every rank, so every rank fails).
    pub fn enable_expert_parallel(&mut self, exchange: Arc<dyn ExpertExchange>) -> Result<(), ModelError> {
        let (r, n) = (exchange.rank(), exchange.size());
        let Some(moe) = &self.config.moe else {
            return Err(ModelError::Unsupported("--enable-expert-parallel needs a mixture-of-experts model; this one is dense".into()));
        };
        if n == 0 || r >= n || moe.n_experts % n != 0 {
            return Err(ModelError::Unsupported(format!(
                "expert parallel over {n} ranks: the model's {} experts per layer cannot be split evenly (use a data-parallel size that divides {})",
                moe.n_experts, moe.n_experts
            )));
        }
        let per = moe.n_experts / n;
        for l in &mut self.layers {
            if let FeedForward::Moe(m) = &mut l.ffn {
                for (e, x) in m.experts.iter_mut().enumerate() {
                    if e / per != r {
                        *x = None;
                    }
                }
            }
        }
        if let Some(m) = &mut self.config.moe {
            m.expert_parallel_size = n;
        }
        self.expert_exchange = Some(exchange);
        Ok(())
    }

    /// Bytes of the weights the kernels read in place from the file's map (experts kept on
    /// this rank only).
    pub fn in_place_bytes(&self) -> usize {
        let experts = self.layers.iter().filter_map(|l| match &l.ffn {
            FeedForward::Moe(m) => Some(m.experts.iter().flatten()),
            FeedForward::Dense(_) => None,
        });
        experts.flatten().flat_map(|e| [&e.gate, &e.up, &e.down]).filter(|m| m.is_in_place()).map(|m| m.bytes().len()).sum()
    }

    /// The expert-parallel exchange, when enabled.
    pub fn expert_exchange(&self) -> Option<&Arc<dyn ExpertExchange>> {
        self.expert_exchange.as_ref()
    }

    /// Collectives one forward pass makes through the expert exchange (0 without one).
    pub fn exchanges_per_forward(&self) -> usize {
        match self.expert_exchange {
            Some(_) => 2 * self.layers.iter().filter(|l| matches!(l.ffn, FeedForward::Moe(_))).count(),
            None => 0,
        }
    }

    /// Joins every exchange of one forward pass with no rows, for a rank whose step ended before
    /// its forward pass reached them (so the peers are not left waiting). No-op without expert
    /// parallelism.
    pub fn join_expert_exchanges_idle(&self) -> Result<(), ModelError> {
        let Some(ex) = self.expert_exchange.as_deref() else { return Ok(()) };
        for l in &self.layers {
            if let FeedForward::Moe(m) = &l.ffn {
                m.forward(&[], &[], Some(ex), &mut [])?;
            }
        }
        Ok(())
    }

    /// Embedding of one token (dequantized row of the embedding table, times the
    /// architecture's embedding scale).
    pub fn embed_into(&self, token: u32, out: &mut [f32]) {
        self.embed.dequantize_row_into(token as usize, out);
        let s = self.config.arch_options.embed_scale;
        if s != 1.0 {
            out.iter_mut().for_each(|v| *v *= s);
        }
    }

    /// Runs the whole batch through the model. Call inside the thread pool that should do the work.
    /// With expert parallelism every rank must call this once per lockstep step (see
    /// `ExpertExchange`); it joins every exchange even when the batch is rejected.
    pub fn forward(&self, batch: &ForwardBatch, kv: &mut KvStore) -> Result<ForwardOutput, ModelError> {
        let _span = tracing::trace_span!("forward", tokens = batch.tokens.len()).entered();
        let Some(ex) = self.expert_exchange.as_deref() else {
            self.check_batch(batch, kv)?;
            return self.forward_inner(batch, kv);
        };
        // a panic mid-way must fail the peers' exchanges rather than leave them waiting
        struct AbortOnUnwind<'a>(&'a dyn ExpertExchange);
        impl Drop for AbortOnUnwind<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.abort();
                }
            }
        }
        let _guard = AbortOnUnwind(ex);
        let (t, p) = (batch.tokens.len(), ex.step_rows());
        let checked = self.check_batch(batch, kv).and_then(|()| match t > p {
            true => Err(ModelError::BadInput(format!("batch of {t} tokens exceeds the {p} rows agreed for this expert-parallel step"))),
            false => Ok(()),
        });
        if let Err(e) = checked {
            self.join_expert_exchanges_idle()?;
            return Err(e);
        }
        self.forward_inner(batch, kv)
    }

    fn forward_inner(&self, batch: &ForwardBatch, kv: &mut KvStore) -> Result<ForwardOutput, ModelError> {
        let c = &self.config;
        let (t, h, qw, kvw, ff) = (batch.tokens.len(), c.hidden_size, c.q_width(), c.kv_width(), c.intermediate_size);
        // Rows that write no KV and give no logits (dummy-batch padding) have no visible effect:
        // the experts skip them.
        let mut active: Vec<bool> = batch.slots.iter().map(|&s| s != NO_SLOT).collect();
        batch.logits_rows.iter().for_each(|&r| active[r] = true);
        let mut positions = vec![0usize; t];
        for s in batch.seqs {
            for i in 0..s.q_len {
                positions[s.q_start + i] = s.context_len - s.q_len + i;
            }
        }

        if let Some(store) = kv.recurrent.as_mut() {
            store.begin(batch.seqs, batch.state_slots)?;
        }
        let mut x = vec![0f32; t * h];
        for (i, &tok) in batch.tokens.iter().enumerate() {
            self.embed_into(tok, &mut x[i * h..(i + 1) * h]);
        }
        let (mut xn, mut o, mut down) = (vec![0f32; t * h], vec![0f32; t * h], vec![0f32; t * h]);
        let (mut q, mut k, mut v, mut attn) = (vec![0f32; t * qw], vec![0f32; t * kvw], vec![0f32; t * kvw], vec![0f32; t * qw]);
        // gated attention: the query projection's rows, queries and gates interleaved per head
        let mut q_gate = vec![0f32; if c.arch_options.attn_output_gate { 2 * t * qw } else { 0 }];
        let mut gate_sig = vec![0f32; q_gate.len() / 2];
        let mut delta_scratch = crate::delta_net::DeltaScratch::default();
        let ff_bufs = if c.moe.is_some() { 0 } else { t * ff };
        let (mut gate, mut up, mut act) = (vec![0f32; ff_bufs], vec![0f32; ff_bufs], vec![0f32; ff_bufs]);
        let scale = c.attn_scale();
        let n = batch.logits_rows.len();
        let nf = batch.hidden_layers.len();
        let mut hidden = vec![0f32; n * nf * h];

        for (li, (l, e)) in self.layers.iter().zip(&self.extras).enumerate() {
            let (window, rope) = match c.attention_kind(li) {
                AttentionKind::Global => (None, &self.rope),
                AttentionKind::Sliding { window, .. } => (Some(window), self.rope_sliding.as_ref().unwrap_or(&self.rope)),
            };
            // attention (or recurrent) block
            rms_norm(&x, &l.attn_norm, c.rms_eps, &mut xn);
            match &l.mixer {
                Mixer::DeltaNet(d) => {
                    let (Some(r), Some(state)) = (&c.arch_options.recurrent, kv.recurrent.as_mut().and_then(|s| s.layer(li))) else {
                        return Err(ModelError::BadInput(format!("layer {li} is recurrent but the KV store holds no recurrent state")));
                    };
                    d.forward(r, c.rms_eps, &xn, h, batch.seqs, batch.state_slots, state, &mut delta_scratch, &mut o);
                }
                Mixer::Attention(a) => {
                    let kvi = self.kv_index[li].unwrap_or(0);
                    // gated attention: each head's queries and then its output gate, in one projection
                    let gated = c.arch_options.attn_output_gate;
                    let q_out = if gated { &mut q_gate } else { &mut q };
                    matmul_many(&MatmulInput::new(&xn, h, &[&a.wq, &a.wk, &a.wv]), &[&a.wq, &a.wk, &a.wv], &mut [q_out, &mut k, &mut v]);
                    if gated {
                        split_query_gate(&q_gate, c.head_dim, &mut q, &mut gate_sig);
                    }
                    if let (Some(bq), Some(bk), Some(bv)) = (&e.q_bias, &e.k_bias, &e.v_bias) {
                        add_bias(&mut q, bq);
                        add_bias(&mut k, bk);
                        add_bias(&mut v, bv);
                    }
                    if let (Some(nq), Some(nk)) = (&e.q_norm, &e.k_norm) {
                        rms_norm_in_place(&mut q, nq, c.rms_eps);
                        rms_norm_in_place(&mut k, nk, c.rms_eps);
                    }
                    let rotates = c.layer_uses_rope(li);
                    for i in 0..t {
                        if rotates {
                            rope.apply(&mut q[i * qw..(i + 1) * qw], positions[i]);
                            rope.apply(&mut k[i * kvw..(i + 1) * kvw], positions[i]);
                        }
                        if batch.slots[i] != NO_SLOT {
                            kv.k[kvi].write(batch.slots[i], &k[i * kvw..(i + 1) * kvw]);
                            kv.v[kvi].write(batch.slots[i], &v[i * kvw..(i + 1) * kvw]);
                        }
                    }
                    paged_attention_windowed(&q, &mut attn, kv.k[kvi].view(), kv.v[kvi].view(), &kv.layout, batch.seqs, scale, window, e.sinks.as_deref());
                    if gated {
                        attn.iter_mut().zip(&gate_sig).for_each(|(o, &g)| *o *= g);
                    }
                    matmul(&MatmulInput::new(&attn, qw, &[&a.wo]), &a.wo, &mut o);
                }
            }
            // (a recurrent layer has none of attention's extras)
            if let Some(b) = &e.o_bias {
                add_bias(&mut o, b);
            }
            if let Some(w) = &e.post_attn_norm {
                rms_norm_in_place(&mut o, w, c.rms_eps);
            }
            add_assign(&mut x, &o);

            // feed-forward block
            rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut xn);
            match &l.ffn {
                FeedForward::Dense(f) => {
                    let inp = MatmulInput::new(&xn, h, &[&f.gate, &f.up]);
                    matmul_many(&inp, &[&f.gate, &f.up], &mut [&mut gate, &mut up]);
                    match c.arch_options.activation {
                        Activation::SiluGate => silu_mul(&gate, &up, &mut act),
                        Activation::GeluTanhGate => gelu_tanh_mul(&gate, &up, &mut act),
                        Activation::SwigluOai => swiglu_oai_mul(&gate, &up, &mut act),
                    }
                    matmul(&MatmulInput::new(&act, ff, &[&f.down]), &f.down, &mut down);
                }
                FeedForward::Moe(m) => m.forward(&xn, &active, self.expert_exchange.as_deref(), &mut down)?,
            }
            if let Some(w) = &e.post_ffn_norm {
                rms_norm_in_place(&mut down, w, c.rms_eps);
            }
            add_assign(&mut x, &down);
            for (f, _) in batch.hidden_layers.iter().enumerate().filter(|&(_, &hl)| hl == li) {
                for (j, &r) in batch.logits_rows.iter().enumerate() {
                    let at = (j * nf + f) * h;
                    hidden[at..at + h].copy_from_slice(&x[r * h..(r + 1) * h]);
                }
            }
        }

        let mut sel = vec![0f32; n * h];
        for (j, &r) in batch.logits_rows.iter().enumerate() {
            sel[j * h..(j + 1) * h].copy_from_slice(&x[r * h..(r + 1) * h]);
        }
        let logits = self.logits(&sel)?;
        Ok(ForwardOutput { logits, hidden })
    }

    /// Keeps only these rows of the output projection, in this order: from then on the logits
    /// have `keep.len()` columns, column `j` the logit of token `keep[j]` (a draft model that may
    /// propose only a subset of the vocabulary reads a fraction of its lm_head).
    pub fn restrict_output(&mut self, keep: &[u32]) -> Result<(), ModelError> {
        let rows: Vec<usize> = keep.iter().map(|&t| t as usize).collect();
        self.lm_head =
            self.lm_head.select_rows(&rows, "output projection").map_err(|e| ModelError::BadTensor { name: "output.weight".into(), message: e.to_string() })?;
        Ok(())
    }

    /// Re-encodes every projection (attention, dense feed-forward, output) stored in a wider
    /// format than the 4-bit ones (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, float) as Q4_0, where its rows
    /// are whole Q4_0 blocks: a draft model then reads fewer bytes per token. Returns the bytes
    /// of the projections before and after.
    pub fn requantize_q4_0(&mut self) -> Result<(usize, usize), ModelError> {
        let (mut before, mut after) = (0, 0);
        let mut one = |m: &mut QMatrix, name: &str| -> Result<(), ModelError> {
            before += m.bytes().len();
            let wider = !matches!(m.format, WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q4K);
            if wider && m.cols.is_multiple_of(WeightFormat::Q4_0.block_len()) {
                *m = m.requantize(WeightFormat::Q4_0, name).map_err(|e| ModelError::BadTensor { name: name.into(), message: e.to_string() })?;
            }
            after += m.bytes().len();
            Ok(())
        };
        for (i, l) in self.layers.iter_mut().enumerate() {
            if let Mixer::Attention(a) = &mut l.mixer {
                for (m, what) in [(&mut a.wq, "attn_q"), (&mut a.wk, "attn_k"), (&mut a.wv, "attn_v"), (&mut a.wo, "attn_output")] {
                    one(m, &format!("blk.{i}.{what}"))?;
                }
            }
            if let FeedForward::Dense(f) = &mut l.ffn {
                for (m, what) in [(&mut f.gate, "ffn_gate"), (&mut f.up, "ffn_up"), (&mut f.down, "ffn_down")] {
                    one(m, &format!("blk.{i}.{what}"))?;
                }
            }
        }
        one(&mut self.lm_head, "output")?;
        Ok((before, after))
    }

    /// Columns of the logits: the vocabulary, or the tokens [`Self::restrict_output`] kept.
    pub fn logits_width(&self) -> usize {
        self.lm_head.rows
    }

    /// Output norm + lm_head for rows of final hidden states (`rows x hidden`).
    pub fn logits(&self, hidden: &[f32]) -> Result<Vec<f32>, ModelError> {
        let h = self.config.hidden_size;
        let n = hidden.len() / h;
        let mut hn = vec![0f32; n * h];
        rms_norm(hidden, &self.final_norm, self.config.rms_eps, &mut hn);
        let mut logits = vec![0f32; n * self.lm_head.rows];
        if n > 0 {
            matmul(&MatmulInput::new(&hn, h, &[&self.lm_head]), &self.lm_head, &mut logits);
        }
        Ok(logits)
    }

    fn check_batch(&self, b: &ForwardBatch, kv: &KvStore) -> Result<(), ModelError> {
        let t = b.tokens.len();
        let bad = |m: String| Err(ModelError::BadInput(m));
        if b.slots.len() != t {
            return bad(format!("{} slots for {t} tokens", b.slots.len()));
        }
        if let Some(&tok) = b.tokens.iter().find(|&&x| x as usize >= self.config.vocab_size) {
            return bad(format!("token id {tok} is outside the vocabulary of {} tokens", self.config.vocab_size));
        }
        let mut covered = 0;
        for s in b.seqs {
            if s.q_start != covered || s.q_len == 0 || s.q_len > s.context_len {
                return bad(format!("sequence span {s:?} does not tile the batch"));
            }
            let blocks = s.context_len.div_ceil(kv.layout.block_size);
            if s.block_table.len() < blocks || s.block_table.iter().any(|&bl| bl as usize >= kv.num_blocks) {
                return bad(format!("block table of {} blocks cannot hold {} tokens", s.block_table.len(), s.context_len));
            }
            covered += s.q_len;
        }
        if covered != t {
            return bad(format!("sequence spans cover {covered} of {t} tokens"));
        }
        if b.slots.iter().any(|&s| s != NO_SLOT && s >= kv.num_slots()) {
            return bad("slot outside the KV cache".into());
        }
        if b.logits_rows.iter().any(|&r| r >= t) {
            return bad("logits row outside the batch".into());
        }
        if let Some(r) = &kv.recurrent {
            if b.state_slots.len() != b.seqs.len() {
                return bad(format!("{} recurrent state slots for {} sequences", b.state_slots.len(), b.seqs.len()));
            }
            if let Some(&s) = b.state_slots.iter().find(|&&s| s >= r.slots()) {
                return bad(format!("recurrent state slot {s} outside the store's {}", r.slots()));
            }
            if b.state_slots.iter().enumerate().any(|(i, s)| b.state_slots[..i].contains(s)) {
                return bad("two sequences share a recurrent state slot".into());
            }
        } else if self.config.arch_options.recurrent.is_some() {
            return bad("the model has recurrent layers but the KV store holds no recurrent state".into());
        }
        if kv.k.len() != self.config.kv_layers() {
            return bad(format!("the KV store has {} layers, the model attends in {}", kv.k.len(), self.config.kv_layers()));
        }
        if let Some(&l) = b.hidden_layers.iter().find(|&&l| l >= self.config.n_layers) {
            return bad(format!("hidden states of layer {l} asked for, but the model has {} layers", self.config.n_layers));
        }
        Ok(())
    }
}
