//! A call the gateway makes of its own accord to a model on the platform: the semantic
//! cache's embedding ([`super::lookup`]) and a classifier guardrail's `/classify`
//! ([`super::classify_guard`]). It goes where the model is served: the model's plan of
//! targets in order, one try each, directly or through an embedded router, each try within
//! its own timeout and all of them within the model's.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};

use super::route::Route;
use super::send::{read_limited, send_direct, send_via_router, RouterAsk, UpstreamReply, JSON};
use crate::config::Resolved;
use crate::routing;
use crate::state::Gateway;

/// What a side call is, and on whose behalf.
pub(crate) struct SideCall<'a> {
    /// The route called on each target (`/v1/embeddings`, `/classify`).
    pub route: Route,
    /// The client request's headers (the router's flow control reads them).
    pub headers: &'a HeaderMap,
    /// The caller's tenant, the flow an embedded router counts the call under.
    pub tenant: &'a str,
    pub request_id: &'a HeaderValue,
    /// The largest answer read.
    pub answer_limit: usize,
}

/// Calls `model` by its plan: `body` makes a try's request for the target's own model name,
/// and `accept` reads a 2xx answer. Returns the first answer accepted, or the last failure
/// in words (no target, a failed send, a non-2xx answer, an answer `accept` refused).
pub(crate) async fn call_model<T>(
    gw: &Gateway,
    resolved: &Resolved,
    model: &str,
    call: &SideCall<'_>,
    body: impl Fn(&str) -> Bytes,
    accept: impl Fn(&Bytes) -> Option<T>,
) -> Result<T, String> {
    let model = resolved
        .model(model)
        .ok_or_else(|| format!("`{model}` is not a model"))?;
    let tries = {
        let mut rng = gw.rng.lock();
        routing::plan(resolved, model, 0, &mut *rng)
    };
    let deadline = Instant::now() + Duration::from_millis(model.timeout_ms);
    let mut last = "no target to try".to_string();
    for att in tries {
        let Some(up) = resolved.upstreams.get(&att.upstream) else {
            continue;
        };
        let per_try = att
            .try_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        if per_try.is_zero() {
            break;
        }
        let payload = body(&att.upstream_model);
        let sent = match &up.router {
            None => {
                send_direct(
                    gw,
                    up,
                    call.route,
                    &payload,
                    &JSON,
                    call.request_id,
                    per_try,
                    None,
                )
                .await
            }
            Some(emb) => {
                let ask = RouterAsk {
                    model: &att.upstream_model,
                    prefix: "",
                    headers: call.headers,
                    priority: 0,
                    flow: call.tenant,
                    traceparent: None,
                    content_type: &JSON,
                };
                let until = Instant::now() + per_try;
                send_via_router(
                    gw,
                    &emb.router,
                    call.route,
                    &payload,
                    call.request_id,
                    &ask,
                    until,
                )
                .await
            }
        };
        last = match sent {
            Ok(UpstreamReply { resp, lease }) => {
                let read = read_limited(resp, call.answer_limit, Instant::now() + per_try).await;
                drop(lease);
                match read {
                    Ok((200..=299, _, bytes)) => match accept(&bytes) {
                        Some(answer) => return Ok(answer),
                        None => format!(
                            "upstream `{}` answered what could not be read",
                            att.upstream
                        ),
                    },
                    Ok((status, _, bytes)) => format!(
                        "upstream `{}` answered {status}: {}",
                        att.upstream,
                        String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                    ),
                    Err(f) => format!("upstream `{}`: {f:?}", att.upstream),
                }
            }
            Err(f) => format!("upstream `{}`: {f:?}", att.upstream),
        };
        tracing::debug!(route = ?call.route, %last, "a side call's try failed");
    }
    Err(last)
}
