//! Chat completions to and from Anthropic's Messages API, for `provider: anthropic`
//! upstreams: the request body on its way out, the answer (whole or streamed) and the
//! error on their way back. The translation itself is [`crate::translate`]'s (the same
//! wire types the `/v1/messages` route serves); this file adapts it to the try stage's
//! bytes and bodies.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Response};
use http_body_util::BodyExt;
use serde_json::Value;
use strata_api::anthropic::{MessagesResponse, StreamEvent};
use strata_api::{ApiError, ChatCompletionRequest, ErrorKind, SseDecoder};

use crate::routing::Failure;
use crate::translate::{self, MessagesToChatChunks};
use crate::upstream::{BodyError, UpstreamBody};

/// `max_tokens` sent when the chat request sets none (the Messages API requires one).
pub const DEFAULT_MAX_TOKENS: u64 = 4096;

/// The Messages request for a chat request (`model` already the upstream's); a request
/// the Messages API cannot say (several choices, a content part it has no block for) is
/// a 400 in OpenAI's shape naming the field.
pub fn request_body(chat: &Value) -> Result<Bytes, Failure> {
    let refuse = |e: ApiError| Failure::Status(400, e.to_json_string());
    let req: ChatCompletionRequest = serde_json::from_value(chat.clone()).map_err(|e| {
        refuse(ApiError::invalid_no_param(format!(
            "Invalid request body: {e}"
        )))
    })?;
    if req.n.is_some_and(|n| n > 1) {
        return Err(refuse(ApiError::invalid(
            "n",
            "This model answers one choice per request (`n` must be 1).",
        )));
    }
    let messages = translate::chat_to_messages_request(&req, DEFAULT_MAX_TOKENS)
        .map_err(|e| refuse(ApiError::invalid(e.param, e.message)))?;
    serde_json::to_vec(&messages)
        .map(Bytes::from)
        .map_err(|e| Failure::Status(500, ApiError::internal(e.to_string()).to_json_string()))
}

/// The chat completion for a whole Messages answer; an answer that is not one is the
/// upstream's fault (a 502's reason).
pub fn answer_body(bytes: &[u8]) -> Result<Bytes, String> {
    let answer: MessagesResponse = serde_json::from_slice(bytes)
        .map_err(|e| format!("the provider's answer is not a Messages answer: {e}"))?;
    let created = u64::try_from(crate::state::unix_now()).unwrap_or(0);
    let chat = translate::messages_to_chat_response(&answer, created);
    serde_json::to_vec(&chat)
        .map(Bytes::from)
        .map_err(|e| e.to_string())
}

/// A streamed Messages answer as a chat stream: each event's chunks as `data:` lines as
/// they come (the usage chunk at `message_stop`), then `data: [DONE]`. An `error` event,
/// and an upstream body that ends before `message_stop` (a cut connection), end the
/// stream broken (the body's error, no `[DONE]`), so the request is not counted as whole
/// and its answer is never cached.
pub fn stream_response(resp: Response<UpstreamBody>) -> Response<UpstreamBody> {
    let (mut parts, body) = resp.into_parts();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    let state = ChatStream {
        body,
        decoder: SseDecoder::new(),
        chunks: MessagesToChatChunks::new(u64::try_from(crate::state::unix_now()).unwrap_or(0)),
        done: false,
        stopped: false,
    };
    let stream = futures_util::stream::unfold(state, ChatStream::next);
    let body = Body::from_stream(stream)
        .map_err(BodyError::from)
        .boxed_unsync();
    Response::from_parts(parts, body)
}

/// The events of a Messages stream this translation reads (others are skipped).
const KNOWN_EVENTS: [&str; 8] = [
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
    "error",
];

/// The state of one translated stream.
struct ChatStream {
    body: UpstreamBody,
    decoder: SseDecoder,
    chunks: MessagesToChatChunks,
    done: bool,
    /// `message_stop` came: the answer is whole.
    stopped: bool,
}

impl ChatStream {
    /// The next piece of the chat stream: the chunks of the next upstream frame that has
    /// any, `[DONE]` once the upstream ended, or the error that broke it.
    async fn next(mut self) -> Option<(Result<Bytes, BodyError>, ChatStream)> {
        loop {
            if self.done {
                return None;
            }
            let frame = match self.body.frame().await {
                None if self.stopped => {
                    self.done = true;
                    return Some((Ok(Bytes::from_static(b"data: [DONE]\n\n")), self));
                }
                None => {
                    self.done = true;
                    let cut = BodyError::from(
                        "the provider's stream ended before `message_stop`".to_string(),
                    );
                    return Some((Err(cut), self));
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Some((Err(e), self));
                }
                Some(Ok(frame)) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            match self.translate(&data) {
                Ok(out) if out.is_empty() => continue,
                Ok(out) => return Some((Ok(Bytes::from(out)), self)),
                Err(e) => {
                    self.done = true;
                    return Some((Err(e), self));
                }
            }
        }
    }

    /// The chat chunks, as SSE text, for the events completed by `data`.
    fn translate(&mut self, data: &[u8]) -> Result<String, BodyError> {
        let events = self
            .decoder
            .feed(data)
            .map_err(|e| BodyError::from(format!("the provider's stream: {e}")))?;
        let mut out = String::new();
        for ev in events {
            let event: StreamEvent = match ev.json() {
                Ok(event) => event,
                // An event type newer than this translation: nothing a chat client reads.
                Err(_) if !KNOWN_EVENTS.contains(&ev.event_type()) => continue,
                Err(e) => {
                    return Err(BodyError::from(format!(
                        "the provider's `{}` event: {e}",
                        ev.event_type()
                    )))
                }
            };
            if let StreamEvent::Error { error } = &event {
                return Err(BodyError::from(format!(
                    "the provider's stream failed: {}: {}",
                    error.kind, error.message
                )));
            }
            if matches!(event, StreamEvent::MessageStop) {
                self.stopped = true;
            }
            for chunk in self.chunks.push(&event) {
                let line = strata_api::sse::encode_json(&chunk)
                    .map_err(|e| BodyError::from(e.to_string()))?;
                out.push_str(&line);
            }
        }
        Ok(out)
    }
}

/// An Anthropic error body (`{"type": "error", "error": {"type", "message"}}`) in OpenAI's
/// shape, its message kept (so a context-window error is still recognised) and its
/// Anthropic type as the `code`; a body of another shape is named by its status.
pub fn error_text(status: u16, text: &str) -> String {
    let mut err = match serde_json::from_str::<strata_api::anthropic::ErrorResponse>(text) {
        Ok(e) => {
            ApiError::new(ErrorKind::from_status(status), e.error.message).with_code(e.error.kind)
        }
        Err(_) => match serde_json::from_str::<strata_api::ErrorResponse>(text) {
            Ok(_) => return text.to_string(),
            Err(_) => ApiError::new(
                ErrorKind::from_status(status),
                format!("The provider answered {status}."),
            ),
        },
    };
    err.status = status;
    err.to_json_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_errors_read_as_openai_errors() {
        let body = r#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"}}"#;
        let v: Value = serde_json::from_str(&error_text(429, body)).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
        assert_eq!(v["error"]["code"], "rate_limit_error");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("per-minute rate limit"));
        let ctx = r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#;
        let text = error_text(400, ctx);
        assert!(crate::routing::is_context_length_error(&text), "{text}");
        let v: Value = serde_json::from_str(&error_text(502, "<html>bad gateway</html>")).unwrap();
        assert_eq!(v["error"]["message"], "The provider answered 502.");
    }
}
