//! `specula-train-head fit`: trains the mtp head on `specula-train-head data` shards with candle's autograd
//! and AdamW (CPU). The graph is exactly what `speculative::mtp` runs at inference (docs/mtp-head-format.md,
//! "What the head computes"): fc over concat(embedding, hidden), one decoder layer whose attention
//! spans this draft chain only (RoPE at the chain position), the final norm, a pruned lm_head. The
//! head is unrolled `--unroll` steps: step j is fed its own hidden output of step j-1 and the
//! sequence's token, exactly the accepted path at inference. Labels are the target's top tokens
//! with their probabilities (soft cross-entropy over the pruned vocabulary). After every epoch the
//! head is written (F16) and the held-out greedy acceptance is measured.

use crate::shard::{Shard, TOP_K};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specula_engine::speculative::mtp_format::{self as fmt, HeadConfig, HeadContext, HeadWeightsF32, StoredDtype, SEQUENCE_WINDOW};
use specula_model::{load_model, LlamaModel};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ContextArg {
    Chain,
    Sequence,
}

impl From<ContextArg> for HeadContext {
    fn from(c: ContextArg) -> Self {
        match c {
            ContextArg::Chain => HeadContext::Chain,
            ContextArg::Sequence => HeadContext::Sequence,
        }
    }
}

#[derive(Args, Debug)]
pub struct FitArgs {
    /// Target model (a GGUF file or model folder, as for `data`); must be the one the data came from.
    #[arg(long, env = "SPECULA_MODEL")]
    pub model: PathBuf,
    /// Folder written by `specula-train-head data`.
    #[arg(long, default_value = "target/mtp-data")]
    pub data: PathBuf,
    /// Where the head is written (each epoch's head goes beside it as NAME.epochN.safetensors;
    /// the final file is the epoch with the best held-out acceptance).
    #[arg(long, default_value = "target/mtp-head.safetensors")]
    pub out: PathBuf,
    /// Size K of the pruned vocabulary (the K most frequent target tokens of the training data).
    /// With `--init` it applies only together with `--revocab`.
    #[arg(long, default_value_t = 6144)]
    pub draft_vocab: usize,
    /// With `--init`: recompute the pruned vocabulary (`--draft-vocab` tokens) over all the
    /// training data instead of keeping the init head's. Tokens the init head had keep its
    /// lm_head rows; new ones start from the target's lm_head rows, as a fresh head does.
    #[arg(long, default_value_t = false)]
    pub revocab: bool,
    #[arg(long, default_value_t = 3)]
    pub epochs: usize,
    /// Rows per optimiser step: for a `sequence` head whole answers are packed back to back until
    /// a batch has at least this many rows; a `chain` head takes this many rows in a seeded random
    /// order (candle's CPU matmuls want wide batches: 256 rows run about twice as many samples per
    /// second as 64).
    #[arg(long, default_value_t = 384)]
    pub batch_size: usize,
    /// What the head's attention reads: `sequence` (EAGLE-style: every earlier answer position's
    /// target hidden state, and the draft chain) or `chain` (only the draft chain, the format's
    /// first heads). Applies to `--init` heads too.
    #[arg(long, value_enum, default_value_t = ContextArg::Sequence)]
    pub attention_context: ContextArg,
    /// Peak learning rate (linear warm-up, cosine decay to a tenth).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Draft steps unrolled in training (the head runs on its own hidden state after step 0).
    #[arg(long, default_value_t = 3)]
    pub unroll: usize,
    /// Loss weight of step j is decay^j.
    #[arg(long, default_value_t = 0.8)]
    pub step_decay: f64,
    /// Draft steps measured on the held-out data.
    #[arg(long, default_value_t = 4)]
    pub eval_k: usize,
    /// Start from this head file (its weights and pruned vocabulary) instead of a fresh head:
    /// continues a run from one of its epoch files. The optimiser state starts afresh.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Label = (1 - w) * target probabilities + w * one-hot(target argmax): w > 0 leans the head
    /// towards the target's greedy choice (what greedy verification accepts).
    #[arg(long, default_value_t = 0.0)]
    pub top1_weight: f32,
    /// Target layers (0-based) the head reads at a target row, comma-separated: a subset of the
    /// data's (`specula-train-head data --feature-layers`) that includes the final layer. Several are
    /// fused into one state by a trained `fuse` matrix (EAGLE-3). Default: the `--init` head's
    /// layers, else every layer the data keeps. A head given more layers than its `--init` file
    /// has starts from that file's computation exactly (the new layers' weights start at 0).
    #[arg(long, value_delimiter = ',')]
    pub feature_layers: Option<Vec<usize>>,
    /// Weight of EAGLE's feature-regression loss: step j's hidden output at row i is pulled
    /// towards the target's hidden state at row i + j + 1 (smooth L1, per dimension scaled to
    /// unit RMS), the state the next step would have been fed at step 0. 0 = token loss only.
    #[arg(long, default_value_t = 0.0)]
    pub feature_weight: f64,
    /// Train fc on inputs scaled to unit RMS (see `Params`); `false` trains on the raw inputs,
    /// as the first run of the shipped head did (heads/README.md).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub input_scale: bool,
    /// Stop an epoch after this many batches (0 = the whole data; for quick runs).
    #[arg(long, default_value_t = 0)]
    pub max_batches: usize,
    /// Also measure the held-out acceptance and write the head (NAME.epochE.batchN.safetensors)
    /// every N batches inside an epoch (0 = only at the end of each epoch), so a run stopped
    /// mid-epoch still leaves its best head so far; these heads compete for the final file too.
    #[arg(long, default_value_t = 0)]
    pub eval_every: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The trainable tensors, in `HeadWeightsF32` order. `fc` is trained on scaled inputs: the
/// target's hidden state is ~300x larger than a token embedding (RMS ~30 with outlier dimensions
/// near 1000, against ~0.1), which would drown the next token's embedding. `in_scale` (fixed,
/// one factor per input column) brings both to unit RMS; the file's fc is `fc * diag(in_scale)`,
/// so inference computes exactly the same thing without knowing about it.
struct Params {
    /// `[H, F * H]` over the feature layers' states, each scaled to unit RMS per dimension
    /// (`feat_scale`), giving the fused state in fc's scaled units (a head of one layer has none:
    /// its state goes to fc as it is). The file's fuse is `diag(1 / s) * fuse * diag(feat_scale)`
    /// with `s` the hidden half of `in_scale`, so that fc sees the same thing at inference.
    fuse: Option<(Var, Tensor)>,
    fc: Var,
    in_scale: Tensor,
    attn_norm: Var,
    wq: Var,
    wk: Var,
    wv: Var,
    wo: Var,
    ffn_norm: Var,
    w_gate: Var,
    w_up: Var,
    w_down: Var,
    norm: Var,
    lm_head: Var,
}

impl Params {
    /// `feat_scale`: one factor per input of fuse (`F * H`; unused for a head of one layer).
    fn new(w: &HeadWeightsF32, c: &HeadConfig, in_scale: &[f32], feat_scale: &[f32]) -> Result<Self> {
        let (h, qw, kvw, ff, k) = (c.target_hidden, c.q_width(), c.kv_width(), c.ffn, w.d2t.len());
        let v = |data: &[f32], shape: &[usize]| -> Result<Var> { Ok(Var::from_tensor(&Tensor::from_slice(data, shape, &Device::Cpu)?)?) };
        let fc: Vec<f32> = w.fc.iter().enumerate().map(|(i, &x)| x / in_scale[i % (2 * h)]).collect();
        let fuse = match c.fuses() {
            true => {
                let fw = c.feature_width();
                let fp: Vec<f32> = w.fuse.iter().enumerate().map(|(i, &x)| x * in_scale[h + i / fw] / feat_scale[i % fw]).collect();
                Some((v(&fp, &[h, fw])?, Tensor::from_slice(feat_scale, fw, &Device::Cpu)?))
            }
            false => None,
        };
        Ok(Self {
            fuse,
            fc: v(&fc, &[h, 2 * h])?,
            in_scale: Tensor::from_slice(in_scale, 2 * h, &Device::Cpu)?,
            attn_norm: v(&w.attn_norm, &[h])?,
            wq: v(&w.attn_q, &[qw, h])?,
            wk: v(&w.attn_k, &[kvw, h])?,
            wv: v(&w.attn_v, &[kvw, h])?,
            wo: v(&w.attn_output, &[h, qw])?,
            ffn_norm: v(&w.ffn_norm, &[h])?,
            w_gate: v(&w.ffn_gate, &[ff, h])?,
            w_up: v(&w.ffn_up, &[ff, h])?,
            w_down: v(&w.ffn_down, &[h, ff])?,
            norm: v(&w.norm, &[h])?,
            lm_head: v(&w.lm_head, &[k, h])?,
        })
    }

    fn vars(&self) -> Vec<Var> {
        self.fuse
            .iter()
            .map(|(f, _)| f)
            .chain([
                &self.fc,
                &self.attn_norm,
                &self.wq,
                &self.wk,
                &self.wv,
                &self.wo,
                &self.ffn_norm,
                &self.w_gate,
                &self.w_up,
                &self.w_down,
                &self.norm,
                &self.lm_head,
            ])
            .cloned()
            .collect()
    }

    fn to_weights(&self, d2t: &[u32]) -> Result<HeadWeightsF32> {
        let f = |v: &Var| -> Result<Vec<f32>> { Ok(v.as_tensor().flatten_all()?.to_vec1::<f32>()?) };
        let fuse = match &self.fuse {
            Some((fp, fs)) => {
                let h = fp.dim(0)?;
                let s_inv = self.in_scale.narrow(0, h, h)?.recip()?.unsqueeze(1)?;
                fp.as_tensor().broadcast_mul(fs)?.broadcast_mul(&s_inv)?.flatten_all()?.to_vec1::<f32>()?
            }
            None => Vec::new(),
        };
        Ok(HeadWeightsF32 {
            fuse,
            fc: self.fc.as_tensor().broadcast_mul(&self.in_scale)?.flatten_all()?.to_vec1::<f32>()?,
            attn_norm: f(&self.attn_norm)?,
            attn_q: f(&self.wq)?,
            attn_k: f(&self.wk)?,
            attn_v: f(&self.wv)?,
            attn_output: f(&self.wo)?,
            ffn_norm: f(&self.ffn_norm)?,
            ffn_gate: f(&self.w_gate)?,
            ffn_up: f(&self.w_up)?,
            ffn_down: f(&self.w_down)?,
            norm: f(&self.norm)?,
            lm_head: f(&self.lm_head)?,
            d2t: d2t.to_vec(),
        })
    }
}

/// The head's computation in candle over a packed batch of whole sequences (the same as
/// `MtpProposer` runs): step 0 at row t is the head on (embedding of the token after t, target
/// hidden of t) at position t; step j at row t is fed the token j places later and the head's own
/// hidden output of step j-1 at row t, at position t + j. Every step's query attends to the
/// context keys (step 0's keys of rows t' <= t of the same sequence; for a `chain` head only
/// t' = t) and to its own chain's keys of steps 1..=j: what the proposer's per-sequence context
/// and draft chain hold at inference.
struct HeadGraph<'a> {
    p: &'a Params,
    c: &'a HeadConfig,
    /// `[positions, head_dim]` cos and sin of the rotate-half RoPE.
    cos: Tensor,
    sin: Tensor,
}

/// Keys/values of one step over every row: `[T, nkv, hd]` each.
type StepKv = (Tensor, Tensor);

/// Rows per held-out batch.
const EVAL_BATCH_ROWS: usize = 512;

/// Additive mask value for keys a query must not see (finite: a row that sees nothing stays finite).
const MASKED: f32 = -1e9;

impl<'a> HeadGraph<'a> {
    fn new(p: &'a Params, c: &'a HeadConfig, max_positions: usize) -> Result<Self> {
        let hd = c.head_dim;
        let (mut cos, mut sin) = (vec![0f32; max_positions * hd], vec![0f32; max_positions * hd]);
        for pos in 0..max_positions {
            for i in 0..hd / 2 {
                let angle = pos as f64 / f64::from(c.rope_theta).powf(2.0 * i as f64 / hd as f64);
                let (co, si) = (angle.cos() as f32, angle.sin() as f32);
                cos[pos * hd + i] = co;
                cos[pos * hd + i + hd / 2] = co;
                sin[pos * hd + i] = si;
                sin[pos * hd + i + hd / 2] = si;
            }
        }
        Ok(Self { p, c, cos: Tensor::from_vec(cos, (max_positions, hd), &Device::Cpu)?, sin: Tensor::from_vec(sin, (max_positions, hd), &Device::Cpu)? })
    }

    /// Step 0's hidden input from a row's feature-layer states `[T, F * H]`: fuse applied (in
    /// the file's units), or the states themselves for a head of one layer.
    fn fused(&self, features: &Tensor) -> Result<Tensor> {
        let Some((fp, fs)) = &self.p.fuse else { return Ok(features.clone()) };
        let h = self.c.target_hidden;
        let u = features.broadcast_mul(fs)?.matmul(&fp.t()?)?;
        Ok(u.broadcast_div(&self.p.in_scale.narrow(0, h, h)?)?)
    }

    fn rms_norm(&self, x: &Tensor, w: &Var) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let r = (ms + f64::from(self.c.rms_eps))?.sqrt()?.recip()?;
        Ok(x.broadcast_mul(&r)?.broadcast_mul(w.as_tensor())?)
    }

    /// Rotate-half RoPE on `[T, heads, hd]`, row t at position t + `shift`.
    fn rope(&self, x: &Tensor, shift: usize) -> Result<Tensor> {
        let (t, hd) = (x.dim(0)?, self.c.head_dim);
        let cos = self.cos.narrow(0, shift, t)?.unsqueeze(1)?;
        let sin = self.sin.narrow(0, shift, t)?.unsqueeze(1)?;
        let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
        let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
    }

    /// Step `j` over every row. `emb`, `hidden`: `[T, H]`; `mask`: `[T, T]` (0 or [`MASKED`]) over
    /// the context keys; `kv[0]` is step 0's keys/values (the context), `kv[i]` chain step i's;
    /// this step's are pushed. Returns the new hidden `[T, H]` and logits `[T, K]`.
    fn step(&self, emb: &Tensor, hidden: &Tensor, j: usize, mask: &Tensor, kv: &mut Vec<StepKv>) -> Result<(Tensor, Tensor)> {
        let (c, p) = (self.c, self.p);
        let t = emb.dim(0)?;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let g = nh / nkv;
        let mut x = Tensor::cat(&[emb, hidden], 1)?.broadcast_mul(&p.in_scale)?.matmul(&p.fc.t()?)?;
        let xn = self.rms_norm(&x, &p.attn_norm)?;
        let q = self.rope(&xn.matmul(&p.wq.t()?)?.reshape((t, nh, hd))?, j)?;
        let k = self.rope(&xn.matmul(&p.wk.t()?)?.reshape((t, nkv, hd))?, j)?;
        let v = xn.matmul(&p.wv.t()?)?.reshape((t, nkv, hd))?;
        kv.push((k, v));
        let scale = 1.0 / (hd as f64).sqrt();
        // head i reads KV head i / g
        let qg = q.reshape((t, nkv, g, hd))?;
        let (k0, v0) = &kv[0];
        let q_ctx = qg.permute((1, 2, 0, 3))?.reshape((nkv, g * t, hd))?;
        let s_ctx = q_ctx.matmul(&k0.permute((1, 2, 0))?.contiguous()?)?.reshape((nkv, g, t, t))?;
        let s_ctx = (s_ctx * scale)?.broadcast_add(mask)?;
        let mut scores = vec![s_ctx];
        for (ki, _) in &kv[1..] {
            // a chain key is read by its own row only
            let s = qg.broadcast_mul(&ki.unsqueeze(2)?)?.sum(D::Minus1)?; // [T, nkv, g]
            scores.push((s.permute((1, 2, 0))?.unsqueeze(3)? * scale)?);
        }
        let att = softmax_last(&Tensor::cat(&scores, 3)?)?; // [nkv, g, T, T + j]
        let mut o = att.narrow(3, 0, t)?.reshape((nkv, g * t, t))?.matmul(&v0.permute((1, 0, 2))?.contiguous()?)?.reshape((nkv, g, t, hd))?;
        for (i, (_, vi)) in kv[1..].iter().enumerate() {
            o = (o + att.narrow(3, t + i, 1)?.broadcast_mul(&vi.permute((1, 0, 2))?.unsqueeze(1)?)?)?;
        }
        let o = o.permute((2, 0, 1, 3))?.reshape((t, nh * hd))?;
        x = (x + o.matmul(&p.wo.t()?)?)?;
        let xn = self.rms_norm(&x, &p.ffn_norm)?;
        let act = (xn.matmul(&p.w_gate.t()?)?.silu()? * xn.matmul(&p.w_up.t()?)?)?;
        x = (x + act.matmul(&p.w_down.t()?)?)?;
        let logits = self.rms_norm(&x, &p.norm)?.matmul(&p.lm_head.t()?)?;
        Ok((x, logits))
    }
}

fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

fn log_softmax_last(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let z = x.broadcast_sub(&m)?;
    Ok(z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)?)
}

/// Everything a batch needs, gathered from the shards.
struct Data {
    shard: Shard,
    /// Rows that start a chain (followed by a known token).
    starts: Vec<u32>,
    /// The layers each row's states are of (the shards' `feature_layers`; older shards: the
    /// final layer).
    layers: Vec<usize>,
    /// Which of those blocks of H a batch's rows carry, in the head's order (`use_layers`).
    blocks: Vec<usize>,
    /// The block of the final layer (the feature-regression targets).
    final_block: usize,
}

impl Data {
    fn load(dir: &Path, prefix: &str, target: &LlamaModel) -> Result<Self> {
        let fingerprint = fmt::target_fingerprint(target);
        let files = shard_files(dir, prefix)?;
        eprintln!("{prefix}*: {} shards", files.len());
        let mut shard: Option<Shard> = None;
        for f in &files {
            let s = Shard::read(f)?;
            if s.fingerprint != fingerprint {
                bail!("{} was made by another target (fingerprint {}, this target {fingerprint})", f.display(), s.fingerprint);
            }
            match shard.as_mut() {
                None => shard = Some(s),
                Some(all) => all.extend(&s).with_context(|| format!("reading {}", f.display()))?,
            }
        }
        let shard = shard.expect("at least one file");
        let starts = (0..shard.rows() as u32).filter(|&r| shard.next_token[r as usize] >= 0).collect();
        let last = target.config.n_layers - 1;
        let layers = if shard.feature_layers.is_empty() { vec![last] } else { shard.feature_layers.clone() };
        let final_block = layers
            .iter()
            .position(|&l| l == last)
            .with_context(|| format!("the shards in {} keep layers {layers:?} but not the final one ({last})", dir.display()))?;
        Ok(Self { shard, starts, blocks: vec![final_block], layers, final_block })
    }

    /// Batches carry the states of `layers` (the head's feature layers), which the data must keep.
    fn use_layers(&mut self, layers: &[usize]) -> Result<()> {
        self.blocks = layers
            .iter()
            .map(|l| {
                self.layers
                    .iter()
                    .position(|x| x == l)
                    .with_context(|| format!("the head reads layer {l}, but the data keeps layers {:?} (train-head data --feature-layers)", self.layers))
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Token fed at chain step j from start row r, if the sequence goes that far.
    fn token(&self, r: usize, j: usize) -> Option<u32> {
        self.shard.next_token.get(r + j).and_then(|&t| u32::try_from(t).ok())
    }

    /// The rows of the sequences in `order`, packed back to back into batches of at least `rows`
    /// rows (a longer sequence is a batch of its own).
    fn pack(&self, order: &[usize], rows: usize) -> Vec<Vec<usize>> {
        let mut batches = Vec::new();
        let mut cur = Vec::new();
        for &s in order {
            cur.extend(self.shard.seq_offsets[s]..self.shard.seq_offsets[s + 1]);
            if cur.len() >= rows {
                batches.push(std::mem::take(&mut cur));
            }
        }
        if !cur.is_empty() {
            batches.push(cur);
        }
        batches
    }

    /// The sequence row `r` belongs to.
    fn sequence_of(&self, r: usize) -> usize {
        self.shard.seq_offsets.partition_point(|&o| o <= r) - 1
    }
}

/// Every `PREFIX*.safetensors` shard of `dir`, sorted: for "train-" the pass-0 shards and those
/// of every later answer pass (`train-pN-NNNN`).
fn shard_files(dir: &Path, prefix: &str) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {} (run `specula-train-head data` first)", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix) && n.ends_with(".safetensors")))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("no {prefix}*.safetensors shards in {}", dir.display());
    }
    Ok(files)
}

/// Inputs of one batch for `steps` chain steps: for a `sequence` head whole sequences, rows back
/// to back; for a `chain` head any rows (each attends to itself only).
struct Batch {
    /// Shard row of each batch row.
    rows: Vec<usize>,
    /// `[T, F * H]`: each row's states after the head's feature layers.
    hidden: Tensor,
    /// Per step: `[T, H]` embeddings of the token fed (zeros where the sequence has none).
    emb: Vec<Tensor>,
    /// `[T, T]`: 0 where row t's queries may read row t''s context key, [`MASKED`] elsewhere.
    mask: Tensor,
    /// Per step: label draft ids `[T, TOP_K]` and weights `[T, TOP_K]` (0 where masked or the
    /// token is outside the pruned vocabulary).
    labels: Vec<(Tensor, Tensor)>,
    /// Per step: rows with a label.
    counts: Vec<f64>,
    /// Per step, when asked for: the target's hidden state `[T, H]` that step's output should
    /// match (row i + j + 1) and `[T, 1]` 1 where there is one.
    features: Vec<(Tensor, Tensor)>,
}

#[allow(clippy::too_many_arguments)]
fn make_batch(
    data: &Data,
    rows: &[usize],
    steps: usize,
    context: HeadContext,
    embed: &specula_kernels::QMatrix,
    t2d: &[i32],
    top1_weight: f32,
    features: bool,
) -> Result<Batch> {
    let s = &data.shard;
    let (h, width) = (s.hidden_size, s.width());
    // block b of row r of the shard: that row's state after feature layer b
    let state = |r: usize, b: usize| &s.hidden[r * width + b * h..r * width + (b + 1) * h];
    let seq_of: Vec<usize> = rows.iter().map(|&r| data.sequence_of(r)).collect();
    let t = rows.len();
    let fw = data.blocks.len() * h;
    let mut hidden = vec![0f32; t * fw];
    for (i, &r) in rows.iter().enumerate() {
        for (j, &b) in data.blocks.iter().enumerate() {
            for (o, v) in hidden[i * fw + j * h..i * fw + (j + 1) * h].iter_mut().zip(state(r, b)) {
                *o = v.to_f32();
            }
        }
    }
    // a context key needs its next token (its input); a chain head reads only its own row's
    let mut mask = vec![MASKED; t * t];
    for qi in 0..t {
        for ki in 0..=qi {
            let visible = match context {
                HeadContext::Chain => ki == qi,
                HeadContext::Sequence => seq_of[ki] == seq_of[qi] && qi - ki < SEQUENCE_WINDOW,
            };
            if visible && data.token(rows[ki], 0).is_some() {
                mask[qi * t + ki] = 0.0;
            }
        }
    }
    let (mut emb, mut labels, mut counts, mut feats) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for j in 0..steps {
        if features {
            let (mut f, mut m) = (vec![0f32; t * h], vec![0f32; t]);
            for (i, &r) in rows.iter().enumerate() {
                if (0..=j).all(|jj| data.token(r, jj).is_some()) {
                    for (o, v) in f[i * h..(i + 1) * h].iter_mut().zip(state(r + j + 1, data.final_block)) {
                        *o = v.to_f32();
                    }
                    m[i] = 1.0;
                }
            }
            feats.push((Tensor::from_vec(f, (t, h), &Device::Cpu)?, Tensor::from_vec(m, (t, 1), &Device::Cpu)?));
        }
        let mut e = vec![0f32; t * h];
        let (mut ids, mut ws) = (vec![0u32; t * TOP_K], vec![0f32; t * TOP_K]);
        let mut count = 0.0;
        for (i, &r) in rows.iter().enumerate() {
            // every earlier step must have had a token too (the chain is contiguous; a sequence's
            // last row has none, so a chain never runs into the next sequence)
            if (0..=j).any(|jj| data.token(r, jj).is_none()) {
                continue;
            }
            let tok = data.token(r, j).expect("checked above");
            embed.dequantize_row_into(tok as usize, &mut e[i * h..(i + 1) * h]);
            let label_row = r + j + 1;
            count += 1.0;
            for k in 0..TOP_K {
                let target = s.top_ids[label_row * TOP_K + k];
                if let Some(&d) = t2d.get(target as usize).filter(|&&d| d >= 0) {
                    ids[i * TOP_K + k] = d as u32;
                    let one_hot = if k == 0 { 1.0 } else { 0.0 };
                    ws[i * TOP_K + k] = (1.0 - top1_weight) * s.top_probs[label_row * TOP_K + k] + top1_weight * one_hot;
                }
            }
        }
        emb.push(Tensor::from_vec(e, (t, h), &Device::Cpu)?);
        labels.push((Tensor::from_vec(ids, (t, TOP_K), &Device::Cpu)?, Tensor::from_vec(ws, (t, TOP_K), &Device::Cpu)?));
        counts.push(count);
    }
    Ok(Batch {
        rows: rows.to_vec(),
        hidden: Tensor::from_vec(hidden, (t, fw), &Device::Cpu)?,
        emb,
        mask: Tensor::from_vec(mask, (t, t), &Device::Cpu)?,
        labels,
        counts,
        features: feats,
    })
}

/// The K most frequent target tokens of the training answers (ties: lower id first), most
/// frequent first. Counts the sampled tokens and the target's top-1 at every position.
fn pruned_vocab(data: &Data, k: usize, target_vocab: usize) -> Vec<u32> {
    let mut freq = vec![0u64; target_vocab];
    for &t in data.shard.next_token.iter().filter(|&&t| t >= 0) {
        freq[t as usize] += 1;
    }
    for r in 0..data.shard.rows() {
        freq[data.shard.top_ids[r * TOP_K] as usize] += 1;
    }
    let mut ids: Vec<u32> = (0..target_vocab as u32).collect();
    ids.sort_by_key(|&t| (std::cmp::Reverse(freq[t as usize]), t));
    ids.truncate(k);
    ids
}

/// Held-out figures of a head on greedy answers.
struct HeldOut {
    /// Per draft position j, the share of start rows whose drafts 1..=j all equal the target's
    /// argmax (drafting `k` tokens from every position of every answer).
    accepted: Vec<f64>,
    /// Soft cross-entropy of chain step 0 against the target's top tokens.
    loss: f64,
    /// Per k, tokens per verify step when the answers are walked as greedy speculative decoding
    /// serves them: a verify step at row r drafts k, emits the accepted ones and the target's own
    /// token, and the next starts at the row after them. Steps start more often just after a
    /// rejection (the target chose a token the head did not expect) and skip accepted rows, so this
    /// is lower than `1 + sum(accepted[..k])`, which counts every row alike.
    served: Vec<f64>,
}

/// Greedy acceptance on the held-out answers: from each start row the head drafts `k` tokens on
/// the accepted path; position j is accepted when it and every earlier draft equal the target's
/// argmax.
fn evaluate(graph: &HeadGraph, data: &Data, k: usize, embed: &specula_kernels::QMatrix, d2t: &[u32], t2d: &[i32]) -> Result<HeldOut> {
    let s = &data.shard;
    let order: Vec<usize> = (0..s.num_sequences()).collect();
    let mut accepted = vec![0u64; k];
    let (mut loss, mut loss_n, mut starts) = (0.0, 0.0, 0usize);
    let (mut walk_steps, mut walk_tokens) = (vec![0u64; k], vec![0u64; k]);
    for rows in data.pack(&order, EVAL_BATCH_ROWS) {
        let batch = make_batch(data, &rows, k, graph.c.context, embed, t2d, 0.0, false)?;
        // only rows from which all k drafts have a token to compare with count
        let counted: Vec<bool> = batch.rows.iter().map(|&r| (0..k).all(|j| data.token(r, j).is_some())).collect();
        starts += counted.iter().filter(|&&c| c).count();
        let mut kv = Vec::new();
        let mut hidden = graph.fused(&batch.hidden)?;
        let mut alive = counted.clone();
        // accepted drafts from each batch row (counted rows only)
        let mut run_len: Vec<Option<usize>> = counted.iter().map(|&c| c.then_some(0)).collect();
        for (j, (emb, acc)) in batch.emb.iter().zip(accepted.iter_mut()).enumerate() {
            let (x, logits) = graph.step(emb, &hidden, j, &batch.mask, &mut kv)?;
            if j == 0 {
                let (ids, ws) = &batch.labels[0];
                let lp = log_softmax_last(&logits)?.gather(ids, 1)?;
                loss -= (lp * ws)?.sum_all()?.to_scalar::<f32>()? as f64;
                loss_n += batch.counts[0];
            }
            let best = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
            for (i, &r) in batch.rows.iter().enumerate() {
                if !alive[i] {
                    continue;
                }
                let target_top1 = s.top_ids[(r + j + 1) * TOP_K] as u32;
                alive[i] = d2t[best[i] as usize] == target_top1;
                if alive[i] {
                    *acc += 1;
                    run_len[i] = Some(j + 1);
                }
            }
            hidden = x;
        }
        // the batch holds whole sequences, rows in order: walk each one's rows
        let mut first = 0;
        for seq_rows in batch.rows.chunk_by(|&a, &b| data.sequence_of(a) == data.sequence_of(b)) {
            let lens = &run_len[first..first + seq_rows.len()];
            for kk in 1..=k {
                let (steps, tokens) = served_walk(lens, kk);
                walk_steps[kk - 1] += steps;
                walk_tokens[kk - 1] += tokens;
            }
            first += seq_rows.len();
        }
    }
    let n = starts.max(1) as f64;
    Ok(HeldOut {
        accepted: accepted.iter().map(|&a| a as f64 / n).collect(),
        loss: loss / loss_n.max(1.0),
        served: walk_tokens.iter().zip(&walk_steps).map(|(&t, &s)| t as f64 / s.max(1) as f64).collect(),
    })
}

/// (verify steps, tokens emitted) of greedy speculation with `k` drafts a step over one answer
/// whose row i accepts `run_len[i]` drafts (None: too close to the end to draft k; the walk stops
/// there). Each step emits the accepted drafts and the target's own token.
fn served_walk(run_len: &[Option<usize>], k: usize) -> (u64, u64) {
    let (mut i, mut steps, mut tokens) = (0, 0, 0);
    while let Some(&Some(len)) = run_len.get(i) {
        let a = len.min(k);
        steps += 1;
        tokens += 1 + a as u64;
        i += 1 + a;
    }
    (steps, tokens)
}

pub fn run(a: FitArgs) -> Result<()> {
    if a.unroll == 0 || a.eval_k == 0 || a.batch_size == 0 {
        bail!("--unroll, --eval-k and --batch-size must be at least 1");
    }
    // before any training: a head that cannot be written would cost an epoch
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let path = crate::target_model(&a.model)?.to_path_buf();
    let target: LlamaModel = load_model(&path)?.model;
    let mut train = Data::load(&a.data, "train-", &target)?;
    let mut held = Data::load(&a.data, "heldout-", &target)?;
    eprintln!(
        "training rows {} ({} sequences), held-out rows {} ({} sequences)",
        train.starts.len(),
        train.shard.num_sequences(),
        held.starts.len(),
        held.shard.num_sequences()
    );
    let v = target.config.vocab_size;
    let (mut cfg, mut w) = match &a.init {
        Some(path) => {
            let (cfg, mut w) = load_head_weights(path, &target)?;
            if a.revocab {
                let d2t = pruned_vocab(&train, a.draft_vocab.min(v), v);
                let kept = revocab(&mut w, d2t, &target);
                eprintln!("pruned vocabulary recomputed: {} tokens, {kept} of them kept from {}", w.d2t.len(), path.display());
            }
            (cfg, w)
        }
        None => fresh_head(&train, &target, a.draft_vocab.min(v), a.seed)?,
    };
    cfg.context = a.attention_context.into();
    eprintln!("attention context: {}", cfg.context.as_str());
    let layers = match (&a.feature_layers, &a.init) {
        (Some(l), _) => l.clone(),
        (None, Some(_)) => cfg.feature_layers.clone(),
        (None, None) => train.layers.clone(),
    };
    if layers != cfg.feature_layers {
        let from = cfg.feature_layers.clone();
        w.fuse = widen_fuse(&cfg, &w.fuse, &layers)?;
        cfg.feature_layers = layers;
        eprintln!("feature layers {from:?} -> {:?} (the new layers' fuse weights start at 0)", cfg.feature_layers);
    }
    train.use_layers(&cfg.feature_layers)?;
    held.use_layers(&cfg.feature_layers)?;
    eprintln!("feature layers: {:?}", cfg.feature_layers);
    let d2t = w.d2t.clone();
    let t2d = fmt::t2d_from_d2t(&d2t, v);
    let covered = train.shard.next_token.iter().filter(|&&t| t >= 0 && t2d[t as usize] >= 0).count() as f64 / train.starts.len().max(1) as f64;
    eprintln!("pruned vocabulary: {} tokens cover {:.2}% of the training answer tokens", d2t.len(), 100.0 * covered);
    let (in_scale, feat_scale) =
        if a.input_scale { input_scale(&train, &target.embed) } else { (vec![1.0; 2 * cfg.target_hidden], vec![1.0; cfg.feature_width()]) };
    let params = Params::new(&w, &cfg, &in_scale, &feat_scale)?;
    let hidden_scale = Tensor::from_slice(&in_scale[cfg.target_hidden..], cfg.target_hidden, &Device::Cpu)?;
    let longest = [&train, &held].iter().flat_map(|d| d.shard.seq_offsets.windows(2).map(|w| w[1] - w[0])).max().unwrap_or(0);
    let graph = HeadGraph::new(&params, &cfg, a.batch_size.max(EVAL_BATCH_ROWS) + longest + a.unroll.max(a.eval_k))?;
    let mut opt = AdamW::new(params.vars(), ParamsAdamW { lr: a.lr, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.0 })?;

    let mut rng = ChaCha8Rng::seed_from_u64(a.seed);
    // a sequence head trains on whole sequences in a seeded order; a chain head on rows in a
    // seeded order, as the chain heads before the sequence ones were trained
    let mut seq_order: Vec<usize> = (0..train.shard.num_sequences()).collect();
    let mut row_order = train.starts.clone();
    let mut epoch_batches = |rng: &mut ChaCha8Rng| -> Vec<Vec<usize>> {
        match cfg.context {
            HeadContext::Sequence => {
                seq_order.shuffle(rng);
                train.pack(&seq_order, a.batch_size)
            }
            HeadContext::Chain => {
                row_order.shuffle(rng);
                row_order.chunks(a.batch_size).map(|c| c.iter().map(|&r| r as usize).collect()).collect()
            }
        }
    };
    let limit = |n: usize| if a.max_batches > 0 { n.min(a.max_batches) } else { n };
    // the packing of later epochs differs a little; the schedule is laid out for this count
    let batches_per_epoch = limit(match cfg.context {
        HeadContext::Sequence => train.pack(&(0..train.shard.num_sequences()).collect::<Vec<_>>(), a.batch_size).len(),
        HeadContext::Chain => train.starts.len().div_ceil(a.batch_size),
    });
    let total = batches_per_epoch * a.epochs;
    let warmup = (total / 20).max(1);
    let lr_at = |step: usize| -> f64 {
        if step < warmup {
            a.lr * (step + 1) as f64 / warmup as f64
        } else {
            let t = ((step - warmup) as f64 / (total - warmup).max(1) as f64).min(1.0);
            a.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
        }
    };
    report_eval("0", &evaluate(&graph, &held, a.eval_k, &target.embed, &d2t, &t2d)?, None);

    let mut best: Option<(f64, PathBuf)> = None;
    // writes the head to `file` and makes it the output while it is the best so far
    let mut keep = |file: PathBuf, eval: &HeldOut| -> Result<()> {
        fmt::save_head(&file, &params.to_weights(&d2t)?, &cfg, StoredDtype::F16)?;
        eprintln!("wrote {}", file.display());
        let score = 1.0 + eval.accepted.iter().take(3).sum::<f64>();
        if best.as_ref().is_none_or(|(b, _)| score > *b) {
            std::fs::copy(&file, &a.out).with_context(|| format!("cannot write {}", a.out.display()))?;
            best = Some((score, file));
        }
        Ok(())
    };
    let mut step = 0;
    for epoch in 1..=a.epochs {
        let started = Instant::now();
        let batches = epoch_batches(&mut rng);
        let batches_this_epoch = limit(batches.len());
        let bar = ProgressBar::new(batches_this_epoch as u64);
        bar.set_style(ProgressStyle::with_template("epoch {msg} [{elapsed_precise}] {wide_bar} {pos}/{len} batches (eta {eta})")?);
        bar.set_message(epoch.to_string());
        let (mut sum, mut n) = (0.0, 0usize);
        for rows in batches.iter().take(batches_this_epoch) {
            opt.set_learning_rate(lr_at(step));
            let batch = make_batch(&train, rows, a.unroll, cfg.context, &target.embed, &t2d, a.top1_weight, a.feature_weight > 0.0)?;
            let mut kv = Vec::new();
            let mut hidden = graph.fused(&batch.hidden)?;
            let mut loss: Option<Tensor> = None;
            for j in 0..a.unroll {
                let (x, logits) = graph.step(&batch.emb[j], &hidden, j, &batch.mask, &mut kv)?;
                let (ids, ws) = &batch.labels[j];
                let lp = log_softmax_last(&logits)?.gather(ids, 1)?;
                let mut lj = ((lp * ws)?.sum_all()?.neg()? * (a.step_decay.powi(j as i32) / batch.counts[j].max(1.0)))?;
                if let Some((target_h, valid)) = batch.features.get(j) {
                    // smooth L1 on unit-RMS dimensions: q (d - q / 2) with q = min(d, 1)
                    let d = x.sub(target_h)?.broadcast_mul(&hidden_scale)?.abs()?;
                    let q = d.clamp(0f32, 1f32)?;
                    let per_row = (&q * (d - (&q * 0.5)?)?)?.mean_keepdim(D::Minus1)?;
                    let lf = (per_row * valid)?.sum_all()?;
                    lj = (lj + (lf * (a.feature_weight * a.step_decay.powi(j as i32) / batch.counts[j].max(1.0)))?)?;
                }
                loss = Some(match loss {
                    None => lj,
                    Some(l) => (l + lj)?,
                });
                hidden = x;
            }
            let loss = loss.expect("unroll >= 1");
            opt.backward_step(&loss)?;
            sum += loss.to_scalar::<f32>()? as f64;
            n += 1;
            step += 1;
            bar.inc(1);
            if n % 50 == 0 {
                eprintln!("epoch {epoch} batch {n}/{batches_this_epoch}: loss {:.4} lr {:.2e}", sum / n as f64, lr_at(step));
            }
            if a.eval_every > 0 && n % a.eval_every == 0 && n < batches_this_epoch {
                let eval = evaluate(&graph, &held, a.eval_k, &target.embed, &d2t, &t2d)?;
                bar.suspend(|| report_eval(&format!("{epoch} batch {n}"), &eval, Some((sum / n as f64, started.elapsed().as_secs_f64()))));
                keep(batch_path(&a.out, epoch, n), &eval)?;
            }
        }
        bar.finish_and_clear();
        let eval = evaluate(&graph, &held, a.eval_k, &target.embed, &d2t, &t2d)?;
        report_eval(&epoch.to_string(), &eval, Some((sum / n.max(1) as f64, started.elapsed().as_secs_f64())));
        keep(epoch_path(&a.out, epoch), &eval)?;
    }
    if let Some((score, file)) = best {
        eprintln!("{} <- {} (held-out tokens per verify step at k=3: {score:.3})", a.out.display(), file.display());
    }
    Ok(())
}

/// Per input column of fc, 1 / RMS over the training data: one factor for the embedding half
/// (over the embeddings of the answer tokens) and one per dimension of the hidden half (the final
/// layer's state, which the head's own state stands in for after step 0); and per input of fuse,
/// 1 / RMS of that dimension of that layer's state (`data.blocks`).
fn input_scale(train: &Data, embed: &specula_kernels::QMatrix) -> (Vec<f32>, Vec<f32>) {
    let (s, h) = (&train.shard, train.shard.hidden_size);
    let mut sq = vec![0f64; s.width()];
    for row in s.hidden.chunks_exact(s.width()) {
        for (a, v) in sq.iter_mut().zip(row) {
            *a += f64::from(v.to_f32()).powi(2);
        }
    }
    let rows = s.rows().max(1) as f64;
    let scale: Vec<f32> = sq.iter().map(|&q| (1.0 / (q / rows + 1e-6).sqrt()) as f32).collect();
    let block = |b: usize| &scale[b * h..(b + 1) * h];
    let mut e = vec![0f32; h];
    let (mut esq, mut n) = (0f64, 0usize);
    for &t in s.next_token.iter().filter(|&&t| t >= 0).take(4096) {
        embed.dequantize_row_into(t as usize, &mut e);
        esq += e.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
        n += h;
    }
    let e_scale = (1.0 / (esq / n.max(1) as f64 + 1e-12).sqrt()) as f32;
    let fc_in = std::iter::repeat_n(e_scale, h).chain(block(train.final_block).iter().copied()).collect();
    (fc_in, train.blocks.iter().flat_map(|&b| block(b).iter().copied()).collect())
}

/// `fuse` of a head reading `cfg.feature_layers` (`fuse` empty: the final layer alone), widened
/// to read `layers`: each layer it read keeps its weights (the final layer alone passes through),
/// the others start at 0, so the widened head computes exactly what it did. Fewer layers than
/// the head reads are refused: that would change what it computes.
fn widen_fuse(cfg: &HeadConfig, fuse: &[f32], layers: &[usize]) -> Result<Vec<f32>> {
    let h = cfg.target_hidden;
    if layers.is_empty() || !layers.windows(2).all(|w| w[0] < w[1]) || layers.iter().any(|&l| l >= cfg.target_layers) {
        bail!("--feature-layers must be increasing layer indices below {}, got {layers:?}", cfg.target_layers);
    }
    let last = cfg.target_layers - 1;
    if !layers.contains(&last) {
        bail!("--feature-layers must include the final layer ({last}): the head's own state stands in for it after the first draft step");
    }
    if let Some(l) = cfg.feature_layers.iter().find(|l| !layers.contains(l)) {
        bail!("the head reads layer {l}, which --feature-layers {layers:?} drops: a head can only be given more layers");
    }
    if layers.len() == 1 {
        return Ok(Vec::new());
    }
    let old: Vec<f32> = if cfg.fuses() { fuse.to_vec() } else { (0..h * h).map(|i| if i / h == i % h { 1.0 } else { 0.0 }).collect() };
    let (ow, nw) = (cfg.feature_layers.len() * h, layers.len() * h);
    let mut out = vec![0f32; h * nw];
    for (ob, l) in cfg.feature_layers.iter().enumerate() {
        let nb = layers.iter().position(|x| x == l).expect("checked above");
        for r in 0..h {
            out[r * nw + nb * h..r * nw + (nb + 1) * h].copy_from_slice(&old[r * ow + ob * h..r * ow + (ob + 1) * h]);
        }
    }
    Ok(out)
}

/// A fresh head: the seeded random layer, the K most frequent training tokens as its vocabulary,
/// the target's own lm_head rows for them and its output norm.
fn fresh_head(train: &Data, target: &LlamaModel, k: usize, seed: u64) -> Result<(HeadConfig, HeadWeightsF32)> {
    let d2t = pruned_vocab(train, k, target.config.vocab_size);
    let (cfg, mut w) = fmt::random_head(target, 1, seed)?;
    // no trained rows to keep: every token starts from the target's lm_head row
    w.d2t.clear();
    revocab(&mut w, d2t, target);
    Ok((cfg, w))
}

/// The weights and vocabulary of an existing head file for `target` (checked like at serving).
pub(crate) fn load_head_weights(path: &Path, target: &LlamaModel) -> Result<(HeadConfig, HeadWeightsF32)> {
    specula_engine::speculative::mtp::MtpHead::load_with(path, target, specula_engine::speculative::mtp::HeadWeights::AsStored)?;
    Ok(fmt::HeadFile::open(path)?.weights_f32()?)
}

fn epoch_path(out: &Path, epoch: usize) -> PathBuf {
    let stem = out.file_stem().and_then(|s| s.to_str()).unwrap_or("head");
    let stem = stem.strip_suffix(".safetensors").unwrap_or(stem);
    out.with_file_name(format!("{stem}.epoch{epoch}.safetensors"))
}

/// The head written after `batch` batches of epoch `epoch` (`--eval-every`).
fn batch_path(out: &Path, epoch: usize, batch: usize) -> PathBuf {
    let stem = out.file_stem().and_then(|s| s.to_str()).unwrap_or("head");
    out.with_file_name(format!("{stem}.epoch{epoch}.batch{batch}.safetensors"))
}

/// Gives `w` the pruned vocabulary `d2t`: a token `w` already had keeps its lm_head row, a new one
/// gets the target's lm_head row (all of them for a fresh head). Returns how many tokens were kept.
fn revocab(w: &mut HeadWeightsF32, d2t: Vec<u32>, target: &LlamaModel) -> usize {
    let h = target.config.hidden_size;
    let old = fmt::t2d_from_d2t(&w.d2t, target.config.vocab_size);
    let mut lm_head = vec![0f32; d2t.len() * h];
    let mut kept = 0;
    for (row, &t) in lm_head.chunks_exact_mut(h).zip(&d2t) {
        match usize::try_from(old[t as usize]) {
            Ok(d) => {
                row.copy_from_slice(&w.lm_head[d * h..(d + 1) * h]);
                kept += 1;
            }
            Err(_) => target.lm_head.dequantize_row_into(t as usize, row),
        }
    }
    w.lm_head = lm_head;
    w.d2t = d2t;
    kept
}

/// One line per epoch: train loss, held-out loss, acceptance per position, tokens per verify step.
fn report_eval(epoch: &str, eval: &HeldOut, train: Option<(f64, f64)>) {
    let acc = &eval.accepted;
    let per_k: Vec<String> = (1..=acc.len()).map(|k| format!("k={k}: {:.3}", 1.0 + acc[..k].iter().sum::<f64>())).collect();
    let served: Vec<String> = eval.served.iter().enumerate().map(|(i, t)| format!("k={}: {t:.3}", i + 1)).collect();
    let pos: Vec<String> = acc.iter().map(|a| format!("{a:.3}")).collect();
    let train = train.map_or("-".to_string(), |(l, s)| format!("{l:.4} ({s:.0} s)"));
    eprintln!(
        "EPOCH {epoch} | train loss {train} | held-out loss(step0) {:.4} | accepted per position [{}] | tokens per verify step {} | as served (walk) {}",
        eval.loss,
        pos.join(", "),
        per_k.join(", "),
        served.join(", ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_walk_steps_over_what_each_verify_step_emits() {
        // rows accept 2, 0, 3, 1, 0, 0, 1 drafts; the last two rows cannot draft k
        let lens = [Some(2), Some(0), Some(3), Some(1), Some(0), Some(0), Some(1), None, None];
        // k = 3: row 0 emits 3 (2 + 1) -> row 3 emits 2 -> row 5 emits 1 -> row 6 emits 2 -> row 8 stops
        assert_eq!(served_walk(&lens, 3), (4, 8));
        // k = 1: row 0 emits 2 -> row 2 emits 2 -> row 4 emits 1 -> row 5 emits 1 -> row 6 emits 2 -> row 8 stops
        assert_eq!(served_walk(&lens, 1), (5, 8));
        // a row too close to the end stops the walk; an empty answer has no step
        assert_eq!(served_walk(&[None, Some(3)], 3), (0, 0));
        assert_eq!(served_walk(&[], 2), (0, 0));
        // every row of an answer visited alike only when nothing is ever accepted
        assert_eq!(served_walk(&[Some(0); 5], 4), (5, 5));
    }

    /// A tiny random target written to a fresh temporary folder (kept alive by the caller).
    fn tiny_target(seed: u64) -> (tempfile::TempDir, LlamaModel) {
        use specula_model::testing::{write_tiny_llama, TinySpec};
        let dir = tempfile::tempdir().unwrap();
        let model_path = dir.path().join("tiny.gguf");
        write_tiny_llama(&model_path, &TinySpec { seed, ..Default::default() }).unwrap();
        let target = load_model(&model_path).unwrap().model;
        (dir, target)
    }

    #[test]
    fn every_answer_pass_is_training_data_and_the_held_out_set_stays_apart() {
        use crate::data::shard_path;
        use crate::prompts::Split;
        let dir = tempfile::tempdir().unwrap();
        let names = [
            shard_path(dir.path(), Split::Train, 0, 0),
            shard_path(dir.path(), Split::Train, 0, 1),
            shard_path(dir.path(), Split::Train, 1, 0),
            shard_path(dir.path(), Split::Train, 12, 3),
            shard_path(dir.path(), Split::HeldOut, 0, 0),
        ];
        for n in names.iter().chain([&dir.path().join("train-0002.tmp"), &dir.path().join("heldout-prompts.txt")]) {
            std::fs::write(n, b"x").unwrap();
        }
        assert_eq!(shard_files(dir.path(), "train-").unwrap(), {
            let mut v = names[..4].to_vec();
            v.sort();
            v
        });
        assert_eq!(shard_files(dir.path(), "heldout-").unwrap(), vec![names[4].clone()]);
        assert!(shard_files(&dir.path().join("none"), "train-").is_err());
    }

    #[test]
    fn epoch_files_sit_beside_the_output() {
        assert_eq!(epoch_path(Path::new("heads/h.safetensors"), 2), PathBuf::from("heads/h.epoch2.safetensors"));
        assert_eq!(batch_path(Path::new("heads/h.safetensors"), 2, 300), PathBuf::from("heads/h.epoch2.batch300.safetensors"));
    }

    /// A recomputed vocabulary keeps the trained rows of the tokens the head had and takes the
    /// target's rows for the others; the rest of the head is untouched.
    #[test]
    fn revocab_keeps_trained_rows_and_takes_the_targets_for_new_tokens() {
        let (dir, target) = tiny_target(3);
        let (_, mut w) = fmt::random_head(&target, 6, 2).unwrap();
        let h = target.config.hidden_size;
        let before = w.clone();
        let had = |t: u32| before.d2t.iter().position(|&x| x == t);
        let absent: Vec<u32> = (0..target.config.vocab_size as u32).filter(|&t| had(t).is_none()).take(3).collect();
        let new_d2t = vec![before.d2t[4], absent[0], before.d2t[1], absent[1], absent[2]];
        assert_eq!(revocab(&mut w, new_d2t.clone(), &target), 2);
        assert_eq!(w.d2t, new_d2t);
        assert_eq!(w.lm_head.len(), 5 * h);
        let mut row = vec![0f32; h];
        for (d, &t) in new_d2t.iter().enumerate() {
            let got = &w.lm_head[d * h..(d + 1) * h];
            match had(t) {
                Some(old) => assert_eq!(got, &before.lm_head[old * h..(old + 1) * h], "token {t}"),
                None => {
                    target.lm_head.dequantize_row_into(t as usize, &mut row);
                    assert_eq!(got, &row[..], "token {t}");
                }
            }
        }
        assert_eq!(w.fc, before.fc);
        assert_eq!(w.ffn_down, before.ffn_down);
        // a head with the new vocabulary is a valid file the proposer loads
        let (cfg, _) = fmt::random_head(&target, 6, 2).unwrap();
        let p = dir.path().join("h.safetensors");
        fmt::save_head(&p, &w, &cfg, StoredDtype::F32).unwrap();
        specula_engine::speculative::mtp::MtpHead::load_with(&p, &target, specula_engine::speculative::mtp::HeadWeights::AsStored).unwrap();
    }

    /// The graph trained here must be the computation `speculative::mtp` runs: with temperature 1 the
    /// proposer's draft distributions are softmax(logits), so they must equal the graph's, step
    /// by step along the same chain (the graph fed the proposer's own draws). The sequence is
    /// observed over three engine steps (a prefill row without drafts, then two rows, then three),
    /// so a `sequence` head's context holds six rows built lazily across calls.
    #[test]
    fn the_training_graph_computes_what_the_mtp_proposer_runs() {
        use specula_engine::speculative::mtp::MtpProposer;
        use specula_engine::speculative::{DraftRequest, Proposer, SeqDrafting};
        use specula_engine::types::SeqId;
        use specula_engine::SamplingParams;

        let (dir, target) = tiny_target(5);
        // one feature layer (the final state), and both layers of the tiny target fused
        for (context, layers) in
            [(HeadContext::Chain, vec![1]), (HeadContext::Sequence, vec![1]), (HeadContext::Sequence, vec![0, 1]), (HeadContext::Chain, vec![0, 1])]
        {
            let (mut cfg, mut w) = fmt::random_head(&target, 40, 9).unwrap();
            cfg.context = context;
            if layers.len() > 1 {
                w.fuse = fmt::pass_through_fuse(&cfg, &layers, 0.7, 4).unwrap();
                cfg.feature_layers = layers.clone();
            }
            let head_path = dir.path().join("head.safetensors");
            fmt::save_head(&head_path, &w, &cfg, StoredDtype::F32).unwrap();
            // the file's weights as stored (the default requantizes them to Q8_0 for speed)
            let mut proposer = MtpProposer::load_with(&head_path, &target, specula_engine::speculative::mtp::HeadWeights::AsStored).unwrap();
            assert_eq!(proposer.hidden_layers(), &layers[..]);
            let h = cfg.target_hidden;
            let fw = cfg.feature_width();
            let rows = 6;
            let hidden: Vec<f32> = (0..rows * fw).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.4 + (i / h) as f32 * 0.1).collect();
            // prompt [1, 5]; the rows are at positions 1..=6 and emitted tokens[2..8]
            let tokens = [1u32, 5, w.d2t[3], 7, w.d2t[1], 2, w.d2t[0], 9];
            let sampling = SamplingParams { temperature: 1.0, seed: Some(3), max_tokens: 100, ..Default::default() };
            let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            let (mut draft, mut drafting) = (None, SeqDrafting::default());
            for (known, first_row, max_draft) in [(3, 0, 0), (5, 1, 0), (8, 3, 3)] {
                let req = DraftRequest {
                    seq: SeqId(1),
                    tokens: &tokens[..known],
                    prompt_len: 2,
                    max_draft,
                    params: &sampling,
                    hidden: Some(&hidden[first_row * fw..(known - 2) * fw]),
                    rng: None,
                    drafting: &mut drafting,
                };
                draft = Some(proposer.propose(&mut [req], &pool).unwrap().remove(0));
            }
            let draft = draft.unwrap();
            assert_eq!(draft.tokens.len(), 3);
            let probs = draft.probs.expect("sampled drafts carry their distributions");

            // non-trivial input scales: folded into fc and fuse on the way out, they must not
            // change the graph
            let in_scale: Vec<f32> = (0..2 * h).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
            let feat_scale: Vec<f32> = (0..fw).map(|i| 0.75 + (i % 5) as f32 * 0.5).collect();
            let params = Params::new(&w, &cfg, &in_scale, &feat_scale).unwrap();
            assert_eq!(params.to_weights(&w.d2t).unwrap().fuse.len(), w.fuse.len());
            for (a, b) in params.to_weights(&w.d2t).unwrap().fuse.iter().zip(&w.fuse) {
                assert!((a - b).abs() < 1e-5 * (1.0 + b.abs()), "fuse round trip: {a} vs {b}");
            }
            let graph = HeadGraph::new(&params, &cfg, rows + 3).unwrap();
            let embed_rows = |toks: &[u32]| {
                let mut e = vec![0f32; toks.len() * h];
                for (row, &t) in e.chunks_exact_mut(h).zip(toks) {
                    target.embed.dequantize_row_into(t as usize, row);
                }
                Tensor::from_vec(e, (toks.len(), h), &Device::Cpu).unwrap()
            };
            let mut mask = vec![MASKED; rows * rows];
            for q in 0..rows {
                for k in 0..=q {
                    if context == HeadContext::Sequence || k == q {
                        mask[q * rows + k] = 0.0;
                    }
                }
            }
            let mask = Tensor::from_vec(mask, (rows, rows), &Device::Cpu).unwrap();
            let mut hid = graph.fused(&Tensor::from_vec(hidden, (rows, fw), &Device::Cpu).unwrap()).unwrap();
            let mut fed = tokens[2..].to_vec();
            let mut kv = Vec::new();
            for (j, (pj, &dj)) in probs.iter().zip(&draft.tokens).enumerate() {
                let (x, logits) = graph.step(&embed_rows(&fed), &hid, j, &mask, &mut kv).unwrap();
                let ours = softmax_last(&logits.narrow(0, rows - 1, 1).unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for (d, &t) in w.d2t.iter().enumerate() {
                    let theirs = pj[t as usize];
                    assert!(
                        (ours[d] - theirs).abs() < 1e-4 * (1.0 + theirs),
                        "{context:?} {layers:?} step {j}, draft id {d}: graph {} proposer {theirs}",
                        ours[d]
                    );
                }
                // the last row's chain goes on with the proposer's draw; the other rows' steps
                // are not read by it (a chain key is read by its own row only)
                fed[rows - 1] = dj;
                hid = x;
            }
        }
    }

    /// A head given more feature layers computes exactly what it did: the final layer passes
    /// through, the new layers' weights are 0, its old layers keep theirs; dropping a layer or
    /// the final one is refused.
    #[test]
    fn widening_the_feature_layers_keeps_the_head_computation() {
        let (_dir, target) = tiny_target(4);
        let (cfg, _) = fmt::random_head(&target, 8, 1).unwrap();
        let h = cfg.target_hidden;
        let wide = widen_fuse(&cfg, &[], &[0, 1]).unwrap();
        assert_eq!(wide, fmt::pass_through_fuse(&cfg, &[0, 1], 0.0, 0).unwrap());
        assert_eq!(wide.len(), h * 2 * h);
        assert!(widen_fuse(&cfg, &[], &[1]).unwrap().is_empty(), "the same single layer needs no fuse");
        assert!(widen_fuse(&cfg, &[], &[0]).unwrap_err().to_string().contains("final layer"));
        let mut two = cfg.clone();
        two.feature_layers = vec![0, 1];
        assert!(widen_fuse(&two, &wide, &[1]).unwrap_err().to_string().contains("drops"));
        assert_eq!(widen_fuse(&two, &wide, &[0, 1]).unwrap(), wide);
        assert!(widen_fuse(&cfg, &[], &[1, 0]).is_err());
    }

    /// A packed batch: a sequence head's rows see only earlier rows of their own answer, every
    /// step's labels and feature targets come from the rows j + 1 ahead, and nothing is read past
    /// an answer's end.
    #[test]
    fn a_packed_batch_masks_across_answers_and_past_their_ends() {
        let (_dir, target) = tiny_target(2);
        let h = target.config.hidden_size;
        let mut shard = Shard::new(h, &[]);
        let top = |t: u32| [(t, 0.5f32); TOP_K];
        // answers [10, 11, 12] and [20, 21]: 4 + 3 rows, row r's hidden filled with r
        let rows_hidden = |first: usize, n: usize| (first..first + n).flat_map(|r| std::iter::repeat_n(r as f32, h)).collect::<Vec<f32>>();
        shard.push_sequence(&rows_hidden(0, 4), &[10, 11, 12], &[top(10), top(11), top(12), top(13)]);
        shard.push_sequence(&rows_hidden(4, 3), &[20, 21], &[top(20), top(21), top(22)]);
        let starts = (0..shard.rows() as u32).filter(|&r| shard.next_token[r as usize] >= 0).collect();
        let data = Data { shard, starts, layers: vec![1], blocks: vec![0], final_block: 0 };
        let rows: Vec<usize> = (0..7).collect();
        let t2d: Vec<i32> = (0..target.config.vocab_size as i32).collect();
        let b = make_batch(&data, &rows, 2, HeadContext::Sequence, &target.embed, &t2d, 0.0, true).unwrap();
        let mask = b.mask.to_vec2::<f32>().unwrap();
        let sees = |q: usize, k: usize| mask[q][k] == 0.0;
        assert!(sees(2, 0) && sees(2, 2) && !sees(2, 3), "row 2 sees rows 0..=2 of its answer");
        assert!(!sees(3, 3), "an answer's last row has no next token, so it is no key");
        assert!(sees(5, 4) && !sees(4, 2) && !sees(5, 1), "the second answer sees only itself");
        assert_eq!(b.counts, vec![5.0, 3.0]);
        let (f0, m0) = (&b.features[0].0.to_vec2::<f32>().unwrap(), b.features[0].1.to_vec2::<f32>().unwrap());
        let (f1, m1) = (&b.features[1].0.to_vec2::<f32>().unwrap(), b.features[1].1.to_vec2::<f32>().unwrap());
        assert_eq!((f0[0][0], f0[2][0], f0[5][0]), (1.0, 3.0, 6.0), "step 0 at row i: the hidden of row i + 1");
        assert_eq!((f1[0][0], f1[4][0]), (2.0, 6.0), "step 1 at row i: the hidden of row i + 2");
        assert_eq!(m0.iter().map(|r| r[0]).collect::<Vec<_>>(), vec![1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]);
        assert_eq!(m1.iter().map(|r| r[0]).collect::<Vec<_>>(), vec![1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
        let (ids1, ws1) = (&b.labels[1].0.to_vec2::<u32>().unwrap(), b.labels[1].1.to_vec2::<f32>().unwrap());
        assert_eq!((ids1[0][0], ids1[4][0]), (12, 22), "step 1 at row i: labels of row i + 2");
        assert_eq!(ws1[2][0], 0.0, "no label past the answer's end");
        // a chain head's rows see only themselves
        let c = make_batch(&data, &rows, 1, HeadContext::Chain, &target.embed, &t2d, 0.0, false).unwrap();
        let cm = c.mask.to_vec2::<f32>().unwrap();
        assert!(cm[2][2] == 0.0 && cm[2][1] != 0.0 && c.features.is_empty());
    }

    /// Rows of two layers' states: a batch carries the blocks of the head's layers in its order,
    /// and the feature targets are the final layer's states whatever the head reads.
    #[test]
    fn a_batch_carries_the_heads_feature_layers() {
        let (_dir, target) = tiny_target(2);
        let h = target.config.hidden_size;
        let mut shard = Shard::new(h, &[0, 1]);
        let top = |t: u32| [(t, 0.5f32); TOP_K];
        // row r: layer 0's state filled with r, layer 1's (the final) with 100 + r
        let states: Vec<f32> = (0..3).flat_map(|r| std::iter::repeat_n(r as f32, h).chain(std::iter::repeat_n(100.0 + r as f32, h))).collect();
        shard.push_sequence(&states, &[10, 11], &[top(10), top(11), top(12)]);
        let starts = (0..shard.rows() as u32).filter(|&r| shard.next_token[r as usize] >= 0).collect();
        let mut data = Data { shard, starts, layers: vec![0, 1], blocks: vec![1], final_block: 1 };
        let t2d: Vec<i32> = (0..target.config.vocab_size as i32).collect();
        data.use_layers(&[0, 1]).unwrap();
        let b = make_batch(&data, &[0, 1, 2], 1, HeadContext::Sequence, &target.embed, &t2d, 0.0, true).unwrap();
        let hid = b.hidden.to_vec2::<f32>().unwrap();
        assert_eq!((hid[1].len(), hid[1][0], hid[1][h], hid[2][2 * h - 1]), (2 * h, 1.0, 101.0, 102.0));
        assert_eq!(b.features[0].0.to_vec2::<f32>().unwrap()[0][0], 101.0, "the final layer's state of the next row");
        data.use_layers(&[1]).unwrap();
        let b = make_batch(&data, &[0, 1, 2], 1, HeadContext::Sequence, &target.embed, &t2d, 0.0, false).unwrap();
        assert_eq!(b.hidden.to_vec2::<f32>().unwrap()[2], vec![102.0; h]);
        assert!(data.use_layers(&[0, 2]).unwrap_err().to_string().contains("keeps layers [0, 1]"));
    }

    #[test]
    fn softmaxes_match_a_direct_computation() {
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, -1.0, 0.0, 1.0], (2, 3), &Device::Cpu).unwrap();
        let p = softmax_last(&x).unwrap().to_vec2::<f32>().unwrap();
        let lp = log_softmax_last(&x).unwrap().to_vec2::<f32>().unwrap();
        let z0: f32 = [1f32, 2.0, 3.0].iter().map(|v| v.exp()).sum();
        let z1: f32 = [-1f32, 0.0, 1.0].iter().map(|v| v.exp()).sum();
        assert!((p[0][2] - 3f32.exp() / z0).abs() < 1e-6);
        assert!((lp[1][0] - ((-1f32).exp() / z1).ln()).abs() < 1e-5);
    }
}
