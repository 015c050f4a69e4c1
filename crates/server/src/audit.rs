//! The live exactness audit (`--speculative-audit F`): a fraction `F` of the finished requests
//! whose output is determined (greedy, or seeded) is replayed on the same engine with speculation
//! off, and the replay's tokens and logprobs are compared with what was served. `/metrics`
//! counts the outcomes (`specula:spec_audit_requests_total{result=...}`); a divergence is logged
//! with the request id, the first differing position and both tokens.
//!
//! Replays never delay live work: one runs only while no live choice is in flight, and is
//! aborted (and retried later, a few times at most) as soon as one arrives. What waits is a
//! bounded queue; a finished request offered to a full queue is counted `skipped`.
//! Not for choosing what to speculate or for the engine's own acceptance metrics (`speculative/`).

use specula_engine::api::{FinishReason, GenerateRequest, RequestEvent, SamplingParams, TokenLogprob};
use specula_engine::constraint::Grammar;
use specula_engine::handle::EngineHandle;
use specula_engine::types::{RequestId, TokenId};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

pub const AUDIT_REQUESTS: &str = "specula:spec_audit_requests_total";
/// Audited choices not yet judged: waiting in the queue or being replayed (a bench run waits for
/// it to reach 0 before it reads the verdicts).
pub const AUDIT_PENDING: &str = "specula:spec_audit_pending";
/// Finished requests that may wait for their replay: enough for a whole benchmark run at
/// concurrency 8 (replays run only in idle time, so under load they wait). A job holds its prompt
/// and output tokens, 4 bytes each: at most 256 x `--max-model-len` tokens, 32 MiB at 32 768.
const QUEUE: usize = 256;
/// Times a replay is cut short by live work before its request is skipped.
const MAX_TRIES: u32 = 32;
/// How often a running replay looks for live work, and an idle auditor for the end of it.
const POLL: Duration = Duration::from_millis(5);
/// Largest difference between a served and a replayed token's logprob still counted as equal
/// (the verified rows are computed in one pass over k + 1 positions, the replay's one at a time).
pub const LOGPROB_TOLERANCE: f32 = 1e-3;

/// What a replay is compared with: one finished choice as it was served.
pub struct AuditJob {
    pub request: RequestId,
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    /// A fresh copy of the request's compiled constraint (never the one that ran).
    pub grammar: Option<Grammar>,
    pub tokens: Vec<TokenId>,
    /// The served tokens' logprobs, when the request asked for them.
    pub logprobs: Vec<f32>,
    tries: u32,
}

/// How a replay compared (the `result` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Identical,
    Diverged,
    Skipped,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Identical => "identical",
            Verdict::Diverged => "diverged",
            Verdict::Skipped => "skipped",
        }
    }
}

/// The first difference between what was served and the replay: `(position, served, replayed)`
/// with tokens (`None`: that side had ended), or the first logprob beyond the tolerance.
#[derive(Clone, Debug, PartialEq)]
pub enum Difference {
    Token { position: usize, served: Option<TokenId>, replayed: Option<TokenId> },
    Logprob { position: usize, served: f32, replayed: f32 },
}

/// Compares a served choice with its replay.
pub fn compare(served: &[TokenId], served_lp: &[f32], replayed: &[TokenId], replayed_lp: &[f32]) -> Option<Difference> {
    let n = served.len().max(replayed.len());
    if let Some(position) = (0..n).find(|&i| served.get(i) != replayed.get(i)) {
        return Some(Difference::Token { position, served: served.get(position).copied(), replayed: replayed.get(position).copied() });
    }
    served_lp
        .iter()
        .zip(replayed_lp)
        .enumerate()
        .find(|(_, (a, b))| (*a - *b).abs() > LOGPROB_TOLERANCE || a.is_nan() != b.is_nan())
        .map(|(position, (&served, &replayed))| Difference::Logprob { position, served, replayed })
}

/// The auditor a server holds: picks the requests to replay, counts live choices, and feeds
/// the replay task.
pub struct Auditor {
    fraction: f64,
    credit: Mutex<f64>,
    queue: mpsc::Sender<AuditJob>,
    live: Arc<AtomicUsize>,
    /// Jobs queued or in replay (the `AUDIT_PENDING` gauge).
    pending: Arc<AtomicUsize>,
}

/// Counts one live choice while it lives (see [`Auditor::live`]).
pub struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Auditor {
    /// Starts the replay task on the current tokio runtime; `fraction` in (0, 1].
    pub fn start(engine: EngineHandle, fraction: f64) -> Arc<Self> {
        let (queue, rx) = mpsc::channel(QUEUE);
        let live = Arc::new(AtomicUsize::new(0));
        let pending = Arc::new(AtomicUsize::new(0));
        for v in [Verdict::Identical, Verdict::Diverged, Verdict::Skipped] {
            metrics::counter!(AUDIT_REQUESTS, "result" => v.label()).absolute(0);
        }
        metrics::gauge!(AUDIT_PENDING).set(0.0);
        tokio::spawn(run(engine, rx, live.clone(), pending.clone()));
        Arc::new(Self { fraction, credit: Mutex::new(0.0), queue, live, pending })
    }

    /// Whether a choice with these parameters has one right output to compare with.
    pub fn determined(params: &SamplingParams) -> bool {
        !params.disable_speculation && (params.temperature == 0.0 || params.seed.is_some())
    }

    /// Whether this finished choice is one of the fraction to audit (every 1/F-th, so the
    /// share holds exactly over any run, not on average).
    pub fn pick(&self) -> bool {
        let mut credit = self.credit.lock().unwrap_or_else(|p| p.into_inner());
        *credit += self.fraction;
        if *credit >= 1.0 - 1e-9 {
            *credit -= 1.0;
            true
        } else {
            false
        }
    }

    /// Marks a live choice in flight until the guard drops.
    pub fn live(&self) -> LiveGuard {
        self.live.fetch_add(1, Ordering::SeqCst);
        LiveGuard(self.live.clone())
    }

    /// Queues a finished choice for its replay (counted skipped when the queue is full).
    pub fn offer(&self, request: RequestId, prompt: Vec<TokenId>, params: SamplingParams, grammar: Option<Grammar>, tokens: Vec<TokenId>, logprobs: Vec<f32>) {
        let job = AuditJob { request, prompt, params, grammar, tokens, logprobs, tries: 0 };
        // counted before it is sent, so the replay task's decrement can never come first
        add_pending(&self.pending, 1);
        if self.queue.try_send(job).is_err() {
            add_pending(&self.pending, -1);
            tracing::debug!(request = %request, "speculative audit: queue full, skipped");
            record(Verdict::Skipped);
        }
    }
}

fn record(v: Verdict) {
    metrics::counter!(AUDIT_REQUESTS, "result" => v.label()).increment(1);
}

/// Moves the pending count by `delta` (+1 or -1) and publishes it.
fn add_pending(pending: &AtomicUsize, delta: isize) {
    let now = if delta >= 0 { pending.fetch_add(1, Ordering::SeqCst) + 1 } else { pending.fetch_sub(1, Ordering::SeqCst).saturating_sub(1) };
    metrics::gauge!(AUDIT_PENDING).set(now as f64);
}

/// What one replay attempt came to.
enum Replay {
    Done {
        tokens: Vec<TokenId>,
        logprobs: Vec<f32>,
    },
    /// Live work arrived; the replay was aborted.
    Preempted,
    Failed(String),
}

async fn run(engine: EngineHandle, mut rx: mpsc::Receiver<AuditJob>, live: Arc<AtomicUsize>, pending: Arc<AtomicUsize>) {
    while let Some(mut job) = rx.recv().await {
        audit_one(&engine, &mut job, &live).await;
        add_pending(&pending, -1);
    }
}

/// Replays one job until it is judged or skipped.
async fn audit_one(engine: &EngineHandle, job: &mut AuditJob, live: &AtomicUsize) {
    loop {
        while live.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(POLL).await;
        }
        match replay(engine, job, live).await {
            Replay::Done { tokens, logprobs } => return judge(job, &tokens, &logprobs),
            Replay::Preempted if job.tries + 1 < MAX_TRIES => job.tries += 1,
            Replay::Preempted => {
                tracing::debug!(request = %job.request, "speculative audit: never idle long enough, skipped");
                return record(Verdict::Skipped);
            }
            Replay::Failed(message) => {
                tracing::warn!(request = %job.request, "speculative audit: the replay failed ({message}), skipped");
                return record(Verdict::Skipped);
            }
        }
    }
}

fn judge(job: &AuditJob, tokens: &[TokenId], logprobs: &[f32]) {
    match compare(&job.tokens, &job.logprobs, tokens, logprobs) {
        None => {
            tracing::debug!(request = %job.request, tokens = tokens.len(), "speculative audit: identical");
            record(Verdict::Identical);
        }
        Some(Difference::Token { position, served, replayed }) => {
            let token = |t: Option<TokenId>| t.map_or_else(|| "(ended)".to_string(), |t| t.to_string());
            tracing::warn!(
                request = %job.request,
                position,
                served = %token(served),
                replayed = %token(replayed),
                "speculative audit: DIVERGED: the output differs from decoding without speculation"
            );
            record(Verdict::Diverged);
        }
        Some(Difference::Logprob { position, served, replayed }) => {
            tracing::warn!(request = %job.request, position, served, replayed, "speculative audit: DIVERGED: a logprob differs from decoding without speculation");
            record(Verdict::Diverged);
        }
    }
}

/// Runs the job's request again without speculation, aborting it as soon as a live choice is
/// in flight.
async fn replay(engine: &EngineHandle, job: &AuditJob, live: &AtomicUsize) -> Replay {
    let id = engine.next_request_id();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let params = SamplingParams { disable_speculation: true, ..job.params.clone() };
    let request = GenerateRequest { id, prompt: job.prompt.clone(), params, events: tx, grammar: job.grammar.clone() };
    if let Err(e) = engine.submit(request) {
        return Replay::Failed(e.to_string());
    }
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    loop {
        let event = tokio::select! {
            e = rx.recv() => e,
            _ = tokio::time::sleep(POLL) => {
                if live.load(Ordering::SeqCst) > 0 {
                    engine.abort(id);
                    return Replay::Preempted;
                }
                continue;
            }
        };
        match event {
            Some(RequestEvent::Delta { tokens: t, logprobs: l, .. }) => {
                tokens.extend(t);
                logprobs.extend(l.iter().map(|x: &TokenLogprob| x.logprob));
            }
            Some(RequestEvent::PromptLogprobs { .. }) => {}
            Some(RequestEvent::Finished { reason: FinishReason::Abort, .. }) => return Replay::Preempted,
            Some(RequestEvent::Finished { .. }) => return Replay::Done { tokens, logprobs },
            Some(RequestEvent::Failed { message }) => return Replay::Failed(message),
            None => return Replay::Failed("the engine stopped".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_finds_the_first_difference() {
        assert_eq!(compare(&[1, 2, 3], &[], &[1, 2, 3], &[]), None);
        assert_eq!(compare(&[1, 2, 3], &[], &[1, 5, 3], &[]), Some(Difference::Token { position: 1, served: Some(2), replayed: Some(5) }));
        assert_eq!(compare(&[1, 2], &[], &[1, 2, 3], &[]), Some(Difference::Token { position: 2, served: None, replayed: Some(3) }));
        assert_eq!(compare(&[1, 2], &[-0.5, -1.0], &[1, 2], &[-0.5, -1.0005]), None);
        assert_eq!(compare(&[1, 2], &[-0.5, -1.0], &[1, 2], &[-0.5, -1.1]), Some(Difference::Logprob { position: 1, served: -1.0, replayed: -1.1 }));
    }

    #[test]
    fn the_fraction_picks_exactly_every_nth() {
        let (queue, _rx) = mpsc::channel(1);
        let a = Auditor { fraction: 0.25, credit: Mutex::new(0.0), queue, live: Arc::default(), pending: Arc::default() };
        let picks: Vec<bool> = (0..12).map(|_| a.pick()).collect();
        assert_eq!(picks.iter().filter(|&&p| p).count(), 3, "{picks:?}");
        assert!(picks[3] && picks[7] && picks[11], "{picks:?}");
    }

    #[test]
    fn only_determined_outputs_are_audited() {
        let greedy = SamplingParams::greedy(4);
        assert!(Auditor::determined(&greedy));
        assert!(Auditor::determined(&SamplingParams { temperature: 0.8, seed: Some(3), ..greedy.clone() }));
        assert!(!Auditor::determined(&SamplingParams { temperature: 0.8, seed: None, ..greedy.clone() }));
        assert!(!Auditor::determined(&SamplingParams { disable_speculation: true, ..greedy }));
    }
}
