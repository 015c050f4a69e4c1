//! What every data-parallel rank does the same way, whichever loop drives it (`replica` or
//! `lockstep`): taking commands from its channel, per-rank counters, and per-rank metrics with a
//! `rank` label (the engine's own unlabeled gauges are written by every rank of the process).

use crate::api::RequestEvent;
use crate::engine::Engine;
use crate::handle::EngineCommand;
use crate::types::RequestId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Counters of one rank, shared with whoever watches it (tests, logs). Raw counts; ratios are
/// computed when read.
#[derive(Debug, Default)]
pub struct RankStats {
    /// Metadata agreements (lockstep only): exactly one collective each.
    pub agreements: AtomicU64,
    /// Steps that ran this rank's own batch.
    pub steps: AtomicU64,
    /// Steps that ran a dummy batch because this rank had nothing scheduled.
    pub dummy_steps: AtomicU64,
    /// Agreements where no rank had tokens to run (idle together).
    pub idle_agreements: AtomicU64,
    /// Tokens of this rank's real batches.
    pub tokens: AtomicU64,
    /// Rows run only to match the padded batch size (dummy rows and padding).
    pub padding_tokens: AtomicU64,
    /// Time spent inside collectives, in nanoseconds.
    pub collective_nanos: AtomicU64,
}

impl RankStats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    pub fn collective_time(&self) -> Duration {
        Duration::from_nanos(self.collective_nanos.load(Ordering::Relaxed))
    }

    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Shutdown state of one rank's command handling.
#[derive(Debug, Default)]
pub(crate) struct Commands {
    /// When in-flight requests must be done; set by the first shutdown (own or agreed).
    pub shutdown_at: Option<Instant>,
}

impl Commands {
    pub fn begin_shutdown(&mut self, grace: Duration) {
        if self.shutdown_at.is_none() {
            self.shutdown_at = Some(Instant::now() + grace);
        }
    }

    /// Applies one command to `engine` as `Engine::run` does.
    pub fn apply(&mut self, engine: &mut Engine, cmd: EngineCommand) {
        match cmd {
            EngineCommand::Submit(req) => {
                if self.shutdown_at.is_some() {
                    engine.counters.waiting.fetch_sub(1, Ordering::Relaxed);
                    let _ = req.events.send(RequestEvent::Failed { message: "the server is shutting down".into() });
                } else {
                    engine.add_request(req);
                }
            }
            EngineCommand::Abort(id) => engine.abort(id),
            EngineCommand::Shutdown => self.begin_shutdown(engine.cfg.shutdown_grace),
        }
    }

    /// Whether the grace period has run out.
    pub fn grace_over(&self) -> bool {
        self.shutdown_at.is_some_and(|d| Instant::now() >= d)
    }
}

/// Aborts requests whose client went away (as `Engine::step` does before scheduling).
pub(crate) fn reap_disconnected(engine: &mut Engine) {
    let gone: Vec<RequestId> = engine.seqs.values().filter(|s| s.events.is_closed()).map(|s| s.request).collect();
    for id in gone {
        tracing::debug!(request = %id, "client disconnected; aborting");
        engine.abort(id);
    }
}

/// Publishes one rank's gauges and counter increments under a `rank` label.
pub(crate) struct RankMetrics {
    rank: String,
    /// Counter values already published, so each publish adds only the difference.
    published: [u64; 5],
    collective_published: u64,
}

impl RankMetrics {
    pub fn new(rank: usize) -> Self {
        let m = Self { rank: rank.to_string(), published: [0; 5], collective_published: 0 };
        // every series exists from the start, not from its first increment
        for name in Self::COUNTERS {
            metrics::counter!(name, "rank" => m.rank.clone()).increment(0);
        }
        metrics::gauge!("specula:dp_collective_seconds_total", "rank" => m.rank.clone()).increment(0.0);
        m
    }

    const COUNTERS: [&'static str; 5] =
        ["specula:dp_agreements_total", "specula:dp_steps_total", "specula:dp_dummy_steps_total", "specula:dp_tokens_total", "specula:dp_padding_tokens_total"];

    pub fn publish(&mut self, engine: &Engine, stats: &RankStats) {
        let r = || self.rank.clone();
        metrics::gauge!("specula:num_requests_running", "rank" => r()).set(engine.scheduler.num_running() as f64);
        metrics::gauge!("specula:num_requests_waiting", "rank" => r()).set(engine.scheduler.num_waiting() as f64);
        metrics::gauge!("specula:kv_cache_usage_perc", "rank" => r()).set(engine.kv.usage() as f64);
        let now = [&stats.agreements, &stats.steps, &stats.dummy_steps, &stats.tokens, &stats.padding_tokens].map(RankStats::get);
        for (i, name) in Self::COUNTERS.iter().enumerate() {
            let delta = now[i].saturating_sub(self.published[i]);
            if delta > 0 {
                metrics::counter!(*name, "rank" => r()).increment(delta);
            }
        }
        self.published = now;
        let nanos = RankStats::get(&stats.collective_nanos);
        let delta = nanos.saturating_sub(self.collective_published);
        if delta > 0 {
            metrics::gauge!("specula:dp_collective_seconds_total", "rank" => r()).increment(delta as f64 * 1e-9);
        }
        self.collective_published = nanos;
    }
}

/// The text of a caught panic.
pub(crate) fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "unknown panic".into())
}
