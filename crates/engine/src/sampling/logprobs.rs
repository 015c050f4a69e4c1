//! Log-probabilities reported to clients: log-softmax of the model's raw logits, before temperature,
//! penalties and filters (vLLM's `raw_logprobs`), so the numbers describe the model, not the
//! sampling settings, and are the same with or without speculation. Top-k alternatives come from a
//! partial selection, never a sort of the vocabulary. Not for sampling (see `processors`).
//!
//! Non-finite logits: NaN counts as -inf (probability 0) and +inf as `f32::MAX`.

use super::SamplingError;
use crate::api::TokenLogprob;
use crate::types::TokenId;
use rayon::prelude::*;
use specula_kernels::logits::{clean, exp_sum, max_and_count_above};
use std::cmp::Ordering;

/// One emitted token's logprob entry plus its rank among all tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct RankedLogprob {
    pub logprob: TokenLogprob,
    /// 1 + the number of tokens with a strictly larger raw logit (the argmax has rank 1).
    pub rank: u32,
}

/// `log(sum(exp(row)))`: the row's maximum plus the log of `sum(exp(x - max))` (f32 lanes summed
/// in f64, `specula_kernels::logits`); -inf for an empty or all -inf/NaN row.
pub fn logsumexp(row: &[f32]) -> f64 {
    let (max, _) = max_and_count_above(row, f32::MAX);
    lse_with_max(row, max)
}

fn lse_with_max(row: &[f32], max: f32) -> f64 {
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    f64::from(max) + exp_sum(row, max).ln()
}

/// `logit - logsumexp`, or -inf when the row has no mass at all.
fn logprob_of(logit: f32, lse: f64) -> f32 {
    if lse == f64::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    (f64::from(clean(logit)) - lse) as f32
}

/// The whole row's log-softmax.
pub fn log_softmax(row: &[f32]) -> Vec<f32> {
    let lse = logsumexp(row);
    row.iter().map(|&x| logprob_of(x, lse)).collect()
}

/// Larger logit first, then lower id: a total order, so the top k are deterministic.
fn higher_first(row: &[f32], a: u32, b: u32) -> Ordering {
    clean(row[b as usize]).total_cmp(&clean(row[a as usize])).then(a.cmp(&b))
}

/// Ids scanned at a time by `top_k_ids`: a span whose largest logit is below the k-th best so far
/// is skipped after one (vectorised) maximum.
const TOP_K_SPAN: usize = 64;

/// Ids of the `k` largest logits, best first (ties: lower id first). One scan that keeps the best
/// `k` so far in order; once there are `k`, a span of ids whose maximum is below the k-th is
/// skipped whole (for a logits row, almost all of them). Never a sort of the vocabulary.
fn top_k_ids(row: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(row.len());
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    for (span, xs) in row.chunks(TOP_K_SPAN).enumerate() {
        if best.len() == k {
            let kth = clean(row[best[k - 1] as usize]);
            if xs.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(clean(x))) < kth {
                continue;
            }
        }
        for j in 0..xs.len() {
            let id = (span * TOP_K_SPAN + j) as u32;
            if best.len() == k && higher_first(row, id, best[k - 1]) != Ordering::Less {
                continue;
            }
            let at = best.partition_point(|&b| higher_first(row, b, id) == Ordering::Less);
            best.insert(at, id);
            best.truncate(k);
        }
    }
    best
}

/// The `k` most likely tokens with their logprobs, best first (ties: lower id first); fewer than
/// `k` only when the vocabulary is smaller.
pub fn top_k_logprobs(row: &[f32], k: usize) -> Vec<(TokenId, f32)> {
    let lse = logsumexp(row);
    top_k_ids(row, k).into_iter().map(|i| (i, logprob_of(row[i as usize], lse))).collect()
}

/// The entry for `token`, sampled from `row`, with the top `k` alternatives and its rank.
pub fn ranked_logprob(row: &[f32], token: TokenId, k: usize) -> Result<RankedLogprob, SamplingError> {
    let sampled = clean(*row.get(token as usize).ok_or(SamplingError::TokenOutOfVocab { token, vocab: row.len() })?);
    let (max, better) = max_and_count_above(row, sampled);
    let lse = lse_with_max(row, max);
    let top = top_k_ids(row, k).into_iter().map(|i| (i, logprob_of(row[i as usize], lse))).collect();
    Ok(RankedLogprob { logprob: TokenLogprob { token, logprob: logprob_of(sampled, lse), top }, rank: u32::try_from(better + 1).unwrap_or(u32::MAX) })
}

/// [`ranked_logprob`] of many rows of `logits` (`[rows, vocab]` row-major): `(row, token)` pairs,
/// each row's entry with the top `k`, in the order given. Rows are spread over the current rayon
/// pool's threads (scoring a prompt asks one per prompt token); each row's result is the same
/// whatever the split.
pub fn ranked_logprobs(logits: &[f32], vocab: usize, rows: &[(usize, TokenId)], k: usize) -> Result<Vec<RankedLogprob>, SamplingError> {
    let total = logits.len() / vocab.max(1);
    rows.par_iter()
        .with_min_len(4)
        .map(|&(r, token)| {
            let row = logits.get(r * vocab..(r + 1) * vocab).ok_or(SamplingError::ShapeMismatch { what: "logits rows", expected: r + 1, got: total })?;
            ranked_logprob(row, token, k)
        })
        .collect()
}

/// Logprobs for one step's sampled rows. `logits` is `[rows, vocab]` row-major, `sampled[r]` the
/// token emitted from row `r`, `requested[r]` that sequence's `logprobs` setting. Rows asking for
/// none get `None`; every other row gets `k_max` alternatives, `k_max` being the largest request
/// in the batch (capped at the vocabulary), which is what the packed transfer carries; each
/// consumer keeps the first `k` of its own.
pub fn batch_logprobs(logits: &[f32], vocab: usize, sampled: &[TokenId], requested: &[Option<usize>]) -> Result<Vec<Option<RankedLogprob>>, SamplingError> {
    let rows = sampled.len();
    if requested.len() != rows {
        return Err(SamplingError::ShapeMismatch { what: "logprobs requests (one per sampled row)", expected: rows, got: requested.len() });
    }
    let expected = rows.saturating_mul(vocab);
    if logits.len() != expected {
        return Err(SamplingError::ShapeMismatch { what: "logits [rows, vocab]", expected, got: logits.len() });
    }
    let Some(k_max) = requested.iter().flatten().copied().max() else {
        return Ok(vec![None; rows]);
    };
    (0..rows)
        .map(|r| match requested[r] {
            None => Ok(None),
            Some(_) => ranked_logprob(&logits[r * vocab..(r + 1) * vocab], sampled[r], k_max).map(Some),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn assert_close(got: f32, want: f32) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn log_softmax_of_log_probabilities_is_the_identity() {
        let row: Vec<f32> = [0.1f32, 0.2, 0.3, 0.4].iter().map(|p| p.ln() + 7.0).collect();
        let got = log_softmax(&row);
        for (g, p) in got.iter().zip([0.1f32, 0.2, 0.3, 0.4]) {
            assert_close(*g, p.ln());
        }
        assert!((logsumexp(&row) - 7.0).abs() < 1e-6);
    }

    #[test]
    fn logsumexp_survives_huge_and_non_finite_logits() {
        assert!((logsumexp(&[1000.0, 1000.0]) - (1000.0 + 2f64.ln())).abs() < 1e-9);
        assert_eq!(logsumexp(&[]), f64::NEG_INFINITY);
        assert_eq!(log_softmax(&[f32::NAN, 0.0]), vec![f32::NEG_INFINITY, 0.0]);
        assert_eq!(log_softmax(&[f32::NEG_INFINITY]), vec![f32::NEG_INFINITY]);
    }

    #[test]
    fn top_k_is_sorted_best_first_with_ties_to_the_lower_id() {
        let row = [1.0, 3.0, 2.0, 3.0, f32::NAN, 0.0];
        let ids: Vec<TokenId> = top_k_logprobs(&row, 3).into_iter().map(|(t, _)| t).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        let all: Vec<TokenId> = top_k_logprobs(&row, 100).into_iter().map(|(t, _)| t).collect();
        assert_eq!(all, vec![1, 3, 2, 0, 5, 4]);
        assert_eq!(top_k_logprobs(&row, 0), vec![]);
    }

    proptest! {
        // the span-skipping scan against the definition: every id sorted by `higher_first`, the
        // first k; rows with ties, -0.0 / 0.0, NaN and +-inf, longer than a few spans
        #[test]
        fn top_k_ids_are_the_first_k_of_the_sorted_ids(
            row in proptest::collection::vec(prop_oneof![
                (-4i32..4).prop_map(|x| x as f32 * 0.5),
                proptest::num::f32::ANY,
                Just(-0.0f32),
                Just(f32::INFINITY),
            ], 1..400),
            k in 0usize..24,
        ) {
            let mut want: Vec<u32> = (0..row.len() as u32).collect();
            want.sort_by(|&a, &b| higher_first(&row, a, b));
            want.truncate(k);
            prop_assert_eq!(top_k_ids(&row, k), want);
            let tok = (k % row.len()) as u32;
            let rank = 1 + row.iter().filter(|&&x| clean(x) > clean(row[tok as usize])).count() as u32;
            prop_assert_eq!(ranked_logprob(&row, tok, k).unwrap().rank, rank);
        }
    }

    #[test]
    fn ranked_logprobs_over_rows_equal_one_row_at_a_time() {
        let vocab = 300;
        let logits: Vec<f32> = (0..vocab * 9).map(|i| ((i * 7919) % 1000) as f32 / 37.0).collect();
        let rows: Vec<(usize, TokenId)> = (0..9).map(|r| ((r * 4) % 9, (r * 31) as TokenId)).collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let got = pool.install(|| ranked_logprobs(&logits, vocab, &rows, 5)).unwrap();
        for (g, &(r, t)) in got.iter().zip(&rows) {
            assert_eq!(*g, ranked_logprob(&logits[r * vocab..(r + 1) * vocab], t, 5).unwrap());
        }
        assert!(ranked_logprobs(&logits, vocab, &[(9, 0)], 1).is_err());
    }

    #[test]
    fn top_k_logprob_values_are_exact() {
        let row = [2f32.ln(), 1f32.ln(), 1f32.ln()];
        let top = top_k_logprobs(&row, 2);
        assert_eq!(top[0].0, 0);
        assert_close(top[0].1, 0.5f32.ln());
        assert_eq!(top[1].0, 1);
        assert_close(top[1].1, 0.25f32.ln());
    }

    #[test]
    fn ranked_logprob_reports_the_sampled_token_and_its_rank() {
        let row = [0.0, 3.0, 1.0, 3.0];
        let r = ranked_logprob(&row, 2, 2).unwrap();
        assert_eq!(r.logprob.token, 2);
        assert_eq!(r.rank, 3);
        assert_eq!(r.logprob.top.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 3]);
        assert_close(r.logprob.logprob, 1.0 - logsumexp(&row) as f32);
        // A tie with the best shares rank 1.
        assert_eq!(ranked_logprob(&row, 3, 0).unwrap().rank, 1);
        assert_eq!(ranked_logprob(&row, 4, 0), Err(SamplingError::TokenOutOfVocab { token: 4, vocab: 4 }));
    }

    #[test]
    fn the_sampled_entry_equals_its_top_entry() {
        let row = [0.3, -2.0, 5.0, 1.0];
        let r = ranked_logprob(&row, 2, 1).unwrap();
        assert_eq!(r.logprob.top, vec![(2, r.logprob.logprob)]);
    }

    #[test]
    fn batch_computes_the_largest_request_for_every_asking_row() {
        let logits = [
            0.0, 1.0, 2.0, 3.0, // row 0 asks for 1
            3.0, 2.0, 1.0, 0.0, // row 1 asks for none
            1.0, 1.0, 5.0, 0.0, // row 2 asks for 3
        ];
        let out = batch_logprobs(&logits, 4, &[0, 1, 2], &[Some(1), None, Some(3)]).unwrap();
        assert_eq!(out.len(), 3);
        let r0 = out[0].as_ref().unwrap();
        assert_eq!(r0.logprob.top.iter().map(|e| e.0).collect::<Vec<_>>(), vec![3, 2, 1]);
        assert_eq!(r0.rank, 4);
        assert_eq!(out[1], None);
        let r2 = out[2].as_ref().unwrap();
        assert_eq!(r2.logprob.top.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 0, 1]);
        assert_eq!(r2.rank, 1);
    }

    #[test]
    fn batch_without_requests_computes_nothing() {
        assert_eq!(batch_logprobs(&[0.0; 4], 2, &[0, 1], &[None, None]), Ok(vec![None, None]));
    }

    #[test]
    fn batch_checks_its_shapes() {
        assert_eq!(
            batch_logprobs(&[0.0; 5], 2, &[0, 1], &[Some(1), None]),
            Err(SamplingError::ShapeMismatch { what: "logits [rows, vocab]", expected: 4, got: 5 })
        );
        assert!(matches!(batch_logprobs(&[0.0; 4], 2, &[0, 1], &[None]), Err(SamplingError::ShapeMismatch { expected: 2, got: 1, .. })));
        assert_eq!(batch_logprobs(&[0.0; 4], 2, &[0, 7], &[None, Some(0)]), Err(SamplingError::TokenOutOfVocab { token: 7, vocab: 2 }));
    }
}
