//! Prometheus metrics: installs the process-wide recorder once (the engine thread records its
//! own gauges through the same `metrics` facade), records the per-request numbers the server
//! sees, and renders everything for `GET /metrics`. Names follow vLLM's with our `specula:` prefix.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use specula_engine::api::FinishReason;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::AppState;

pub const PROMPT_TOKENS: &str = "specula:prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "specula:generation_tokens_total";
pub const REQUEST_SUCCESS: &str = "specula:request_success_total";
pub const TIME_TO_FIRST_TOKEN: &str = "specula:time_to_first_token_seconds";
pub const TIME_PER_OUTPUT_TOKEN: &str = "specula:time_per_output_token_seconds";
pub const E2E_REQUEST_LATENCY: &str = "specula:e2e_request_latency_seconds";

// vLLM's buckets, so dashboards built for it read ours the same way.
const TTFT_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const TPOT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const E2E_BUCKETS: &[f64] = &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0];
/// Engine step phases and the gaps between forward passes (async scheduling): 10 µs to 10 s.
pub const STEP_PHASE: &str = "specula:step_phase_seconds";
pub const FORWARD_GAP: &str = "specula:forward_gap_seconds";
pub const COMPUTE_IDLE_GAP: &str = "specula:compute_idle_gap_seconds";
const STEP_BUCKETS: &[f64] = &[0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0];

/// How often histograms are folded into their rendered form (bounds memory between scrapes).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The handle of the process-wide Prometheus recorder, installed on first use. Every later call
/// (many servers in one test process, say) shares it. If some other recorder was installed
/// first, the server gets a detached recorder, logs why, and `/metrics` stays mostly empty.
pub fn prometheus_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(install).clone()
}

fn install() -> PrometheusHandle {
    let builder = [
        (TIME_TO_FIRST_TOKEN, TTFT_BUCKETS),
        (TIME_PER_OUTPUT_TOKEN, TPOT_BUCKETS),
        (E2E_REQUEST_LATENCY, E2E_BUCKETS),
        (STEP_PHASE, STEP_BUCKETS),
        (FORWARD_GAP, STEP_BUCKETS),
        (COMPUTE_IDLE_GAP, STEP_BUCKETS),
    ]
    .into_iter()
    .try_fold(PrometheusBuilder::new(), |b, (name, buckets)| b.set_buckets_for_metric(Matcher::Full(name.into()), buckets))
    .expect("bucket lists are non-empty constants");
    let handle = match builder.install_recorder() {
        Ok(handle) => handle,
        Err(e) => {
            tracing::warn!("cannot install the Prometheus recorder ({e}); /metrics will not show engine or request metrics");
            PrometheusBuilder::new().build_recorder().handle()
        }
    };
    describe();
    let upkeep = handle.clone();
    let spawned = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || loop {
        std::thread::sleep(UPKEEP_INTERVAL);
        upkeep.run_upkeep();
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the metrics upkeep thread ({e}); histograms are folded at scrape time only");
    }
    handle
}

fn describe() {
    use metrics::{describe_counter, describe_histogram, Unit};
    describe_counter!(PROMPT_TOKENS, Unit::Count, "Prompt tokens of finished requests.");
    describe_counter!(GENERATION_TOKENS, Unit::Count, "Generated tokens of finished requests.");
    describe_counter!(REQUEST_SUCCESS, Unit::Count, "Finished requests, by finished_reason (stop, length, abort).");
    describe_histogram!(TIME_TO_FIRST_TOKEN, Unit::Seconds, "Time from request arrival to its first generated token.");
    describe_histogram!(TIME_PER_OUTPUT_TOKEN, Unit::Seconds, "Mean time between generated tokens, per request.");
    describe_histogram!(E2E_REQUEST_LATENCY, Unit::Seconds, "Time from request arrival to its last event.");
    describe_histogram!(STEP_PHASE, Unit::Seconds, "Engine step time by phase (schedule, prepare, forward, sample, propose, update).");
    describe_histogram!(FORWARD_GAP, Unit::Seconds, "Time from the end of one forward pass to the start of the next (sampling included).");
    describe_histogram!(COMPUTE_IDLE_GAP, Unit::Seconds, "Time the compute side waits on host work between steps (job end to next forward pass).");
}

/// Timings of one engine request (one choice), recorded as its events arrive.
#[derive(Debug, Clone)]
pub struct RequestTimer {
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl RequestTimer {
    pub fn new(arrived: Instant) -> Self {
        Self { arrived, first_token: None, last_token: None }
    }

    pub fn on_tokens(&mut self, count: usize) {
        if count == 0 {
            return;
        }
        let now = Instant::now();
        if self.first_token.is_none() {
            self.first_token = Some(now);
            metrics::histogram!(TIME_TO_FIRST_TOKEN).record(now.duration_since(self.arrived).as_secs_f64());
        }
        self.last_token = Some(now);
    }

    pub fn on_finished(&self, reason: FinishReason, prompt_tokens: usize, completion_tokens: usize) {
        metrics::counter!(PROMPT_TOKENS).increment(prompt_tokens as u64);
        metrics::counter!(GENERATION_TOKENS).increment(completion_tokens as u64);
        metrics::counter!(REQUEST_SUCCESS, "finished_reason" => reason.as_str()).increment(1);
        if let (Some(first), Some(last)) = (self.first_token, self.last_token) {
            if completion_tokens > 1 {
                let per_token = last.duration_since(first).as_secs_f64() / (completion_tokens - 1) as f64;
                metrics::histogram!(TIME_PER_OUTPUT_TOKEN).record(per_token);
            }
        }
        metrics::histogram!(E2E_REQUEST_LATENCY).record(self.arrived.elapsed().as_secs_f64());
    }
}

/// `GET /metrics`: the Prometheus text exposition of everything recorded in this process.
pub async fn render(State(state): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.metrics.render())
}
