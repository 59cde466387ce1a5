//! Server-sent events over every choice of a request: one task merges the choices'
//! channels into one response body. A client that goes away closes the body, which drops
//! the receivers, which aborts the sequences.

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use strata_api::sse;
use tokio::sync::mpsc::{self, UnboundedReceiver};

use crate::sequence::SeqEvent;

/// One SSE stream over every choice of a request.
///
/// `encode(Some((choice, event)))` turns an event into SSE lines; `encode(None)` gives the
/// lines that go before `[DONE]` (the usage chunk).
pub(super) fn sse_response(
    receivers: Vec<UnboundedReceiver<SeqEvent>>,
    mut encode: impl FnMut(Option<(usize, SeqEvent)>) -> Vec<String> + Send + 'static,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut streams =
            futures_util::stream::select_all(receivers.into_iter().enumerate().map(|(i, rx)| {
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |ev| (i, ev))
            }));
        loop {
            tokio::select! {
                // The client went away: dropping the receivers aborts the sequences.
                _ = tx.closed() => return,
                next = streams.next() => {
                    let Some((i, ev)) = next else { break };
                    for line in encode(Some((i, ev))) {
                        if tx.send(Ok(Bytes::from(line))).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
        for line in encode(None) {
            if tx.send(Ok(Bytes::from(line))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(sse::DONE.as_bytes()))).await;
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
