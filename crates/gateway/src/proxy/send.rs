//! One upstream call: to a fixed base URL, or through an embedded router that picks a
//! replica (and holds its lease while the answer is relayed); and reading a whole body,
//! bounded in size and time.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue};
use http_body_util::BodyExt;
use strata_router::scheduling::SchedRequest;
use strata_router::{Lease, Picked, Router};

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
    // Flow control counts the request as in transit until it is picked (dropped below).
    let admitted = admit_to_router(router, ask, payload, try_deadline).await?;
    let picked = pick_replicas(router, ask)?;
    drop(admitted);
    let one = ReplicaTry {
        gw,
        route,
        payload,
        request_id,
        ask,
        try_deadline,
    };
    let max_attempts = router.config().max_retries + 1;
    let mut attempts = 0;
    let mut last = Failure::Status(503, "router: no replica could take the request".into());
    for (id, url) in &picked.ranked {
        if attempts >= max_attempts {
            break;
        }
        let Some(lease) = router.lease(*id, url) else {
            continue;
        };
        attempts += 1;
        match one.send(lease, url).await {
            Sent::Answer(reply) => return Ok(reply),
            Sent::Stop(failure) => return Err(failure),
            Sent::Next(failure) => last = failure,
        }
    }
    Err(last)
}

/// The router's admission (flow control) for the request, waited for at most until the
/// try's deadline.
async fn admit_to_router(
    router: &Router,
    ask: &RouterAsk<'_>,
    payload: &Bytes,
    try_deadline: Instant,
) -> Result<strata_router::admission::Admitted, Failure> {
    let left = try_deadline.saturating_duration_since(Instant::now());
    let ticket = strata_router::admission::Ticket {
        priority: ask.priority,
        flow: ask.flow.to_string(),
        bytes: payload.len() as u64,
        ttl: Some(left),
    };
    match tokio::time::timeout(left, router.admit_flow(&ticket)).await {
        Err(_) => Err(Failure::Timeout),
        Ok(Err(e)) => Err(Failure::Status(503, e.to_string())),
        Ok(Ok(a)) => Ok(a),
    }
}

/// The router's ranked replicas for the request, the pick traced in its own span.
fn pick_replicas(router: &Router, ask: &RouterAsk<'_>) -> Result<Picked, Failure> {
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
    Ok(picked)
}

/// How one replica's try ended.
enum Sent {
    /// An answer below 500, with the replica's lease.
    Answer(UpstreamReply),
    /// A failure that ends the request's try (its deadline passed).
    Stop(Failure),
    /// A failure the next replica may make up for.
    Next(Failure),
}

/// What every replica's try of one request shares.
struct ReplicaTry<'a> {
    gw: &'a Gateway,
    route: Route,
    payload: &'a Bytes,
    request_id: &'a HeaderValue,
    ask: &'a RouterAsk<'a>,
    try_deadline: Instant,
}

impl ReplicaTry<'_> {
    /// Sends the request to the replica at `url` (its lease taken), reporting a failure
    /// to its circuit breaker; a 5xx answer's body is read for the failure's text. A
    /// URL that does not parse fails quietly: nothing was sent.
    async fn send(&self, mut lease: Lease, url: &str) -> Sent {
        let left = self.try_deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Sent::Stop(Failure::Timeout);
        }
        let Ok(uri) = format!("{url}{}", self.route.path()).parse::<axum::http::Uri>() else {
            lease.failure();
            return Sent::Next(Failure::Connect);
        };
        let send = self.gw.client.post(
            &uri,
            self.payload.clone(),
            self.ask.content_type,
            (REQUEST_ID_HEADER, self.request_id),
            &[],
            self.ask.traceparent,
        );
        let failure = match tokio::time::timeout(left, send).await {
            Err(_) => {
                lease.failure();
                return Sent::Stop(Failure::Timeout);
            }
            Ok(Ok(resp)) if !resp.status().is_server_error() => {
                return Sent::Answer(UpstreamReply {
                    resp,
                    lease: Some(Replica {
                        lease,
                        settled: false,
                    }),
                });
            }
            Ok(Err(e)) => {
                lease.failure();
                classify_send_error(&e)
            }
            Ok(Ok(resp)) => {
                lease.failure();
                let status = resp.status().as_u16();
                let text = match read_limited(resp, ERROR_BODY_LIMIT, self.try_deadline).await {
                    Ok((_, _, b)) => String::from_utf8_lossy(&b).into_owned(),
                    Err(_) => String::new(),
                };
                Failure::Status(status, text)
            }
        };
        tracing::debug!(endpoint = %url, failure = ?failure, "replica failed before answering; next");
        Sent::Next(failure)
    }
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
