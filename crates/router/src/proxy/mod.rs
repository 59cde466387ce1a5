//! The HTTP front (PROTOCOLS §1): reads each request's routing view, admits it, asks the
//! [`Router`] where to send it, and forwards it, on every path.
//!
//! Request flow, one way: read the body (bounded: 413) → [`crate::intake`] (the routing
//! view; only a body that is not JSON, or no `model` where the API runs one, is answered
//! here, 400, no replica touched) → flow control for requests that name a model
//! ([`Router::admit_flow`]: refused with 429, or queued in its band and flow until the
//! pool has room, 503 past its time to live) → prefix keys (prompt-text chunks; token blocks
//! when a precise scorer is configured) → the pick ([`Router::pick`], or the replica that
//! holds the stored response the request needs) → attempts in ranked order
//! ([`forward`]). Everything the engine validates (sampling values, message roles,
//! multimodal parts, structured outputs, unknown fields) goes to it byte for byte, and its
//! answer, success or error, comes back unchanged.
//!
//! Callers' key: with `api_key` set, [`crate::auth`] answers a request without it 401
//! before anything else (`/health` and `/metrics` stay open).
//!
//! Routes: the router answers `GET /v1/models` (the union over the pool), `GET /health`,
//! `GET /metrics`, `GET /debug/endpoints` and `GET /debug/flows` itself ([`local`]).
//! Every other path is forwarded: known APIs ([`crate::intake::routes`]) and unknown
//! POSTs whose JSON body names a `model` are routed by it; anything else (a `GET`, a body
//! without a model on a path that needs none) goes to any ready replica, or to the one
//! holding the stored response its path names. The five routes the router has always
//! served (`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/tokenize`,
//! `/detokenize`) answer another method with 405.
//!
//! Disaggregated requests (a prefill/decode profile pair in the scheduling config,
//! PROTOCOLS §11, vLLM's proxy protocol): see [`prefill`]. A client's `x-prefiller-*`
//! headers are never passed on: they would make a decode engine prefill on a host the
//! client chose.
//!
//! Answers: streams (`text/event-stream`) are passed through chunk by chunk as they arrive
//! ([`stream`]); other answers are read whole first, so an upstream dying mid-body is still
//! retried elsewhere. Token `usage`, wherever an answer carries one, is counted per
//! endpoint. A client that goes away drops the response body, which drops the upstream
//! connection: the engine sees the disconnect and aborts the request.

mod forward;
mod local;
mod prefill;
mod stream;
mod upstream;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::response::Response;
use axum::routing::{get, post};
use rand::Rng;
use strata_api::trace::{self, TraceParent};
use strata_api::ApiError;

use crate::admission::Ticket;
use crate::intake::{self, Incoming, Intake};
use crate::router::Router;

pub use crate::headers::{OBJECTIVE, PREFILLED_BY, PROFILE, REQUEST_ID, SERVED_BY};

/// The router's axum app.
pub fn app(router: Router) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", post(routed))
        .route("/v1/completions", post(routed))
        .route("/v1/embeddings", post(routed))
        .route("/tokenize", post(routed))
        .route("/detokenize", post(routed))
        .route("/v1/models", get(local::models))
        .route("/health", get(local::health))
        .route("/metrics", get(local::metrics))
        .route("/debug/endpoints", get(local::debug_endpoints))
        .route("/debug/flows", get(local::debug_flows))
        .fallback(routed)
        .method_not_allowed_fallback(strata_api::http::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            router.clone(),
            crate::auth::require_api_key,
        ))
        .with_state(router)
}

fn error_response(err: &ApiError, request_id: Option<&HeaderValue>) -> Response {
    let mut resp = strata_api::http::error_response(err, None);
    if let Some(id) = request_id {
        resp.headers_mut().insert(REQUEST_ID, id.clone());
    }
    resp
}

fn request_id(headers: &HeaderMap) -> HeaderValue {
    headers
        .get(REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .cloned()
        .unwrap_or_else(|| {
            let n: u128 = rand::rng().random();
            HeaderValue::from_str(&format!("{n:032x}")).unwrap_or(HeaderValue::from_static("0"))
        })
}

/// A request's trace span and the `traceparent` it came with.
struct Traced {
    span: tracing::Span,
    incoming: Option<TraceParent>,
}

/// The request's span, child of the caller's `traceparent` when it sent a valid one.
fn traced(parts: &axum::http::request::Parts) -> Traced {
    let span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        "router.request",
        otel.kind = "server",
        http.route = parts.uri.path()
    );
    let incoming = trace::accept(
        &span,
        parts.headers.get(trace::TRACEPARENT).map(|v| v.as_bytes()),
    );
    Traced { span, incoming }
}

/// Whether a request of this method carries a body to read.
fn has_body(method: &Method) -> bool {
    *method == Method::POST || *method == Method::PUT || *method == Method::PATCH
}

/// Every forwarded path: read → intake → admit → schedule → forward.
async fn routed(State(router): State<Router>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let traced = traced(&parts);
    let rid = request_id(&parts.headers);
    router.metrics().requests.inc();
    let intake = match read(&router, &parts, body).await {
        Ok(i) => i,
        Err(e) => {
            router.metrics().fail("invalid_request");
            return error_response(&e, Some(&rid));
        }
    };
    let ticket = Ticket::read(
        &router,
        &parts.headers,
        &intake.model,
        intake.view.priority,
        intake.body.len(),
    );
    // Flow control is for work a model runs; a request naming none (a `GET`, an
    // operation on the replica) is not held back.
    let admitted = if intake.model.is_empty() {
        None
    } else {
        match router.admit_flow(&ticket).await {
            Ok(a) => Some(a),
            Err(e) => return error_response(&e.to_api_error(), Some(&rid)),
        }
    };
    let sreq = intake::sched_request(&router, &parts.headers, &intake, ticket.priority).await;
    forward::forward(&router, &parts, intake, sreq, rid, traced, admitted).await
}

/// The body, bounded by `max_body_bytes`, and its routing view.
async fn read(
    router: &Router,
    parts: &axum::http::request::Parts,
    body: Body,
) -> Result<Intake, ApiError> {
    let max = router.config().max_body_bytes;
    let body: Bytes = axum::body::to_bytes(body, max)
        .await
        .map_err(|_| ApiError::body_too_large(max))?;
    let req = Incoming {
        has_body: has_body(&parts.method),
        path: parts.uri.path(),
        content_type: parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
    };
    intake::read(req, body, intake::limits(router), None)
}
