//! Who may call an engine: `--api-key` (vLLM's semantics, `STRATA_API_KEY`) and
//! `--admin-key` (`STRATA_ADMIN_KEY`), checked by one middleware in front of every route of
//! both HTTP fronts (the generation [`server`](crate::server) and the encoder's
//! [`embed::server`](crate::embed::server)).
//!
//! Routes fall in three classes ([`Access`]):
//! - **open**: `/health`, `/version` and `/metrics` (as vLLM leaves them; `--protect-metrics`
//!   puts `/metrics` behind the API key);
//! - **admin**: the routes that change the engine rather than use it (the prefix-cache
//!   reset, LoRA loads and unloads); with `--admin-key` they need it; with only `--api-key`
//!   they are disabled (403); with neither they are open (development);
//! - **API**: everything else, `/v1/*` as in vLLM and also `/tokenize`, `/detokenize` and
//!   unknown paths (vLLM guards only paths under `/v1`; deny-by-default costs nothing here).
//!   With `--api-key` they need one of the keys (or the admin key).
//!
//! A key is presented as `Authorization: Bearer <key>`. Keys are compared as SHA-256 digests
//! with a constant-time equality over every configured key, so neither the comparison's
//! time nor an early exit tells how much of a key was right. Refusals are OpenAI-shaped
//! (401 `authentication_error` with code `invalid_api_key`, 403 `permission_error`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use strata_api::ApiError;
use subtle::ConstantTimeEq;

/// The keys an engine is started with. `Debug` never prints a key.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AuthOptions {
    /// `--api-key` (repeatable or comma-separated, for rotation): any one of them opens the
    /// API routes. Empty: the API routes are open.
    pub api_keys: Vec<String>,
    /// `--admin-key`: the key of the admin routes.
    pub admin_key: Option<String>,
    /// `--protect-metrics`: `/metrics` needs the API key too.
    pub protect_metrics: bool,
}

impl std::fmt::Debug for AuthOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthOptions")
            .field("api_keys", &self.api_keys.len())
            .field("admin_key", &self.admin_key.is_some())
            .field("protect_metrics", &self.protect_metrics)
            .finish()
    }
}

impl AuthOptions {
    /// A key that a client could not send (empty, or not a visible ASCII header token) is
    /// refused at start-up, naming the flag.
    pub fn validate(&self) -> Result<(), String> {
        let check = |flag: &str, key: &str| {
            if key.is_empty() {
                Err(format!("{flag} must not be empty"))
            } else if !key.bytes().all(|b| b.is_ascii_graphic()) {
                Err(format!(
                    "{flag} must be visible ASCII without spaces (it travels in an HTTP header)"
                ))
            } else {
                Ok(())
            }
        };
        for k in &self.api_keys {
            check("--api-key", k)?;
        }
        if let Some(k) = &self.admin_key {
            check("--admin-key", k)?;
        }
        if self.protect_metrics && self.api_keys.is_empty() {
            return Err("--protect-metrics needs --api-key".into());
        }
        Ok(())
    }

    /// Whether the API routes need a key (every request that reaches them presented one).
    pub fn requires_api_key(&self) -> bool {
        !self.api_keys.is_empty()
    }

    /// Whether any route needs a key.
    pub fn any_key(&self) -> bool {
        !self.api_keys.is_empty() || self.admin_key.is_some()
    }

    /// The key this engine presents to its peers' HTTP fronts (a decode engine's phase-1
    /// call to a prefill engine): its first API key.
    pub fn outbound_key(&self) -> Option<&str> {
        self.api_keys.first().map(String::as_str)
    }
}

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Open,
    Api,
    Admin,
}

/// The generation server's admin routes.
pub const ADMIN_ROUTES: &[&str] = &[
    "/reset_prefix_cache",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
];

/// The keys as digests, and which routes are admin routes; checked per request.
pub struct Gate {
    api: Vec<[u8; 32]>,
    admin: Option<[u8; 32]>,
    protect_metrics: bool,
    admin_routes: &'static [&'static str],
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Whether `presented` equals any of `keys`, in time that depends only on their count.
fn matches_any(presented: &[u8; 32], keys: &[[u8; 32]]) -> bool {
    let mut hit = subtle::Choice::from(0u8);
    for k in keys {
        hit |= presented.ct_eq(k);
    }
    bool::from(hit)
}

impl Gate {
    pub fn new(opts: &AuthOptions, admin_routes: &'static [&'static str]) -> Self {
        Self {
            api: opts.api_keys.iter().map(|k| digest(k)).collect(),
            admin: opts.admin_key.as_deref().map(digest),
            protect_metrics: opts.protect_metrics,
            admin_routes,
        }
    }

    /// What `path` needs.
    pub fn access(&self, path: &str) -> Access {
        match path {
            "/health" | "/version" => Access::Open,
            "/metrics" if !self.protect_metrics => Access::Open,
            p if self.admin_routes.contains(&p) => Access::Admin,
            _ => Access::Api,
        }
    }

    /// Whether a request for `path` with `headers` may go on; the refusal otherwise.
    pub fn check(&self, path: &str, headers: &HeaderMap) -> Result<(), ApiError> {
        match self.access(path) {
            Access::Open => Ok(()),
            Access::Api if self.api.is_empty() => Ok(()),
            Access::Api => {
                let key = presented(headers)?;
                let admin = self
                    .admin
                    .as_ref()
                    .is_some_and(|a| matches_any(&key, std::slice::from_ref(a)));
                if matches_any(&key, &self.api) | admin {
                    Ok(())
                } else {
                    Err(wrong_key())
                }
            }
            Access::Admin => match &self.admin {
                Some(admin) => {
                    let key = presented(headers)?;
                    if matches_any(&key, std::slice::from_ref(admin)) {
                        Ok(())
                    } else if matches_any(&key, &self.api) {
                        Err(ApiError::forbidden(
                            "This route needs the admin key; the API key does not open it.",
                        )
                        .with_code("admin_key_required"))
                    } else {
                        Err(wrong_key())
                    }
                }
                None if !self.api.is_empty() => Err(ApiError::forbidden(
                    "Admin routes are disabled: start the engine with --admin-key.",
                )
                .with_code("admin_disabled")),
                None => Ok(()),
            },
        }
    }
}

/// The digest of the `Authorization: Bearer` key, or the 401 for a missing one.
fn presented(headers: &HeaderMap) -> Result<[u8; 32], ApiError> {
    let missing = || {
        ApiError::unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
            .with_code("invalid_api_key")
    };
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or_else(missing)?
        .to_str()
        .map_err(|_| wrong_key())?;
    let (scheme, key) = value.trim().split_once(' ').ok_or_else(wrong_key)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(missing());
    }
    Ok(digest(key.trim()))
}

fn wrong_key() -> ApiError {
    ApiError::unauthorized("Incorrect API key provided.").with_code("invalid_api_key")
}

/// The middleware: refuses what [`Gate::check`] refuses (401s carry
/// `WWW-Authenticate: Bearer`), passes the rest on.
pub async fn guard(State(gate): State<Arc<Gate>>, req: Request, next: Next) -> Response {
    match gate.check(req.uri().path(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => {
            let mut resp = strata_api::http::error_response(&e, None);
            if e.status == 401 {
                resp.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            resp.into_response()
        }
    }
}

/// The start-up warning for a front that anyone who reaches it may use fully.
pub fn warn_if_open(opts: &AuthOptions, addr: std::net::SocketAddr) {
    if !opts.any_key() && !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "serving on a non-loopback address without --api-key or --admin-key: anyone who \
             can reach this port may use every route, admin routes included"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    fn gate(api: &[&str], admin: Option<&str>, protect_metrics: bool) -> Gate {
        Gate::new(
            &AuthOptions {
                api_keys: api.iter().map(|s| s.to_string()).collect(),
                admin_key: admin.map(str::to_string),
                protect_metrics,
            },
            ADMIN_ROUTES,
        )
    }

    fn status(g: &Gate, path: &str, auth: Option<&str>) -> u16 {
        match g.check(path, &headers(auth)) {
            Ok(()) => 200,
            Err(e) => e.status,
        }
    }

    #[test]
    fn without_keys_everything_is_open() {
        let g = gate(&[], None, false);
        for p in [
            "/v1/chat/completions",
            "/tokenize",
            "/reset_prefix_cache",
            "/x",
        ] {
            assert_eq!(status(&g, p, None), 200, "{p}");
        }
    }

    #[test]
    fn api_key_guards_every_route_but_health_version_and_metrics() {
        let g = gate(&["k1", "k2"], None, false);
        for p in ["/health", "/version", "/metrics"] {
            assert_eq!(status(&g, p, None), 200, "{p}");
        }
        for p in [
            "/v1/chat/completions",
            "/v1/models",
            "/tokenize",
            "/detokenize",
            "/nope",
        ] {
            assert_eq!(status(&g, p, None), 401, "{p}");
            assert_eq!(status(&g, p, Some("Bearer k3")), 401, "{p}");
            assert_eq!(status(&g, p, Some("Bearer k1")), 200, "{p}");
            assert_eq!(status(&g, p, Some("bearer k2")), 200, "{p}");
        }
        // Another scheme, no key, or the key without a scheme are refused.
        for bad in ["Basic k1", "Bearer", "k1", "Bearer k1x", "Bearer  "] {
            assert_eq!(status(&g, "/v1/models", Some(bad)), 401, "{bad}");
        }
        // Admin routes are disabled without an admin key, whatever is presented.
        for auth in [None, Some("Bearer k1")] {
            let e = g.check("/reset_prefix_cache", &headers(auth)).unwrap_err();
            assert_eq!(e.status, 403);
            assert!(e.message.contains("--admin-key"), "{}", e.message);
        }
        let e = g.check("/v1/models", &headers(None)).unwrap_err();
        assert_eq!(e.type_str(), "authentication_error");
        assert_eq!(e.code.as_deref(), Some("invalid_api_key"));
    }

    #[test]
    fn admin_key_opens_admin_routes_and_api_routes() {
        let g = gate(&["api"], Some("adm"), false);
        for p in ADMIN_ROUTES {
            assert_eq!(status(&g, p, None), 401, "{p}");
            assert_eq!(status(&g, p, Some("Bearer wrong")), 401, "{p}");
            assert_eq!(status(&g, p, Some("Bearer api")), 403, "{p}");
            assert_eq!(status(&g, p, Some("Bearer adm")), 200, "{p}");
        }
        assert_eq!(status(&g, "/v1/completions", Some("Bearer adm")), 200);
        // An admin key alone guards only the admin routes.
        let g = gate(&[], Some("adm"), false);
        assert_eq!(status(&g, "/v1/completions", None), 200);
        assert_eq!(status(&g, "/reset_prefix_cache", None), 401);
        assert_eq!(status(&g, "/reset_prefix_cache", Some("Bearer adm")), 200);
    }

    #[test]
    fn protected_metrics_need_the_api_key() {
        let g = gate(&["k"], None, true);
        assert_eq!(status(&g, "/metrics", None), 401);
        assert_eq!(status(&g, "/metrics", Some("Bearer k")), 200);
        assert_eq!(status(&g, "/health", None), 200);
    }

    #[test]
    fn unusable_keys_are_refused_at_start_and_never_printed() {
        let o = |api: &[&str], admin: Option<&str>| AuthOptions {
            api_keys: api.iter().map(|s| s.to_string()).collect(),
            admin_key: admin.map(str::to_string),
            protect_metrics: false,
        };
        assert!(o(&["ok-key"], Some("adm")).validate().is_ok());
        assert!(o(&[""], None).validate().is_err());
        assert!(o(&["has space"], None).validate().is_err());
        assert!(o(&[], Some("tab\t")).validate().is_err());
        let protect = AuthOptions {
            protect_metrics: true,
            ..o(&[], None)
        };
        assert!(protect.validate().is_err());
        let shown = format!("{:?}", o(&["secret-1"], Some("secret-2")));
        assert!(!shown.contains("secret"), "{shown}");
    }
}
