//! Serving another API through the chat pipeline: the routes of [`crate::anthropic`] and
//! [`crate::responses`] translate their request into a chat request ([`crate::translate`])
//! and hand it to the proxy's stages ([`crate::proxy::handle`]) as if the client had sent
//! it to `/v1/chat/completions`, so keys, limits, budgets, usage accounting, caches,
//! cascades and guardrails apply unchanged. This file builds that inner request, reads
//! the pipeline's answer ([`ChatAnswer`]) and maps a streamed one event by event
//! ([`map_stream`]).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use serde::Serialize;
use strata_api::{ApiError, ChatCompletionChunk, ErrorKind, SseDecoder};

use crate::proxy::{self, Route};
use crate::state::Gateway;

/// What the chat pipeline answered.
pub(crate) enum ChatAnswer {
    /// A 2xx JSON body.
    Whole { body: Bytes, headers: HeaderMap },
    /// A 2xx event stream (the request is settled when the body is done or dropped).
    Stream { body: Body, headers: HeaderMap },
    /// A refusal or an upstream error, as the pipeline worded it.
    Error { error: ApiError, headers: HeaderMap },
}

/// Sends `body` to `route` through the proxy's stages, with the client's headers
/// (credentials, request id, trace context) and the caller the route authenticated
/// (`proxy::Authenticated` in `parts`' extensions: not authenticated twice), and reads
/// what came back.
pub(crate) async fn call(
    gw: Arc<Gateway>,
    parts: &Parts,
    route: Route,
    body: Vec<u8>,
) -> ChatAnswer {
    let mut req = Request::new(Body::from(body));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = route.path().parse().unwrap_or_default();
    if let Some(caller) = parts.extensions.get::<proxy::Authenticated>() {
        req.extensions_mut().insert(caller.clone());
    }
    let headers = req.headers_mut();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_LENGTH && name != header::TRANSFER_ENCODING {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let limit = gw.config.get().config.server.max_response_bytes;
    let resp = proxy::handle(gw, route, req).await;
    read(resp, limit).await
}

/// Serializes `value` for [`call`] (a request the gateway built always serializes).
pub(crate) fn to_body<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// Reads the pipeline's answer; a body that is not an event stream is read whole within
/// `limit` (`server.max_response_bytes`).
async fn read(resp: Response, limit: usize) -> ChatAnswer {
    let (parts, body) = resp.into_parts();
    let mut headers = parts.headers;
    let is_stream = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    headers.remove(header::CONTENT_TYPE);
    headers.remove(header::CONTENT_LENGTH);
    if parts.status.is_success() && is_stream {
        return ChatAnswer::Stream { body, headers };
    }
    // A whole answer is in memory already (read within `server.max_response_bytes`), but
    // a streamed request's answer that is not an event stream (an upstream answering
    // 2xx JSON to `stream: true`) is still the upstream's live body: bounded the same.
    let bytes = match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => bytes,
        Err(_) => {
            let mut error = ApiError::new(
                ErrorKind::Server,
                format!(
                    "The model's answer broke off or exceeds the gateway's limit of {limit} bytes."
                ),
            );
            error.status = 502;
            return ChatAnswer::Error { error, headers };
        }
    };
    if parts.status.is_success() {
        return ChatAnswer::Whole {
            body: bytes,
            headers,
        };
    }
    let status = parts.status.as_u16();
    let error = serde_json::from_slice::<strata_api::ErrorResponse>(&bytes)
        .map(|e| e.into_api_error(status))
        .unwrap_or_else(|_| {
            ApiError::new(
                ErrorKind::from_status(status),
                format!("The request failed with status {status}."),
            )
        });
    ChatAnswer::Error { error, headers }
}

/// What a streamed chat answer becomes, event by event.
pub(crate) trait StreamMapper: Send + 'static {
    /// Appends the SSE text for one chunk.
    fn chunk(&mut self, chunk: &ChatCompletionChunk, out: &mut String);
    /// Appends the closing events (`[DONE]` came).
    fn done(&mut self, out: &mut String);
    /// Appends an error event (the stream broke or carried an error).
    fn error(&mut self, message: &str, out: &mut String);
    /// Work to finish before the events appended so far go out (taken once after each
    /// call; a Responses stream stores its response before `response.completed`).
    fn pending(&mut self) -> Option<futures_util::future::BoxFuture<'static, ()>> {
        None
    }
}

struct MapState<M> {
    inner: axum::body::BodyDataStream,
    decoder: SseDecoder,
    mapper: M,
    ended: bool,
}

/// A chat event stream's body as `M` maps it. A chunk that is an error object (a
/// guardrail that stopped the stream, an upstream's error event) and a stream that breaks
/// or ends without `[DONE]` end the mapped stream with the mapper's error event.
pub(crate) fn map_stream<M: StreamMapper>(body: Body, mapper: M) -> Body {
    let state = MapState {
        inner: body.into_data_stream(),
        decoder: SseDecoder::new(),
        mapper,
        ended: false,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if st.ended {
                return None;
            }
            let mut out = String::new();
            match st.inner.next().await {
                Some(Ok(bytes)) => feed(&mut st, &bytes, &mut out),
                Some(Err(e)) => {
                    st.mapper.error(&format!("The stream broke: {e}"), &mut out);
                    st.ended = true;
                }
                None => {
                    st.mapper
                        .error("The stream ended before it was complete.", &mut out);
                    st.ended = true;
                }
            }
            if let Some(work) = st.mapper.pending() {
                work.await;
            }
            if !out.is_empty() {
                return Some((Ok::<_, std::io::Error>(Bytes::from(out)), st));
            }
        }
    });
    Body::from_stream(stream)
}

fn feed<M: StreamMapper>(st: &mut MapState<M>, bytes: &[u8], out: &mut String) {
    let events = match st.decoder.feed(bytes) {
        Ok(events) => events,
        Err(e) => {
            st.mapper.error(&format!("Unreadable stream: {e}"), out);
            st.ended = true;
            return;
        }
    };
    for ev in events {
        if st.ended {
            return;
        }
        if ev.is_done() {
            st.mapper.done(out);
            st.ended = true;
            return;
        }
        match ev.json::<ChatCompletionChunk>() {
            Ok(chunk) => st.mapper.chunk(&chunk, out),
            Err(_) => {
                let message = serde_json::from_str::<serde_json::Value>(&ev.data)
                    .ok()
                    .and_then(|v| {
                        v.get("error")
                            .and_then(|e| e.get("message"))
                            .and_then(|m| m.as_str())
                            .map(str::to_string)
                    });
                if let Some(m) = message {
                    st.mapper.error(&m, out);
                    st.ended = true;
                    return;
                }
            }
        }
    }
}

/// An SSE response with `headers` (request id, rate-limit state, who answered).
pub(crate) fn sse_response(body: Body, headers: HeaderMap) -> Response {
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp.headers_mut().extend(headers);
    resp
}

/// A JSON response with `status` and `headers`.
pub(crate) fn json_response<T: Serialize>(
    status: StatusCode,
    value: &T,
    headers: HeaderMap,
) -> Response {
    let mut resp = Response::new(Body::from(to_body(value)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut().extend(headers);
    resp
}

/// The request body, within `server.max_body_bytes`; `Err(limit)` when larger.
pub(crate) async fn read_body(gw: &Gateway, body: Body) -> Result<Bytes, usize> {
    let limit = gw.config.get().config.server.max_body_bytes;
    axum::body::to_bytes(body, limit).await.map_err(|_| limit)
}
