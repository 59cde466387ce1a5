//! Stage 6, settle: the accounting of a reply ([`Settle::finish`]), at once for a whole
//! answer, when the stream is over for a streamed one.

use std::sync::Arc;

use axum::response::Response;

use super::account::Settle;
use super::stream::watch_stream;
use super::values::Reply;
use crate::state::Gateway;

/// Settles a reply: at once for a whole answer, when the stream is over for a streamed
/// one (the returned response's body carries the settlement).
pub(crate) async fn settle(gw: &Arc<Gateway>, settle: Settle, reply: Reply) -> Response {
    match reply {
        Reply::Whole {
            response,
            usage,
            status,
            cached,
        } => {
            settle.finish(usage, status, cached).await;
            response
        }
        Reply::Stream(s) => watch_stream(gw.clone(), *s, settle),
    }
}
