//! Stage 4, try: the plan's tries in order, each retried while the retry policy allows
//! ([`crate::retry`]: backoff with jitter, the upstream's `Retry-After`), until one
//! answers 2xx or the request's deadline passes. Targets on a provider that cannot take
//! the route are skipped; a provider speaking another API gets the request translated,
//! and its answer is translated back ([`crate::provider`]). The stage *returns*
//! the answer (a whole body, or a stream's head with its lease) instead of sending it, so
//! a later stage can look at it (guardrails, the cache, a cascade's escalation check).

use std::time::{Duration, Instant, SystemTime};

use axum::body::Bytes;
use axum::http::{header, HeaderValue};
use rand::Rng;
use serde_json::Value;
use strata_api::trace::{self, TraceParent};
use tracing::Instrument;

use super::form;
use super::send::{
    read_limited, send_direct, send_via_router, RouterAsk, UpstreamReply, ERROR_BODY_LIMIT, JSON,
};
use super::shape::prompt_prefix_text;
use super::values::{Admitted, Served, Tried};
use crate::config::ResolvedUpstream;
use crate::provider::anthropic;
use crate::retry::{self, Decision, FailedTry, RetryPolicy};
use crate::routing::{Attempt, Failure};
use crate::state::Gateway;

/// What the tries of one request carry from one to the next.
struct Tries {
    /// Tries made so far.
    made: u32,
    last: Option<Failure>,
    /// Prompt text for the embedded routers' prefix index, built on first use.
    prefix_text: Option<String>,
    /// The client's trace context: every try's span is its child.
    incoming: Option<TraceParent>,
}

/// One try: what it sends where, and until when.
struct OneTry<'a> {
    att: &'a Attempt,
    up: &'a ResolvedUpstream,
    payload: &'a Bytes,
    /// Its number among the request's tries (1 for the first).
    number: u32,
    per_try: Duration,
    deadline: Instant,
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
    let mut tries = Tries {
        made: 0,
        last: None,
        prefix_text: None,
        incoming: TraceParent::from_header(
            req.headers.get(trace::TRACEPARENT).map(|v| v.as_bytes()),
        ),
    };
    'targets: for att in plan {
        let Some(up) = resolved.upstreams.get(&att.upstream) else {
            continue;
        };
        if let Some(p) = up.provider.filter(|p| !p.serves(req.route)) {
            // Named as a 404 when no other target takes the route.
            let why = strata_api::ApiError::not_found(format!(
                "Upstream `{}` (provider {}) does not serve {}.",
                up.name,
                p.name(),
                req.route.path()
            ));
            tries.last = Some(Failure::Status(404, why.to_json_string()));
            continue;
        }
        let payload = match payload(req, att, up) {
            Ok(p) => p,
            Err(Some(refused)) => {
                tries.last = Some(refused);
                continue;
            }
            Err(None) => continue,
        };
        let mut retries_made = 0;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break 'targets;
            }
            let per_try = att.try_timeout.min(remaining);
            tries.made += 1;
            let one = OneTry {
                att,
                up,
                payload: &payload,
                number: tries.made,
                per_try,
                deadline: Instant::now() + per_try,
            };
            let sent = send(
                gw,
                req,
                &one,
                &mut tries.prefix_text,
                tries.incoming.as_ref(),
            )
            .await;
            let (failure, retry_after) = match sent {
                Err(f) => (f, None),
                Ok(reply) => match answer(gw, req, &one, reply, started).await {
                    Ok(tried) => return tried,
                    Err(failed) => failed,
                },
            };
            count_failure(gw, req, att, &failure);
            let decision = {
                let jitter = gw.rng.lock().random::<f64>();
                let failed = FailedTry {
                    failure: &failure,
                    retry_after,
                    retries_made,
                };
                let policy = RetryPolicy {
                    retries: att.retries,
                    base_ms: att.backoff_ms,
                };
                retry::decide(policy, failed, jitter, Instant::now(), deadline)
            };
            tries.last = Some(failure);
            match decision {
                Decision::Retry { after } => {
                    tokio::time::sleep(after).await;
                    retries_made += 1;
                }
                Decision::NextTarget => continue 'targets,
                Decision::Relay => break 'targets,
            }
        }
    }
    Tried::Failed(tries.last)
}

/// The body sent for `att` on `up`: as received when only its `model` could differ and
/// does not; translated for a provider that speaks another API. `Err(None)` when it cannot
/// be serialized, `Err(Some(400))` when the request cannot be said in the provider's API
/// (the target is skipped either way).
fn payload(
    req: &mut Admitted,
    att: &Attempt,
    up: &ResolvedUpstream,
) -> Result<Bytes, Option<Failure>> {
    let translates = up.provider.is_some_and(|p| p.translates(req.route));
    if req.route.multipart() {
        // The form as sent; only its `model` field changes when the target names another.
        if att.upstream_model == req.requested {
            return Ok(req.bytes.clone());
        }
        return form::with_model(&req.bytes, &att.upstream_model).ok_or(None);
    }
    if !translates && !req.rewritten && att.upstream_model == req.requested {
        return Ok(req.bytes.clone());
    }
    req.body["model"] = Value::String(att.upstream_model.clone());
    if translates {
        return anthropic::request_body(&req.body).map_err(Some);
    }
    serde_json::to_vec(&req.body)
        .map(Bytes::from)
        .map_err(|_| None)
}

/// Sends one try, in its own span (the upstream sees it as its parent): to the upstream's
/// base URL, or through its embedded router. Any status comes back as an answer.
async fn send(
    gw: &Gateway,
    req: &Admitted,
    one: &OneTry<'_>,
    prefix_text: &mut Option<String>,
    incoming: Option<&TraceParent>,
) -> Result<UpstreamReply, Failure> {
    let att = one.att;
    let try_span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        "gateway.try",
        otel.kind = "client",
        upstream = %att.upstream,
        model = %att.upstream_model,
        try_number = one.number,
        http.response.status_code = tracing::field::Empty,
        failure = tracing::field::Empty,
    );
    let traceparent = trace::outgoing(&try_span, incoming)
        .and_then(|t| HeaderValue::from_str(&t.to_string()).ok());
    let traceparent = traceparent.as_ref();
    // A form goes with the client's `Content-Type` (its boundary); JSON as JSON.
    let content_type = match req.headers.get(header::CONTENT_TYPE) {
        Some(ct) if req.route.multipart() => ct,
        _ => &JSON,
    };
    let sent = async {
        match &one.up.router {
            None => {
                send_direct(
                    gw,
                    one.up,
                    req.route,
                    one.payload,
                    content_type,
                    &req.request_id,
                    one.per_try,
                    traceparent,
                )
                .await
            }
            Some(emb) => {
                let prefix = prefix_text.get_or_insert_with(|| prompt_prefix_text(&req.body));
                let ask = RouterAsk {
                    model: &att.upstream_model,
                    prefix,
                    headers: &req.headers,
                    priority: req
                        .body
                        .get("priority")
                        .and_then(Value::as_i64)
                        .map_or(0, |p| p.clamp(i32::MIN.into(), i32::MAX.into()) as i32),
                    flow: &req.key.record.tenant,
                    traceparent,
                    content_type,
                };
                send_via_router(
                    gw,
                    &emb.router,
                    req.route,
                    one.payload,
                    &req.request_id,
                    &ask,
                    one.deadline,
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
    sent
}

/// What one try's answer comes to: a 2xx is the request's answer (a stream's head, or a
/// body read whole within the try's deadline), translated back to chat when the provider
/// speaks another API; anything else is a failure, its error body kept (in OpenAI's
/// shape) for classification and relay, with the wait the upstream asked for.
async fn answer(
    gw: &Gateway,
    req: &Admitted,
    one: &OneTry<'_>,
    reply: UpstreamReply,
    started: Instant,
) -> Result<Tried, (Failure, Option<Duration>)> {
    let UpstreamReply { resp, mut lease } = reply;
    let att = one.att;
    let translates = one.up.provider.is_some_and(|p| p.translates(req.route));
    if !resp.status().is_success() {
        let status = resp.status().as_u16();
        let wait = {
            let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok());
            retry::retry_after(
                header("retry-after-ms"),
                header("retry-after"),
                SystemTime::now(),
            )
        };
        let mut text = match read_limited(resp, ERROR_BODY_LIMIT, one.deadline).await {
            Ok((_, _, b)) => String::from_utf8_lossy(&b).into_owned(),
            Err(_) => String::new(),
        };
        if translates {
            text = anthropic::error_text(status, &text);
        }
        drop(lease);
        if one.up.provider.is_some() && matches!(status, 401 | 403) {
            // The provider refused the gateway's own key, not the client's: a fault of
            // this upstream that a retry would meet again, so the next target is tried at
            // once; never relayed as the client's.
            tracing::warn!(upstream = %one.up.name, status, "the provider refused the gateway's key");
            return Err((Failure::KeyRefused(status), None));
        }
        return Err((Failure::Status(status, text), wait));
    }
    let resp = if translates && req.stream {
        anthropic::stream_response(resp)
    } else {
        resp
    };
    tracing::debug!(
        request_id = req.request_id.to_str().unwrap_or(""),
        key = %req.key.record.id,
        model = %att.model,
        upstream = %att.upstream,
        tries = one.number,
        stream = req.stream,
        "upstream answered"
    );
    gw.metrics.duration.observe(started.elapsed().as_secs_f64());
    let served = Served {
        attempt: att.clone(),
        tries: one.number,
        replica: lease
            .as_ref()
            .map(|l| l.url().trim_start_matches("http://").to_string()),
    };
    if req.stream {
        return Ok(Tried::Stream {
            resp,
            lease,
            served,
        });
    }
    let max_response_bytes = req.resolved.config.server.max_response_bytes;
    match read_limited(resp, max_response_bytes, one.deadline).await {
        Ok((status, content_type, bytes)) => {
            drop(lease);
            let (content_type, bytes) = if translates {
                let chat = anthropic::answer_body(&bytes)
                    .map_err(|why| (Failure::Status(502, why), None))?;
                (Some(JSON.clone()), chat)
            } else {
                (content_type, bytes)
            };
            Ok(Tried::Whole {
                status,
                content_type,
                bytes,
                served,
            })
        }
        Err(f) => {
            if let Some(l) = &mut lease {
                l.fail();
            }
            Err((f, None))
        }
    }
}

/// Counts a failed try (`strata_gateway_upstream_failures_total`) and logs it.
fn count_failure(gw: &Gateway, req: &Admitted, att: &Attempt, failure: &Failure) {
    let kind = match failure {
        Failure::Connect => "connect".to_string(),
        Failure::Tls(_) => "tls".to_string(),
        Failure::Timeout => "timeout".to_string(),
        Failure::KeyRefused(_) => "key_refused".to_string(),
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
}

/// The deadline of all tries of a request that started at `started` for a model with
/// `timeout_ms`.
pub(crate) fn deadline(started: Instant, timeout_ms: u64) -> Instant {
    started + Duration::from_millis(timeout_ms)
}
