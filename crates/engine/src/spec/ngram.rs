//! N-gram (prompt lookup) proposer: finds the most recent earlier occurrence of the sequence's
//! last n tokens (n from max down to min) and proposes the tokens that followed it. Costs no
//! model call, so it pays off whenever the output repeats the input (edits, quotes, code).

use super::proposer::{Draft, DraftRequest, Proposer};
use super::SpecError;
use crate::types::TokenId;

pub struct NgramProposer {
    pub min_n: usize,
    pub max_n: usize,
}

impl NgramProposer {
    pub fn new(min_n: usize, max_n: usize) -> Self {
        Self { min_n, max_n }
    }

    /// The continuation of the latest earlier match of the longest matching suffix.
    pub fn lookup(&self, tokens: &[TokenId], k: usize) -> Vec<TokenId> {
        if k == 0 {
            return Vec::new();
        }
        let len = tokens.len();
        for n in (self.min_n..=self.max_n).rev() {
            if len <= n {
                continue;
            }
            let suffix = &tokens[len - n..];
            // latest start i < len - n with tokens[i..i+n] == suffix
            for i in (0..len - n).rev() {
                if &tokens[i..i + n] == suffix {
                    let start = i + n;
                    let end = (start + k).min(len);
                    if start < end {
                        return tokens[start..end].to_vec();
                    }
                }
            }
        }
        Vec::new()
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, reqs: &[DraftRequest], _pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        Ok(reqs.iter().map(|r| Draft { tokens: self.lookup(r.tokens, r.max_draft), probs: None }).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match_of_the_longest_suffix() {
        let p = NgramProposer::new(1, 3);
        // ... 1 2 3 [4 5] ... 1 2 3 [9 9] ... 1 2 3 -> latest match of "1 2 3" continues with 9 9
        let t = [1, 2, 3, 4, 5, 7, 1, 2, 3, 9, 9, 8, 1, 2, 3];
        assert_eq!(p.lookup(&t, 2), vec![9, 9]);
        assert_eq!(p.lookup(&t, 5), vec![9, 9, 8, 1, 2]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_proposes_nothing_without_a_match() {
        let p = NgramProposer::new(1, 3);
        assert_eq!(p.lookup(&[5, 6, 7, 6], 3), vec![7, 6]);
        assert_eq!(p.lookup(&[1, 2, 3, 4], 3), Vec::<u32>::new());
        assert_eq!(p.lookup(&[1, 1], 0), Vec::<u32>::new());
        let p2 = NgramProposer::new(2, 3);
        assert_eq!(p2.lookup(&[5, 6, 7, 6], 3), Vec::<u32>::new());
    }

    #[test]
    fn continuation_is_capped_by_the_sequence_end() {
        let p = NgramProposer::new(2, 2);
        assert_eq!(p.lookup(&[4, 5, 4, 5], 8), vec![4, 5]);
    }
}
