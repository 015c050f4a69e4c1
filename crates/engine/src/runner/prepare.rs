//! Building one step's flat batch. Pure function of the plan, the sequences' tokens and the KV
//! manager's block tables, so it can run off the engine thread (async scheduling).

use crate::kv_cache::{KvCacheError, KvCacheManager};
use crate::scheduler::StepPlan;
use crate::sequence::Sequence;
use crate::types::{SeqId, TokenId};
use std::collections::BTreeMap;

/// A sequence's rows in the flattened batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRange {
    pub q_start: usize,
    pub q_len: usize,
    /// Tokens in context after this step.
    pub context_len: usize,
}

/// Everything the forward pass reads, built before it runs.
#[derive(Clone, Debug, Default)]
pub struct BatchInputs {
    /// `[total_tokens]` token ids, sequence after sequence.
    pub tokens: Vec<TokenId>,
    /// One per scheduled sequence, in plan order; q_starts tile `tokens`.
    pub spans: Vec<RowRange>,
    /// One per scheduled sequence: its block ids.
    pub block_tables: Vec<Vec<u32>>,
    /// `[total_tokens]` KV slot of each token.
    pub slots: Vec<usize>,
    /// Rows whose logits are needed, in order: for each sampling sequence its last
    /// `1 + num_drafts` rows.
    pub logits_rows: Vec<usize>,
    /// For each sampling sequence: (seq, first index into logits_rows, number of rows).
    pub sample_rows: Vec<(SeqId, usize, usize)>,
    pub want_hidden: bool,
}

pub fn prepare(plan: &StepPlan, seqs: &BTreeMap<SeqId, Sequence>, kv: &KvCacheManager) -> Result<BatchInputs, KvCacheError> {
    let mut b = BatchInputs::default();
    for sch in &plan.seqs {
        let s = &seqs[&sch.seq];
        let q_start = b.tokens.len();
        let known = s.tokens.len();
        for pos in sch.start..sch.start + sch.num_tokens {
            b.tokens.push(if pos < known { s.tokens[pos] } else { s.draft.tokens[pos - known] });
        }
        kv.extend_slot_mapping(sch.seq, sch.start, sch.num_tokens, &mut b.slots)?;
        b.spans.push(RowRange { q_start, q_len: sch.num_tokens, context_len: sch.start + sch.num_tokens });
        b.block_tables.push(kv.block_table(sch.seq)?.iter().map(|x| x.0).collect());
        if sch.sample {
            let rows = 1 + sch.num_drafts;
            let first = q_start + sch.num_tokens - rows;
            b.sample_rows.push((sch.seq, b.logits_rows.len(), rows));
            b.logits_rows.extend(first..first + rows);
        }
    }
    Ok(b)
}
