//! The edits an output makes to the prompt it copies, learned while it is written, so the n-gram
//! proposer drafts the edited text instead of the original one.
//!
//! A code edit ("rename `values` to `data`", "`Vec` becomes `VecDeque`") copies the prompt's file
//! with a few spans changed, most of them many times. Plain prompt lookup breaks at every changed
//! span twice: it drafts the old span (rejected), and after the new one its match is a token or
//! two long and points anywhere (after `len(data` it continues the first `data`, `):`, not the
//! prompt's `len(values` with `)`). Here the proposer watches where the output copies the prompt:
//! when the output leaves the prompt at one point and copies it again from a later one, the gap
//! is an edit, `from` (the prompt's span) -> `to` (the output's). The proposer then also indexes the
//! prompt with every learned edit applied and drafts from whichever text matches the output's
//! suffix longer, so an edit that is repeated is drafted right from its second occurrence on, and
//! a wrong one costs nothing beyond its index (the original text then matches longer).
//!
//! Not for edits that do not repeat (a new method, a comment): those are new text either way.

use crate::types::TokenId;

/// A match at least this long says the output is copying the prompt there (shorter ones happen
/// anywhere: `(`, `self`).
pub const SYNC_LEN: usize = 4;
/// Longest span an edit replaces or writes (longer gaps are new text, not an edit).
pub const MAX_SPAN: usize = 8;
/// Edits kept per sequence (past it, no more are learned).
pub const MAX_EDITS: usize = 32;

/// One learned edit: the prompt's tokens `from` were written as `to` (never equal; `from` is never
/// empty: an insertion keeps the token before it on both sides).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edit {
    pub from: Vec<TokenId>,
    pub to: Vec<TokenId>,
}

/// Per sequence: the edits learned so far and where the output last copied the prompt.
#[derive(Clone, Debug, Default)]
pub struct EditLearner {
    edits: Vec<Edit>,
    /// (text position, source position) of the last token of the latest step that ended copying the
    /// source: the output's token at `.0` was the source's at `.1`.
    anchor: Option<(usize, usize)>,
}

impl EditLearner {
    pub fn edits(&self) -> &[Edit] {
        &self.edits
    }

    /// After a step, with `text(i)` the `n` tokens of the source-side text (the source's
    /// `source_len` tokens, then the output) and `m` the longest earlier match of its suffix
    /// (length, end of its first occurrence): learns the edit that separates this copy of the
    /// source from the previous one, if the gap between them is one. Returns whether an edit was
    /// learned; the caller then applies the edits afresh (new positions) and calls again, which
    /// only re-anchors.
    pub fn observe(&mut self, text: impl Fn(usize) -> TokenId, n: usize, source_len: usize, m: Option<(usize, usize)>) -> bool {
        let Some((len, end)) = m.filter(|&(len, end)| len >= SYNC_LEN && end < source_len) else { return false };
        // where this copy starts, in the output and in the source
        let (t_start, s_start) = (n - len, end + 1 - len);
        let learned = match self.anchor {
            // (a gap longer than an edit is not even read)
            Some((ta, sa)) if ta < t_start && sa < s_start && t_start - ta <= MAX_SPAN + 1 && s_start - sa <= MAX_SPAN + 1 && self.edits.len() < MAX_EDITS => {
                let to: Vec<TokenId> = (ta + 1..t_start).map(&text).collect();
                let from: Vec<TokenId> = (sa + 1..s_start).map(&text).collect();
                edit_between(&from, &to, sa + 1, &text).filter(|e| !self.edits.contains(e))
            }
            _ => None,
        };
        match learned {
            Some(e) => {
                tracing::debug!(from = ?e.from, to = ?e.to, "n-gram: learned an edit of the prompt");
                self.edits.push(e);
                self.anchor = None;
                true
            }
            None => {
                self.anchor = Some((n - 1, end));
                false
            }
        }
    }

    /// `source` with every edit applied, in the order they were learned (each to the result of
    /// the ones before, as each was learned against that text), left to right, never overlapping.
    pub fn apply(&self, source: &[TokenId]) -> Vec<TokenId> {
        self.edits.iter().fold(source.to_vec(), |text, e| replace(&text, e, false))
    }

    /// A model's `draft` (continuing the output) with the learned edits applied where an edit's
    /// `from` stands whole in it and its `to` does not already (a draft model that copies the
    /// prompt drafts its old spans; one that read the edit in the context writes the new ones,
    /// and an insertion must not be inserted twice), cut to `max` tokens, with the index of its
    /// first changed token; None when nothing changes. Each edit once over the draft, in the order
    /// they were learned, as [`EditLearner::apply`] applies them to the prompt.
    pub fn rewrite(&self, draft: &[TokenId], max: usize) -> Option<(usize, Vec<TokenId>)> {
        let draft = &draft[..draft.len().min(max)];
        let mut text = self.edits.iter().fold(draft.to_vec(), |text, e| replace(&text, e, true));
        text.truncate(max);
        let first = text.iter().zip(draft).position(|(a, b)| a != b).or((text.len() != draft.len()).then(|| text.len().min(draft.len())))?;
        Some((first, text))
    }
}

/// `text` with every occurrence of `e.from` replaced by `e.to`, left to right, never overlapping;
/// with `unless_written`, not where `e.to` already stands (as far as the text goes). An edit
/// with nothing to replace (never learned: `edit_between` keeps a token on both sides of an
/// insertion) leaves the text as it is.
fn replace(text: &[TokenId], e: &Edit, unless_written: bool) -> Vec<TokenId> {
    if e.from.is_empty() {
        return text.to_vec();
    }
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        if rest.starts_with(&e.from) && !(unless_written && rest.iter().zip(&e.to).all(|(a, b)| a == b)) {
            out.extend_from_slice(&e.to);
            i += e.from.len();
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}

/// The edit that turned the source's `from` (starting at source position `from_at`) into the
/// output's `to`, trimmed to what differs (a shared head or tail is copy, not edit); an insertion
/// keeps the source token before it on both sides, so that it applies where that token is. None
/// when the gap is not an edit: nothing written (`observe` reads no gap of more than `MAX_SPAN`
/// tokens a side).
fn edit_between(from: &[TokenId], to: &[TokenId], from_at: usize, text: &impl Fn(usize) -> TokenId) -> Option<Edit> {
    debug_assert!(from.len() <= MAX_SPAN && to.len() <= MAX_SPAN);
    if to.is_empty() || from == to {
        return None;
    }
    let head = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    let (from, to) = (&from[head..], &to[head..]);
    let tail = from.iter().rev().zip(to.iter().rev()).take_while(|(a, b)| a == b).count();
    let (from, to) = (&from[..from.len() - tail], &to[..to.len() - tail]);
    if to.is_empty() {
        return None; // a deletion: not learned (a rule that deletes everywhere is a large bet)
    }
    if from.is_empty() {
        // an insertion after the source token at from_at + head - 1 (the anchor's at the least)
        let before = text(from_at + head - 1);
        return Some(Edit { from: vec![before], to: [&[before][..], to].concat() });
    }
    Some(Edit { from: from.to_vec(), to: to.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `source ++ output` one token at a time as the proposer does per step, with the
    /// longest match by brute force over the source-side text (the edits applied to the source).
    fn learn(source: &[TokenId], output: &[TokenId]) -> EditLearner {
        let mut l = EditLearner::default();
        for end in 1..=output.len() {
            loop {
                let text: Vec<TokenId> = [&l.apply(source)[..], &output[..end]].concat();
                let m = brute(&text);
                let src_len = text.len() - end;
                if !l.observe(|i| text[i], text.len(), src_len, m) {
                    break;
                }
            }
        }
        l
    }

    fn brute(t: &[TokenId]) -> Option<(usize, usize)> {
        let n = t.len();
        (1..n).rev().find_map(|len| {
            let suf = &t[n - len..];
            (0..n - len).find(|&i| &t[i..i + len] == suf).map(|start| (len, start + len - 1))
        })
    }

    #[test]
    fn a_renamed_token_is_learned_as_a_substitution() {
        // source: "f ( 50 ) + g ( 50 ) ;"  output renames 50 -> 60 in both places
        let source = [1, 2, 50, 3, 4, 5, 2, 50, 3, 6, 7, 8, 9];
        let output = [1, 2, 60, 3, 4, 5, 2, 60, 3, 6, 7, 8, 9];
        let l = learn(&source, &output);
        assert_eq!(l.edits(), &[Edit { from: vec![50], to: vec![60] }]);
        assert_eq!(l.apply(&source), output);
    }

    #[test]
    fn an_insertion_keeps_the_token_before_it() {
        // "total ( self )" -> "total _quantity ( self )"
        let source = [10, 11, 12, 20, 30, 31, 32, 40, 41, 42, 43];
        let output = [10, 11, 12, 20, 21, 30, 31, 32, 40, 41, 42, 43];
        let l = learn(&source, &output);
        assert_eq!(l.edits(), &[Edit { from: vec![20], to: vec![20, 21] }]);
        assert_eq!(l.apply(&source), output);
    }

    #[test]
    fn new_text_and_deletions_are_not_edits() {
        // a long insertion (new text) and a deletion of two tokens
        let source: Vec<TokenId> = (1..=16).collect();
        let mut output = vec![1, 2, 3, 4];
        output.extend(100..100 + MAX_SPAN as u32 + 1);
        output.extend([5, 6, 7, 8, 11, 12, 13, 14, 15, 16]);
        let l = learn(&source, &output);
        assert!(l.edits().is_empty(), "{:?}", l.edits());
    }

    #[test]
    fn a_model_draft_gets_the_edits_it_copies_unedited_and_keeps_those_it_wrote() {
        let l = EditLearner {
            edits: vec![Edit { from: vec![50], to: vec![60] }, Edit { from: vec![20], to: vec![20, 21] }, Edit { from: vec![7, 8], to: vec![9] }],
            anchor: None,
        };
        // the old name, an insertion not made, a two-token span: rewritten from index 1
        assert_eq!(l.rewrite(&[1, 50, 3, 20, 30, 7, 8, 4], 16), Some((1, vec![1, 60, 3, 20, 21, 30, 9, 4])));
        // already edited (the new name, the insertion made): nothing to change
        assert_eq!(l.rewrite(&[1, 60, 3, 20, 21, 30], 16), None);
        // an insertion whose `to` is cut by the draft's end may already be written: left alone
        assert_eq!(l.rewrite(&[1, 2, 20], 16), None);
        // a span cut by the draft's end is not there whole
        assert_eq!(l.rewrite(&[1, 2, 7], 16), None);
        // longer than asked: cut, the change still reported
        assert_eq!(l.rewrite(&[2, 20, 30], 3), Some((2, vec![2, 20, 21])));
        assert_eq!(l.rewrite(&[2, 3, 20, 30], 3), None, "the insertion's `to` falls past the cut");
        assert_eq!(EditLearner::default().rewrite(&[1, 50], 4), None);
    }

    #[test]
    fn edits_apply_in_the_order_they_were_learned() {
        let l = EditLearner { edits: vec![Edit { from: vec![1], to: vec![2, 2] }, Edit { from: vec![2, 2], to: vec![3] }], anchor: None };
        assert_eq!(l.apply(&[1, 0, 2, 2, 1]), vec![3, 0, 3, 3]);
    }
}
