//! Anthropic's Messages API on the gateway: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`.
//!
//! A request is checked against [`strata_api::anthropic`]'s types, translated into a chat
//! request ([`crate::translate::messages_to_chat`]) and sent through the proxy's stages
//! ([`crate::via_chat`]): the answer, whole or streamed, is translated back. When every
//! upstream of the model speaks the Messages API itself (`apis: [messages]` on the
//! upstream, [`crate::passthrough`]), the body goes to the upstream's `/v1/messages` as
//! sent, through the same stages. `count_tokens` counts with the upstream's tokenizer
//! (`/tokenize` over the chat messages), or is passed through likewise — also to a hosted
//! Anthropic provider (`provider: anthropic`, which has no `/tokenize`).
//!
//! Credentials: `x-api-key` (what Anthropic's SDKs send) or `Authorization: Bearer`;
//! `anthropic-version` and `anthropic-beta` are accepted and not needed. Every error on
//! these routes is in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`,
//! with the status the gateway would give a chat request (refusals cost nothing).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::json;
use strata_api::anthropic::{
    CountTokensRequest, CountTokensResponse, ErrorResponse, MessagesRequest,
};
use strata_api::{parse_json, ApiError, ChatCompletionResponse};

use crate::passthrough::{self, Api};
use crate::proxy::{self, Route};
use crate::state::Gateway;
use crate::translate::{chat_to_messages, encode_event, messages_to_chat, ChatToMessagesEvents};
use crate::via_chat::{self, ChatAnswer, StreamMapper};

/// An error answer in Anthropic's shape, with the headers it carries.
pub(crate) fn error(status: StatusCode, message: &str, headers: HeaderMap) -> Response {
    via_chat::json_response(
        status,
        &ErrorResponse::new(status.as_u16(), message),
        headers,
    )
}

fn bad_request(message: &str) -> Response {
    error(StatusCode::BAD_REQUEST, message, HeaderMap::new())
}

fn from_api_error(e: &ApiError, headers: HeaderMap) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = error(status, &e.message, headers);
    if matches!(e.status, 429 | 503) && !resp.headers().contains_key("retry-after") {
        resp.headers_mut()
            .insert("retry-after", axum::http::HeaderValue::from_static("1"));
    }
    resp
}

/// The caller is authenticated first (a 401 before any word about the body), then the
/// body read within `server.max_body_bytes`. The caller travels in `parts`' extensions
/// to the proxy's stages, which then do not authenticate it again.
async fn intake(gw: &Gateway, req: Request) -> Result<(Parts, axum::body::Bytes), Response> {
    let (mut parts, body) = req.into_parts();
    match proxy::authenticate(gw, &parts.headers).await {
        Ok(caller) => {
            parts.extensions.insert(proxy::Authenticated(caller));
        }
        Err(e) => return Err(from_api_error(&e, HeaderMap::new())),
    }
    match via_chat::read_body(gw, body).await {
        Ok(bytes) => Ok((parts, bytes)),
        Err(limit) => Err(from_api_error(
            &ApiError::body_too_large(limit),
            HeaderMap::new(),
        )),
    }
}

/// `POST /v1/messages`.
pub async fn messages(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let (parts, bytes) = match intake(&gw, req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let req = match parse_json::<MessagesRequest>(&bytes) {
        Ok(r) => r,
        Err(e) => return bad_request(&e.message),
    };
    if req.messages.is_empty() {
        return bad_request("messages: at least one message is required.");
    }
    if req.max_tokens == 0 {
        return bad_request("max_tokens: must be at least 1.");
    }
    if passthrough::speaks(&gw, &req.model, Api::Messages) {
        let answer = via_chat::call(gw, &parts, Route::Messages, bytes.to_vec()).await;
        return pass_answer(answer);
    }
    let chat = match messages_to_chat(&req) {
        Ok(c) => c,
        Err(e) => return bad_request(&format!("{}: {}", e.param, e.message)),
    };
    let id = format!("msg_{:024x}", rand::random::<u128>() >> 32);
    let stop_sequences = req.stop_sequences.clone().unwrap_or_default();
    match via_chat::call(gw, &parts, Route::Chat, via_chat::to_body(&chat)).await {
        ChatAnswer::Whole { body, headers } => {
            match serde_json::from_slice::<ChatCompletionResponse>(&body) {
                Ok(answer) => via_chat::json_response(
                    StatusCode::OK,
                    &chat_to_messages(&answer, &stop_sequences, &id),
                    headers,
                ),
                Err(e) => error(
                    StatusCode::BAD_GATEWAY,
                    &format!("The model's answer could not be read: {e}"),
                    headers,
                ),
            }
        }
        ChatAnswer::Stream { body, headers } => {
            let mapper = MessagesMapper(ChatToMessagesEvents::new(&id, &req.model, stop_sequences));
            via_chat::sse_response(via_chat::map_stream(body, mapper), headers)
        }
        ChatAnswer::Error {
            error: e, headers, ..
        } => from_api_error(&e, headers),
    }
}

/// A passed-through answer: as the upstream gave it, errors in Anthropic's shape.
fn pass_answer(answer: ChatAnswer) -> Response {
    match answer {
        ChatAnswer::Whole { body, headers } => {
            let mut resp = Response::new(axum::body::Body::from(body));
            resp.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            );
            resp.headers_mut().extend(headers);
            resp
        }
        ChatAnswer::Stream { body, headers } => via_chat::sse_response(body, headers),
        ChatAnswer::Error {
            error: e, headers, ..
        } => from_api_error(&e, headers),
    }
}

/// Chat chunks as Messages events.
struct MessagesMapper(ChatToMessagesEvents);

impl StreamMapper for MessagesMapper {
    fn chunk(&mut self, chunk: &strata_api::ChatCompletionChunk, out: &mut String) {
        for ev in self.0.push(chunk) {
            out.push_str(&encode_event(ev.name(), &ev));
        }
    }

    fn done(&mut self, out: &mut String) {
        for ev in self.0.finish() {
            out.push_str(&encode_event(ev.name(), &ev));
        }
    }

    fn error(&mut self, message: &str, out: &mut String) {
        out.push_str(&encode_event(
            "error",
            &json!({"type": "error", "error": {"type": "api_error", "message": message}}),
        ));
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model's tokenizer counts
/// them after its chat template (the upstream's `/tokenize`, through the proxy's stages:
/// authenticated and rate limited, no tokens charged). A model whose every upstream is a
/// hosted Anthropic provider (no `/tokenize` there) is counted by Anthropic's own
/// `/v1/messages/count_tokens`, the body passed as sent — with guardrails configured, only
/// when they find nothing in the prompt (read as chat: system, tool results and all),
/// since a prompt passed as is cannot be redacted.
pub async fn count_tokens(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let (parts, bytes) = match intake(&gw, req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let req = match parse_json::<CountTokensRequest>(&bytes) {
        Ok(r) => r,
        Err(e) => return bad_request(&e.message),
    };
    if req.messages.is_empty() {
        return bad_request("messages: at least one message is required.");
    }
    if passthrough::speaks(&gw, &req.model, Api::Messages) {
        let answer = via_chat::call(gw, &parts, Route::CountTokens, bytes.to_vec()).await;
        return pass_answer(answer);
    }
    let resolved = gw.config.get();
    let at_anthropic = passthrough::all_anthropic_in(&resolved, &req.model);
    let as_messages = MessagesRequest {
        model: req.model.clone(),
        messages: req.messages,
        max_tokens: 1,
        system: req.system,
        stop_sequences: None,
        stream: None,
        temperature: None,
        top_p: None,
        top_k: None,
        tools: req.tools,
        tool_choice: None,
        metadata: None,
        output_config: None,
    };
    let chat = match messages_to_chat(&as_messages) {
        Ok(c) => c,
        Err(e) => return bad_request(&format!("{}: {}", e.param, e.message)),
    };
    if at_anthropic {
        if !resolved.guardrails.is_empty() {
            let mut checked = serde_json::to_value(&chat).unwrap_or_default();
            match resolved.guardrails.apply_request(&mut checked) {
                Ok(false) => {}
                Ok(true) => {
                    return bad_request(
                        "The prompt holds text the gateway's guardrails redact; this model's \
                         provider counts the prompt as sent, so it cannot be counted.",
                    )
                }
                Err(reason) => {
                    gw.metrics.reject("guardrail");
                    return bad_request(&reason);
                }
            }
        }
        drop(resolved);
        let answer = via_chat::call(gw, &parts, Route::CountTokens, bytes.to_vec()).await;
        return pass_answer(answer);
    }
    drop(resolved);
    let mut body = json!({
        "model": req.model,
        "messages": chat.messages,
        "add_generation_prompt": true,
    });
    if let Some(tools) = chat.tools {
        body["tools"] = tools;
    }
    match via_chat::call(gw, &parts, Route::Tokenize, via_chat::to_body(&body)).await {
        ChatAnswer::Whole { body, headers } => {
            match serde_json::from_slice::<strata_api::TokenizeResponse>(&body) {
                Ok(t) => via_chat::json_response(
                    StatusCode::OK,
                    &CountTokensResponse {
                        input_tokens: t.count as u64,
                    },
                    headers,
                ),
                Err(e) => error(
                    StatusCode::BAD_GATEWAY,
                    &format!("The tokenizer's answer could not be read: {e}"),
                    headers,
                ),
            }
        }
        ChatAnswer::Stream { headers, .. } => error(
            StatusCode::BAD_GATEWAY,
            "The tokenizer answered with a stream.",
            headers,
        ),
        ChatAnswer::Error {
            error: e, headers, ..
        } => from_api_error(&e, headers),
    }
}
