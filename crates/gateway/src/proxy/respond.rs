//! Stage 5, respond: turns what the tries came to (or a cache hit) into the client's
//! answer: output guardrails over a whole body, storing it in the cache, the headers
//! naming who answered, relaying an upstream's client error as worded, or a 503 when every
//! try failed. It says what to settle; it settles nothing itself.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::Value;
use strata_api::ApiError;

use super::account::Settle;
use super::classify_guard;
use super::classify_stream;
use super::headers::{hv, CACHE_HEADER, MODEL_HEADER, SERVED_BY_HEADER, UPSTREAM_HEADER};
use super::lookup::store_answer;
use super::refusal::error_response;
use super::send::Replica;
use super::shape::answer_usage;
use super::values::{Admitted, Reply, Served, Store, StreamReply, Tried};
use crate::routing::{self, Failure};
use crate::state::Gateway;
use crate::stream_guard::StreamGuard;
use crate::upstream::UpstreamBody;

pub(crate) fn count_request(gw: &Gateway, model: &str, status: u16) {
    gw.metrics
        .requests
        .get_or_create(&vec![
            ("model", model.to_string()),
            ("status", status.to_string()),
        ])
        .inc();
}

/// A cache hit (`which`: `hit` for the exact cache, `semantic`), answered as the lookup
/// gave it: the stored body, or for a streamed request that answer as SSE events.
pub(crate) fn cached(
    gw: &Gateway,
    mut req: Admitted,
    hit: Bytes,
    which: &'static str,
    settle: &mut Settle,
) -> Reply {
    settle.answered_by_cache();
    count_request(gw, &req.model().name, 200);
    let content_type = if req.stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    let mut response = Response::new(Body::from(hit));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if req.stream {
        response
            .headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    }
    response
        .headers_mut()
        .insert(CACHE_HEADER, HeaderValue::from_static(which));
    // The exact cache's "miss" before a semantic hit is not the answer's outcome.
    req.extra.remove(CACHE_HEADER);
    response.headers_mut().extend(req.extra);
    Reply::Whole {
        response,
        usage: None,
        status: 200,
        cached: true,
    }
}

/// Names who answered in the headers and in the accounting.
fn served(gw: &Gateway, req: &mut Admitted, served: &Served, settle: &mut Settle) {
    let att = &served.attempt;
    settle.served_by(&att.upstream, &att.model, att.price);
    if served.tries > 1 {
        gw.metrics.fallbacks.inc();
    }
    req.extra.insert(UPSTREAM_HEADER, hv(&att.upstream));
    req.extra.insert(MODEL_HEADER, hv(&att.model));
    if let Some(r) = &served.replica {
        req.extra.insert(SERVED_BY_HEADER, hv(r));
    }
}

pub(crate) async fn respond(
    gw: &Gateway,
    mut req: Admitted,
    tried: Tried,
    store: Store,
    settle: &mut Settle,
) -> Reply {
    let public_model = req.model().name.clone();
    match tried {
        Tried::Stream {
            resp,
            lease,
            served: s,
        } => {
            served(gw, &mut req, &s, settle);
            stream_reply(gw, req, resp, lease, store).await
        }
        Tried::Whole {
            status,
            content_type,
            mut bytes,
            served: s,
        } => {
            served(gw, &mut req, &s, settle);
            let usage = answer_usage(req.route, &bytes);
            if let Err(e) = classify_guard::check_output(gw, &req, &bytes).await {
                return withheld(gw, req, e, usage, status);
            }
            if !req.resolved.guardrails.is_empty() {
                if let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) {
                    match req.resolved.guardrails.apply_response(&mut v) {
                        Ok(true) => {
                            if let Ok(b) = serde_json::to_vec(&v) {
                                bytes = Bytes::from(b);
                            }
                        }
                        Ok(false) => {}
                        Err(reason) => {
                            count_request(gw, &public_model, 400);
                            gw.metrics.reject("guardrail");
                            let mut response = error_response(
                                &ApiError::invalid_no_param(format!(
                                    "The response was withheld: {reason}"
                                ))
                                .with_code("guardrail_blocked"),
                            );
                            response.headers_mut().extend(req.extra);
                            // The model did the work: charged at the upstream's status.
                            return Reply::Whole {
                                response,
                                usage,
                                status,
                                cached: false,
                            };
                        }
                    }
                }
            }
            if status == 200 {
                store_answer(gw, store, bytes.clone()).await;
            }
            count_request(gw, &public_model, status);
            let mut response = Response::new(Body::from(bytes));
            *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                content_type.unwrap_or_else(|| HeaderValue::from_static("application/json")),
            );
            response.headers_mut().extend(req.extra);
            Reply::Whole {
                response,
                usage,
                status,
                cached: false,
            }
        }
        Tried::Failed(last) => {
            let mut response = failed(&public_model, last);
            let status = response.status().as_u16();
            count_request(gw, &public_model, status);
            response.headers_mut().extend(req.extra);
            Reply::Whole {
                response,
                usage: None,
                status,
                cached: false,
            }
        }
    }
}

/// A streamed answer to relay: held first while output classifier rules read it
/// ([`classify_stream`]), then watched through the pattern guardrails.
async fn stream_reply(
    gw: &Gateway,
    req: Admitted,
    resp: axum::http::Response<UpstreamBody>,
    lease: Option<Replica>,
    store: Store,
) -> Reply {
    let resp = if classify_guard::classifies_output(&req) {
        let status = resp.status().as_u16();
        match classify_stream::hold(gw, &req, resp).await {
            Ok(resp) => resp,
            Err(w) => {
                drop(lease);
                return withheld(gw, req, w.error, w.usage, status);
            }
        }
    } else {
        resp
    };
    count_request(gw, &req.model().name, 200);
    let guard =
        (!req.resolved.guardrails.is_empty()).then(|| StreamGuard::new(req.resolved.clone()));
    Reply::Stream(Box::new(StreamReply {
        resp,
        lease,
        guard,
        extra: req.extra,
        store,
        max_entry_bytes: req.resolved.config.cache.max_entry_bytes,
    }))
}

/// An answer an output rule withheld: the rule's error instead. The model did the work,
/// so it is charged at the upstream's `status` with the answer's `usage`.
fn withheld(
    gw: &Gateway,
    req: Admitted,
    error: ApiError,
    usage: Option<(u64, u64)>,
    status: u16,
) -> Reply {
    count_request(gw, &req.model().name, error.status);
    gw.metrics.reject("guardrail");
    let mut response = error_response(&error);
    response.headers_mut().extend(req.extra);
    Reply::Whole {
        response,
        usage,
        status,
        cached: false,
    }
}

/// Nothing succeeded: the last failure, when it is an upstream's client error (4xx, also
/// one that moved the plan on, such as a context-length error), goes to the client as that
/// status with the upstream's error; only connect errors, timeouts and 5xx become a 503.
fn failed(model: &str, last: Option<Failure>) -> Response {
    match last {
        Some(Failure::Status(status, text)) if routing::is_client_error(status) => {
            // The upstream's message, param and code in OpenAI's shape (a body that is not
            // OpenAI-shaped is replaced by one naming the status).
            let err = serde_json::from_str::<strata_api::ErrorResponse>(&text)
                .map(|e| e.into_api_error(status))
                .unwrap_or_else(|_| {
                    ApiError::new(
                        strata_api::ErrorKind::from_status(status),
                        format!("Upstream answered {status}."),
                    )
                });
            error_response(&err)
        }
        other => {
            let why = match other {
                Some(Failure::Timeout) => "timed out".to_string(),
                Some(Failure::Connect) => "could not be reached".to_string(),
                Some(Failure::Tls(why)) => format!(
                    "could not be reached over TLS ({})",
                    routing::tls_reason(&why)
                ),
                Some(Failure::KeyRefused(s)) => format!("refused the gateway's key ({s})"),
                Some(Failure::Status(s, _)) => format!("answered {s}"),
                None => "were not tried (deadline)".to_string(),
            };
            error_response(&ApiError::unavailable(format!(
                "All upstreams for model `{model}` failed: the last {why}."
            )))
        }
    }
}
