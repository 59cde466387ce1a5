//! OpenAI's Responses API on the gateway: `POST /v1/responses` (whole or streamed) and
//! `GET /v1/responses/{id}`.
//!
//! A request is checked against [`strata_api::responses`]'s types, translated into a
//! chat request ([`crate::translate::responses_to_chat`], after the conversation of its
//! `previous_response_id`) and sent through the proxy's stages ([`crate::via_chat`]); the
//! answer is translated back. With `store` on (the default) the response and the
//! conversation up to it are kept in the gateway's store for the caller's tenant
//! ([`crate::store::StoredResponse`], for `store.responses_retention_secs`): `GET` reads
//! it, and `previous_response_id` continues it — another tenant's id is not found. A
//! streamed response is stored before its `response.completed` event is sent, so a
//! follow-up can name it at once.
//!
//! When every upstream of the model speaks the Responses API (`apis: [responses]`,
//! [`crate::passthrough`]), the body goes to the upstream's `/v1/responses` as sent; that
//! upstream keeps the conversation itself, one store for every caller. So the gateway
//! records, per tenant, each response it passed through (the upstream's answer, whole or
//! the `response.completed` event's, by its `id`): `GET` serves it like a translated one,
//! and a passed-through `previous_response_id` must be one of the caller's tenant — any
//! other is not found, as an unknown id is, and never reaches the upstream. Errors are
//! OpenAI-shaped.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use futures_util::future::BoxFuture;
use strata_api::responses::{Response as ResponseObject, ResponsesRequest};
use strata_api::{parse_json, ApiError, ChatCompletionResponse, ErrorKind, RequestMessage};

use crate::passthrough::{self, Api};
use crate::proxy::{self, error_response, Route};
use crate::state::Gateway;
use crate::store::StoredResponse;
use crate::translate::{
    chat_to_response, conversation_after, encode_event, response_skeleton, responses_to_chat,
    ChatToResponseEvents, ResponseIds,
};
use crate::via_chat::{self, ChatAnswer, StreamMapper};

fn with_headers(mut resp: Response, headers: HeaderMap) -> Response {
    resp.headers_mut().extend(headers);
    resp
}

/// `POST /v1/responses`.
pub async fn create(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let (mut parts, body) = req.into_parts();
    let caller = match proxy::authenticate(&gw, &parts.headers).await {
        Ok(c) => c,
        Err(e) => return error_response(&e),
    };
    // Handed on to the proxy's stages, which then do not authenticate it again.
    parts
        .extensions
        .insert(proxy::Authenticated(caller.clone()));
    let bytes = match via_chat::read_body(&gw, body).await {
        Ok(b) => b,
        Err(limit) => return error_response(&ApiError::body_too_large(limit)),
    };
    let req = match parse_json::<ResponsesRequest>(&bytes) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    if passthrough::speaks(&gw, &req.model, Api::Responses) {
        let tenant = caller.key.record.tenant.clone();
        if let Some(prev) = req.previous_response_id.as_deref() {
            // Only a response this tenant passed through may be continued upstream.
            match load(&gw, &tenant, prev).await {
                Ok(Some(row)) if row.conversation == PASSED_THROUGH => {}
                Ok(_) => return error_response(&previous_not_found(prev)),
                Err(e) => return error_response(&e),
            }
        }
        let keep = (req.store != Some(false)).then(|| PassedKeep {
            gw: gw.clone(),
            tenant,
        });
        return match via_chat::call(gw, &parts, Route::Responses, bytes.to_vec()).await {
            ChatAnswer::Whole { body, headers } => {
                if let (Some(keep), Ok(r)) = (keep, serde_json::from_slice(&body)) {
                    keep.save(r).await;
                }
                let mut resp = Response::new(axum::body::Body::from(body));
                resp.headers_mut().insert(
                    axum::http::header::CONTENT_TYPE,
                    axum::http::HeaderValue::from_static("application/json"),
                );
                with_headers(resp, headers)
            }
            ChatAnswer::Stream { body, headers } => {
                via_chat::sse_response(watch_passed(body, keep), headers)
            }
            ChatAnswer::Error { error, headers, .. } => {
                with_headers(error_response(&error), headers)
            }
        };
    }
    let tenant = caller.key.record.tenant.clone();
    let history = match previous(&gw, &tenant, req.previous_response_id.as_deref()).await {
        Ok(h) => h,
        Err(e) => return error_response(&e),
    };
    let chat = match responses_to_chat(&req, &history) {
        Ok(c) => c,
        Err(e) => return error_response(&ApiError::invalid(&e.param, e.message)),
    };
    let chat_body = via_chat::to_body(&chat);
    // The client's own body was within the limit (read above); with the history of
    // `previous_response_id` prepended the chat request may not be: say so, rather than
    // a 413 about a body the client never sent.
    let limit = gw.config.get().config.server.max_body_bytes;
    if chat_body.len() > limit {
        if let Some(prev) = req.previous_response_id.as_deref() {
            return error_response(
                &ApiError::too_large(format!(
                    "The conversation is too long to continue: with the history of \
                     previous_response_id '{prev}' the request comes to {} bytes, above this \
                     gateway's limit of {limit} bytes. Start a new conversation or send a \
                     shorter input.",
                    chat_body.len()
                ))
                .with_param("previous_response_id")
                .with_code("conversation_too_long"),
            );
        }
    }
    let ids = ResponseIds::new(&format!("{:032x}", rand::random::<u128>()));
    let created_at = u64::try_from(gw.now()).unwrap_or(0);
    let keep = (req.store != Some(false)).then(|| Keep {
        gw: gw.clone(),
        tenant,
        history,
        req: req.clone(),
    });
    answer(gw.clone(), &parts, req, chat_body, ids, created_at, keep).await
}

/// Sends the chat request and translates what comes back.
async fn answer(
    gw: Arc<Gateway>,
    parts: &Parts,
    req: ResponsesRequest,
    chat_body: Vec<u8>,
    ids: ResponseIds,
    created_at: u64,
    keep: Option<Keep>,
) -> Response {
    match via_chat::call(gw, parts, Route::Chat, chat_body).await {
        ChatAnswer::Whole { body, headers } => {
            let answer = match serde_json::from_slice::<ChatCompletionResponse>(&body) {
                Ok(a) => a,
                Err(e) => {
                    return with_headers(
                        error_response(&ApiError::new(
                            ErrorKind::Server,
                            format!("The model's answer could not be read: {e}"),
                        )),
                        headers,
                    )
                }
            };
            let r = chat_to_response(&answer, &req, &ids, created_at);
            if let Some(keep) = keep {
                keep.save(r.clone()).await;
            }
            via_chat::json_response(StatusCode::OK, &r, headers)
        }
        ChatAnswer::Stream { body, headers } => {
            let mapper = ResponsesMapper {
                events: ChatToResponseEvents::new(
                    ids.clone(),
                    response_skeleton(&req, &ids, created_at),
                ),
                keep,
                pending: None,
                failed: false,
            };
            via_chat::sse_response(via_chat::map_stream(body, mapper), headers)
        }
        ChatAnswer::Error { error, headers, .. } => with_headers(error_response(&error), headers),
    }
}

/// The conversation a `previous_response_id` continues (none without one).
async fn previous(
    gw: &Arc<Gateway>,
    tenant: &str,
    id: Option<&str>,
) -> Result<Vec<RequestMessage>, ApiError> {
    let Some(id) = id else {
        return Ok(Vec::new());
    };
    let row = load(gw, tenant, id)
        .await?
        .ok_or_else(|| previous_not_found(id))?;
    // A passed-through response's conversation is its upstream's: not continued here.
    serde_json::from_str(&row.conversation).map_err(|_| previous_not_found(id))
}

/// The answer to a `previous_response_id` the caller's tenant cannot continue (unknown,
/// another tenant's, expired, or kept by another kind of model), as OpenAI words it.
fn previous_not_found(id: &str) -> ApiError {
    ApiError::invalid(
        "previous_response_id",
        format!("Previous response with id '{id}' not found."),
    )
    .with_code("previous_response_not_found")
}

/// The `conversation` of a passed-through response's row (its upstream keeps the
/// conversation; the row says whose the id is).
const PASSED_THROUGH: &str = "\"passed-through\"";

/// Where to record the responses passed through for a tenant (`store` on).
struct PassedKeep {
    gw: Arc<Gateway>,
    tenant: String,
}

impl PassedKeep {
    /// Records `r` (the upstream's response object) under its `id`; a store that fails
    /// is logged (the id then cannot be continued or read back through the gateway).
    async fn save(self, r: serde_json::Value) {
        let Some(id) = r.get("id").and_then(|v| v.as_str()).map(str::to_string) else {
            return;
        };
        let retention = self.gw.config.get().config.store.responses_retention_secs;
        let now = self.gw.now();
        let row = StoredResponse {
            tenant: self.tenant,
            id: id.clone(),
            created_at: now,
            expires_at: now.saturating_add(i64::try_from(retention).unwrap_or(i64::MAX)),
            body: r.to_string(),
            conversation: PASSED_THROUGH.to_string(),
        };
        let store = self.gw.store.clone();
        let res = tokio::task::spawn_blocking(move || store.put_response(&row)).await;
        if !matches!(res, Ok(Ok(()))) {
            self.gw.metrics.backend_error("store");
            tracing::warn!(%id, "could not record a passed-through response; it cannot be continued");
        }
    }
}

/// The response a passed-through stream's last event carries (`response.completed`,
/// `.incomplete` or `.failed`), if `data` is that event.
fn final_response(data: &str) -> Option<serde_json::Value> {
    let mut v: serde_json::Value = serde_json::from_str(data).ok()?;
    let kind = v.get("type")?.as_str()?;
    if !matches!(
        kind,
        "response.completed" | "response.incomplete" | "response.failed"
    ) {
        return None;
    }
    Some(v.get_mut("response")?.take())
}

/// A passed-through event stream, its bytes untouched; the response in its last event is
/// recorded before the bytes that carry that event go out (so a follow-up can name it at
/// once). A stream that is not SSE is passed on unwatched.
fn watch_passed(body: axum::body::Body, keep: Option<PassedKeep>) -> axum::body::Body {
    use futures_util::StreamExt;
    let Some(keep) = keep else {
        return body;
    };
    let state = (
        body.into_data_stream(),
        strata_api::SseDecoder::new(),
        Some(keep),
    );
    let stream =
        futures_util::stream::unfold(state, |(mut inner, mut decoder, mut keep)| async move {
            let item = inner.next().await?;
            if let (Ok(bytes), Some(_)) = (&item, &keep) {
                match decoder.feed(bytes) {
                    Ok(events) => {
                        if let Some(r) = events.iter().find_map(|ev| final_response(&ev.data)) {
                            if let Some(k) = keep.take() {
                                k.save(r).await;
                            }
                        }
                    }
                    Err(_) => keep = None,
                }
            }
            Some((item, (inner, decoder, keep)))
        });
    axum::body::Body::from_stream(stream)
}

/// The tenant's stored response `id` (a store that fails is a 503).
async fn load(
    gw: &Arc<Gateway>,
    tenant: &str,
    id: &str,
) -> Result<Option<StoredResponse>, ApiError> {
    let store = gw.store.clone();
    let (tenant, id, now) = (tenant.to_string(), id.to_string(), gw.now());
    tokio::task::spawn_blocking(move || store.get_response(&tenant, &id, now))
        .await
        .map_err(|e| ApiError::unavailable(format!("The response store is unavailable: {e}.")))?
        .map_err(|e| {
            gw.metrics.backend_error("store");
            ApiError::unavailable(format!("The response store is unavailable: {e}."))
        })
}

/// `GET /v1/responses/{id}`: a response the caller's tenant stored (translated, or
/// passed through and recorded).
pub async fn get(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let caller = match proxy::authenticate(&gw, &headers).await {
        Ok(c) => c,
        Err(e) => return error_response(&e),
    };
    match load(&gw, &caller.key.record.tenant, &id).await {
        Ok(Some(row)) => {
            let mut resp = Response::new(axum::body::Body::from(row.body));
            resp.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            );
            resp
        }
        Ok(None) => error_response(
            &ApiError::not_found(format!("Response with id '{id}' not found."))
                .with_code("response_not_found"),
        ),
        Err(e) => error_response(&e),
    }
}

/// Where and what to keep of a response (`store` on).
struct Keep {
    gw: Arc<Gateway>,
    tenant: String,
    history: Vec<RequestMessage>,
    req: ResponsesRequest,
}

impl Keep {
    /// Stores `r` with the conversation after it; a store that fails is logged (the
    /// answer was made and charged; only a later `GET` or follow-up misses it).
    async fn save(self, r: ResponseObject) {
        let conversation = match conversation_after(&self.history, self.req.input.as_ref(), &r) {
            Ok(c) => c,
            Err(_) => return,
        };
        let retention = self.gw.config.get().config.store.responses_retention_secs;
        let now = self.gw.now();
        let row = StoredResponse {
            tenant: self.tenant,
            id: r.id.clone(),
            created_at: now,
            expires_at: now.saturating_add(i64::try_from(retention).unwrap_or(i64::MAX)),
            body: serde_json::to_string(&r).unwrap_or_default(),
            conversation: serde_json::to_string(&conversation).unwrap_or_default(),
        };
        let store = self.gw.store.clone();
        let res = tokio::task::spawn_blocking(move || store.put_response(&row)).await;
        if !matches!(res, Ok(Ok(()))) {
            self.gw.metrics.backend_error("store");
            tracing::warn!(id = %r.id, "could not store a response; it cannot be continued");
        }
    }
}

/// Chat chunks as Responses events; the whole response is stored before
/// `response.completed` goes out.
struct ResponsesMapper {
    events: ChatToResponseEvents,
    keep: Option<Keep>,
    pending: Option<BoxFuture<'static, ()>>,
    failed: bool,
}

impl StreamMapper for ResponsesMapper {
    fn chunk(&mut self, chunk: &strata_api::ChatCompletionChunk, out: &mut String) {
        for ev in self.events.push(chunk) {
            out.push_str(&encode_event(ev.name(), &ev));
        }
    }

    fn done(&mut self, out: &mut String) {
        let (events, whole) = self.events.finish();
        for ev in events {
            out.push_str(&encode_event(ev.name(), &ev));
        }
        if let Some(keep) = self.keep.take() {
            self.pending = Some(Box::pin(keep.save(whole)));
        }
    }

    fn error(&mut self, message: &str, out: &mut String) {
        if self.failed {
            return;
        }
        self.failed = true;
        out.push_str(&encode_event(
            "error",
            &serde_json::json!({
                "type": "error", "code": "server_error", "message": message, "param": null,
                "sequence_number": self.events.next_sequence_number(),
            }),
        ));
    }

    fn pending(&mut self) -> Option<BoxFuture<'static, ()>> {
        self.pending.take()
    }
}
