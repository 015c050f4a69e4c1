//! The Llama-family transformer, read top to bottom: weights, then one forward pass over a
//! flattened batch of variable-length sequences (prefill chunks and decode tokens alike) that
//! writes keys/values into a paged cache and returns logits only for the rows asked for.

use crate::config::ModelConfig;
use crate::kv_store::KvStore;
use crate::ModelError;
use specula_kernels::attention::{paged_attention, write_kv};
use specula_kernels::matmul::{matmul, matmul_many, MatmulInput};
use specula_kernels::ops::{add_assign, rms_norm, silu_mul, Rope};
use specula_kernels::QMatrix;

pub use specula_kernels::attention::SeqSpan;

/// Slot value meaning "do not write this token's keys/values" (dummy batches).
pub const NO_SLOT: usize = usize::MAX;

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub wo: QMatrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    pub w_down: QMatrix,
}

pub struct LlamaModel {
    pub config: ModelConfig,
    pub embed: QMatrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// The output projection (the embedding matrix itself when tied).
    pub lm_head: QMatrix,
    pub rope: Rope,
}

/// One step's flattened input. Token i of sequence s sits at row `s.q_start + i`, position
/// `s.context_len - s.q_len + i`, and its keys/values go to `slots[row]`.
pub struct ForwardBatch<'a> {
    pub tokens: &'a [u32],
    pub seqs: &'a [SeqSpan<'a>],
    pub slots: &'a [usize],
    /// Rows whose logits are computed (sampled or verified positions), in output order.
    pub logits_rows: &'a [usize],
    /// Also return the final hidden states (before the output norm) of `logits_rows`.
    pub want_hidden: bool,
}

pub struct ForwardOutput {
    /// `logits_rows.len() x vocab`.
    pub logits: Vec<f32>,
    /// `logits_rows.len() x hidden` when asked for, else empty.
    pub hidden: Vec<f32>,
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
    pub fn new(config: ModelConfig, embed: QMatrix, layers: Vec<LayerWeights>, final_norm: Vec<f32>, lm_head: QMatrix, rope_freqs: Option<Vec<f32>>) -> Result<Self, ModelError> {
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
            check(&l.wq, c.q_width(), c.hidden_size, &format!("layer {i} attn_q"))?;
            check(&l.wk, c.kv_width(), c.hidden_size, &format!("layer {i} attn_k"))?;
            check(&l.wv, c.kv_width(), c.hidden_size, &format!("layer {i} attn_v"))?;
            check(&l.wo, c.hidden_size, c.q_width(), &format!("layer {i} attn_output"))?;
            check(&l.w_gate, c.intermediate_size, c.hidden_size, &format!("layer {i} ffn_gate"))?;
            check(&l.w_up, c.intermediate_size, c.hidden_size, &format!("layer {i} ffn_up"))?;
            check(&l.w_down, c.hidden_size, c.intermediate_size, &format!("layer {i} ffn_down"))?;
            check_norm(&l.attn_norm, c.hidden_size, &format!("layer {i} attn_norm"))?;
            check_norm(&l.ffn_norm, c.hidden_size, &format!("layer {i} ffn_norm"))?;
        }
        check_norm(&final_norm, c.hidden_size, "output norm")?;
        if layers.len() != c.n_layers {
            return Err(ModelError::BadTensor { name: "layers".into(), message: format!("found {} layers, config says {}", layers.len(), c.n_layers) });
        }
        if let Some(f) = &rope_freqs {
            if f.len() != c.head_dim / 2 {
                return Err(ModelError::BadTensor { name: "rope_freqs".into(), message: format!("{} entries, expected {}", f.len(), c.head_dim / 2) });
            }
        }
        let rope = Rope::new(c.head_dim, c.head_dim, c.rope_theta, c.rope_linear_scale, rope_freqs.as_deref(), c.rope_neox);
        Ok(Self { config, embed, layers, final_norm, lm_head, rope })
    }

    /// Embedding of one token (dequantized row of the embedding table).
    pub fn embed_into(&self, token: u32, out: &mut [f32]) {
        self.embed.dequantize_row_into(token as usize, out);
    }

    /// Runs the whole batch through the model. Call inside the thread pool that should do the work.
    pub fn forward(&self, batch: &ForwardBatch, kv: &mut KvStore) -> Result<ForwardOutput, ModelError> {
        let _span = tracing::trace_span!("forward", tokens = batch.tokens.len()).entered();
        let c = &self.config;
        let (t, h, qw, kvw, ff) = (batch.tokens.len(), c.hidden_size, c.q_width(), c.kv_width(), c.intermediate_size);
        self.check_batch(batch, kv)?;
        let mut positions = vec![0usize; t];
        for s in batch.seqs {
            for i in 0..s.q_len {
                positions[s.q_start + i] = s.context_len - s.q_len + i;
            }
        }

        let mut x = vec![0f32; t * h];
        for (i, &tok) in batch.tokens.iter().enumerate() {
            self.embed_into(tok, &mut x[i * h..(i + 1) * h]);
        }
        let (mut xn, mut o, mut down) = (vec![0f32; t * h], vec![0f32; t * h], vec![0f32; t * h]);
        let (mut q, mut k, mut v, mut attn) = (vec![0f32; t * qw], vec![0f32; t * kvw], vec![0f32; t * kvw], vec![0f32; t * qw]);
        let (mut gate, mut up, mut act) = (vec![0f32; t * ff], vec![0f32; t * ff], vec![0f32; t * ff]);
        let scale = 1.0 / (c.head_dim as f32).sqrt();

        for (li, l) in self.layers.iter().enumerate() {
            // attention block
            rms_norm(&x, &l.attn_norm, c.rms_eps, &mut xn);
            let inp = MatmulInput::new(&xn, h, &[&l.wq, &l.wk, &l.wv]);
            matmul_many(&inp, &[&l.wq, &l.wk, &l.wv], &mut [&mut q, &mut k, &mut v]);
            for i in 0..t {
                self.rope.apply(&mut q[i * qw..(i + 1) * qw], positions[i]);
                self.rope.apply(&mut k[i * kvw..(i + 1) * kvw], positions[i]);
                if batch.slots[i] != NO_SLOT {
                    write_kv(&mut kv.k[li], &mut kv.v[li], &kv.layout, batch.slots[i], &k[i * kvw..(i + 1) * kvw], &v[i * kvw..(i + 1) * kvw]);
                }
            }
            paged_attention(&q, &mut attn, &kv.k[li], &kv.v[li], &kv.layout, batch.seqs, scale);
            matmul(&MatmulInput::new(&attn, qw, &[&l.wo]), &l.wo, &mut o);
            add_assign(&mut x, &o);

            // feed-forward block
            rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut xn);
            let inp = MatmulInput::new(&xn, h, &[&l.w_gate, &l.w_up]);
            matmul_many(&inp, &[&l.w_gate, &l.w_up], &mut [&mut gate, &mut up]);
            silu_mul(&gate, &up, &mut act);
            matmul(&MatmulInput::new(&act, ff, &[&l.w_down]), &l.w_down, &mut down);
            add_assign(&mut x, &down);
        }

        let n = batch.logits_rows.len();
        let mut sel = vec![0f32; n * h];
        for (j, &r) in batch.logits_rows.iter().enumerate() {
            sel[j * h..(j + 1) * h].copy_from_slice(&x[r * h..(r + 1) * h]);
        }
        let logits = self.logits(&sel)?;
        Ok(ForwardOutput { logits, hidden: if batch.want_hidden { sel } else { Vec::new() } })
    }

    /// Output norm + lm_head for rows of final hidden states (`rows x hidden`).
    pub fn logits(&self, hidden: &[f32]) -> Result<Vec<f32>, ModelError> {
        let h = self.config.hidden_size;
        let n = hidden.len() / h;
        let mut hn = vec![0f32; n * h];
        rms_norm(hidden, &self.final_norm, self.config.rms_eps, &mut hn);
        let mut logits = vec![0f32; n * self.config.vocab_size];
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
        Ok(())
    }
}
