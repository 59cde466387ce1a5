//! One request on its way upstream: what every attempt shares, the headers that go up and
//! come back, and reading an answer whole.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use http_body_util::{BodyExt, Full, Limited};
use strata_api::trace;

use super::{PREFILLED_BY, REQUEST_ID, SERVED_BY};
use crate::intake::Api;
use crate::router::Router;

/// Largest non-streamed upstream body relayed.
const MAX_UPSTREAM_BODY: usize = 256 << 20;

/// What every attempt of one request shares: where it goes upstream and what it carries
/// besides the body.
pub(super) struct Upstream<'a> {
    pub router: &'a Router,
    pub parts: &'a axum::http::request::Parts,
    /// Path and query, as the client sent them.
    pub path: &'a str,
    pub rid: HeaderValue,
    /// The `traceparent` every attempt sends: the proxy span as parent.
    pub traceparent: Option<HeaderValue>,
    /// The API the path asks for (how its streams end, whether it stores responses).
    pub api: Api,
}

pub(super) fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

/// The client's headers that go upstream: not hop-by-hop, not the ones the router sets
/// itself (request id, `traceparent`), and never one of the prefill protocol's
/// (`x-prefiller-*`): a client does not choose the host a decode engine prefills on.
pub(super) fn forwarded_headers(
    parts: &axum::http::request::Parts,
) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    parts.headers.iter().filter(|(name, _)| {
        !is_hop_by_hop(name)
            && *name != REQUEST_ID
            && *name != trace::TRACEPARENT
            && !crate::headers::is_prefiller(name.as_str())
    })
}

/// The request one attempt sends to `url`.
pub(super) fn upstream_request(
    up: &Upstream<'_>,
    url: &str,
    body: Bytes,
) -> Result<hyper::Request<Full<Bytes>>, axum::http::Error> {
    let mut builder = hyper::Request::builder()
        .method(up.parts.method.clone())
        .uri(format!("{url}{}", up.path));
    for (name, value) in forwarded_headers(up.parts) {
        builder = builder.header(name, value);
    }
    builder = builder.header(REQUEST_ID, up.rid.clone());
    if let Some(tp) = &up.traceparent {
        builder = builder.header(trace::TRACEPARENT, tp.clone());
    }
    builder.body(Full::new(body))
}

/// The upstream's answer headers for the client: not hop-by-hop, plus the request id and
/// who served (and prefilled) it.
pub(super) fn relayed_headers(
    upstream: &HeaderMap,
    rid: &HeaderValue,
    url: &str,
    prefilled_by: Option<&str>,
) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(upstream.len() + 2);
    for (name, value) in upstream {
        if !is_hop_by_hop(name) {
            headers.append(name, value.clone());
        }
    }
    headers.insert(REQUEST_ID, rid.clone());
    if let Ok(v) = HeaderValue::from_str(crate::endpoint::strip_scheme(url)) {
        headers.insert(SERVED_BY, v);
    }
    if let Some(p) = prefilled_by {
        if let Ok(v) = HeaderValue::from_str(crate::endpoint::strip_scheme(p)) {
            headers.insert(PREFILLED_BY, v);
        }
    }
    headers
}

pub(super) fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

pub(super) fn respond(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// An answer's body, read whole (bounded); `None` when it broke off or was too large.
pub(super) async fn collect_limited(body: hyper::body::Incoming) -> Option<Bytes> {
    Limited::new(body, MAX_UPSTREAM_BODY)
        .collect()
        .await
        .ok()
        .map(|c| c.to_bytes())
}
