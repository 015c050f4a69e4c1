//! The cross-request suffix index (SuffixDecoding-style): the outputs of recent finished requests,
//! so a request whose output repeats what an earlier request wrote (the same tool-call scaffold,
//! boilerplate another agent wrote, a regenerated answer) is drafted from it, where its own
//! prompt has nothing to copy.
//!
//! Bounded: at most `max_tokens` tokens of output are kept across all tenants, oldest output
//! evicted first (the index then drops to 3/4 of the budget, so the rebuild an eviction costs,
//! linear in what is left, is paid once per quarter of the budget written: about 15 ms for the
//! 49 152 tokens left at the default budget, on the proposer's thread, once every ~16 000 output
//! tokens; measured on an AMD EPYC Zen 5). Per tenant: each
//! tenant ([`Tenant`], one per API key) has its own index, and a lookup only reads its own
//! tenant's, so no text crosses keys. Outputs shorter than [`MIN_OUTPUT`] tokens are not kept
//! (nothing to copy), nor the part of one past the budget.
//!
//! A lookup gives the longest suffix of the sequence's last [`QUERY_TOKENS`] tokens that occurs in
//! the tenant's outputs and the tokens that followed its first occurrence, up to that output's
//! end. Whether a match is worth drafting is the caller's to judge: the n-gram proposer compares
//! it with the sequence's own match and adaptive k keeps a separate acceptance estimate for
//! corpus matches.
//!
//! Observed in `/metrics` as `specula:spec_decode_corpus_tokens` (kept now) and
//! `specula:spec_decode_corpus_drafts` (drafts it gave).
//!
//! Memory: the automaton's states and transitions cost about 150 bytes per kept token (about
//! 10 MB at the default budget of 65 536 tokens).

use super::suffix::SuffixAutomaton;
use crate::types::{Tenant, TokenId};
use std::collections::{HashMap, VecDeque};

/// Never a token: ends every output in a tenant's text, so no match runs from one output into
/// the next and a continuation stops at its output's end.
const SEPARATOR: TokenId = TokenId::MAX;
/// The sequence's last tokens a lookup matches (a longer match is as good as this long).
pub const QUERY_TOKENS: usize = 64;
/// Outputs shorter than this are not kept.
pub const MIN_OUTPUT: usize = 4;

/// See the module docs.
pub struct Corpus {
    max_tokens: usize,
    /// Tokens kept across tenants (separators not counted).
    total: usize,
    /// Every kept output's tenant and length, oldest first (eviction order).
    order: VecDeque<(Tenant, usize)>,
    tenants: HashMap<Tenant, TenantIndex>,
}

/// One tenant's outputs and the automaton over them.
#[derive(Default)]
struct TenantIndex {
    /// The kept outputs, oldest first, each followed by [`SEPARATOR`].
    text: Vec<TokenId>,
    /// Length (with separator) of each kept output, oldest first.
    lens: VecDeque<usize>,
    automaton: SuffixAutomaton,
}

impl TenantIndex {
    fn push(&mut self, output: &[TokenId]) {
        for &t in output.iter().chain(std::iter::once(&SEPARATOR)) {
            self.text.push(t);
            self.automaton.push(t);
        }
        self.lens.push_back(output.len() + 1);
    }

    /// Drops the `n` oldest outputs and rebuilds the automaton over the rest.
    fn evict(&mut self, n: usize) {
        let cut: usize = self.lens.drain(..n.min(self.lens.len())).sum();
        self.text.drain(..cut);
        self.automaton = SuffixAutomaton::new();
        self.text.iter().for_each(|&t| self.automaton.push(t));
    }
}

/// A corpus match: how many of the query's last tokens it matched and what followed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorpusMatch {
    pub len: usize,
    pub continuation: Vec<TokenId>,
}

impl Corpus {
    /// An index of at most `max_tokens` tokens (0: keeps nothing).
    pub fn new(max_tokens: usize) -> Self {
        Self { max_tokens, total: 0, order: VecDeque::new(), tenants: HashMap::new() }
    }

    /// Tokens kept now, across tenants.
    pub fn tokens(&self) -> usize {
        self.total
    }

    /// Keeps a finished request's `output` in `tenant`'s index (at most the budget's last
    /// tokens of it), evicting the oldest outputs past the budget.
    pub fn add(&mut self, tenant: Tenant, output: &[TokenId]) {
        let output = &output[output.len().saturating_sub(self.max_tokens)..];
        if output.len() < MIN_OUTPUT || output.contains(&SEPARATOR) {
            return;
        }
        self.tenants.entry(tenant).or_default().push(output);
        self.order.push_back((tenant, output.len()));
        self.total += output.len();
        if self.total > self.max_tokens {
            self.evict_to(self.max_tokens * 3 / 4);
        }
        metrics::gauge!("specula:spec_decode_corpus_tokens").set(self.total as f64);
    }

    /// Evicts the oldest outputs until at most `keep` tokens are left (never the newest); each
    /// tenant that lost outputs is rebuilt once.
    fn evict_to(&mut self, keep: usize) {
        let mut lost: HashMap<Tenant, usize> = HashMap::new();
        while self.total > keep && self.order.len() > 1 {
            let Some((tenant, len)) = self.order.pop_front() else { break };
            self.total -= len;
            *lost.entry(tenant).or_default() += 1;
        }
        for (tenant, n) in lost {
            let Some(index) = self.tenants.get_mut(&tenant) else { continue };
            if n >= index.lens.len() {
                self.tenants.remove(&tenant);
            } else {
                index.evict(n);
            }
        }
    }

    /// The longest suffix of `tokens`' last [`QUERY_TOKENS`] that occurs in `tenant`'s outputs,
    /// at least `min_len` long, with up to `k` tokens that followed it (fewer where its output
    /// ended; k = 0: the match alone). None where nothing followed it, whatever `k`.
    pub fn lookup(&self, tenant: Tenant, tokens: &[TokenId], min_len: usize, k: usize) -> Option<CorpusMatch> {
        let index = self.tenants.get(&tenant)?;
        let query = &tokens[tokens.len().saturating_sub(QUERY_TOKENS)..];
        let (len, end) = index.automaton.longest_suffix_of(query).filter(|&(len, _)| len >= min_len.max(1))?;
        let after = index.text[end + 1..].iter().take_while(|&&t| t != SEPARATOR);
        let continuation: Vec<TokenId> = after.clone().take(k).copied().collect();
        after.clone().next().is_some().then_some(CorpusMatch { len, continuation })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Tenant = Tenant(1);
    const B: Tenant = Tenant(2);

    #[test]
    fn continues_an_earlier_output_up_to_its_end() {
        let mut c = Corpus::new(1000);
        c.add(A, &[10, 11, 12, 13, 14, 15]);
        c.add(A, &[20, 21, 22, 23]);
        // the text ends "... 11 12": the first output went on 13 14 15 and ended there
        let m = c.lookup(A, &[1, 2, 11, 12], 1, 8).unwrap();
        assert_eq!(m, CorpusMatch { len: 2, continuation: vec![13, 14, 15] });
        // no match runs across an output's end: "15 20" never happened
        assert_eq!(c.lookup(A, &[15, 20], 1, 4).unwrap(), CorpusMatch { len: 1, continuation: vec![21, 22, 23] });
        // an output's last token: nothing followed it
        assert_eq!(c.lookup(A, &[9, 23], 1, 4), None);
        // shorter than asked
        assert_eq!(c.lookup(A, &[1, 2, 11, 12], 3, 8), None);
        // k = 0: the match alone, where something follows it
        assert_eq!(c.lookup(A, &[1, 2, 11, 12], 1, 0), Some(CorpusMatch { len: 2, continuation: vec![] }));
        assert_eq!(c.lookup(A, &[9, 23], 1, 0), None);
        assert_eq!(c.lookup(A, &[1, 2, 11, 12], 2, 2).unwrap().continuation, vec![13, 14]);
    }

    #[test]
    fn never_across_tenants() {
        let mut c = Corpus::new(1000);
        c.add(A, &[10, 11, 12, 13, 14]);
        assert!(c.lookup(A, &[10, 11], 1, 2).is_some());
        assert_eq!(c.lookup(B, &[10, 11], 1, 2), None);
        c.add(B, &[10, 11, 99, 98]);
        assert_eq!(c.lookup(B, &[10, 11], 1, 2).unwrap().continuation, vec![99, 98]);
        assert_eq!(c.lookup(A, &[10, 11], 1, 2).unwrap().continuation, vec![12, 13]);
    }

    #[test]
    fn the_budget_evicts_the_oldest_outputs_of_any_tenant() {
        let mut c = Corpus::new(20);
        c.add(A, &[1, 2, 3, 4, 5, 6, 7, 8]);
        c.add(B, &[11, 12, 13, 14, 15, 16]);
        c.add(A, &[21, 22, 23, 24]);
        assert_eq!(c.tokens(), 18);
        // 18 + 5 > 20: down to 15 at most, oldest first (A's first output, 8 tokens)
        c.add(B, &[31, 32, 33, 34, 35]);
        assert_eq!(c.tokens(), 15);
        assert_eq!(c.lookup(A, &[1, 2], 1, 2), None);
        assert_eq!(c.lookup(A, &[21, 22], 1, 2).unwrap().continuation, vec![23, 24]);
        assert_eq!(c.lookup(B, &[11, 12], 1, 2).unwrap().continuation, vec![13, 14]);
        assert_eq!(c.lookup(B, &[33], 1, 9).unwrap().continuation, vec![34, 35]);
        // a tenant whose outputs are all gone is dropped whole; the newest output stays
        c.add(B, &[41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]);
        assert_eq!(c.tokens(), 18);
        assert!(!c.tenants.contains_key(&A));
        assert_eq!(c.lookup(B, &[50, 51], 1, 2).unwrap().continuation, vec![52, 53]);
    }

    #[test]
    fn short_outputs_and_an_empty_budget_keep_nothing() {
        let mut c = Corpus::new(0);
        c.add(A, &[1, 2, 3, 4, 5, 6]);
        assert_eq!((c.tokens(), c.lookup(A, &[1, 2], 1, 2)), (0, None));
        let mut c = Corpus::new(100);
        c.add(A, &[1, 2, 3]);
        assert_eq!(c.tokens(), 0);
        // an output longer than the budget keeps its last tokens
        let mut c = Corpus::new(8);
        c.add(A, &(0..20).collect::<Vec<TokenId>>());
        assert_eq!(c.tokens(), 8);
        assert_eq!(c.lookup(A, &[15], 1, 9).unwrap().continuation, vec![16, 17, 18, 19]);
        assert_eq!(c.lookup(A, &[5, 6], 1, 9), None);
    }
}
