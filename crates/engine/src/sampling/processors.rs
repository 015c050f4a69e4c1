//! Logits processors: from a raw logits row to the probability distribution a token is drawn from.
//! Order (vLLM v1): repetition penalty, presence/frequency penalties, temperature, softmax, min-p,
//! top-k, top-p, renormalize. Greedy requests get a one-hot distribution on the penalized argmax,
//! so speculative decoding treats greedy and random sampling alike. Not for logprobs: those are
//! reported from the raw logits (see `logprobs`).

use super::SamplingError;
use crate::api::SamplingParams;
use crate::types::TokenId;
use std::cmp::Ordering;

/// The tokens a sequence has seen, which the penalties look at.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenHistory<'a> {
    pub prompt: &'a [TokenId],
    /// Tokens generated so far (accepted ones only).
    pub output: &'a [TokenId],
}

/// HF/vLLM repetition penalty: every distinct token seen in the prompt or the output has its logit
/// divided by `penalty` if positive, multiplied if not. Ids outside the row are ignored.
pub fn apply_repetition_penalty(logits: &mut [f32], history: TokenHistory<'_>, penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = vec![0u64; logits.len().div_ceil(64)];
    for &t in history.prompt.iter().chain(history.output) {
        let i = t as usize;
        if i >= logits.len() || seen[i / 64] & (1 << (i % 64)) != 0 {
            continue;
        }
        seen[i / 64] |= 1 << (i % 64);
        let x = logits[i];
        logits[i] = if x > 0.0 { x / penalty } else { x * penalty };
    }
}

/// OpenAI presence and frequency penalties over the output only: a token generated `c` times
/// loses `frequency * c + presence` (the presence term once, if `c > 0`). Ids outside the row are
/// ignored.
pub fn apply_presence_frequency_penalties(logits: &mut [f32], output: &[TokenId], presence: f32, frequency: f32) {
    if presence == 0.0 && frequency == 0.0 {
        return;
    }
    let mut sorted = output.to_vec();
    sorted.sort_unstable();
    for run in sorted.chunk_by(|a, b| a == b) {
        if let Some(x) = logits.get_mut(run[0] as usize) {
            *x -= frequency * run.len() as f32 + presence;
        }
    }
}

/// Adds each `(token, bias)` to that token's logit (ids past the row are ignored: the server
/// refuses them before a request gets here).
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(id, b) in bias {
        if let Some(x) = logits.get_mut(id as usize) {
            *x += b;
        }
    }
}

/// The logit bias, then both kinds of penalty, as `params` asks.
pub fn apply_penalties(logits: &mut [f32], params: &SamplingParams, history: TokenHistory<'_>) {
    apply_logit_bias(logits, &params.logit_bias);
    apply_repetition_penalty(logits, history, params.repetition_penalty);
    apply_presence_frequency_penalties(logits, history.output, params.presence_penalty, params.frequency_penalty);
}

/// NaN becomes -inf (never chosen) and +inf becomes `f32::MAX` (a broken model's +inf is still
/// its favourite), so later steps see only finite values and -inf.
pub fn sanitize(logits: &mut [f32]) {
    for x in logits {
        if x.is_nan() {
            *x = f32::NEG_INFINITY;
        } else if *x == f32::INFINITY {
            *x = f32::MAX;
        }
    }
}

/// Divides by `temperature` (> 0) after shifting the row so its maximum is 0: softmax ignores the
/// shift, and it keeps tiny temperatures from overflowing to inf. Expects a sanitized row.
pub fn apply_temperature(logits: &mut [f32], temperature: f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY || !(temperature > 0.0) {
        return;
    }
    for x in logits {
        *x = (*x - max) / temperature;
    }
}

/// Softmax in place, accumulated in f64. Expects a sanitized row; fails if every entry is -inf.
pub fn softmax_in_place(row: &mut [f32]) -> Result<(), SamplingError> {
    if row.is_empty() {
        return Err(SamplingError::EmptyRow);
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Err(SamplingError::NoFiniteLogits);
    }
    let mut sum = 0.0f64;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += f64::from(*x);
    }
    let inv = (1.0 / sum) as f32;
    for x in row {
        *x *= inv;
    }
    Ok(())
}

/// Drops (zeroes) tokens whose probability is below `min_p` times the largest probability.
pub fn apply_min_p(probs: &mut [f32], min_p: f32) {
    if min_p <= 0.0 {
        return;
    }
    let max = probs.iter().copied().fold(0.0f32, f32::max);
    let threshold = min_p * max;
    for p in probs {
        if *p < threshold {
            *p = 0.0;
        }
    }
}

/// Keeps the `k` most probable tokens (ties: lower id first), zeroing the rest. `k == 0` or
/// `k >= vocab` keeps everything. Partial selection, O(vocab).
pub fn apply_top_k(probs: &mut [f32], k: usize) {
    if k == 0 || k >= probs.len() {
        return;
    }
    let mut candidates = nonzero_ids(probs);
    if candidates.len() <= k {
        return;
    }
    candidates.select_nth_unstable_by(k - 1, |&a, &b| more_probable_first(probs, a, b));
    for &i in &candidates[k..] {
        probs[i as usize] = 0.0;
    }
}

/// Nucleus filter: keeps the smallest set of most probable tokens (ties: lower id first) whose
/// mass is at least `top_p` of the row's mass, zeroing the rest; always keeps at least one token.
/// `top_p >= 1` keeps everything. Sorts only a growing head of the candidates (64, 256, ...),
/// so the usual case costs a partial selection, not a sort of the vocabulary.
pub fn apply_top_p(probs: &mut [f32], top_p: f32) {
    if top_p >= 1.0 {
        return;
    }
    let mut candidates = nonzero_ids(probs);
    let n = candidates.len();
    let target = f64::from(top_p) * probs.iter().map(|&p| f64::from(p)).sum::<f64>();
    let mut head = n.min(64);
    loop {
        if head < n {
            candidates.select_nth_unstable_by(head - 1, |&a, &b| more_probable_first(probs, a, b));
        }
        candidates[..head].sort_unstable_by(|&a, &b| more_probable_first(probs, a, b));
        let mut cumulative = 0.0f64;
        let found = candidates[..head].iter().position(|&i| {
            cumulative += f64::from(probs[i as usize]);
            cumulative >= target
        });
        match found {
            Some(last) => {
                for &i in &candidates[last + 1..] {
                    probs[i as usize] = 0.0;
                }
                return;
            }
            // Rounding left the whole row just short of the target: keep it all.
            None if head == n => return,
            None => head = n.min(head * 4),
        }
    }
}

/// Rescales to sum 1; fails if nothing is left.
pub fn normalize(probs: &mut [f32]) -> Result<(), SamplingError> {
    let sum: f64 = probs.iter().map(|&p| f64::from(p)).sum();
    if !(sum > 0.0) {
        return Err(SamplingError::NoFiniteLogits);
    }
    let inv = (1.0 / sum) as f32;
    for p in probs {
        *p *= inv;
    }
    Ok(())
}

/// Turns a logits row into the distribution the sampler draws from, in place: penalties, then
/// either a one-hot on the argmax (greedy) or temperature, softmax, min-p, top-k, top-p and
/// renormalization. Tokens filtered out have probability exactly 0.
pub fn probabilities_in_place(row: &mut [f32], params: &SamplingParams, history: TokenHistory<'_>) -> Result<(), SamplingError> {
    if row.is_empty() {
        return Err(SamplingError::EmptyRow);
    }
    apply_penalties(row, params, history);
    sanitize(row);
    if params.is_greedy() {
        let best = argmax(row).ok_or(SamplingError::NoFiniteLogits)? as usize;
        if row[best] == f32::NEG_INFINITY {
            return Err(SamplingError::NoFiniteLogits);
        }
        row.fill(0.0);
        row[best] = 1.0;
        return Ok(());
    }
    apply_temperature(row, params.temperature);
    softmax_in_place(row)?;
    apply_min_p(row, params.min_p);
    apply_top_k(row, params.top_k);
    apply_top_p(row, params.top_p);
    normalize(row)
}

/// [`probabilities_in_place`] on a copy: `out` receives the distribution and `logits` is left
/// intact (for logprobs, or for computing both p and q in speculative decoding).
pub fn probabilities(logits: &[f32], params: &SamplingParams, history: TokenHistory<'_>, out: &mut Vec<f32>) -> Result<(), SamplingError> {
    out.clear();
    out.extend_from_slice(logits);
    probabilities_in_place(out, params, history)
}

fn nonzero_ids(probs: &[f32]) -> Vec<u32> {
    (0..probs.len() as u32).filter(|&i| probs[i as usize] > 0.0).collect()
}

/// Descending probability, then ascending id: a total order, so selections are deterministic.
fn more_probable_first(probs: &[f32], a: u32, b: u32) -> Ordering {
    probs[b as usize].total_cmp(&probs[a as usize]).then(a.cmp(&b))
}

/// The id of the largest value; ties go to the lowest id and NaN is never chosen. `None` for an
/// empty or all-NaN row.
pub fn argmax(row: &[f32]) -> Option<TokenId> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in row.iter().enumerate() {
        if x.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as TokenId)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams::default()
    }

    fn dist(logits: &[f32], p: &SamplingParams) -> Vec<f32> {
        let mut out = Vec::new();
        probabilities(logits, p, TokenHistory::default(), &mut out).unwrap();
        out
    }

    fn assert_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_once() {
        let mut row = [2.0, -2.0, 2.0, 1.0, 0.0];
        // Token 0 twice (prompt and output) is penalized once; token 9 is out of range.
        let h = TokenHistory { prompt: &[0, 1, 9], output: &[0, 4] };
        apply_repetition_penalty(&mut row, h, 2.0);
        assert_eq!(row, [1.0, -4.0, 2.0, 1.0, 0.0]);
    }

    #[test]
    fn repetition_penalty_below_one_encourages_repeats() {
        let mut row = [2.0, -2.0];
        apply_repetition_penalty(&mut row, TokenHistory { prompt: &[0, 1], output: &[] }, 0.5);
        assert_eq!(row, [4.0, -1.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_output_tokens_only() {
        let mut row = [1.0; 4];
        apply_presence_frequency_penalties(&mut row, &[2, 0, 2, 2, 7], 0.5, 0.25);
        // token 0: once -> 1 - 0.25 - 0.5; token 2: three times -> 1 - 0.75 - 0.5.
        assert_eq!(row, [0.25, 1.0, -0.25, 1.0]);

        let mut row = [1.0; 4];
        let p = SamplingParams { presence_penalty: 1.0, ..params() };
        apply_penalties(&mut row, &p, TokenHistory { prompt: &[1], output: &[3] });
        assert_eq!(row, [1.0, 1.0, 1.0, 0.0]);
    }

    #[test]
    fn negative_presence_penalty_raises_seen_tokens() {
        let mut row = [0.0; 2];
        apply_presence_frequency_penalties(&mut row, &[1], -2.0, 0.0);
        assert_eq!(row, [0.0, 2.0]);
    }

    #[test]
    fn temperature_shifts_to_zero_max_and_scales() {
        let mut row = [1.0, 3.0, f32::NEG_INFINITY];
        apply_temperature(&mut row, 0.5);
        assert_eq!(row, [-4.0, 0.0, f32::NEG_INFINITY]);
        let mut hot = [1e30, -1e30];
        apply_temperature(&mut hot, 1e-30);
        assert_eq!(hot, [0.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn softmax_of_logs_recovers_the_distribution() {
        let mut row = [0.1f32.ln(), 0.2f32.ln(), 0.3f32.ln(), 0.4f32.ln()];
        softmax_in_place(&mut row).unwrap();
        assert_close(&row, &[0.1, 0.2, 0.3, 0.4]);
    }

    #[test]
    fn top_k_keeps_the_k_largest_with_ties_to_the_lower_id() {
        let mut probs = [0.1, 0.3, 0.2, 0.3, 0.1];
        apply_top_k(&mut probs, 2);
        assert_eq!(probs, [0.0, 0.3, 0.0, 0.3, 0.0]);
        let mut probs = [0.25, 0.25, 0.25, 0.25];
        apply_top_k(&mut probs, 3);
        assert_eq!(probs, [0.25, 0.25, 0.25, 0.0]);
        let mut probs = [0.5, 0.5];
        apply_top_k(&mut probs, 0);
        assert_eq!(probs, [0.5, 0.5]);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_the_mass() {
        // 0.4 alone is short of 0.65; 0.4 + 0.3 reaches it.
        let mut probs = [0.1, 0.4, 0.2, 0.3];
        apply_top_p(&mut probs, 0.65);
        assert_eq!(probs, [0.0, 0.4, 0.0, 0.3]);
        let mut probs = [0.1, 0.4, 0.2, 0.3];
        apply_top_p(&mut probs, 0.71);
        assert_eq!(probs, [0.0, 0.4, 0.2, 0.3]);
        let mut probs = [0.1, 0.4, 0.2, 0.3];
        apply_top_p(&mut probs, 1e-6);
        assert_eq!(probs, [0.0, 0.4, 0.0, 0.0]);
    }

    #[test]
    fn top_p_is_relative_to_the_mass_left_by_earlier_filters() {
        // Mass 0.5 left after top-k; top_p 0.5 of that is 0.25, reached by the first token.
        let mut probs = [0.3, 0.2, 0.0, 0.0];
        apply_top_p(&mut probs, 0.5);
        assert_eq!(probs, [0.3, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn top_p_over_a_long_tail_grows_its_sorted_head() {
        // 1000 equal tokens: 90% needs 900 of them, beyond the first 64- and 256-token heads.
        let mut probs = vec![0.001f32; 1000];
        apply_top_p(&mut probs, 0.9);
        let kept: Vec<usize> = (0..1000).filter(|&i| probs[i] > 0.0).collect();
        assert_eq!(kept.len(), 900);
        assert_eq!(kept.last(), Some(&899), "ties keep the lowest ids");
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_top() {
        let mut probs = [0.5, 0.2, 0.05, 0.25];
        apply_min_p(&mut probs, 0.4);
        assert_eq!(probs, [0.5, 0.2, 0.0, 0.25]);
        let mut probs = [0.5, 0.2, 0.05, 0.25];
        apply_min_p(&mut probs, 0.5);
        assert_eq!(probs, [0.5, 0.0, 0.0, 0.25]);
    }

    #[test]
    fn greedy_gives_a_one_hot_on_the_penalized_argmax() {
        let p = SamplingParams { repetition_penalty: 4.0, ..SamplingParams::greedy(1) };
        let mut out = Vec::new();
        let h = TokenHistory { prompt: &[1], output: &[] };
        probabilities(&[1.0, 3.0, 0.5], &p, h, &mut out).unwrap();
        // 3.0 / 4 = 0.75 < 1.0, so token 0 wins.
        assert_eq!(out, [1.0, 0.0, 0.0]);
    }

    #[test]
    fn full_pipeline_applies_temperature_then_filters_then_renormalizes() {
        let logits = [0.1f32.ln(), 0.2f32.ln(), 0.3f32.ln(), 0.4f32.ln()];
        assert_close(&dist(&logits, &params()), &[0.1, 0.2, 0.3, 0.4]);
        // Temperature 0.5 squares then renormalizes: 1, 4, 9, 16 over 30.
        let p = SamplingParams { temperature: 0.5, ..params() };
        assert_close(&dist(&logits, &p), &[1.0 / 30.0, 4.0 / 30.0, 9.0 / 30.0, 16.0 / 30.0]);
        let p = SamplingParams { top_k: 2, ..params() };
        assert_close(&dist(&logits, &p), &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
        let p = SamplingParams { min_p: 0.6, ..params() };
        assert_close(&dist(&logits, &p), &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
        let p = SamplingParams { top_p: 0.5, ..params() };
        assert_close(&dist(&logits, &p), &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
    }

    #[test]
    fn nan_and_infinite_logits_do_not_poison_the_distribution() {
        let got = dist(&[f32::NAN, 0.0, f32::NEG_INFINITY, 0.0], &params());
        assert_eq!(got, [0.0, 0.5, 0.0, 0.5]);
        let got = dist(&[0.0, f32::INFINITY, 5.0], &params());
        assert_eq!(got, [0.0, 1.0, 0.0]);
    }

    #[test]
    fn rows_with_nothing_to_sample_are_errors() {
        let mut out = Vec::new();
        let h = TokenHistory::default();
        assert_eq!(probabilities(&[], &params(), h, &mut out), Err(SamplingError::EmptyRow));
        let bad = [f32::NAN, f32::NEG_INFINITY];
        assert_eq!(probabilities(&bad, &params(), h, &mut out), Err(SamplingError::NoFiniteLogits));
        let greedy = SamplingParams::greedy(1);
        assert_eq!(probabilities(&bad, &greedy, h, &mut out), Err(SamplingError::NoFiniteLogits));
    }
}
