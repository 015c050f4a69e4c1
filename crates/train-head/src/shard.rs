//! One shard of distillation data in memory and on disk (safetensors; layout in `data.rs`).
//! Hidden states are kept as f16 to halve disk and memory; training widens them per batch.

use anyhow::{bail, Context, Result};
use half::f16;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;

/// Target tokens (with probabilities) kept per position as soft labels.
pub const TOP_K: usize = 8;

#[derive(Clone, Debug, Default)]
pub struct Shard {
    pub hidden_size: usize,
    /// The target layers whose hidden states each row holds, in order (metadata
    /// `feature_layers`); empty for shards written before the key existed, which hold the final
    /// hidden state only.
    pub feature_layers: Vec<usize>,
    /// `[rows, F * H]`: per row the hidden state after each of the F feature layers.
    pub hidden: Vec<f16>,
    /// Token that follows each row (-1 on a sequence's last row).
    pub next_token: Vec<i32>,
    /// `[rows, TOP_K]` target ids, most probable first, and their probabilities.
    pub top_ids: Vec<i32>,
    pub top_probs: Vec<f32>,
    /// Row ranges of the sequences: `seq_offsets[s]..seq_offsets[s + 1]`; starts with 0.
    pub seq_offsets: Vec<usize>,
    /// Fingerprint of the target that produced the data.
    pub fingerprint: String,
}

impl Shard {
    pub fn new(hidden_size: usize, feature_layers: &[usize]) -> Self {
        Self { hidden_size, feature_layers: feature_layers.to_vec(), seq_offsets: vec![0], ..Default::default() }
    }

    /// Values per row of `hidden`: H per feature layer.
    pub fn width(&self) -> usize {
        self.hidden_size * self.feature_layers.len().max(1)
    }

    pub fn rows(&self) -> usize {
        self.next_token.len()
    }

    pub fn num_sequences(&self) -> usize {
        self.seq_offsets.len() - 1
    }

    /// Appends one sequence: `answer.len() + 1` rows of hidden state and top tokens (rows
    /// p-1 ..= L-1 of the teacher-forced pass); row r is followed by `answer[r]`.
    pub fn push_sequence(&mut self, hidden: &[f32], answer: &[u32], top: &[[(u32, f32); TOP_K]]) {
        let rows = answer.len() + 1;
        assert_eq!(hidden.len(), rows * self.width(), "teacher pass returned the wrong number of hidden rows");
        assert_eq!(top.len(), rows, "teacher pass returned the wrong number of logits rows");
        self.hidden.extend(hidden.iter().map(|&v| f16::from_f32(v)));
        self.next_token.extend(answer.iter().map(|&t| t as i32).chain([-1]));
        for row in top {
            self.top_ids.extend(row.iter().map(|&(t, _)| t as i32));
            self.top_probs.extend(row.iter().map(|&(_, p)| p));
        }
        self.seq_offsets.push(self.rows());
    }

    /// Appends every sequence of `other`.
    pub fn extend(&mut self, other: &Shard) -> Result<()> {
        if (other.hidden_size, &other.feature_layers) != (self.hidden_size, &self.feature_layers) {
            bail!(
                "shards of different shapes cannot be read together (hidden size {} layers {:?} against {} layers {:?}): delete the older ones and run `specula-train-head data` again",
                other.hidden_size,
                other.feature_layers,
                self.hidden_size,
                self.feature_layers
            );
        }
        let base = self.rows();
        self.hidden.extend_from_slice(&other.hidden);
        self.next_token.extend_from_slice(&other.next_token);
        self.top_ids.extend_from_slice(&other.top_ids);
        self.top_probs.extend_from_slice(&other.top_probs);
        self.seq_offsets.extend(other.seq_offsets[1..].iter().map(|o| o + base));
        Ok(())
    }

    /// Writes through a temporary file, so an interrupted run never leaves a half shard.
    pub fn write(&self, path: &Path, fingerprint: &str, split: &str) -> Result<()> {
        let (r, w, s) = (self.rows(), self.width(), self.num_sequences());
        let hidden: Vec<u8> = self.hidden.iter().flat_map(|v| v.to_le_bytes()).collect();
        let next: Vec<u8> = self.next_token.iter().flat_map(|v| v.to_le_bytes()).collect();
        let ids: Vec<u8> = self.top_ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let probs: Vec<u8> = self.top_probs.iter().flat_map(|v| v.to_le_bytes()).collect();
        let offs: Vec<u8> = self.seq_offsets.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect();
        let views = vec![
            ("hidden", TensorView::new(Dtype::F16, vec![r, w], &hidden)?),
            ("next_token", TensorView::new(Dtype::I32, vec![r], &next)?),
            ("top_ids", TensorView::new(Dtype::I32, vec![r, TOP_K], &ids)?),
            ("top_probs", TensorView::new(Dtype::F32, vec![r, TOP_K], &probs)?),
            ("seq_offsets", TensorView::new(Dtype::I64, vec![s + 1], &offs)?),
        ];
        let layers = self.feature_layers.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(",");
        let md: HashMap<String, String> = [
            ("target_fingerprint".to_string(), fingerprint.to_string()),
            ("split".to_string(), split.to_string()),
            ("hidden_size".to_string(), self.hidden_size.to_string()),
            ("feature_layers".to_string(), layers),
        ]
        .into();
        let tmp = path.with_extension("tmp");
        safetensors::serialize_to_file(views, &Some(md), &tmp)?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }

    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let (_, meta) = SafeTensors::read_metadata(&bytes).with_context(|| format!("{} is not a safetensors file", path.display()))?;
        let st = SafeTensors::deserialize(&bytes)?;
        let get = |name: &str, dtype: Dtype| -> Result<(Vec<usize>, &[u8])> {
            let t = st.tensor(name).with_context(|| format!("{}: tensor '{name}' is missing", path.display()))?;
            if t.dtype() != dtype {
                bail!("{}: tensor '{name}' is {:?}, expected {dtype:?}", path.display(), t.dtype());
            }
            Ok((t.shape().to_vec(), t.data()))
        };
        let (hs, hidden) = get("hidden", Dtype::F16)?;
        let (_, next) = get("next_token", Dtype::I32)?;
        let (_, ids) = get("top_ids", Dtype::I32)?;
        let (_, probs) = get("top_probs", Dtype::F32)?;
        let (_, offs) = get("seq_offsets", Dtype::I64)?;
        let i32s = |b: &[u8]| b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes"))).collect::<Vec<_>>();
        let md = meta.metadata().clone().unwrap_or_default();
        let bad = |what: &str| anyhow::anyhow!("{}: metadata '{what}' is malformed; delete the shard and run `specula-train-head data` again", path.display());
        let feature_layers: Vec<usize> = match md.get("feature_layers").map(|s| s.trim()) {
            None | Some("") => Vec::new(),
            Some(v) => v.split(',').map(|x| x.trim().parse::<usize>().map_err(|_| bad("feature_layers"))).collect::<Result<_>>()?,
        };
        let width = hs.get(1).copied().unwrap_or(0);
        let hidden_size = match md.get("hidden_size") {
            Some(v) => v.trim().parse::<usize>().map_err(|_| bad("hidden_size"))?,
            None => width,
        };
        let s = Self {
            hidden_size,
            feature_layers,
            hidden: hidden.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect(),
            next_token: i32s(next),
            top_ids: i32s(ids),
            top_probs: probs.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
            seq_offsets: offs.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as usize).collect(),
            fingerprint: md.get("target_fingerprint").cloned().unwrap_or_default(),
        };
        let r = s.rows();
        if s.hidden_size == 0
            || width != s.width()
            || s.hidden.len() != r * s.width()
            || s.top_ids.len() != r * TOP_K
            || s.top_probs.len() != r * TOP_K
            || s.seq_offsets.first() != Some(&0)
            || s.seq_offsets.last() != Some(&r)
        {
            bail!("{}: inconsistent shard (rows {r}); delete it and run `specula-train-head data` again", path.display());
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_round_trips_through_a_file() {
        let mut s = Shard::new(2, &[]);
        let top = [(3u32, 0.5f32); TOP_K];
        s.push_sequence(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[7, 8], &[top; 3]);
        s.push_sequence(&[0.5, -1.0, 0.25, 2.0], &[9], &[top; 2]);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        s.write(&p, "fp", "train").unwrap();
        let r = Shard::read(&p).unwrap();
        assert_eq!(r.seq_offsets, vec![0, 3, 5]);
        assert_eq!(r.next_token, vec![7, 8, -1, 9, -1]);
        assert_eq!(r.hidden.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5, -1.0, 0.25, 2.0]);
        assert_eq!(r.fingerprint, "fp");
        std::fs::write(&p, b"garbage").unwrap();
        assert!(Shard::read(&p).is_err());
    }

    /// Rows of several layers' states: the width follows the layers, the layers survive the
    /// file, and shards of other layers are not mixed.
    #[test]
    fn a_shard_of_several_layers_round_trips_and_refuses_other_layers() {
        let mut s = Shard::new(2, &[1, 4, 7]);
        assert_eq!(s.width(), 6);
        let top = [(3u32, 0.5f32); TOP_K];
        let rows: Vec<f32> = (0..12).map(|i| i as f32).collect();
        s.push_sequence(&rows, &[5], &[top; 2]);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        s.write(&p, "fp", "train").unwrap();
        let mut r = Shard::read(&p).unwrap();
        assert_eq!((r.hidden_size, r.feature_layers.clone(), r.width()), (2, vec![1, 4, 7], 6));
        assert_eq!(r.hidden.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), rows);
        r.extend(&s).unwrap();
        assert_eq!(r.rows(), 4);
        let err = r.extend(&Shard::new(2, &[7])).unwrap_err().to_string();
        assert!(err.contains("different shapes"), "{err}");
    }
}
