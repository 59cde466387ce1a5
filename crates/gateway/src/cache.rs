//! Exact-match response cache.
//!
//! The key is SHA-256 over the tenant name and a canonical form of the request: the route,
//! then the JSON body with object keys sorted and the fields that do not change the answer
//! removed (`stream`, `stream_options`, `user`). The tenant is part of the key, so one
//! tenant can never be served another's entry. Only deterministic requests are cached
//! (temperature 0, or an explicit `seed`), only non-streamed 200 answers are stored, and a
//! request with `Cache-Control: no-cache` (or `no-store`) skips the lookup. An answer
//! that calls tools is never stored ([`is_tool_call_answer`]): a call stands for an
//! action the client is about to take, and a replay would hand it another call's id.
//!
//! Backends: an in-memory LRU with a TTL and an entry-count bound, or Redis (`SET .. EX`;
//! size is bounded by Redis's own `maxmemory` policy). A Redis failure is a miss (or an
//! answer not stored); the caller counts it in `strata_gateway_backend_errors_total{backend="cache"}`.

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use bytes::Bytes;
use lru::LruCache;
use parking_lot::Mutex;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::redis_conn::{RedisConn, RedisError};

/// Fields that never change the answer.
const IGNORED: &[&str] = &["stream", "stream_options", "user"];

/// True when the request's answer is reproducible: greedy sampling or a fixed seed.
pub fn is_deterministic(body: &Value) -> bool {
    let temp_zero = body
        .get("temperature")
        .and_then(Value::as_f64)
        .is_some_and(|t| t == 0.0);
    let seeded = body.get("seed").is_some_and(|s| !s.is_null());
    temp_zero || seeded
}

/// True when an answer body calls tools: a choice whose `finish_reason` is `tool_calls`
/// or whose message carries `tool_calls` (a body that mentions them but is not JSON
/// counts too). Neither cache stores such an answer.
pub fn is_tool_call_answer(body: &[u8]) -> bool {
    const NEEDLE: &[u8] = b"tool_calls";
    if !body.windows(NEEDLE.len()).any(|w| w == NEEDLE) {
        return false;
    }
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return true;
    };
    v.get("choices")
        .and_then(Value::as_array)
        .is_some_and(|choices| {
            choices.iter().any(|c| {
                c.get("finish_reason").and_then(Value::as_str) == Some("tool_calls")
                    || c.get("message")
                        .and_then(|m| m.get("tool_calls"))
                        .and_then(Value::as_array)
                        .is_some_and(|t| !t.is_empty())
            })
        })
}

/// The cache key of a request for `tenant` on `route`.
pub fn cache_key(tenant: &str, route: &str, body: &Value) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(tenant.as_bytes());
    h.update([0]);
    h.update(route.as_bytes());
    h.update([0]);
    let mut canon = String::new();
    if let Value::Object(map) = body {
        let mut keys: Vec<&String> = map
            .keys()
            .filter(|k| !IGNORED.contains(&k.as_str()))
            .collect();
        keys.sort();
        canon.push('{');
        for (i, k) in keys.iter().enumerate() {
            if i > 0 {
                canon.push(',');
            }
            canonical(&Value::String((*k).clone()), &mut canon);
            canon.push(':');
            canonical(&map[k.as_str()], &mut canon);
        }
        canon.push('}');
    } else {
        canonical(body, &mut canon);
    }
    h.update(canon.as_bytes());
    h.finalize().into()
}

/// Compact JSON with object keys sorted at every depth.
fn canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(&Value::String((*k).clone()), out);
                out.push(':');
                canonical(&map[k.as_str()], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, it) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(it, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

struct Entry {
    body: Bytes,
    expires: Instant,
}

/// In-process LRU with TTL.
pub struct MemoryCache {
    ttl: Duration,
    max_entry_bytes: usize,
    map: Mutex<LruCache<[u8; 32], Entry>>,
}

impl MemoryCache {
    pub fn new(max_entries: usize, ttl: Duration, max_entry_bytes: usize) -> MemoryCache {
        let cap = NonZeroUsize::new(max_entries).unwrap_or(NonZeroUsize::MIN);
        MemoryCache {
            ttl,
            max_entry_bytes,
            map: Mutex::new(LruCache::new(cap)),
        }
    }

    pub fn get(&self, key: &[u8; 32], now: Instant) -> Option<Bytes> {
        let mut map = self.map.lock();
        match map.get(key) {
            Some(e) if e.expires > now => Some(e.body.clone()),
            Some(_) => {
                map.pop(key);
                None
            }
            None => None,
        }
    }

    pub fn put(&self, key: [u8; 32], body: Bytes, now: Instant) {
        if body.len() > self.max_entry_bytes || is_tool_call_answer(&body) {
            return;
        }
        self.map.lock().put(
            key,
            Entry {
                body,
                expires: now + self.ttl,
            },
        );
    }

    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Cache in Redis, shared by replicas.
pub struct RedisCache {
    conn: RedisConn,
    ttl: Duration,
    max_entry_bytes: usize,
}

impl RedisCache {
    pub fn new(conn: RedisConn, ttl: Duration, max_entry_bytes: usize) -> RedisCache {
        RedisCache {
            conn,
            ttl,
            max_entry_bytes,
        }
    }

    fn name(key: &[u8; 32]) -> String {
        format!("strata:cache:{}", hex::encode(key))
    }
}

/// The configured cache.
pub enum ResponseCache {
    Memory(MemoryCache),
    Redis(RedisCache),
}

impl ResponseCache {
    /// The stored answer for `key`; an error only from Redis (the caller treats it as a miss).
    pub async fn get(&self, key: &[u8; 32]) -> Result<Option<Bytes>, RedisError> {
        match self {
            ResponseCache::Memory(m) => Ok(m.get(key, Instant::now())),
            ResponseCache::Redis(r) => {
                let cmd = redis::cmd("GET").arg(RedisCache::name(key)).clone();
                let v = r.conn.query::<Option<Vec<u8>>>(&cmd).await?;
                Ok(v.map(Bytes::from))
            }
        }
    }

    /// Stores `body` under `key` (an entry over the size bound, or one that calls tools,
    /// is skipped); an error only from Redis.
    pub async fn put(&self, key: [u8; 32], body: Bytes) -> Result<(), RedisError> {
        match self {
            ResponseCache::Memory(m) => {
                m.put(key, body, Instant::now());
                Ok(())
            }
            ResponseCache::Redis(r) => {
                if body.len() > r.max_entry_bytes || is_tool_call_answer(&body) {
                    return Ok(());
                }
                let cmd = redis::cmd("SET")
                    .arg(RedisCache::name(&key))
                    .arg(body.as_ref())
                    .arg("EX")
                    .arg(r.ttl.as_secs().max(1))
                    .clone();
                r.conn.query::<()>(&cmd).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_ignores_order_and_non_semantic_fields() {
        let a = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stream": false});
        let b = json!({"temperature": 0, "user": "x", "messages": [{"content": "hi", "role": "user"}], "model": "m"});
        assert_eq!(cache_key("t", "chat", &a), cache_key("t", "chat", &b));
    }

    #[test]
    fn key_separates_tenants_routes_and_content() {
        let a = json!({"model": "m", "prompt": "hi", "temperature": 0});
        let k = cache_key("t1", "completions", &a);
        assert_ne!(k, cache_key("t2", "completions", &a));
        assert_ne!(k, cache_key("t1", "chat", &a));
        let b = json!({"model": "m", "prompt": "hi!", "temperature": 0});
        assert_ne!(k, cache_key("t1", "completions", &b));
        let c = json!({"model": "m", "prompt": "hi", "temperature": 0, "max_tokens": 3});
        assert_ne!(k, cache_key("t1", "completions", &c));
        // A tenant name cannot be forged by moving bytes between tenant and route.
        assert_ne!(cache_key("ab", "c", &a), cache_key("a", "bc", &a));
    }

    #[test]
    fn determinism_rule() {
        assert!(is_deterministic(&json!({"temperature": 0})));
        assert!(is_deterministic(&json!({"temperature": 0.0})));
        assert!(is_deterministic(&json!({"temperature": 0.7, "seed": 1})));
        assert!(!is_deterministic(&json!({"temperature": 0.7})));
        assert!(!is_deterministic(&json!({})));
        assert!(!is_deterministic(&json!({"seed": null})));
    }

    #[test]
    fn tool_call_answers_are_never_stored() {
        let call = br#"{"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"content": null, "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}"#;
        let cut = br#"{"choices": [{"finish_reason": "length", "message": {"tool_calls": [{"id": "x"}]}}]}"#;
        let text = br#"{"choices": [{"finish_reason": "stop", "message": {"content": "tool_calls are JSON"}}]}"#;
        assert!(is_tool_call_answer(call));
        assert!(is_tool_call_answer(cut));
        assert!(!is_tool_call_answer(text));
        assert!(!is_tool_call_answer(b"{\"choices\": []}"));
        let c = MemoryCache::new(4, Duration::from_secs(60), 1 << 20);
        let now = Instant::now();
        c.put([1; 32], Bytes::from_static(call), now);
        c.put([2; 32], Bytes::from_static(text), now);
        assert!(c.get(&[1; 32], now).is_none());
        assert!(c.get(&[2; 32], now).is_some());
    }

    #[test]
    fn memory_cache_ttl_and_lru() {
        let c = MemoryCache::new(2, Duration::from_secs(10), 100);
        let t0 = Instant::now();
        c.put([1; 32], Bytes::from_static(b"one"), t0);
        c.put([2; 32], Bytes::from_static(b"two"), t0);
        assert!(c.get(&[1; 32], t0).is_some()); // 1 is now most recent
        c.put([3; 32], Bytes::from_static(b"three"), t0);
        assert!(c.get(&[2; 32], t0).is_none(), "least recently used evicted");
        assert!(
            c.get(&[1; 32], t0 + Duration::from_secs(11)).is_none(),
            "expired"
        );
        c.put([4; 32], Bytes::from(vec![0u8; 101]), t0);
        assert!(c.get(&[4; 32], t0).is_none(), "too large to keep");
    }
}
