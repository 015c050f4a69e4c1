//! specula-server: the OpenAI-compatible HTTP front end. Routes (`/v1/completions`,
//! `/v1/chat/completions`, Anthropic's `/v1/messages`, OpenAI's `/v1/responses`, `/v1/models`, vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`,
//! `/health`, `/metrics`) turn requests into validated
//! engine requests, submit them through an [`EngineHandle`], and stream the engine's events back
//! as OpenAI JSON or SSE. It never touches the model; the engine loop runs elsewhere.
//!
//! ```ignore
//! let state = AppState::new(engine_handle, tokenizer, Some(template), ServerConfig::new("smollm2"));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//! specula_server::serve(listener, state, async { tokio::signal::ctrl_c().await.ok(); }).await?;
//! ```

pub mod audit;
pub mod auth;
pub mod bounds;
pub mod connections;
pub mod conversation;
pub mod dialect;
pub mod error;
pub mod extract;
pub mod generate;
pub mod metrics;
pub mod origin;
pub mod output;
pub mod prep;
pub mod reasoning;
pub mod routes;
pub mod sse;
pub mod tools;
pub mod types;
pub mod validate;

use axum::extract::DefaultBodyLimit;
use axum::http::Uri;
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use specula_engine::handle::EngineHandle;
use specula_model::{ChatTemplate, Tokenizer};
use std::future::Future;
use std::sync::Arc;

pub use connections::ConnectionLimits;
pub use error::ApiError;

/// What the server needs to know about the deployment; built by the CLI from `specula serve`'s
/// flags and checked once by [`ServerConfig::validate`] (which [`serve`] calls).
#[derive(Clone)]
pub struct ServerConfig {
    /// The served model's name: what responses and `/v1/models` report, and an accepted
    /// `model` value; requests naming neither it nor an alias get 404 `model_not_found`.
    pub model_name: String,
    /// Other accepted `model` values (`specula serve --model NAME` with a known model's name:
    /// the name the client was started with, where `model_name` is the file's).
    pub model_aliases: Vec<String>,
    /// Prompt + generated tokens per sequence (`--max-model-len`).
    pub max_model_len: usize,
    /// Largest `logprobs` / `top_logprobs` a request may ask for (`--max-logprobs`).
    pub max_logprobs: usize,
    /// When any is set, `/v1/*` requires `Authorization: Bearer <key>` with one of them
    /// (`--api-key`, repeatable); each key is a tenant (`auth.rs`).
    pub api_keys: Vec<String>,
    /// Largest `n` (choices per prompt) a request may ask for.
    pub max_n: usize,
    /// Bodies above this are refused with 413.
    pub max_body_bytes: usize,
    /// `max_tokens` for `/v1/completions` when the request has none (OpenAI: 16), cut to the
    /// context left. Chat requests without it get all the context left (vLLM's behaviour).
    pub completions_default_max_tokens: usize,
    /// Most stop strings one request may give (`--max-stop-strings`); each is matched against
    /// every new piece of text, so the count bounds that work.
    pub max_stop_strings: usize,
    /// Longest stop string, in characters (`--max-stop-string-chars`).
    pub max_stop_string_chars: usize,
    /// Most prompts in one `/v1/completions` request (`--max-prompts-per-request`). Each
    /// prompt is tokenized and becomes `n` engine requests; prompts x n is bounded further by
    /// the room left in the engine's waiting queue (`--max-waiting`), checked before any work.
    pub max_prompts_per_request: usize,
    /// Most `logit_bias` entries (`--max-logit-bias`; OpenAI documents 300): each is applied to
    /// every sampled row of the request.
    pub max_logit_bias: usize,
    /// Most `stop_token_ids`: each is compared with every sampled token.
    pub max_stop_token_ids: usize,
    /// Most `tools` in a chat request (OpenAI's limit is 128): each is rendered into the prompt
    /// and may become part of a forced-call grammar.
    pub max_tools: usize,
    /// Most `messages` in a chat request.
    pub max_messages: usize,
    /// Largest structured-output constraint (a JSON schema's text, a regex, a grammar, the
    /// choices together) and largest `tools` list (its JSON), in bytes; what passes is compiled
    /// within `constraint::GrammarBudget` and `grammar_compile_timeout`.
    pub max_schema_bytes: usize,
    /// Wall time one grammar compilation may take on the prep pool; past it the request is a
    /// 400 naming the field (the compilation finishes in the background, holding its thread, so
    /// the pool stays bounded).
    pub grammar_compile_timeout: std::time::Duration,
    /// Threads that prepare requests (tokenize, render templates, compile grammars) off the
    /// async workers (`--prep-threads`; default: the machine's cores).
    pub prep_threads: usize,
    /// Preparations that may wait for a prep thread; past it a request is a 503 `overloaded`.
    pub prep_queue: usize,
    /// Timeouts and the connection cap (`--header-read-timeout`, `--idle-timeout`,
    /// `--max-connections`, `--sse-keep-alive`).
    pub connections: ConnectionLimits,
    /// Browser origins that may use a server without an API key beside loopback ones
    /// (`--allowed-origins`; `*` for any), see `origin.rs`.
    pub allowed_origins: Vec<String>,
    /// The share of finished greedy or seeded requests replayed without speculation and compared
    /// (`--speculative-audit`, see `audit.rs`); 0 (off) unless the engine speculates.
    pub speculative_audit: f64,
}

impl ServerConfig {
    /// Whether a request naming `model` is for this server's model.
    pub fn serves(&self, model: &str) -> bool {
        model == self.model_name || self.model_aliases.iter().any(|a| a == model)
    }

    /// Defaults for everything but the model's name.
    pub fn new(model_name: impl Into<String>) -> Self {
        Self {
            model_name: model_name.into(),
            model_aliases: Vec::new(),
            max_model_len: 2048,
            max_logprobs: 20,
            api_keys: Vec::new(),
            max_n: 16,
            max_body_bytes: 4 * 1024 * 1024,
            completions_default_max_tokens: 16,
            max_stop_strings: 16,
            max_stop_string_chars: 256,
            max_prompts_per_request: 256,
            max_logit_bias: 1024,
            max_stop_token_ids: 256,
            max_tools: 128,
            max_messages: 1024,
            max_schema_bytes: 256 * 1024,
            grammar_compile_timeout: std::time::Duration::from_secs(2),
            prep_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            prep_queue: 64,
            connections: ConnectionLimits::default(),
            allowed_origins: Vec::new(),
            speculative_audit: 0.0,
        }
    }

    pub fn validate(&self) -> Result<(), ServeError> {
        let bad = |msg: String| Err(ServeError::Config(msg));
        if self.model_name.is_empty() {
            return bad("the served model name is empty".into());
        }
        if self.max_model_len < 2 {
            return bad(format!("--max-model-len is {} but must leave room for a prompt and one token (>= 2)", self.max_model_len));
        }
        if self.max_n == 0 {
            return bad("max_n must be at least 1".into());
        }
        if self.max_body_bytes == 0 {
            return bad("max_body_bytes must be at least 1".into());
        }
        for (name, v) in [
            ("--max-prompts-per-request", self.max_prompts_per_request),
            ("--prep-threads", self.prep_threads),
            ("max_messages", self.max_messages),
            ("max_schema_bytes", self.max_schema_bytes),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if !(0.0..=1.0).contains(&self.speculative_audit) {
            return bad(format!("--speculative-audit is {} but must be a fraction between 0 and 1", self.speculative_audit));
        }
        if self.max_prompts_per_request > types::PROMPT_LIST_CAP {
            return bad(format!("--max-prompts-per-request is {} but must be at most {}", self.max_prompts_per_request, types::PROMPT_LIST_CAP));
        }
        if let Some(problem) = self.connections.problem() {
            return bad(problem);
        }
        if self.api_keys.iter().any(String::is_empty) {
            return bad("--api-key is empty; leave it out to disable auth".into());
        }
        Ok(())
    }
}

impl std::fmt::Debug for ServerConfig {
    /// Like the derived one, but never prints the API key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("model_name", &self.model_name)
            .field("max_model_len", &self.max_model_len)
            .field("max_logprobs", &self.max_logprobs)
            .field("api_keys", &format!("<{} set>", self.api_keys.len()))
            .field("max_n", &self.max_n)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("completions_default_max_tokens", &self.completions_default_max_tokens)
            .field("max_stop_strings", &self.max_stop_strings)
            .field("max_stop_string_chars", &self.max_stop_string_chars)
            .field("max_prompts_per_request", &self.max_prompts_per_request)
            .field("max_logit_bias", &self.max_logit_bias)
            .field("max_stop_token_ids", &self.max_stop_token_ids)
            .field("max_tools", &self.max_tools)
            .field("max_messages", &self.max_messages)
            .field("max_schema_bytes", &self.max_schema_bytes)
            .field("grammar_compile_timeout", &self.grammar_compile_timeout)
            .field("prep_threads", &self.prep_threads)
            .field("prep_queue", &self.prep_queue)
            .field("connections", &self.connections)
            .field("allowed_origins", &self.allowed_origins)
            .finish()
    }
}

/// Everything a handler needs; cheap to clone (all shared).
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    /// None for a model without a template: chat requests then get a 400 that says so.
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub config: Arc<ServerConfig>,
    /// The process-wide Prometheus recorder `/metrics` renders.
    pub metrics: PrometheusHandle,
    /// Unix seconds when this state was built (`created` in `/v1/models`).
    pub started: u64,
    /// Finished `/v1/responses` kept for `previous_response_id` and `GET` (bounded; see its module).
    pub responses: Arc<dialect::store::ResponseStore>,
    /// The bounded pool that tokenizes, renders and compiles (`prep.rs`).
    pub prep: Arc<prep::PrepPool>,
    /// The live exactness audit, when `--speculative-audit` is on (`audit.rs`).
    pub audit: Option<Arc<audit::Auditor>>,
}

impl AppState {
    /// Installs the Prometheus recorder on first use in the process (see [`metrics::prometheus_handle`]);
    /// call it before the engine thread starts so the engine's gauges land in the same recorder.
    pub fn new(engine: EngineHandle, tokenizer: Arc<Tokenizer>, chat_template: Option<Arc<ChatTemplate>>, config: ServerConfig) -> Self {
        let prep = Arc::new(prep::PrepPool::new(config.prep_threads, config.prep_queue, prep::PrepPool::longest_token(&tokenizer)));
        Self {
            engine,
            tokenizer,
            chat_template,
            config: Arc::new(config),
            metrics: metrics::prometheus_handle(),
            started: unix_now(),
            responses: Default::default(),
            prep,
            audit: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("server configuration: {0}")]
    Config(String),
    #[error("serving HTTP: {0}")]
    Io(#[from] std::io::Error),
}

/// All routes, with auth on `/v1/*`, browser origins checked everywhere (`origin.rs`), the body
/// limit and idle timeout, SSE keep-alive comments, and OpenAI-shaped 404/405s.
pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(dialect::handle::<dialect::completions::Completions>))
        .route("/v1/chat/completions", post(dialect::handle::<dialect::chat::Chat>))
        .route("/v1/models", get(routes::models::list))
        .route("/v1/models/{model}", get(routes::models::retrieve))
        // vLLM serves its tokenizer endpoints at the root; they are behind the API key too
        .route("/tokenize", post(routes::tokenize::tokenize))
        .route("/detokenize", post(routes::tokenize::detokenize))
        .route("/tokenizer_info", get(routes::tokenize::info))
        .route("/v1/responses", post(dialect::handle::<dialect::responses::Responses>))
        .route("/v1/responses/{id}", get(dialect::responses::retrieve))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_api_key));
    // Anthropic's routes answer errors (auth included) in Anthropic's shape
    let anthropic = Router::new()
        .route("/v1/messages", post(dialect::handle::<dialect::anthropic::Messages>))
        .route("/v1/messages/count_tokens", post(dialect::anthropic::count_tokens))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_api_key))
        .route_layer(axum::middleware::from_fn(dialect::anthropic::anthropic_errors));
    let limits = Arc::new(state.config.connections.clone());
    Router::new()
        .merge(v1)
        .merge(anthropic)
        .route("/health", get(routes::health))
        .route("/metrics", get(metrics::render))
        .fallback(|uri: Uri| async move { ApiError::route_not_found(uri.path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(limits.clone(), connections::sse_keep_alive))
        .layer(axum::middleware::from_fn_with_state(limits, connections::body_idle_timeout))
        .layer(axum::middleware::from_fn_with_state(state.clone(), origin::require_local_origin))
        .with_state(state)
}

/// Serves [`router`] on `listener` until `shutdown` resolves, then stops accepting and waits for
/// open responses (streams included) to end. The caller shuts the engine down afterwards (or
/// from `shutdown`, so streams finish). Connections are capped and each request's head must
/// arrive in time ([`ConnectionLimits`]): a client that opens connections and sends half a
/// request holds nothing for long.
pub async fn serve(listener: tokio::net::TcpListener, state: AppState, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ServeError> {
    state.config.validate()?;
    let mut state = state;
    if state.config.speculative_audit > 0.0 && state.audit.is_none() {
        state.audit = Some(audit::Auditor::start(state.engine.clone(), state.config.speculative_audit));
    }
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, model = %state.config.model_name, "serving the OpenAI API");
    }
    let limits = state.config.connections.clone();
    connections::accept_loop(listener, router(state), &limits, shutdown).await;
    Ok(())
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
