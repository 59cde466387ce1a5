//! The HTTP edge every Strata front shares (feature `http`): how an [`ApiError`] becomes a
//! response, the fallbacks for unknown routes and methods, and the shutdown signal. One
//! definition, so the engine, the router, the gateway and the controller answer alike
//! (`Retry-After` on every 429 and 503, the same JSON shape, the same `content-type`).

use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Seconds a client is told to wait before retrying a 429 or 503 that names no better time.
pub const DEFAULT_RETRY_AFTER_SECS: u64 = 1;

/// The response for `err`: its status, OpenAI's JSON body, and `Retry-After` on 429 and 503
/// (`retry_after_secs`, or [`DEFAULT_RETRY_AFTER_SECS`]).
pub fn error_response(err: &ApiError, retry_after_secs: Option<u64>) -> Response {
    let status = StatusCode::from_u16(err.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        err.to_json_string(),
    )
        .into_response();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        let secs = retry_after_secs.unwrap_or(DEFAULT_RETRY_AFTER_SECS).max(1);
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(&self, None)
    }
}

/// Fallback for routes nobody serves: a 404 naming the method and path.
pub async fn not_found(method: Method, uri: Uri) -> Response {
    ApiError::not_found(format!("No route for {method} {}.", uri.path()))
        .with_code("not_found")
        .into_response()
}

/// Fallback for a known route asked with the wrong method: a 405.
pub async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let mut e =
        ApiError::invalid_no_param(format!("Method {method} is not allowed on {}.", uri.path()))
            .with_code("method_not_allowed");
    e.status = 405;
    e.into_response()
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_429_and_503_says_when_to_retry() {
        for (err, retry) in [
            (ApiError::rate_limited("slow down"), Some("1")),
            (ApiError::unavailable("no capacity"), Some("1")),
            (ApiError::invalid("max_tokens", "bad"), None),
            (ApiError::internal("bug"), None),
        ] {
            let resp = err.clone().into_response();
            assert_eq!(resp.status().as_u16(), err.status);
            assert_eq!(
                resp.headers()
                    .get(header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()),
                retry,
                "{err:?}"
            );
            assert_eq!(
                resp.headers().get(header::CONTENT_TYPE).unwrap(),
                "application/json"
            );
        }
        let resp = error_response(&ApiError::rate_limited("x"), Some(30));
        assert_eq!(resp.headers().get(header::RETRY_AFTER).unwrap(), "30");
    }
}
