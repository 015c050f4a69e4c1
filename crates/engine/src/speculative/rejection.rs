//! The rejection sampler: given target logits for the 1 + k verified positions and a draft,
//! keeps the longest acceptable prefix of the draft and adds one token from the target, so the
//! emitted tokens are distributed exactly as plain sampling from the target would be.
//!
//! - greedy: accept while the draft token is the target's (penalized) argmax; then emit the argmax.
//! - sampling, one-hot draft (n-gram, a draft model's coupled draw): sample position i from p_i with
//!   the position's own draw, exactly as plain decoding would, and keep the draft token iff it is
//!   the one sampled (accepted with probability p_i(x_i); on a mismatch the sampled token is
//!   distributed as p_i without x_i, the residual). The output is plain decoding's, token for token.
//! - sampling, stochastic draft (q given): accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
//!   on the first rejection draw from normalize(max(0, p_i - q_i)); lossless, not token-identical.
//! - if all k are accepted, the bonus token is sampled from p_k with its position's draw.
//!
//! p is the target distribution after the request's own penalties, temperature, top-k/p, min-p
//! (the exact distribution plain sampling uses), so speculation changes nothing a user observes.

use super::proposer::Draft;
use super::SpecError;
use crate::api::SamplingParams;
use crate::sampling::{greedy_argmax, probabilities, sample_from_probs, SamplingError, SeqRng, TokenHistory};
use crate::types::TokenId;

/// What verification kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Accepted draft tokens followed by exactly one target token (bonus or resampled).
    pub tokens: Vec<TokenId>,
    /// How many draft tokens were accepted (`tokens.len() - 1`).
    pub num_accepted: usize,
}

/// `logits`: `(1 + k) x vocab` rows for the positions after the last known token and after each
/// draft token. `prompt`/`output` are the sequence's tokens before this step.
#[allow(clippy::too_many_arguments)]
pub fn verify(
    logits: &[f32],
    vocab: usize,
    draft: &Draft,
    params: &SamplingParams,
    prompt: &[TokenId],
    output: &[TokenId],
    rng: &SeqRng,
    force_accept: bool,
) -> Result<Verdict, SpecError> {
    let k = draft.tokens.len();
    if logits.len() != (k + 1) * vocab {
        return Err(SamplingError::ShapeMismatch { what: "verification logits [(1 + k), vocab]", expected: (k + 1) * vocab, got: logits.len() }.into());
    }
    if let Some(q) = &draft.probs {
        if q.len() != k || q.iter().any(|row| row.len() != vocab) {
            return Err(SamplingError::ShapeMismatch { what: "draft distributions [k, vocab]", expected: k * vocab, got: q.iter().map(Vec::len).sum() }.into());
        }
    }
    if params.is_plain_greedy() && !force_accept && !general_path_forced() {
        return verify_plain_greedy(logits, vocab, draft);
    }
    // the position of row 0's token: each row is sampled with its own position's draw
    let base = prompt.len() + output.len();
    // the general path: each row's processed distribution (any parameters)
    let mut hist_output: Vec<TokenId> = output.to_vec();
    let mut p = Vec::with_capacity(vocab);
    let mut tokens = Vec::with_capacity(k + 1);
    for i in 0..=k {
        let row = &logits[i * vocab..(i + 1) * vocab];
        probabilities(row, params, TokenHistory { prompt, output: &hist_output }, &mut p)?;
        let u = rng.uniform_at(base + i, false);
        if i == k {
            // every draft token accepted: the bonus token
            tokens.push(sample_from_probs(&p, u).ok_or(SamplingError::NoFiniteLogits)?);
            break;
        }
        let x = draft.tokens[i];
        if x as usize >= vocab {
            return Err(SamplingError::TokenOutOfVocab { token: x, vocab }.into());
        }
        let Some(q) = &draft.probs else {
            // one-hot draft: the token plain decoding samples here, kept as the draft iff equal
            let y = if force_accept { x } else { sample_from_probs(&p, u).ok_or(SamplingError::NoFiniteLogits)? };
            tokens.push(y);
            if y != x {
                break;
            }
            hist_output.push(x);
            continue;
        };
        let q_x = q[i][x as usize];
        // compared in f64: rounding u to f32 could turn u < 1 into 1.0 and reject a p >= q token
        let accept = force_accept || (q_x > 0.0 && u < (p[x as usize] as f64 / q_x as f64).min(1.0)) || (p[x as usize] >= 1.0);
        if accept {
            tokens.push(x);
            hist_output.push(x);
            continue;
        }
        // residual distribution max(0, p - q), renormalized
        p.iter_mut().zip(&q[i]).for_each(|(pv, qv)| *pv = (*pv - qv).max(0.0));
        let sum: f64 = p.iter().map(|&v| v as f64).sum();
        if sum <= 0.0 {
            return Err(SamplingError::NoFiniteLogits.into());
        }
        let inv = (1.0 / sum) as f32;
        p.iter_mut().for_each(|v| *v *= inv);
        let u2 = rng.uniform_at(base + i, true);
        tokens.push(sample_from_probs(&p, u2).ok_or(SamplingError::NoFiniteLogits)?);
        break;
    }
    let num_accepted = tokens.len() - 1;
    Ok(Verdict { tokens, num_accepted })
}

#[cfg(not(test))]
fn general_path_forced() -> bool {
    false
}

#[cfg(test)]
thread_local! {
    /// Tests compare the fast path with the general one on the same inputs.
    static FORCE_GENERAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
fn general_path_forced() -> bool {
    FORCE_GENERAL.with(|f| f.get())
}

/// `verify` for plain greedy (no penalties), without building distributions: the target's
/// distribution at each row is one-hot on its argmax, so a draft token is accepted exactly when it
/// is that argmax, and the first mismatch (or the bonus row) emits the argmax.
fn verify_plain_greedy(logits: &[f32], vocab: usize, draft: &Draft) -> Result<Verdict, SpecError> {
    let k = draft.tokens.len();
    let mut tokens = Vec::with_capacity(k + 1);
    for i in 0..=k {
        let best = greedy_argmax(&logits[i * vocab..(i + 1) * vocab]).ok_or(SamplingError::NoFiniteLogits)?;
        if i < k && draft.tokens[i] as usize >= vocab {
            return Err(SamplingError::TokenOutOfVocab { token: draft.tokens[i], vocab }.into());
        }
        if i < k && best == draft.tokens[i] {
            tokens.push(draft.tokens[i]);
            continue;
        }
        tokens.push(best);
        break;
    }
    let num_accepted = tokens.len() - 1;
    Ok(Verdict { tokens, num_accepted })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The greedy fast path emits what building the one-hot distributions emits, on rows with
        /// ties, NaN and infinities.
        #[test]
        fn plain_greedy_fast_path_matches_the_general_path(
            rows in proptest::collection::vec(proptest::collection::vec(prop_oneof![
                8 => (-4i32..4).prop_map(|v| v as f32),
                1 => Just(f32::NAN),
                1 => Just(f32::INFINITY),
                1 => Just(f32::NEG_INFINITY),
            ], 6), 1..5),
            draft_seed in proptest::collection::vec(0u32..6, 4),
            seed in 0u64..1000,
        ) {
            let vocab = 6;
            let k = rows.len() - 1;
            let logits: Vec<f32> = rows.concat();
            let draft = Draft { tokens: draft_seed[..k].to_vec(), probs: None };
            let params = SamplingParams::greedy(10);
            let r2 = SeqRng::new(Some(seed), 0);
            let fast = verify_plain_greedy(&logits, vocab, &draft);
            FORCE_GENERAL.with(|f| f.set(true));
            let general = verify(&logits, vocab, &draft, &params, &[1], &[], &r2, false);
            FORCE_GENERAL.with(|f| f.set(false));
            match (fast, general) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "fast {:?} vs general {:?}", a, b),
            }
        }
    }

    proptest! {
        /// Sampled verification of a one-hot draft emits what plain decoding samples, token for
        /// token: the plain tokens y_0.. (each position with its own draw, under a repetition
        /// penalty so the history matters), cut after the first position where the draft differs.
        #[test]
        fn one_hot_drafts_give_plain_decodings_tokens(
            rows in proptest::collection::vec(proptest::collection::vec(-3.0f32..3.0, 5), 1..6),
            draft_seed in proptest::collection::vec(0u32..5, 5),
            follow in proptest::collection::vec(proptest::bool::ANY, 5),
            seed in 0u64..10_000,
        ) {
            let vocab = 5;
            let k = rows.len() - 1;
            let logits: Vec<f32> = rows.concat();
            let params = SamplingParams { temperature: 0.9, repetition_penalty: 1.3, seed: Some(seed), ..SamplingParams::default() };
            let prompt = [1u32, 2, 3];
            let rng = SeqRng::new(Some(seed), 0);
            // plain decoding of the same rows
            let mut sampler = crate::sampling::Sampler::new();
            let mut plain = Vec::new();
            for i in 0..=k {
                let h = TokenHistory { prompt: &prompt, output: &plain };
                let y = sampler.sample(&logits[i * vocab..(i + 1) * vocab], &params, h, &rng.clone()).unwrap();
                plain.push(y);
            }
            // a draft that follows plain decoding where `follow` says so
            let draft: Vec<u32> = (0..k).map(|i| if follow[i] { plain[i] } else { draft_seed[i] }).collect();
            let v = verify(&logits, vocab, &Draft { tokens: draft.clone(), probs: None }, &params, &prompt, &[], &rng.clone(), false).unwrap();
            let cut = (0..k).find(|&i| draft[i] != plain[i]).map_or(k + 1, |i| i + 1);
            prop_assert_eq!(&v.tokens[..], &plain[..cut]);
        }
    }

    fn logits_from_probs(p: &[f32]) -> Vec<f32> {
        p.iter().map(|x| if *x > 0.0 { x.ln() } else { f32::NEG_INFINITY }).collect()
    }

    #[test]
    fn greedy_accepts_the_matching_prefix_then_emits_the_argmax() {
        let vocab = 4;
        // rows: argmax 2, argmax 3, argmax 1
        let logits = [0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 5.0, 0.0, 0.0];
        let params = SamplingParams::greedy(10);
        let rng = SeqRng::new(Some(1), 0);
        let v = verify(&logits, vocab, &Draft { tokens: vec![2, 0], probs: None }, &params, &[1], &[], &rng, false).unwrap();
        assert_eq!(v, Verdict { tokens: vec![2, 3], num_accepted: 1 });
        let v = verify(&logits, vocab, &Draft { tokens: vec![2, 3], probs: None }, &params, &[1], &[], &rng, false).unwrap();
        assert_eq!(v, Verdict { tokens: vec![2, 3, 1], num_accepted: 2 });
        let v = verify(&logits, vocab, &Draft { tokens: vec![0, 3], probs: None }, &params, &[1], &[], &rng, false).unwrap();
        assert_eq!(v, Verdict { tokens: vec![2], num_accepted: 0 });
    }

    #[test]
    fn force_accept_keeps_every_draft_token() {
        let logits = [0.0, 5.0, 0.0, 5.0, 0.0, 5.0];
        let rng = SeqRng::new(Some(1), 0);
        let v = verify(&logits, 2, &Draft { tokens: vec![0, 0], probs: None }, &SamplingParams::greedy(5), &[], &[], &rng, true).unwrap();
        assert_eq!(v.tokens, vec![0, 0, 1]);
    }

    /// The first emitted token's distribution must equal p exactly, for one-hot and for
    /// stochastic drafts. 200k draws: the standard error of each frequency is below 0.0012, so a
    /// 0.006 tolerance (5 sigma) never fails by chance but catches any systematic bias (a sampler
    /// that ignores q, or forgets the residual, is off by more than 0.05 here).
    #[test]
    fn first_emitted_token_is_distributed_as_the_target() {
        let p = [0.1f32, 0.2, 0.3, 0.4];
        let q = [0.4f32, 0.3, 0.2, 0.1];
        let vocab = 4;
        let row = logits_from_probs(&p);
        let logits: Vec<f32> = row.iter().chain(row.iter()).cloned().collect();
        let params = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
        let n = 200_000;
        for stochastic in [false, true] {
            let mut counts = [0usize; 4];
            let mut qrng = SeqRng::new(Some(8), 0);
            for i in 0..n {
                // each trial its own sequence (a position has one draw per sequence)
                let rng = SeqRng::new(Some(7 + i as u64), 0);
                let (tok, probs) = if stochastic {
                    (sample_from_probs(&q, qrng.uniform()).unwrap(), Some(vec![q.to_vec()]))
                } else {
                    (0, None) // n-gram style: always proposes token 0, one-hot q
                };
                let v = verify(&logits, vocab, &Draft { tokens: vec![tok], probs }, &params, &[], &[], &rng, false).unwrap();
                counts[v.tokens[0] as usize] += 1;
            }
            for t in 0..4 {
                let f = counts[t] as f32 / n as f32;
                assert!((f - p[t]).abs() < 0.006, "stochastic={stochastic} token {t}: {f} vs {}", p[t]);
            }
        }
    }

    #[test]
    fn shape_errors_are_reported_not_panicked() {
        let rng = SeqRng::new(Some(1), 0);
        let e = verify(&[0.0; 3], 2, &Draft { tokens: vec![0], probs: None }, &SamplingParams::greedy(1), &[], &[], &rng, false);
        assert!(e.is_err());
        let e = verify(&[0.0; 4], 2, &Draft { tokens: vec![5], probs: None }, &SamplingParams::greedy(1), &[], &[], &rng, false);
        assert!(e.is_err());
    }
}
