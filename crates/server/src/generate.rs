//! Running choices on the engine: submit one engine request per choice, stream its events back,
//! and make sure a choice nobody listens to any more is aborted. Shared by both generation routes;
//! knows nothing of the OpenAI response shapes.
//!
//! Ownership does the bookkeeping: each [`ChoiceRun`] holds an [`AbortOnDrop`], so when the HTTP
//! response (streaming body or handler future) is dropped because the client went away, every
//! unfinished choice is aborted and its KV blocks go back, whatever path the drop took.

use crate::audit::{Auditor, LiveGuard};
use crate::error::ApiError;
use crate::metrics::RequestTimer;
use futures::stream::{SelectAll, Stream, StreamExt};
use specula_engine::api::{FinishReason, GenerateRequest, RequestEvent, SamplingParams, TokenLogprob};
use specula_engine::constraint::Grammar;
use specula_engine::handle::EngineHandle;
use specula_engine::types::{RequestId, Tenant, TokenId};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Aborts the engine request when dropped, unless it was disarmed because the request ended.
pub struct AbortOnDrop {
    engine: EngineHandle,
    id: RequestId,
    armed: bool,
}

impl AbortOnDrop {
    pub fn new(engine: EngineHandle, id: RequestId) -> Self {
        Self { engine, id, armed: true }
    }

    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            tracing::debug!(request = %self.id, "client went away; aborting");
            self.engine.abort(self.id);
        }
    }
}

/// One engine request to make: choice `index` of the response.
pub struct ChoiceJob {
    pub index: usize,
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    /// `params.constraint` compiled: a clone of the request's one compilation (`prep.rs`).
    pub grammar: Option<Grammar>,
}

/// A submitted choice: a stream of `(choice index, event)` that ends after the terminal event
/// (`Finished` or `Failed`). An engine that drops the request without a terminal event shows up
/// as `Failed`, so a stream never hangs on a stopped engine.
pub struct ChoiceRun {
    pub index: usize,
    pub id: RequestId,
    events: UnboundedReceiver<RequestEvent>,
    guard: AbortOnDrop,
    timer: RequestTimer,
    done: bool,
    /// Prompt length and tokens delivered so far: what an abort records when the client goes away.
    prompt_tokens: usize,
    delivered: usize,
    /// With `--speculative-audit`: this choice counted as live work, and, when it is one to
    /// audit, what its replay needs.
    audit: Option<AuditTap>,
}

/// A choice's part in the speculative audit (`audit.rs`).
struct AuditTap {
    auditor: Arc<Auditor>,
    _live: LiveGuard,
    /// The choice as submitted (prompt, parameters, a fresh copy of its grammar) and what it has
    /// emitted, when it was picked for a replay.
    picked: Option<Picked>,
}

struct Picked {
    prompt: Vec<TokenId>,
    params: SamplingParams,
    grammar: Option<Grammar>,
    tokens: Vec<TokenId>,
    logprobs: Vec<f32>,
}

/// A choice dropped before its terminal event (the client went away) was aborted: it is counted
/// as a finished request with reason `abort`, with the tokens it had delivered.
impl Drop for ChoiceRun {
    fn drop(&mut self) {
        if !self.done {
            self.timer.on_finished(FinishReason::Abort, self.prompt_tokens, self.delivered);
        }
    }
}

impl Stream for ChoiceRun {
    type Item = (usize, RequestEvent);

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let event = match self.events.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(event)) => event,
            Poll::Ready(None) => RequestEvent::Failed { message: "the engine stopped before finishing this request".into() },
        };
        match &event {
            RequestEvent::Delta { tokens, logprobs, .. } => {
                self.delivered += tokens.len();
                self.timer.on_tokens(tokens.len());
                if let Some(p) = self.audit.as_mut().and_then(|a| a.picked.as_mut()) {
                    p.tokens.extend(tokens);
                    p.logprobs.extend(logprobs.iter().map(|l| l.logprob));
                }
            }
            RequestEvent::PromptLogprobs { .. } => {}
            RequestEvent::Finished { reason, prompt_tokens, completion_tokens, .. } => {
                self.timer.on_finished(*reason, *prompt_tokens, *completion_tokens);
                self.guard.disarm();
                self.done = true;
                let id = self.id;
                if let (Some(tap), false) = (self.audit.as_mut(), *reason == FinishReason::Abort) {
                    if let Some(p) = tap.picked.take() {
                        tap.auditor.offer(id, p.prompt, p.params, p.grammar, p.tokens, p.logprobs);
                    }
                }
            }
            RequestEvent::Failed { message } => {
                tracing::warn!(request = %self.id, "engine failed the request: {message}");
                self.guard.disarm();
                self.done = true;
            }
        }
        Poll::Ready(Some((self.index, event)))
    }
}

/// All choices of one HTTP request, events interleaved as they come.
pub type ChoiceEvents = SelectAll<ChoiceRun>;

/// Submits every job or none (`EngineHandle::submit_all`): a refusal (queue full, engine
/// stopping) leaves the engine's queue as it was and is returned. With an `audit`, each choice
/// counts as live work while it runs, and the determined ones it picks are replayed after.
/// Every job is `tenant`'s (`auth.rs`).
pub fn submit(engine: &EngineHandle, jobs: Vec<ChoiceJob>, tenant: Tenant, arrived: Instant, audit: Option<&Arc<Auditor>>) -> Result<Vec<ChoiceRun>, ApiError> {
    let mut runs = Vec::with_capacity(jobs.len());
    let mut reqs = Vec::with_capacity(jobs.len());
    for mut job in jobs {
        job.params.tenant = tenant;
        let id = engine.next_request_id();
        let (tx, rx) = unbounded_channel();
        let prompt_tokens = job.prompt.len();
        let audit = audit.map(|a| AuditTap {
            auditor: a.clone(),
            _live: a.live(),
            picked: (Auditor::determined(&job.params) && a.pick()).then(|| Picked {
                prompt: job.prompt.clone(),
                params: job.params.clone(),
                grammar: job.grammar.clone(),
                tokens: Vec::new(),
                logprobs: Vec::new(),
            }),
        });
        reqs.push(GenerateRequest { id, prompt: job.prompt, params: job.params, events: tx, grammar: job.grammar });
        runs.push(ChoiceRun {
            index: job.index,
            id,
            events: rx,
            guard: AbortOnDrop::new(engine.clone(), id),
            timer: RequestTimer::new(arrived),
            done: false,
            prompt_tokens,
            delivered: 0,
            audit,
        });
    }
    if let Err(e) = engine.submit_all(reqs) {
        // nothing of this request is queued: nothing to abort, no finish to count
        runs.iter_mut().for_each(|r| {
            r.guard.disarm();
            r.done = true;
        });
        return Err(e.into());
    }
    Ok(runs)
}

/// Everything one choice produced, for non-streaming responses.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceOutput {
    pub index: usize,
    pub text: String,
    /// The generated tokens.
    pub tokens: Vec<TokenId>,
    /// One entry per generated token when logprobs were asked for.
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: FinishReason,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// The prompt's logprobs and ranks (entry i: prompt token i + 1), when asked for.
    pub prompt_logprobs: Option<(Vec<TokenLogprob>, Vec<u32>)>,
}

/// A request's prompt tokens served from the prefix cache, from each choice's `(index, cached)`
/// where choice `i` ran prompt `i / choices_per_prompt`: per prompt the fewest any of its choices
/// had (usage counts a prompt once, however many choices ran it), summed over the prompts.
pub fn cached_tokens(choices_per_prompt: usize, per_choice: impl IntoIterator<Item = (usize, usize)>) -> usize {
    let mut per_prompt = std::collections::BTreeMap::new();
    for (index, cached) in per_choice {
        per_prompt.entry(index / choices_per_prompt.max(1)).and_modify(|c: &mut usize| *c = (*c).min(cached)).or_insert(cached);
    }
    per_prompt.values().sum()
}

/// Waits for every choice to finish; the first failure fails the whole response (500) and the
/// other choices are aborted. Outputs come back sorted by choice index.
pub async fn collect(runs: Vec<ChoiceRun>) -> Result<Vec<ChoiceOutput>, ApiError> {
    let mut outputs: Vec<ChoiceOutput> = runs
        .iter()
        .map(|r| ChoiceOutput {
            index: r.index,
            text: String::new(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Abort,
            completion_tokens: 0,
            cached_tokens: 0,
            prompt_logprobs: None,
        })
        .collect();
    let slot: std::collections::HashMap<usize, usize> = runs.iter().enumerate().map(|(i, r)| (r.index, i)).collect();
    let mut events: ChoiceEvents = futures::stream::select_all(runs);
    while let Some((index, event)) = events.next().await {
        let out = &mut outputs[slot[&index]];
        match event {
            RequestEvent::Delta { tokens, text, logprobs } => {
                out.tokens.extend(tokens);
                out.text.push_str(&text);
                out.logprobs.extend(logprobs);
            }
            RequestEvent::Finished { reason, completion_tokens, cached_tokens, .. } => {
                out.finish_reason = reason;
                out.completion_tokens = completion_tokens;
                out.cached_tokens = cached_tokens;
            }
            RequestEvent::Failed { message } => return Err(ApiError::internal(message)),
            RequestEvent::PromptLogprobs { logprobs, ranks } => out.prompt_logprobs = Some((logprobs, ranks)),
        }
    }
    outputs.sort_by_key(|o| o.index);
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use super::cached_tokens;

    #[test]
    fn cached_tokens_count_each_prompt_once_at_its_least_cached_choice() {
        // two prompts, two choices each (choice i ran prompt i / 2), finishing in any order
        assert_eq!(cached_tokens(2, [(3, 32), (0, 16), (2, 48), (1, 32)]), 16 + 32);
        assert_eq!(cached_tokens(1, [(0, 64)]), 64);
        assert_eq!(cached_tokens(3, []), 0);
    }
}
