//! What every data-parallel rank has the same way, whichever loop drives it (`replica` or
//! `lockstep`): what a rank is built from ([`RankSetup`]), its raw counters ([`RankStats`], and
//! the [`RankSnapshot`] an MPI rank sends to rank 0), and its metrics under a `rank` label
//! ([`RankMetrics`]; the engine's own unlabeled gauges are written by every rank of the process).
//! Not the command handling: every rank takes its commands in the one engine loop
//! (`engine_loop::Commands`), with a `LoopHook` of `dp::group` or `dp::lockstep`.

use crate::config::EngineConfig;
use crate::engine::Engine;
use crate::fault::FaultInjection;
use crate::speculative::{Proposer, SpecConfig};
use serde::{Deserialize, Serialize};
use specula_model::LlamaModel;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// What one rank is built from.
pub struct RankSetup {
    pub model: LlamaModel,
    pub spec: Option<(SpecConfig, Box<dyn Proposer>)>,
    /// This rank's own test-only fault switch; replaces the group configuration's
    /// `EngineConfig::fault_injection` on this rank (see [`Self::with_fault_injection`]).
    fault_injection: Option<FaultInjection>,
}

impl RankSetup {
    pub fn new(model: LlamaModel) -> Self {
        Self { model, spec: None, fault_injection: None }
    }

    pub fn with_speculation(mut self, cfg: SpecConfig, proposer: Box<dyn Proposer>) -> Self {
        self.spec = Some((cfg, proposer));
        self
    }

    /// Test-only: injects `fault` into this rank alone (the group's configuration applies to
    /// every rank, and its switch would trip on each rank that prepares the step).
    #[doc(hidden)]
    pub fn with_fault_injection(mut self, fault: FaultInjection) -> Self {
        self.fault_injection = Some(fault);
        self
    }

    /// The configuration this rank runs with: `cfg`, with this rank's own fault switch.
    pub(crate) fn config(&self, cfg: &EngineConfig) -> EngineConfig {
        EngineConfig { fault_injection: self.fault_injection.or(cfg.fault_injection), ..cfg.clone() }
    }
}

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
    /// Gauges as last published: requests running, requests waiting, KV usage (f32 bits).
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub kv_usage_bits: AtomicU32,
}

/// One rank's counters and gauges at one moment: what an MPI rank sends to rank 0 so that
/// rank 0's /metrics shows every rank (`bridge`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankSnapshot {
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f32,
    pub agreements: u64,
    pub steps: u64,
    pub dummy_steps: u64,
    pub tokens: u64,
    pub padding_tokens: u64,
    pub collective_nanos: u64,
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

    pub fn snapshot(&self) -> RankSnapshot {
        let g = Self::get;
        RankSnapshot {
            running: g(&self.running),
            waiting: g(&self.waiting),
            kv_usage: f32::from_bits(self.kv_usage_bits.load(Ordering::Relaxed)),
            agreements: g(&self.agreements),
            steps: g(&self.steps),
            dummy_steps: g(&self.dummy_steps),
            tokens: g(&self.tokens),
            padding_tokens: g(&self.padding_tokens),
            collective_nanos: g(&self.collective_nanos),
        }
    }

    fn set_gauges(&self, engine: &Engine) {
        let (running, waiting, kv_usage) = engine.load();
        self.running.store(running as u64, Ordering::Relaxed);
        self.waiting.store(waiting as u64, Ordering::Relaxed);
        self.kv_usage_bits.store(kv_usage.to_bits(), Ordering::Relaxed);
    }
}

/// Publishes one rank's gauges and counter increments under a `rank` label, and keeps the
/// unlabeled gauges (`specula:num_requests_running`, `..._waiting`, `kv_cache_usage_perc`) as the
/// aggregate over the ranks this process knows (its own, and on MPI rank 0 the remote ones):
/// sums of requests, mean KV usage. (Each replica's engine also writes its own values to the
/// unlabeled gauges at the end of a step; the publish right after that step restores the
/// aggregate.)
pub struct RankMetrics {
    rank: usize,
    label: String,
    /// Counter values already published, so each publish adds only the difference.
    published: [u64; 5],
    collective_published: u64,
}

/// Latest (running, waiting, kv usage) of every rank publishing in this process, for the
/// unlabeled aggregate.
static RANK_GAUGES: Mutex<BTreeMap<usize, (u64, u64, f32)>> = Mutex::new(BTreeMap::new());

impl RankMetrics {
    pub fn new(rank: usize) -> Self {
        let m = Self { rank, label: rank.to_string(), published: [0; 5], collective_published: 0 };
        // every series exists from the start, not from its first increment
        for name in Self::COUNTERS {
            metrics::counter!(name, "rank" => m.label.clone()).increment(0);
        }
        metrics::gauge!("specula:dp_collective_seconds_total", "rank" => m.label.clone()).increment(0.0);
        m
    }

    const COUNTERS: [&'static str; 5] =
        ["specula:dp_agreements_total", "specula:dp_steps_total", "specula:dp_dummy_steps_total", "specula:dp_tokens_total", "specula:dp_padding_tokens_total"];

    /// Records the engine's gauges in `stats` and publishes everything.
    pub(crate) fn publish(&mut self, engine: &Engine, stats: &RankStats) {
        stats.set_gauges(engine);
        self.publish_snapshot(&stats.snapshot());
    }

    /// Publishes a rank's snapshot (a local rank's, or one an MPI rank sent).
    pub fn publish_snapshot(&mut self, s: &RankSnapshot) {
        let r = || self.label.clone();
        metrics::gauge!("specula:num_requests_running", "rank" => r()).set(s.running as f64);
        metrics::gauge!("specula:num_requests_waiting", "rank" => r()).set(s.waiting as f64);
        metrics::gauge!("specula:kv_cache_usage_perc", "rank" => r()).set(s.kv_usage as f64);
        let now = [s.agreements, s.steps, s.dummy_steps, s.tokens, s.padding_tokens];
        for (i, name) in Self::COUNTERS.iter().enumerate() {
            let delta = now[i].saturating_sub(self.published[i]);
            if delta > 0 {
                metrics::counter!(*name, "rank" => r()).increment(delta);
            }
        }
        self.published = now;
        let delta = s.collective_nanos.saturating_sub(self.collective_published);
        if delta > 0 {
            metrics::gauge!("specula:dp_collective_seconds_total", "rank" => r()).increment(delta as f64 * 1e-9);
        }
        self.collective_published = s.collective_nanos;
        self.publish_aggregate(s);
    }

    fn publish_aggregate(&self, s: &RankSnapshot) {
        let mut all = RANK_GAUGES.lock().unwrap_or_else(|e| e.into_inner());
        all.insert(self.rank, (s.running, s.waiting, s.kv_usage));
        let running: u64 = all.values().map(|v| v.0).sum();
        let waiting: u64 = all.values().map(|v| v.1).sum();
        let kv = all.values().map(|v| v.2 as f64).sum::<f64>() / all.len() as f64;
        metrics::gauge!("specula:num_requests_running").set(running as f64);
        metrics::gauge!("specula:num_requests_waiting").set(waiting as f64);
        metrics::gauge!("specula:kv_cache_usage_perc").set(kv);
    }
}
