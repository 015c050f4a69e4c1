//! Turns the outcomes of one run into its results (throughputs, latency summaries, errors,
//! speculation counters) and prints them; the same structs are what `--output-json` writes.

use super::request::RequestOutcome;
use super::spec::{self, SpecCounters, SpecSummary};
use super::stats::Summary;
use serde::Serialize;

/// Everything one invocation measured: the configuration and one result per concurrency level.
#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub label: Option<String>,
    pub config: serde_json::Value,
    pub results: Vec<LevelResult>,
}

/// One run at one concurrency level. Latencies are in milliseconds, over completed requests only.
#[derive(Debug, Serialize)]
pub struct LevelResult {
    /// Requests in flight at most; `None` = no limit.
    pub max_concurrency: Option<usize>,
    /// Offered load in requests/s (Poisson arrivals); `None` = all requests at once.
    pub request_rate: Option<f64>,
    pub completed: usize,
    pub failed: usize,
    /// From the first request sent to the last response finished.
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    pub output_throughput: f64,
    /// Input plus output tokens per second.
    pub total_token_throughput: f64,
    pub ttft_ms: Option<Summary>,
    /// Per request: (e2e - ttft) / (output tokens - 1).
    pub tpot_ms: Option<Summary>,
    /// Over all gaps between text chunks of all requests.
    pub itl_ms: Option<Summary>,
    pub e2e_ms: Option<Summary>,
    /// Completed requests whose output tokens are a chunk count (the server sent no usage).
    pub output_tokens_counted_as_chunks: usize,
    /// Distinct failure messages, most frequent first.
    pub errors: Vec<ErrorCount>,
    /// Speculation counters the responses carried, summed over completed requests.
    pub spec_decode: Option<SpecSummary>,
    /// Speculation counters from the server's /metrics, the difference across this run.
    pub spec_decode_metrics: Option<SpecSummary>,
    /// Prompt tokens served from the server's prefix cache / prompt tokens (its /metrics, else
    /// what the responses said), where the server tells.
    pub prefix_cache_share: Option<f64>,
    /// Every request's outcome, with --save-detailed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<Vec<RequestOutcome>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: usize,
}

impl LevelResult {
    pub fn new(
        max_concurrency: Option<usize>,
        request_rate: Option<f64>,
        duration_s: f64,
        outcomes: Vec<RequestOutcome>,
        metrics_diff: Option<SpecCounters>,
        keep_requests: bool,
    ) -> LevelResult {
        let done: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
        let ms = |f: &dyn Fn(&RequestOutcome) -> Option<f64>| -> Vec<f64> { done.iter().filter_map(|o| f(o)).map(|s| s * 1e3).collect() };
        let itl: Vec<f64> = done.iter().flat_map(|o| o.itl_s.iter().map(|s| s * 1e3)).collect();
        let total_input_tokens = done.iter().map(|o| o.prompt_tokens).sum();
        let total_output_tokens = done.iter().map(|o| o.output_tokens).sum();
        let per_s = |n: usize| if duration_s > 0.0 { n as f64 / duration_s } else { 0.0 };
        let mut spec_total = SpecCounters::new();
        for o in &done {
            spec::add(&mut spec_total, &o.spec);
        }
        LevelResult {
            max_concurrency,
            request_rate,
            completed: done.len(),
            failed: outcomes.len() - done.len(),
            duration_s,
            total_input_tokens,
            total_output_tokens,
            request_throughput: per_s(done.len()),
            output_throughput: per_s(total_output_tokens),
            total_token_throughput: per_s(total_input_tokens + total_output_tokens),
            ttft_ms: Summary::of(&ms(&|o| Some(o.ttft_s))),
            tpot_ms: Summary::of(&ms(&|o| o.tpot_s())),
            itl_ms: Summary::of(&itl),
            e2e_ms: Summary::of(&ms(&|o| Some(o.e2e_s))),
            output_tokens_counted_as_chunks: done.iter().filter(|o| !o.output_tokens_from_usage).count(),
            errors: count_errors(&outcomes),
            prefix_cache_share: metrics_diff.as_ref().and_then(spec::prefix_cache_share).or_else(|| spec::prefix_cache_share(&spec_total)),
            spec_decode: SpecSummary::of(spec_total),
            spec_decode_metrics: metrics_diff.and_then(SpecSummary::of),
            requests: keep_requests.then_some(outcomes),
        }
    }
}

fn count_errors(outcomes: &[RequestOutcome]) -> Vec<ErrorCount> {
    let mut counts: Vec<ErrorCount> = Vec::new();
    for e in outcomes.iter().filter_map(|o| o.error.as_deref()) {
        match counts.iter_mut().find(|c| c.message == e) {
            Some(c) => c.count += 1,
            None => counts.push(ErrorCount { message: e.to_string(), count: 1 }),
        }
    }
    counts.sort_by_key(|c| std::cmp::Reverse(c.count));
    counts
}

fn rate_text(rate: Option<f64>) -> String {
    rate.map_or("inf".to_string(), |r| format!("{r}"))
}

fn concurrency_text(c: Option<usize>) -> String {
    c.map_or("unlimited".to_string(), |c| c.to_string())
}

/// The block printed after each run, laid out like `vllm bench serve`'s.
pub fn print_level(label: Option<&str>, r: &LevelResult) {
    let title = match label {
        Some(l) => format!(" Serving Benchmark Result: {l} "),
        None => " Serving Benchmark Result ".to_string(),
    };
    println!("{title:=^64}");
    let row = |name: &str, value: String| println!("{name:<40}{value:>24}");
    row("Maximum request concurrency:", concurrency_text(r.max_concurrency));
    row("Request rate (req/s):", rate_text(r.request_rate));
    row("Successful requests:", r.completed.to_string());
    row("Failed requests:", r.failed.to_string());
    row("Benchmark duration (s):", format!("{:.2}", r.duration_s));
    row("Total input tokens:", r.total_input_tokens.to_string());
    row("Total generated tokens:", r.total_output_tokens.to_string());
    row("Request throughput (req/s):", format!("{:.2}", r.request_throughput));
    row("Output token throughput (tok/s):", format!("{:.2}", r.output_throughput));
    row("Total token throughput (tok/s):", format!("{:.2}", r.total_token_throughput));
    if let Some(share) = r.prefix_cache_share {
        row("Prompt tokens from prefix cache:", format!("{:.1}%", share * 100.0));
    }
    println!("{:-^64}", "");
    println!("{:<16}{:>16}{:>16}{:>16}", "latency (ms)", "mean", "p50", "p99");
    for (name, s) in [("TTFT", &r.ttft_ms), ("TPOT", &r.tpot_ms), ("ITL", &r.itl_ms), ("E2E", &r.e2e_ms)] {
        match s {
            Some(s) => println!("{name:<16}{:>16.2}{:>16.2}{:>16.2}", s.mean, s.p50, s.p99),
            None => println!("{name:<16}{:>16}{:>16}{:>16}", "-", "-", "-"),
        }
    }
    for (source, s) in [("responses", &r.spec_decode), ("/metrics", &r.spec_decode_metrics)] {
        if let Some(s) = s {
            let f = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.3}"));
            let counters: Vec<String> = s.counters.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!(
                "spec decode ({source}): acceptance rate {}, mean acceptance length {} ({})",
                f(s.acceptance_rate),
                f(s.mean_acceptance_length),
                counters.join(", ")
            );
        }
    }
    if r.output_tokens_counted_as_chunks > 0 {
        println!("note: {} responses had no usage; their output tokens are text-chunk counts", r.output_tokens_counted_as_chunks);
    }
    for e in &r.errors {
        println!("error ({}x): {}", e.count, e.message);
    }
    println!("{:=^64}", "");
}

/// One kind of turn's figures in a level (a dataset's `kind`), from its successful requests.
#[derive(Debug, Clone, PartialEq)]
pub struct KindRow {
    pub kind: String,
    pub requests: usize,
    pub mean_prompt_tokens: f64,
    pub output_tokens: usize,
    /// Output tokens over the requests' summed end-to-end time: one request's speed, not the
    /// server's throughput.
    pub request_tok_s: f64,
    pub mean_ttft_ms: f64,
    /// Mean over the requests of (E2E - TTFT) / (output tokens - 1), those with 2 or more.
    pub mean_tpot_ms: Option<f64>,
    /// The share of these requests' prompt tokens their responses say the prefix cache served
    /// (None where the server does not say).
    pub prefix_cache_share: Option<f64>,
}

/// Per-kind rows, in the order the kinds first appear; empty when no prompt has a kind.
pub fn kind_rows(prompts: &[super::workload::Prompt], outcomes: &[RequestOutcome]) -> Vec<KindRow> {
    let mut order: Vec<&str> = Vec::new();
    for k in prompts.iter().filter_map(|p| p.kind.as_deref()) {
        if !order.contains(&k) {
            order.push(k);
        }
    }
    order
        .into_iter()
        .map(|kind| {
            let ok: Vec<&RequestOutcome> =
                prompts.iter().zip(outcomes).filter(|(p, o)| p.kind.as_deref() == Some(kind) && o.error.is_none()).map(|(_, o)| o).collect();
            let mean = |f: &dyn Fn(&RequestOutcome) -> Option<f64>| Summary::of(&ok.iter().filter_map(|o| f(o)).collect::<Vec<_>>()).map(|s| s.mean);
            let output_tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
            let e2e: f64 = ok.iter().map(|o| o.e2e_s).sum();
            KindRow {
                kind: kind.to_string(),
                requests: ok.len(),
                mean_prompt_tokens: mean(&|o| Some(o.prompt_tokens as f64)).unwrap_or(0.0),
                output_tokens,
                request_tok_s: if e2e > 0.0 { output_tokens as f64 / e2e } else { 0.0 },
                mean_ttft_ms: mean(&|o| Some(o.ttft_s * 1e3)).unwrap_or(0.0),
                mean_tpot_ms: mean(&|o| o.tpot_s().map(|s| s * 1e3)),
                prefix_cache_share: spec::prefix_cache_share(&ok.iter().fold(SpecCounters::new(), |mut t, o| {
                    spec::add(&mut t, &o.spec);
                    t
                })),
            }
        })
        .collect()
}

/// The per-kind table after a level, when the dataset names kinds of turn.
pub fn print_kinds(rows: &[KindRow]) {
    if rows.is_empty() {
        return;
    }
    println!(
        "{:<12} {:>5} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "turn kind", "reqs", "prompt tok", "cached", "out tok", "req tok/s", "TTFT ms", "TPOT ms"
    );
    for r in rows {
        let tpot = r.mean_tpot_ms.map_or("-".to_string(), |t| format!("{t:.1}"));
        let cached = r.prefix_cache_share.map_or("-".to_string(), |s| format!("{:.0}%", s * 100.0));
        println!(
            "{:<12} {:>5} {:>10.0} {:>8} {:>10} {:>10.2} {:>10.1} {:>10}",
            r.kind, r.requests, r.mean_prompt_tokens, cached, r.output_tokens, r.request_tok_s, r.mean_ttft_ms, tpot
        );
    }
}

/// One line per level, to compare the levels of a `--max-concurrency` sweep at a glance.
pub fn print_sweep(label: Option<&str>, results: &[LevelResult]) {
    println!("\nSweep{}", label.map_or(String::new(), |l| format!(": {l}")));
    println!(
        "{:>11} {:>5} {:>5} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "concurrency", "ok", "fail", "req/s", "out tok/s", "TTFT p50", "TPOT p50", "ITL p50", "E2E p50"
    );
    let p50 = |s: &Option<Summary>| s.map_or("-".to_string(), |s| format!("{:.2}", s.p50));
    for r in results {
        println!(
            "{:>11} {:>5} {:>5} {:>8.2} {:>10.2} {:>10} {:>10} {:>10} {:>10}",
            concurrency_text(r.max_concurrency),
            r.completed,
            r.failed,
            r.request_throughput,
            r.output_throughput,
            p50(&r.ttft_ms),
            p50(&r.tpot_ms),
            p50(&r.itl_ms),
            p50(&r.e2e_ms)
        );
    }
    println!("(latencies in ms)");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ttft: f64, e2e: f64, tokens: usize, itl: &[f64]) -> RequestOutcome {
        RequestOutcome {
            error: None,
            prompt_tokens: 10,
            output_tokens: tokens,
            output_tokens_from_usage: true,
            ttft_s: ttft,
            e2e_s: e2e,
            itl_s: itl.to_vec(),
            spec: SpecCounters::new(),
        }
    }

    fn failed(msg: &str) -> RequestOutcome {
        RequestOutcome { error: Some(msg.into()), ..ok(0.0, 0.1, 0, &[]) }
    }

    #[test]
    fn kind_rows_group_completed_turns_by_kind_in_first_seen_order() {
        let turn = |kind: Option<&str>| super::super::workload::Prompt {
            text: String::new(),
            messages: None,
            conversation: Some("c".into()),
            kind: kind.map(str::to_string),
            max_tokens: 8,
            approx_tokens: 1,
        };
        let prompts = [turn(Some("edit")), turn(Some("call")), turn(Some("edit")), turn(None), turn(Some("call"))];
        let outcomes = [ok(0.1, 0.5, 5, &[]), ok(0.2, 0.2, 1, &[]), ok(0.3, 0.7, 3, &[]), ok(0.1, 0.2, 2, &[]), failed("x")];
        let rows = kind_rows(&prompts, &outcomes);
        assert_eq!(rows.iter().map(|r| (r.kind.as_str(), r.requests, r.output_tokens)).collect::<Vec<_>>(), [("edit", 2, 8), ("call", 1, 1)]);
        let edit = &rows[0];
        // 8 tokens over 1.2 s of the two requests; TTFT 100 and 300 ms; TPOT 100 and 200 ms
        assert!((edit.request_tok_s - 8.0 / 1.2).abs() < 1e-9 && (edit.mean_ttft_ms - 200.0).abs() < 1e-9);
        assert!((edit.mean_tpot_ms.unwrap() - 150.0).abs() < 1e-9 && edit.mean_prompt_tokens == 10.0);
        // one token: no TPOT
        assert_eq!(rows[1].mean_tpot_ms, None);
        assert!(kind_rows(&[turn(None)], &[ok(0.1, 0.2, 2, &[])]).is_empty());
    }

    #[test]
    fn level_result_counts_only_completed_requests_in_throughput_and_latency() {
        let outcomes = vec![ok(0.1, 0.5, 5, &[0.1, 0.3]), ok(0.3, 0.7, 3, &[0.2]), failed("HTTP 500: boom"), failed("HTTP 500: boom"), failed("timeout")];
        let r = LevelResult::new(Some(2), None, 2.0, outcomes, None, false);
        assert_eq!((r.completed, r.failed), (2, 3));
        assert_eq!((r.total_input_tokens, r.total_output_tokens), (20, 8));
        assert_eq!((r.request_throughput, r.output_throughput, r.total_token_throughput), (1.0, 4.0, 14.0));
        let ttft = r.ttft_ms.unwrap();
        assert!((ttft.mean - 200.0).abs() < 1e-9 && (ttft.p50 - 200.0).abs() < 1e-9);
        // TPOT: (0.5 - 0.1) / 4 = 100 ms and (0.7 - 0.3) / 2 = 200 ms.
        assert!((r.tpot_ms.unwrap().mean - 150.0).abs() < 1e-9);
        let itl = r.itl_ms.unwrap();
        assert_eq!(itl.count, 3);
        assert!((itl.p50 - 200.0).abs() < 1e-9);
        assert_eq!(r.errors, vec![ErrorCount { message: "HTTP 500: boom".into(), count: 2 }, ErrorCount { message: "timeout".into(), count: 1 }]);
        assert!(r.requests.is_none());
    }

    #[test]
    fn all_failed_level_has_no_latencies_and_zero_throughput() {
        let r = LevelResult::new(None, Some(2.0), 0.0, vec![failed("x")], None, true);
        assert_eq!((r.completed, r.failed, r.request_throughput), (0, 1, 0.0));
        assert!(r.ttft_ms.is_none() && r.e2e_ms.is_none());
        assert_eq!(r.requests.as_ref().map(Vec::len), Some(1));
        print_level(Some("smoke"), &r); // must not panic on empty summaries
    }
}
