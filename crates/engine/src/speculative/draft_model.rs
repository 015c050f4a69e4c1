//! Draft-model proposer: a smaller model with the same vocabulary, its own paged KV cache, run
//! autoregressively for k steps over all speculating sequences in one batch per step. Its KV is
//! rolled back to what the target accepted, so it never recomputes accepted tokens.
//!
//! On a CPU a draft token costs the bytes the draft reads, and a small model's tied output
//! projection over a 150k vocabulary is a large part of them (Qwen2.5-0.5B: 136 MB of about 300).
//! With a draft vocabulary (`SpecConfig::draft_vocab`) the draft computes logits only for the
//! first `n` token ids (BPE and SentencePiece vocabularies are ordered by merge rank / score, so
//! these are the frequent ones) and the end-of-sequence tokens; it never proposes another token,
//! and the rejection sampler stays exact (those tokens have draft probability 0). Greedy requests
//! take the draft's argmax directly (no distribution is built or carried).
//!
//! A hybrid draft (recurrent layers, Qwen3.5's small models) cannot roll its state back over the
//! single rows it drafts with: its state is checkpointed where the chain starts (after the rows
//! that catch up with the sequence) and put back after the chain, so the next proposal feeds the
//! accepted tokens again from there (one batched span).

use super::proposer::{Draft, DraftRequest, Proposer};
use super::vocab_map::VocabMap;
use super::SpecError;
use crate::kv_cache::KvCacheManager;
use crate::sampling::{greedy_argmax, probabilities, sample_from_probs, SeqRng, TokenHistory};
use crate::types::{SeqId, TokenId};
use specula_kernels::attention::KvLayout;
use specula_model::{ForwardBatch, KvStore, LlamaModel, SeqSpan};
use std::collections::HashMap;

pub struct DraftModelProposer {
    model: LlamaModel,
    kv_store: KvStore,
    kv: KvCacheManager,
    /// Per sequence: tokens whose draft KV is computed (the draft's own random stream is in the
    /// sequence's [`super::SeqDrafting`]).
    computed: HashMap<SeqId, usize>,
    /// The tokens the draft may propose when its output is restricted (column j of its logits is
    /// token `d2t(j)`); None: the whole vocabulary.
    vocab: Option<VocabMap>,
}

/// A hybrid draft's chain in one proposal: its sequence, its state slot, where the chain starts.
type ChainStart = (SeqId, u32, usize);

impl DraftModelProposer {
    /// A draft with `num_blocks` blocks of KV; a hybrid draft also holds recurrent state for
    /// `max_seqs` sequences (and a checkpoint of each).
    pub fn new(model: LlamaModel, target_vocab: usize, num_blocks: usize, block_size: usize, max_seqs: usize) -> Result<Self, SpecError> {
        if model.config.vocab_size != target_vocab {
            return Err(SpecError::Config(format!(
                "the draft model's vocabulary has {} tokens but the target's has {target_vocab}; a draft model must share the target's tokenizer",
                model.config.vocab_size
            )));
        }
        let c = &model.config;
        let layout = KvLayout { block_size, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
        let kv_store = KvStore::for_model(c, layout, num_blocks, specula_kernels::kv::KvDtype::default(), max_seqs)?;
        // with prefix caching: an agent's next turn resends the conversation, which the draft
        // would otherwise prefill whole again before its first draft (it doubled the time to the
        // first token of the 1.5B's agent turns, benchmarks.md S10); a hybrid draft's cache is
        // off (its chain's checkpoints are its own)
        let mut kv = KvCacheManager::new(num_blocks, block_size, true)?;
        if c.arch_options.recurrent.is_some() {
            kv.set_state_slots(max_seqs, 0);
        }
        Ok(Self { model, kv_store, kv, computed: HashMap::new(), vocab: None })
    }

    /// Restricts the draft to the first `n` token ids and `always` (end-of-sequence tokens):
    /// its lm_head keeps only those rows. `n` at or above the vocabulary: no restriction.
    pub fn with_draft_vocab(mut self, n: usize, always: &[TokenId]) -> Result<Self, SpecError> {
        let vocab = self.model.config.vocab_size;
        if n >= vocab {
            return Ok(self);
        }
        let keep = super::config::first_ids_and(n, always, vocab);
        self.model.restrict_output(&keep)?;
        self.vocab = Some(VocabMap::from_d2t(keep, vocab).map_err(SpecError::Config)?);
        Ok(self)
    }

    /// Re-encodes the draft's projections stored wider than 4 bits as Q4_0
    /// (`LlamaModel::requantize_q4_0`, `SpecConfig::draft_weights`): a draft token costs the bytes
    /// it reads. Called after `with_draft_vocab`, so only the output rows kept are converted.
    pub fn with_q4_0_weights(mut self) -> Result<Self, SpecError> {
        let t = std::time::Instant::now();
        let (before, after) = self.model.requantize_q4_0()?;
        tracing::info!(
            "draft model projections re-encoded as Q4_0 where wider: {:.1} -> {:.1} MB in {:.1} s (--draft-weights stored keeps the file's)",
            before as f64 / 1e6,
            after as f64 / 1e6,
            t.elapsed().as_secs_f64()
        );
        Ok(self)
    }

    /// Prompt tokens looked up in and found in the draft's prefix cache so far.
    pub fn prefix_cache_stats(&self) -> crate::kv_cache::PrefixCacheStats {
        self.kv.prefix_cache_stats()
    }

    /// A hybrid draft: each drafting sequence's state where its chain starts (after this
    /// proposal's first rows), saved in the checkpoint of its slot (ids are slots).
    fn checkpoint_chain_starts(&mut self, items: &[(SeqId, Vec<TokenId>, usize)]) -> Result<Vec<ChainStart>, SpecError> {
        let mut starts = Vec::new();
        let Some(store) = self.kv_store.recurrent.as_mut() else { return Ok(starts) };
        for (seq, feed, start) in items {
            if let Some(slot) = self.kv.state_slot(*seq)? {
                store.save_checkpoint(slot as usize, slot as usize, start + feed.len())?;
                starts.push((*seq, slot, start + feed.len()));
            }
        }
        Ok(starts)
    }

    /// A hybrid draft after its chain: each sequence's state back where the chain started, and
    /// its draft computed to there (its next proposal feeds the accepted tokens again).
    fn back_to_chain_starts(&mut self, starts: Vec<ChainStart>) -> Result<(), SpecError> {
        for (seq, slot, at) in starts {
            if let (Some(store), Some(computed)) = (self.kv_store.recurrent.as_mut(), self.computed.get_mut(&seq)) {
                store.restore_checkpoint(slot as usize, slot as usize, at)?;
                *computed = (*computed).min(at);
            }
        }
        Ok(())
    }

    fn run(&mut self, items: &[(SeqId, Vec<TokenId>, usize)], pool: &rayon::ThreadPool) -> Result<Vec<f32>, SpecError> {
        // items: (seq, tokens to feed, start position)
        let mut tokens = Vec::new();
        let mut slots = Vec::new();
        let mut tables = Vec::new();
        let mut spans = Vec::new();
        let mut rows = Vec::new();
        let mut state_slots = Vec::new();
        for (seq, feed, start) in items {
            if let Some(slot) = self.kv.state_slot(*seq)? {
                state_slots.push(slot as usize);
            }
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
        let out = pool.install(|| {
            model.forward(
                &ForwardBatch { tokens: &tokens, seqs: &seqs, slots: &slots, logits_rows: &rows, hidden_layers: &[], state_slots: &state_slots },
                kv_store,
            )
        })?;
        Ok(out.logits)
    }
}

/// Refuses a draft whose tokenizer is not the target's: the same number of tokens, the same text
/// for every id (a draft proposes ids; the same id must mean the same text to both).
pub fn check_same_tokenizer(draft: &specula_model::Tokenizer, target: &specula_model::Tokenizer) -> Result<(), SpecError> {
    if draft.vocab_size() != target.vocab_size() {
        return Err(SpecError::Config(format!(
            "the draft model's tokenizer has {} tokens but the target's has {}; a draft model must share the target's tokenizer",
            draft.vocab_size(),
            target.vocab_size()
        )));
    }
    for id in 0..draft.vocab_size() as TokenId {
        let (d, t) = (draft.id_to_token(id), target.id_to_token(id));
        if d != t {
            return Err(SpecError::Config(format!(
                "the draft model's token {id} is {d:?} but the target's is {t:?}; a draft model must share the target's tokenizer"
            )));
        }
    }
    Ok(())
}

impl Proposer for DraftModelProposer {
    fn cost_per_draft_token(&self, target: &specula_model::ModelConfig) -> f64 {
        super::adaptive::matmul_cost(&self.model.config) / super::adaptive::matmul_cost(target)
    }

    fn draft_step_seconds(&mut self, batches: &[usize], pool: &rayon::ThreadPool) -> Result<Option<Vec<(usize, f64)>>, SpecError> {
        Ok(Some(super::cost::measure_steps(&self.model, batches, pool)?))
    }

    fn propose(&mut self, reqs: &mut [DraftRequest], pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let vocab = self.model.config.vocab_size;
        let width = self.model.logits_width();
        // Greedy drafts are one-hot. A sampled draft is one-hot too when the engine gave the
        // sequence's stream: the draft samples each position with the draw the target samples it
        // with (coupled draws: the same token whenever the two distributions agree there), so the
        // output is plain decoding's. Without the stream it carries its distributions (lossless,
        // not token-identical).
        let mut drafts: Vec<Draft> =
            reqs.iter().map(|r| Draft { tokens: vec![], probs: (!r.params.is_plain_greedy() && r.rng.is_none()).then(Vec::new) }).collect();
        // which requests take part, with what they feed first
        let mut active: Vec<usize> = Vec::new();
        let mut items = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            if r.max_draft == 0 {
                continue;
            }
            if !self.computed.contains_key(&r.seq) {
                // the draft's KV of a prefix an earlier sequence computed is reused
                let cached = self.kv.allocate_prompt(r.seq, r.tokens)?;
                self.computed.insert(r.seq, cached);
            }
            let computed = self.computed[&r.seq].min(r.tokens.len() - 1);
            // the draft KV of the sequence's known tokens is valid up to `computed` (drafts past
            // it were rolled back): its full blocks join the prefix cache
            self.kv.commit_tokens(r.seq, &r.tokens[..computed])?;
            if self.kv.ensure_capacity(r.seq, r.tokens.len() + r.max_draft).is_err() {
                continue; // draft cache full: no proposal for this sequence this step
            }
            active.push(i);
            items.push((r.seq, r.tokens[computed..].to_vec(), computed));
        }
        let max_k = active.iter().map(|&i| reqs[i].max_draft).max().unwrap_or(0);
        let (start, first_rows, drafting) = (std::time::Instant::now(), items.iter().map(|it| it.1.len()).sum::<usize>(), items.len());
        let mut p = Vec::with_capacity(vocab);
        let mut full = Vec::new();
        let mut chain_starts = Vec::new();
        for step in 0..max_k {
            if items.is_empty() {
                break;
            }
            let logits = self.run(&items, pool)?;
            if step == 0 && max_k > 1 {
                chain_starts = self.checkpoint_chain_starts(&items)?;
            }
            let mut next_items = Vec::new();
            let mut next_active = Vec::new();
            for (j, ((seq, feed, start), &i)) in items.iter().zip(&active).enumerate() {
                let r = &mut reqs[i];
                let row = &logits[j * width..(j + 1) * width];
                *self.computed.get_mut(seq).expect("created above") = start + feed.len();
                let tok = if r.params.is_plain_greedy() {
                    let d = greedy_argmax(row).unwrap_or(0);
                    self.vocab.as_ref().map_or(Some(d), |m| m.d2t(d)).unwrap_or(0)
                } else {
                    // the distribution over the whole vocabulary (0 outside a restricted draft's)
                    let row = match &self.vocab {
                        None => row,
                        Some(m) => {
                            m.spread_into(row, f32::NEG_INFINITY, &mut full);
                            &full[..]
                        }
                    };
                    let mut output: Vec<TokenId> = r.tokens[r.prompt_len..].to_vec();
                    output.extend_from_slice(&drafts[i].tokens);
                    probabilities(row, r.params, TokenHistory { prompt: &r.tokens[..r.prompt_len], output: &output }, &mut p)?;
                    let u = match r.rng {
                        Some(rng) => rng.uniform_at(r.tokens.len() + drafts[i].tokens.len(), false),
                        None => r.drafting.rng.get_or_insert_with(|| SeqRng::new(r.params.seed, 1)).uniform(),
                    };
                    let tok = sample_from_probs(&p, u).unwrap_or(0);
                    if let Some(q) = drafts[i].probs.as_mut() {
                        q.push(p.clone());
                    }
                    tok
                };
                drafts[i].tokens.push(tok);
                if step + 1 < r.max_draft {
                    next_items.push((*seq, vec![tok], start + feed.len()));
                    next_active.push(i);
                }
            }
            items = next_items;
            active = next_active;
        }
        self.back_to_chain_starts(chain_starts)?;
        if drafting > 0 {
            tracing::debug!(drafting, first_rows, max_k, micros = start.elapsed().as_micros() as u64, "draft model proposed");
        }
        Ok(drafts)
    }

    fn rollback(&mut self, seq: SeqId, kept: usize) {
        let hybrid = self.kv_store.recurrent.is_some();
        if let Some(computed) = self.computed.get_mut(&seq) {
            if *computed > kept {
                // a hybrid's state is where its chain started, and cannot go further back: it
                // starts over (drafting never asks for this; a sequence rolled back further does)
                *computed = if hybrid { 0 } else { kept };
            }
            *computed = self.kv.truncate(seq, *computed).unwrap_or(0);
        }
    }

    fn backlog(&self, seq: SeqId, known: usize) -> usize {
        known.saturating_sub(1 + self.computed.get(&seq).copied().unwrap_or(0))
    }

    fn remove(&mut self, seq: SeqId) {
        self.computed.remove(&seq);
        self.kv.release(seq);
    }

    fn kv_blocks(&self) -> Option<(usize, usize)> {
        Some((self.kv.num_free_blocks(), self.kv.num_total_blocks()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::SamplingParams;
    use crate::speculative::SeqDrafting;
    use specula_model::testing::{write_tiny_llama, TinySpec};

    fn proposer(dir: &std::path::Path) -> DraftModelProposer {
        let path = dir.join("draft.gguf");
        write_tiny_llama(&path, &TinySpec { seed: 5, ..Default::default() }).unwrap();
        let model = specula_model::load_model(&path).unwrap().model;
        let vocab = model.config.vocab_size;
        DraftModelProposer::new(model, vocab, 32, 16, 4).unwrap()
    }

    fn draft(p: &mut DraftModelProposer, seq: u64, tokens: &[TokenId], pool: &rayon::ThreadPool) -> Vec<TokenId> {
        let params = SamplingParams::greedy(64);
        let req = DraftRequest {
            seq: SeqId(seq),
            tokens,
            prompt_len: tokens.len(),
            max_draft: 4,
            params: &params,
            hidden: None,
            rng: None,
            drafting: &mut SeqDrafting::default(),
        };
        p.propose(&mut [req], pool).unwrap().remove(0).tokens
    }

    /// A conversation's next turn resends its history: the draft computes only what its prefix
    /// cache does not hold, and drafts what it drafts without the cache.
    #[test]
    fn a_later_sequence_reuses_the_draft_kv_of_a_shared_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let first: Vec<TokenId> = (0..40).map(|i| 3 + (i * 7) % 250).collect();
        let next: Vec<TokenId> = first.iter().copied().chain([9, 8, 7, 6, 5]).collect();
        let mut p = proposer(dir.path());
        draft(&mut p, 1, &first, &pool);
        // the verified tokens' blocks are committed at the sequence's next step
        draft(&mut p, 1, &first, &pool);
        p.remove(SeqId(1));
        let before = p.prefix_cache_stats();
        let cached = draft(&mut p, 2, &next, &pool);
        let stats = p.prefix_cache_stats();
        // two full blocks of 16 of the first sequence's 40 tokens
        assert_eq!(stats.hit_tokens - before.hit_tokens, 32);
        assert_eq!(cached, draft(&mut proposer(dir.path()), 2, &next, &pool), "the cached KV drafts what a fresh computation does");
        p.remove(SeqId(2));
        let (free, total) = p.kv_blocks().unwrap();
        assert_eq!(free, total, "draft blocks leaked");
    }
}
