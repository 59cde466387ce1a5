//! The way upstream: the pick (or the stored response's home), phase 1 of a
//! disaggregated request, then attempts in ranked order, each outcome feeding that
//! endpoint's circuit breaker. A connect error, a 5xx, or a non-streamed body that breaks
//! off moves on to the next-ranked endpoint, at most `max_retries` times; when none
//! answers the last 5xx is relayed (else 503).

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use strata_api::{trace, ApiError};

use super::prefill;
use super::stream::stream_through;
use super::upstream::{
    collect_limited, is_event_stream, relayed_headers, respond, upstream_request, Upstream,
};
use super::{error_response, Traced, REQUEST_ID};
use crate::admission::Admitted;
use crate::intake::{Api, Intake};
use crate::response_homes::ResponseIdScan;
use crate::router::{Lease, Picked, RouteError, Router};
use crate::scheduling::SchedRequest;
use crate::usage::usage_of;

/// What one attempt on one endpoint came to.
enum Attempt {
    /// An answer to relay (a success or a client error), or the error ending the request.
    Answered(Response),
    /// A 5xx: the next endpoint is tried, and this one is relayed if none answers.
    ServerError(StatusCode, HeaderMap, Bytes),
    /// No usable answer (a connect error, a body that broke): the next endpoint is tried.
    Failed,
}

/// Pick → phase 1 of a disaggregated request → attempts in ranked order → the last 5xx
/// (or a 503) when none answered.
pub(super) async fn forward(
    router: &Router,
    parts: &axum::http::request::Parts,
    intake: Intake,
    mut sreq: SchedRequest,
    rid: HeaderValue,
    traced: Traced,
    admitted: Option<Admitted>,
) -> Response {
    let home = intake.home.as_deref().and_then(|id| router.pick_home(id));
    let picked = home.map_or_else(|| pick(router, &mut sreq, &traced.span), Ok);
    // Picked: the pool's room counts the request from here on.
    drop(admitted);
    let picked = match picked {
        Ok(p) => p,
        Err(e) => return error_response(&e.to_api_error(), Some(&rid)),
    };
    let body = intake.body;
    let proxy_span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        parent: &traced.span,
        "router.proxy",
        otel.kind = "client",
        endpoint = tracing::field::Empty,
        attempts = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    // Every attempt names this span as its parent; what the caller sent is replaced.
    let traceparent = trace::outgoing(&proxy_span, traced.incoming.as_ref())
        .and_then(|t| HeaderValue::from_str(&t.to_string()).ok());
    let up = Upstream {
        router,
        parts,
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/"),
        rid,
        traceparent,
        api: intake.api,
    };
    let (body, prefilled_by) = prefill::disaggregate(&up, &picked, body, &proxy_span).await;
    try_ranked(
        &up,
        &picked,
        &body,
        prefilled_by.as_deref(),
        [traced.span, proxy_span],
    )
    .await
}

/// The scheduling decision, on its own span.
fn pick(
    router: &Router,
    sreq: &mut SchedRequest,
    parent: &tracing::Span,
) -> Result<Picked, RouteError> {
    let pick_span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        parent: parent,
        "router.pick",
        model = %sreq.model,
        profile = tracing::field::Empty,
        endpoint = tracing::field::Empty,
        candidates = tracing::field::Empty,
        scores = tracing::field::Empty,
        error = tracing::field::Empty,
    );
    let picked = pick_span.in_scope(|| router.pick(sreq));
    match &picked {
        Ok(p) if !pick_span.is_disabled() => record_pick(&pick_span, p),
        Ok(_) => {}
        Err(e) => {
            pick_span.record("error", tracing::field::display(e));
        }
    }
    picked
}

/// Attempts in ranked order, at most `max_retries + 1` of them, skipping endpoints whose
/// circuit refuses. `spans` (the request's and the proxy's) end with the answer, or with
/// its stream.
async fn try_ranked(
    up: &Upstream<'_>,
    picked: &Picked,
    body: &Bytes,
    prefilled_by: Option<&str>,
    spans: [tracing::Span; 2],
) -> Response {
    let max_attempts = up.router.config().max_retries + 1;
    let mut last_5xx: Option<(StatusCode, HeaderMap, Bytes)> = None;
    let mut attempts = 0;
    for (id, url) in &picked.ranked {
        if attempts >= max_attempts {
            break;
        }
        let Some(lease) = up.router.lease(*id, url) else {
            continue;
        };
        if attempts > 0 {
            up.router.metrics().retried.inc();
        }
        attempts += 1;
        spans[1].record("endpoint", &**url);
        spans[1].record("attempts", attempts);
        match attempt(up, url, lease, body, prefilled_by, &spans).await {
            Attempt::Answered(resp) => return resp,
            Attempt::ServerError(status, headers, bytes) => {
                last_5xx = Some((status, headers, bytes));
            }
            Attempt::Failed => {}
        }
    }
    up.router.metrics().fail("upstream");
    none_answered(last_5xx, up.rid.clone())
}

/// One attempt on `url`, its outcome fed to the endpoint's circuit through `lease`. A
/// stream is relayed as it arrives (the lease travels with it); any other answer is read
/// whole first, so one that breaks off is retried elsewhere.
async fn attempt(
    up: &Upstream<'_>,
    url: &str,
    mut lease: Lease,
    body: &Bytes,
    prefilled_by: Option<&str>,
    spans: &[tracing::Span; 2],
) -> Attempt {
    let req = match upstream_request(up, url, body.clone()) {
        Ok(r) => r,
        Err(e) => {
            return Attempt::Answered(error_response(
                &ApiError::internal(format!("building the upstream request: {e}")),
                Some(&up.rid),
            ))
        }
    };
    let resp = match up.router.inner.client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(endpoint = %url, request_id = ?up.rid, error = %e, "upstream failed before responding");
            lease.failure();
            return Attempt::Failed;
        }
    };
    let status = resp.status();
    spans[1].record("http.response.status_code", status.as_u16());
    let (resp_parts, incoming) = resp.into_parts();
    if status.is_server_error() {
        lease.failure();
        let bytes = collect_limited(incoming).await.unwrap_or_default();
        return Attempt::ServerError(status, resp_parts.headers, bytes);
    }
    lease.success();
    let headers = relayed_headers(&resp_parts.headers, &up.rid, url, prefilled_by);
    if is_event_stream(&resp_parts.headers) {
        // The spans end with the stream, not with its head.
        let body = stream_through(incoming, lease, up.router.clone(), up.api, spans.clone());
        return Attempt::Answered(respond(status, headers, body));
    }
    match collect_limited(incoming).await {
        Some(bytes) => {
            settle_answer(up, url, status, &headers, &bytes);
            drop(lease);
            Attempt::Answered(respond(status, headers, Body::from(bytes)))
        }
        None => {
            tracing::warn!(endpoint = %url, request_id = ?up.rid, "upstream body broke before anything was sent; retrying");
            lease.failure();
            Attempt::Failed
        }
    }
}

/// A whole answer's bookkeeping: its `usage` for the endpoint's token counters and, on
/// the Responses API, the response's home.
fn settle_answer(
    up: &Upstream<'_>,
    url: &str,
    status: StatusCode,
    headers: &HeaderMap,
    bytes: &[u8],
) {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    if !json {
        return;
    }
    if let Some((prompt, completion)) = usage_of(bytes) {
        up.router.metrics().usage(url, prompt, completion);
    }
    if up.api == Api::Responses && status.is_success() {
        if let Some(id) = ResponseIdScan::default().feed(bytes) {
            up.router.remember_response(&id, url);
        }
    }
}

/// Every attempt failed: the last 5xx as the endpoint sent it (its content type, the
/// request id), or a 503 when none answered at all.
fn none_answered(last_5xx: Option<(StatusCode, HeaderMap, Bytes)>, rid: HeaderValue) -> Response {
    match last_5xx {
        Some((status, headers, bytes)) => {
            let mut out = Response::new(Body::from(bytes));
            *out.status_mut() = status;
            if let Some(ct) = headers.get(header::CONTENT_TYPE) {
                out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
            }
            out.headers_mut().insert(REQUEST_ID, rid);
            out
        }
        None => error_response(
            &ApiError::unavailable("No replica could serve the request."),
            Some(&rid),
        ),
    }
}

/// The pick on its span: the chosen endpoint, the candidates ranked and the best scores.
fn record_pick(span: &tracing::Span, picked: &Picked) {
    use std::fmt::Write as _;
    let mut scores = String::new();
    for (id, url) in picked.ranked.iter().take(4) {
        let Some(s) = picked.decision.ranked.iter().find(|s| s.id == *id) else {
            continue;
        };
        if !scores.is_empty() {
            scores.push(' ');
        }
        let _ = write!(
            scores,
            "{}={:.3}",
            url.trim_start_matches("http://"),
            s.score
        );
    }
    span.record("profile", picked.decision.profile.as_str());
    if let Some((_, url)) = picked.ranked.first() {
        span.record("endpoint", &**url);
    }
    span.record("candidates", picked.ranked.len());
    span.record("scores", scores.as_str());
}
