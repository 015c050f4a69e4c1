//! The mtp proposer: a one-layer EAGLE/MTP-style head that reads the target's final hidden state
//! and the embedding of the next token, and drafts k tokens by running on its own hidden states.
//! The head is one we trained (a head file, over a pruned vocabulary) or the target file's own
//! multi-token-prediction layer (`nextn`, as Qwen3.5 ships it: RMSNorms before the input
//! projection, gated attention with q/k norms and the target's RoPE, the target's FFN and head).
//! Its attention reads the draft chain and, for a `sequence` head (EAGLE-style), the keys/values of
//! the sequence's earlier target rows, kept per sequence (`SeqContext`) and built lazily from the
//! hidden states of the tokens each step emitted: accepted tokens only, so nothing to roll back.
//! The file format lives in `mtp_format`; training lives elsewhere.

use super::mtp_format::{self as fmt, HeadConfig, HeadFile};
use super::proposer::{Draft, DraftRequest, Proposer};
use super::vocab_map::VocabMap;
use super::SpecError;
use crate::api::SamplingParams;
use crate::sampling::{argmax, probabilities, sample_from_probs, SeqRng, TokenHistory};
use crate::types::{SeqId, TokenId};
use specula_kernels::attention::{paged_attention, KvLayout, SeqSpan};
use specula_kernels::formats::QK;
use specula_kernels::matmul::{matmul, matmul_many, MatmulInput};
use specula_kernels::ops::{add_assign, rms_norm, rms_norm_in_place, split_query_gate, Rope};
use specula_kernels::{QMatrix, WeightFormat};
use specula_model::config::Activation;
use specula_model::llama::{AttentionWeights, FeedForward, LayerExtras, LayerWeights, Mixer};
use specula_model::DenseFfn;
use specula_model::LlamaModel;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

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

/// `m` (a float matrix) as Q8_0, or `m` itself where it is Q8_0 already (a file stored so) or its
/// rows are not whole Q8_0 blocks.
fn requantize_q8_0(m: &QMatrix) -> Result<QMatrix, specula_kernels::KernelError> {
    if !m.cols.is_multiple_of(QK) || m.format == WeightFormat::Q8_0 {
        return Ok(m.clone());
    }
    m.requantize(WeightFormat::Q8_0, "mtp head (Q8_0)")
}

/// A loaded head, checked against the target it will draft for.
pub struct MtpHead {
    pub config: HeadConfig,
    /// `[H, F * H]`: a target row's F feature-layer states -> the one state fc reads (heads of
    /// several feature layers only).
    fuse: Option<QMatrix>,
    /// `[H, 2H]`: concat(embedding(token), hidden) -> the layer's input.
    fc: QMatrix,
    layer: Arc<LayerWeights>,
    /// The q/k norms of a file's prediction layer (a trained head has none).
    extras: LayerExtras,
    /// Whether the query projection also gives each head's output gate (gated attention).
    gated: bool,
    norm: Vec<f32>,
    /// `[K, H]` over the pruned vocabulary.
    lm_head: QMatrix,
    vocab: VocabMap,
    /// Rotate-half (HF/NeoX) pairs, as a PyTorch trainer writes them; a file's prediction layer
    /// rotates as its target does.
    rope: Rope,
    /// Earlier target rows a sequence's context keeps.
    window: usize,
    /// What a file's own prediction layer adds; `None` for a trained head.
    nextn: Option<NextnInputs>,
}

/// The steps of a file's prediction layer around the shared body (llama.cpp's qwen35 MTP graph):
/// the target's rows enter through the target's output norm (its `h_nextn`), the embedding and
/// hidden halves of the input through `enorm` and `hnorm`, a row pairing target row `p` with the
/// token after it sits at position `p + 1`, and the chain carries the head-normed output.
struct NextnInputs {
    target_norm: Vec<f32>,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    /// The layer's own token embedding (`nextn.embed_tokens`), where the file has one.
    embed: Option<QMatrix>,
}

/// Earlier rows a file's prediction layer attends to (the sequence's output rows from its last
/// prompt row on): llama.cpp runs it over every row of the sequence; a window bounds the memory
/// and time per sequence here.
pub const NEXTN_WINDOW: usize = 4096;

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
        let fuse = if c.fuses() { Some(matrix(fmt::FUSE, h, c.feature_width())?) } else { None };
        let fc = matrix(fmt::FC, h, 2 * h)?;
        let layer = Arc::new(LayerWeights {
            attn_norm: file.vector(fmt::ATTN_NORM, h)?,
            mixer: Mixer::Attention(AttentionWeights {
                wq: matrix(fmt::ATTN_Q, qw, h)?,
                wk: matrix(fmt::ATTN_K, kvw, h)?,
                wv: matrix(fmt::ATTN_V, kvw, h)?,
                wo: matrix(fmt::ATTN_OUTPUT, h, qw)?,
            }),
            ffn_norm: file.vector(fmt::FFN_NORM, h)?,
            ffn: FeedForward::Dense(DenseFfn::new(matrix(fmt::FFN_GATE, ff, h)?, matrix(fmt::FFN_UP, ff, h)?, matrix(fmt::FFN_DOWN, h, ff)?)),
        });
        let norm = file.vector(fmt::NORM, h)?;
        let lm_head = matrix(fmt::LM_HEAD, k, h)?;
        let vocab = Self::vocab_map(&file, k, path)?;
        let rope = Rope::new(c.head_dim, c.head_dim, c.rope_theta, 1.0, None, true);
        let window = c.context.window();
        Ok(Self { config: c, fuse, fc, layer, extras: LayerExtras::default(), gated: false, norm, lm_head, vocab, rope, window, nextn: None })
    }

    /// The target file's own prediction layer (`LlamaModel::nextn`, loaded with
    /// `LoadOptions::nextn`) as a head proposing the target ids `keep` (increasing; the whole
    /// vocabulary, or the output rows a draft step computes cut to those as a draft model's are,
    /// `SpecConfig::draft_vocab`), the matrices as the file stores them.
    pub fn from_nextn(target: &LlamaModel, keep: &[TokenId]) -> Result<Self, SpecError> {
        let Some(n) = &target.nextn else {
            return Err(SpecError::Config(format!(
                "the target ({}) has no multi-token-prediction layer of its own (nextn); pass --draft-model HEAD.safetensors, an mtp head trained for it",
                target.config.arch
            )));
        };
        let t = &target.config;
        let ffn = match &t.moe {
            // (the cost estimate's width: the experts a token runs, and the shared one)
            Some(m) => m.expert_ffn * m.n_used + m.shared_ffn.unwrap_or(0),
            None => t.intermediate_size,
        };
        let head = n.head.as_ref().unwrap_or(&target.lm_head);
        let (lm_head, vocab) = match keep.len() == t.vocab_size {
            true => (head.clone(), VocabMap::identity(t.vocab_size)),
            false => {
                let rows: Vec<usize> = keep.iter().map(|&id| id as usize).collect();
                let lm_head = head.select_rows(&rows, "nextn output rows").map_err(|e| SpecError::Config(e.to_string()))?;
                (lm_head, VocabMap::from_d2t(keep.to_vec(), t.vocab_size).map_err(SpecError::Config)?)
            }
        };
        let config = HeadConfig {
            target_vocab: t.vocab_size,
            target_hidden: t.hidden_size,
            target_layers: t.n_layers,
            feature_layers: vec![t.n_layers - 1],
            num_heads: t.n_heads,
            num_kv_heads: t.n_kv_heads,
            head_dim: t.head_dim,
            ffn,
            rms_eps: t.rms_eps,
            rope_theta: t.rope_theta,
            target_fingerprint: fmt::target_fingerprint(target),
            context: fmt::HeadContext::Sequence,
        };
        Ok(Self {
            config,
            fuse: None,
            fc: n.eh_proj.clone(),
            layer: Arc::clone(&n.layer),
            extras: n.extras.clone(),
            gated: t.arch_options.attn_output_gate,
            norm: n.head_norm.clone(),
            lm_head,
            vocab,
            rope: target.rope.clone(),
            window: NEXTN_WINDOW,
            nextn: Some(NextnInputs { target_norm: target.final_norm.clone(), enorm: n.enorm.clone(), hnorm: n.hnorm.clone(), embed: n.embed.clone() }),
        })
    }

    /// The position a row pairing target row `p` with the token after it is rotated at.
    fn row_position(&self, p: usize) -> usize {
        p + usize::from(self.nextn.is_some())
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
            .map(|(d, &t)| {
                u32::try_from(t).ok().filter(|&t| (t as usize) < v).ok_or_else(|| err(format!("d2t[{d}] = {t} is outside the target vocabulary of {v} tokens")))
            })
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

    /// One H-wide state per target row from its feature-layer states (`[n, F * H]`): `fuse`
    /// applied, or the rows themselves for a head of one feature layer.
    fn fused(&self, mut features: Vec<f32>) -> Vec<f32> {
        if let Some(n) = &self.nextn {
            rms_norm_in_place(&mut features, &n.target_norm, self.config.rms_eps);
            return features;
        }
        let Some(fuse) = &self.fuse else { return features };
        let (h, w) = (self.config.target_hidden, self.config.feature_width());
        let mut out = vec![0f32; features.len() / w * h];
        matmul(&MatmulInput::new(&features, w, &[fuse]), fuse, &mut out);
        out
    }

    /// concat(embedding(token), hidden) per row, each half through its RMSNorm for a file's
    /// prediction layer: the input `project` reads.
    fn input_rows<'a>(&self, embed: &QMatrix, rows: impl ExactSizeIterator<Item = (TokenId, &'a [f32])>) -> Vec<f32> {
        let h = self.config.target_hidden;
        let mut input = vec![0f32; rows.len() * 2 * h];
        for (row, (tok, hidden)) in input.chunks_exact_mut(2 * h).zip(rows) {
            embed.dequantize_row_into(tok as usize, &mut row[..h]);
            row[h..].copy_from_slice(hidden);
            if let Some(n) = &self.nextn {
                let (e, x) = row.split_at_mut(h);
                rms_norm_in_place(e, &n.enorm, self.config.rms_eps);
                rms_norm_in_place(x, &n.hnorm, self.config.rms_eps);
            }
        }
        input
    }

    /// The layer's input and attention projections for `n` rows: `input` `[n, 2H]` rows of
    /// concat(embedding, hidden), row i for target row `pos[i]`. Returns the residual `x` `[n, H]`,
    /// the rotated queries `[n, qw]` and keys, the values `[n, kvw]` and, for gated attention,
    /// the output gates (sigmoid applied) `[n, qw]`.
    fn project(&self, input: &[f32], pos: &[usize]) -> Projected {
        let c = &self.config;
        let l = &self.layer;
        let (h, qw, kvw) = (c.target_hidden, c.q_width(), c.kv_width());
        let n = pos.len();
        let mut x = vec![0f32; n * h];
        matmul(&MatmulInput::new(input, 2 * h, &[&self.fc]), &self.fc, &mut x);
        let mut xn = vec![0f32; n * h];
        let q_rows = if self.gated { 2 * qw } else { qw };
        let (mut q, mut k, mut v) = (vec![0f32; n * q_rows], vec![0f32; n * kvw], vec![0f32; n * kvw]);
        rms_norm(&x, &l.attn_norm, c.rms_eps, &mut xn);
        let Mixer::Attention(a) = &l.mixer else { unreachable!("an mtp head's layer attends (MtpHead::load, NextnLayer::check)") };
        matmul_many(&MatmulInput::new(&xn, h, &[&a.wq, &a.wk, &a.wv]), &[&a.wq, &a.wk, &a.wv], &mut [&mut q, &mut k, &mut v]);
        let mut gate = Vec::new();
        if self.gated {
            // per head its queries, then its output gate (as the target's gated attention)
            let (mut qs, mut gs) = (vec![0f32; n * qw], vec![0f32; n * qw]);
            split_query_gate(&q, c.head_dim, &mut qs, &mut gs);
            (q, gate) = (qs, gs);
        }
        if let (Some(nq), Some(nk)) = (&self.extras.q_norm, &self.extras.k_norm) {
            rms_norm_in_place(&mut q, nq, c.rms_eps);
            rms_norm_in_place(&mut k, nk, c.rms_eps);
        }
        for (i, &p) in pos.iter().enumerate() {
            let p = self.row_position(p);
            self.rope.apply(&mut q[i * qw..(i + 1) * qw], p);
            self.rope.apply(&mut k[i * kvw..(i + 1) * kvw], p);
        }
        Projected { x, q, k, v, gate }
    }

    /// The rest of the layer for `n` rows, given their residual `x`, attention output `attn`
    /// `[n, qw]` and output gates (gated attention; else empty): returns the hidden states the
    /// chain carries on `[n, H]` (a file's prediction layer: after the head norm, as llama.cpp's
    /// `h_nextn`) and logits `[n, K]`.
    fn finish(&self, mut x: Vec<f32>, attn: &mut [f32], gate: &[f32]) -> Result<(Vec<f32>, Vec<f32>), SpecError> {
        let c = &self.config;
        let l = &self.layer;
        let (h, qw) = (c.target_hidden, c.q_width());
        let n = x.len() / h;
        let mut o = vec![0f32; n * h];
        let Mixer::Attention(a) = &l.mixer else { unreachable!("an mtp head's layer attends (MtpHead::load, NextnLayer::check)") };
        if !gate.is_empty() {
            attn.iter_mut().zip(gate).for_each(|(o, &g)| *o *= g);
        }
        matmul(&MatmulInput::new(attn, qw, &[&a.wo]), &a.wo, &mut o);
        add_assign(&mut x, &o);

        let mut xn = vec![0f32; n * h];
        rms_norm(&x, &l.ffn_norm, c.rms_eps, &mut xn);
        match &l.ffn {
            FeedForward::Dense(f) => f.forward(&xn, Activation::SiluGate, &mut o),
            FeedForward::Moe(m) => m.forward(&xn, &vec![true; n], None, &mut o)?,
        }
        add_assign(&mut x, &o);

        rms_norm(&x, &self.norm, c.rms_eps, &mut xn);
        let mut logits = vec![0f32; n * self.vocab.draft_vocab()];
        matmul(&MatmulInput::new(&xn, h, &[&self.lm_head]), &self.lm_head, &mut logits);
        Ok((if self.nextn.is_some() { xn } else { x }, logits))
    }
}

/// [`MtpHead::project`]'s output.
struct Projected {
    x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    gate: Vec<f32>,
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
    Some(l.mixer_matrices().into_iter().chain([&f.gate, &f.up, &f.down]).map(|m| m.bytes().len()).sum())
}

/// A target row the head has not turned into a context key yet: the row at `pos` and the token
/// that followed it (keys are computed lazily, batched into the sequence's next proposal).
struct PendingRow {
    pos: usize,
    token: TokenId,
    hidden: Vec<f32>,
}

/// What one sequence's drafts attend to: the keys/values of its latest target rows (at most the
/// head's window; one for a `chain` head), each computed from (embedding of the token after the
/// row, the row's target hidden state) at the row's position, followed by room for the keys of
/// the draft chain being run. Rows only ever come from emitted tokens, so nothing here needs a
/// rollback when drafts are rejected.
struct SeqContext {
    /// `[capacity, kvw]` each: context entries `0..len` (in no particular order: attention does
    /// not care, each key carries its position through RoPE), then the chain's.
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
    /// Once the window is full, the slot of the oldest entry (the next one overwritten).
    oldest: usize,
    /// Position of the newest row seen (context or pending).
    last_pos: Option<usize>,
    pending: std::collections::VecDeque<PendingRow>,
}

impl SeqContext {
    fn new() -> Self {
        Self { k: Vec::new(), v: Vec::new(), len: 0, oldest: 0, last_pos: None, pending: Default::default() }
    }

    /// Queues this step's rows: `hidden` holds `rows` target rows whose emitted tokens are the
    /// last `rows` of `tokens` (row j sits at position `tokens.len() - rows + j - 1`). A row at or
    /// before one already seen (the sequence was recomputed) starts the context afresh.
    fn observe(&mut self, tokens: &[TokenId], hidden: &[f32], h: usize, window: usize, vocab_rows: usize) {
        let rows = hidden.len() / h;
        let n = tokens.len();
        // every row emitted a token after at least one prompt token
        if rows == 0 || rows >= n {
            return;
        }
        if self.last_pos.is_some_and(|p| n - rows - 1 <= p) {
            *self = Self::new();
        }
        for (j, row) in hidden.chunks_exact(h).enumerate() {
            let pos = n - rows + j - 1;
            let token = tokens[pos + 1];
            if token as usize >= vocab_rows {
                // cannot be embedded: the context restarts after it
                *self = Self::new();
                continue;
            }
            self.pending.push_back(PendingRow { pos, token, hidden: row.to_vec() });
            self.last_pos = Some(pos);
        }
        while self.pending.len() > window {
            self.pending.pop_front();
        }
    }

    /// Adds one key/value row, in place of the oldest entry when the window is full (a ring: no
    /// row moves); `room` chain slots stay free after the context.
    fn push(&mut self, k: &[f32], v: &[f32], window: usize, room: usize) {
        let w = k.len();
        // grown as rows arrive (a prediction layer's window is long; most sequences are not)
        let need = ((self.len + 1).min(window) + room) * w;
        if self.k.len() < need {
            self.k.resize(need, 0.0);
            self.v.resize(need, 0.0);
        }
        let slot = if self.len < window {
            self.len += 1;
            self.len - 1
        } else {
            let s = self.oldest;
            self.oldest = (self.oldest + 1) % window;
            s
        };
        self.k[slot * w..(slot + 1) * w].copy_from_slice(k);
        self.v[slot * w..(slot + 1) * w].copy_from_slice(v);
    }
}

/// A sequence drafting in this proposal.
struct Chain {
    /// Index into the requests.
    req: usize,
    /// Target id fed at the next step.
    token: TokenId,
    /// Hidden state fed at the next step (the head's own output of the previous step).
    hidden: Vec<f32>,
    /// Position of the row that emitted the sequence's last token (chain step j runs at `pos + j`).
    pos: usize,
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
    /// Per sequence, what its drafts attend to: the head's context rows (its own KV, as a draft
    /// model's blocks are; the head's random stream is in the sequence's [`super::SeqDrafting`]).
    contexts: HashMap<SeqId, SeqContext>,
}

impl MtpProposer {
    pub fn new(head: MtpHead, target: &LlamaModel) -> Self {
        let target_bytes = target.layers.iter().map(layer_bytes).sum::<Option<usize>>().map(|b| b + target.lm_head.bytes().len());
        let fuse_bytes = head.fuse.as_ref().map_or(0, |f| f.bytes().len());
        let head_bytes = layer_bytes(&head.layer).map(|b| b + fuse_bytes + head.fc.bytes().len() + head.lm_head.bytes().len());
        let weight_share = match (head_bytes, target_bytes) {
            (Some(h), Some(t)) if t > 0 => Some(h as f64 / t as f64),
            _ => None,
        };
        let embed = head.nextn.as_ref().and_then(|n| n.embed.clone()).unwrap_or_else(|| target.embed.clone());
        Self { head, min_confidence: 0.0, weight_share, embed, contexts: HashMap::new() }
    }

    /// The target file's own prediction layer as the drafter (see [`MtpHead::from_nextn`]).
    pub fn from_nextn(target: &LlamaModel, keep: &[TokenId]) -> Result<Self, SpecError> {
        Ok(Self::new(MtpHead::from_nextn(target, keep)?, target))
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

    fn propose(&mut self, reqs: &mut [DraftRequest], pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let _span = tracing::trace_span!("mtp_propose", seqs = reqs.len()).entered();
        // one entry into the pool for the whole proposal, not one per chain step: each entry may
        // land on another worker, whose kernel helpers then spin beside the last one's
        pool.install(|| self.propose_here(reqs))
    }

    fn remove(&mut self, seq: SeqId) {
        self.contexts.remove(&seq);
    }

    fn hidden_layers(&self) -> &[usize] {
        &self.head.config.feature_layers
    }
}

impl MtpProposer {
    /// `propose`, on the current thread (inside the compute pool).
    fn propose_here(&mut self, reqs: &mut [DraftRequest]) -> Result<Vec<Draft>, SpecError> {
        let c = self.head.config.clone();
        let (h, kvw, qw, hw) = (c.target_hidden, c.kv_width(), c.q_width(), c.feature_width());
        let window = self.head.window;
        let kd = self.head.vocab.draft_vocab();
        let mut drafts: Vec<Draft> = reqs.iter().map(|r| Draft { tokens: Vec::new(), probs: (!r.params.is_greedy()).then(Vec::new) }).collect();
        // every request's rows join its context, drafting or not
        for r in reqs.iter() {
            let Some(hidden) = r.hidden else { continue };
            if hidden.is_empty() || !hidden.len().is_multiple_of(hw) {
                return Err(SpecError::Config(format!("the engine passed {} hidden values to an mtp head of {hw} per row", hidden.len())));
            }
            self.contexts.entry(r.seq).or_insert_with(SeqContext::new).observe(r.tokens, hidden, hw, window, self.embed.rows);
        }
        // the chains: sequences asking for drafts whose newest row is their last token's
        let mut chains = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            let Some(ctx) = self.contexts.get(&r.seq) else { continue };
            // the newest row is the one that emitted the last token
            let Some(last_pos) = r.tokens.len().checked_sub(2) else { continue };
            if r.max_draft == 0 || r.hidden.is_none() || ctx.last_pos != Some(last_pos) || ctx.pending.back().is_none_or(|p| p.pos != last_pos) {
                continue;
            }
            chains.push(Chain { req: i, token: 0, hidden: Vec::new(), pos: last_pos });
        }
        let chain_len = chains.iter().map(|ch| reqs[ch.req].max_draft).max().unwrap_or(0);
        if chain_len == 0 {
            return Ok(drafts);
        }
        // step 0: every pending row of the drafting sequences becomes a context key in one batch;
        // each sequence's newest row is also its chain's first query
        let (mut features, mut tokens, mut pos, mut owner) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (j, ch) in chains.iter().enumerate() {
            for row in &self.contexts[&reqs[ch.req].seq].pending {
                features.extend_from_slice(&row.hidden);
                tokens.push(row.token);
                pos.push(row.pos);
                owner.push(j);
            }
        }
        let fused = self.head.fused(features);
        let input = self.head.input_rows(&self.embed, tokens.iter().copied().zip(fused.chunks_exact(h)));
        let pr = self.head.project(&input, &pos);
        let (mut x0, mut q0) = (vec![0f32; chains.len() * h], vec![0f32; chains.len() * qw]);
        for (i, &j) in owner.iter().enumerate() {
            let ctx = self.contexts.get_mut(&reqs[chains[j].req].seq).expect("drafting sequences have a context");
            ctx.push(&pr.k[i * kvw..(i + 1) * kvw], &pr.v[i * kvw..(i + 1) * kvw], window, chain_len);
            // rows are in order: the last one of a sequence is its chain's start
            x0[j * h..(j + 1) * h].copy_from_slice(&pr.x[i * h..(i + 1) * h]);
            q0[j * qw..(j + 1) * qw].copy_from_slice(&pr.q[i * qw..(i + 1) * qw]);
        }
        for ch in &chains {
            self.contexts.get_mut(&reqs[ch.req].seq).expect("drafting sequences have a context").pending.clear();
        }
        let mut g0 = vec![0f32; if pr.gate.is_empty() { 0 } else { chains.len() * qw }];
        if !g0.is_empty() {
            for (i, &j) in owner.iter().enumerate() {
                g0[j * qw..(j + 1) * qw].copy_from_slice(&pr.gate[i * qw..(i + 1) * qw]);
            }
        }
        let mut attn = self.attend(&q0, &chains, reqs, 0);
        let (mut hidden, mut logits) = self.head.finish(x0, &mut attn, &g0)?;

        let mut p = Vec::with_capacity(kd);
        for step in 0..chain_len {
            let mut next_chains = Vec::new();
            for (j, mut ch) in chains.into_iter().enumerate() {
                let r = &mut reqs[ch.req];
                let row = &logits[j * kd..(j + 1) * kd];
                let (prompt, output) = self.draft_history(r, &drafts[ch.req].tokens);
                let d = match probabilities(row, r.params, TokenHistory { prompt: &prompt, output: &output }, &mut p) {
                    Ok(()) if r.params.is_greedy() => argmax(&p),
                    Ok(()) => sample_from_probs(&p, r.drafting.rng.get_or_insert_with(|| SeqRng::new(r.params.seed, MTP_RNG_STREAM)).uniform()),
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
                if step + 1 < r.max_draft {
                    ch.token = tok;
                    ch.hidden = hidden[j * h..(j + 1) * h].to_vec();
                    next_chains.push(ch);
                }
            }
            chains = next_chains;
            if chains.is_empty() || step + 1 == chain_len {
                break;
            }
            // chain step `step + 1`: (embedding of the draft, the head's own hidden state) at the
            // next position; its key goes to the chain slot after the context
            let input = self.head.input_rows(&self.embed, chains.iter().map(|ch| (ch.token, ch.hidden.as_slice())));
            let pos: Vec<usize> = chains.iter().map(|ch| ch.pos + step + 1).collect();
            let pr = self.head.project(&input, &pos);
            for (j, ch) in chains.iter().enumerate() {
                let ctx = self.contexts.get_mut(&reqs[ch.req].seq).expect("drafting sequences have a context");
                let slot = ctx.len + step;
                ctx.k[slot * kvw..(slot + 1) * kvw].copy_from_slice(&pr.k[j * kvw..(j + 1) * kvw]);
                ctx.v[slot * kvw..(slot + 1) * kvw].copy_from_slice(&pr.v[j * kvw..(j + 1) * kvw]);
            }
            let mut attn = self.attend(&pr.q, &chains, reqs, step + 1);
            (hidden, logits) = self.head.finish(pr.x, &mut attn, &pr.gate)?;
        }
        Ok(drafts)
    }

    /// The head's logits at every row of one sequence, teacher-forced (the oracle's view): row
    /// `i` pairs the target's row `i` (its states `hidden[i]`, as the forward returns them for
    /// `hidden_layers()`) with `tokens[i + 1]` and attends to rows `0..=i`. `tokens.len() - 1`
    /// rows of the head's vocabulary. Unlike drafting, every row of the sequence is context.
    pub fn teacher_forced(&self, tokens: &[TokenId], hidden: &[f32]) -> Result<Vec<f32>, SpecError> {
        let c = &self.head.config;
        let (h, fw, qw) = (c.target_hidden, c.feature_width(), c.q_width());
        let n = tokens.len().saturating_sub(1);
        if hidden.len() < n * fw {
            return Err(SpecError::Config(format!("{} hidden values for {n} rows of {fw}", hidden.len())));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.embed.rows) {
            return Err(SpecError::Config(format!("token {t} is outside the embedding of {} rows", self.embed.rows)));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let fused = self.head.fused(hidden[..n * fw].to_vec());
        let input = self.head.input_rows(&self.embed, tokens[1..].iter().copied().zip(fused.chunks_exact(h)));
        let pos: Vec<usize> = (0..n).collect();
        let pr = self.head.project(&input, &pos);
        let layout = KvLayout { block_size: n, n_heads: c.num_heads, n_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
        let span = SeqSpan { q_start: 0, q_len: n, context_len: n, block_table: &[0] };
        let mut attn = vec![0f32; n * qw];
        paged_attention(&pr.q, &mut attn, &pr.k, &pr.v, &layout, &[span], 1.0 / (c.head_dim as f32).sqrt());
        Ok(self.head.finish(pr.x, &mut attn, &pr.gate)?.1)
    }

    /// Attention of each chain's query at chain step `step` over its sequence's context and the
    /// chain keys of steps 1..=step.
    fn attend(&self, q: &[f32], chains: &[Chain], reqs: &[DraftRequest], step: usize) -> Vec<f32> {
        let c = &self.head.config;
        let qw = c.q_width();
        let mut out = vec![0f32; q.len()];
        for (j, ch) in chains.iter().enumerate() {
            let ctx = &self.contexts[&reqs[ch.req].seq];
            let layout = KvLayout { block_size: ctx.k.len() / c.kv_width(), n_heads: c.num_heads, n_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
            let span = SeqSpan { q_start: 0, q_len: 1, context_len: ctx.len + step, block_table: &[0] };
            paged_attention(&q[j * qw..(j + 1) * qw], &mut out[j * qw..(j + 1) * qw], &ctx.k, &ctx.v, &layout, &[span], 1.0 / (c.head_dim as f32).sqrt());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full window keeps exactly the newest `window` rows, each in one slot, and leaves the
    /// chain's room after them untouched.
    #[test]
    fn a_full_context_window_keeps_the_newest_rows() {
        let mut ctx = SeqContext::new();
        for i in 0..7 {
            ctx.push(&[i as f32, 0.0], &[0.0, -(i as f32)], 3, 2);
            if i == 1 {
                assert_eq!((ctx.len, &ctx.k[..4]), (2, &[0.0, 0.0, 1.0, 0.0][..]));
            }
        }
        assert_eq!((ctx.len, ctx.k.len()), (3, 5 * 2));
        let mut keys: Vec<f32> = ctx.k[..3 * 2].chunks(2).map(|kv| kv[0]).collect();
        keys.sort_by(f32::total_cmp);
        assert_eq!(keys, vec![4.0, 5.0, 6.0]);
        let values: Vec<f32> = ctx.v[..3 * 2].chunks(2).map(|kv| kv[1]).collect();
        for (k, v) in ctx.k[..6].chunks(2).zip(values) {
            assert_eq!(v, -k[0], "a key and its value share a slot");
        }
        assert!(ctx.k[6..].iter().all(|&x| x == 0.0), "the chain's room is not context");
    }
}
