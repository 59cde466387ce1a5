//! A streamed answer on its way to the client: every chunk passes through as it arrives
//! (through the output guardrails when configured) while an SSE decoder watches for the
//! `usage` chunk; the request is settled when the stream ends or the client goes away.
//! When the request is cacheable, what the client received is also assembled into a whole
//! answer ([`crate::sse_answer`]) and stored once the stream ended normally (`[DONE]`,
//! no upstream error, no guardrail block); a stream the client left is never stored.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::{Stream, StreamExt};
use http_body_util::BodyExt;
use strata_api::SseDecoder;

use super::account::Settle;
use super::lookup::store_answer;
use super::send::Replica;
use super::shape::usage_from_json;
use super::values::{Store, StreamReply};
use crate::sse_answer::Assembler;
use crate::state::Gateway;
use crate::stream_guard::StreamGuard;
use crate::upstream::BodyError;

/// Wraps an upstream byte stream: passes every chunk through untouched and watches the
/// SSE events for `usage`; settles when finished or dropped.
struct UsageWatch {
    inner: Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>,
    decoder: Option<SseDecoder>,
    usage: Option<(u64, u64)>,
    settle: Option<Settle>,
    gw: Arc<Gateway>,
    failed: bool,
    /// The replica's lease when an embedded router chose it: told about a stream that
    /// breaks or ends without `[DONE]`; released (in flight no more) when this drops,
    /// including when the client goes away.
    lease: Option<Replica>,
    saw_done: bool,
    /// Output guardrails over the stream (when any are configured).
    guard: Option<StreamGuard>,
    /// No more items: the upstream ended (and held text was flushed) or a guardrail
    /// blocked the stream.
    ended: bool,
    /// The answer being assembled for the caches (cacheable requests only).
    capture: Option<Capture>,
}

/// What the client was sent, decoded and assembled, and where the answer goes.
struct Capture {
    decoder: SseDecoder,
    assembler: Assembler,
    store: Store,
}

impl Capture {
    /// `limit`: the largest answer the caches keep.
    fn new(store: Store, limit: usize) -> Capture {
        Capture {
            decoder: SseDecoder::new(),
            assembler: Assembler::new(limit),
            store,
        }
    }

    /// Feeds bytes the client was sent; false once the answer cannot be cached.
    fn feed(&mut self, bytes: &[u8]) -> bool {
        match self.decoder.feed(bytes) {
            Ok(events) => {
                for ev in events {
                    if !ev.is_done() {
                        self.assembler.feed(&ev.data);
                    }
                }
                !self.assembler.broken()
            }
            Err(_) => false,
        }
    }
}

impl UsageWatch {
    /// Hands what the client is sent to the cache capture.
    fn capture(&mut self, sent: &[u8]) {
        if let Some(c) = &mut self.capture {
            if !c.feed(sent) {
                self.capture = None;
            }
        }
    }

    /// The stream ended normally: store the assembled answer (in the background).
    fn store_capture(&mut self) {
        let Some(c) = self.capture.take() else { return };
        if self.failed || !self.saw_done {
            return;
        }
        let Some(answer) = c.assembler.finish() else {
            return;
        };
        let Ok(bytes) = serde_json::to_vec(&answer) else {
            return;
        };
        let gw = self.gw.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                store_answer(&gw, c.store, Bytes::from(bytes)).await;
            });
        }
    }

    fn observe(&mut self, chunk: &[u8]) {
        let Some(dec) = &mut self.decoder else { return };
        match dec.feed(chunk) {
            Ok(events) => {
                for ev in events {
                    // `[DONE]`, or the last event of a passed-through Messages or
                    // Responses stream (those send no `[DONE]`).
                    let last = matches!(
                        ev.event.as_deref(),
                        Some("message_stop" | "response.completed" | "response.incomplete")
                    );
                    if ev.is_done() || last {
                        self.saw_done = true;
                    }
                    if ev.data.contains("\"usage\"") && !ev.is_done() {
                        if let Some(u) = usage_from_json(ev.data.as_bytes()) {
                            self.usage = Some(u);
                        }
                    }
                }
            }
            Err(_) => self.decoder = None,
        }
    }
}

impl Stream for UsageWatch {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.ended {
                return Poll::Ready(None);
            }
            match self.inner.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    self.observe(&chunk);
                    let Some(guard) = &mut self.guard else {
                        self.capture(&chunk);
                        return Poll::Ready(Some(Ok(chunk)));
                    };
                    let out = guard.feed(&chunk);
                    if guard.blocked().is_some() {
                        // Stop reading: dropping the upstream body cancels the generation.
                        self.ended = true;
                        self.inner = Box::pin(futures_util::stream::empty());
                        self.gw.metrics.reject("guardrail");
                        self.capture = None;
                    }
                    if !out.is_empty() {
                        self.capture(&out);
                        return Poll::Ready(Some(Ok(Bytes::from(out))));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.failed = true;
                    self.capture = None;
                    if let Some(l) = &mut self.lease {
                        l.fail();
                    }
                    return Poll::Ready(Some(Err(std::io::Error::other(e))));
                }
                Poll::Ready(None) => {
                    // A replica that ends the stream without `[DONE]` failed it; a decoder
                    // that gave up (not SSE) cannot tell, so it counts as finished.
                    if !self.saw_done && self.decoder.is_some() {
                        if let Some(l) = &mut self.lease {
                            l.fail();
                        }
                    }
                    self.lease = None;
                    self.ended = true;
                    let rest = self.guard.as_mut().map(StreamGuard::finish);
                    if let Some(out) = &rest {
                        self.capture(out);
                    }
                    self.store_capture();
                    return match rest {
                        Some(out) if !out.is_empty() => Poll::Ready(Some(Ok(Bytes::from(out)))),
                        _ => Poll::Ready(None),
                    };
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Drop for UsageWatch {
    fn drop(&mut self) {
        if let Some(s) = self.settle.take() {
            let usage = self.usage;
            let status = if self.failed { 502 } else { 200 };
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(s.finish(usage, status, false));
            }
        }
    }
}

/// The client's response for a streamed answer; `settle` finishes when it is over.
pub(crate) fn watch_stream(gw: Arc<Gateway>, reply: StreamReply, settle: Settle) -> Response {
    let StreamReply {
        resp,
        lease,
        guard,
        extra,
        store,
        max_entry_bytes,
    } = reply;
    let capture = store
        .is_some()
        .then(|| Capture::new(store, max_entry_bytes));
    let status = resp.status();
    let ct = resp.headers().get(header::CONTENT_TYPE).cloned();
    let watch = UsageWatch {
        inner: Box::pin(resp.into_body().into_data_stream()),
        decoder: Some(SseDecoder::new()),
        usage: None,
        settle: Some(settle),
        gw,
        failed: false,
        lease,
        saw_done: false,
        guard,
        ended: false,
        capture,
    };
    let mut out = Response::new(Body::from_stream(watch.fuse()));
    *out.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::OK);
    out.headers_mut().insert(
        header::CONTENT_TYPE,
        ct.unwrap_or_else(|| HeaderValue::from_static("text/event-stream")),
    );
    out.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    out.headers_mut().extend(extra);
    out
}
