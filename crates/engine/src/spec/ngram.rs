//! N-gram (prompt lookup) proposer: finds the longest suffix of the sequence's text (prompt and
//! accepted output) that occurred earlier and proposes the tokens that followed it. Costs no model
//! call, so it pays off whenever the output repeats the input (edits, quotes, code).
//!
//! Each sequence keeps a [`SuffixAutomaton`] fed only the tokens accepted since its last step, so a
//! lookup is O(1) whatever the text's length and the match is the longest there is, not the
//! longest of a few fixed n. The draft is as long as the match (a match of 40 tokens in a code
//! edit says the next ones are copied too; one of 2 is a guess), capped by what the engine allows
//! this step (`max_draft`, from the cost model and the sequence's acceptance).

use super::proposer::{Draft, DraftRequest, Proposer};
use super::suffix::SuffixAutomaton;
use super::SpecError;
use crate::types::{SeqId, TokenId};
use std::collections::HashMap;

pub struct NgramProposer {
    /// Shortest match that is worth a draft.
    pub min_match: usize,
    index: HashMap<SeqId, SuffixAutomaton>,
}

impl NgramProposer {
    pub fn new(min_match: usize) -> Self {
        Self { min_match: min_match.max(1), index: HashMap::new() }
    }

    /// `seq`'s automaton, fed up to `tokens` (only the tokens it has not seen; indexed afresh
    /// if the sequence lost tokens it had, which it should not).
    fn fed(&mut self, seq: SeqId, tokens: &[TokenId]) -> &SuffixAutomaton {
        let automaton = self.index.entry(seq).or_default();
        if automaton.len() > tokens.len() {
            *automaton = SuffixAutomaton::new();
        }
        for &t in &tokens[automaton.len()..] {
            automaton.push(t);
        }
        automaton
    }

    /// The draft for a text seen for the first time (tests, one-off lookups).
    pub fn lookup(&self, tokens: &[TokenId], k: usize) -> Vec<TokenId> {
        let mut a = SuffixAutomaton::new();
        tokens.iter().for_each(|&t| a.push(t));
        continuation(self.min_match, &a, tokens, k)
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, reqs: &[DraftRequest], _pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let mut drafts = Vec::with_capacity(reqs.len());
        for r in reqs {
            if r.max_draft == 0 {
                drafts.push(Draft::default());
                continue;
            }
            let min = self.min_match;
            let tokens = continuation(min, self.fed(r.seq, r.tokens), r.tokens, r.max_draft);
            drafts.push(Draft { tokens, probs: None });
        }
        Ok(drafts)
    }

    fn support(&mut self, seq: SeqId, tokens: &[TokenId]) -> Option<usize> {
        let min = self.min_match;
        Some(draftable_match(min, self.fed(seq, tokens)).map_or(0, |(len, _)| len))
    }

    fn remove(&mut self, seq: SeqId) {
        self.index.remove(&seq);
    }
}

/// The longest earlier match of the text's suffix (length, end of its first occurrence), if it
/// is at least `min_match` long: what a draft continues, and what `support` reports.
fn draftable_match(min_match: usize, automaton: &SuffixAutomaton) -> Option<(usize, usize)> {
    automaton.longest_repeat().filter(|&(len, _)| len >= min_match)
}

/// Up to `k` tokens continuing `tokens` after the longest earlier match of its suffix (the
/// first occurrence of that match), given the automaton of exactly `tokens`; nothing for a match
/// shorter than `min_match`.
fn continuation(min_match: usize, automaton: &SuffixAutomaton, tokens: &[TokenId], k: usize) -> Vec<TokenId> {
    let Some((len, end)) = draftable_match(min_match, automaton) else { return Vec::new() };
    if k == 0 {
        return Vec::new();
    }
    let k = k.min(len);
    // the continuation may run into the text's own end (a repeating pattern): it then goes on
    // with the draft's own tokens, which is what the text would be if the pattern continues
    let mut out = Vec::with_capacity(k);
    for i in 0..k {
        let at = end + 1 + i;
        out.push(if at < tokens.len() { tokens[at] } else { out[at - tokens.len()] });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_longest_earlier_match() {
        let p = NgramProposer::new(1);
        // the text ends "8 1 2 3": "8 1 2 3" never occurred before, "1 2 3" did (first at 0..3)
        let t = [1, 2, 3, 4, 5, 7, 1, 2, 3, 9, 9, 8, 1, 2, 3];
        assert_eq!(p.lookup(&t, 2), vec![4, 5]);
        // the draft is no longer than the match
        assert_eq!(p.lookup(&t, 5), vec![4, 5, 7]);
        // a longer match wins over an earlier shorter one: "7 1 2" then "3"
        let t = [1, 2, 5, 7, 1, 2, 3, 6, 7, 1, 2];
        assert_eq!(p.lookup(&t, 1), vec![3]);
    }

    #[test]
    fn nothing_below_the_minimum_match_or_without_a_match() {
        assert_eq!(NgramProposer::new(1).lookup(&[5, 6, 7, 6], 3), vec![7]);
        assert_eq!(NgramProposer::new(2).lookup(&[5, 6, 7, 6], 3), Vec::<u32>::new());
        assert_eq!(NgramProposer::new(1).lookup(&[1, 2, 3, 4], 3), Vec::<u32>::new());
        assert_eq!(NgramProposer::new(1).lookup(&[1, 1], 0), Vec::<u32>::new());
    }

    #[test]
    fn a_repeating_pattern_continues_past_the_end_of_the_text() {
        // "4 5 4 5": the suffix "4 5" first ended at 1; its continuation 4 5 then the draft's own
        let p = NgramProposer::new(2);
        assert_eq!(p.lookup(&[4, 5, 4, 5], 2), vec![4, 5]);
        assert_eq!(p.lookup(&[4, 5, 4, 5, 4, 5, 4, 5], 6), vec![4, 5, 4, 5, 4, 5]);
    }

    #[test]
    fn support_is_the_length_of_the_match_the_draft_continues() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let params = crate::api::SamplingParams::greedy(8);
        let text: Vec<TokenId> = vec![1, 2, 3, 4, 5, 7, 1, 2, 3, 9, 8, 1, 2, 3];
        let mut p = NgramProposer::new(2);
        // "1 2 3" occurred before: a 3-token match, and the draft is at most that long
        assert_eq!(p.support(SeqId(1), &text), Some(3));
        let req = DraftRequest { seq: SeqId(1), tokens: &text, prompt_len: 2, max_draft: 8, params: &params, hidden: None, rng: None };
        assert_eq!(p.propose(&[req], &pool).unwrap()[0].tokens, vec![4, 5, 7]);
        // one more token: "6" never occurred before, nothing matches
        let longer: Vec<TokenId> = [&text[..], &[6]].concat();
        assert_eq!(p.support(SeqId(1), &longer), Some(0));
        assert_eq!(NgramProposer::new(1).support(SeqId(1), &[5, 6, 7, 6]), Some(1));
        assert_eq!(NgramProposer::new(1).support(SeqId(1), &[1, 2, 3]), Some(0));
    }

    #[test]
    fn the_per_sequence_index_is_fed_incrementally_and_matches_a_fresh_one() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let params = crate::api::SamplingParams::greedy(8);
        let mut p = NgramProposer::new(2);
        let text: Vec<TokenId> = [10, 11, 12, 13, 14, 10, 11, 12, 20, 10, 11, 12, 13].to_vec();
        for end in 3..=text.len() {
            let req = DraftRequest { seq: SeqId(7), tokens: &text[..end], prompt_len: 3, max_draft: 4, params: &params, hidden: None, rng: None };
            let d = p.propose(&[req], &pool).unwrap();
            assert_eq!(d[0].tokens, NgramProposer::new(2).lookup(&text[..end], 4), "at {end}");
        }
        p.remove(SeqId(7));
        assert!(p.index.is_empty());
    }
}
