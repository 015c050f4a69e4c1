//! Turning one row of logits into a token, and reporting what the client asked to see about it:
//! processors (penalties, temperature, top-k/top-p/min-p) build the distribution, the sampler draws
//! from it with the sequence's own RNG, logprobs/packing report log-probabilities compactly, and
//! stop strings decide how much text may be streamed. Not for speculative verification (the spec
//! module reuses `probabilities` for p and q) and not for detokenization.

pub mod logprobs;
pub mod packing;
pub mod processors;
pub mod rng;
pub mod sampler;
pub mod stop;

pub use logprobs::{batch_logprobs, log_softmax, logsumexp, ranked_logprob, ranked_logprobs, top_k_logprobs, RankedLogprob};
pub use packing::{pack, pack_header, unpack, unpack_header, Header, PackError, PackedLogprobs, Unpacked};
pub use processors::{probabilities, probabilities_in_place, TokenHistory};
pub use rng::SeqRng;
pub use sampler::{argmax, greedy_argmax, sample_from_probs, Sampler};
pub use stop::{StopCheck, StopStrings};

use crate::types::TokenId;

/// Why a row could not be sampled or scored. These come from the model's output or from a
/// caller's shapes, never from a client's request (that is validated by `SamplingParams`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplingError {
    #[error("cannot sample from an empty logits row")]
    EmptyRow,
    #[error("every logit in the row is -inf or NaN; the model produced no usable distribution")]
    NoFiniteLogits,
    #[error("token {token} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfVocab { token: TokenId, vocab: usize },
    #[error("{what}: expected {expected} elements, got {got}")]
    ShapeMismatch { what: &'static str, expected: usize, got: usize },
}
