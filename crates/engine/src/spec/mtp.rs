//! The mtp proposer: a one-layer EAGLE/MTP-style head that reads the target's final hidden state
//! and the embedding of the next token, and drafts k tokens by running on its own hidden states.
//! It keeps no state across steps (nothing to roll back): each proposal attends only over its own
//! chain of k positions. The file format lives in `mtp_format`; training lives elsewhere.

use super::mtp_format::{self as fmt, HeadConfig, HeadFile};
use super::proposer::{Draft, DraftRequest, Proposer};
use super::vocab_map::VocabMap;
use super::SpecError;
use crate::api::SamplingParams;
use crate::sampling::{argmax, probabilities, sample_from_probs, SeqRng, TokenHistory};
use crate::types::{SeqId, TokenId};
use specula_kernels::attention::{paged_attention, write_kv, KvLayout, SeqSpan};
use specula_kernels::matmul::{matmul, matmul_many, MatmulInput};
use specula_kernels::ops::{add_assign, rms_norm, silu_mul, Rope};
use specula_kernels::formats::{quantize_row, QK};
use specula_kernels::{QMatrix, WeightBytes, WeightFormat};
use specula_model::llama::{FeedForward, LayerWeights};
use specula_model::DenseFfn;
use specula_model::LlamaModel;
use std::collections::HashMap;
use std::path::Path;

/// RNG stream of the head's draws, apart from the target's per-completion streams (0, 1, ...).
const MTP_RNG_STREAM: u64 = 0x6D74_7000;

/// How the head's matrices are held in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadWeights {
    /// As the file stores them (F32/F16/BF16, through the float kernels).
    AsStored,
    /// Requantized to Q8_0 at load (matrices whose width is a multiple of 32; others stay as
    /// stored), through the int8 kernels: the shipped F16 head's k draft steps cost a quarter to a
    /// half of a target step at batch 1 from F16, about half that from Q8_0, and the drafts barely
    /// change (heads/README.md). Verification keeps the output exact whatever the head drafts.
    Q8_0,
}

/// `m` (a float matrix) as Q8_0, or `m` itself where its rows are not whole Q8_0 blocks.
fn requantize_q8_0(m: &QMatrix) -> Result<QMatrix, specula_kernels::KernelError> {
    if m.cols % QK != 0 {
        return Ok(m.clone());
    }
    let mut row = vec![0f32; m.cols];
    let mut bytes = Vec::with_capacity(m.rows * WeightFormat::Q8_0.row_bytes(m.cols));
    for r in 0..m.rows {
        m.dequantize_row_into(r, &mut row);
        bytes.extend(quantize_row(WeightFormat::Q8_0, &row));
    }
    QMatrix::new(WeightFormat::Q8_0, m.rows, m.cols, WeightBytes::owned(bytes), "mtp head (Q8_0)")
}

/// A loaded head, checked against the target it will draft for.
pub struct MtpHead {
    pub config: HeadConfig,
    /// `[H, 2H]`: concat(embedding(token), hidden) -> the layer's input.
    fc: QMatrix,
    layer: LayerWeights,
    norm: Vec<f32>,
    /// `[K, H]` over the pruned vocabulary.
    lm_head: QMatrix,
    vocab: VocabMap,
    /// Rotate-half (HF/NeoX) pairs, as a PyTorch trainer writes them.
    rope: Rope,
}

impl MtpHead {
    /// Loads `path` and checks it fits `target`: format, hidden size, vocabulary, fingerprint,
    /// every tensor's shape and type, and `d2t`/`t2d`. The matrices are requantized to Q8_0
    /// (see [`HeadWeights`]).
    pub fn load(path: &Path, target: &LlamaModel) -> Result<Self, SpecError> {
        Self::load_with(path, target, HeadWeights::Q8_0)
    }

    /// [`MtpHead::load`] with the matrices kept as stored or requantized.
    pub fn load_with(path: &Path, target: &LlamaModel, weights: HeadWeights) -> Result<Self, SpecError> {
        let file = HeadFile::open(path)?;
        let c = file.config.clone();
        let t = &target.config;
        let err = |m: String| SpecError::Head { path: path.display().to_string(), message: m };
        if c.target_hidden != t.hidden_size {
            return Err(err(format!("head hidden size {} does not match the target's {}", c.target_hidden, t.hidden_size)));
        }
        if c.target_vocab != t.vocab_size {
            return Err(err(format!("head was trained for a vocabulary of {} tokens but the target has {}", c.target_vocab, t.vocab_size)));
        }
        if c.target_layers != t.n_layers {
            return Err(err(format!("head was trained on the hidden state of a {}-layer target but the target has {} layers", c.target_layers, t.n_layers)));
        }
        let fingerprint = fmt::target_fingerprint(target);
        if !c.accepts_fingerprint(&fingerprint) {
            return Err(err(format!(
                "this head was trained for a different target model (head fingerprint {}, target {fingerprint}); use the target it was trained for or train a head for this one",
                c.target_fingerprint
            )));
        }
        let (h, qw, kvw, ff) = (c.target_hidden, c.q_width(), c.kv_width(), c.ffn);
        let k = file.len_of(fmt::D2T).ok_or_else(|| err(format!("tensor '{}' is missing", fmt::D2T)))?;
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<QMatrix, SpecError> {
            let m = file.matrix(name, rows, cols)?;
            match weights {
                HeadWeights::AsStored => Ok(m),
                HeadWeights::Q8_0 => requantize_q8_0(&m).map_err(|e| err(format!("tensor '{name}': {e}"))),
            }
        };
        let fc = matrix(fmt::FC, h, 2 * h)?;
        let layer = LayerWeights {
            attn_norm: file.vector(fmt::ATTN_NORM, h)?,
            wq: matrix(fmt::ATTN_Q, qw, h)?,
            wk: matrix(fmt::ATTN_K, kvw, h)?,
            wv: matrix(fmt::ATTN_V, kvw, h)?,
            wo: matrix(fmt::ATTN_OUTPUT, h, qw)?,
            ffn_norm: file.vector(fmt::FFN_NORM, h)?,
            ffn: FeedForward::Dense(DenseFfn { gate: matrix(fmt::FFN_GATE, ff, h)?, up: matrix(fmt::FFN_UP, ff, h)?, down: matrix(fmt::FFN_DOWN, h, ff)? }),
        };
        let norm = file.vector(fmt::NORM, h)?;
        let lm_head = matrix(fmt::LM_HEAD, k, h)?;
        let vocab = Self::vocab_map(&file, k, path)?;
        let rope = Rope::new(c.head_dim, c.head_dim, c.rope_theta, 1.0, None, true);
        Ok(Self { config: c, fc, layer, norm, lm_head, vocab, rope })
    }

    /// `d2t` (every id inside the target vocabulary, distinct) and `t2d` (exactly its inverse).
    fn vocab_map(file: &HeadFile, k: usize, path: &Path) -> Result<VocabMap, SpecError> {
        let v = file.config.target_vocab;
        let err = |m: String| SpecError::Head { path: path.display().to_string(), message: m };
        if k == 0 {
            return Err(err("d2t is empty: the head predicts no tokens".into()));
        }
        let d2t: Vec<TokenId> = file
            .ids(fmt::D2T, k)?
            .iter()
            .enumerate()
            .map(|(d, &t)| u32::try_from(t).ok().filter(|&t| (t as usize) < v).ok_or_else(|| err(format!("d2t[{d}] = {t} is outside the target vocabulary of {v} tokens"))))
            .collect::<Result<_, _>>()?;
        let map = VocabMap::from_d2t(d2t, v).map_err(err)?;
        for (t, &d) in file.ids(fmt::T2D, v)?.iter().enumerate() {
            let expected = map.t2d(t as TokenId).map_or(-1, i64::from);
            if d != expected {
                return Err(err(format!("t2d is inconsistent with d2t: t2d[{t}] = {d} but d2t gives {expected} (-1 = not in the pruned vocabulary)")));
            }
        }
        Ok(map)
    }

    pub fn vocab(&self) -> &VocabMap {
        &self.vocab
    }

    /// Whether target token `t` lies in the head's pruned vocabulary (can ever be proposed).
    pub fn covers(&self, t: TokenId) -> bool {
        self.vocab.t2d(t).is_some()
    }

    /// One chain step for `n` sequences at chain position `pos`. `input`: `[n, 2H]` rows of
    /// concat(embedding, hidden). Sequence i's chain keys/values live in block `blocks[i]` of
    /// `chain`. Returns the new hidden states `[n, H]` and logits `[n, K]`.
    fn step(&self, input: &[f32], pos: usize, chain: &mut ChainKv, blocks: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let l = &self.layer;
        let (h, qw, kvw, ff) = (c.target_hidden, c.q_width(), c.kv_width(), c.ffn);
        let n = blocks.len();
        let mut x = vec![0f32; n * h];
        matmul(&MatmulInput::new(input, 2 * h, &[&self.fc]), &self.fc, &mut x);

        let mut xn = vec![0f32; n * h];
        let (mut q, mut k, mut v, mut attn) = (vec![0f32; n * qw], vec![0f32; n * kvw], vec![0f32; n * kvw], vec![0f32; n * qw]);
        rms_norm(&x, &l.attn_norm, c.rms_eps, &mut xn);
        matmul_many(&MatmulInput::new(&xn, h, &[&l.wq, &l.wk, &l.wv]), &[&l.wq, &l.wk, &l.wv], &mut [&mut q, &mut k, &mut v]);
        for (i, &b) in blocks.iter().enumerate() {
            self.rope.apply(&mut q[i * qw..(i + 1) * qw], pos);
            self.rope.apply(&mut k[i * kvw..(i + 1) * kvw], pos);
            let slot = b as usize * chain.layout.block_size + pos;
            write_kv(&mut chain.k, &mut chain.v, &chain.layout, slot, &k[i * kvw..(i + 1) * kvw], &v[i * kvw..(i + 1) * kvw]);
        }
        let tables: Vec<[u32; 1]> = blocks.iter().map(|&b| [b]).collect();
        let spans: Vec<SeqSpan> = tables.iter().enumerate().map(|(i, t)| SeqSpan { q_start: i, q_len: 1, context_len: pos + 1, block_table: t }).collect();
        paged_attention(&q, &mut attn, &chain.k, &chain.v, &chain.layout, &spans, 1.0 / (c.head_dim as f32).sqrt());
        let mut o = vec![0f32; n * h];
        matmul(&MatmulInput::new(&attn, qw, &[&l.wo]), &l.wo, &mut o);
        add_assign(&mut x, &o);

        let (mut gate, mut up, mut act) = (vec![0f32; n * ff], vec![0f32; n * ff], vec![0f32; n * ff]);
        rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut xn);
        let FeedForward::Dense(f) = &l.ffn else { unreachable!("the MTP head's FFN is built dense in MtpHead::load") };
        matmul_many(&MatmulInput::new(&xn, h, &[&f.gate, &f.up]), &[&f.gate, &f.up], &mut [&mut gate, &mut up]);
        silu_mul(&gate, &up, &mut act);
        matmul(&MatmulInput::new(&act, ff, &[&f.down]), &f.down, &mut o);
        add_assign(&mut x, &o);

        rms_norm(&x, &self.norm, c.rms_eps, &mut xn);
        let mut logits = vec![0f32; n * self.vocab.draft_vocab()];
        matmul(&MatmulInput::new(&xn, h, &[&self.lm_head]), &self.lm_head, &mut logits);
        (x, logits)
    }
}

/// softmax(row)[i] (temperature 1).
fn confidence(row: &[f32], i: usize) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f32 = row.iter().map(|&x| (x - m).exp()).sum();
    if z > 0.0 && z.is_finite() {
        (row[i] - m).exp() / z
    } else {
        0.0
    }
}

/// Bytes of the weights a dense layer's matmuls read per token; None for a mixture of experts.
fn layer_bytes(l: &LayerWeights) -> Option<usize> {
    let FeedForward::Dense(f) = &l.ffn else { return None };
    Some([&l.wq, &l.wk, &l.wv, &l.wo, &f.gate, &f.up, &f.down].iter().map(|m| m.bytes().len()).sum())
}

/// Keys/values of the chains of one proposal: one block of `k` slots per sequence.
struct ChainKv {
    layout: KvLayout,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl ChainKv {
    fn new(c: &HeadConfig, sequences: usize, chain_len: usize) -> Self {
        let layout = KvLayout { block_size: chain_len, n_heads: c.num_heads, n_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
        let n = sequences * chain_len * layout.kv_width();
        Self { layout, k: vec![0f32; n], v: vec![0f32; n] }
    }
}

/// A sequence drafting in this proposal.
struct Chain {
    /// Index into the requests.
    req: usize,
    /// Target id fed at the next step.
    token: TokenId,
    /// Hidden state fed at the next step: the target's at step 0, the head's own afterwards.
    hidden: Vec<f32>,
}

pub struct MtpProposer {
    head: MtpHead,
    /// Greedy drafts stop at the first token whose softmax probability under the head (at
    /// temperature 1) is below this (0: never).
    min_confidence: f32,
    /// Bytes of weights one draft step reads relative to a plain target step (None when the
    /// target's per-token weights depend on routing: mixture-of-experts).
    weight_share: Option<f64>,
    /// The target's token embedding (a clone sharing its bytes): the head file carries none.
    embed: QMatrix,
    /// Per sampling sequence, the head's own random stream (greedy sequences draw nothing).
    rngs: HashMap<SeqId, SeqRng>,
}

impl MtpProposer {
    pub fn new(head: MtpHead, target: &LlamaModel) -> Self {
        let target_bytes = target.layers.iter().map(layer_bytes).sum::<Option<usize>>().map(|b| b + target.lm_head.bytes().len());
        let head_bytes = layer_bytes(&head.layer).map(|b| b + head.fc.bytes().len() + head.lm_head.bytes().len());
        let weight_share = match (head_bytes, target_bytes) {
            (Some(h), Some(t)) if t > 0 => Some(h as f64 / t as f64),
            _ => None,
        };
        Self { head, min_confidence: 0.0, weight_share, embed: target.embed.clone(), rngs: HashMap::new() }
    }

    /// Loads the head at `path` for `target` (see [`MtpHead::load`]).
    pub fn load(path: &Path, target: &LlamaModel) -> Result<Self, SpecError> {
        Ok(Self::new(MtpHead::load(path, target)?, target))
    }

    /// Greedy drafts end at the first token the head gives less than `p` (see the field).
    pub fn with_min_confidence(mut self, p: f32) -> Self {
        self.min_confidence = p;
        self
    }

    /// [`MtpProposer::load`] with the head's matrices as `weights` says.
    pub fn load_with(path: &Path, target: &LlamaModel, weights: HeadWeights) -> Result<Self, SpecError> {
        Ok(Self::new(MtpHead::load_with(path, target, weights)?, target))
    }

    pub fn head(&self) -> &MtpHead {
        &self.head
    }

    /// The request's history in draft ids (tokens outside the pruned vocabulary dropped), for
    /// penalties on the K-sized row; empty when the request has no penalties.
    fn draft_history(&self, r: &DraftRequest, drafted: &[TokenId]) -> (Vec<u32>, Vec<u32>) {
        let p: &SamplingParams = r.params;
        if p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
            return (Vec::new(), Vec::new());
        }
        let map = |ts: &mut dyn Iterator<Item = &TokenId>| ts.filter_map(|&t| self.head.vocab.t2d(t)).collect::<Vec<u32>>();
        let (prompt, output) = r.tokens.split_at(r.prompt_len.min(r.tokens.len()));
        (map(&mut prompt.iter()), map(&mut output.iter().chain(drafted)))
    }
}

impl Proposer for MtpProposer {
    /// The bytes of weights a draft step reads (fc, the layer, the pruned lm_head) against a
    /// target step's: at batch 1 both are bound by reading their weights (measured at 2 threads
    /// on the default model: a Q8_0 draft step 0.57 ms against a 5.7 ms step, the estimate 0.097;
    /// from F16, 1.3 ms, estimate 0.18). Multiply-adds where the target's are not known.
    fn cost_per_draft_token(&self, target: &specula_model::ModelConfig) -> f64 {
        use super::adaptive::{layer_matmul_cost, matmul_cost};
        if let Some(share) = self.weight_share {
            return share;
        }
        let c = &self.head.config;
        let h = c.target_hidden as f64;
        let layer = layer_matmul_cost(c.target_hidden, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn);
        (2.0 * h * h + layer + self.head.vocab.draft_vocab() as f64 * h) / matmul_cost(target)
    }

    fn propose(&mut self, reqs: &[DraftRequest], pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let _span = tracing::trace_span!("mtp_propose", seqs = reqs.len()).entered();
        // one entry into the pool for the whole proposal, not one per chain step: each entry may
        // land on another worker, whose kernel helpers then spin beside the last one's
        pool.install(|| self.propose_here(reqs))
    }

    fn remove(&mut self, seq: SeqId) {
        self.rngs.remove(&seq);
    }

    fn needs_hidden(&self) -> bool {
        true
    }
}

impl MtpProposer {
    /// `propose`, on the current thread (inside the compute pool).
    fn propose_here(&mut self, reqs: &[DraftRequest]) -> Result<Vec<Draft>, SpecError> {
        let c = self.head.config.clone();
        let h = c.target_hidden;
        let kd = self.head.vocab.draft_vocab();
        let mut drafts: Vec<Draft> = reqs.iter().map(|r| Draft { tokens: Vec::new(), probs: (!r.params.is_greedy()).then(Vec::new) }).collect();
        let mut chains = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            let (Some(hidden), Some(&last)) = (r.hidden, r.tokens.last()) else { continue };
            if r.max_draft == 0 || (last as usize) >= self.embed.rows {
                continue;
            }
            if hidden.len() != h {
                return Err(SpecError::Config(format!("the engine passed a hidden state of {} values to an mtp head of hidden size {h}", hidden.len())));
            }
            if !r.params.is_greedy() {
                self.rngs.entry(r.seq).or_insert_with(|| SeqRng::new(r.params.seed, MTP_RNG_STREAM));
            }
            chains.push(Chain { req: i, token: last, hidden: hidden.to_vec() });
        }
        let chain_len = chains.iter().map(|ch| reqs[ch.req].max_draft).max().unwrap_or(0);
        if chain_len == 0 {
            return Ok(drafts);
        }
        let mut kv = ChainKv::new(&c, chains.len(), chain_len);
        // blocks[j] = the chain-KV block of chains[j]; a chain keeps its block after others stop
        let mut blocks: Vec<u32> = (0..chains.len() as u32).collect();
        let mut p = Vec::with_capacity(kd);
        for pos in 0..chain_len {
            if chains.is_empty() {
                break;
            }
            let mut input = vec![0f32; chains.len() * 2 * h];
            for (row, ch) in input.chunks_exact_mut(2 * h).zip(&chains) {
                self.embed.dequantize_row_into(ch.token as usize, &mut row[..h]);
                row[h..].copy_from_slice(&ch.hidden);
            }
            let (hidden, logits) = self.head.step(&input, pos, &mut kv, &blocks);
            let (mut next_chains, mut next_blocks) = (Vec::new(), Vec::new());
            for (j, mut ch) in chains.into_iter().enumerate() {
                let r = &reqs[ch.req];
                let row = &logits[j * kd..(j + 1) * kd];
                let (prompt, output) = self.draft_history(r, &drafts[ch.req].tokens);
                let d = match probabilities(row, r.params, TokenHistory { prompt: &prompt, output: &output }, &mut p) {
                    Ok(()) if r.params.is_greedy() => argmax(&p),
                    Ok(()) => sample_from_probs(&p, self.rngs.get_mut(&r.seq).expect("rng created above").uniform()),
                    Err(e) => {
                        tracing::debug!("mtp head gave an unusable row for {}: {e}", r.seq);
                        None
                    }
                };
                // greedy: a draft the head itself doubts is not worth verifying; the chain ends
                if r.params.is_greedy() && self.min_confidence > 0.0 && d.is_some_and(|d| confidence(row, d as usize) < self.min_confidence) {
                    continue;
                }
                let Some(tok) = d.and_then(|d| self.head.vocab.d2t(d)) else { continue };
                drafts[ch.req].tokens.push(tok);
                if let Some(q) = drafts[ch.req].probs.as_mut() {
                    q.push(self.head.vocab.to_target_probs(&p));
                }
                if pos + 1 < r.max_draft {
                    ch.token = tok;
                    ch.hidden.copy_from_slice(&hidden[j * h..(j + 1) * h]);
                    next_chains.push(ch);
                    next_blocks.push(blocks[j]);
                }
            }
            chains = next_chains;
            blocks = next_blocks;
        }
        Ok(drafts)
    }
}
