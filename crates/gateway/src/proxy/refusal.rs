//! Every reason the gateway refuses a request before (or instead of) an upstream answer,
//! as one enum. Each refusal maps once to the OpenAI-shaped error the client sees and to
//! the `reason` label of `strata_gateway_rejected_total`, so a new refusal is one variant
//! and two match arms, never a hand-built response in the middle of the request path.

use std::time::Duration;

use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use strata_api::{ApiError, ErrorKind};

use super::headers::hv;
use crate::state::Gateway;

/// Why a request is refused by the gateway itself.
#[derive(Debug)]
pub enum Refusal {
    /// No key in `Authorization` or `x-api-key`.
    MissingKey,
    /// A key that is malformed, unknown, wrong or revoked.
    BadKey,
    /// A JWT bearer token that does not verify (the reason is safe to show).
    BadToken(String),
    /// The body is larger than `server.max_body_bytes`.
    BodyTooLarge {
        limit: usize,
    },
    /// The body does not parse as the route's request type; the parser's error names the
    /// faulty field.
    BadShape(ApiError),
    MissingModel,
    BadMaxTokens,
    UnknownModel(String),
    /// The key or its tenant may not use this model.
    ModelForbidden(String),
    PromptTooLarge {
        chars: usize,
        max: usize,
    },
    GuardrailBlocked(String),
    /// The key's or tenant's budget is spent (the message says which).
    BudgetExceeded(String),
    /// A shared backend the request needs (rate limiter, store) failed and its failure
    /// mode is `closed`.
    BackendUnavailable {
        what: &'static str,
        error: String,
    },
    /// A rate limit refused the request. `headers` carries the request id and the
    /// `x-ratelimit-*` state; `too_large` is `(needed, limit)` when the request alone is
    /// larger than a token limit (waiting would not help, so no `Retry-After`).
    RateLimited {
        key_id: String,
        retry_after: Duration,
        too_large: Option<(u64, u64)>,
        headers: Box<HeaderMap>,
    },
    /// Every model in the plan is too small for the estimated request.
    ContextTooLong {
        max: u64,
        needed: u64,
    },
}

impl Refusal {
    /// The `reason` label in `strata_gateway_rejected_total`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Refusal::MissingKey | Refusal::BadKey | Refusal::BadToken(_) => "auth",
            Refusal::BodyTooLarge { .. }
            | Refusal::BadShape(_)
            | Refusal::MissingModel
            | Refusal::BadMaxTokens
            | Refusal::UnknownModel(_)
            | Refusal::ContextTooLong { .. } => "invalid",
            Refusal::ModelForbidden(_) => "forbidden",
            Refusal::PromptTooLarge { .. } | Refusal::GuardrailBlocked(_) => "guardrail",
            Refusal::BudgetExceeded(_) => "budget",
            Refusal::BackendUnavailable { .. } => "backend",
            Refusal::RateLimited { .. } => "rate_limit",
        }
    }

    /// The error the client sees.
    pub fn to_api_error(&self) -> ApiError {
        match self {
            Refusal::MissingKey => ApiError::unauthorized(
                "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
            )
            .with_code("invalid_api_key"),
            Refusal::BadKey => ApiError::unauthorized("Invalid, unknown or revoked API key.")
                .with_code("invalid_api_key"),
            Refusal::BadToken(why) => {
                ApiError::unauthorized(format!("Invalid bearer token: {why}."))
                    .with_code("invalid_token")
            }
            Refusal::BodyTooLarge { limit } => ApiError::body_too_large(*limit),
            Refusal::BadShape(e) => e.clone(),
            Refusal::MissingModel => {
                ApiError::invalid("model", "You must provide a `model` parameter.")
            }
            Refusal::BadMaxTokens => ApiError::invalid(
                "max_tokens",
                "`max_tokens` must be an integer of at least 1.",
            ),
            Refusal::UnknownModel(m) => ApiError::model_not_found(m),
            Refusal::ModelForbidden(m) => {
                ApiError::forbidden(format!("This API key may not use model `{m}`."))
                    .with_param("model")
                    .with_code("model_not_allowed")
            }
            Refusal::PromptTooLarge { chars, max } => ApiError::invalid_no_param(format!(
                "The prompt has {chars} characters; the limit is {max}."
            ))
            .with_code("prompt_too_large"),
            Refusal::GuardrailBlocked(reason) => {
                ApiError::invalid_no_param(reason.clone()).with_code("guardrail_blocked")
            }
            Refusal::BudgetExceeded(msg) => {
                ApiError::new(ErrorKind::RateLimit, msg.clone()).with_code("budget_exceeded")
            }
            Refusal::BackendUnavailable { what, error } => {
                ApiError::unavailable(format!("{what} is unavailable: {error}."))
            }
            Refusal::RateLimited {
                key_id,
                retry_after,
                too_large,
                ..
            } => match too_large {
                Some((needed, limit)) => ApiError::rate_limited(format!(
                    "Request too large: it needs about {needed} tokens but the limit is {limit} tokens per minute."
                )),
                None => ApiError::rate_limited(format!(
                    "Rate limit reached for API key {key_id}; retry after {:.1} s.",
                    retry_after.as_secs_f64()
                )),
            },
            Refusal::ContextTooLong { max, needed } => ApiError::invalid_no_param(format!(
                "This model's maximum context length is {max} tokens; the request needs about {needed}."
            ))
            .with_code("context_length_exceeded"),
        }
    }

    /// Counts the refusal and builds its response (with the headers it carries).
    pub fn into_response(self, gw: &Gateway) -> Response {
        gw.metrics.reject(self.metric_label());
        let mut resp = error_response(&self.to_api_error());
        match self {
            Refusal::BudgetExceeded(_) => {
                resp.headers_mut()
                    .insert("x-strata-budget", HeaderValue::from_static("exceeded"));
            }
            Refusal::RateLimited {
                retry_after,
                too_large,
                headers,
                ..
            } => {
                resp.headers_mut().extend(*headers);
                if too_large.is_none() {
                    let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
                    resp.headers_mut().insert(header::RETRY_AFTER, hv(secs));
                } else {
                    // A request larger than the whole per-minute limit never fits: waiting
                    // would not help, so the default `Retry-After` is withdrawn.
                    resp.headers_mut().remove(header::RETRY_AFTER);
                }
            }
            _ => {}
        }
        resp
    }
}

/// An OpenAI-shaped error response.
pub fn error_response(err: &ApiError) -> Response {
    // The one mapping every Strata front shares: status, OpenAI's body, and `Retry-After`
    // on 429 and 503 (a refusal that knows a better wait overwrites it).
    strata_api::http::error_response(err, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_has_a_label_and_an_openai_status() {
        let cases = [
            (Refusal::MissingKey, "auth", 401),
            (Refusal::BadKey, "auth", 401),
            (Refusal::BodyTooLarge { limit: 10 }, "invalid", 413),
            (Refusal::MissingModel, "invalid", 400),
            (Refusal::BadMaxTokens, "invalid", 400),
            (Refusal::UnknownModel("x".into()), "invalid", 404),
            (Refusal::ModelForbidden("x".into()), "forbidden", 403),
            (
                Refusal::PromptTooLarge { chars: 5, max: 4 },
                "guardrail",
                400,
            ),
            (Refusal::GuardrailBlocked("no".into()), "guardrail", 400),
            (Refusal::BudgetExceeded("spent".into()), "budget", 429),
            (
                Refusal::BackendUnavailable {
                    what: "Rate limiting",
                    error: "down".into(),
                },
                "backend",
                503,
            ),
            (
                Refusal::RateLimited {
                    key_id: "k".into(),
                    retry_after: Duration::from_secs(1),
                    too_large: None,
                    headers: Box::default(),
                },
                "rate_limit",
                429,
            ),
            (
                Refusal::ContextTooLong { max: 8, needed: 9 },
                "invalid",
                400,
            ),
        ];
        for (r, label, status) in cases {
            assert_eq!(r.metric_label(), label, "{r:?}");
            assert_eq!(r.to_api_error().status, status, "{r:?}");
        }
    }
}
