//! OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`): the request,
//! the response object, its output items and the streamed events, as OpenAI's SDK and
//! vLLM 0.32 put them on the wire.
//!
//! Requests are lenient (unknown fields ignored); tool kinds other than `function` and
//! input items other than messages and function calls are refused by the parser (the
//! gateway answers them with a 400 naming the field). The gateway translates these to and
//! from chat completions (`strata_gateway::translate`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `"object": "response"`.
pub const OBJECT_RESPONSE: &str = "response";

/// `input`: one user text, or a list of items.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a string or an array of input items")]
pub enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

/// One input item: a typed item, or a message without `type` (the "easy" form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "an input item: a message ({role, content}), a `function_call` or a `function_call_output`"
)]
pub enum InputItem {
    Typed(Item),
    Message(InputMessage),
}

/// A typed item, in `input` or (messages and function calls) in a response's `output`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Item {
    Message(InputMessage),
    FunctionCall(FunctionCall),
    FunctionCallOutput(FunctionCallOutput),
    /// A reasoning item sent back (not forwarded to a chat model).
    Reasoning {
        #[serde(default)]
        id: Option<String>,
        #[serde(default)]
        summary: Vec<Value>,
    },
}

/// A message in `input` (or an output message sent back as input).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputMessage {
    /// `user`, `assistant`, `system` or `developer`.
    pub role: InputRole,
    pub content: MessageContent,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// The roles an input message may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputRole {
    User,
    Assistant,
    System,
    Developer,
}

/// A message's `content`: a string or a list of parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a string or an array of content parts")]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    InputText {
        text: String,
    },
    /// The model's text (in an output message, or one sent back as input).
    OutputText {
        text: String,
        #[serde(default)]
        annotations: Vec<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<Value>,
    },
    InputImage {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        image_url: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    Refusal {
        refusal: String,
    },
}

impl ContentPart {
    /// An `output_text` part without annotations.
    pub fn output_text(text: impl Into<String>) -> ContentPart {
        ContentPart::OutputText {
            text: text.into(),
            annotations: Vec::new(),
            logprobs: None,
        }
    }
}

/// The model calls a function (`arguments` is JSON text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub call_id: String,
    pub name: String,
    pub arguments: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// The caller's answer to a function call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCallOutput {
    pub call_id: String,
    /// Text (or, from newer clients, a list of content parts).
    pub output: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// A tool the model may call: only function tools are served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Tool {
    Function {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parameters: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

/// `tool_choice`: `"auto"`, `"none"`, `"required"` or `{"type": "function", "name"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}"
)]
pub enum ToolChoice {
    Mode(ToolChoiceMode),
    Function(NamedFunction),
}

/// The word forms of `tool_choice`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolChoiceMode {
    Auto,
    None,
    Required,
}

/// `{"type": "function", "name": ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedFunction {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: FunctionKind,
    pub name: String,
}

/// The one `type` a [`NamedFunction`] has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FunctionKind {
    Function,
}

/// `text`: the output's format.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<TextFormat>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<String>,
}

/// `text.format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    Text,
    JsonObject,
    /// The output is JSON matching `schema`.
    JsonSchema {
        name: String,
        schema: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

/// Body of `POST /v1/responses`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponsesRequest {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Input>,
    /// System instructions (not carried over by `previous_response_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Continue the conversation of a stored response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    /// Keep the response for `GET` and `previous_response_id` (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// An item of a response's `output`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Message {
        id: String,
        role: InputRole,
        status: String,
        content: Vec<ContentPart>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        status: String,
    },
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputTokensDetails {
    #[serde(default)]
    pub cached_tokens: u64,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputTokensDetails {
    #[serde(default)]
    pub reasoning_tokens: u64,
}

/// Token accounting of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub total_tokens: u64,
    #[serde(default)]
    pub input_tokens_details: InputTokensDetails,
    #[serde(default)]
    pub output_tokens_details: OutputTokensDetails,
}

/// `incomplete_details`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncompleteDetails {
    /// `max_output_tokens` or `content_filter`.
    pub reason: String,
}

/// The response object (`POST` answer, `GET` answer, and inside the lifecycle events).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub id: String,
    /// Always `response`.
    pub object: String,
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: String,
    #[serde(default)]
    pub error: Option<Value>,
    #[serde(default)]
    pub incomplete_details: Option<IncompleteDetails>,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    pub model: String,
    pub output: Vec<OutputItem>,
    #[serde(default)]
    pub parallel_tool_calls: bool,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub text: Option<TextConfig>,
    /// As requested (default `"auto"`).
    #[serde(default)]
    pub tool_choice: Value,
    #[serde(default)]
    pub tools: Vec<Tool>,
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub usage: Option<ResponseUsage>,
}

impl Response {
    /// The text of every `output_text` part, concatenated (the SDKs' `output_text`).
    pub fn output_text(&self) -> String {
        let mut out = String::new();
        for item in &self.output {
            if let OutputItem::Message { content, .. } = item {
                for part in content {
                    if let ContentPart::OutputText { text, .. } = part {
                        out.push_str(text);
                    }
                }
            }
        }
        out
    }
}

/// One streamed event (the SSE `event:` name equals `type`); every event carries
/// `sequence_number`, counted from 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum StreamEvent {
    #[serde(rename = "response.created")]
    Created {
        response: Response,
        sequence_number: u64,
    },
    #[serde(rename = "response.in_progress")]
    InProgress {
        response: Response,
        sequence_number: u64,
    },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        output_index: u32,
        item: OutputItem,
        sequence_number: u64,
    },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        item_id: String,
        output_index: u32,
        content_index: u32,
        part: ContentPart,
        sequence_number: u64,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: String,
        output_index: u32,
        content_index: u32,
        delta: String,
        #[serde(default)]
        logprobs: Vec<Value>,
        sequence_number: u64,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        text: String,
        #[serde(default)]
        logprobs: Vec<Value>,
        sequence_number: u64,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        part: ContentPart,
        sequence_number: u64,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        item_id: String,
        output_index: u32,
        delta: String,
        sequence_number: u64,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        item_id: String,
        output_index: u32,
        arguments: String,
        sequence_number: u64,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        output_index: u32,
        item: OutputItem,
        sequence_number: u64,
    },
    #[serde(rename = "response.completed")]
    Completed {
        response: Response,
        sequence_number: u64,
    },
    #[serde(rename = "response.incomplete")]
    Incomplete {
        response: Response,
        sequence_number: u64,
    },
    #[serde(rename = "response.failed")]
    Failed {
        response: Response,
        sequence_number: u64,
    },
    /// A stream that broke: OpenAI's error fields.
    #[serde(rename = "error")]
    Error {
        #[serde(default)]
        code: Option<String>,
        message: String,
        #[serde(default)]
        param: Option<String>,
        sequence_number: u64,
    },
}

impl StreamEvent {
    /// The SSE `event:` name (the `type`).
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::Created { .. } => "response.created",
            StreamEvent::InProgress { .. } => "response.in_progress",
            StreamEvent::OutputItemAdded { .. } => "response.output_item.added",
            StreamEvent::ContentPartAdded { .. } => "response.content_part.added",
            StreamEvent::OutputTextDelta { .. } => "response.output_text.delta",
            StreamEvent::OutputTextDone { .. } => "response.output_text.done",
            StreamEvent::ContentPartDone { .. } => "response.content_part.done",
            StreamEvent::FunctionCallArgumentsDelta { .. } => {
                "response.function_call_arguments.delta"
            }
            StreamEvent::FunctionCallArgumentsDone { .. } => {
                "response.function_call_arguments.done"
            }
            StreamEvent::OutputItemDone { .. } => "response.output_item.done",
            StreamEvent::Completed { .. } => "response.completed",
            StreamEvent::Incomplete { .. } => "response.incomplete",
            StreamEvent::Failed { .. } => "response.failed",
            StreamEvent::Error { .. } => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_forms_parse() {
        let r: ResponsesRequest = serde_json::from_value(json!({
            "model": "m",
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "3"}
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}
        }))
        .unwrap();
        let Some(Input::Items(items)) = r.input else {
            panic!("items")
        };
        assert!(matches!(items[0], InputItem::Message(_)));
        assert!(matches!(items[2], InputItem::Typed(Item::FunctionCall(_))));
        assert!(matches!(r.tool_choice, Some(ToolChoice::Function(_))));
    }

    #[test]
    fn unsupported_tools_are_refused() {
        let r = serde_json::from_value::<ResponsesRequest>(
            json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
        );
        assert!(r.is_err());
    }

    #[test]
    fn vllm_answers_parse() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/vllm-0.32/api/responses.json"
        ))
        .unwrap();
        let r: Response = serde_json::from_str(&text).unwrap();
        assert_eq!(r.output_text(), "The capital of France is Paris.");
        let ev: StreamEvent = serde_json::from_value(json!({"content_index":0,"delta":"Hello","item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"})).unwrap();
        assert_eq!(ev.name(), "response.output_text.delta");
    }
}
