//! One record per sequence on the compute side (vLLM v1's persistent batch): what sampling,
//! verification and drafting read of a sequence — its history, sampling settings, random stream,
//! constraint state, the drafts proposed for its next step and its speculation estimates — kept
//! across steps instead of copied into every step's job.
//!
//! A record is created from the host's sequence the first time a step schedules it (the step's
//! job carries it: [`crate::step::StepJob::admitted`]), updated in place by the jobs that sample
//! it (the emitted tokens appended, the random stream and grammar advanced, the next drafts kept),
//! and forgotten in one place when the host removes the sequence (`ComputeState::forget`, from
//! `Engine`'s sync after every host change). What a proposer keeps of the sequence between steps
//! is here too (`spec.drafting`, lent with its draft requests); what it keeps as a cache (a draft
//! model's KV blocks, the n-gram index other sequences read, an mtp head's context rows) is the
//! proposer's, keyed by the sequence's id and released there as well (`Proposer::remove`). A
//! step's item names the record and the rows it samples; the history a step reads grows by the
//! tokens it emits, never copied whole.
//!
//! The host keeps its own copy of the tokens (scheduling, the prefix cache, streaming) and of the
//! draft tokens (the next step's inputs); both sides append the same emitted tokens, and a job
//! checks the record's length against the step it runs (`SeqRecord::check`).

use crate::api::SamplingParams;
use crate::constraint::Grammar;
use crate::sampling::SeqRng;
use crate::speculative::SeqSpec;
use crate::types::{Draft, SeqId, TokenId};
use std::collections::BTreeMap;

/// A sequence as the compute side keeps it.
pub(crate) struct SeqRecord {
    /// Prompt followed by every emitted token.
    pub tokens: Vec<TokenId>,
    pub prompt_len: usize,
    pub params: SamplingParams,
    pub rng: SeqRng,
    /// Where the output stands in its constraint's language (structured outputs; `None`: free text).
    pub grammar: Option<Grammar>,
    /// The drafts (with their draft distributions) proposed for the next step; that step
    /// verifies a prefix of them (the host may schedule none).
    pub draft: Draft,
    /// Its acceptance estimates for adaptive k and what the proposer keeps of it.
    pub spec: SeqSpec,
}

/// Why a step's view of a sequence and its record disagree (an engine bug: the step fails).
#[derive(Clone, Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{0}: the step samples a sequence the compute side has no record of")]
    Missing(SeqId),
    #[error("{seq}: the step expects {expected} known tokens, its record holds {held}")]
    History { seq: SeqId, expected: usize, held: usize },
    #[error("{seq}: the step verifies {scheduled} drafts, its record holds {held}")]
    Drafts { seq: SeqId, scheduled: usize, held: usize },
}

impl SeqRecord {
    pub fn new(tokens: Vec<TokenId>, prompt_len: usize, params: SamplingParams, rng: SeqRng, grammar: Option<Grammar>) -> Self {
        Self { tokens, prompt_len, params, rng, grammar, draft: Draft::default(), spec: SeqSpec::default() }
    }

    /// Checks the record against a step that sees `known` tokens of the sequence and verifies
    /// `drafts` of its drafts, and keeps only those drafts (a step may verify fewer than were
    /// proposed: none when the host had no room for them).
    pub fn check(&mut self, seq: SeqId, known: usize, drafts: usize) -> Result<(), RecordError> {
        if self.tokens.len() != known {
            return Err(RecordError::History { seq, expected: known, held: self.tokens.len() });
        }
        if drafts > self.draft.tokens.len() {
            return Err(RecordError::Drafts { seq, scheduled: drafts, held: self.draft.tokens.len() });
        }
        self.draft.truncate(drafts);
        Ok(())
    }

    /// Tokens output so far.
    pub fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// Every live sequence's record, by id.
#[derive(Default)]
pub(crate) struct SeqRecords {
    records: BTreeMap<SeqId, SeqRecord>,
}

impl SeqRecords {
    /// Records a sequence new to the compute side (a record it already has is kept: the host
    /// hands each sequence over once).
    pub fn admit(&mut self, seq: SeqId, record: SeqRecord) {
        self.records.entry(seq).or_insert(record);
    }

    /// The records of `seqs` (distinct: a step samples a sequence once), in that order.
    pub fn get_many_mut(&mut self, seqs: &[SeqId]) -> Result<Vec<&mut SeqRecord>, RecordError> {
        let want: std::collections::BTreeSet<SeqId> = seqs.iter().copied().collect();
        let mut found: BTreeMap<SeqId, &mut SeqRecord> = self.records.iter_mut().filter(|(id, _)| want.contains(id)).map(|(id, r)| (*id, r)).collect();
        seqs.iter().map(|id| found.remove(id).ok_or(RecordError::Missing(*id))).collect()
    }

    /// Forgets a sequence the host removed.
    pub fn forget(&mut self, seq: SeqId) {
        self.records.remove(&seq);
    }

    /// Forgets every sequence (the host state was lost and rebuilt).
    pub fn clear(&mut self) {
        self.records.clear();
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tokens: Vec<TokenId>, draft: Vec<TokenId>) -> SeqRecord {
        let mut r = SeqRecord::new(tokens, 2, SamplingParams::greedy(8), SeqRng::new(Some(1), 0), None);
        let probs = Some(draft.iter().map(|&t| vec![t as f32]).collect());
        r.draft = Draft { tokens: draft, probs };
        r
    }

    /// A step sees the record's history and verifies a prefix of its drafts (their distributions
    /// cut with them); a step that sees another length, or more drafts than were proposed, is
    /// refused, naming the sequence.
    #[test]
    fn a_step_is_checked_against_the_record_and_keeps_a_prefix_of_its_drafts() {
        let mut r = record(vec![1, 2, 3], vec![7, 8, 9]);
        r.check(SeqId(4), 3, 2).unwrap();
        assert_eq!(r.draft.tokens, vec![7, 8]);
        assert_eq!(r.draft.probs.as_ref().map(|p| p.len()), Some(2));
        r.check(SeqId(4), 3, 0).unwrap();
        assert!(r.draft.tokens.is_empty() && r.draft.probs.as_ref().is_some_and(|p| p.is_empty()));

        let e = record(vec![1, 2, 3], vec![]).check(SeqId(4), 4, 0).unwrap_err();
        assert_eq!(e.to_string(), "seq4: the step expects 4 known tokens, its record holds 3");
        let e = record(vec![1, 2, 3], vec![7]).check(SeqId(4), 3, 2).unwrap_err();
        assert_eq!(e.to_string(), "seq4: the step verifies 2 drafts, its record holds 1");
    }

    /// A sequence is handed over once: a second admission keeps the record (its history and
    /// stream have moved on since); a forgotten or unknown sequence is missing.
    #[test]
    fn records_are_admitted_once_and_forgotten_in_one_place() {
        let mut rs = SeqRecords::default();
        rs.admit(SeqId(1), record(vec![1, 2], vec![]));
        rs.get_many_mut(&[SeqId(1)]).unwrap()[0].tokens.push(5);
        rs.admit(SeqId(1), record(vec![1, 2], vec![]));
        rs.admit(SeqId(2), record(vec![3], vec![]));
        // in the order asked for, not the ids'
        let both = rs.get_many_mut(&[SeqId(2), SeqId(1)]).unwrap();
        assert_eq!((both[0].tokens.clone(), both[1].tokens.clone()), (vec![3], vec![1, 2, 5]));
        assert_eq!(both[1].output_len(), 1);
        rs.forget(SeqId(1));
        rs.forget(SeqId(2));
        assert!(rs.is_empty());
        assert_eq!(
            rs.get_many_mut(&[SeqId(1)]).err().map(|e| e.to_string()).as_deref(),
            Some("seq1: the step samples a sequence the compute side has no record of")
        );
    }
}
