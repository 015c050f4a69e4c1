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
    /// `[rows, H]`.
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
    pub fn new(hidden_size: usize) -> Self {
        Self { hidden_size, seq_offsets: vec![0], ..Default::default() }
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
        assert_eq!(hidden.len(), rows * self.hidden_size, "teacher pass returned the wrong number of hidden rows");
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
    pub fn extend(&mut self, other: &Shard) {
        let base = self.rows();
        self.hidden.extend_from_slice(&other.hidden);
        self.next_token.extend_from_slice(&other.next_token);
        self.top_ids.extend_from_slice(&other.top_ids);
        self.top_probs.extend_from_slice(&other.top_probs);
        self.seq_offsets.extend(other.seq_offsets[1..].iter().map(|o| o + base));
    }

    /// Writes through a temporary file, so an interrupted run never leaves a half shard.
    pub fn write(&self, path: &Path, fingerprint: &str, split: &str) -> Result<()> {
        let (r, h, s) = (self.rows(), self.hidden_size, self.num_sequences());
        let hidden: Vec<u8> = self.hidden.iter().flat_map(|v| v.to_le_bytes()).collect();
        let next: Vec<u8> = self.next_token.iter().flat_map(|v| v.to_le_bytes()).collect();
        let ids: Vec<u8> = self.top_ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let probs: Vec<u8> = self.top_probs.iter().flat_map(|v| v.to_le_bytes()).collect();
        let offs: Vec<u8> = self.seq_offsets.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect();
        let views = vec![
            ("hidden", TensorView::new(Dtype::F16, vec![r, h], &hidden)?),
            ("next_token", TensorView::new(Dtype::I32, vec![r], &next)?),
            ("top_ids", TensorView::new(Dtype::I32, vec![r, TOP_K], &ids)?),
            ("top_probs", TensorView::new(Dtype::F32, vec![r, TOP_K], &probs)?),
            ("seq_offsets", TensorView::new(Dtype::I64, vec![s + 1], &offs)?),
        ];
        let md: HashMap<String, String> = [("target_fingerprint".to_string(), fingerprint.to_string()), ("split".to_string(), split.to_string())].into();
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
        let s = Self {
            hidden_size: hs[1],
            hidden: hidden.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect(),
            next_token: i32s(next),
            top_ids: i32s(ids),
            top_probs: probs.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
            seq_offsets: offs.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as usize).collect(),
            fingerprint: meta.metadata().as_ref().and_then(|m| m.get("target_fingerprint").cloned()).unwrap_or_default(),
        };
        let r = s.rows();
        if s.hidden.len() != r * s.hidden_size || s.top_ids.len() != r * TOP_K || s.top_probs.len() != r * TOP_K || s.seq_offsets.first() != Some(&0) || s.seq_offsets.last() != Some(&r) {
            bail!("{}: inconsistent shard (rows {r}); delete it and run `specula train-head data` again", path.display());
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_round_trips_through_a_file() {
        let mut s = Shard::new(2);
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
}
