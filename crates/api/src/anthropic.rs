//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the
//! request, the answer, the streamed events and the error, as Anthropic's SDKs and vLLM
//! 0.32 put them on the wire.
//!
//! Requests are lenient (unknown fields ignored: clients add `cache_control`, `metadata`,
//! `thinking`, ...); answers are written with every field the SDKs read. The gateway
//! translates these to and from chat completions (`strata_gateway::translate`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `"type": "message"` of an answer.
pub const OBJECT_MESSAGE: &str = "message";

/// The author of a message: Anthropic has only these two (system text is a field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageRole {
    User,
    Assistant,
}

/// `system`: one string or a list of text blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a string or an array of text blocks")]
pub enum SystemPrompt {
    Text(String),
    Blocks(Vec<TextBlock>),
}

impl SystemPrompt {
    /// The system text, blocks joined by a blank line.
    pub fn text(&self) -> String {
        match self {
            SystemPrompt::Text(s) => s.clone(),
            SystemPrompt::Blocks(b) => b
                .iter()
                .map(|b| b.text.as_str())
                .collect::<Vec<_>>()
                .join("\n\n"),
        }
    }
}

/// A `{"type": "text", "text": ...}` block where only text is allowed (`system`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextBlock {
    /// Always `text`.
    #[serde(rename = "type")]
    pub kind: TextKind,
    pub text: String,
}

/// The one `type` a [`TextBlock`] may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextKind {
    Text,
}

/// A message's `content`: a string or a list of blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a string or an array of content blocks")]
pub enum Content {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

/// One content block, in a request or an answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text {
        text: String,
    },
    /// An image: `source` is `{"type": "base64", "media_type", "data"}` or
    /// `{"type": "url", "url"}`.
    Image {
        source: ImageSource,
    },
    /// The model calls a tool (`input` is the arguments object).
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    /// The caller's answer to a `tool_use` (content: a string or text/image blocks).
    ToolResult {
        tool_use_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content: Option<ToolResultContent>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
    },
    /// Extended thinking sent back by a client (not forwarded to a chat model).
    Thinking {
        thinking: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signature: Option<String>,
    },
    /// Redacted thinking sent back by a client (not forwarded).
    RedactedThinking {
        data: String,
    },
}

/// An image's `source`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ImageSource {
    Base64 { media_type: String, data: String },
    Url { url: String },
}

impl ImageSource {
    /// The image as a URL (a `data:` URL for base64 data), as chat's `image_url` takes it.
    pub fn to_url(&self) -> String {
        match self {
            ImageSource::Base64 { media_type, data } => format!("data:{media_type};base64,{data}"),
            ImageSource::Url { url } => url.clone(),
        }
    }
}

/// A `tool_result`'s `content`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a string or an array of content blocks")]
pub enum ToolResultContent {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

/// One message of the conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: MessageRole,
    pub content: Content,
}

/// A tool the model may call (custom tools; `input_schema` is a JSON Schema object).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub input_schema: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides.
    Auto {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call some tool.
    Any {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call this tool.
    Tool {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model may not call tools.
    None,
}

/// Body of `POST /v1/messages`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    pub messages: Vec<Message>,
    /// Required by Anthropic's API: the most tokens to generate.
    pub max_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// `{"user_id": ...}`, kept raw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// Structured output: `{"format": {"type": "json_schema", "schema": {...}}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_config: Option<OutputConfig>,
}

/// `output_config`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OutputConfig {
    /// The answer is JSON matching this schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<OutputFormat>,
    /// `low` … `max` (kept; a chat model has no such knob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<String>,
}

/// `output_config.format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputFormat {
    JsonSchema { schema: Value },
}

/// Body of `POST /v1/messages/count_tokens`: a Messages request without `max_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CountTokensRequest {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
}

/// The answer of `count_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountTokensResponse {
    pub input_tokens: u64,
}

/// Why the model stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model ended its turn.
    EndTurn,
    /// `max_tokens` was reached.
    MaxTokens,
    /// One of `stop_sequences` was generated (named in `stop_sequence`).
    StopSequence,
    /// The model called tools.
    ToolUse,
    /// The model paused a long turn (server tools).
    PauseTurn,
    /// The model refused.
    Refusal,
}

/// Token accounting of an answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessagesUsage {
    /// Absent from Anthropic's `message_delta` usage (only `output_tokens` is sent there).
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_creation_input_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<u64>,
}

/// The answer of `POST /v1/messages` (also `message_start`'s `message`, then with empty
/// `content` and no stop reason).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagesResponse {
    pub id: String,
    /// Always `message`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Always `assistant`.
    pub role: MessageRole,
    pub content: Vec<ContentBlock>,
    pub model: String,
    pub stop_reason: Option<StopReason>,
    #[serde(default)]
    pub stop_sequence: Option<String>,
    pub usage: MessagesUsage,
}

/// A streamed block's increment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    TextDelta {
        text: String,
    },
    /// A piece of a `tool_use` block's `input`, as JSON text.
    InputJsonDelta {
        partial_json: String,
    },
    ThinkingDelta {
        thinking: String,
    },
    SignatureDelta {
        signature: String,
    },
}

/// `message_delta`'s `delta`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageDelta {
    pub stop_reason: Option<StopReason>,
    #[serde(default)]
    pub stop_sequence: Option<String>,
}

/// One event of a streamed answer (the SSE `event:` name equals `type`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    MessageStart {
        message: MessagesResponse,
    },
    ContentBlockStart {
        index: u32,
        content_block: ContentBlock,
    },
    ContentBlockDelta {
        index: u32,
        delta: BlockDelta,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: MessageDelta,
        usage: MessagesUsage,
    },
    MessageStop,
    Ping,
    Error {
        error: ErrorBody,
    },
}

impl StreamEvent {
    /// The SSE `event:` name (the `type`).
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Ping => "ping",
            StreamEvent::Error { .. } => "error",
        }
    }
}

/// The `error` of an error answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// `invalid_request_error`, `authentication_error`, `permission_error`,
    /// `not_found_error`, `request_too_large`, `rate_limit_error`, `api_error`,
    /// `overloaded_error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

/// An error answer: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// Always `error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub error: ErrorBody,
}

impl ErrorResponse {
    /// The error Anthropic sends with HTTP `status`.
    pub fn new(status: u16, message: impl Into<String>) -> ErrorResponse {
        ErrorResponse {
            kind: "error".into(),
            error: ErrorBody {
                kind: error_type(status).into(),
                message: message.into(),
            },
        }
    }
}

/// Anthropic's error `type` for an HTTP status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 | 503 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_request_with_system_blocks_tools_and_results_parses() {
        let r: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "max_tokens": 16,
            "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"}
        }))
        .unwrap();
        assert_eq!(r.system.unwrap().text(), "be brief");
        assert_eq!(r.messages.len(), 3);
        assert!(matches!(r.tool_choice, Some(ToolChoice::Any { .. })));
    }

    #[test]
    fn missing_max_tokens_and_bad_roles_are_refused() {
        let no_max = json!({"model": "m", "messages": []});
        assert!(serde_json::from_value::<MessagesRequest>(no_max).is_err());
        let system_role = json!({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]});
        assert!(serde_json::from_value::<MessagesRequest>(system_role).is_err());
    }

    #[test]
    fn vllm_answers_parse() {
        let answer = json!({"id":"chatcmpl-1","type":"message","role":"assistant","content":[{"type":"text","text":"hi"}],"model":"m","stop_reason":"end_turn","usage":{"input_tokens":26,"output_tokens":24}});
        let r: MessagesResponse = serde_json::from_value(answer).unwrap();
        assert_eq!(r.stop_reason, Some(StopReason::EndTurn));
        let ev: StreamEvent = serde_json::from_value(json!({"type":"content_block_delta","delta":{"type":"text_delta","text":"Hello"},"index":0})).unwrap();
        assert_eq!(ev.name(), "content_block_delta");
    }

    #[test]
    fn errors_carry_anthropics_types() {
        let e = ErrorResponse::new(400, "bad");
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}})
        );
        assert_eq!(error_type(401), "authentication_error");
        assert_eq!(error_type(429), "rate_limit_error");
        assert_eq!(error_type(503), "overloaded_error");
        assert_eq!(error_type(500), "api_error");
    }
}
