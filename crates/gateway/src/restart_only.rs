//! The config keys a running gateway reads once, at start (they choose a backend or size
//! one: the rate limiter's and cache's Redis, the cache's memory bounds, the semantic
//! index, the store). A reload that changes one is refused, naming the key, instead of
//! reporting "reloaded" while the old value stays in force; every other key is read from
//! the live config on each use.

use serde_json::Value;

/// The keys read only at start, as JSON pointers into the config.
pub const RESTART_ONLY: &[&str] = &[
    "/limits/backend",
    "/limits/redis_url",
    "/limits/redis_timeout_ms",
    "/cache/enabled",
    "/cache/backend",
    "/cache/redis_url",
    "/cache/ttl_secs",
    "/cache/max_entries",
    "/cache/max_entry_bytes",
    "/cache/semantic/enabled",
    "/cache/semantic/max_entries",
    "/cache/semantic/ttl_secs",
    "/cache/semantic/redis_url",
    "/cache/semantic/redis_stream",
    "/store/backend",
    "/store/url",
    "/store/timeout_ms",
    "/auth",
    "/metrics/listen",
    "/server/max_connections",
    "/server/header_timeout_ms",
    "/server/max_header_bytes",
    "/server/body_timeout_ms",
    "/server/body_min_bytes_per_sec",
    "/server/tls",
];

/// The first restart-only key whose value differs between the running config `old` and
/// the reloaded `new` (each as its JSON value), written as in the file (`limits.backend`);
/// `None` when a reload can apply `new` whole.
pub fn changed_restart_only_key(old: &Value, new: &Value) -> Option<String> {
    RESTART_ONLY
        .iter()
        .find(|p| old.pointer(p) != new.pointer(p))
        .map(|p| p.trim_start_matches('/').replace('/', "."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_the_first_changed_start_only_key() {
        let a = json!({"limits": {"backend": "memory", "on_backend_error": "open"}});
        let b = json!({"limits": {"backend": "memory", "on_backend_error": "closed"}});
        assert_eq!(changed_restart_only_key(&a, &b), None, "a live key");
        let c = json!({"limits": {"backend": "redis", "on_backend_error": "open"}});
        assert_eq!(
            changed_restart_only_key(&a, &c).as_deref(),
            Some("limits.backend")
        );
        let d = json!({"limits": {"backend": "memory"}, "cache": {"semantic": {"redis_url": "x"}}});
        assert_eq!(
            changed_restart_only_key(&a, &d).as_deref(),
            Some("cache.semantic.redis_url")
        );
        // The identity section and the edge bounds are read at start.
        let e = json!({"limits": {"backend": "memory"}, "auth": {"jwt": {"issuer": "x"}}});
        assert_eq!(changed_restart_only_key(&a, &e).as_deref(), Some("auth"));
        let f = json!({"limits": {"backend": "memory"}, "server": {"max_connections": 9}});
        assert_eq!(
            changed_restart_only_key(&a, &f).as_deref(),
            Some("server.max_connections")
        );
        let g = json!({"limits": {"backend": "memory"}, "metrics": {"key": "k"}});
        assert_eq!(
            changed_restart_only_key(&a, &g),
            None,
            "the metrics key reloads"
        );
    }
}
