//! Two proposers at once (`--speculative-method ngram,draft` or `ngram,mtp`): the n-gram
//! proposer's free drafts where the sequence's text matches far back, the model's (a draft model
//! or an mtp head) elsewhere, chosen per sequence and step.
//!
//! The choice is made by adaptive k ([`super::Speculation::plan_drafts`]), which holds the
//! acceptance estimates: the n-gram match's band ([`super::Support::band`]) against the
//! sequence's estimate for the model's drafts; the n-gram draft wins ties (it costs no model
//! call). This proposer reports the n-gram's support, is told the choice
//! ([`Proposer::choose_ngram`]) and routes each request: the model runs only for the sequences
//! that chose it (the others are passed to it with no draft asked, so a head that keeps
//! per-sequence state still sees every row), the n-gram proposer drafts the rest. Without adaptive
//! k there is no choice: the model drafts for every sequence.

use super::ngram::NgramProposer;
use super::proposer::{Draft, DraftRequest, Proposer, Support};
use super::SpecError;
use crate::types::{SeqId, Tenant, TokenId};
use std::collections::HashSet;

pub struct CombinedProposer {
    ngram: NgramProposer,
    model: Box<dyn Proposer>,
    /// The sequences whose next draft is the n-gram's.
    ngram_seqs: HashSet<SeqId>,
}

impl CombinedProposer {
    pub fn new(ngram: NgramProposer, model: Box<dyn Proposer>) -> Self {
        Self { ngram, model, ngram_seqs: HashSet::new() }
    }
}

impl Proposer for CombinedProposer {
    fn propose(&mut self, reqs: &[DraftRequest], pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let takes_ngram = |r: &DraftRequest| r.max_draft > 0 && self.ngram_seqs.contains(&r.seq);
        // the model sees every request, with no draft asked where the n-gram drafts
        let for_model: Vec<DraftRequest> = reqs.iter().map(|r| DraftRequest { max_draft: if takes_ngram(r) { 0 } else { r.max_draft }, ..*r }).collect();
        let for_ngram: Vec<DraftRequest> = reqs.iter().filter(|r| takes_ngram(r)).copied().collect();
        let mut from_model = self.model.propose(&for_model, pool)?;
        let mut from_ngram = self.ngram.propose(&for_ngram, pool)?.into_iter();
        for (r, d) in reqs.iter().zip(from_model.iter_mut()) {
            if takes_ngram(r) {
                *d = from_ngram.next().unwrap_or_default();
            }
        }
        Ok(from_model)
    }

    fn rollback(&mut self, seq: SeqId, kept: usize) {
        self.model.rollback(seq, kept);
    }

    fn remove(&mut self, seq: SeqId) {
        self.ngram_seqs.remove(&seq);
        self.ngram.remove(seq);
        self.model.remove(seq);
    }

    fn backlog(&self, seq: SeqId, known: usize) -> usize {
        self.model.backlog(seq, known)
    }

    fn support(&mut self, seq: SeqId, tokens: &[TokenId], prompt_len: usize, tenant: Tenant) -> Option<Support> {
        self.ngram.support(seq, tokens, prompt_len, tenant)
    }

    fn choose_ngram(&mut self, seq: SeqId, ngram: bool) {
        if ngram {
            self.ngram_seqs.insert(seq);
        } else {
            self.ngram_seqs.remove(&seq);
        }
    }

    fn combined(&self) -> bool {
        true
    }

    fn finished(&mut self, tenant: Tenant, output: &[TokenId]) {
        self.ngram.finished(tenant, output);
    }

    fn hidden_layers(&self) -> &[usize] {
        self.model.hidden_layers()
    }

    fn cost_per_draft_token(&self, target: &specula_model::ModelConfig) -> f64 {
        self.model.cost_per_draft_token(target)
    }

    fn draft_step_seconds(&mut self, batches: &[usize], pool: &rayon::ThreadPool) -> Result<Option<Vec<(usize, f64)>>, SpecError> {
        self.model.draft_step_seconds(batches, pool)
    }

    fn kv_blocks(&self) -> Option<(usize, usize)> {
        self.model.kv_blocks()
    }
}
