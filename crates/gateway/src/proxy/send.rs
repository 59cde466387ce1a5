//! One upstream call: to a fixed base URL, or through an embedded router that picks a
//! replica (and holds its lease while the answer is relayed); and reading a whole body,
//! bounded in size and time.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue};
use http_body_util::BodyExt;
use strata_router::scheduling::SchedRequest;
use strata_router::{Lease, Router};

use super::headers::REQUEST_ID_HEADER;
use super::route::Route;
use crate::config::ResolvedUpstream;
use crate::routing::Failure;
use crate::state::Gateway;
use crate::upstream::{SendError, UpstreamBody};

/// The `Content-Type` of a JSON body.
pub(crate) static JSON: HeaderValue = HeaderValue::from_static("application/json");

/// Bytes of an upstream error body kept for classification and relay.
pub(super) const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// A try that got response headers; `lease` holds the replica chosen by an embedded
/// router (in flight until dropped).
pub(crate) struct UpstreamReply {
    pub resp: axum::http::Response<UpstreamBody>,
    pub lease: Option<Replica>,
}

/// A replica's lease while its answer is being relayed. The outcome is reported once,
/// when it is known: [`Replica::fail`] for a body or stream that breaks; success when
/// dropped otherwise — a whole body, a stream that ended with `[DONE]`, a client error
/// answer, or a client that went away (not the replica's fault). Reporting success only
/// at the end lets a replica that cuts every stream open its circuit, and reporting on
/// every path keeps a half-open circuit from waiting forever for its probe.
pub(crate) struct Replica {
    lease: Lease,
    settled: bool,
}

impl Replica {
    pub(crate) fn url(&self) -> &str {
        self.lease.url()
    }

    pub(crate) fn fail(&mut self) {
        if !self.settled {
            self.settled = true;
            self.lease.failure();
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if !self.settled {
            self.lease.success();
        }
    }
}

fn classify_send_error(e: &SendError) -> Failure {
    tracing::warn!(error = %e, "upstream try failed before an answer");
    match e {
        SendError::Timeout => Failure::Timeout,
        SendError::Connect(_) => Failure::Connect,
        SendError::Tls(why) => Failure::Tls(why.clone()),
    }
}

/// One try against a fixed base URL (the upstream's path for the route, its auth
/// headers): any status comes back as an [`UpstreamReply`].
#[allow(clippy::too_many_arguments)]
pub(crate) async fn send_direct(
    gw: &Gateway,
    up: &ResolvedUpstream,
    route: Route,
    payload: &Bytes,
    content_type: &HeaderValue,
    request_id: &HeaderValue,
    per_try: Duration,
    traceparent: Option<&HeaderValue>,
) -> Result<UpstreamReply, Failure> {
    // Parsed at load (the fallback only serves a hand-built upstream).
    let parsed;
    let uri = match up.route_urls.get(route.index()) {
        Some(u) => u,
        None => {
            parsed = format!("{}{}", up.base_url, route.path())
                .parse::<axum::http::Uri>()
                .map_err(|_| Failure::Connect)?;
            &parsed
        }
    };
    let client = up.client.as_ref().unwrap_or(&gw.client);
    let send = client.post(
        uri,
        payload.clone(),
        content_type,
        (REQUEST_ID_HEADER, request_id),
        &up.auth,
        traceparent,
    );
    match tokio::time::timeout(per_try, send).await {
        Err(_) => Err(Failure::Timeout),
        Ok(Err(e)) => Err(classify_send_error(&e)),
        Ok(Ok(resp)) => Ok(UpstreamReply { resp, lease: None }),
    }
}

/// What an embedded router needs to place one request.
pub(crate) struct RouterAsk<'a> {
    /// The `model` sent upstream (replicas may be pinned to one).
    pub model: &'a str,
    /// Prompt text for the approximate prefix index.
    pub prefix: &'a str,
    pub headers: &'a HeaderMap,
    pub priority: i32,
    /// The flow-control flow (fairness id) the request waits in: its tenant, so one
    /// tenant's burst waits behind its own requests, not everyone's.
    pub flow: &'a str,
    /// The W3C `traceparent` to send, when the request is traced.
    pub traceparent: Option<&'a HeaderValue>,
    /// The body's `Content-Type`.
    pub content_type: &'a HeaderValue,
}

/// One try through an embedded router: admission, a pick, then the ranked replicas in
/// order, moving on after a connect error or a 5xx before the first byte (at most the
/// router's `max_retries` more), each outcome reported to the replica's circuit breaker.
/// An answer below 500 comes back with its lease; the caller reports a body that
/// breaks and drops the lease when the request is over.
pub(crate) async fn send_via_router(
    gw: &Gateway,
    router: &Router,
    route: Route,
    payload: &Bytes,
    request_id: &HeaderValue,
    ask: &RouterAsk<'_>,
    try_deadline: Instant,
) -> Result<UpstreamReply, Failure> {
    let left = try_deadline.saturating_duration_since(Instant::now());
    let ticket = strata_router::admission::Ticket {
        priority: ask.priority,
        flow: ask.flow.to_string(),
        bytes: payload.len() as u64,
        ttl: Some(left),
    };
    // Flow control counts the request as in transit until it is picked (dropped below).
    let admitted = match tokio::time::timeout(left, router.admit_flow(&ticket)).await {
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(e)) => return Err(Failure::Status(503, e.to_string())),
        Ok(Ok(a)) => a,
    };
    let config = router.config();
    let mut sreq = SchedRequest {
        model: ask.model.to_string(),
        approx_blocks: router.approx_blocks(ask.model, ask.prefix),
        priority: ask.priority,
        session: ask
            .headers
            .get(config.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        ..Default::default()
    };
    let pick_span = tracing::info_span!(
        target: strata_api::trace::SPAN_TARGET,
        "gateway.pick",
        endpoint = tracing::field::Empty,
        candidates = tracing::field::Empty,
    );
    let picked = pick_span
        .in_scope(|| router.pick(&mut sreq))
        .map_err(|e| Failure::Status(503, format!("router: {e}")))?;
    if let Some((_, url)) = picked.ranked.first() {
        pick_span.record("endpoint", &**url);
    }
    pick_span.record("candidates", picked.ranked.len());
    drop(pick_span);
    drop(admitted);
    let max_attempts = config.max_retries + 1;
    let mut attempts = 0;
    let mut last = Failure::Status(503, "router: no replica could take the request".into());
    for (id, url) in &picked.ranked {
        if attempts >= max_attempts {
            break;
        }
        let Some(mut lease) = router.lease(*id, url) else {
            continue;
        };
        attempts += 1;
        let left = try_deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Failure::Timeout);
        }
        let Ok(uri) = format!("{url}{}", route.path()).parse::<axum::http::Uri>() else {
            lease.failure();
            last = Failure::Connect;
            continue;
        };
        let send = gw.client.post(
            &uri,
            payload.clone(),
            ask.content_type,
            (REQUEST_ID_HEADER, request_id),
            &[],
            ask.traceparent,
        );
        match tokio::time::timeout(left, send).await {
            Err(_) => {
                lease.failure();
                return Err(Failure::Timeout);
            }
            Ok(Err(e)) => {
                lease.failure();
                last = classify_send_error(&e);
            }
            Ok(Ok(resp)) if resp.status().is_server_error() => {
                lease.failure();
                let status = resp.status().as_u16();
                let text = match read_limited(resp, ERROR_BODY_LIMIT, try_deadline).await {
                    Ok((_, _, b)) => String::from_utf8_lossy(&b).into_owned(),
                    Err(_) => String::new(),
                };
                last = Failure::Status(status, text);
            }
            Ok(Ok(resp)) => {
                return Ok(UpstreamReply {
                    resp,
                    lease: Some(Replica {
                        lease,
                        settled: false,
                    }),
                });
            }
        }
        tracing::debug!(endpoint = %url, failure = ?last, "replica failed before answering; next");
    }
    Err(last)
}

/// Reads a whole upstream body, bounded in size and time. A body that arrives in one
/// piece is returned without a copy.
pub(crate) async fn read_limited(
    resp: axum::http::Response<UpstreamBody>,
    limit: usize,
    deadline: Instant,
) -> Result<(u16, Option<HeaderValue>, Bytes), Failure> {
    let status = resp.status().as_u16();
    let ct = resp.headers().get(header::CONTENT_TYPE).cloned();
    let mut body = resp.into_body();
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, body.frame()).await {
            Err(_) => return Err(Failure::Timeout),
            Ok(Some(Err(_))) => return Err(Failure::Connect),
            Ok(None) => break,
            Ok(Some(Ok(frame))) => {
                let Ok(chunk) = frame.into_data() else {
                    continue; // trailers
                };
                len += chunk.len();
                if len > limit {
                    return Err(Failure::Status(502, "upstream response too large".into()));
                }
                chunks.push(chunk);
            }
        }
    }
    let bytes = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.swap_remove(0),
        _ => Bytes::from(chunks.concat()),
    };
    Ok((status, ct, bytes))
}
