//! The mtp head file (docs/mtp-head-format.md): one safetensors file holding a one-layer
//! EAGLE/MTP draft head, its pruned vocabulary maps and the metadata that ties it to one target.
//! This module reads, checks and writes that file and knows nothing of proposing; `speculative::mtp`
//! runs the head. The writer is shared by the tests and the trainer.

use super::SpecError;
use crate::types::TokenId;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use sha2::{Digest, Sha256};
use specula_kernels::formats::{quantize_row, QK};
use specula_kernels::{QMatrix, WeightBytes, WeightFormat};
use specula_model::LlamaModel;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// Value of the `format` metadata key.
pub const FORMAT: &str = "specula-mtp-v1";
/// How much of the target's embedding bytes the fingerprint hashes.
pub const FINGERPRINT_PREFIX_BYTES: usize = 1 << 20;

pub const FUSE: &str = "fuse.weight";
pub const FC: &str = "fc.weight";
pub const ATTN_NORM: &str = "layer.attn_norm.weight";
pub const ATTN_Q: &str = "layer.attn_q.weight";
pub const ATTN_K: &str = "layer.attn_k.weight";
pub const ATTN_V: &str = "layer.attn_v.weight";
pub const ATTN_OUTPUT: &str = "layer.attn_output.weight";
pub const FFN_NORM: &str = "layer.ffn_norm.weight";
pub const FFN_GATE: &str = "layer.ffn_gate.weight";
pub const FFN_UP: &str = "layer.ffn_up.weight";
pub const FFN_DOWN: &str = "layer.ffn_down.weight";
pub const NORM: &str = "norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";
pub const D2T: &str = "d2t";
pub const T2D: &str = "t2d";

/// The head's shape and what it was trained against: the file's `__metadata__`.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadConfig {
    /// Vocabulary size of the target (length of `t2d`).
    pub target_vocab: usize,
    /// Hidden size of the target, which is also the head's own width.
    pub target_hidden: usize,
    /// Layers of the target (checked against the target's).
    pub target_layers: usize,
    /// The target layers (0-based, increasing) whose hidden states feed the head at a target row,
    /// fused into one H-wide state by `fuse.weight` when there are several (EAGLE-3's low, middle
    /// and high features); metadata `feature_layers`, absent = the final layer only
    /// (`target_layers - 1`), as every head before the key was.
    pub feature_layers: Vec<usize>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// [`target_fingerprint`] of the target the head was trained for; several, comma-separated,
    /// when one head serves several files of the same weights (e.g. two quantizations).
    pub target_fingerprint: String,
    /// What the head's attention reads besides its own draft chain.
    pub context: HeadContext,
}

/// The keys/values a head's attention reads (metadata `attention_context`; a file without the key
/// is a `chain` head, as every head before it was).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadContext {
    /// Only the draft chain: step 0 attends to itself, step j to steps 0..=j.
    Chain,
    /// EAGLE-style: also every earlier position of the sequence's output whose target hidden
    /// state is known (from the last prompt row on, at most `SEQUENCE_WINDOW` of them), each
    /// position's key/value computed from (embedding of the token after it, its target hidden).
    Sequence,
}

/// Most earlier positions a `sequence` head attends to (a sliding window; the training answers
/// are at most 193 rows long, so the window never binds in training).
pub const SEQUENCE_WINDOW: usize = 256;

impl HeadContext {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chain => "chain",
            Self::Sequence => "sequence",
        }
    }

    /// Earlier target rows the attention keeps (the chain's own start row included).
    pub fn window(self) -> usize {
        match self {
            Self::Chain => 1,
            Self::Sequence => SEQUENCE_WINDOW,
        }
    }
}

impl HeadConfig {
    /// A head shaped like one layer of `target` (the usual choice), fingerprinted for it.
    pub fn for_target(target: &LlamaModel) -> Self {
        let c = &target.config;
        Self {
            target_vocab: c.vocab_size,
            target_hidden: c.hidden_size,
            target_layers: c.n_layers,
            feature_layers: vec![c.n_layers - 1],
            num_heads: c.n_heads,
            num_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            ffn: c.intermediate_size,
            rms_eps: c.rms_eps,
            rope_theta: c.rope_theta,
            target_fingerprint: target_fingerprint(target),
            context: HeadContext::Chain,
        }
    }

    pub fn q_width(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// Values of one target row's features: H per feature layer.
    pub fn feature_width(&self) -> usize {
        self.feature_layers.len() * self.target_hidden
    }
    /// Whether the head fuses several layers' states (and so has `fuse.weight`).
    pub fn fuses(&self) -> bool {
        self.feature_layers.len() > 1
    }

    /// Whether `fingerprint` is one this head accepts.
    pub fn accepts_fingerprint(&self, fingerprint: &str) -> bool {
        self.target_fingerprint.split(',').map(str::trim).any(|f| f == fingerprint)
    }

    pub fn to_metadata(&self) -> HashMap<String, String> {
        [
            ("format", FORMAT.to_string()),
            ("target_vocab", self.target_vocab.to_string()),
            ("target_hidden", self.target_hidden.to_string()),
            ("target_layers", self.target_layers.to_string()),
            ("num_heads", self.num_heads.to_string()),
            ("num_kv_heads", self.num_kv_heads.to_string()),
            ("head_dim", self.head_dim.to_string()),
            ("ffn", self.ffn.to_string()),
            ("rms_eps", self.rms_eps.to_string()),
            ("rope_theta", self.rope_theta.to_string()),
            ("target_fingerprint", self.target_fingerprint.clone()),
            ("attention_context", self.context.as_str().to_string()),
            ("feature_layers", self.feature_layers.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(",")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Parses the metadata, naming the key that is missing or malformed.
    pub fn from_metadata(md: &HashMap<String, String>) -> Result<Self, String> {
        let get = |k: &str| md.get(k).map(|s| s.trim()).ok_or_else(|| format!("metadata key '{k}' is missing"));
        match get("format")? {
            FORMAT => {}
            other => return Err(format!("metadata format is '{other}', expected '{FORMAT}' (is this an mtp head file?)")),
        }
        let int = |k: &str| get(k)?.parse::<usize>().map_err(|_| format!("metadata '{k}' = '{}' is not a non-negative integer", md[k]));
        let float = |k: &str| {
            get(k)?.parse::<f32>().ok().filter(|v| v.is_finite() && *v > 0.0).ok_or_else(|| format!("metadata '{k}' = '{}' is not a positive number", md[k]))
        };
        let target_layers = int("target_layers")?;
        let feature_layers = match md.get("feature_layers").map(|s| s.trim()) {
            None => vec![target_layers.saturating_sub(1)],
            Some(v) => v
                .split(',')
                .map(|x| x.trim().parse::<usize>().map_err(|_| format!("metadata 'feature_layers' = '{v}' is not a comma-separated list of layer indices")))
                .collect::<Result<Vec<_>, _>>()?,
        };
        if feature_layers.is_empty() || feature_layers.iter().any(|&l| l >= target_layers) || !feature_layers.windows(2).all(|w| w[0] < w[1]) {
            return Err(format!("metadata 'feature_layers' = {feature_layers:?} must be increasing layer indices below target_layers ({target_layers})"));
        }
        let c = Self {
            target_vocab: int("target_vocab")?,
            target_hidden: int("target_hidden")?,
            target_layers,
            feature_layers,
            num_heads: int("num_heads")?,
            num_kv_heads: int("num_kv_heads")?,
            head_dim: int("head_dim")?,
            ffn: int("ffn")?,
            rms_eps: float("rms_eps")?,
            rope_theta: float("rope_theta")?,
            target_fingerprint: get("target_fingerprint")?.to_string(),
            context: match md.get("attention_context").map(|s| s.trim()) {
                None | Some("chain") => HeadContext::Chain,
                Some("sequence") => HeadContext::Sequence,
                Some(other) => return Err(format!("metadata 'attention_context' = '{other}' is not 'chain' or 'sequence'")),
            },
        };
        if c.num_heads == 0 || c.num_kv_heads == 0 || !c.num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(format!("{} attention heads cannot be grouped over {} KV heads", c.num_heads, c.num_kv_heads));
        }
        if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even and positive (RoPE rotates pairs)", c.head_dim));
        }
        if c.target_hidden == 0 || c.ffn == 0 || c.target_vocab == 0 {
            return Err("target_hidden, ffn and target_vocab must be positive".into());
        }
        Ok(c)
    }
}

/// The head's weights in f32, row-major, as the trainer holds them and the writer stores them.
/// Shapes (H = target_hidden, K = d2t.len()): see [`HeadWeightsF32::shapes`].
#[derive(Clone, Debug, PartialEq)]
pub struct HeadWeightsF32 {
    /// `[H, F * H]` when the head fuses F > 1 feature layers, else empty.
    pub fuse: Vec<f32>,
    pub fc: Vec<f32>,
    pub attn_norm: Vec<f32>,
    pub attn_q: Vec<f32>,
    pub attn_k: Vec<f32>,
    pub attn_v: Vec<f32>,
    pub attn_output: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub ffn_gate: Vec<f32>,
    pub ffn_up: Vec<f32>,
    pub ffn_down: Vec<f32>,
    pub norm: Vec<f32>,
    pub lm_head: Vec<f32>,
    /// Draft id -> target id (absolute ids, not offsets); K entries, distinct.
    pub d2t: Vec<TokenId>,
}

impl HeadWeightsF32 {
    /// Every float tensor with its name and shape under `cfg`, in file order.
    pub fn shapes(&self, cfg: &HeadConfig) -> Vec<(&'static str, Vec<usize>, &[f32])> {
        let (h, qw, kvw, ff, k) = (cfg.target_hidden, cfg.q_width(), cfg.kv_width(), cfg.ffn, self.d2t.len());
        let fuse = cfg.fuses().then(|| (FUSE, vec![h, cfg.feature_width()], &self.fuse[..]));
        fuse.into_iter()
            .chain([
                (FC, vec![h, 2 * h], &self.fc[..]),
                (ATTN_NORM, vec![h], &self.attn_norm),
                (ATTN_Q, vec![qw, h], &self.attn_q),
                (ATTN_K, vec![kvw, h], &self.attn_k),
                (ATTN_V, vec![kvw, h], &self.attn_v),
                (ATTN_OUTPUT, vec![h, qw], &self.attn_output),
                (FFN_NORM, vec![h], &self.ffn_norm),
                (FFN_GATE, vec![ff, h], &self.ffn_gate),
                (FFN_UP, vec![ff, h], &self.ffn_up),
                (FFN_DOWN, vec![h, ff], &self.ffn_down),
                (NORM, vec![h], &self.norm),
                (LM_HEAD, vec![k, h], &self.lm_head),
            ])
            .collect()
    }
}

/// How `save_head` stores the float tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    F16,
    BF16,
    /// Matrices as ggml Q8_0 blocks (what serving runs anyway: 34 bytes per 32 weights, about half
    /// of F16), vectors as F32; a matrix whose rows are not whole blocks falls back to F16.
    Q8_0,
}

/// Bytes of one stored Q8_0 block: an F16 scale, then 32 int8 values (ggml's `block_q8_0`).
pub const Q8_0_BLOCK_BYTES: usize = 2 + QK;

/// Shape of a `[rows, cols]` matrix stored as Q8_0: U8 `[rows, cols / 32, 34]`.
fn q8_0_shape(rows: usize, cols: usize) -> Vec<usize> {
    vec![rows, cols / QK, Q8_0_BLOCK_BYTES]
}

/// `t2d` for a `d2t`: target id -> draft id, -1 where the target token has none.
pub fn t2d_from_d2t(d2t: &[TokenId], target_vocab: usize) -> Vec<i32> {
    let mut t2d = vec![-1i32; target_vocab];
    for (d, &t) in d2t.iter().enumerate() {
        if let Some(slot) = t2d.get_mut(t as usize) {
            *slot = d as i32;
        }
    }
    t2d
}

/// Target tokens as draft ids through a stored `t2d` table: the trainer's labels (a position
/// whose next token is `None` lies outside the pruned vocabulary and cannot be predicted).
pub fn map_targets(t2d: &[i32], tokens: &[TokenId]) -> Vec<Option<u32>> {
    tokens.iter().map(|&t| t2d.get(t as usize).and_then(|&d| u32::try_from(d).ok())).collect()
}

/// Identifies a target's weights: hex SHA-256 of `"specula-target-v1 {rows}x{cols} {type}\n"`
/// followed by the first [`FINGERPRINT_PREFIX_BYTES`] bytes of the token embedding as stored
/// (rows = vocabulary, cols = hidden, type the ggml type name such as `Q8_0` or `BF16`).
pub fn target_fingerprint(model: &LlamaModel) -> String {
    let e = &model.embed;
    let mut h = Sha256::new();
    h.update(format!("specula-target-v1 {}x{} {}\n", e.rows, e.cols, ggml_type_name(e.format)).as_bytes());
    let bytes = e.bytes();
    h.update(&bytes[..bytes.len().min(FINGERPRINT_PREFIX_BYTES)]);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn ggml_type_name(f: WeightFormat) -> &'static str {
    f.ggml_name()
}

fn head_error(path: &Path, message: impl Into<String>) -> SpecError {
    SpecError::Head { path: path.display().to_string(), message: message.into() }
}

/// Writes a head file: the float tensors in `dtype`, `d2t` as I64, `t2d` (derived) as I32, and
/// `cfg` as metadata. Checks every shape first so a trainer's slip fails here, not at load.
pub fn save_head(path: &Path, w: &HeadWeightsF32, cfg: &HeadConfig, dtype: StoredDtype) -> Result<(), SpecError> {
    let err = |m: String| head_error(path, m);
    if w.d2t.is_empty() {
        return Err(err("d2t is empty: the head must predict at least one token".into()));
    }
    super::vocab_map::VocabMap::from_d2t(w.d2t.clone(), cfg.target_vocab).map_err(err)?;
    if !cfg.fuses() && !w.fuse.is_empty() {
        return Err(err(format!("a head of one feature layer has no '{FUSE}', but {} values were given", w.fuse.len())));
    }
    let mut buffers: Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape, data) in w.shapes(cfg) {
        let n: usize = shape.iter().product();
        if data.len() != n {
            return Err(err(format!("tensor '{name}' has {} values, shape {shape:?} needs {n}", data.len())));
        }
        let f32 = || data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16 = || data.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let (st, shape, bytes): (Dtype, Vec<usize>, Vec<u8>) = match dtype {
            StoredDtype::F32 => (Dtype::F32, shape, f32()),
            StoredDtype::F16 => (Dtype::F16, shape, f16()),
            StoredDtype::BF16 => (Dtype::BF16, shape, data.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect()),
            StoredDtype::Q8_0 => match shape[..] {
                [rows, cols] if cols % QK == 0 => {
                    (Dtype::U8, q8_0_shape(rows, cols), data.chunks_exact(cols).flat_map(|row| quantize_row(WeightFormat::Q8_0, row)).collect())
                }
                [_, _] => (Dtype::F16, shape, f16()),
                _ => (Dtype::F32, shape, f32()),
            },
        };
        buffers.push((name, st, shape, bytes));
    }
    let d2t: Vec<u8> = w.d2t.iter().flat_map(|&t| i64::from(t).to_le_bytes()).collect();
    buffers.push((D2T, Dtype::I64, vec![w.d2t.len()], d2t));
    let t2d: Vec<u8> = t2d_from_d2t(&w.d2t, cfg.target_vocab).iter().flat_map(|v| v.to_le_bytes()).collect();
    buffers.push((T2D, Dtype::I32, vec![cfg.target_vocab], t2d));

    let views = buffers
        .iter()
        .map(|(name, st, shape, bytes)| TensorView::new(*st, shape.clone(), bytes).map(|v| (name.to_string(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("cannot lay out tensors: {e}")))?;
    safetensors::serialize_to_file(views, &Some(cfg.to_metadata()), path).map_err(|e| err(format!("cannot write: {e}")))
}

/// Deterministic starting weights for `target` (the tests' heads and the trainer's init): the
/// pruned vocabulary is a seeded random subset of `k_vocab` target tokens in seeded order; the
/// output norm and lm_head rows are the target's own (restricted to that subset); the rest is
/// small seeded noise, with the norms near 1.
pub fn random_head(target: &LlamaModel, k_vocab: usize, seed: u64) -> Result<(HeadConfig, HeadWeightsF32), SpecError> {
    let cfg = HeadConfig::for_target(target);
    let (v, h, qw, kvw, ff) = (cfg.target_vocab, cfg.target_hidden, cfg.q_width(), cfg.kv_width(), cfg.ffn);
    if k_vocab == 0 || k_vocab > v {
        return Err(SpecError::Config(format!("a pruned head vocabulary must have 1..={v} tokens, got {k_vocab}")));
    }
    let mut rng = SplitMix(seed ^ 0x6D74_705F_6865_6164);
    let mut ids: Vec<TokenId> = (0..v as u32).collect();
    for i in (1..v).rev() {
        ids.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    ids.truncate(k_vocab);
    let mut noise = |n: usize, std: f32, mean: f32| -> Vec<f32> { (0..n).map(|_| mean + std * rng.symmetric()).collect() };
    let (fc_std, in_std) = (1.0 / (2.0 * h as f32).sqrt(), 1.0 / (h as f32).sqrt());
    let mut w = HeadWeightsF32 {
        fuse: Vec::new(),
        fc: noise(h * 2 * h, fc_std, 0.0),
        attn_norm: noise(h, 0.02, 1.0),
        attn_q: noise(qw * h, in_std, 0.0),
        attn_k: noise(kvw * h, in_std, 0.0),
        attn_v: noise(kvw * h, in_std, 0.0),
        attn_output: noise(h * qw, 0.5 / (qw as f32).sqrt(), 0.0),
        ffn_norm: noise(h, 0.02, 1.0),
        ffn_gate: noise(ff * h, in_std, 0.0),
        ffn_up: noise(ff * h, in_std, 0.0),
        ffn_down: noise(h * ff, 0.5 / (ff as f32).sqrt(), 0.0),
        norm: target.final_norm.clone(),
        lm_head: vec![0f32; k_vocab * h],
        d2t: ids,
    };
    for (d, &t) in w.d2t.iter().enumerate() {
        target.lm_head.dequantize_row_into(t as usize, &mut w.lm_head[d * h..(d + 1) * h]);
    }
    Ok((cfg, w))
}

/// `fuse.weight` for `layers` (the target's states after each, back to back) that passes the
/// final hidden state (layer `target_layers - 1`, which must be among them) through unchanged and
/// adds `noise` times seeded unit noise over every input: with noise 0, exactly a one-layer head
/// fed the final state, the starting point when a trained head learns to read more layers.
pub fn pass_through_fuse(cfg: &HeadConfig, layers: &[usize], noise: f32, seed: u64) -> Result<Vec<f32>, SpecError> {
    let h = cfg.target_hidden;
    let last = cfg.target_layers.checked_sub(1).and_then(|l| layers.iter().position(|&x| x == l));
    let Some(f) = last else {
        return Err(SpecError::Config(format!("feature layers {layers:?} do not include the final layer {}", cfg.target_layers.saturating_sub(1))));
    };
    let w = layers.len() * h;
    let mut rng = SplitMix(seed ^ 0x6675_7365);
    let std = noise / (w as f32).sqrt();
    let mut fuse: Vec<f32> = (0..h * w).map(|_| if noise == 0.0 { 0.0 } else { std * rng.symmetric() }).collect();
    for i in 0..h {
        fuse[i * w + f * h + i] += 1.0;
    }
    Ok(fuse)
}

/// [`random_head`] written as F32 to `path`.
pub fn write_random_head(path: &Path, target: &LlamaModel, k_vocab: usize, seed: u64) -> Result<(), SpecError> {
    let (cfg, w) = random_head(target, k_vocab, seed)?;
    save_head(path, &w, &cfg, StoredDtype::F32)
}

/// SplitMix64: no dependency, so a seed names one head on every platform.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-sqrt(3), sqrt(3)): unit variance.
    fn symmetric(&mut self) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * 3f32.sqrt()
    }
}

/// A head file read into memory and parsed; tensors are handed out checked against shapes.
pub struct HeadFile {
    path: std::path::PathBuf,
    bytes: Arc<Vec<u8>>,
    pub config: HeadConfig,
    tensors: HashMap<String, TensorEntry>,
}

struct TensorEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

impl HeadFile {
    /// Reads and parses `path`: a valid safetensors file with well-formed mtp metadata.
    pub fn open(path: &Path) -> Result<Self, SpecError> {
        let bytes = std::fs::read(path).map_err(|e| head_error(path, format!("cannot read: {e}")))?;
        let st =
            SafeTensors::deserialize(&bytes).map_err(|e| head_error(path, format!("not a valid safetensors file ({e}); the file is corrupt or truncated")))?;
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| head_error(path, format!("not a valid safetensors file ({e})")))?;
        let md = header.metadata().clone().unwrap_or_default();
        let config = HeadConfig::from_metadata(&md).map_err(|m| head_error(path, m))?;
        let base = bytes.as_ptr() as usize;
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, v)| (name, TensorEntry { dtype: v.dtype(), shape: v.shape().to_vec(), start: v.data().as_ptr() as usize - base, len: v.data().len() }))
            .collect();
        Ok(Self { path: path.to_path_buf(), bytes: Arc::new(bytes), config, tensors })
    }

    fn err(&self, m: impl Into<String>) -> SpecError {
        head_error(&self.path, m)
    }

    fn entry(&self, name: &str, shape: &[usize]) -> Result<&TensorEntry, SpecError> {
        let e = self.tensors.get(name).ok_or_else(|| self.err(format!("tensor '{name}' is missing")))?;
        if e.shape != shape {
            return Err(self.err(format!("tensor '{name}' has shape {:?}, expected {shape:?}", e.shape)));
        }
        Ok(e)
    }

    /// A `[rows, cols]` matrix (floats, or Q8_0 blocks as U8 `[rows, cols / 32, 34]`), sharing
    /// the file's bytes.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QMatrix, SpecError> {
        let stored_q8_0 = self.tensors.get(name).is_some_and(|e| e.dtype == Dtype::U8);
        if !stored_q8_0 {
            let e = self.entry(name, &[rows, cols])?;
            return self.float_matrix(name, e, rows, cols);
        }
        if !cols.is_multiple_of(QK) {
            return Err(self.err(format!("tensor '{name}' is stored as Q8_0 blocks, but its rows ({cols} values) are not whole blocks of {QK}")));
        }
        let e = self.entry(name, &q8_0_shape(rows, cols))?;
        self.shared_matrix(name, e, WeightFormat::Q8_0, rows, cols)
    }

    /// A `[len]` float vector (norm weights), converted to f32.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, SpecError> {
        let e = self.entry(name, &[len])?;
        let mut out = vec![0f32; len];
        self.float_matrix(name, e, 1, len)?.dequantize_row_into(0, &mut out);
        Ok(out)
    }

    fn float_matrix(&self, name: &str, e: &TensorEntry, rows: usize, cols: usize) -> Result<QMatrix, SpecError> {
        let format = match e.dtype {
            Dtype::F32 => WeightFormat::F32,
            Dtype::F16 => WeightFormat::F16,
            Dtype::BF16 => WeightFormat::BF16,
            other => return Err(self.err(format!("tensor '{name}' has type {other:?}; weights must be F32, F16, BF16 or (matrices) Q8_0 blocks as U8"))),
        };
        self.shared_matrix(name, e, format, rows, cols)
    }

    /// Entry `e` as a `format` matrix over the file's bytes (no copy).
    fn shared_matrix(&self, name: &str, e: &TensorEntry, format: WeightFormat, rows: usize, cols: usize) -> Result<QMatrix, SpecError> {
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.bytes.clone();
        QMatrix::new(format, rows, cols, WeightBytes::new(owner, e.start, e.len), name).map_err(|er| self.err(er.to_string()))
    }

    /// Every tensor of the head as f32 (matrices dequantized), the inverse of [`save_head`] up to
    /// the stored type's rounding: what a trainer continues from or rewrites in another type.
    /// Checks shapes, not the target (see `MtpHead::load`).
    pub fn weights_f32(&self) -> Result<(HeadConfig, HeadWeightsF32), SpecError> {
        let c = self.config.clone();
        let (h, qw, kvw, ff) = (c.target_hidden, c.q_width(), c.kv_width(), c.ffn);
        let k = self.len_of(D2T).ok_or_else(|| self.err(format!("tensor '{D2T}' is missing")))?;
        let m = |name: &str, rows: usize, cols: usize| -> Result<Vec<f32>, SpecError> {
            let q = self.matrix(name, rows, cols)?;
            let mut out = vec![0f32; rows * cols];
            for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                q.dequantize_row_into(r, row);
            }
            Ok(out)
        };
        let w = HeadWeightsF32 {
            fuse: if c.fuses() { m(FUSE, h, c.feature_width())? } else { Vec::new() },
            fc: m(FC, h, 2 * h)?,
            attn_norm: self.vector(ATTN_NORM, h)?,
            attn_q: m(ATTN_Q, qw, h)?,
            attn_k: m(ATTN_K, kvw, h)?,
            attn_v: m(ATTN_V, kvw, h)?,
            attn_output: m(ATTN_OUTPUT, h, qw)?,
            ffn_norm: self.vector(FFN_NORM, h)?,
            ffn_gate: m(FFN_GATE, ff, h)?,
            ffn_up: m(FFN_UP, ff, h)?,
            ffn_down: m(FFN_DOWN, h, ff)?,
            norm: self.vector(NORM, h)?,
            lm_head: m(LM_HEAD, k, h)?,
            d2t: self.ids(D2T, k)?.into_iter().map(|t| t as TokenId).collect(),
        };
        Ok((c, w))
    }

    /// A `[len]` integer vector (I32 or I64), widened to i64.
    pub fn ids(&self, name: &str, len: usize) -> Result<Vec<i64>, SpecError> {
        let e = self.entry(name, &[len])?;
        let data = &self.bytes[e.start..e.start + e.len];
        match e.dtype {
            Dtype::I64 => Ok(data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk"))).collect()),
            Dtype::I32 => Ok(data.chunks_exact(4).map(|c| i64::from(i32::from_le_bytes(c.try_into().expect("4-byte chunk")))).collect()),
            other => Err(self.err(format!("tensor '{name}' has type {other:?}; id tables must be I32 or I64"))),
        }
    }

    /// Length of `name`'s first dimension, if it is present (K from `d2t`).
    pub fn len_of(&self, name: &str) -> Option<usize> {
        self.tensors.get(name).and_then(|e| e.shape.first().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_names_bad_keys() {
        let c = HeadConfig {
            target_vocab: 259,
            target_hidden: 64,
            target_layers: 2,
            feature_layers: vec![0, 1],
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            rms_eps: 1e-5,
            rope_theta: 10000.0,
            target_fingerprint: "ab,cd".into(),
            context: HeadContext::Sequence,
        };
        let md = c.to_metadata();
        assert_eq!(HeadConfig::from_metadata(&md).unwrap(), c);
        // the heads written before the keys existed attend over their chain only and read the
        // final hidden state alone
        let mut m = md.clone();
        m.remove("attention_context");
        m.remove("feature_layers");
        let old = HeadConfig::from_metadata(&m).unwrap();
        assert_eq!((old.context, old.feature_layers.clone(), old.fuses()), (HeadContext::Chain, vec![1], false));
        for bad in ["1,0", "0,2", "", "a"] {
            m.insert("feature_layers".into(), bad.into());
            assert!(HeadConfig::from_metadata(&m).unwrap_err().contains("'feature_layers'"), "{bad}");
        }
        m.remove("feature_layers");
        m.insert("attention_context".into(), "global".into());
        assert!(HeadConfig::from_metadata(&m).unwrap_err().contains("'attention_context' = 'global'"));
        assert!(c.accepts_fingerprint("cd") && !c.accepts_fingerprint("ef"));
        let mut m = md.clone();
        m.remove("ffn");
        assert_eq!(HeadConfig::from_metadata(&m).unwrap_err(), "metadata key 'ffn' is missing");
        let mut m = md.clone();
        m.insert("head_dim".into(), "x".into());
        assert!(HeadConfig::from_metadata(&m).unwrap_err().contains("'head_dim' = 'x'"));
        let mut m = md;
        m.insert("format".into(), "eagle".into());
        assert!(HeadConfig::from_metadata(&m).unwrap_err().contains("expected 'specula-mtp-v1'"));
    }

    #[test]
    fn map_targets_uses_t2d_and_marks_tokens_outside_the_pruned_vocabulary() {
        let t2d = t2d_from_d2t(&[7, 2, 9], 10);
        assert_eq!(t2d, vec![-1, -1, 1, -1, -1, -1, -1, 0, -1, 2]);
        assert_eq!(map_targets(&t2d, &[9, 3, 7, 2, 42]), vec![Some(2), None, Some(0), Some(1), None]);
    }
}
