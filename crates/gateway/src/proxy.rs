//! The request path for `/v1/chat/completions`, `/v1/completions` and `/v1/embeddings`.
//!
//! One direction, each step able to answer early without touching an upstream:
//! auth → body size → JSON shape → model → permission → guardrails → budget → rate limits
//! (estimate) → cache → tries (targets, retries, fallbacks) → usage, cost and reconcile.
//!
//! Streaming responses are passed through chunk by chunk as they arrive; an SSE decoder
//! watches them for the `usage` chunk (requested with `stream_options.include_usage`) and
//! the accounting runs when the stream ends or the client goes away.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::{Stream, StreamExt};
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use strata_api::types::{ChatCompletionRequest, CompletionRequest, EmbeddingRequest};
use strata_api::{parse_json, ApiError, SseDecoder};
use strata_router::scheduling::SchedRequest;
use strata_router::{Lease, Router};

use crate::cache;
use crate::config::{Price, Resolved, ResolvedUpstream};
use crate::keys;
use crate::ratelimit::{Decision, LimitCheck, LimitKind};
use crate::routing::{self, Failure, Next};
use crate::state::{unix_now, Gateway, KeyEntry};
use crate::store::UsageEvent;
use crate::stream_guard::StreamGuard;
use crate::upstream::{BodyError, SendError, UpstreamBody};

/// Output tokens assumed when a request sets no `max_tokens` (reconciled afterwards).
pub const DEFAULT_OUTPUT_ESTIMATE: u64 = 256;
/// Bytes of an upstream error body kept for classification and relay.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

pub const CACHE_HEADER: &str = "x-strata-cache";
pub const UPSTREAM_HEADER: &str = "x-strata-upstream";
pub const MODEL_HEADER: &str = "x-strata-model";
/// Taken from the client when present, generated otherwise; sent upstream and back.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// The replica (`host:port`) that served, when an embedded router chose it.
pub const SERVED_BY_HEADER: &str = strata_router::proxy::SERVED_BY;

/// The OpenAI routes the gateway forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Chat,
    Completions,
    Embeddings,
}

impl Route {
    /// Index into [`crate::config::ROUTE_PATHS`] and [`ResolvedUpstream::route_urls`].
    fn index(self) -> usize {
        match self {
            Route::Chat => 0,
            Route::Completions => 1,
            Route::Embeddings => 2,
        }
    }

    pub fn path(self) -> &'static str {
        crate::config::ROUTE_PATHS[self.index()]
    }

    fn name(self) -> &'static str {
        match self {
            Route::Chat => "chat",
            Route::Completions => "completions",
            Route::Embeddings => "embeddings",
        }
    }
}

/// An OpenAI-shaped error response.
pub fn error_response(err: &ApiError) -> Response {
    let mut resp = Response::new(Body::from(err.to_json_string()));
    *resp.status_mut() =
        StatusCode::from_u16(err.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn hv(v: impl ToString) -> HeaderValue {
    HeaderValue::from_str(&v.to_string()).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Formats a reset time as OpenAI does (`1s`, `6m0s`, `20ms`).
fn reset_text(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else {
        let s = d.as_secs();
        if s >= 60 {
            format!("{}m{}s", s / 60, s % 60)
        } else {
            let text = format!("{:.3}", d.as_secs_f64());
            format!("{}s", text.trim_end_matches('0').trim_end_matches('.'))
        }
    }
}

/// `x-ratelimit-*` headers: the tightest limit of each kind.
fn ratelimit_headers(headers: &mut HeaderMap, checks: &[LimitCheck], d: &Decision) {
    for (kind, suffix) in [
        (LimitKind::Requests, "requests"),
        (LimitKind::Tokens, "tokens"),
    ] {
        let tightest = checks
            .iter()
            .zip(&d.states)
            .filter(|(c, _)| c.kind == kind)
            .min_by_key(|(_, (remaining, _))| *remaining);
        if let Some((c, (remaining, reset))) = tightest {
            let pairs = [
                (format!("x-ratelimit-limit-{suffix}"), c.limit.to_string()),
                (
                    format!("x-ratelimit-remaining-{suffix}"),
                    remaining.to_string(),
                ),
                (format!("x-ratelimit-reset-{suffix}"), reset_text(*reset)),
            ];
            for (name, value) in pairs {
                if let Ok(name) = HeaderName::from_bytes(name.as_bytes()) {
                    headers.insert(name, hv(value));
                }
            }
        }
    }
}

/// Everything the accounting at the end of a request needs.
struct Settle {
    gw: Arc<Gateway>,
    token_checks: Vec<LimitCheck>,
    estimate: u64,
    prompt_estimate: u64,
    key_id: String,
    tenant: String,
    model: String,
    upstream: String,
    price: Price,
}

impl Settle {
    /// Reconciles the token limits with real usage, records cost and the ledger row.
    async fn finish(self, usage: Option<(u64, u64)>, status: u16, cached: bool) {
        let (input, output) = match (usage, cached) {
            (_, true) => (0, 0),
            (Some(u), false) => u,
            // No usage reported: charge the estimate rather than nothing.
            (None, false) if status < 300 => {
                (self.prompt_estimate, self.estimate - self.prompt_estimate)
            }
            (None, false) => (0, 0),
        };
        let delta = (input + output) as i64 - self.estimate as i64;
        self.gw.limiter.adjust(&self.token_checks, delta).await;
        let cost = if cached {
            0
        } else {
            self.price.cost_micros(input, output)
        };
        let m = &self.gw.metrics;
        if input + output > 0 {
            m.tokens
                .get_or_create(&vec![
                    ("tenant", self.tenant.clone()),
                    ("model", self.model.clone()),
                    ("kind", "input".into()),
                ])
                .inc_by(input);
            m.tokens
                .get_or_create(&vec![
                    ("tenant", self.tenant.clone()),
                    ("model", self.model.clone()),
                    ("kind", "output".into()),
                ])
                .inc_by(output);
        }
        if cost > 0 {
            m.cost
                .get_or_create(&vec![
                    ("tenant", self.tenant.clone()),
                    ("model", self.model.clone()),
                ])
                .inc_by(cost as f64 / 1e6);
        }
        self.gw.record_usage(UsageEvent {
            ts: unix_now(),
            key_id: self.key_id,
            tenant: self.tenant,
            model: self.model,
            upstream: self.upstream,
            input_tokens: input,
            output_tokens: output,
            cost_micros: cost,
            cached,
            status,
        });
    }
}

fn count_request(gw: &Gateway, model: &str, status: u16) {
    gw.metrics
        .requests
        .get_or_create(&vec![
            ("model", model.to_string()),
            ("status", status.to_string()),
        ])
        .inc();
}

/// Rejects before any model work: counts the reason and builds the error.
fn reject(gw: &Gateway, reason: &str, err: ApiError) -> Response {
    gw.metrics.reject(reason);
    error_response(&err)
}

/// Total characters of prompt text (messages' contents, `prompt`, `input`).
fn prompt_chars(body: &Value) -> usize {
    fn text_len(v: &Value) -> usize {
        match v {
            Value::String(s) => s.chars().count(),
            Value::Array(items) => items.iter().map(text_len).sum(),
            Value::Object(o) => o.get("text").map_or(0, text_len),
            _ => 0,
        }
    }
    let mut n = 0;
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        n += msgs
            .iter()
            .map(|m| m.get("content").map_or(0, text_len))
            .sum::<usize>();
    }
    n += body.get("prompt").map_or(0, text_len);
    n += body.get("input").map_or(0, text_len);
    n
}

/// The authenticated key of a request, or the 401 to send (counted as a rejection).
pub fn authenticate(gw: &Gateway, headers: &HeaderMap) -> Result<Arc<KeyEntry>, ApiError> {
    let found = match keys::from_headers(headers) {
        None => Err(ApiError::unauthorized(
            "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
        )),
        Some(presented) => gw
            .authenticate(presented)
            .ok_or_else(|| ApiError::unauthorized("Invalid, unknown or revoked API key.")),
    };
    found.map_err(|e| {
        gw.metrics.reject("auth");
        e.with_code("invalid_api_key")
    })
}

fn may_use(resolved: &Resolved, key: &KeyEntry, requested: &str, canonical: &str) -> bool {
    let allowed =
        |list: &[String]| list.is_empty() || list.iter().any(|m| m == requested || m == canonical);
    let tenant_ok = resolved
        .tenants
        .get(&key.record.tenant)
        .is_none_or(|t| allowed(&t.allowed_models));
    tenant_ok && allowed(&key.record.allowed_models)
}

/// Handles one proxied request end to end.
pub async fn handle(gw: Arc<Gateway>, route: Route, req: Request) -> Response {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    let key = match authenticate(&gw, &parts.headers) {
        Ok(k) => k,
        Err(e) => return error_response(&e),
    };
    let resolved = gw.config.get();
    let server = &resolved.config.server;

    // Body: refuse by Content-Length before reading when possible.
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = || {
        reject(
            &gw,
            "invalid",
            ApiError::too_large(format!(
                "Request body exceeds {} bytes.",
                server.max_body_bytes
            )),
        )
    };
    if declared.is_some_and(|n| n > server.max_body_bytes as u64) {
        return too_large();
    }
    let Ok(bytes) = axum::body::to_bytes(body, server.max_body_bytes).await else {
        return too_large();
    };

    // Shape: the body is parsed once; the typed check runs over that parse and names the
    // faulty field. The forwarded body stays as sent unless the gateway must change it.
    let mut body = match check_shape(route, &bytes) {
        Ok(v) => v,
        Err(e) => return reject(&gw, "invalid", e),
    };
    let Some(requested) = body
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string)
    else {
        return reject(
            &gw,
            "invalid",
            ApiError::invalid("model", "You must provide a `model` parameter."),
        );
    };
    let max_tokens = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .filter(|v| !v.is_null());
    let max_tokens = match max_tokens.map(Value::as_i64) {
        None => None,
        Some(Some(n)) if n >= 1 => Some(n as u64),
        Some(_) => {
            return reject(
                &gw,
                "invalid",
                ApiError::invalid(
                    "max_tokens",
                    "`max_tokens` must be an integer of at least 1.",
                ),
            );
        }
    };
    let n_choices = body
        .get("n")
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .clamp(1, 128);
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);

    // Model and permission.
    let Some(model) = resolved.model(&requested) else {
        return reject(&gw, "invalid", ApiError::model_not_found(&requested));
    };
    if !may_use(&resolved, &key, &requested, &model.name) {
        return reject(
            &gw,
            "forbidden",
            ApiError::forbidden(format!("This API key may not use model `{requested}`."))
                .with_param("model")
                .with_code("model_not_allowed"),
        );
    }

    // Guardrails before the model.
    let chars = prompt_chars(&body);
    if let Some(max) = resolved.guardrails.max_prompt_chars {
        if chars > max {
            return reject(
                &gw,
                "guardrail",
                ApiError::invalid_no_param(format!(
                    "The prompt has {chars} characters; the limit is {max}."
                ))
                .with_code("prompt_too_large"),
            );
        }
    }
    // Whether the forwarded body must be written anew rather than sent as received.
    let mut rewritten = match resolved.guardrails.apply_request(&mut body) {
        Ok(changed) => changed,
        Err(reason) => {
            return reject(
                &gw,
                "guardrail",
                ApiError::invalid_no_param(reason).with_code("guardrail_blocked"),
            );
        }
    };

    // Budget.
    if let Some(msg) = gw.budget_exhausted(&key) {
        let mut resp = reject(
            &gw,
            "budget",
            ApiError::new(strata_api::ErrorKind::RateLimit, msg).with_code("budget_exceeded"),
        );
        resp.headers_mut()
            .insert("x-strata-budget", HeaderValue::from_static("exceeded"));
        return resp;
    }

    // Rate limits on the estimate.
    let prompt_estimate = (chars as u64).div_ceil(4).max(1);
    let output_estimate = if route == Route::Embeddings {
        0
    } else {
        max_tokens.unwrap_or(DEFAULT_OUTPUT_ESTIMATE) * n_choices
    };
    let estimate = prompt_estimate + output_estimate;
    let (request_checks, token_checks) = gw.limit_checks(&key, estimate);
    let all_checks: Vec<LimitCheck> = request_checks
        .iter()
        .chain(&token_checks)
        .cloned()
        .collect();
    let decision = match gw.limiter.check(&all_checks).await {
        Ok(d) => d,
        Err(e) => {
            gw.metrics
                .backend_errors
                .get_or_create(&vec![("backend", "ratelimit".into())])
                .inc();
            return reject(
                &gw,
                "backend",
                ApiError::unavailable(format!("Rate limiting is unavailable: {e}.")),
            );
        }
    };
    if decision.degraded {
        gw.metrics
            .backend_errors
            .get_or_create(&vec![("backend", "ratelimit".into())])
            .inc();
    }
    let mut extra = HeaderMap::new();
    let request_id = parts
        .headers
        .get(REQUEST_ID_HEADER)
        .cloned()
        .unwrap_or_else(|| hv(gw.next_request_id()));
    extra.insert(REQUEST_ID_HEADER, request_id.clone());
    ratelimit_headers(&mut extra, &all_checks, &decision);
    if !decision.allowed {
        let err = match decision.too_large {
            Some(i) => ApiError::rate_limited(format!(
                "Request too large: it needs about {} tokens but the limit is {} tokens per minute.",
                all_checks[i].cost, all_checks[i].limit
            )),
            None => ApiError::rate_limited(format!(
                "Rate limit reached for API key {}; retry after {:.1} s.",
                key.record.id,
                decision.retry_after.as_secs_f64()
            )),
        };
        let mut resp = reject(&gw, "rate_limit", err);
        resp.headers_mut().extend(extra);
        if decision.too_large.is_none() {
            let secs = decision.retry_after.as_secs_f64().ceil().max(1.0) as u64;
            resp.headers_mut().insert(header::RETRY_AFTER, hv(secs));
        }
        return resp;
    }

    let mut settle = Settle {
        gw: gw.clone(),
        token_checks,
        estimate,
        prompt_estimate,
        key_id: key.record.id.clone(),
        tenant: key.record.tenant.clone(),
        model: model.name.clone(),
        upstream: String::new(),
        price: model.price,
    };

    // Exact-match cache.
    body["model"] = Value::String(model.name.clone());
    let no_cache = parts
        .headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("no-cache") || v.contains("no-store"));
    let cache_key = match &gw.cache {
        Some(_) if !stream && cache::is_deterministic(&body) => {
            Some(cache::cache_key(&key.record.tenant, route.name(), &body))
        }
        _ => None,
    };
    if let (Some(c), Some(ck)) = (&gw.cache, &cache_key) {
        if !no_cache {
            if let Some(hit) = c.get(ck).await {
                gw.metrics
                    .cache
                    .get_or_create(&vec![("result", "hit".into())])
                    .inc();
                settle.upstream = "cache".into();
                settle.finish(None, 200, true).await;
                count_request(&gw, &model.name, 200);
                let mut resp = Response::new(Body::from(hit));
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                resp.headers_mut()
                    .insert(CACHE_HEADER, HeaderValue::from_static("hit"));
                resp.headers_mut().extend(extra);
                return resp;
            }
        }
        gw.metrics
            .cache
            .get_or_create(&vec![("result", "miss".into())])
            .inc();
        extra.insert(CACHE_HEADER, HeaderValue::from_static("miss"));
    }

    if stream {
        // Ask for the usage chunk so streamed requests are accounted exactly.
        if let Some(obj) = body.as_object_mut() {
            let opts = obj
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Some(o) = opts.as_object_mut() {
                if o.get("include_usage") != Some(&Value::Bool(true)) {
                    o.insert("include_usage".into(), Value::Bool(true));
                    rewritten = true;
                }
            }
        }
    }

    // Tries.
    let plan = {
        let mut rng = gw.rng.lock();
        routing::plan(&resolved, model, estimate, &mut *rng)
    };
    if plan.is_empty() {
        settle.finish(None, 400, false).await;
        return reject(
            &gw,
            "invalid",
            ApiError::invalid_no_param(format!(
                "This model's maximum context length is {} tokens; the request needs about {estimate}.",
                model.context_length.unwrap_or(0)
            ))
            .with_code("context_length_exceeded"),
        );
    }
    let deadline = started + Duration::from_millis(model.timeout_ms);
    let mut last: Option<Failure> = None;
    let mut tries = 0u32;
    // Prompt text for the embedded routers' prefix index, built on first use.
    let mut prefix_text: Option<String> = None;
    'targets: for att in &plan {
        let Some(up) = resolved.upstreams.get(&att.upstream) else {
            continue;
        };
        // The body as received when only its `model` could differ and does not.
        let payload = if !rewritten && att.upstream_model == requested {
            bytes.clone()
        } else {
            body["model"] = Value::String(att.upstream_model.clone());
            match serde_json::to_vec(&body) {
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
            let sent = match &up.router {
                None => send_direct(&gw, up, route, &payload, &request_id, per_try).await,
                Some(emb) => {
                    let prefix = prefix_text.get_or_insert_with(|| prompt_prefix_text(&body));
                    let ask = RouterAsk {
                        model: &att.upstream_model,
                        prefix,
                        headers: &parts.headers,
                        priority: body
                            .get("priority")
                            .and_then(Value::as_i64)
                            .map_or(0, |p| p.clamp(i32::MIN.into(), i32::MAX.into()) as i32),
                    };
                    send_via_router(
                        &gw,
                        &emb.router,
                        route,
                        &payload,
                        &request_id,
                        &ask,
                        try_deadline,
                    )
                    .await
                }
            };
            let failure = match sent {
                Err(f) => f,
                Ok(Answer { resp, mut lease }) if resp.status().is_success() => {
                    tracing::debug!(
                        request_id = request_id.to_str().unwrap_or(""),
                        key = %key.record.id,
                        model = %att.model,
                        upstream = %att.upstream,
                        tries,
                        stream,
                        "upstream answered"
                    );
                    settle.upstream = att.upstream.clone();
                    if tries > 1 {
                        gw.metrics.fallbacks.inc();
                    }
                    gw.metrics.duration.observe(started.elapsed().as_secs_f64());
                    extra.insert(UPSTREAM_HEADER, hv(&att.upstream));
                    extra.insert(MODEL_HEADER, hv(&att.model));
                    if let Some(l) = &lease {
                        extra.insert(SERVED_BY_HEADER, hv(l.url().trim_start_matches("http://")));
                    }
                    settle.model = att.model.clone();
                    settle.price = att.price;
                    if stream {
                        count_request(&gw, &model.name, 200);
                        let guard = (!resolved.guardrails.is_empty())
                            .then(|| StreamGuard::new(resolved.clone()));
                        return stream_response(resp, settle, extra, lease, guard);
                    }
                    match read_limited(resp, server.max_response_bytes, try_deadline).await {
                        Ok((status, ct, bytes)) => {
                            drop(lease);
                            return finish_json(
                                &gw,
                                &resolved,
                                settle,
                                status,
                                ct,
                                bytes,
                                extra,
                                cache_key,
                                model.name.clone(),
                            )
                            .await;
                        }
                        Err(f) => {
                            if let Some(l) = &mut lease {
                                l.fail();
                            }
                            f
                        }
                    }
                }
                Ok(Answer { resp, lease }) => {
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
                request_id = request_id.to_str().unwrap_or(""),
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

    // Nothing succeeded: relay a client error as the upstream worded it, else 503.
    let mut resp = match last {
        Some(Failure::Status(status, text))
            if routing::classify(&Failure::Status(status, text.clone())) == Next::Relay =>
        {
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
                Some(Failure::Status(s, _)) => format!("answered {s}"),
                None => "were not tried (deadline)".to_string(),
            };
            error_response(&ApiError::unavailable(format!(
                "All upstreams for model `{}` failed: the last {why}.",
                model.name
            )))
        }
    };
    let status = resp.status().as_u16();
    count_request(&gw, &model.name, status);
    settle.finish(None, status, false).await;
    resp.headers_mut().extend(extra);
    resp
}

/// A try that got response headers; `lease` holds the replica chosen by an embedded
/// router (in flight until dropped).
struct Answer {
    resp: axum::http::Response<UpstreamBody>,
    lease: Option<Replica>,
}

/// A replica's lease while its answer is being relayed. The outcome is reported once,
/// when it is known: [`Replica::fail`] for a body or stream that breaks; success when
/// dropped otherwise — a whole body, a stream that ended with `[DONE]`, a client error
/// answer, or a client that went away (not the replica's fault). Reporting success only
/// at the end lets a replica that cuts every stream open its circuit, and reporting on
/// every path keeps a half-open circuit from waiting forever for its probe.
struct Replica {
    lease: Lease,
    settled: bool,
}

impl Replica {
    fn url(&self) -> &str {
        self.lease.url()
    }

    fn fail(&mut self) {
        if !self.settled {
            self.settled = true;
            self.lease.failure();
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if !self.settled {
            self.lease.success();
        }
    }
}

fn classify_send_error(e: &SendError) -> Failure {
    match e {
        SendError::Timeout => Failure::Timeout,
        SendError::Connect(_) => Failure::Connect,
    }
}

/// One try against a fixed base URL: any status comes back as an [`Answer`].
async fn send_direct(
    gw: &Gateway,
    up: &ResolvedUpstream,
    route: Route,
    payload: &Bytes,
    request_id: &HeaderValue,
    per_try: Duration,
) -> Result<Answer, Failure> {
    // Parsed at load (the fallback only serves a hand-built upstream).
    let parsed;
    let uri = match up.route_urls.get(route.index()) {
        Some(u) => u,
        None => {
            parsed = format!("{}{}", up.base_url, route.path())
                .parse::<axum::http::Uri>()
                .map_err(|_| Failure::Connect)?;
            &parsed
        }
    };
    let send = gw.client.post_json(
        uri,
        payload.clone(),
        (REQUEST_ID_HEADER, request_id),
        up.auth_header.as_ref(),
    );
    match tokio::time::timeout(per_try, send).await {
        Err(_) => Err(Failure::Timeout),
        Ok(Err(e)) => Err(classify_send_error(&e)),
        Ok(Ok(resp)) => Ok(Answer { resp, lease: None }),
    }
}

/// What an embedded router needs to place one request.
struct RouterAsk<'a> {
    /// The `model` sent upstream (replicas may be pinned to one).
    model: &'a str,
    /// Prompt text for the approximate prefix index.
    prefix: &'a str,
    headers: &'a HeaderMap,
    priority: i32,
}

/// One try through an embedded router: admission, a pick, then the ranked replicas in
/// order, moving on after a connect error or a 5xx before the first byte (at most the
/// router's `max_retries` more), each outcome reported to the replica's circuit breaker.
/// An answer below 500 comes back with its lease; the caller reports a body that
/// breaks and drops the lease when the request is over.
async fn send_via_router(
    gw: &Gateway,
    router: &Router,
    route: Route,
    payload: &Bytes,
    request_id: &HeaderValue,
    ask: &RouterAsk<'_>,
    try_deadline: Instant,
) -> Result<Answer, Failure> {
    let left = try_deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(left, router.admit(ask.priority)).await {
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(e)) => return Err(Failure::Status(503, e.to_string())),
        Ok(Ok(())) => {}
    }
    let config = router.config();
    let mut sreq = SchedRequest {
        model: ask.model.to_string(),
        approx_blocks: router.approx_blocks(ask.model, ask.prefix),
        priority: ask.priority,
        session: ask
            .headers
            .get(config.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        ..Default::default()
    };
    let picked = router
        .pick(&mut sreq)
        .map_err(|e| Failure::Status(503, format!("router: {e}")))?;
    let max_attempts = config.max_retries + 1;
    let mut attempts = 0;
    let mut last = Failure::Status(503, "router: no replica could take the request".into());
    for (id, url) in &picked.ranked {
        if attempts >= max_attempts {
            break;
        }
        let Some(mut lease) = router.lease(*id, url) else {
            continue;
        };
        attempts += 1;
        let left = try_deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Failure::Timeout);
        }
        let Ok(uri) = format!("{url}{}", route.path()).parse::<axum::http::Uri>() else {
            lease.failure();
            last = Failure::Connect;
            continue;
        };
        let send =
            gw.client
                .post_json(&uri, payload.clone(), (REQUEST_ID_HEADER, request_id), None);
        match tokio::time::timeout(left, send).await {
            Err(_) => {
                lease.failure();
                return Err(Failure::Timeout);
            }
            Ok(Err(e)) => {
                lease.failure();
                last = classify_send_error(&e);
            }
            Ok(Ok(resp)) if resp.status().is_server_error() => {
                lease.failure();
                let status = resp.status().as_u16();
                let text = match read_limited(resp, ERROR_BODY_LIMIT, try_deadline).await {
                    Ok((_, _, b)) => String::from_utf8_lossy(&b).into_owned(),
                    Err(_) => String::new(),
                };
                last = Failure::Status(status, text);
            }
            Ok(Ok(resp)) => {
                return Ok(Answer {
                    resp,
                    lease: Some(Replica {
                        lease,
                        settled: false,
                    }),
                });
            }
        }
        tracing::debug!(endpoint = %url, failure = ?last, "replica failed before answering; next");
    }
    Err(last)
}

/// The prompt as one text (role and content of each message, or the prompt), the key
/// of the embedded routers' approximate prefix index.
fn prompt_prefix_text(body: &Value) -> String {
    fn push_text(out: &mut String, v: &Value) {
        match v {
            Value::String(s) => out.push_str(s),
            Value::Array(items) => items.iter().for_each(|i| push_text(out, i)),
            Value::Object(o) => {
                if let Some(t) = o.get("text") {
                    push_text(out, t);
                }
            }
            _ => {}
        }
    }
    let mut out = String::new();
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        for m in msgs {
            if let Some(role) = m.get("role").and_then(Value::as_str) {
                out.push_str(role);
            }
            out.push('\n');
            if let Some(c) = m.get("content") {
                push_text(&mut out, c);
            }
            out.push('\n');
        }
    }
    for field in ["prompt", "input"] {
        if let Some(p) = body.get(field) {
            push_text(&mut out, p);
        }
    }
    out
}

/// Reads a whole upstream body, bounded in size and time. A body that arrives in one
/// piece is returned without a copy.
async fn read_limited(
    resp: axum::http::Response<UpstreamBody>,
    limit: usize,
    deadline: Instant,
) -> Result<(u16, Option<HeaderValue>, Bytes), Failure> {
    let status = resp.status().as_u16();
    let ct = resp.headers().get(header::CONTENT_TYPE).cloned();
    let mut body = resp.into_body();
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, body.frame()).await {
            Err(_) => return Err(Failure::Timeout),
            Ok(Some(Err(_))) => return Err(Failure::Connect),
            Ok(None) => break,
            Ok(Some(Ok(frame))) => {
                let Ok(chunk) = frame.into_data() else {
                    continue; // trailers
                };
                len += chunk.len();
                if len > limit {
                    return Err(Failure::Status(502, "upstream response too large".into()));
                }
                chunks.push(chunk);
            }
        }
    }
    let bytes = match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.swap_remove(0),
        _ => Bytes::from(chunks.concat()),
    };
    Ok((status, ct, bytes))
}

/// The body checked against the route's request type, parsed once. On failure the
/// error is the one [`parse_json`] gives (it names the faulty field).
fn check_shape(route: Route, bytes: &[u8]) -> Result<Value, ApiError> {
    fn typed<T: DeserializeOwned>(value: &Value, bytes: &[u8]) -> Result<T, ApiError> {
        T::deserialize(value).map_err(|e| {
            parse_json::<T>(bytes)
                .err()
                .unwrap_or_else(|| ApiError::invalid_no_param(format!("Invalid request body: {e}")))
        })
    }
    let value: Value = match serde_json::from_slice(bytes) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            let err = match route {
                Route::Chat => parse_json::<ChatCompletionRequest>(bytes).err(),
                Route::Completions => parse_json::<CompletionRequest>(bytes).err(),
                Route::Embeddings => parse_json::<EmbeddingRequest>(bytes).err(),
            };
            return Err(err.unwrap_or_else(|| {
                ApiError::invalid_no_param("Request body must be a JSON object.")
            }));
        }
    };
    match route {
        Route::Chat => {
            let r: ChatCompletionRequest = typed(&value, bytes)?;
            if r.messages.is_empty() {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` must not be empty.",
                ));
            }
        }
        Route::Completions => {
            typed::<CompletionRequest>(&value, bytes)?;
        }
        Route::Embeddings => {
            typed::<EmbeddingRequest>(&value, bytes)?;
        }
    }
    Ok(value)
}

/// The token counts of an answer's (or a stream chunk's) `usage`, read without building
/// the rest of the document: other fields are skipped, not kept.
#[derive(Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<UsageCounts>,
}

#[derive(Deserialize)]
struct UsageCounts {
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

/// `(prompt_tokens, completion_tokens)` of an answer; `None` when it is not JSON or has
/// no usable `usage` (then the estimate is charged).
fn usage_from_json(bytes: &[u8]) -> Option<(u64, u64)> {
    let u = serde_json::from_slice::<UsageOnly>(bytes).ok()?.usage?;
    Some((u.prompt_tokens, u.completion_tokens.unwrap_or(0)))
}

#[allow(clippy::too_many_arguments)]
async fn finish_json(
    gw: &Arc<Gateway>,
    resolved: &Resolved,
    settle: Settle,
    status: u16,
    content_type: Option<HeaderValue>,
    mut bytes: Bytes,
    extra: HeaderMap,
    cache_key: Option<[u8; 32]>,
    public_model: String,
) -> Response {
    let usage = usage_from_json(&bytes);
    if !resolved.guardrails.is_empty() {
        if let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) {
            match resolved.guardrails.apply_response(&mut v) {
                Ok(true) => {
                    if let Ok(b) = serde_json::to_vec(&v) {
                        bytes = Bytes::from(b);
                    }
                }
                Ok(false) => {}
                Err(reason) => {
                    settle.finish(usage, status, false).await;
                    count_request(gw, &public_model, 400);
                    gw.metrics.reject("guardrail");
                    let mut resp = error_response(
                        &ApiError::invalid_no_param(format!("The response was withheld: {reason}"))
                            .with_code("guardrail_blocked"),
                    );
                    resp.headers_mut().extend(extra);
                    return resp;
                }
            }
        }
    }
    if let (Some(c), Some(k), 200) = (&gw.cache, cache_key, status) {
        c.put(k, bytes.clone()).await;
    }
    settle.finish(usage, status, false).await;
    count_request(gw, &public_model, status);
    let mut resp = Response::new(Body::from(bytes));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        content_type.unwrap_or_else(|| HeaderValue::from_static("application/json")),
    );
    resp.headers_mut().extend(extra);
    resp
}

/// Wraps an upstream byte stream: passes every chunk through untouched and watches the
/// SSE events for `usage`; settles when finished or dropped.
struct UsageWatch {
    inner: Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>,
    decoder: Option<SseDecoder>,
    usage: Option<(u64, u64)>,
    settle: Option<Settle>,
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
}

impl UsageWatch {
    fn observe(&mut self, chunk: &[u8]) {
        let Some(dec) = &mut self.decoder else { return };
        match dec.feed(chunk) {
            Ok(events) => {
                for ev in events {
                    if ev.is_done() {
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
                        return Poll::Ready(Some(Ok(chunk)));
                    };
                    let out = guard.feed(&chunk);
                    if guard.blocked().is_some() {
                        // Stop reading: dropping the upstream body cancels the generation.
                        self.ended = true;
                        self.inner = Box::pin(futures_util::stream::empty());
                        if let Some(s) = &self.settle {
                            s.gw.metrics.reject("guardrail");
                        }
                    }
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Bytes::from(out))));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.failed = true;
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

fn stream_response(
    resp: axum::http::Response<UpstreamBody>,
    settle: Settle,
    extra: HeaderMap,
    lease: Option<Replica>,
    guard: Option<StreamGuard>,
) -> Response {
    let status = resp.status();
    let ct = resp.headers().get(header::CONTENT_TYPE).cloned();
    let watch = UsageWatch {
        inner: Box::pin(resp.into_body().into_data_stream()),
        decoder: Some(SseDecoder::new()),
        usage: None,
        settle: Some(settle),
        failed: false,
        lease,
        saw_done: false,
        guard,
        ended: false,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_text_formats() {
        assert_eq!(reset_text(Duration::from_millis(20)), "20ms");
        assert_eq!(reset_text(Duration::from_millis(1500)), "1.5s");
        assert_eq!(reset_text(Duration::from_secs(360)), "6m0s");
    }

    #[test]
    fn prompt_chars_counts_text_fields() {
        let v = serde_json::json!({"messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "de"}]}]});
        assert_eq!(prompt_chars(&v), 5);
        assert_eq!(prompt_chars(&serde_json::json!({"prompt": ["ab", "c"]})), 3);
    }
}
