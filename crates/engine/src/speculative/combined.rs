//! Two proposers at once (`--speculative-method ngram,draft` or `ngram,mtp`): the n-gram
//! proposer's free drafts where the sequence's text matches far back, the model's (a draft model
//! or an mtp head) elsewhere, chosen per sequence and step.
//!
//! The choice is made by adaptive k ([`super::Speculation::plan_drafts`]), which holds the
//! acceptance estimates: the n-gram match's band ([`super::Support::band`]) against the
//! sequence's estimate for the model's drafts; the n-gram draft wins ties (it costs no model
//! call). This proposer reports the n-gram's support, reads the choice in the sequence's state
//! ([`super::SeqDrafting::ngram_next`]) and routes each request: the model runs only for the sequences
//! that chose it (the others are passed to it with no draft asked, so a head that keeps
//! per-sequence state still sees every row), the n-gram proposer drafts the rest. Without adaptive
//! k there is no choice: the model drafts for every sequence.
//!
//! The edits the n-gram proposer learns from each output ([`super::edits`]) also rewrite the
//! model's drafts: a draft model that copies the prompt where the n-gram has no long match (right
//! after an edited span, say) drafts the prompt's old spans, which the output has been writing
//! differently. A one-hot draft is rewritten where a learned edit's old span stands in it (a
//! sampled draft that carries its distributions is left as drawn: the rejection sampler needs
//! the token it drew), and the model's state past the first rewritten token is rolled back.

use super::ngram::NgramProposer;
use super::proposer::{Draft, DraftRequest, Proposer, SeqDrafting, Support};
use super::SpecError;
use crate::types::{SeqId, Tenant, TokenId};

pub struct CombinedProposer {
    ngram: NgramProposer,
    model: Box<dyn Proposer>,
}

impl CombinedProposer {
    pub fn new(ngram: NgramProposer, model: Box<dyn Proposer>) -> Self {
        Self { ngram, model }
    }
}

impl Proposer for CombinedProposer {
    fn propose(&mut self, reqs: &mut [DraftRequest], pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let takes_ngram: Vec<bool> = reqs.iter().map(|r| r.max_draft > 0 && r.drafting.ngram_next).collect();
        let mut for_ngram: Vec<DraftRequest> = reqs.iter_mut().zip(&takes_ngram).filter(|(_, &t)| t).map(|(r, _)| r.reborrow()).collect();
        let mut from_ngram = self.ngram.propose(&mut for_ngram, pool)?.into_iter();
        drop(for_ngram);
        // the model sees every request, with no draft asked where the n-gram drafts
        let mut for_model: Vec<DraftRequest> =
            reqs.iter_mut().zip(&takes_ngram).map(|(r, &t)| DraftRequest { max_draft: if t { 0 } else { r.max_draft }, ..r.reborrow() }).collect();
        let mut from_model = self.model.propose(&mut for_model, pool)?;
        drop(for_model);
        for ((r, d), &t) in reqs.iter().zip(from_model.iter_mut()).zip(&takes_ngram) {
            if t {
                *d = from_ngram.next().unwrap_or_default();
                continue;
            }
            if d.probs.is_some() {
                continue;
            }
            if let Some((first, tokens)) = self.ngram.edits(r.seq).and_then(|l| l.rewrite(&d.tokens, r.max_draft)) {
                // the model's state holds the tokens it drafted; those from `first` on are not
                self.model.rollback(r.seq, r.tokens.len() + first);
                d.tokens = tokens;
                metrics::counter!("specula:spec_decode_edited_model_drafts").increment(1);
            }
        }
        Ok(from_model)
    }

    fn rollback(&mut self, seq: SeqId, kept: usize) {
        self.model.rollback(seq, kept);
    }

    fn remove(&mut self, seq: SeqId) {
        self.ngram.remove(seq);
        self.model.remove(seq);
    }

    fn backlog(&self, seq: SeqId, known: usize) -> usize {
        self.model.backlog(seq, known)
    }

    fn support(&mut self, seq: SeqId, tokens: &[TokenId], prompt_len: usize, tenant: Tenant, drafting: &mut SeqDrafting) -> Option<Support> {
        self.ngram.support(seq, tokens, prompt_len, tenant, drafting)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::SamplingParams;
    use std::sync::{Arc, Mutex};

    /// A model that drafts the same tokens every time and records its rollbacks.
    struct Fixed {
        draft: Vec<TokenId>,
        probs: bool,
        rollbacks: Arc<Mutex<Vec<(SeqId, usize)>>>,
    }

    impl Proposer for Fixed {
        fn propose(&mut self, reqs: &mut [DraftRequest], _pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
            Ok(reqs
                .iter()
                .map(|r| {
                    let tokens: Vec<TokenId> = self.draft.iter().take(r.max_draft).copied().collect();
                    Draft { probs: self.probs.then(|| vec![vec![0.0; 4]; tokens.len()]), tokens }
                })
                .collect())
        }

        fn rollback(&mut self, seq: SeqId, kept: usize) {
            self.rollbacks.lock().unwrap().push((seq, kept));
        }
    }

    /// The output renamed the prompt's token 50 to 60 once; a model draft that copies the next
    /// use of 50 gets 60, and the model is rolled back to before it.
    #[test]
    fn a_learned_edit_rewrites_the_model_draft_that_copies_the_old_span() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let prompt: Vec<TokenId> = vec![10, 11, 12, 13, 50, 20, 21, 22, 23, 30, 31, 32, 33, 50, 40, 41, 42, 43];
        let output: Vec<TokenId> = vec![10, 11, 12, 13, 60, 20, 21, 22, 23];
        let copied = vec![30, 31, 32, 33, 50, 40];
        for (probs, expect) in [(false, vec![30, 31, 32, 33, 60, 40]), (true, copied.clone())] {
            let rollbacks = Arc::new(Mutex::new(Vec::new()));
            let model = Fixed { draft: copied.clone(), probs, rollbacks: rollbacks.clone() };
            let mut p = CombinedProposer::new(NgramProposer::new(1), Box::new(model));
            let (seq, params) = (SeqId(7), SamplingParams::greedy(64));
            // the engine asks for the support of every sequence at every step: the n-gram learns
            let mut tokens = prompt.clone();
            let mut drafting = SeqDrafting::default();
            for &t in &output {
                tokens.push(t);
                p.support(seq, &tokens, prompt.len(), Tenant::default(), &mut drafting);
            }
            assert_eq!(p.ngram.edits(seq).unwrap().edits(), &[crate::speculative::edits::Edit { from: vec![50], to: vec![60] }]);
            // adaptive k chose the model
            drafting.ngram_next = false;
            let req = DraftRequest {
                seq,
                tokens: &tokens,
                prompt_len: prompt.len(),
                max_draft: 6,
                params: &params,
                hidden: None,
                rng: None,
                drafting: &mut drafting,
            };
            let draft = p.propose(&mut [req], &pool).unwrap().remove(0);
            assert_eq!(draft.tokens, expect, "probs carried: {probs}");
            let rolled = rollbacks.lock().unwrap().clone();
            assert_eq!(rolled, if probs { vec![] } else { vec![(seq, tokens.len() + 4)] });
        }
    }
}
