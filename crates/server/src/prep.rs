//! The prep pool: where a request's CPU-heavy preparation runs (tokenizing prompts, rendering
//! chat templates, compiling grammars), so that none of it runs on the async workers that answer
//! `/health` and feed streams, nor on the engine thread.
//!
//! Bounded twice: a semaphore lets at most `threads` preparations run at once (on tokio's
//! blocking threads), and at most `queue` more may wait for one; a request past that gets a 503
//! `overloaded` at once. A preparation whose client went away still finishes on its thread,
//! holding its place, so the bound counts the work really in progress.
//!
//! Not here: the count and size checks that come before any of this work (`bounds.rs`).

use crate::error::ApiError;
use crate::{bounds, ServerConfig};
use specula_engine::api::Constraint;
use specula_engine::constraint::{ConstraintCompiler, Grammar};
use specula_engine::ReasoningBudget;
use specula_model::Tokenizer;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// See the module docs. Shared by every handler (`AppState::prep`).
pub struct PrepPool {
    /// One permit per thread that may prepare at once.
    permits: Arc<Semaphore>,
    /// Preparations admitted (running or waiting for a permit); at most `limit`.
    admitted: Arc<AtomicUsize>,
    /// Threads + queue.
    limit: usize,
    /// The most bytes of text one token of the tokenizer spells: a text of `b` bytes has at least
    /// `b / max_token_bytes` tokens, which refuses an overlong prompt before it is tokenized.
    max_token_bytes: usize,
}

/// Gives an admitted preparation's place back when dropped, however it ended.
struct Admitted(Arc<AtomicUsize>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PrepPool {
    /// A pool of `threads` (at least 1) with `queue` waiting places, for the requests of a
    /// tokenizer whose longest token spells `max_token_bytes` ([`PrepPool::longest_token`]).
    pub fn new(threads: usize, queue: usize, max_token_bytes: usize) -> Self {
        let threads = threads.max(1);
        let max_token_bytes = max_token_bytes.max(1);
        Self { permits: Arc::new(Semaphore::new(threads)), admitted: Arc::new(AtomicUsize::new(0)), limit: threads + queue, max_token_bytes }
    }

    /// The most bytes one of `tokenizer`'s tokens spells.
    pub fn longest_token(tokenizer: &Tokenizer) -> usize {
        tokenizer.token_bytes().iter().map(|t| t.bytes.len()).max().unwrap_or(1)
    }

    /// See the field: the fewest tokens a text of `bytes` bytes can have is `bytes / this`.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The fewest tokens a text of `bytes` bytes can encode to.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.max_token_bytes)
    }

    /// Preparations admitted now (running or waiting), for tests and metrics.
    pub fn in_use(&self) -> usize {
        self.admitted.load(Ordering::Acquire)
    }

    /// Runs `f` on a prep thread and returns its result; 503 `overloaded` at once when the pool
    /// and its queue are full.
    pub async fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
        self.run_within(None, f).await.map(|r| r.expect("no deadline, so never cut"))
    }

    /// Like [`PrepPool::run`], but `None` when `f` has not finished within `deadline` (it goes on
    /// to the end on its thread, holding its place, and its result is dropped).
    pub async fn run_within<T: Send + 'static>(&self, deadline: Option<Duration>, f: impl FnOnce() -> T + Send + 'static) -> Result<Option<T>, ApiError> {
        self.admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| (a < self.limit).then_some(a + 1))
            .map_err(|a| ApiError::overloaded(format!("the server is overloaded: {a} requests are being prepared (limit {}); retry later", self.limit)))?;
        let place = Admitted(self.admitted.clone());
        let permit = self.permits.clone().acquire_owned().await.map_err(|_| ApiError::internal("the prep pool is closed"))?;
        let job = tokio::task::spawn_blocking(move || {
            let _held = (permit, place);
            f()
        });
        let joined = match deadline {
            None => job.await,
            Some(d) => match tokio::time::timeout(d, job).await {
                Ok(joined) => joined,
                Err(_) => return Ok(None),
            },
        };
        joined.map(Some).map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))
    }

    /// Compiles a request's constraint and reasoning budget once, on a prep thread, within
    /// `max_schema_bytes`, the grammar budget (`constraint::GrammarBudget`) and
    /// `grammar_compile_timeout`: the grammar every choice clones. A constraint that is too
    /// large, does not compile or is over budget is a 400 naming `param`; `what` prefixes the
    /// reason.
    pub async fn compile(
        &self,
        tokenizer: &Arc<Tokenizer>,
        constraint: Option<Arc<Constraint>>,
        budget: Option<ReasoningBudget>,
        param: &str,
        what: &str,
        config: &ServerConfig,
    ) -> Result<Option<Grammar>, ApiError> {
        if constraint.is_none() && budget.is_none() {
            return Ok(None);
        }
        bounds::check_constraint(constraint.as_deref(), param, config)?;
        let (tokenizer, timeout) = (tokenizer.clone(), config.grammar_compile_timeout);
        let compile = move || ConstraintCompiler::for_tokenizer(&tokenizer)?.compile_request(constraint.as_deref(), budget.as_ref());
        match self.run_within(Some(timeout), compile).await? {
            Some(Ok(grammar)) => Ok(grammar),
            Some(Err(e)) => Err(ApiError::invalid_param(param, format!("{what}{e}"))),
            None => Err(ApiError::invalid_param(
                param,
                format!("{what}compiling it took longer than the server's budget of {} ms; simplify it", timeout.as_millis()),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One thread and one queue place: a third preparation is refused at once with 503, and the
    /// places come back when the first two end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_pool_refuses_at_once_and_frees_its_places() {
        let pool = Arc::new(PrepPool::new(1, 1, 4));
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(std::sync::Mutex::new(gate));
        let mut running = Vec::new();
        for _ in 0..2 {
            let (pool, gate) = (pool.clone(), gate.clone());
            running.push(tokio::spawn(async move { pool.run(move || gate.lock().unwrap().recv().is_ok()).await }));
        }
        while pool.in_use() < 2 {
            tokio::task::yield_now().await;
        }
        let started = std::time::Instant::now();
        let refused = pool.run(|| ()).await.unwrap_err();
        assert_eq!((refused.status.as_u16(), refused.code), (503, Some("overloaded")));
        assert!(started.elapsed() < Duration::from_millis(100), "refused in {:?}", started.elapsed());
        release.send(()).unwrap();
        release.send(()).unwrap();
        for r in running {
            assert!(r.await.unwrap().unwrap());
        }
        assert_eq!(pool.in_use(), 0);
        assert!(pool.run(|| 7).await.is_ok_and(|v| v == 7));
    }

    /// A job past its deadline is answered `None` at once; its place is held until it ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_past_its_deadline_is_cut_but_keeps_its_place_until_it_ends() {
        let pool = PrepPool::new(1, 0, 4);
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let cut = pool.run_within(Some(Duration::from_millis(20)), move || gate.recv().is_ok()).await.unwrap();
        assert_eq!(cut, None);
        assert_eq!(pool.in_use(), 1, "the cut job still runs");
        assert_eq!(pool.run(|| ()).await.unwrap_err().status.as_u16(), 503);
        release.send(()).unwrap();
        while pool.in_use() > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[test]
    fn the_fewest_tokens_of_a_text_come_from_the_longest_token() {
        let pool = PrepPool::new(1, 0, 4);
        assert_eq!(pool.max_token_bytes(), 4);
        assert_eq!((pool.min_tokens(0), pool.min_tokens(4), pool.min_tokens(5)), (0, 1, 2));
    }
}
