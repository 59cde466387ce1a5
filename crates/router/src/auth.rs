//! The callers' key: with `api_key` set (`--api-key`, `STRATA_ROUTER_API_KEY`), every route
//! but `/health` and `/metrics` needs `Authorization: Bearer <key>`; anything else is a 401
//! in OpenAI's shape, answered before the body is read or a replica is touched.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use strata_api::ApiError;

use crate::router::Router;

/// Routes served without a key: probes and scrapes.
pub const OPEN_PATHS: [&str; 2] = ["/health", "/metrics"];

/// The middleware [`crate::proxy::app`] runs first.
pub async fn require_api_key(State(router): State<Router>, req: Request, next: Next) -> Response {
    let Some(key) = router.config().api_key.as_deref() else {
        return next.run(req).await;
    };
    if OPEN_PATHS.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    match bearer(req.headers()) {
        Some(sent) if same(sent.as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => unauthorized("Incorrect API key provided."),
        None => unauthorized(
            "You didn't provide an API key. Send it in the Authorization header as `Bearer <key>`.",
        ),
    }
}

/// The token of an `Authorization: Bearer <token>` header (scheme case-insensitive).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Equal bytes, compared in time that depends on the length only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn unauthorized(message: &str) -> Response {
    let mut resp = ApiError::unauthorized(message)
        .with_code("invalid_api_key")
        .into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_read_and_compared_whole() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        for (sent, token) in [
            ("Bearer sk-1", Some("sk-1")),
            ("bearer   sk-1 ", Some("sk-1")),
            ("Basic c2stMQ==", None),
            ("Bearer ", None),
            ("sk-1", None),
        ] {
            h.insert(header::AUTHORIZATION, HeaderValue::from_static(sent));
            assert_eq!(bearer(&h), token, "{sent}");
        }
        assert!(same(b"sk-1", b"sk-1"));
        assert!(!same(b"sk-1", b"sk-2"));
        assert!(!same(b"sk-1", b"sk-12"));
        assert!(!same(b"", b"x"));
    }
}
