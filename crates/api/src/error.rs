//! OpenAI-shaped errors.
//!
//! Every Strata HTTP front (engine, router, gateway) answers failures with the body OpenAI's
//! clients know how to read:
//!
//! ```json
//! {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
//! ```
//!
//! `param` and `code` are always present (as `null` when unknown) because some clients index
//! them without checking. The HTTP status travels beside the body in [`ApiError::status`];
//! [`ErrorKind`] is the single place that pairs a status with its `type` string, so the
//! mapping from "what went wrong" to HTTP happens exactly once.
//!
//! Type strings follow what OpenAI returns today. Two choices are worth writing down:
//!
//! * **413** uses `invalid_request_error`: OpenAI has no dedicated type for an oversized body
//!   and reports it as a bad request.
//! * **503** uses `service_unavailable_error`, the type OpenAI's API currently sends for
//!   "servers are overloaded / not ready". (Older OpenAI responses and some proxies used
//!   `server_error`; vLLM sends Python exception names such as `BadRequestError`, which no
//!   client relies on.) Clients retry on the status code, not on the type string.
//!
//! [`ErrorResponse`] is the tolerant *parsing* side of the same shape, for code that reads an
//! upstream's error (vLLM puts an integer in `code`, OpenAI a string, so it is kept raw).

use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};

/// What went wrong, as a client-visible category. Each kind has one HTTP status and one
/// OpenAI `type` string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// 400: the request is malformed or asks for something we refuse.
    InvalidRequest,
    /// 401: no API key, or a wrong one.
    Authentication,
    /// 403: the key may not use this model or route.
    Permission,
    /// 404: unknown model or resource.
    NotFound,
    /// 413: the request body is larger than the server accepts.
    RequestTooLarge,
    /// 429: rate limited, or shed by admission control (send `Retry-After`).
    RateLimit,
    /// 500: a bug on our side. Never used for anything a client can cause.
    Server,
    /// 503: no capacity right now, or not ready yet.
    ServiceUnavailable,
}

impl ErrorKind {
    /// The HTTP status code this kind is answered with.
    pub const fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::Authentication => 401,
            ErrorKind::Permission => 403,
            ErrorKind::NotFound => 404,
            ErrorKind::RequestTooLarge => 413,
            ErrorKind::RateLimit => 429,
            ErrorKind::Server => 500,
            ErrorKind::ServiceUnavailable => 503,
        }
    }

    /// The OpenAI `type` string written into the error body.
    pub const fn type_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::RequestTooLarge => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::Server => "server_error",
            ErrorKind::ServiceUnavailable => "service_unavailable_error",
        }
    }

    /// The kind a front should use for an arbitrary HTTP status (for example one relayed
    /// from an upstream). Unknown 4xx map to [`ErrorKind::InvalidRequest`], unknown 5xx to
    /// [`ErrorKind::Server`].
    pub const fn from_status(status: u16) -> ErrorKind {
        match status {
            401 => ErrorKind::Authentication,
            403 => ErrorKind::Permission,
            404 => ErrorKind::NotFound,
            413 => ErrorKind::RequestTooLarge,
            429 => ErrorKind::RateLimit,
            503 => ErrorKind::ServiceUnavailable,
            400..=499 => ErrorKind::InvalidRequest,
            _ => ErrorKind::Server,
        }
    }
}

/// An error ready to be sent to a client: status, OpenAI body fields and kind.
///
/// Build one with the constructors ([`ApiError::invalid`], [`ApiError::model_not_found`],
/// ...) so that `status` and `kind` always agree. Serializing it (or calling
/// [`ApiError::body`]) yields the `{"error": {...}}` envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {}: {message}", kind.type_str())]
pub struct ApiError {
    /// HTTP status code (always `kind.status()` when built by this module).
    pub status: u16,
    /// Human-readable explanation, shown to the end user by most clients.
    pub message: String,
    /// Category; decides the `type` string.
    pub kind: ErrorKind,
    /// The request field at fault, e.g. `"max_tokens"` or `"messages[2].role"`.
    pub param: Option<String>,
    /// A machine-readable code, e.g. `"model_not_found"`.
    pub code: Option<String>,
}

impl ApiError {
    /// An error of `kind` with its matching status and no `param` or `code`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            status: kind.status(),
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// Sets the offending request field.
    #[must_use]
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Sets the machine-readable code.
    #[must_use]
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// 400 naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message).with_param(param)
    }

    /// 400 that concerns the request as a whole (no single field to blame).
    pub fn invalid_no_param(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Authentication, message)
    }

    /// 403: the caller may not use what it asked for.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Permission, message)
    }

    /// 404 for something other than a model (an unknown route or adapter).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    /// 404 for an unknown model, worded and coded as OpenAI does.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            ErrorKind::NotFound,
            format!("The model `{model}` does not exist."),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// 413: the body is too large.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::RequestTooLarge, message)
    }

    /// 413 for a request body over `limit` bytes: the one wording every server uses.
    pub fn body_too_large(limit: usize) -> Self {
        Self::too_large(format!(
            "The request body exceeds the limit of {limit} bytes."
        ))
    }

    /// 429 with OpenAI's `rate_limit_exceeded` code. The HTTP layer adds `Retry-After`.
    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::RateLimit, message).with_code("rate_limit_exceeded")
    }

    /// 503: no capacity, draining, or not ready.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::ServiceUnavailable, message)
    }

    /// 500: a bug. Log the details; keep the message free of internals.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Server, message)
    }

    /// The OpenAI `type` string of this error.
    pub fn type_str(&self) -> &'static str {
        self.kind.type_str()
    }

    /// The `{"error": {...}}` body as a JSON value.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind.type_str(),
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// The `{"error": {...}}` body as compact JSON text, fields in OpenAI's order
    /// (`message`, `type`, `param`, `code`).
    pub fn to_json_string(&self) -> String {
        // Serializing strings and options into a String cannot fail; the fallback exists
        // only so that no code path can panic.
        serde_json::to_string(self).unwrap_or_else(|_| self.body().to_string())
    }
}

/// The inner object of the error envelope, borrowed for serialization.
struct ErrorFields<'a>(&'a ApiError);

impl Serialize for ErrorFields<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("Error", 4)?;
        s.serialize_field("message", &self.0.message)?;
        s.serialize_field("type", self.0.kind.type_str())?;
        s.serialize_field("param", &self.0.param)?;
        s.serialize_field("code", &self.0.code)?;
        s.end()
    }
}

impl Serialize for ApiError {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("ErrorEnvelope", 1)?;
        s.serialize_field("error", &ErrorFields(self))?;
        s.end()
    }
}

/// An error body as received from some OpenAI-compatible server, parsed leniently.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// The error details.
    pub error: ErrorDetail,
}

/// The inner object of [`ErrorResponse`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Human-readable explanation.
    pub message: String,
    /// OpenAI `type` string (or whatever the upstream put there).
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// The field at fault, if named.
    #[serde(default)]
    pub param: Option<String>,
    /// OpenAI sends a string here, vLLM the HTTP status as a number; kept raw.
    #[serde(default)]
    pub code: Option<serde_json::Value>,
}

impl ErrorResponse {
    /// Converts a relayed upstream error into an [`ApiError`] carrying the upstream's
    /// status, message and param. A non-string `code` is dropped.
    pub fn into_api_error(self, status: u16) -> ApiError {
        let kind = ErrorKind::from_status(status);
        ApiError {
            status,
            message: self.error.message,
            kind,
            param: self.error.param,
            code: match self.error.code {
                Some(serde_json::Value::String(code)) => Some(code),
                _ => None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn invalid_has_openai_shape_with_param() {
        let err = ApiError::invalid("max_tokens", "max_tokens must be at least 1");
        assert_eq!(err.status, 400);
        assert_eq!(
            err.body(),
            json!({"error": {
                "message": "max_tokens must be at least 1",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": null
            }})
        );
    }

    #[test]
    fn param_and_code_are_null_not_omitted() {
        let text = ApiError::internal("boom").to_json_string();
        assert_eq!(
            text,
            r#"{"error":{"message":"boom","type":"server_error","param":null,"code":null}}"#
        );
    }

    #[test]
    fn serialize_matches_body() {
        let err = ApiError::model_not_found("llama-9");
        let via_serde = serde_json::to_value(&err).unwrap();
        assert_eq!(via_serde, err.body());
        assert_eq!(
            err.to_json_string(),
            r#"{"error":{"message":"The model `llama-9` does not exist.","type":"not_found_error","param":"model","code":"model_not_found"}}"#
        );
    }

    #[test]
    fn constructors_map_to_status_and_type() {
        let cases = [
            (
                ApiError::invalid_no_param("x"),
                400,
                "invalid_request_error",
            ),
            (ApiError::unauthorized("x"), 401, "authentication_error"),
            (ApiError::forbidden("x"), 403, "permission_error"),
            (ApiError::not_found("x"), 404, "not_found_error"),
            (ApiError::model_not_found("m"), 404, "not_found_error"),
            (ApiError::too_large("x"), 413, "invalid_request_error"),
            (ApiError::rate_limited("x"), 429, "rate_limit_error"),
            (ApiError::internal("x"), 500, "server_error"),
            (ApiError::unavailable("x"), 503, "service_unavailable_error"),
        ];
        for (err, status, ty) in cases {
            assert_eq!(err.status, status, "{err:?}");
            assert_eq!(err.kind.status(), status, "{err:?}");
            assert_eq!(err.type_str(), ty, "{err:?}");
            assert_eq!(err.body()["error"]["type"], ty);
        }
    }

    #[test]
    fn an_oversized_body_names_the_limit() {
        let err = ApiError::body_too_large(4096);
        assert_eq!(err.status, 413);
        assert_eq!(
            err.message,
            "The request body exceeds the limit of 4096 bytes."
        );
    }

    #[test]
    fn model_not_found_names_param_and_code() {
        let err = ApiError::model_not_found("gpt-x");
        assert_eq!(err.param.as_deref(), Some("model"));
        assert_eq!(err.code.as_deref(), Some("model_not_found"));
        assert!(err.message.contains("gpt-x"));
    }

    #[test]
    fn rate_limited_has_openai_code() {
        assert_eq!(
            ApiError::rate_limited("slow down").code.as_deref(),
            Some("rate_limit_exceeded")
        );
    }

    #[test]
    fn display_mentions_status_type_and_message() {
        let err = ApiError::unavailable("draining");
        assert_eq!(err.to_string(), "503 service_unavailable_error: draining");
        let as_std: &dyn std::error::Error = &err;
        assert!(as_std.source().is_none());
    }

    #[test]
    fn from_status_round_trips_known_statuses() {
        for kind in [
            ErrorKind::InvalidRequest,
            ErrorKind::Authentication,
            ErrorKind::Permission,
            ErrorKind::NotFound,
            ErrorKind::RequestTooLarge,
            ErrorKind::RateLimit,
            ErrorKind::Server,
            ErrorKind::ServiceUnavailable,
        ] {
            assert_eq!(ErrorKind::from_status(kind.status()), kind);
        }
        assert_eq!(ErrorKind::from_status(422), ErrorKind::InvalidRequest);
        assert_eq!(ErrorKind::from_status(502), ErrorKind::Server);
    }

    #[test]
    fn parses_vllm_and_openai_upstream_errors() {
        let vllm =
            r#"{"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}"#;
        let parsed: ErrorResponse = serde_json::from_str(vllm).unwrap();
        assert_eq!(parsed.error.code, Some(json!(400)));
        let api = parsed.into_api_error(400);
        assert_eq!(api.kind, ErrorKind::InvalidRequest);
        assert_eq!(api.code, None);
        assert_eq!(api.message, "too long");

        let openai = ApiError::model_not_found("m").to_json_string();
        let parsed: ErrorResponse = serde_json::from_str(&openai).unwrap();
        let api = parsed.into_api_error(404);
        assert_eq!(api, ApiError::model_not_found("m"));
    }
}
