//! Serving the Responses API on a chat model: a Responses request (with the conversation
//! of its `previous_response_id`, already in chat terms) as a chat request, and a chat
//! answer as a response object.

use serde_json::{json, Value};
use strata_api::responses::{
    ContentPart, FunctionCall, IncompleteDetails, Input, InputItem, InputMessage, InputRole, Item,
    MessageContent as RMessageContent, OutputItem, Response, ResponseUsage, ResponsesRequest,
    TextConfig, TextFormat, Tool, ToolChoice, ToolChoiceMode, OBJECT_RESPONSE,
};
use strata_api::types::chat::{ContentPart as ChatPart, MessageContent};
use strata_api::types::{FinishReason, ResponseFormat, StreamOptions};
use strata_api::{ChatCompletionRequest, ChatCompletionResponse, RequestMessage, Role};

use super::{chat_tool_call, read_tool_call, TranslateError};

/// The ids of one response and its items: `resp_<x>`, `msg_<x>`, `fc_<x>_<i>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseIds {
    pub response: String,
    suffix: String,
}

impl ResponseIds {
    /// Ids built on `suffix` (a random hex string the caller draws).
    pub fn new(suffix: &str) -> ResponseIds {
        ResponseIds {
            response: format!("resp_{suffix}"),
            suffix: suffix.to_string(),
        }
    }

    pub fn message(&self) -> String {
        format!("msg_{}", self.suffix)
    }

    pub fn function_call(&self, i: usize) -> String {
        format!("fc_{}_{i}", self.suffix)
    }
}

/// The chat request asking what `req` asks; `history` is the conversation so far (the
/// stored input and output of `previous_response_id`), in chat terms. A streamed request
/// asks for the usage chunk.
pub fn responses_to_chat(
    req: &ResponsesRequest,
    history: &[RequestMessage],
) -> Result<ChatCompletionRequest, TranslateError> {
    let mut messages = Vec::with_capacity(history.len() + 4);
    if let Some(i) = req.instructions.as_ref().filter(|i| !i.is_empty()) {
        messages.push(RequestMessage::new(Role::System, i.clone()));
    }
    messages.extend(history.iter().cloned());
    messages.extend(input_messages(req.input.as_ref())?);
    if messages.is_empty() {
        return Err(TranslateError::new("input", "`input` must not be empty."));
    }
    let mut chat = ChatCompletionRequest {
        model: Some(req.model.clone()),
        messages,
        max_tokens: req
            .max_output_tokens
            .map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
        temperature: req.temperature,
        top_p: req.top_p,
        user: req.user.clone(),
        parallel_tool_calls: req.parallel_tool_calls,
        ..Default::default()
    };
    if req.stream == Some(true) {
        chat.stream = Some(true);
        chat.stream_options = Some(StreamOptions {
            include_usage: Some(true),
            continuous_usage_stats: None,
        });
    }
    if let Some(tools) = req.tools.as_ref().filter(|t| !t.is_empty()) {
        chat.tools = Some(Value::Array(tools.iter().map(chat_tool).collect()));
    }
    chat.tool_choice = req.tool_choice.as_ref().map(|c| match c {
        ToolChoice::Mode(ToolChoiceMode::Auto) => json!("auto"),
        ToolChoice::Mode(ToolChoiceMode::None) => json!("none"),
        ToolChoice::Mode(ToolChoiceMode::Required) => json!("required"),
        ToolChoice::Function(f) => json!({"type": "function", "function": {"name": f.name}}),
    });
    chat.response_format = req
        .text
        .as_ref()
        .and_then(|t| t.format.as_ref())
        .map(response_format);
    Ok(chat)
}

fn chat_tool(t: &Tool) -> Value {
    let Tool::Function {
        name,
        description,
        parameters,
        strict,
    } = t;
    let mut f = json!({"name": name});
    if let Some(d) = description {
        f["description"] = json!(d);
    }
    f["parameters"] = parameters
        .clone()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    if let Some(s) = strict {
        f["strict"] = json!(s);
    }
    json!({"type": "function", "function": f})
}

fn response_format(f: &TextFormat) -> ResponseFormat {
    match f {
        TextFormat::Text => ResponseFormat {
            kind: "text".into(),
            json_schema: None,
        },
        TextFormat::JsonObject => ResponseFormat {
            kind: "json_object".into(),
            json_schema: None,
        },
        TextFormat::JsonSchema {
            name,
            schema,
            description,
            strict,
        } => {
            let mut s = json!({"name": name, "schema": schema});
            if let Some(d) = description {
                s["description"] = json!(d);
            }
            if let Some(st) = strict {
                s["strict"] = json!(st);
            }
            ResponseFormat {
                kind: "json_schema".into(),
                json_schema: Some(s),
            }
        }
    }
}

/// The request's `input` as chat messages: consecutive function calls join one assistant
/// message's `tool_calls`; function call outputs become `tool` messages.
pub(crate) fn input_messages(input: Option<&Input>) -> Result<Vec<RequestMessage>, TranslateError> {
    let items = match input {
        None => return Ok(Vec::new()),
        Some(Input::Text(t)) => return Ok(vec![RequestMessage::new(Role::User, t.clone())]),
        Some(Input::Items(items)) => items,
    };
    let mut out: Vec<RequestMessage> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item {
            InputItem::Message(m) | InputItem::Typed(Item::Message(m)) => {
                out.push(chat_message(m, i)?)
            }
            InputItem::Typed(Item::FunctionCall(c)) => push_call(&mut out, c),
            InputItem::Typed(Item::FunctionCallOutput(o)) => out.push(RequestMessage {
                role: Role::Tool.as_str().into(),
                content: Some(MessageContent::Text(output_text(&o.output))),
                name: None,
                tool_calls: None,
                tool_call_id: Some(o.call_id.clone()),
            }),
            InputItem::Typed(Item::Reasoning { .. }) => {}
        }
    }
    Ok(out)
}

fn output_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        other => other.to_string(),
    }
}

fn push_call(out: &mut Vec<RequestMessage>, c: &FunctionCall) {
    let call = chat_tool_call(&c.call_id, &c.name, &c.arguments);
    if let Some(last) = out
        .last_mut()
        .filter(|m| m.role == Role::Assistant.as_str())
    {
        match &mut last.tool_calls {
            Some(Value::Array(calls)) => calls.push(call),
            _ => last.tool_calls = Some(Value::Array(vec![call])),
        }
        return;
    }
    out.push(RequestMessage {
        role: Role::Assistant.as_str().into(),
        content: None,
        name: None,
        tool_calls: Some(Value::Array(vec![call])),
        tool_call_id: None,
    });
}

fn chat_message(m: &InputMessage, i: usize) -> Result<RequestMessage, TranslateError> {
    let role = match m.role {
        InputRole::User => Role::User,
        InputRole::Assistant => Role::Assistant,
        InputRole::System => Role::System,
        InputRole::Developer => Role::Developer,
    };
    let content = match &m.content {
        RMessageContent::Text(t) => MessageContent::Text(t.clone()),
        RMessageContent::Parts(parts) => {
            let mut out = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                out.push(match p {
                    ContentPart::InputText { text } | ContentPart::OutputText { text, .. } => {
                        ChatPart::text(text.clone())
                    }
                    ContentPart::Refusal { refusal } => ChatPart::text(refusal.clone()),
                    ContentPart::InputImage { image_url, .. } => {
                        let Some(url) = image_url else {
                            return Err(TranslateError::new(
                                format!("input[{i}].content[{j}].image_url"),
                                "`input_image` needs an `image_url` (file ids are not served).",
                            ));
                        };
                        let mut part = ChatPart::text("");
                        part.kind = "image_url".into();
                        part.text = None;
                        part.image_url = Some(json!({ "url": url }));
                        part
                    }
                });
            }
            match out.as_slice() {
                [p] if p.kind == "text" => MessageContent::Text(p.text.clone().unwrap_or_default()),
                _ => MessageContent::Parts(out),
            }
        }
    };
    Ok(RequestMessage {
        role: role.as_str().into(),
        content: Some(content),
        name: None,
        tool_calls: None,
        tool_call_id: None,
    })
}

/// The response object as it stands before any output: the request's settings echoed,
/// `status: in_progress`.
pub fn response_skeleton(req: &ResponsesRequest, ids: &ResponseIds, created_at: u64) -> Response {
    Response {
        id: ids.response.clone(),
        object: OBJECT_RESPONSE.into(),
        created_at,
        status: "in_progress".into(),
        error: None,
        incomplete_details: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        model: req.model.clone(),
        output: Vec::new(),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        previous_response_id: req.previous_response_id.clone(),
        temperature: req.temperature,
        top_p: req.top_p,
        text: Some(req.text.clone().unwrap_or(TextConfig {
            format: Some(TextFormat::Text),
            verbosity: None,
        })),
        tool_choice: req
            .tool_choice
            .as_ref()
            .and_then(|c| serde_json::to_value(c).ok())
            .unwrap_or_else(|| json!("auto")),
        tools: req.tools.clone().unwrap_or_default(),
        store: Some(req.store.unwrap_or(true)),
        metadata: req.metadata.clone(),
        user: req.user.clone(),
        usage: None,
    }
}

/// Status and incomplete details for a chat finish reason.
pub(crate) fn status_of(finish: Option<FinishReason>) -> (&'static str, Option<IncompleteDetails>) {
    let incomplete = |reason: &str| {
        (
            "incomplete",
            Some(IncompleteDetails {
                reason: reason.into(),
            }),
        )
    };
    match finish {
        Some(FinishReason::Length) => incomplete("max_output_tokens"),
        Some(FinishReason::ContentFilter) => incomplete("content_filter"),
        _ => ("completed", None),
    }
}

/// The response object for a chat answer (its first choice): a message item with the
/// text (when there is text, or nothing else), a `function_call` item per tool call.
pub fn chat_to_response(
    chat: &ChatCompletionResponse,
    req: &ResponsesRequest,
    ids: &ResponseIds,
    created_at: u64,
) -> Response {
    let mut r = response_skeleton(req, ids, created_at);
    r.model = chat.model.clone();
    let choice = chat.choices.first();
    let text = choice
        .and_then(|c| c.message.content.clone())
        .unwrap_or_default();
    let calls = choice
        .and_then(|c| c.message.tool_calls.clone())
        .unwrap_or_default();
    if !text.is_empty() || calls.is_empty() {
        r.output.push(OutputItem::Message {
            id: ids.message(),
            role: InputRole::Assistant,
            status: "completed".into(),
            content: vec![ContentPart::output_text(text)],
        });
    }
    for (i, call) in calls.iter().enumerate() {
        let (call_id, name, arguments) = read_tool_call(call);
        r.output.push(OutputItem::FunctionCall {
            id: ids.function_call(i),
            call_id,
            name,
            arguments,
            status: "completed".into(),
        });
    }
    let (status, incomplete) = status_of(choice.and_then(|c| c.finish_reason));
    r.status = status.into();
    r.incomplete_details = incomplete;
    r.usage = Some(usage_of(
        chat.usage.prompt_tokens.into(),
        chat.usage.completion_tokens.into(),
        chat.usage
            .prompt_tokens_details
            .map_or(0, |d| d.cached_tokens.into()),
    ));
    r
}

pub(crate) fn usage_of(input: u64, output: u64, cached: u64) -> ResponseUsage {
    ResponseUsage {
        input_tokens: input,
        output_tokens: output,
        total_tokens: input + output,
        input_tokens_details: strata_api::responses::InputTokensDetails {
            cached_tokens: cached,
        },
        output_tokens_details: Default::default(),
    }
}

/// The conversation after `r` in chat terms: `input` (without instructions) then the
/// output, what a later `previous_response_id` continues.
pub fn conversation_after(
    history: &[RequestMessage],
    input: Option<&Input>,
    r: &Response,
) -> Result<Vec<RequestMessage>, TranslateError> {
    let mut conv = history.to_vec();
    conv.extend(input_messages(input)?);
    let mut text = String::new();
    let mut calls = Vec::new();
    for item in &r.output {
        match item {
            OutputItem::Message { content, .. } => {
                for p in content {
                    if let ContentPart::OutputText { text: t, .. } = p {
                        text.push_str(t);
                    }
                }
            }
            OutputItem::FunctionCall {
                call_id,
                name,
                arguments,
                ..
            } => calls.push(chat_tool_call(call_id, name, arguments)),
        }
    }
    conv.push(RequestMessage {
        role: Role::Assistant.as_str().into(),
        content: (!text.is_empty() || calls.is_empty()).then_some(MessageContent::Text(text)),
        name: None,
        tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
        tool_call_id: None,
    });
    Ok(conv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> ResponsesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn instructions_history_items_tools_and_schema_become_a_chat_request() {
        let r = req(json!({
            "model": "m", "instructions": "be brief", "max_output_tokens": 9, "stream": true,
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"role": "user", "content": [{"type": "input_text", "text": "so?"}]}
            ],
            "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
            "tool_choice": "required",
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}}
        }));
        let history = vec![RequestMessage::new(Role::User, "weather?")];
        let chat = serde_json::to_value(responses_to_chat(&r, &history).unwrap()).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                {"role": "user", "content": "so?"}
            ])
        );
        assert_eq!(chat["max_tokens"], 9);
        assert_eq!(chat["tool_choice"], "required");
        assert_eq!(
            chat["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": true}})
        );
        assert_eq!(chat["stream_options"]["include_usage"], true);
    }

    #[test]
    fn empty_input_is_refused() {
        let e = responses_to_chat(&req(json!({"model": "m", "input": []})), &[]).unwrap_err();
        assert_eq!(e.param, "input");
    }

    #[test]
    fn tool_calls_and_length_become_items_and_incomplete() {
        let chat: ChatCompletionResponse = serde_json::from_value(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "call_9", "type": "function", "function": {"name": "get", "arguments": "{\"a\":1}"}}
            ]}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
        }))
        .unwrap();
        let r = req(json!({"model": "m", "input": "hi"}));
        let ids = ResponseIds::new("abc");
        let out = chat_to_response(&chat, &r, &ids, 7);
        assert_eq!(out.status, "incomplete");
        assert_eq!(
            out.incomplete_details.as_ref().unwrap().reason,
            "max_output_tokens"
        );
        assert_eq!(
            serde_json::to_value(&out.output).unwrap(),
            json!([
                {"type": "message", "id": "msg_abc", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
                {"type": "function_call", "id": "fc_abc_0", "call_id": "call_9", "name": "get", "arguments": "{\"a\":1}", "status": "completed"}
            ])
        );
        assert_eq!(out.usage.unwrap().total_tokens, 6);
        let conv = conversation_after(&[], r.input.as_ref(), &out).unwrap();
        assert_eq!(conv.len(), 2);
        assert_eq!(conv[1].tool_calls.as_ref().unwrap()[0]["id"], "call_9");
    }
}
