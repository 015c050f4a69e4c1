//! Speculative-decoding counters, read two ways so any server can report them:
//! from responses (a `spec_decode` object in a chunk or in `usage`, or llama-server's
//! `timings.draft_n` / `timings.draft_n_accepted`) and from the server's Prometheus `/metrics`
//! (vLLM-style `*spec_decode_num_{drafts,draft_tokens,accepted_tokens}` counters, any prefix),
//! diffed around a run. Counters are raw; rates are computed when reported. The prefix cache's
//! counters come the same two ways (`*prefix_cache_{queries,hits}` in /metrics, as vLLM and specula
//! name them; per request OpenAI's `usage.prompt_tokens_details.cached_tokens` of
//! `usage.prompt_tokens`, as specula, vLLM and OpenAI report it, or llama-server's
//! `timings.cache_n` / `prompt_n`).

use serde::Serialize;
use std::collections::BTreeMap;

/// Counter name -> value, for one request or summed over many.
pub type SpecCounters = BTreeMap<String, f64>;

pub const NUM_DRAFTS: &str = "num_drafts";
pub const NUM_DRAFT_TOKENS: &str = "num_draft_tokens";
pub const NUM_ACCEPTED_TOKENS: &str = "num_accepted_tokens";
/// Prompt tokens looked up in / found in the prefix cache.
pub const PREFIX_CACHE_QUERIES: &str = "prefix_cache_queries";
pub const PREFIX_CACHE_HITS: &str = "prefix_cache_hits";

/// The share of prompt tokens the prefix cache served, where the counters tell.
pub fn prefix_cache_share(c: &SpecCounters) -> Option<f64> {
    match (c.get(PREFIX_CACHE_HITS), c.get(PREFIX_CACHE_QUERIES)) {
        (Some(h), Some(q)) if *q > 0.0 => Some(h / q),
        _ => None,
    }
}

/// Reads the counters one stream chunk carries into `into` (a later chunk overwrites an earlier
/// one: servers report per-request totals, usually in the last chunk).
pub fn read_chunk(chunk: &serde_json::Value, into: &mut SpecCounters) {
    for obj in [&chunk["spec_decode"], &chunk["usage"]["spec_decode"]] {
        if let Some(map) = obj.as_object() {
            for (k, v) in map {
                if let Some(x) = v.as_f64() {
                    into.insert(k.clone(), x);
                }
            }
        }
    }
    let timings = &chunk["timings"];
    for (theirs, ours) in [("draft_n", NUM_DRAFT_TOKENS), ("draft_n_accepted", NUM_ACCEPTED_TOKENS)] {
        if let Some(x) = timings[theirs].as_f64() {
            into.insert(ours.to_string(), x);
        }
    }
    // OpenAI's usage: cached_tokens of prompt_tokens came from the cache
    let usage = &chunk["usage"];
    if let (Some(cached), Some(prompt)) = (usage["prompt_tokens_details"]["cached_tokens"].as_f64(), usage["prompt_tokens"].as_f64()) {
        into.insert(PREFIX_CACHE_HITS.to_string(), cached);
        into.insert(PREFIX_CACHE_QUERIES.to_string(), prompt);
    }
    // llama-server: prompt_n tokens were computed, cache_n came from its cache
    if let (Some(cached), Some(computed)) = (timings["cache_n"].as_f64(), timings["prompt_n"].as_f64()) {
        into.insert(PREFIX_CACHE_HITS.to_string(), cached);
        into.insert(PREFIX_CACHE_QUERIES.to_string(), cached + computed);
    }
}

/// Sums counters over requests.
pub fn add(total: &mut SpecCounters, one: &SpecCounters) {
    for (k, v) in one {
        *total.entry(k.clone()).or_default() += v;
    }
}

/// Counters and the rates derived from them, for one run.
#[derive(Debug, Clone, Serialize)]
pub struct SpecSummary {
    pub counters: SpecCounters,
    /// accepted draft tokens / proposed draft tokens.
    pub acceptance_rate: Option<f64>,
    /// Tokens emitted per verification step: 1 + accepted / drafts (vLLM's definition).
    pub mean_acceptance_length: Option<f64>,
}

impl SpecSummary {
    /// `None` when there is nothing to report (no counters, or no draft tokens at all).
    pub fn of(counters: SpecCounters) -> Option<SpecSummary> {
        let get = |k: &str| counters.get(k).copied();
        let accepted = get(NUM_ACCEPTED_TOKENS);
        if counters.is_empty() || get(NUM_DRAFT_TOKENS).is_some_and(|d| d == 0.0) {
            return None;
        }
        let ratio = |num: Option<f64>, den: Option<f64>| match (num, den) {
            (Some(n), Some(d)) if d > 0.0 => Some(n / d),
            _ => None,
        };
        Some(SpecSummary {
            acceptance_rate: ratio(accepted, get(NUM_DRAFT_TOKENS)),
            mean_acceptance_length: ratio(accepted, get(NUM_DRAFTS)).map(|r| 1.0 + r),
            counters,
        })
    }
}

/// The spec-decode counters in a Prometheus text exposition, summed over label sets.
/// `vllm:spec_decode_num_drafts_total{engine="0"} 12` counts as `num_drafts` = 12.
pub fn parse_prometheus(text: &str) -> SpecCounters {
    let mut out = SpecCounters::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (name, rest) = match line.find('{') {
            Some(b) => match line[b..].find('}') {
                Some(e) => (&line[..b], &line[b + e + 1..]),
                None => continue,
            },
            None => line.split_once(char::is_whitespace).unwrap_or((line, "")),
        };
        let name = name.strip_suffix("_total").unwrap_or(name);
        let counter = match (name.find("spec_decode_"), name.find("prefix_cache_")) {
            (Some(at), _) => &name[at + "spec_decode_".len()..],
            (None, Some(at)) => &name[at..],
            (None, None) => continue,
        };
        if ![NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS].contains(&counter) {
            continue;
        }
        if let Some(v) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) {
            *out.entry(counter.to_string()).or_default() += v;
        }
    }
    out
}

/// after - before, per counter present after.
pub fn diff(before: &SpecCounters, after: &SpecCounters) -> SpecCounters {
    after.iter().map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chunk_counters_come_from_spec_decode_or_llama_timings() {
        let mut c = SpecCounters::new();
        read_chunk(
            &json!({"choices": [], "usage": {"completion_tokens": 8, "spec_decode": {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5}}}),
            &mut c,
        );
        assert_eq!(c, SpecCounters::from([("num_drafts".into(), 3.0), ("num_draft_tokens".into(), 9.0), ("num_accepted_tokens".into(), 5.0)]));
        let mut l = SpecCounters::new();
        read_chunk(&json!({"choices": [], "timings": {"predicted_n": 16, "draft_n": 12, "draft_n_accepted": 9}}), &mut l);
        assert_eq!(l, SpecCounters::from([("num_draft_tokens".into(), 12.0), ("num_accepted_tokens".into(), 9.0)]));
        let mut none = SpecCounters::new();
        read_chunk(&json!({"choices": [{"text": "x"}]}), &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn summary_derives_rates_and_never_divides_by_zero() {
        let s =
            SpecSummary::of(SpecCounters::from([("num_drafts".into(), 4.0), ("num_draft_tokens".into(), 16.0), ("num_accepted_tokens".into(), 8.0)])).unwrap();
        assert_eq!(s.acceptance_rate, Some(0.5));
        assert_eq!(s.mean_acceptance_length, Some(3.0));
        assert!(SpecSummary::of(SpecCounters::from([("num_draft_tokens".into(), 0.0)])).is_none());
        assert!(SpecSummary::of(SpecCounters::new()).is_none());
        let partial = SpecSummary::of(SpecCounters::from([("num_accepted_tokens".into(), 3.0)])).unwrap();
        assert_eq!((partial.acceptance_rate, partial.mean_acceptance_length), (None, None));
    }

    #[test]
    fn prometheus_counters_are_summed_over_labels_whatever_the_prefix() {
        let text = "# HELP vllm:spec_decode_num_drafts_total Number of drafts.\n\
                    # TYPE vllm:spec_decode_num_drafts_total counter\n\
                    vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"m\"} 10.0\n\
                    vllm:spec_decode_num_drafts_total{engine=\"1\",model_name=\"m\"} 2.0\n\
                    vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 7.0\n\
                    specula_spec_decode_num_draft_tokens 30 1700000000\n\
                    vllm:num_requests_running 3\n";
        let c = parse_prometheus(text);
        assert_eq!(c, SpecCounters::from([("num_drafts".into(), 12.0), ("num_draft_tokens".into(), 30.0)]));
        let before = SpecCounters::from([("num_drafts".into(), 2.0)]);
        assert_eq!(diff(&before, &c), SpecCounters::from([("num_drafts".into(), 10.0), ("num_draft_tokens".into(), 30.0)]));
    }

    #[test]
    fn the_prefix_cache_share_comes_from_metrics_or_llama_timings() {
        let c = parse_prometheus(
            "specula:prefix_cache_queries 400
vllm:prefix_cache_hits_total{engine=\"0\"} 300
specula:prefix_cache_other 9
",
        );
        assert_eq!(c, SpecCounters::from([(PREFIX_CACHE_QUERIES.into(), 400.0), (PREFIX_CACHE_HITS.into(), 300.0)]));
        assert_eq!(prefix_cache_share(&c), Some(0.75));
        let mut l = SpecCounters::new();
        read_chunk(&json!({"timings": {"prompt_n": 10, "cache_n": 30}}), &mut l);
        let mut u = SpecCounters::new();
        read_chunk(&json!({"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}}), &mut u);
        assert_eq!(prefix_cache_share(&u), Some(0.64));
        assert_eq!(prefix_cache_share(&l), Some(0.75));
        assert_eq!(prefix_cache_share(&SpecCounters::from([(PREFIX_CACHE_QUERIES.into(), 0.0)])), None);
    }
}
