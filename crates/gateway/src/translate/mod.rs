//! Translation between chat completions and the two other generation APIs the gateway
//! serves, Anthropic's Messages API ([`strata_api::anthropic`]) and OpenAI's Responses API
//! ([`strata_api::responses`]). Pure functions and stream state machines over the typed
//! wire values: no I/O, no gateway state, so any part of the gateway (the `/v1/messages`
//! and `/v1/responses` routes, a hosted-provider upstream) can use them.
//!
//! Serving an API over a chat upstream (the default for Strata engines):
//! * [`messages_to_chat`] / [`chat_to_messages`]: a Messages request as a chat request,
//!   a chat answer as a Messages answer; [`ChatToMessagesEvents`] turns a chat stream's
//!   chunks into Messages events (`message_start` … `message_stop`).
//! * [`responses_to_chat`] / [`chat_to_response`]: likewise for the Responses API;
//!   [`ChatToResponseEvents`] turns chunks into `response.*` events and, at the end, the
//!   whole [`strata_api::responses::Response`] (kept for `previous_response_id`).
//!
//! Calling a Messages upstream (an Anthropic provider) for a chat client, the other way:
//! * [`chat_to_messages_request`] / [`messages_to_chat_response`], and
//!   [`MessagesToChatChunks`] for its stream.
//!
//! Stop reasons map both ways: `end_turn` ⇄ `stop`, `max_tokens` ⇄ `length`,
//! `stop_sequence` ⇄ `stop` with vLLM's `stop_reason` naming the string, `tool_use` ⇄
//! `tool_calls`, `refusal` ⇄ `content_filter`. Tool calls: chat's `tool_calls` (arguments
//! as JSON text) ⇄ Messages' `tool_use` blocks (input as an object) ⇄ Responses'
//! `function_call` items; tool results ⇄ `tool` messages. What a chat model cannot take
//! (thinking blocks sent back, reasoning items) is dropped; what a field cannot carry is a
//! [`TranslateError`] naming it.
//!
//! [`encode_event`] writes one named SSE event, as both APIs stream them.

mod messages;
mod messages_stream;
mod messages_upstream;
mod messages_upstream_stream;
mod responses;
mod responses_stream;

pub use messages::{chat_to_messages, messages_to_chat, stop_reason_of};
pub use messages_stream::ChatToMessagesEvents;
pub use messages_upstream::{chat_to_messages_request, messages_to_chat_response};
pub use messages_upstream_stream::MessagesToChatChunks;
pub use responses::{
    chat_to_response, conversation_after, response_skeleton, responses_to_chat, ResponseIds,
};
pub use responses_stream::ChatToResponseEvents;

use serde::Serialize;

/// A request that cannot be said in the other API: `param` names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct TranslateError {
    pub param: String,
    pub message: String,
}

impl TranslateError {
    pub(crate) fn new(param: impl Into<String>, message: impl Into<String>) -> TranslateError {
        TranslateError {
            param: param.into(),
            message: message.into(),
        }
    }
}

/// One SSE event with an `event:` name: `event: <name>\ndata: <json>\n\n`.
pub fn encode_event<T: Serialize>(name: &str, value: &T) -> String {
    let data = serde_json::to_string(value).unwrap_or_else(|_| "{}".to_string());
    format!("event: {name}\ndata: {data}\n\n")
}

/// The text of a chat tool call's `function.arguments` as an object (`{}` for an empty
/// text; a text that is not a JSON object is kept under `"arguments"` so nothing is lost).
pub(crate) fn arguments_object(arguments: &str) -> serde_json::Value {
    let trimmed = arguments.trim();
    if trimmed.is_empty() {
        return serde_json::json!({});
    }
    match serde_json::from_str::<serde_json::Value>(trimmed) {
        Ok(v @ serde_json::Value::Object(_)) => v,
        _ => serde_json::json!({ "arguments": arguments }),
    }
}

/// A chat tool call: `{"id", "type": "function", "function": {"name", "arguments"}}`.
pub(crate) fn chat_tool_call(id: &str, name: &str, arguments: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

/// `(id, name, arguments)` of a chat tool call (missing fields empty).
pub(crate) fn read_tool_call(call: &serde_json::Value) -> (String, String, String) {
    let s = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).unwrap_or("").to_string();
    let f = call.get("function");
    (
        s(call.get("id")),
        s(f.and_then(|f| f.get("name"))),
        s(f.and_then(|f| f.get("arguments"))),
    )
}
