//! The HTTP plumbing every handler shares: the body under its size limit, JSON answers,
//! OpenAI-shaped errors, and request ids.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use rand::Rng;
use strata_api::ApiError;

use super::state::AppState;

/// An OpenAI-shaped error response.
pub(super) struct ErrorResponse(pub ApiError);

impl From<ApiError> for ErrorResponse {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        strata_api::http::error_response(&self.0, None)
    }
}

pub(super) type ApiResult = Result<Response, ErrorResponse>;

/// The request's headers and whole body; a body over `--max-body-bytes` is a 413.
pub(super) async fn read_body(
    state: &AppState,
    req: Request,
) -> Result<(HeaderMap, Bytes), ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, state.max_body_bytes)
        .await
        .map_err(|_| ApiError::body_too_large(state.max_body_bytes))?;
    Ok((parts.headers, bytes))
}

pub(super) fn json_response<T: serde::Serialize>(value: &T) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => ErrorResponse(ApiError::internal(format!("cannot encode response: {e}")))
            .into_response(),
    }
}

/// The caller's `x-request-id`, when it is usable as part of ours.
pub(super) fn request_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 256)
        .map(str::to_string)
}

pub(super) fn random_id(prefix: &str) -> String {
    let n: u128 = rand::rng().random();
    format!("{prefix}-{n:032x}")
}

pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
