//! Domain identifiers shared by the whole engine, and the one value every phase passes along
//! ([`Draft`]). Newtypes so a block index can never be passed where a sequence id is expected.
//! A leaf: imports nothing of the engine.

/// A token id in the target model's vocabulary.
pub type TokenId = u32;

/// One running sequence (a request's single completion; `n > 1` requests own several).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Index of a KV-cache block in the block pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Client-visible request id (what `abort` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Who sent a request, where the server tells tenants apart (one per API key; 0 when it does not):
/// state learned from one tenant's requests (speculation's cross-request index) never serves
/// another's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Tenant(pub u32);

/// A proposal: `tokens.len()` draft tokens and, for stochastic proposers, the distribution each
/// was drawn from (`probs[i]` over the target vocabulary). `None` means one-hot on the token.
/// Written by the proposer (`speculative::Proposer`) and by jump-forward, cut by the grammar
/// (`constraint`), carried by the step to the sequence and verified by the next step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<TokenId>,
    pub probs: Option<Vec<Vec<f32>>>,
}

impl Draft {
    /// Keeps the first `n` draft tokens and their distributions.
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        if let Some(p) = self.probs.as_mut() {
            p.truncate(n);
        }
    }
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq{}", self.0)
    }
}
impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req{}", self.0)
    }
}
