//! `/v1/chat/completions`: request, response and streaming chunk.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::common::{FinishReason, KvTransferParams, StopReason, Usage};
use super::logprobs::ChatLogprobs;
use super::sampling::sampling_request;
use super::{OBJECT_CHAT_COMPLETION, OBJECT_CHAT_COMPLETION_CHUNK};

/// The author of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions from the deployer.
    System,
    /// OpenAI's newer name for system instructions.
    Developer,
    /// The end user.
    User,
    /// The model.
    Assistant,
    /// A tool result.
    Tool,
}

impl Role {
    /// Every role, in the order above.
    pub const ALL: [Role; 5] = [
        Role::System,
        Role::Developer,
        Role::User,
        Role::Assistant,
        Role::Tool,
    ];

    /// The wire name (`"system"`, ...), also what chat templates expect.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    /// Parses a wire name; `None` for anything else (names are case-sensitive, as in
    /// OpenAI's API).
    pub fn from_name(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

/// One part of an array-form message `content`.
///
/// Kept as a loose struct so that every part type (`image_url`, `input_audio`, `file`, ...)
/// parses and validation can reject non-text parts with a clear message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    /// Part type (`type` on the wire): `"text"`, `"image_url"`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The payload of an `image_url` part.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_url: Option<Value>,
    /// The payload of an `input_audio` part.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_audio: Option<Value>,
    /// The payload of a `file` part.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<Value>,
    /// The text of a `refusal` part (assistant messages).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
}

impl ContentPart {
    /// A `{"type": "text", "text": ...}` part.
    pub fn text(text: impl Into<String>) -> Self {
        ContentPart {
            kind: "text".into(),
            text: Some(text.into()),
            image_url: None,
            input_audio: None,
            file: None,
            refusal: None,
        }
    }
}

/// Message `content`: a string or a list of parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a string or an array of content parts")]
pub enum MessageContent {
    /// `"content": "Hello"`
    Text(String),
    /// `"content": [{"type": "text", "text": "Hello"}]`
    Parts(Vec<ContentPart>),
}

/// A message as a client sends it. `role` stays a string so an unknown role is reported by
/// validation as `messages[i].role` rather than as a parse failure of the whole body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// May be `null` (or absent) for assistant messages that only carry tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// Optional participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Tool calls made by an assistant message, kept raw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl RequestMessage {
    /// A message with string content.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        RequestMessage {
            role: role.as_str().to_string(),
            content: Some(MessageContent::Text(content.into())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

sampling_request! {
    /// Body of `POST /v1/chat/completions`: OpenAI's fields plus vLLM's sampling extensions.
    /// The sampling and output fields it shares with completions are declared once, in
    /// `types/sampling.rs`.
    ///
    /// See [`crate::validate::validate_chat`] for the checks and defaults.
    #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
    pub struct ChatCompletionRequest {
        /// Served model name. vLLM lets it be omitted (the default model is used).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub model: Option<String>,
        /// The conversation so far.
        pub messages: Vec<RequestMessage>,
    }
    after_seed {
        /// Return log-probabilities of the generated tokens.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub logprobs: Option<bool>,
        /// Alternatives per position (needs `logprobs: true`).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub top_logprobs: Option<i64>,
    }
    after_stream_options {
        /// Tool definitions, kept raw for the chat template.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub tools: Option<Value>,
        /// `"none"`, `"auto"`, `"required"` or a named function, kept raw.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub tool_choice: Option<Value>,
        /// Whether the model may call several tools at once.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub parallel_tool_calls: Option<bool>,
    }
    after_cache_salt {
        /// Prepend the last message to the output when it has the assistant role.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub echo: Option<bool>,
        /// Append the assistant header after the messages (default true).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub add_generation_prompt: Option<bool>,
        /// Continue the final (assistant) message instead of starting a new one.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub continue_final_message: Option<bool>,
        /// Add BOS etc. on top of the chat template (default false: templates add them).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub add_special_tokens: Option<bool>,
        /// Extra variables for the chat template, kept raw.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub chat_template_kwargs: Option<Value>,
    }
}

/// The assistant message of a non-streaming choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseMessage {
    /// Always `assistant`.
    pub role: Role,
    /// The generated text; `null` when the model only called tools.
    pub content: Option<String>,
    /// OpenAI sends `"refusal": null`; kept for parity.
    #[serde(default)]
    pub refusal: Option<String>,
    /// Tool calls, raw; omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// Reasoning text of reasoning models (vLLM's field); omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ResponseMessage {
    /// An assistant message with text content.
    pub fn assistant(content: impl Into<String>) -> Self {
        ResponseMessage {
            role: Role::Assistant,
            content: Some(content.into()),
            refusal: None,
            tool_calls: None,
            reasoning_content: None,
        }
    }
}

/// One choice of a non-streaming chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Position among the `n` choices.
    pub index: u32,
    /// The generated message.
    pub message: ResponseMessage,
    /// `null` unless logprobs were requested.
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    /// Why generation stopped.
    pub finish_reason: Option<FinishReason>,
    /// vLLM: the stop string or token that matched; omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
}

/// Response of a non-streaming chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    /// `chatcmpl-...`
    pub id: String,
    /// Always `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Generated choices.
    pub choices: Vec<ChatChoice>,
    /// Token accounting.
    pub usage: Usage,
    /// Build identifier; omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
    /// vLLM: what a remote decoder needs to pull this request's KV (PROTOCOLS §11);
    /// only a prefill engine asked with `do_remote_decode` sends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

impl ChatCompletionResponse {
    /// A response with `object` set correctly.
    pub fn new(
        id: impl Into<String>,
        created: u64,
        model: impl Into<String>,
        choices: Vec<ChatChoice>,
        usage: Usage,
    ) -> Self {
        ChatCompletionResponse {
            id: id.into(),
            object: OBJECT_CHAT_COMPLETION.to_string(),
            created,
            model: model.into(),
            choices,
            usage,
            system_fingerprint: None,
            kv_transfer_params: None,
        }
    }
}

/// The incremental message of a streaming choice. All fields are omitted when absent: the
/// first chunk carries `role`, later ones `content`, the final one is `{}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatDelta {
    /// `assistant`, in the first chunk of each choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// New text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New reasoning text (vLLM's field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool call fragments, raw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
}

/// One choice of a streaming chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    /// Position among the `n` choices.
    pub index: u32,
    /// What is new in this chunk.
    pub delta: ChatDelta,
    /// Logprobs of the tokens in this delta; `null` when not requested.
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    /// `null` until the choice's last chunk.
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// vLLM: the stop string or token that matched; omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
}

/// One `chat.completion.chunk` of a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    /// Same id in every chunk of a stream.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds; same in every chunk.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Choices with news; empty in the final usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    /// Only in the usage chunk (or every chunk with `continuous_usage_stats`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Build identifier; omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
}

impl ChatCompletionChunk {
    /// A chunk with `object` set correctly and no usage.
    pub fn new(
        id: impl Into<String>,
        created: u64,
        model: impl Into<String>,
        choices: Vec<ChatChunkChoice>,
    ) -> Self {
        ChatCompletionChunk {
            id: id.into(),
            object: OBJECT_CHAT_COMPLETION_CHUNK.to_string(),
            created,
            model: model.into(),
            choices,
            usage: None,
            system_fingerprint: None,
        }
    }

    /// The last chunk before `[DONE]` under `include_usage`: empty `choices`, with `usage`.
    pub fn usage_only(
        id: impl Into<String>,
        created: u64,
        model: impl Into<String>,
        usage: Usage,
    ) -> Self {
        let mut chunk = Self::new(id, created, model, Vec::new());
        chunk.usage = Some(usage);
        chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn role_names_round_trip() {
        for role in Role::ALL {
            assert_eq!(Role::from_name(role.as_str()), Some(role));
            assert_eq!(serde_json::to_value(role).unwrap(), json!(role.as_str()));
        }
        assert_eq!(Role::from_name("User"), None);
        assert_eq!(Role::from_name("function"), None);
    }

    #[test]
    fn content_string_or_parts() {
        let m: RequestMessage =
            serde_json::from_value(json!({"role": "user", "content": "hi"})).unwrap();
        assert_eq!(m.content, Some(MessageContent::Text("hi".into())));
        let m: RequestMessage = serde_json::from_value(json!({
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            ]
        }))
        .unwrap();
        let Some(MessageContent::Parts(parts)) = m.content else {
            panic!("expected parts");
        };
        assert_eq!(parts[0], ContentPart::text("look"));
        assert_eq!(parts[1].kind, "image_url");
        assert!(parts[1].image_url.is_some());
    }

    #[test]
    fn null_content_allowed_in_parse() {
        let m: RequestMessage = serde_json::from_value(json!({
            "role": "assistant", "content": null,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "f", "arguments": "{}"}}]
        }))
        .unwrap();
        assert_eq!(m.content, None);
        assert!(m.tool_calls.is_some());
    }

    #[test]
    fn response_serializes_nulls_where_openai_does() {
        let resp = ChatCompletionResponse::new(
            "chatcmpl-1",
            1_700_000_000,
            "llama",
            vec![ChatChoice {
                index: 0,
                message: ResponseMessage::assistant("Hello"),
                logprobs: None,
                finish_reason: Some(FinishReason::Stop),
                stop_reason: None,
            }],
            Usage::new(3, 1),
        );
        let v = serde_json::to_value(&resp).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["logprobs"], Value::Null);
        assert!(v["choices"][0]
            .as_object()
            .unwrap()
            .contains_key("logprobs"));
        assert!(!v["choices"][0]
            .as_object()
            .unwrap()
            .contains_key("stop_reason"));
        assert_eq!(
            v["choices"][0]["message"],
            json!({"role": "assistant", "content": "Hello", "refusal": null})
        );
        assert!(!v.as_object().unwrap().contains_key("system_fingerprint"));
    }

    #[test]
    fn chunk_shapes() {
        let chunk = ChatCompletionChunk::new(
            "chatcmpl-1",
            7,
            "llama",
            vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta {
                    content: Some("He".into()),
                    ..Default::default()
                },
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }],
        );
        let v = serde_json::to_value(&chunk).unwrap();
        assert_eq!(
            v,
            json!({
                "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
                "model": "llama",
                "choices": [{"index": 0, "delta": {"content": "He"},
                             "logprobs": null, "finish_reason": null}]
            })
        );
        let last = ChatCompletionChunk::usage_only("chatcmpl-1", 7, "llama", Usage::new(1, 2));
        let v = serde_json::to_value(&last).unwrap();
        assert_eq!(v["choices"], json!([]));
        assert_eq!(v["usage"]["total_tokens"], 3);
    }
}
