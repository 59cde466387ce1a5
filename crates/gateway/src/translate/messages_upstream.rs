//! Calling a Messages upstream for a chat client: a chat request as a Messages request,
//! and a Messages answer as a chat answer.

use serde_json::{json, Value};
use strata_api::anthropic::{
    Content, ContentBlock, ImageSource, Message, MessageRole, MessagesRequest, MessagesResponse,
    OutputConfig, OutputFormat, StopReason, SystemPrompt, Tool, ToolChoice, ToolResultContent,
};
use strata_api::types::chat::MessageContent;
use strata_api::types::{FinishReason, StopReason as ChatStop, OBJECT_CHAT_COMPLETION};
use strata_api::{
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ResponseMessage, Role,
};

use super::{arguments_object, chat_tool_call, read_tool_call, TranslateError};

/// The Messages request asking what `chat` asks. Messages requires `max_tokens`:
/// `default_max_tokens` is used when the chat request sets none.
pub fn chat_to_messages_request(
    chat: &ChatCompletionRequest,
    default_max_tokens: u64,
) -> Result<MessagesRequest, TranslateError> {
    let mut system = Vec::new();
    let mut messages: Vec<Message> = Vec::new();
    for (i, m) in chat.messages.iter().enumerate() {
        let role = Role::from_name(&m.role).ok_or_else(|| {
            TranslateError::new(
                format!("messages[{i}].role"),
                format!("Unknown role `{}`.", m.role),
            )
        })?;
        let (role, blocks) = match role {
            Role::System | Role::Developer => {
                system.push(content_text(m.content.as_ref()));
                continue;
            }
            Role::User => (MessageRole::User, user_blocks(m.content.as_ref(), i)?),
            Role::Assistant => (
                MessageRole::Assistant,
                assistant_blocks(m.content.as_ref(), m.tool_calls.as_ref()),
            ),
            Role::Tool => (
                MessageRole::User,
                vec![ContentBlock::ToolResult {
                    tool_use_id: m.tool_call_id.clone().unwrap_or_default(),
                    content: Some(ToolResultContent::Text(content_text(m.content.as_ref()))),
                    is_error: None,
                }],
            ),
        };
        // Consecutive messages of one role become one (tool results after each other).
        match messages.last_mut() {
            Some(Message {
                role: last,
                content: Content::Blocks(b),
            }) if *last == role => b.extend(blocks),
            _ => messages.push(Message {
                role,
                content: Content::Blocks(blocks),
            }),
        }
    }
    let max_tokens = chat
        .max_completion_tokens
        .or(chat.max_tokens)
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(default_max_tokens);
    let parallel_off = chat.parallel_tool_calls == Some(false);
    Ok(MessagesRequest {
        model: chat.model.clone().unwrap_or_default(),
        messages,
        max_tokens,
        system: (!system.is_empty()).then(|| SystemPrompt::Text(system.join("\n\n"))),
        stop_sequences: chat.stop.clone().map(|s| s.into_vec()),
        stream: chat.stream,
        temperature: chat.temperature,
        top_p: chat.top_p,
        top_k: chat.top_k.filter(|k| *k > 0),
        tools: chat.tools.as_ref().map(messages_tools).transpose()?,
        tool_choice: chat
            .tool_choice
            .as_ref()
            .map(|c| messages_tool_choice(c, parallel_off))
            .transpose()?,
        metadata: chat.user.as_ref().map(|u| json!({ "user_id": u })),
        output_config: output_config(chat),
    })
}

/// Chat's `response_format: json_schema` as Messages' `output_config` (other formats have
/// no Messages counterpart and are left to the prompt).
fn output_config(chat: &ChatCompletionRequest) -> Option<OutputConfig> {
    let f = chat
        .response_format
        .as_ref()
        .filter(|f| f.kind == "json_schema")?;
    let schema = f.json_schema.as_ref()?.get("schema")?.clone();
    Some(OutputConfig {
        format: Some(OutputFormat::JsonSchema { schema }),
        effort: None,
    })
}

fn content_text(c: Option<&MessageContent>) -> String {
    match c {
        None => String::new(),
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(p)) => p
            .iter()
            .filter_map(|p| p.text.as_deref())
            .collect::<Vec<_>>()
            .join(""),
    }
}

fn user_blocks(c: Option<&MessageContent>, i: usize) -> Result<Vec<ContentBlock>, TranslateError> {
    let parts = match c {
        None => return Ok(Vec::new()),
        Some(MessageContent::Text(t)) => return Ok(vec![ContentBlock::Text { text: t.clone() }]),
        Some(MessageContent::Parts(p)) => p,
    };
    let mut out = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        match p.kind.as_str() {
            "text" => out.push(ContentBlock::Text {
                text: p.text.clone().unwrap_or_default(),
            }),
            "image_url" => {
                let url = p
                    .image_url
                    .as_ref()
                    .and_then(|u| u.get("url").or(Some(u)))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                out.push(ContentBlock::Image {
                    source: image_source(url),
                });
            }
            other => {
                return Err(TranslateError::new(
                    format!("messages[{i}].content[{j}]"),
                    format!("Content parts of type `{other}` cannot be sent to this model."),
                ))
            }
        }
    }
    Ok(out)
}

/// A `data:` URL as base64 data, any other URL as a URL source.
fn image_source(url: &str) -> ImageSource {
    if let Some(rest) = url.strip_prefix("data:") {
        if let Some((media_type, data)) = rest.split_once(";base64,") {
            return ImageSource::Base64 {
                media_type: media_type.into(),
                data: data.into(),
            };
        }
    }
    ImageSource::Url { url: url.into() }
}

fn assistant_blocks(c: Option<&MessageContent>, calls: Option<&Value>) -> Vec<ContentBlock> {
    let mut out = Vec::new();
    let text = content_text(c);
    if !text.is_empty() {
        out.push(ContentBlock::Text { text });
    }
    for call in calls.and_then(Value::as_array).into_iter().flatten() {
        let (id, name, args) = read_tool_call(call);
        out.push(ContentBlock::ToolUse {
            id,
            name,
            input: arguments_object(&args),
        });
    }
    out
}

fn messages_tools(tools: &Value) -> Result<Vec<Tool>, TranslateError> {
    let list = tools
        .as_array()
        .ok_or_else(|| TranslateError::new("tools", "`tools` must be a list."))?;
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let f = t.get("function").ok_or_else(|| {
                TranslateError::new(format!("tools[{i}]"), "Only function tools are supported.")
            })?;
            Ok(Tool {
                name: f
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .into(),
                description: f
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                input_schema: f
                    .get("parameters")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            })
        })
        .collect()
}

fn messages_tool_choice(c: &Value, parallel_off: bool) -> Result<ToolChoice, TranslateError> {
    let disable = parallel_off.then_some(true);
    match c {
        Value::String(s) if s == "auto" => Ok(ToolChoice::Auto {
            disable_parallel_tool_use: disable,
        }),
        Value::String(s) if s == "required" => Ok(ToolChoice::Any {
            disable_parallel_tool_use: disable,
        }),
        Value::String(s) if s == "none" => Ok(ToolChoice::None),
        Value::Object(o) => match o
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
        {
            Some(name) => Ok(ToolChoice::Tool {
                name: name.into(),
                disable_parallel_tool_use: disable,
            }),
            None => Err(TranslateError::new(
                "tool_choice",
                "A named `tool_choice` needs `function.name`.",
            )),
        },
        _ => Err(TranslateError::new(
            "tool_choice",
            "`tool_choice` must be \"auto\", \"required\", \"none\" or a named function.",
        )),
    }
}

/// The chat answer for a Messages answer: text blocks joined as `content`, `tool_use`
/// blocks as `tool_calls`, thinking as vLLM's `reasoning_content`.
pub fn messages_to_chat_response(m: &MessagesResponse, created: u64) -> ChatCompletionResponse {
    let mut text = String::new();
    let mut thinking = String::new();
    let mut calls = Vec::new();
    for b in &m.content {
        match b {
            ContentBlock::Text { text: t } => text.push_str(t),
            ContentBlock::Thinking { thinking: t, .. } => thinking.push_str(t),
            ContentBlock::ToolUse { id, name, input } => {
                let args = serde_json::to_string(input).unwrap_or_else(|_| "{}".into());
                calls.push(chat_tool_call(id, name, &args));
            }
            _ => {}
        }
    }
    let (finish, matched) = finish_of(m.stop_reason, m.stop_sequence.as_deref());
    let message = ResponseMessage {
        role: Role::Assistant,
        content: (!text.is_empty() || calls.is_empty()).then_some(text),
        refusal: None,
        tool_calls: (!calls.is_empty()).then_some(calls),
        reasoning_content: (!thinking.is_empty()).then_some(thinking),
    };
    let choice = ChatChoice {
        index: 0,
        message,
        logprobs: None,
        finish_reason: Some(finish),
        stop_reason: matched,
    };
    let mut out = ChatCompletionResponse::new(
        m.id.clone(),
        created,
        m.model.clone(),
        vec![choice],
        strata_api::Usage::new(
            u32::try_from(m.usage.input_tokens).unwrap_or(u32::MAX),
            u32::try_from(m.usage.output_tokens).unwrap_or(u32::MAX),
        ),
    );
    out.object = OBJECT_CHAT_COMPLETION.into();
    out
}

/// Chat's finish reason (and vLLM's `stop_reason`) for a Messages stop reason.
pub(crate) fn finish_of(
    stop: Option<StopReason>,
    sequence: Option<&str>,
) -> (FinishReason, Option<ChatStop>) {
    match stop {
        Some(StopReason::MaxTokens) => (FinishReason::Length, None),
        Some(StopReason::ToolUse) => (FinishReason::ToolCalls, None),
        Some(StopReason::Refusal) => (FinishReason::ContentFilter, None),
        Some(StopReason::StopSequence) => (
            FinishReason::Stop,
            sequence.map(|s| ChatStop::Text(s.into())),
        ),
        _ => (FinishReason::Stop, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::{chat_to_messages, messages_to_chat};

    #[test]
    fn a_chat_conversation_becomes_a_messages_request_and_back() {
        let chat: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "claude", "max_tokens": 20, "stop": "END", "parallel_tool_calls": false,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        }))
        .unwrap();
        let m = chat_to_messages_request(&chat, 1024).unwrap();
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            json!({
                "model": "claude", "max_tokens": 20, "system": "be brief", "stop_sequences": ["END"],
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "2"}]}
                ],
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}
            })
        );
        // And back: the same conversation in chat terms.
        let back = serde_json::to_value(messages_to_chat(&m).unwrap()).unwrap();
        assert_eq!(
            back["messages"][2]["tool_calls"][0]["function"]["arguments"],
            "{\"x\":1}"
        );
        assert_eq!(
            back["messages"][3],
            json!({"role": "tool", "content": "2", "tool_call_id": "c1"})
        );
        assert_eq!(back["tool_choice"], "required");
    }

    #[test]
    fn unknown_roles_and_parts_are_refused() {
        let bad_role: ChatCompletionRequest =
            serde_json::from_value(json!({"messages": [{"role": "narrator", "content": "x"}]}))
                .unwrap();
        assert_eq!(
            chat_to_messages_request(&bad_role, 8).unwrap_err().param,
            "messages[0].role"
        );
        let audio: ChatCompletionRequest = serde_json::from_value(json!({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})).unwrap();
        assert_eq!(
            chat_to_messages_request(&audio, 8).unwrap_err().param,
            "messages[0].content[0]"
        );
    }

    #[test]
    fn a_messages_answer_round_trips_through_chat() {
        let m: MessagesResponse = serde_json::from_value(json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
            "content": [{"type": "text", "text": "Let me look."}, {"type": "tool_use", "id": "tu", "name": "f", "input": {"q": "a"}}],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 11, "output_tokens": 6}
        }))
        .unwrap();
        let chat = messages_to_chat_response(&m, 5);
        assert_eq!(chat.choices[0].finish_reason, Some(FinishReason::ToolCalls));
        assert_eq!(chat.usage.prompt_tokens, 11);
        assert_eq!(chat_to_messages(&chat, &[], "msg_1"), m);
    }
}
