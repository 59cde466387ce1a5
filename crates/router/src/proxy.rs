//! The HTTP front (PROTOCOLS §1): validates each request at the edge, admits it, asks the
//! [`Router`] where to send it, and forwards it.
//!
//! Request flow, one way: read the body (bounded) → parse and validate with `strata-api`
//! (a malformed request is answered here, no replica touched) → priority and admission
//! (shed with 429, or wait for capacity) → prefix keys (prompt-text chunks; token blocks
//! when a precise scorer is configured) → [`Router::pick`] → attempts in ranked order.
//!
//! Disaggregated requests (a prefill/decode profile pair in the scheduling config,
//! PROTOCOLS §11, vLLM's proxy protocol): when the pick names a prefill engine, phase 1
//! sends it the request with `kv_transfer_params: {do_remote_decode: true, ...}`,
//! `max_tokens: 1`, `stream: false` and the same `x-request-id`, bounded by
//! `pd.prefill_timeout_ms`; the `kv_transfer_params` of its answer go into the original
//! body, which phase 2 sends to the decode pick (streamed or not, as the client asked). The
//! prefill engine's lease lasts for phase 1 only. Any phase-1 failure (an error status, a
//! timeout, an answer without `kv_transfer_params`) sends the original request to the
//! decode pick, which computes the prompt itself: the client never sees it.
//!
//! A client's `x-prefiller-host-port` is never passed on: it would make a decode engine
//! prefill on a host the client chose.
//!
//! Attempts: a connect error or a 5xx before the first byte moves on to the next-ranked
//! endpoint, at most `max_retries` times, each outcome feeding that endpoint's circuit
//! breaker. Streams (`text/event-stream`) are passed through chunk by chunk as they
//! arrive; if the upstream breaks mid-stream the client gets a final
//! `data: {"error": ...}` event. Non-streamed answers are read whole before anything is
//! sent, so an upstream dying mid-body is still retried elsewhere. A client that goes
//! away drops the response body, which drops the upstream connection: the engine sees the
//! disconnect and aborts the request.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, Limited};
use rand::Rng;
use strata_api::trace::{self, TraceParent};
use strata_api::types::{ChatCompletionRequest, CompletionRequest};
use strata_api::validate::{parse_json, validate_chat, validate_completion, PromptInput};
use strata_api::{sse, ApiError, StreamWatch};
use xxhash_rust::xxh64::xxh64;

use crate::router::{RouteError, Router};
use crate::scheduling::{PdChoice, SchedRequest};
use crate::telemetry::{PD_PATH_DECODE_ONLY, PD_PATH_DISAGGREGATED, PD_PATH_FALLBACK};
use tracing::Instrument;

pub use crate::headers::{OBJECTIVE, PREFILLED_BY, PROFILE, REQUEST_ID, SERVED_BY};

/// Largest non-streamed upstream body relayed.
const MAX_UPSTREAM_BODY: usize = 256 << 20;

/// The router's axum app.
pub fn app(router: Router) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(generic_post))
        .route("/tokenize", post(generic_post))
        .route("/detokenize", post(generic_post))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/debug/endpoints", get(debug_endpoints))
        .fallback(strata_api::http::not_found)
        .method_not_allowed_fallback(strata_api::http::method_not_allowed)
        .with_state(router)
}

fn error_response(err: &ApiError, request_id: Option<&HeaderValue>) -> Response {
    let mut resp = strata_api::http::error_response(err, None);
    if let Some(id) = request_id {
        resp.headers_mut().insert(REQUEST_ID, id.clone());
    }
    resp
}

fn request_id(headers: &HeaderMap) -> HeaderValue {
    headers
        .get(REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .cloned()
        .unwrap_or_else(|| {
            let n: u128 = rand::rng().random();
            HeaderValue::from_str(&format!("{n:032x}")).unwrap_or(HeaderValue::from_static("0"))
        })
}

async fn read_body(router: &Router, body: Body) -> Result<Bytes, ApiError> {
    let max = router.config().max_body_bytes;
    axum::body::to_bytes(body, max).await.map_err(|_| {
        ApiError::too_large(format!(
            "The request body exceeds the limit of {max} bytes."
        ))
    })
}

/// What the proxy extracted from a generation request.
struct Parsed {
    model: Option<String>,
    priority: i32,
    /// Text used for the approximate prefix index.
    prefix_text: String,
    /// Token ids when the prompt came as ids.
    tokens: Option<Vec<u32>>,
    salt: Option<String>,
    /// Body for `/tokenize`, when the precise index needs one.
    tokenize_body: Option<serde_json::Value>,
    /// The client sent its own `kv_transfer_params` (it runs the protocol itself): never
    /// disaggregated here.
    own_kv_transfer: bool,
}

fn parse_chat(body: &[u8], want_tokenize: bool) -> Result<Parsed, ApiError> {
    let req: ChatCompletionRequest = parse_json(body)?;
    let tokenize_body = want_tokenize.then(|| {
        serde_json::json!({"model": req.model, "messages": req.messages, "add_generation_prompt": req.add_generation_prompt.unwrap_or(true)})
    });
    let own_kv_transfer = req.kv_transfer_params.is_some();
    let v = validate_chat(req)?;
    let mut prefix_text = String::new();
    for m in &v.messages {
        prefix_text.push_str(m.role.as_str());
        prefix_text.push('\n');
        prefix_text.push_str(&m.content);
        prefix_text.push('\n');
    }
    Ok(Parsed {
        model: v.model,
        priority: v.sampling.priority,
        prefix_text,
        tokens: None,
        salt: v.sampling.cache_salt,
        tokenize_body,
        own_kv_transfer,
    })
}

fn parse_completion(body: &[u8], want_tokenize: bool) -> Result<Parsed, ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    let own_kv_transfer = req.kv_transfer_params.is_some();
    let v = validate_completion(req)?;
    let (prefix_text, tokens, tokenize_body) = match &v.prompt {
        PromptInput::Text(t) => (
            t.clone(),
            None,
            want_tokenize.then(|| serde_json::json!({"model": v.model, "prompt": t, "add_special_tokens": v.add_special_tokens})),
        ),
        PromptInput::Tokens(ids) => {
            let mut s = String::with_capacity(ids.len() * 6);
            for id in ids {
                s.push_str(&id.to_string());
                s.push(' ');
            }
            (s, Some(ids.clone()), None)
        }
    };
    Ok(Parsed {
        model: v.model,
        priority: v.sampling.priority,
        prefix_text,
        tokens,
        salt: v.sampling.cache_salt,
        tokenize_body,
        own_kv_transfer,
    })
}

fn priority_of(router: &Router, headers: &HeaderMap, body_priority: i32) -> i32 {
    match headers
        .get(OBJECTIVE)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
    {
        Some(name) if !name.is_empty() => router
            .config()
            .admission
            .objectives
            .get(name)
            .copied()
            .or_else(|| name.parse().ok())
            .unwrap_or(body_priority),
        _ => body_priority,
    }
}

async fn chat(State(router): State<Router>, req: Request) -> Response {
    generate(router, req, true).await
}

async fn completions(State(router): State<Router>, req: Request) -> Response {
    generate(router, req, false).await
}

/// A request's trace span and the `traceparent` it came with.
struct Traced {
    span: tracing::Span,
    incoming: Option<TraceParent>,
}

/// The request's span, child of the caller's `traceparent` when it sent a valid one.
fn traced(parts: &axum::http::request::Parts) -> Traced {
    let span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        "router.request",
        otel.kind = "server",
        http.route = parts.uri.path()
    );
    let incoming = trace::accept(
        &span,
        parts.headers.get(trace::TRACEPARENT).map(|v| v.as_bytes()),
    );
    Traced { span, incoming }
}

async fn generate(router: Router, req: Request, is_chat: bool) -> Response {
    let (parts, body) = req.into_parts();
    let traced = traced(&parts);
    let rid = request_id(&parts.headers);
    router.metrics().requests.inc();
    let body = match read_body(&router, body).await {
        Ok(b) => b,
        Err(e) => return error_response(&e, Some(&rid)),
    };
    let precise = router.uses_precise();
    let parsed = if is_chat {
        parse_chat(&body, precise)
    } else {
        parse_completion(&body, precise)
    };
    let parsed = match parsed {
        Ok(p) => p,
        Err(e) => {
            router.metrics().fail("invalid_request");
            return error_response(&e, Some(&rid));
        }
    };
    let priority = priority_of(&router, &parts.headers, parsed.priority);
    if let Err(e) = router.admit(priority).await {
        return error_response(&e.to_api_error(), Some(&rid));
    }
    let model = parsed.model.clone().unwrap_or_default();
    let mut sreq = SchedRequest {
        approx_blocks: router.approx_blocks(&model, &parsed.prefix_text),
        model,
        priority,
        session: parts
            .headers
            .get(router.config().session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        profile: parts
            .headers
            .get(PROFILE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        ..Default::default()
    };
    // A request for a LoRA adapter: the adapter name is the blocks' extra key (PROTOCOLS
    // §3), in the precise hashes as the engine computes them, and in the approximate
    // ones through the model-name seed (which is the adapter name), so its prefixes never
    // match the base model's.
    sreq.lora = router.lora_adapter(&sreq.model);
    if precise {
        let tokens = match (&parsed.tokens, &parsed.tokenize_body) {
            (Some(t), _) => Some(Arc::new(t.clone())),
            (None, Some(tb)) => {
                let tb = Bytes::from(tb.to_string());
                router.tokenize(xxh64(&tb, 0), tb).await
            }
            _ => None,
        };
        if let Some(t) = &tokens {
            sreq.prompt_tokens = Some(t.len());
        }
        sreq.precise_blocks =
            tokens.map(|t| router.precise_blocks(&t, sreq.lora.as_deref(), parsed.salt.as_deref()));
    }
    if parsed.own_kv_transfer {
        sreq.prompt_tokens = None;
    } else if sreq.prompt_tokens.is_none() {
        sreq.prompt_tokens = Some(crate::scheduling::pd::estimate_prompt_tokens(
            parsed.prefix_text.len(),
            parsed.tokens.as_ref().map(Vec::len),
        ));
    }
    forward(&router, &parts, body, sreq, rid, traced).await
}

async fn generic_post(State(router): State<Router>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let traced = traced(&parts);
    let rid = request_id(&parts.headers);
    router.metrics().requests.inc();
    let body = match read_body(&router, body).await {
        Ok(b) => b,
        Err(e) => return error_response(&e, Some(&rid)),
    };
    let value: serde_json::Value = match parse_json(&body) {
        Ok(v) => v,
        Err(e) => return error_response(&e, Some(&rid)),
    };
    let Some(obj) = value.as_object() else {
        return error_response(
            &ApiError::invalid_no_param("The request body must be a JSON object."),
            Some(&rid),
        );
    };
    let model = match obj.get("model") {
        None | Some(serde_json::Value::Null) => String::new(),
        Some(serde_json::Value::String(m)) => m.clone(),
        Some(_) => {
            return error_response(
                &ApiError::invalid("model", "`model` must be a string."),
                Some(&rid),
            )
        }
    };
    let sreq = SchedRequest {
        model,
        ..Default::default()
    };
    forward(&router, &parts, body, sreq, rid, traced).await
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

/// What every attempt of one request shares: where it goes upstream and what it carries
/// besides the body.
struct Upstream<'a> {
    router: &'a Router,
    parts: &'a axum::http::request::Parts,
    /// Path and query, as the client sent them.
    path: &'a str,
    rid: HeaderValue,
    /// The `traceparent` every attempt sends: the proxy span as parent.
    traceparent: Option<HeaderValue>,
}

/// What one attempt on one endpoint came to.
enum Attempt {
    /// An answer to relay (a success or a client error), or the error ending the request.
    Answered(Response),
    /// A 5xx: the next endpoint is tried, and this one is relayed if none answers.
    ServerError(StatusCode, HeaderMap, Bytes),
    /// No usable answer (a connect error, a body that broke): the next endpoint is tried.
    Failed,
}

/// Pick → phase 1 of a disaggregated request → attempts in ranked order → the last 5xx
/// (or a 503) when none answered.
async fn forward(
    router: &Router,
    parts: &axum::http::request::Parts,
    body: Bytes,
    mut sreq: SchedRequest,
    rid: HeaderValue,
    traced: Traced,
) -> Response {
    let picked = match pick(router, &mut sreq, &traced.span) {
        Ok(p) => p,
        Err(e) => return error_response(&e.to_api_error(), Some(&rid)),
    };
    let proxy_span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        parent: &traced.span,
        "router.proxy",
        otel.kind = "client",
        endpoint = tracing::field::Empty,
        attempts = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    // Every attempt names this span as its parent; what the caller sent is replaced.
    let traceparent = trace::outgoing(&proxy_span, traced.incoming.as_ref())
        .and_then(|t| HeaderValue::from_str(&t.to_string()).ok());
    let up = Upstream {
        router,
        parts,
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/"),
        rid,
        traceparent,
    };
    let (body, prefilled_by) = disaggregate(&up, &picked, body, &proxy_span).await;
    try_ranked(
        &up,
        &picked,
        &body,
        prefilled_by.as_deref(),
        [traced.span, proxy_span],
    )
    .await
}

/// The scheduling decision, on its own span.
fn pick(
    router: &Router,
    sreq: &mut SchedRequest,
    parent: &tracing::Span,
) -> Result<crate::router::Picked, RouteError> {
    let pick_span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        parent: parent,
        "router.pick",
        model = %sreq.model,
        profile = tracing::field::Empty,
        endpoint = tracing::field::Empty,
        candidates = tracing::field::Empty,
        scores = tracing::field::Empty,
        error = tracing::field::Empty,
    );
    let picked = pick_span.in_scope(|| router.pick(sreq));
    match &picked {
        Ok(p) if !pick_span.is_disabled() => record_pick(&pick_span, p),
        Ok(_) => {}
        Err(e) => {
            pick_span.record("error", tracing::field::display(e));
        }
    }
    picked
}

/// Phase 1 of a disaggregated request, when the pick named prefill engines; returns the
/// body the decode pick gets and the prefill engine that computed the prompt. A failed
/// phase 1 leaves the original body: the decode pick computes the prompt itself.
async fn disaggregate(
    up: &Upstream<'_>,
    picked: &crate::router::Picked,
    body: Bytes,
    proxy_span: &tracing::Span,
) -> (Bytes, Option<Arc<str>>) {
    let metrics = up.router.metrics();
    match (&picked.prefill, picked.pd) {
        (Some(prefill), _) => {
            let phase1 = prefill_phase(up, &body, prefill)
                .instrument(tracing::info_span!(
                    target: trace::SPAN_TARGET,
                    parent: proxy_span,
                    "router.prefill"
                ))
                .await;
            match phase1.and_then(|(params, url)| Ok((with_kv_params(&body, params)?, url))) {
                Ok((b, url)) => {
                    metrics.pd_path(PD_PATH_DISAGGREGATED);
                    (b, Some(url))
                }
                Err(e) => {
                    tracing::warn!(request_id = ?up.rid, error = %e, "remote prefill failed; the decode pick computes the prompt");
                    metrics.pd_path(PD_PATH_FALLBACK);
                    (body, None)
                }
            }
        }
        (None, PdChoice::DecodeOnly | PdChoice::NoPrefill) => {
            metrics.pd_path(PD_PATH_DECODE_ONLY);
            (body, None)
        }
        (None, _) => (body, None),
    }
}

/// Attempts in ranked order, at most `max_retries + 1` of them, skipping endpoints whose
/// circuit refuses. `spans` (the request's and the proxy's) end with the answer, or with
/// its stream.
async fn try_ranked(
    up: &Upstream<'_>,
    picked: &crate::router::Picked,
    body: &Bytes,
    prefilled_by: Option<&str>,
    spans: [tracing::Span; 2],
) -> Response {
    let max_attempts = up.router.config().max_retries + 1;
    let mut last_5xx: Option<(StatusCode, HeaderMap, Bytes)> = None;
    let mut attempts = 0;
    for (id, url) in &picked.ranked {
        if attempts >= max_attempts {
            break;
        }
        let Some(lease) = up.router.lease(*id, url) else {
            continue;
        };
        if attempts > 0 {
            up.router.metrics().retried.inc();
        }
        attempts += 1;
        spans[1].record("endpoint", &**url);
        spans[1].record("attempts", attempts);
        match attempt(up, url, lease, body, prefilled_by, &spans).await {
            Attempt::Answered(resp) => return resp,
            Attempt::ServerError(status, headers, bytes) => {
                last_5xx = Some((status, headers, bytes));
            }
            Attempt::Failed => {}
        }
    }
    up.router.metrics().fail("upstream");
    none_answered(last_5xx, up.rid.clone())
}

/// One attempt on `url`, its outcome fed to the endpoint's circuit through `lease`. A
/// stream is relayed as it arrives (the lease travels with it); any other answer is read
/// whole first, so one that breaks off is retried elsewhere.
async fn attempt(
    up: &Upstream<'_>,
    url: &str,
    mut lease: crate::router::Lease,
    body: &Bytes,
    prefilled_by: Option<&str>,
    spans: &[tracing::Span; 2],
) -> Attempt {
    let req = match upstream_request(up, url, body.clone()) {
        Ok(r) => r,
        Err(e) => {
            return Attempt::Answered(error_response(
                &ApiError::internal(format!("building the upstream request: {e}")),
                Some(&up.rid),
            ))
        }
    };
    let resp = match up.router.inner.client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(endpoint = %url, request_id = ?up.rid, error = %e, "upstream failed before responding");
            lease.failure();
            return Attempt::Failed;
        }
    };
    let status = resp.status();
    spans[1].record("http.response.status_code", status.as_u16());
    let (resp_parts, incoming) = resp.into_parts();
    if status.is_server_error() {
        lease.failure();
        let bytes = collect_limited(incoming).await.unwrap_or_default();
        return Attempt::ServerError(status, resp_parts.headers, bytes);
    }
    lease.success();
    let headers = relayed_headers(&resp_parts.headers, &up.rid, url, prefilled_by);
    if is_event_stream(&resp_parts.headers) {
        // The spans end with the stream, not with its head.
        let body = stream_through(incoming, lease, spans.clone());
        return Attempt::Answered(respond(status, headers, body));
    }
    match collect_limited(incoming).await {
        Some(bytes) => {
            drop(lease);
            Attempt::Answered(respond(status, headers, Body::from(bytes)))
        }
        None => {
            tracing::warn!(endpoint = %url, request_id = ?up.rid, "upstream body broke before anything was sent; retrying");
            lease.failure();
            Attempt::Failed
        }
    }
}

/// The client's headers that go upstream: not hop-by-hop, not the ones the router sets
/// itself (request id, `traceparent`), and never the prefill engine a client names.
fn forwarded_headers(
    parts: &axum::http::request::Parts,
) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    parts.headers.iter().filter(|(name, _)| {
        !is_hop_by_hop(name)
            && *name != REQUEST_ID
            && *name != trace::TRACEPARENT
            && *name != crate::headers::PREFILLER
    })
}

/// The request one attempt sends to `url`.
fn upstream_request(
    up: &Upstream<'_>,
    url: &str,
    body: Bytes,
) -> Result<hyper::Request<Full<Bytes>>, axum::http::Error> {
    let mut builder = hyper::Request::builder()
        .method(up.parts.method.clone())
        .uri(format!("{url}{}", up.path));
    for (name, value) in forwarded_headers(up.parts) {
        builder = builder.header(name, value);
    }
    builder = builder.header(REQUEST_ID, up.rid.clone());
    if let Some(tp) = &up.traceparent {
        builder = builder.header(trace::TRACEPARENT, tp.clone());
    }
    builder.body(Full::new(body))
}

/// The upstream's answer headers for the client: not hop-by-hop, plus the request id and
/// who served (and prefilled) it.
fn relayed_headers(
    upstream: &HeaderMap,
    rid: &HeaderValue,
    url: &str,
    prefilled_by: Option<&str>,
) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(upstream.len() + 2);
    for (name, value) in upstream {
        if !is_hop_by_hop(name) {
            headers.append(name, value.clone());
        }
    }
    headers.insert(REQUEST_ID, rid.clone());
    if let Ok(v) = HeaderValue::from_str(url.trim_start_matches("http://")) {
        headers.insert(SERVED_BY, v);
    }
    if let Some(p) = prefilled_by {
        if let Ok(v) = HeaderValue::from_str(p.trim_start_matches("http://")) {
            headers.insert(PREFILLED_BY, v);
        }
    }
    headers
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

fn respond(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// Every attempt failed: the last 5xx as the endpoint sent it (its content type, the
/// request id), or a 503 when none answered at all.
fn none_answered(last_5xx: Option<(StatusCode, HeaderMap, Bytes)>, rid: HeaderValue) -> Response {
    match last_5xx {
        Some((status, headers, bytes)) => {
            let mut out = Response::new(Body::from(bytes));
            *out.status_mut() = status;
            if let Some(ct) = headers.get(header::CONTENT_TYPE) {
                out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
            }
            out.headers_mut().insert(REQUEST_ID, rid);
            out
        }
        None => error_response(
            &ApiError::unavailable("No replica could serve the request."),
            Some(&rid),
        ),
    }
}

/// The phase-1 body (PROTOCOLS §11): the client's request asking the prefill engine to
/// compute the prompt and keep its KV for a remote decoder, one token, not streamed.
fn prefill_body(body: &[u8]) -> Result<Bytes, String> {
    let mut value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("body: {e}"))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| "the body is not a JSON object".to_string())?;
    obj.insert(
        "kv_transfer_params".into(),
        serde_json::json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    obj.insert("max_tokens".into(), 1.into());
    if obj.contains_key("max_completion_tokens") {
        obj.insert("max_completion_tokens".into(), 1.into());
    }
    obj.insert("stream".into(), false.into());
    obj.remove("stream_options");
    serde_json::to_vec(&value)
        .map(Bytes::from)
        .map_err(|e| format!("encoding the phase-1 body: {e}"))
}

/// The phase-2 body: the client's request with the prefill engine's `kv_transfer_params`.
fn with_kv_params(body: &[u8], params: serde_json::Value) -> Result<Bytes, String> {
    let mut value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("body: {e}"))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| "the body is not a JSON object".to_string())?;
    obj.insert("kv_transfer_params".into(), params);
    serde_json::to_vec(&value)
        .map(Bytes::from)
        .map_err(|e| format!("encoding the phase-2 body: {e}"))
}

/// Phase 1 on the first prefill engine whose circuit lets it through: one attempt,
/// bounded by `pd.prefill_timeout_ms`, its lease (in-flight count, circuit) held for this
/// phase only. Returns the answer's top-level `kv_transfer_params` and the engine's URL,
/// or why there are none.
async fn prefill_phase(
    up: &Upstream<'_>,
    body: &Bytes,
    prefill: &[(crate::endpoint::EndpointId, Arc<str>)],
) -> Result<(serde_json::Value, Arc<str>), String> {
    let router = up.router;
    let phase1 = prefill_body(body)?;
    let Some((mut lease, url)) = prefill
        .iter()
        .find_map(|(id, url)| router.lease(*id, url).map(|l| (l, url.clone())))
    else {
        return Err("no prefill engine could take the request".into());
    };
    let mut builder = hyper::Request::builder()
        .method(hyper::Method::POST)
        .uri(format!("{url}{}", up.path));
    for (name, value) in forwarded_headers(up.parts) {
        if name != header::CONTENT_TYPE {
            builder = builder.header(name, value);
        }
    }
    builder = builder
        .header(REQUEST_ID, up.rid.clone())
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(tp) = &up.traceparent {
        builder = builder.header(trace::TRACEPARENT, tp.clone());
    }
    let req = builder
        .body(Full::new(phase1))
        .map_err(|e| format!("building the phase-1 request: {e}"))?;
    let started = std::time::Instant::now();
    let exchange = async {
        let resp = router
            .inner
            .client
            .request(req)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let bytes = collect_limited(resp.into_body())
            .await
            .ok_or_else(|| format!("{url}: the answer broke off"))?;
        Ok::<_, String>((status, bytes))
    };
    let outcome = tokio::time::timeout(router.config().prefill_timeout(), exchange).await;
    router
        .metrics()
        .pd_prefill_seconds
        .observe(started.elapsed().as_secs_f64());
    let (status, bytes) = match outcome {
        Err(_) => {
            lease.failure();
            return Err(format!("{url}: no answer within the prefill timeout"));
        }
        Ok(Err(e)) => {
            lease.failure();
            return Err(e);
        }
        Ok(Ok(answer)) => answer,
    };
    if status.is_server_error() {
        lease.failure();
        return Err(format!("{url} answered {status}"));
    }
    lease.success();
    if !status.is_success() {
        return Err(format!("{url} answered {status}"));
    }
    let answer: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{url}: the answer is not JSON: {e}"))?;
    match answer.get("kv_transfer_params") {
        Some(p @ serde_json::Value::Object(_)) => Ok((p.clone(), url)),
        _ => Err(format!("{url}: the answer has no kv_transfer_params")),
    }
}

/// The pick on its span: the chosen endpoint, the candidates ranked and the best scores.
fn record_pick(span: &tracing::Span, picked: &crate::router::Picked) {
    use std::fmt::Write as _;
    let mut scores = String::new();
    for (id, url) in picked.ranked.iter().take(4) {
        let Some(s) = picked.decision.ranked.iter().find(|s| s.id == *id) else {
            continue;
        };
        if !scores.is_empty() {
            scores.push(' ');
        }
        let _ = write!(
            scores,
            "{}={:.3}",
            url.trim_start_matches("http://"),
            s.score
        );
    }
    span.record("profile", picked.decision.profile.as_str());
    if let Some((_, url)) = picked.ranked.first() {
        span.record("endpoint", &**url);
    }
    span.record("candidates", picked.ranked.len());
    span.record("scores", scores.as_str());
}

async fn collect_limited(body: hyper::body::Incoming) -> Option<Bytes> {
    Limited::new(body, MAX_UPSTREAM_BODY)
        .collect()
        .await
        .ok()
        .map(|c| c.to_bytes())
}

/// Passes an upstream SSE body through chunk by chunk, watching it as SSE events (so a
/// `data: [DONE]` split across network chunks is seen, and content that merely quotes
/// `[DONE]` is not taken for it). A broken upstream, or one that ends without `[DONE]`,
/// ends the client's stream with an error event and counts against the endpoint.
fn stream_through(
    incoming: hyper::body::Incoming,
    lease: crate::router::Lease,
    spans: [tracing::Span; 2],
) -> Body {
    struct St {
        data: http_body_util::BodyDataStream<hyper::body::Incoming>,
        lease: crate::router::Lease,
        watch: StreamWatch,
        _spans: [tracing::Span; 2],
    }
    let st = St {
        data: incoming.into_data_stream(),
        lease,
        watch: StreamWatch::new(),
        _spans: spans,
    };
    let s = futures_util::stream::unfold(Some(st), |st| async move {
        let mut st = st?;
        match st.data.next().await {
            Some(Ok(chunk)) => {
                st.watch.feed(&chunk);
                Some((Ok::<Bytes, Infallible>(chunk), Some(st)))
            }
            Some(Err(e)) => {
                tracing::warn!(endpoint = %st.lease.url(), error = %e, "upstream stream broke");
                st.lease.failure();
                Some((Ok(stream_error_event()), None))
            }
            None => {
                st.watch.finish();
                if st.watch.ended_well() {
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

/// `GET /v1/models`: the union of what the ready endpoints serve. One endpoint per distinct
/// `model` label is asked (the next one of the same label when it fails); entries are merged
/// by `id`, first seen first. Needs no `model` of its own, so it never goes through the
/// scheduler's model filter.
async fn models(State(router): State<Router>, headers: HeaderMap) -> Response {
    let rid = request_id(&headers);
    let mut groups: Vec<(Option<String>, Vec<String>)> = Vec::new();
    for s in router.status() {
        if !s.ready || s.draining {
            continue;
        }
        match groups.iter_mut().find(|(m, _)| *m == s.spec.model) {
            Some((_, urls)) => urls.push(s.spec.url.clone()),
            None => groups.push((s.spec.model.clone(), vec![s.spec.url.clone()])),
        }
    }
    if groups.is_empty() {
        return error_response(&ApiError::unavailable("No replica is ready."), Some(&rid));
    }
    let mut data: Vec<serde_json::Value> = Vec::new();
    let mut answered = false;
    for (_, urls) in &groups {
        for url in urls {
            let r = crate::client::fetch(
                &router.inner.client,
                hyper::Method::GET,
                &format!("{url}/v1/models"),
                None,
                Duration::from_secs(5),
                16 << 20,
            )
            .await;
            let Ok((status, bytes)) = r else { continue };
            if !status.is_success() {
                continue;
            }
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
                continue;
            };
            answered = true;
            if let Some(list) = v.get("data").and_then(|d| d.as_array()) {
                for m in list {
                    let id = m.get("id");
                    if id.is_some() && !data.iter().any(|d| d.get("id") == id) {
                        data.push(m.clone());
                    }
                }
            }
            break;
        }
    }
    if !answered {
        return error_response(&ApiError::unavailable("No replica answered."), Some(&rid));
    }
    let body = serde_json::json!({"object": "list", "data": data});
    let mut out = Response::new(Body::from(body.to_string()));
    out.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    out.headers_mut().insert(REQUEST_ID, rid);
    out
}

async fn health(State(router): State<Router>) -> Response {
    if router.any_ready() {
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"status":"ok"}"#,
        )
            .into_response()
    } else {
        error_response(&ApiError::unavailable("No replica is ready."), None)
    }
}

async fn metrics(State(router): State<Router>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        router.metrics().encode(),
    )
        .into_response()
}

async fn debug_endpoints(State(router): State<Router>) -> Response {
    axum::Json(router.debug_json()).into_response()
}
