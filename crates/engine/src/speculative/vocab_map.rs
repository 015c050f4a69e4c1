//! Pruned draft vocabularies: a draft head may predict over K target tokens only. `d2t[i]` is the
//! target id of draft id i; `t2d[t]` the draft id of target id t, or none. Proposals are mapped
//! through d2t; target tokens fed back to the head are mapped through t2d where the head needs
//! draft ids. Tokens outside the pruned set can never be proposed, and the rejection sampler stays
//! exact for them (their q is 0, so they only ever come from the target's residual).

use crate::types::TokenId;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabMap {
    d2t: Vec<TokenId>,
    t2d: Vec<Option<u32>>,
}

impl VocabMap {
    /// Builds the map from `d2t`, checking every id is inside the target vocabulary and unique.
    pub fn from_d2t(d2t: Vec<TokenId>, target_vocab: usize) -> Result<Self, String> {
        let mut t2d = vec![None; target_vocab];
        for (d, &t) in d2t.iter().enumerate() {
            let slot = t2d.get_mut(t as usize).ok_or_else(|| format!("d2t[{d}] = {t} is outside the target vocabulary of {target_vocab} tokens"))?;
            if slot.is_some() {
                return Err(format!("d2t maps two draft ids to target id {t}"));
            }
            *slot = Some(d as u32);
        }
        Ok(Self { d2t, t2d })
    }

    /// The identity over a full vocabulary.
    pub fn identity(vocab: usize) -> Self {
        Self { d2t: (0..vocab as u32).collect(), t2d: (0..vocab as u32).map(Some).collect() }
    }

    pub fn draft_vocab(&self) -> usize {
        self.d2t.len()
    }
    pub fn target_vocab(&self) -> usize {
        self.t2d.len()
    }
    pub fn d2t(&self, d: u32) -> Option<TokenId> {
        self.d2t.get(d as usize).copied()
    }
    pub fn t2d(&self, t: TokenId) -> Option<u32> {
        self.t2d.get(t as usize).copied().flatten()
    }
    pub fn d2t_slice(&self) -> &[TokenId] {
        &self.d2t
    }

    /// Spreads a draft-vocabulary distribution over the target vocabulary (0 outside the set).
    pub fn to_target_probs(&self, draft_probs: &[f32]) -> Vec<f32> {
        let mut out = Vec::new();
        self.spread_into(draft_probs, 0.0, &mut out);
        out
    }

    /// Writes `draft_row` (one value per draft id) into `out` over the target vocabulary, `fill`
    /// for the target tokens outside the draft's set (0 for probabilities, -inf for logits).
    pub fn spread_into(&self, draft_row: &[f32], fill: f32, out: &mut Vec<f32>) {
        out.clear();
        out.resize(self.target_vocab(), fill);
        for (&t, &x) in self.d2t.iter().zip(draft_row) {
            out[t as usize] = x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn d2t_and_t2d_round_trip_and_unmapped_tokens_are_none() {
        let m = VocabMap::from_d2t(vec![7, 2, 9], 10).unwrap();
        for d in 0..3 {
            assert_eq!(m.t2d(m.d2t(d).unwrap()), Some(d));
        }
        assert_eq!(m.t2d(3), None);
        assert_eq!(m.t2d(100), None);
        assert_eq!(m.d2t(3), None);
        assert_eq!(m.to_target_probs(&[0.5, 0.25, 0.25]), vec![0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.25]);
    }

    #[test]
    fn out_of_range_or_duplicate_d2t_is_refused() {
        assert!(VocabMap::from_d2t(vec![1, 10], 10).unwrap_err().contains("outside"));
        assert!(VocabMap::from_d2t(vec![1, 1], 10).unwrap_err().contains("two draft ids"));
    }
}
