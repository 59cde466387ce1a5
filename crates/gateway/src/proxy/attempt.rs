//! Stage 4, try: the plan's tries in order, each retried with backoff while the failure
//! allows, until one answers 2xx or the request's deadline passes. The stage *returns*
//! the answer (a whole body, or a stream's head with its lease) instead of sending it, so
//! a later stage can look at it (guardrails, the cache, a cascade's escalation check).

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::HeaderValue;
use serde_json::Value;
use strata_api::trace::{self, TraceParent};
use tracing::Instrument;

use super::admit::Admitted;
use super::send::{read_limited, send_direct, send_via_router, Replica, RouterAsk, UpstreamReply};
use super::shape::prompt_prefix_text;
use super::ERROR_BODY_LIMIT;
use crate::routing::{self, Attempt, Failure, Next};
use crate::state::Gateway;
use crate::upstream::UpstreamBody;

/// Which try answered.
#[derive(Debug, Clone)]
pub(crate) struct Served {
    pub attempt: Attempt,
    /// Tries made, this one included.
    pub tries: u32,
    /// The replica (`host:port`) when an embedded router chose it.
    pub replica: Option<String>,
}

/// What the tries came to.
pub(crate) enum Tried {
    /// A 2xx answer, read whole (the replica's lease is already released).
    Whole {
        status: u16,
        content_type: Option<HeaderValue>,
        bytes: Bytes,
        served: Served,
    },
    /// A 2xx streamed answer: its head, the body still to come, the replica's lease.
    Stream {
        resp: axum::http::Response<UpstreamBody>,
        lease: Option<Replica>,
        served: Served,
    },
    /// Nothing answered 2xx: the last failure (`None` when the deadline left no try).
    Failed(Option<Failure>),
}

/// Runs `plan` for `req` (which arrived at `started`) until `deadline`.
pub(crate) async fn try_plan(
    gw: &Gateway,
    req: &mut Admitted,
    plan: &[Attempt],
    started: Instant,
    deadline: Instant,
) -> Tried {
    let resolved = req.resolved.clone();
    let max_response_bytes = resolved.config.server.max_response_bytes;
    let mut last: Option<Failure> = None;
    let mut tries = 0u32;
    // Prompt text for the embedded routers' prefix index, built on first use.
    let mut prefix_text: Option<String> = None;
    let incoming =
        TraceParent::from_header(req.headers.get(trace::TRACEPARENT).map(|v| v.as_bytes()));
    'targets: for att in plan {
        let Some(up) = resolved.upstreams.get(&att.upstream) else {
            continue;
        };
        // The body as received when only its `model` could differ and does not.
        let payload = if !req.rewritten && att.upstream_model == req.requested {
            req.bytes.clone()
        } else {
            req.body["model"] = Value::String(att.upstream_model.clone());
            match serde_json::to_vec(&req.body) {
                Ok(p) => Bytes::from(p),
                Err(_) => continue,
            }
        };
        for n in 0..=att.retries {
            if n > 0 {
                let wait = {
                    let mut rng = gw.rng.lock();
                    routing::backoff(att.backoff_ms, n - 1, &mut *rng)
                };
                if Instant::now() + wait >= deadline {
                    break 'targets;
                }
                tokio::time::sleep(wait).await;
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break 'targets;
            }
            let per_try = att.try_timeout.min(remaining);
            let try_deadline = Instant::now() + per_try;
            tries += 1;
            // One span per attempt; the upstream sees it as its parent.
            let try_span = tracing::info_span!(
                target: trace::SPAN_TARGET,
                "gateway.try",
                otel.kind = "client",
                upstream = %att.upstream,
                model = %att.upstream_model,
                try_number = tries,
                http.response.status_code = tracing::field::Empty,
                failure = tracing::field::Empty,
            );
            let traceparent = trace::outgoing(&try_span, incoming.as_ref())
                .and_then(|t| HeaderValue::from_str(&t.to_string()).ok());
            let traceparent = traceparent.as_ref();
            let sent = async {
                match &up.router {
                    None => {
                        send_direct(
                            gw,
                            up,
                            req.route,
                            &payload,
                            &req.request_id,
                            per_try,
                            traceparent,
                        )
                        .await
                    }
                    Some(emb) => {
                        let prefix =
                            prefix_text.get_or_insert_with(|| prompt_prefix_text(&req.body));
                        let ask = RouterAsk {
                            model: &att.upstream_model,
                            prefix,
                            headers: &req.headers,
                            priority: req
                                .body
                                .get("priority")
                                .and_then(Value::as_i64)
                                .map_or(0, |p| p.clamp(i32::MIN.into(), i32::MAX.into()) as i32),
                            traceparent,
                        };
                        send_via_router(
                            gw,
                            &emb.router,
                            req.route,
                            &payload,
                            &req.request_id,
                            &ask,
                            try_deadline,
                        )
                        .await
                    }
                }
            }
            .instrument(try_span.clone())
            .await;
            match &sent {
                Ok(r) => {
                    try_span.record("http.response.status_code", r.resp.status().as_u16());
                }
                Err(f) => {
                    try_span.record("failure", tracing::field::debug(f));
                }
            }
            let failure = match sent {
                Err(f) => f,
                Ok(UpstreamReply { resp, mut lease }) if resp.status().is_success() => {
                    tracing::debug!(
                        request_id = req.request_id.to_str().unwrap_or(""),
                        key = %req.key.record.id,
                        model = %att.model,
                        upstream = %att.upstream,
                        tries,
                        stream = req.stream,
                        "upstream answered"
                    );
                    gw.metrics.duration.observe(started.elapsed().as_secs_f64());
                    let served = Served {
                        attempt: att.clone(),
                        tries,
                        replica: lease
                            .as_ref()
                            .map(|l| l.url().trim_start_matches("http://").to_string()),
                    };
                    if req.stream {
                        return Tried::Stream {
                            resp,
                            lease,
                            served,
                        };
                    }
                    match read_limited(resp, max_response_bytes, try_deadline).await {
                        Ok((status, content_type, bytes)) => {
                            drop(lease);
                            return Tried::Whole {
                                status,
                                content_type,
                                bytes,
                                served,
                            };
                        }
                        Err(f) => {
                            if let Some(l) = &mut lease {
                                l.fail();
                            }
                            f
                        }
                    }
                }
                Ok(UpstreamReply { resp, lease }) => {
                    let status = resp.status().as_u16();
                    let text = match read_limited(resp, ERROR_BODY_LIMIT, try_deadline).await {
                        Ok((_, _, b)) => String::from_utf8_lossy(&b).into_owned(),
                        Err(_) => String::new(),
                    };
                    drop(lease);
                    Failure::Status(status, text)
                }
            };
            let kind = match &failure {
                Failure::Connect => "connect".to_string(),
                Failure::Timeout => "timeout".to_string(),
                Failure::Status(s, _) => s.to_string(),
            };
            gw.metrics
                .upstream_failures
                .get_or_create(&vec![("upstream", att.upstream.clone()), ("kind", kind)])
                .inc();
            tracing::debug!(
                request_id = req.request_id.to_str().unwrap_or(""),
                upstream = %att.upstream,
                ?failure,
                "upstream try failed"
            );
            let next = routing::classify(&failure);
            last = Some(failure);
            match next {
                Next::Retry => continue,
                Next::NextTarget => continue 'targets,
                Next::Relay => break 'targets,
            }
        }
    }
    Tried::Failed(last)
}

/// The deadline of all tries of a request that started at `started` for a model with
/// `timeout_ms`.
pub(crate) fn deadline(started: Instant, timeout_ms: u64) -> Instant {
    started + Duration::from_millis(timeout_ms)
}
