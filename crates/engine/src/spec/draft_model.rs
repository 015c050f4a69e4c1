//! Draft-model proposer: a smaller model with the same vocabulary, its own paged KV cache, run
//! autoregressively for k steps over all speculating sequences in one batch per step. Its KV is
//! rolled back to what the target accepted, so it never recomputes accepted tokens.

use super::proposer::{Draft, DraftRequest, Proposer};
use super::SpecError;
use crate::kv_cache::KvCacheManager;
use crate::sampling::{probabilities, sample_from_probs, SeqRng, TokenHistory};
use crate::types::{SeqId, TokenId};
use specula_kernels::attention::KvLayout;
use specula_model::{ForwardBatch, KvStore, LlamaModel, SeqSpan};
use std::collections::HashMap;

pub struct DraftModelProposer {
    model: LlamaModel,
    kv_store: KvStore,
    kv: KvCacheManager,
    /// Per sequence: tokens whose draft KV is computed, and the draft's own random stream.
    state: HashMap<SeqId, (usize, SeqRng)>,
}

impl DraftModelProposer {
    pub fn new(model: LlamaModel, target_vocab: usize, num_blocks: usize, block_size: usize) -> Result<Self, SpecError> {
        if model.config.vocab_size != target_vocab {
            return Err(SpecError::Config(format!(
                "the draft model's vocabulary has {} tokens but the target's has {target_vocab}; a draft model must share the target's tokenizer",
                model.config.vocab_size
            )));
        }
        let c = &model.config;
        let layout = KvLayout { block_size, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
        let kv_store = KvStore::new(c.n_layers, layout, num_blocks);
        let kv = KvCacheManager::new(num_blocks, block_size, false)?;
        Ok(Self { model, kv_store, kv, state: HashMap::new() })
    }

    fn run(&mut self, items: &[(SeqId, Vec<TokenId>, usize)], pool: &rayon::ThreadPool) -> Result<Vec<f32>, SpecError> {
        // items: (seq, tokens to feed, start position)
        let mut tokens = Vec::new();
        let mut slots = Vec::new();
        let mut tables = Vec::new();
        let mut spans = Vec::new();
        let mut rows = Vec::new();
        for (seq, feed, start) in items {
            self.kv.ensure_capacity(*seq, start + feed.len())?;
            let q_start = tokens.len();
            tokens.extend_from_slice(feed);
            self.kv.extend_slot_mapping(*seq, *start, feed.len(), &mut slots)?;
            tables.push(self.kv.block_table(*seq)?.iter().map(|b| b.0).collect::<Vec<u32>>());
            spans.push((q_start, feed.len(), start + feed.len()));
            rows.push(q_start + feed.len() - 1);
        }
        let seqs: Vec<SeqSpan> =
            spans.iter().zip(&tables).map(|(&(q_start, q_len, context_len), t)| SeqSpan { q_start, q_len, context_len, block_table: t }).collect();
        let model = &self.model;
        let kv_store = &mut self.kv_store;
        let out =
            pool.install(|| model.forward(&ForwardBatch { tokens: &tokens, seqs: &seqs, slots: &slots, logits_rows: &rows, hidden_layers: &[] }, kv_store))?;
        Ok(out.logits)
    }
}

impl Proposer for DraftModelProposer {
    fn cost_per_draft_token(&self, target: &specula_model::ModelConfig) -> f64 {
        super::adaptive::matmul_cost(&self.model.config) / super::adaptive::matmul_cost(target)
    }

    fn propose(&mut self, reqs: &[DraftRequest], pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let vocab = self.model.config.vocab_size;
        let mut drafts: Vec<Draft> = reqs.iter().map(|_| Draft { tokens: vec![], probs: Some(vec![]) }).collect();
        // which requests take part, with what they feed first
        let mut active: Vec<usize> = Vec::new();
        let mut items = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            if r.max_draft == 0 {
                continue;
            }
            if !self.state.contains_key(&r.seq) {
                self.kv.allocate_prompt(r.seq, &[])?;
                self.state.insert(r.seq, (0, SeqRng::new(r.params.seed, 1)));
            }
            let computed = self.state[&r.seq].0.min(r.tokens.len() - 1);
            if self.kv.ensure_capacity(r.seq, r.tokens.len() + r.max_draft).is_err() {
                continue; // draft cache full: no proposal for this sequence this step
            }
            active.push(i);
            items.push((r.seq, r.tokens[computed..].to_vec(), computed));
        }
        let max_k = active.iter().map(|&i| reqs[i].max_draft).max().unwrap_or(0);
        let mut p = Vec::with_capacity(vocab);
        for step in 0..max_k {
            if items.is_empty() {
                break;
            }
            let logits = self.run(&items, pool)?;
            let mut next_items = Vec::new();
            let mut next_active = Vec::new();
            for (j, ((seq, feed, start), &i)) in items.iter().zip(&active).enumerate() {
                let r = &reqs[i];
                let row = &logits[j * vocab..(j + 1) * vocab];
                let mut output: Vec<TokenId> = r.tokens[r.prompt_len..].to_vec();
                output.extend_from_slice(&drafts[i].tokens);
                probabilities(row, r.params, TokenHistory { prompt: &r.tokens[..r.prompt_len], output: &output }, &mut p)?;
                let st = self.state.get_mut(seq).expect("state created above");
                let tok = sample_from_probs(&p, st.1.uniform()).unwrap_or(0);
                st.0 = start + feed.len();
                drafts[i].tokens.push(tok);
                if let Some(q) = drafts[i].probs.as_mut() {
                    q.push(p.clone());
                }
                if step + 1 < r.max_draft {
                    next_items.push((*seq, vec![tok], start + feed.len()));
                    next_active.push(i);
                }
            }
            items = next_items;
            active = next_active;
        }
        Ok(drafts)
    }

    fn rollback(&mut self, seq: SeqId, kept: usize) {
        if let Some(st) = self.state.get_mut(&seq) {
            if st.0 > kept {
                st.0 = kept;
            }
            let keep = st.0;
            match self.kv.truncate(seq, keep) {
                Ok(k) => st.0 = k,
                Err(_) => st.0 = 0,
            }
        }
    }

    fn remove(&mut self, seq: SeqId) {
        self.state.remove(&seq);
        let _ = self.kv.free(seq);
    }

    fn kv_blocks(&self) -> Option<(usize, usize)> {
        Some((self.kv.num_free_blocks(), self.kv.num_total_blocks()))
    }
}
