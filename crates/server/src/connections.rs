//! The TCP side of the server: the accept loop [`crate::serve`] runs, with a cap on open
//! connections and a deadline for each request's head (hyper's header-read timeout, which also
//! closes a kept-alive connection that sends nothing), and two body wrappers: a request body that
//! pauses longer than the idle timeout fails, and an event stream that has nothing to say for a
//! while sends an SSE comment so proxies and clients see it is alive.
//!
//! Not for routing or auth (`lib.rs`, `auth.rs`, `origin.rs`): this file only moves bytes.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use futures::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// Limits on what one connection may hold; `specula serve` flags, checked by
/// `ServerConfig::validate`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A request's line and headers must arrive whole within this, counted from when the server
    /// starts waiting for them (so a kept-alive connection idle this long is closed too)
    /// (`--header-read-timeout`, default 10 s).
    pub header_read_timeout: Duration,
    /// Longest pause inside a request body before the request fails and its connection closes
    /// (`--idle-timeout`, default 30 s).
    pub idle_timeout: Duration,
    /// Open connections at most; one more is closed as soon as it is accepted
    /// (`--max-connections`, default 512).
    pub max_connections: usize,
    /// An SSE stream silent this long gets a `: keep-alive` comment (`--sse-keep-alive`,
    /// default 15 s).
    pub sse_keep_alive: Duration,
}

/// The largest `--max-connections` (far above any file-descriptor limit).
const MAX_CONNECTIONS: usize = 1 << 20;

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            max_connections: 512,
            sse_keep_alive: Duration::from_secs(15),
        }
    }
}

impl ConnectionLimits {
    /// Why these limits cannot serve, if they cannot.
    pub fn problem(&self) -> Option<String> {
        if !(1..=MAX_CONNECTIONS).contains(&self.max_connections) {
            return Some(format!("--max-connections is {} but must be between 1 and {MAX_CONNECTIONS}", self.max_connections));
        }
        for (flag, d) in [("--header-read-timeout", self.header_read_timeout), ("--idle-timeout", self.idle_timeout), ("--sse-keep-alive", self.sse_keep_alive)]
        {
            if d.is_zero() {
                return Some(format!("{flag} must be above zero"));
            }
        }
        None
    }
}

/// Accepts connections on `listener` and serves `app` on each until `shutdown` resolves; then
/// stops accepting, asks every open connection to finish its current response and close, and
/// returns once they have.
pub(crate) async fn accept_loop(listener: TcpListener, app: Router, limits: &ConnectionLimits, shutdown: impl Future<Output = ()>) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    let http = Arc::new(http);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = &mut shutdown => break,
        };
        let tcp = match accepted {
            Ok((tcp, _peer)) => tcp,
            Err(e) => {
                // out of file descriptors and the like: wait instead of spinning on the error
                tracing::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(limit = limits.max_connections, "connection refused: --max-connections are open");
            metrics::counter!("specula:connections_refused_total").increment(1);
            drop(tcp);
            continue;
        };
        // Streamed tokens are small writes; Nagle would hold each one back.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
        let service = TowerToHyperService::new(app.clone());
        let http = http.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            metrics::gauge!("specula:open_connections").increment(1.0);
            let conn = http.serve_connection(TokioIo::new(tcp), service).with_upgrades();
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => Some(r),
                _ = stop.wait_for(|s| *s) => None,
            };
            let result = match ended {
                Some(r) => r,
                None => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::debug!("connection ended: {e}");
            }
            metrics::gauge!("specula:open_connections").decrement(1.0);
            drop(permit);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // every connection holds a permit until it is gone
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
}

/// Middleware: a request body that sends nothing for the idle timeout fails (the handler sees a
/// read error, answered 400, and the connection closes since its body was not read to the end).
pub(crate) async fn body_idle_timeout(State(limits): State<Arc<ConnectionLimits>>, req: Request, next: Next) -> Response {
    let idle = limits.idle_timeout;
    let (parts, body) = req.into_parts();
    let timed = futures::stream::unfold(Some(body.into_data_stream()), move |stream| async move {
        let mut stream = stream?;
        match tokio::time::timeout(idle, stream.next()).await {
            Ok(Some(chunk)) => Some((chunk.map_err(axum::BoxError::from), Some(stream))),
            Ok(None) => None,
            Err(_) => Some((Err(format!("the request body sent nothing for {} s (--idle-timeout)", idle.as_secs_f64()).into()), None)),
        }
    });
    next.run(Request::from_parts(parts, Body::from_stream(timed))).await
}

/// Middleware: an SSE response (`text/event-stream`) that has no event for the keep-alive
/// interval sends a comment line (`: keep-alive`), which every SSE client ignores. Comments go
/// only between whole events (each body frame of an SSE response is one event).
pub(crate) async fn sse_keep_alive(State(limits): State<Arc<ConnectionLimits>>, req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    let is_sse = response.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
    if !is_sse {
        return response;
    }
    let every = limits.sse_keep_alive;
    let (parts, body) = response.into_parts();
    let with_comments = futures::stream::unfold(Some(body.into_data_stream()), move |stream| async move {
        let mut stream = stream?;
        // `next` is cancel-safe: a timeout drops the wait, never an event
        match tokio::time::timeout(every, stream.next()).await {
            Ok(Some(frame)) => Some((frame, Some(stream))),
            Ok(None) => None,
            Err(_) => Some((Ok(Bytes::from_static(b": keep-alive\n\n")), Some(stream))),
        }
    });
    Response::from_parts(parts, Body::from_stream(with_comments))
}
