//! An online suffix automaton over one sequence's tokens: after each appended token it answers, in
//! O(1), which is the longest suffix of the text that also occurs earlier, and where that earlier
//! occurrence ends. Appending is amortised O(1) (one hash-map transition per state touched), so a
//! proposer keeps one per sequence and feeds it only the tokens accepted since the last step,
//! instead of scanning the whole text for n-grams every step.
//!
//! Our own code (no crate offers an incremental automaton over u32 symbols with first-occurrence
//! positions); it is the textbook construction (Blumer et al.), with `first_end` kept per state.

use crate::types::TokenId;
use std::collections::HashMap;

/// State 0 is the root (the empty string).
#[derive(Clone, Debug)]
pub struct SuffixAutomaton {
    /// Longest string of each state.
    len: Vec<u32>,
    /// Suffix link (root: none).
    link: Vec<u32>,
    /// End position (index of the last token) of the first occurrence of the state's strings.
    first_end: Vec<u32>,
    next: HashMap<(u32, TokenId), u32>,
    /// Symbols with a transition out of each state (to copy a state's transitions when it is split).
    symbols: Vec<Vec<TokenId>>,
    /// The state of the whole text.
    last: u32,
    tokens: usize,
}

const NONE: u32 = u32::MAX;

impl Default for SuffixAutomaton {
    fn default() -> Self {
        Self::new()
    }
}

impl SuffixAutomaton {
    pub fn new() -> Self {
        Self { len: vec![0], link: vec![NONE], first_end: vec![0], next: HashMap::new(), symbols: vec![Vec::new()], last: 0, tokens: 0 }
    }

    /// Tokens appended so far.
    pub fn len(&self) -> usize {
        self.tokens
    }

    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    fn add_state(&mut self, len: u32, link: u32, first_end: u32) -> u32 {
        self.len.push(len);
        self.link.push(link);
        self.first_end.push(first_end);
        self.symbols.push(Vec::new());
        (self.len.len() - 1) as u32
    }

    fn set(&mut self, from: u32, t: TokenId, to: u32) {
        if self.next.insert((from, t), to).is_none() {
            self.symbols[from as usize].push(t);
        }
    }

    /// Appends one token.
    pub fn push(&mut self, t: TokenId) {
        let pos = self.tokens as u32;
        self.tokens += 1;
        let cur = self.add_state(self.len[self.last as usize] + 1, NONE, pos);
        let mut p = self.last;
        while p != NONE && !self.next.contains_key(&(p, t)) {
            self.set(p, t, cur);
            p = self.link[p as usize];
        }
        if p == NONE {
            self.link[cur as usize] = 0;
        } else {
            let q = self.next[&(p, t)];
            if self.len[p as usize] + 1 == self.len[q as usize] {
                self.link[cur as usize] = q;
            } else {
                // split q: the clone keeps q's transitions and first occurrence
                let clone = self.add_state(self.len[p as usize] + 1, self.link[q as usize], self.first_end[q as usize]);
                let symbols = self.symbols[q as usize].clone();
                for &c in &symbols {
                    let to = self.next[&(q, c)];
                    self.next.insert((clone, c), to);
                }
                self.symbols[clone as usize] = symbols;
                while p != NONE && self.next.get(&(p, t)) == Some(&q) {
                    self.next.insert((p, t), clone);
                    p = self.link[p as usize];
                }
                self.link[q as usize] = clone;
                self.link[cur as usize] = clone;
            }
        }
        self.last = cur;
    }

    /// The longest suffix of `query` that occurs in the text: its length and where (index of the
    /// last token) its first occurrence in the text ends. None when not even the last token
    /// occurs. O(`query.len()`) amortised (the matching walk along suffix links).
    pub fn longest_suffix_of(&self, query: &[TokenId]) -> Option<(usize, usize)> {
        let (mut state, mut len) = (0u32, 0usize);
        for &t in query {
            while state != 0 && !self.next.contains_key(&(state, t)) {
                state = self.link[state as usize];
                len = self.len[state as usize] as usize;
            }
            match self.next.get(&(state, t)) {
                Some(&to) => {
                    state = to;
                    len += 1;
                }
                None => len = 0,
            }
        }
        (len > 0).then(|| (len, self.first_end[state as usize] as usize))
    }

    /// The longest suffix of the text that also occurs ending earlier: its length and the position
    /// (index of the last token) where its first occurrence ends. None when no suffix repeats.
    pub fn longest_repeat(&self) -> Option<(usize, usize)> {
        let l = self.link[self.last as usize];
        if l == NONE || l == 0 {
            return None;
        }
        Some((self.len[l as usize] as usize, self.first_end[l as usize] as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition, by brute force: the longest suffix occurring ending before the last token,
    /// and the first position any occurrence of it ends.
    fn brute(t: &[TokenId]) -> Option<(usize, usize)> {
        let n = t.len();
        for len in (1..n).rev() {
            let suf = &t[n - len..];
            if let Some(start) = (0..n - len).find(|&i| &t[i..i + len] == suf) {
                return Some((len, start + len - 1));
            }
        }
        None
    }

    #[test]
    fn finds_the_longest_earlier_match() {
        let mut a = SuffixAutomaton::new();
        for &t in &[1, 2, 3, 4, 1, 2, 3] {
            a.push(t);
        }
        assert_eq!(a.longest_repeat(), Some((3, 2)));
        a.push(9);
        assert_eq!(a.longest_repeat(), None);
    }

    /// The definition, by brute force: the longest suffix of `q` occurring in `t`, and the first
    /// position an occurrence of it ends.
    fn brute_in(t: &[TokenId], q: &[TokenId]) -> Option<(usize, usize)> {
        for len in (1..=q.len().min(t.len())).rev() {
            let suf = &q[q.len() - len..];
            if let Some(start) = (0..=t.len() - len).find(|&i| &t[i..i + len] == suf) {
                return Some((len, start + len - 1));
            }
        }
        None
    }

    proptest! {
        #[test]
        fn a_query_s_longest_suffix_in_the_text_agrees_with_brute_force(
            t in proptest::collection::vec(0u32..4, 1..60),
            q in proptest::collection::vec(0u32..5, 0..20),
        ) {
            let mut a = SuffixAutomaton::new();
            t.iter().for_each(|&x| a.push(x));
            prop_assert_eq!(a.longest_suffix_of(&q), brute_in(&t, &q));
        }

        #[test]
        fn agrees_with_brute_force_after_every_token(t in proptest::collection::vec(0u32..4, 1..80)) {
            let mut a = SuffixAutomaton::new();
            for i in 0..t.len() {
                a.push(t[i]);
                prop_assert_eq!(a.longest_repeat(), brute(&t[..=i]), "prefix {:?}", &t[..=i]);
            }
        }
    }
}
