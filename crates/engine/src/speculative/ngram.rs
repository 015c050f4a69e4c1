//! N-gram (prompt lookup) proposer: finds the longest suffix of the sequence's text (prompt and
//! accepted output) that occurred earlier and proposes the tokens that followed it. Costs no model
//! call, so it pays off whenever the output repeats the input (edits, quotes, code).
//!
//! Each sequence keeps a [`SuffixAutomaton`] fed only the tokens accepted since its last step, so a
//! lookup is O(1) whatever the text's length and the match is the longest there is, not the
//! longest of a few fixed n. The draft is as long as the match (a match of 40 tokens in a code
//! edit says the next ones are copied too; one of 2 is a guess), capped by what the engine allows
//! this step (`max_draft`, from the cost model and the sequence's acceptance).
//!
//! Code edits copy the prompt with a few spans changed, most of them many times: the edits learned
//! while the output is written ([`super::edits`]) give a second index, of the prompt with them
//! applied, and the draft comes from whichever index matches the text's suffix longer.
//!
//! Two more are shared across requests: the texts (prompt and output so far) of the tenant's other
//! running sequences, and the outputs of its recent finished requests ([`super::corpus`]). They
//! draft where their match is longer than the sequence's own (at least [`CORPUS_MIN_MATCH`]
//! tokens; a running text wins a tie with a finished output), and their matches keep their own
//! acceptance estimates (`Support::from_corpus`). Several agents on one repository send the same
//! files: an edit one of them writes is often in another's prompt.

use super::corpus::{Corpus, CorpusMatch, QUERY_TOKENS};
use super::edits::EditLearner;
use super::proposer::{Draft, DraftRequest, Proposer, SeqDrafting, Support};
use super::suffix::SuffixAutomaton;
use super::SpecError;
use crate::types::{SeqId, Tenant, TokenId};
use std::collections::HashMap;

/// Shortest match in the cross-request index that drafts (shorter ones, a `(` or a `self`, match
/// anywhere in other requests' outputs).
pub const CORPUS_MIN_MATCH: usize = 3;

/// Most other running sequences a lookup reads (the newest of the tenant's): a lookup walks one
/// automaton per peer (about 0.15 ms per step for 8 sequences of one tenant, `bench offline
/// --async-compare`'s propose column), so a large batch does not pay it squared.
pub const LIVE_PEERS: usize = 8;

/// Draft tokens a support lookup keeps for the draft asked next (longer drafts look up again).
const MEMO_DRAFT: usize = 64;

pub struct NgramProposer {
    /// Shortest match that is worth a draft.
    pub min_match: usize,
    /// Each running sequence's index: its own drafts continue it, and the lookups of the other
    /// sequences of its tenant read it ([`Self::live_lookup`]), so it is the proposer's.
    index: HashMap<SeqId, SeqIndex>,
    /// The outputs of recent finished requests (a budget of 0 keeps none).
    corpus: Corpus,
}

/// A sequence's last support lookup ([`Proposer::support`], asked for every sequence that may
/// draft before its draft length is chosen) with up to [`MEMO_DRAFT`] tokens of its draft, kept
/// in the sequence's [`SeqDrafting`]: the draft asked next for the same text is cut from it
/// instead of running the cross-request lookups again, and continues the very match whose
/// support chose its length.
#[derive(Clone, Debug)]
pub struct Memo {
    text_len: usize,
    support: Support,
    draft: Vec<TokenId>,
}

/// One sequence's lookup state.
struct SeqIndex {
    prompt_len: usize,
    /// Whose sequence it is: only the same tenant's sequences draft from its text.
    tenant: Tenant,
    /// The sequence's text (prompt and output) as far as it was fed: what its own matches
    /// continue, and what the other sequences' lookups read.
    text: Vec<TokenId>,
    /// The sequence's text (prompt and output) as it is.
    plain: SuffixAutomaton,
    /// The edits the output made to the prompt so far ([`super::edits`]).
    learner: EditLearner,
    /// From the first learned edit on: the prompt with the edits applied, and the automaton of it
    /// followed by the output (rebuilt when an edit is learned, fed like `plain` otherwise).
    edited: Option<Edited>,
}

struct Edited {
    source: Vec<TokenId>,
    automaton: SuffixAutomaton,
}

/// The match a draft continues: its length, the end of its first occurrence, and in which text.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Match {
    len: usize,
    end: usize,
    edited: bool,
}

impl SeqIndex {
    fn new(prompt_len: usize, tenant: Tenant) -> Self {
        Self { prompt_len, tenant, text: Vec::new(), plain: SuffixAutomaton::new(), learner: EditLearner::default(), edited: None }
    }

    /// Token `i` of the text `m` was found in.
    fn at(&self, edited: bool, i: usize) -> TokenId {
        match (&self.edited, edited) {
            (Some(e), true) if i < e.source.len() => e.source[i],
            (Some(e), true) => self.text[self.prompt_len + i - e.source.len()],
            _ => self.text[i],
        }
    }

    /// Length of the text `m` was found in.
    fn text_len(&self, edited: bool) -> usize {
        match (&self.edited, edited) {
            (Some(e), true) => e.source.len() + self.text.len() - self.prompt_len,
            _ => self.text.len(),
        }
    }

    /// Learns from the step that brought the text to where it is (fed to the automata already).
    fn learn(&mut self) {
        loop {
            let edited = self.edited.is_some();
            let (n, source_len) = (self.text_len(edited), self.edited.as_ref().map_or(self.prompt_len, |e| e.source.len()));
            let m = self.edited.as_ref().map_or(&self.plain, |e| &e.automaton).longest_repeat();
            let mut learner = std::mem::take(&mut self.learner);
            let learned = learner.observe(|i| self.at(edited, i), n, source_len, m);
            self.learner = learner;
            if !learned {
                return;
            }
            let source = self.learner.apply(&self.text[..self.prompt_len]);
            let mut automaton = SuffixAutomaton::new();
            source.iter().chain(&self.text[self.prompt_len..]).for_each(|&t| automaton.push(t));
            self.edited = Some(Edited { source, automaton });
        }
    }

    /// The longest earlier match of the text's suffix, in the plain or the edited text (the
    /// edited one on a tie: it is what the output has been writing), if at least `min_match` long.
    fn best_match(&self, min_match: usize) -> Option<Match> {
        let plain = self.plain.longest_repeat().map(|(len, end)| Match { len, end, edited: false });
        let edited = self.edited.as_ref().and_then(|e| e.automaton.longest_repeat()).map(|(len, end)| Match { len, end, edited: true });
        let best = match (plain, edited) {
            (Some(p), Some(e)) => Some(if e.len >= p.len { e } else { p }),
            (p, e) => p.or(e),
        };
        best.filter(|m| m.len >= min_match)
    }

    /// Up to `k` tokens continuing the text after the best match (its first occurrence).
    fn continuation(&self, min_match: usize, k: usize) -> Vec<TokenId> {
        let Some(m) = self.best_match(min_match) else { return Vec::new() };
        let (k, n) = (k.min(m.len), self.text_len(m.edited));
        // the continuation may run into the text's own end (a repeating pattern): it then goes on
        // with the draft's own tokens, which is what the text would be if the pattern continues
        let mut out = Vec::with_capacity(k);
        for i in 0..k {
            let at = m.end + 1 + i;
            out.push(if at < n { self.at(m.edited, at) } else { out[at - n] });
        }
        out
    }
}

impl NgramProposer {
    /// Without a cross-request index.
    pub fn new(min_match: usize) -> Self {
        Self::with_corpus(min_match, 0)
    }

    /// With a cross-request index of at most `corpus_tokens` tokens ([`Corpus`]).
    pub fn with_corpus(min_match: usize, corpus_tokens: usize) -> Self {
        Self { min_match: min_match.max(1), index: HashMap::new(), corpus: Corpus::new(corpus_tokens) }
    }

    /// The draft of up to `k` tokens for `r`'s sequence and how far it is backed: from the
    /// sequence's own text, or from another running sequence's text or the cross-request index
    /// where their match is longer (k = 0: how far only, no draft built).
    fn draft(&mut self, seq: SeqId, tokens: &[TokenId], prompt_len: usize, tenant: Tenant, k: usize) -> (Support, Vec<TokenId>) {
        let min = self.min_match;
        let s = self.fed(seq, tokens, prompt_len, tenant);
        let own = s.best_match(min).map_or(0, |m| m.len);
        // (a match of the whole query cannot be beaten)
        let live = if own >= QUERY_TOKENS { None } else { self.live_lookup(seq, tenant, tokens, CORPUS_MIN_MATCH.max(min), k).filter(|m| m.len > own) };
        let floor = live.as_ref().map_or(own, |m| m.len);
        let across = self.corpus.lookup(tenant, tokens, CORPUS_MIN_MATCH.max(min), k).filter(|m| m.len > floor).or(live);
        match across {
            Some(m) => (Support { len: m.len, from_corpus: true }, m.continuation),
            None => {
                let s = &self.index[&seq];
                (Support::own(own), if k == 0 { Vec::new() } else { s.continuation(min, k) })
            }
        }
    }

    /// The longest suffix of `tokens`' last [`QUERY_TOKENS`] found in the text of another running
    /// sequence of `tenant` (the newest [`LIVE_PEERS`]; at least `min_len`, with something after
    /// it), and up to `k` tokens that followed it there; on a tie, the sequence with the lowest id.
    fn live_lookup(&self, seq: SeqId, tenant: Tenant, tokens: &[TokenId], min_len: usize, k: usize) -> Option<CorpusMatch> {
        let query = &tokens[tokens.len().saturating_sub(QUERY_TOKENS)..];
        let mut peers: Vec<(SeqId, &SeqIndex)> = self.index.iter().filter(|(&other, s)| other != seq && s.tenant == tenant).map(|(&o, s)| (o, s)).collect();
        if peers.len() > LIVE_PEERS {
            peers.select_nth_unstable_by(LIVE_PEERS - 1, |a, b| b.0.cmp(&a.0));
            peers.truncate(LIVE_PEERS);
        }
        let mut best: Option<(usize, SeqId, usize)> = None;
        for (other, s) in peers {
            let Some((len, end)) = s.plain.longest_suffix_of(query).filter(|&(len, end)| len >= min_len && end + 1 < s.text.len()) else { continue };
            if best.is_none_or(|(l, id, _)| len > l || (len == l && other < id)) {
                best = Some((len, other, end));
            }
        }
        let (len, other, end) = best?;
        let text = &self.index[&other].text;
        Some(CorpusMatch { len, continuation: text[end + 1..].iter().take(k).copied().collect() })
    }

    /// `seq`'s index, fed up to `tokens` (only the tokens it has not seen; indexed afresh if the
    /// sequence lost tokens it had, which it should not), having learned from them.
    fn fed(&mut self, seq: SeqId, tokens: &[TokenId], prompt_len: usize, tenant: Tenant) -> &SeqIndex {
        let s = self.index.entry(seq).or_insert_with(|| SeqIndex::new(prompt_len, tenant));
        if s.plain.len() > tokens.len() || s.prompt_len != prompt_len || s.tenant != tenant {
            *s = SeqIndex::new(prompt_len, tenant);
        }
        let old = s.plain.len();
        s.text.extend_from_slice(&tokens[old..]);
        for &t in &tokens[old..] {
            s.plain.push(t);
            if let Some(e) = s.edited.as_mut() {
                e.automaton.push(t);
            }
        }
        if tokens.len() > old && tokens.len() > prompt_len {
            s.learn();
        }
        s
    }

    /// What `seq`'s output learned of its edits to the prompt so far (none before it was fed).
    pub fn edits(&self, seq: SeqId) -> Option<&EditLearner> {
        self.index.get(&seq).map(|s| &s.learner)
    }

    /// The draft for a text seen for the first time (tests, one-off lookups; no edits learned).
    pub fn lookup(&self, tokens: &[TokenId], k: usize) -> Vec<TokenId> {
        let mut s = SeqIndex::new(tokens.len(), Tenant::default());
        s.text = tokens.to_vec();
        tokens.iter().for_each(|&t| s.plain.push(t));
        s.continuation(self.min_match, k)
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, reqs: &mut [DraftRequest], _pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let mut drafts = Vec::with_capacity(reqs.len());
        for r in reqs.iter_mut() {
            if r.max_draft == 0 {
                drafts.push(Draft::default());
                continue;
            }
            let (support, tokens) = match r.drafting.ngram_memo.take() {
                // the support lookup of this step, for this text, kept enough of the draft
                Some(m) if m.text_len == r.tokens.len() && (r.max_draft <= MEMO_DRAFT || m.draft.len() < MEMO_DRAFT) => {
                    (m.support, m.draft.into_iter().take(r.max_draft).collect())
                }
                _ => self.draft(r.seq, r.tokens, r.prompt_len, r.params.tenant, r.max_draft),
            };
            if support.from_corpus && !tokens.is_empty() {
                metrics::counter!("specula:spec_decode_corpus_drafts").increment(1);
            }
            drafts.push(Draft { tokens, probs: None });
        }
        Ok(drafts)
    }

    fn support(&mut self, seq: SeqId, tokens: &[TokenId], prompt_len: usize, tenant: Tenant, drafting: &mut SeqDrafting) -> Option<Support> {
        let (support, draft) = self.draft(seq, tokens, prompt_len, tenant, MEMO_DRAFT);
        drafting.ngram_memo = Some(Memo { text_len: tokens.len(), support, draft });
        Some(support)
    }

    fn remove(&mut self, seq: SeqId) {
        self.index.remove(&seq);
    }

    fn finished(&mut self, tenant: Tenant, output: &[TokenId]) {
        self.corpus.add(tenant, output);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The draft of up to `k` tokens for sequence `seq` (`tokens`, the first `prompt_len` its
    /// prompt), asked with no drafting state kept for it from an earlier step.
    fn draft_once(
        p: &mut NgramProposer,
        seq: u64,
        tokens: &[TokenId],
        prompt_len: usize,
        k: usize,
        params: &crate::api::SamplingParams,
        pool: &rayon::ThreadPool,
    ) -> Vec<TokenId> {
        let req = DraftRequest { seq: SeqId(seq), tokens, prompt_len, max_draft: k, params, hidden: None, rng: None, drafting: &mut SeqDrafting::default() };
        p.propose(&mut [req], pool).unwrap().remove(0).tokens
    }

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
        assert_eq!(p.support(SeqId(1), &text, 2, Tenant(0), &mut SeqDrafting::default()), Some(Support::own(3)));
        assert_eq!(draft_once(&mut p, 1, &text, 2, 8, &params, &pool), vec![4, 5, 7]);
        // one more token: "6" never occurred before, nothing matches
        let longer: Vec<TokenId> = [&text[..], &[6]].concat();
        assert_eq!(p.support(SeqId(1), &longer, 2, Tenant(0), &mut SeqDrafting::default()), Some(Support::own(0)));
        assert_eq!(NgramProposer::new(1).support(SeqId(1), &[5, 6, 7, 6], 4, Tenant(0), &mut SeqDrafting::default()), Some(Support::own(1)));
        assert_eq!(NgramProposer::new(1).support(SeqId(1), &[1, 2, 3], 3, Tenant(0), &mut SeqDrafting::default()), Some(Support::own(0)));
    }

    #[test]
    fn the_draft_after_a_support_lookup_is_the_one_a_fresh_lookup_gives() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let params = crate::api::SamplingParams::greedy(8);
        // a 90-token pattern twice then its start again: a long match with a long continuation
        let pattern: Vec<TokenId> = (0..90).map(|i| 100 + (i * 7) % 53).collect();
        let mut text: Vec<TokenId> = pattern.iter().chain(&pattern).copied().collect();
        text.extend(&pattern[..20]);
        let fresh = |text: &[TokenId], k: usize| draft_once(&mut NgramProposer::new(2), 1, text, 2, k, &params, &pool);
        for k in [1, 5, MEMO_DRAFT, MEMO_DRAFT + 30] {
            let (mut p, mut drafting) = (NgramProposer::new(2), SeqDrafting::default());
            assert!(p.support(SeqId(1), &text, 2, Tenant(0), &mut drafting).is_some_and(|s| s.len > MEMO_DRAFT));
            assert!(drafting.ngram_memo.is_some(), "the lookup is kept in the sequence's state");
            let req =
                DraftRequest { seq: SeqId(1), tokens: &text, prompt_len: 2, max_draft: k, params: &params, hidden: None, rng: None, drafting: &mut drafting };
            let got = p.propose(&mut [req], &pool).unwrap().remove(0).tokens;
            assert_eq!(got.len(), k, "a draft longer than the kept one is looked up again");
            assert_eq!(got, fresh(&text, k));
            assert!(drafting.ngram_memo.is_none(), "a draft uses its lookup once");
        }
        // a text that moved on since the support lookup is looked up afresh
        let (mut p, mut drafting) = (NgramProposer::new(2), SeqDrafting::default());
        p.support(SeqId(1), &text, 2, Tenant(0), &mut drafting);
        text.push(pattern[20]);
        let req = DraftRequest { seq: SeqId(1), tokens: &text, prompt_len: 2, max_draft: 8, params: &params, hidden: None, rng: None, drafting: &mut drafting };
        assert_eq!(p.propose(&mut [req], &pool).unwrap().remove(0).tokens, fresh(&text, 8));
        assert_eq!(fresh(&text, 8)[0], pattern[21]);
    }

    #[test]
    fn after_an_edit_repeats_the_draft_copies_the_edited_prompt() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let params = crate::api::SamplingParams::greedy(8);
        // a prompt with three uses of token 50; the output copies it with 50 renamed to 60
        let prompt: Vec<TokenId> = vec![1, 2, 50, 3, 4, 5, 6, 2, 50, 3, 7, 8, 9, 10, 2, 50, 3, 11, 12];
        let output: Vec<TokenId> = prompt.iter().map(|&t| if t == 50 { 60 } else { t }).collect();
        let mut p = NgramProposer::new(1);
        let mut drafts = Vec::new();
        for end in 0..output.len() {
            let text = [&prompt[..], &output[..end]].concat();
            drafts.push(draft_once(&mut p, 3, &text, prompt.len(), 1, &params, &pool));
        }
        // the rename is learned once the output copies the prompt again after the second use
        // (positions 7..10); the third use (output position 15) is drafted renamed, the plain
        // lookup drafts the prompt's 50 there
        assert_eq!(drafts[15], vec![60]);
        assert_eq!(NgramProposer::new(1).lookup(&[&prompt[..], &output[..15]].concat(), 1), vec![50]);
        assert_eq!(p.index[&SeqId(3)].learner.edits(), &[super::super::edits::Edit { from: vec![50], to: vec![60] }]);
    }

    #[test]
    fn an_earlier_output_of_the_same_tenant_drafts_where_it_matches_longer() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let (a, b) = (
            crate::api::SamplingParams { tenant: Tenant(1), ..crate::api::SamplingParams::greedy(8) },
            crate::api::SamplingParams { tenant: Tenant(2), ..crate::api::SamplingParams::greedy(8) },
        );
        let mut p = NgramProposer::with_corpus(1, 1000);
        // an earlier request of tenant 1 wrote this
        p.finished(Tenant(1), &[40, 41, 42, 43, 44, 45, 46, 47]);
        // a new sequence whose prompt has nothing to copy writes "41 42 43"
        let text: Vec<TokenId> = vec![1, 2, 3, 41, 42, 43];
        let draft = |p: &mut NgramProposer, params: &crate::api::SamplingParams| draft_once(p, 9, &text, 3, 4, params, &pool);
        assert_eq!(p.support(SeqId(9), &text, 3, Tenant(1), &mut SeqDrafting::default()), Some(Support { len: 3, from_corpus: true }));
        assert_eq!(draft(&mut p, &a), vec![44, 45, 46, 47]);
        // another tenant never sees it
        assert_eq!(p.support(SeqId(9), &text, 3, Tenant(2), &mut SeqDrafting::default()), Some(Support::own(0)));
        assert_eq!(draft(&mut p, &b), Vec::<TokenId>::new());
        // a match in the sequence's own text as long as the corpus's wins
        let own: Vec<TokenId> = vec![41, 42, 43, 7, 1, 2, 3, 41, 42, 43];
        assert_eq!(draft_once(&mut p, 10, &own, 3, 4, &a, &pool), vec![7, 1, 2]);
        // under the corpus's minimum match, nothing from it
        let short: Vec<TokenId> = vec![1, 2, 3, 42, 43];
        assert_eq!(p.support(SeqId(11), &short, 3, Tenant(1), &mut SeqDrafting::default()), Some(Support::own(0)));
    }

    #[test]
    fn another_running_sequence_of_the_same_tenant_drafts_where_it_matches_longer() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let params = |t: u32| crate::api::SamplingParams { tenant: Tenant(t), ..crate::api::SamplingParams::greedy(8) };
        let (a, b) = (params(1), params(2));
        let mut p = NgramProposer::new(1);
        // a running sequence of tenant 1 whose prompt holds a file
        let file: Vec<TokenId> = vec![1, 2, 40, 41, 42, 43, 44, 45, 46, 47];
        draft_once(&mut p, 1, &file, file.len(), 4, &a, &pool);
        // another sequence, with nothing to copy in its own text, writes "41 42 43"
        let text: Vec<TokenId> = vec![7, 8, 9, 41, 42, 43];
        let draft = |p: &mut NgramProposer, params: &crate::api::SamplingParams| draft_once(p, 2, &text, 3, 3, params, &pool);
        assert_eq!(p.support(SeqId(2), &text, 3, Tenant(1), &mut SeqDrafting::default()), Some(Support { len: 3, from_corpus: true }));
        assert_eq!(draft(&mut p, &a), vec![44, 45, 46]);
        // never across tenants
        assert_eq!(p.support(SeqId(2), &text, 3, Tenant(2), &mut SeqDrafting::default()), Some(Support::own(0)));
        assert_eq!(draft(&mut p, &b), Vec::<TokenId>::new());
        // a longer finished output wins over the running text; an as long one does not
        p.corpus = Corpus::new(1000);
        p.finished(Tenant(1), &[9, 41, 42, 43, 90, 91]);
        assert_eq!(draft(&mut p, &a), vec![90, 91]);
        p.corpus = Corpus::new(1000);
        p.finished(Tenant(1), &[5, 41, 42, 43, 90, 91]);
        assert_eq!(draft(&mut p, &a), vec![44, 45, 46]);
        // once the first sequence is gone, its text drafts nothing
        p.corpus = Corpus::new(0);
        p.remove(SeqId(1));
        assert_eq!(draft(&mut p, &a), Vec::<TokenId>::new());
    }

    #[test]
    fn a_lookup_reads_the_newest_running_sequences_only() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let params = crate::api::SamplingParams::greedy(8);
        let mut p = NgramProposer::new(1);
        // the oldest running sequence holds "41 42 43 44"; LIVE_PEERS newer ones hold nothing of it
        let holder: Vec<TokenId> = vec![40, 41, 42, 43, 44, 45];
        let feed = |p: &mut NgramProposer, seq: u64, text: &[TokenId]| {
            draft_once(p, seq, text, text.len(), 2, &params, &pool);
        };
        feed(&mut p, 1, &holder);
        let text: Vec<TokenId> = vec![7, 8, 9, 41, 42, 43];
        assert_eq!(p.support(SeqId(100), &text, 3, Tenant(0), &mut SeqDrafting::default()), Some(Support { len: 3, from_corpus: true }));
        for seq in 2..2 + LIVE_PEERS as u64 {
            feed(&mut p, seq, &[seq as TokenId + 1000, 1, 2, 3]);
        }
        assert_eq!(p.support(SeqId(100), &text, 3, Tenant(0), &mut SeqDrafting::default()), Some(Support::own(0)));
        p.remove(SeqId(2));
        assert_eq!(p.support(SeqId(100), &text, 3, Tenant(0), &mut SeqDrafting::default()), Some(Support { len: 3, from_corpus: true }));
    }

    #[test]
    fn the_per_sequence_index_is_fed_incrementally_and_matches_a_fresh_one() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let params = crate::api::SamplingParams::greedy(8);
        let mut p = NgramProposer::new(2);
        let text: Vec<TokenId> = [10, 11, 12, 13, 14, 10, 11, 12, 20, 10, 11, 12, 13].to_vec();
        for end in 3..=text.len() {
            assert_eq!(draft_once(&mut p, 7, &text[..end], 3, 4, &params, &pool), NgramProposer::new(2).lookup(&text[..end], 4), "at {end}");
        }
        p.remove(SeqId(7));
        assert!(p.index.is_empty());
    }
}
