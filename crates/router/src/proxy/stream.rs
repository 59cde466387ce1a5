//! Streamed answers, passed through chunk by chunk as they arrive.
//!
//! Each chunk is also watched: as SSE events for the APIs whose streams end with
//! `data: [DONE]` (chat and text completions; a terminator split across network chunks is
//! still seen, and content that merely quotes `[DONE]` is not taken for it), for a `usage`
//! block on every API (counted for the endpoint when the stream ends), and on the
//! Responses API for the response's id (its home, for later requests that need it). A
//! broken upstream, or a completions stream that ends without `[DONE]`, ends the client's
//! stream with an error event and counts against the endpoint. The lease travels with the
//! stream and is dropped once, when it ends or when the client goes away.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use futures_util::StreamExt;
use http_body_util::BodyExt;
use strata_api::{sse, ApiError, StreamWatch};

use crate::intake::Api;
use crate::response_homes::ResponseIdScan;
use crate::router::{Lease, Router};
use crate::usage::UsageScan;

struct Relay {
    data: http_body_util::BodyDataStream<hyper::body::Incoming>,
    lease: Lease,
    router: Router,
    /// Judges the end of a `[DONE]`-terminated stream.
    done: Option<StreamWatch>,
    usage: UsageScan,
    /// Looks for the id of a Responses answer.
    ids: Option<ResponseIdScan>,
    _spans: [tracing::Span; 2],
}

impl Relay {
    fn chunk(&mut self, chunk: &[u8]) {
        if let Some(w) = &mut self.done {
            w.feed(chunk);
        }
        self.usage.feed(chunk);
        if let Some(id) = self.ids.as_mut().and_then(|s| s.feed(chunk)) {
            self.router.remember_response(&id, self.lease.url());
        }
    }

    /// The stream ended cleanly: whether it ended the way a finished one does.
    fn ended_well(&mut self) -> bool {
        if let Some((prompt, completion)) = self.usage.finish() {
            self.router
                .metrics()
                .usage(self.lease.url(), prompt, completion);
        }
        match &mut self.done {
            Some(w) => {
                w.finish();
                w.ended_well()
            }
            None => true,
        }
    }
}

/// The client's body for an upstream event stream of `api`.
pub(super) fn stream_through(
    incoming: hyper::body::Incoming,
    lease: Lease,
    router: Router,
    api: Api,
    spans: [tracing::Span; 2],
) -> Body {
    let relay = Relay {
        data: incoming.into_data_stream(),
        lease,
        router,
        done: api.ends_with_done().then(StreamWatch::new),
        usage: UsageScan::new(true),
        ids: (api == Api::Responses).then(ResponseIdScan::default),
        _spans: spans,
    };
    let s = futures_util::stream::unfold(Some(relay), |relay| async move {
        let mut st = relay?;
        match st.data.next().await {
            Some(Ok(chunk)) => {
                st.chunk(&chunk);
                Some((Ok::<Bytes, Infallible>(chunk), Some(st)))
            }
            Some(Err(e)) => {
                tracing::warn!(endpoint = %st.lease.url(), error = %e, "upstream stream broke");
                st.lease.failure();
                Some((Ok(stream_error_event()), None))
            }
            None => {
                if st.ended_well() {
                    None
                } else {
                    tracing::warn!(endpoint = %st.lease.url(), "upstream stream ended without [DONE]");
                    st.lease.failure();
                    Some((Ok(stream_error_event()), None))
                }
            }
        }
    });
    Body::from_stream(s)
}

fn stream_error_event() -> Bytes {
    let err = ApiError::unavailable("The replica serving this stream failed before it finished.");
    Bytes::from(sse::encode_data(&err.to_json_string()))
}
