//! The bounded in-memory store behind `store: true`, `previous_response_id` and
//! `GET /v1/responses/{id}`: each finished response is kept with the conversation it ended
//! (its input messages and its output as an assistant turn), so a follow-up can continue it.
//!
//! Bounds (both enforced on every insert, oldest first):
//! - age: an entry older than [`MAX_AGE`] (one hour) is gone;
//! - size: the entries' JSON together stay under [`MAX_BYTES`] (64 MiB); one larger than that
//!   alone is not stored.
//!
//! Nothing is written to disk; a restart forgets everything.

use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const MAX_AGE: Duration = Duration::from_secs(3600);
pub const MAX_BYTES: usize = 64 * 1024 * 1024;

/// One stored response.
#[derive(Debug, Clone)]
pub struct Stored {
    /// The response object as `GET /v1/responses/{id}` returns it.
    pub response: Value,
    /// The conversation so far, template-shaped, without `instructions` (which, as in OpenAI's
    /// API, do not carry over to a follow-up).
    pub messages: Vec<Value>,
    /// The tenant (API key) that stored it: no other reads it back or continues it.
    pub tenant: specula_engine::types::Tenant,
}

#[derive(Debug)]
struct Entry {
    stored: Stored,
    at: Instant,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Ids in insertion order (oldest first): eviction walks it from the front.
    order: VecDeque<String>,
    bytes: usize,
}

/// Thread-safe; shared by all handlers through `AppState`.
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
    max_age: Duration,
    max_bytes: usize,
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new(MAX_AGE, MAX_BYTES)
    }
}

impl ResponseStore {
    pub fn new(max_age: Duration, max_bytes: usize) -> Self {
        Self { inner: Mutex::new(Inner::default()), max_age, max_bytes }
    }

    /// Keeps `stored` under `id`, evicting expired and then oldest entries to make room.
    pub fn insert(&self, id: String, stored: Stored) {
        let bytes = stored.response.to_string().len() + stored.messages.iter().map(|m| m.to_string().len()).sum::<usize>();
        if bytes > self.max_bytes {
            tracing::debug!(%id, bytes, "response too large to store");
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        while let Some(oldest) = inner.order.front().cloned() {
            let expired = inner.entries.get(&oldest).is_none_or(|e| now.duration_since(e.at) > self.max_age);
            if !(expired || inner.bytes + bytes > self.max_bytes) {
                break;
            }
            inner.order.pop_front();
            if let Some(e) = inner.entries.remove(&oldest) {
                inner.bytes -= e.bytes;
            }
        }
        inner.bytes += bytes;
        inner.order.push_back(id.clone());
        if let Some(old) = inner.entries.insert(id, Entry { stored, at: now, bytes }) {
            inner.bytes -= old.bytes;
        }
    }

    /// The entry under `id`, unless it expired.
    pub fn get(&self, id: &str) -> Option<Stored> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.entries.get(id).filter(|e| e.at.elapsed() <= self.max_age).map(|e| e.stored.clone())
    }

    /// Bytes held (for tests and metrics).
    pub fn bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> Stored {
        Stored { response: json!({"t": text}), messages: vec![], tenant: Default::default() }
    }

    #[test]
    fn the_oldest_go_first_when_the_size_bound_is_reached() {
        let one = json!({"t": "x".repeat(10)}).to_string().len();
        let store = ResponseStore::new(MAX_AGE, 3 * one);
        for id in ["a", "b", "c", "d"] {
            store.insert(id.into(), stored(&"x".repeat(10)));
        }
        assert!(store.get("a").is_none(), "a was the oldest");
        assert!(["b", "c", "d"].iter().all(|id| store.get(id).is_some()));
        assert_eq!(store.bytes(), 3 * one);
        store.insert("huge".into(), stored(&"x".repeat(4 * one)));
        assert!(store.get("huge").is_none() && store.get("d").is_some(), "too large alone: not stored, nothing evicted");
    }

    #[test]
    fn expired_entries_are_not_returned_and_are_evicted() {
        let store = ResponseStore::new(Duration::from_millis(20), MAX_BYTES);
        store.insert("a".into(), stored("x"));
        assert!(store.get("a").is_some());
        std::thread::sleep(Duration::from_millis(40));
        assert!(store.get("a").is_none());
        store.insert("b".into(), stored("y"));
        assert_eq!(store.bytes(), json!({"t": "y"}).to_string().len(), "a was evicted by the insert");
    }
}
