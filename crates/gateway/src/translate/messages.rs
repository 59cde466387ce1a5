//! Serving the Messages API on a chat model: a Messages request as a chat request, and a
//! chat answer as a Messages answer.

use serde_json::{json, Value};
use strata_api::anthropic::{
    Content, ContentBlock, Message, MessageRole, MessagesRequest, MessagesResponse, MessagesUsage,
    OutputFormat, StopReason, Tool, ToolChoice, ToolResultContent, OBJECT_MESSAGE,
};
use strata_api::types::chat::{ContentPart, MessageContent};
use strata_api::types::{FinishReason, ResponseFormat, StreamOptions};
use strata_api::{
    ChatCompletionRequest, ChatCompletionResponse, RequestMessage, Role, StopReason as ChatStop,
};

use super::{arguments_object, chat_tool_call, read_tool_call, TranslateError};

/// The chat request that asks what `req` asks. A streamed request asks for the usage
/// chunk (`stream_options.include_usage`), which the Messages stream reports.
pub fn messages_to_chat(req: &MessagesRequest) -> Result<ChatCompletionRequest, TranslateError> {
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    if let Some(system) = &req.system {
        messages.push(RequestMessage::new(Role::System, system.text()));
    }
    for (i, m) in req.messages.iter().enumerate() {
        push_message(&mut messages, m, i)?;
    }
    let stream = req.stream.unwrap_or(false);
    let mut chat = ChatCompletionRequest {
        model: Some(req.model.clone()),
        messages,
        max_tokens: Some(
            i64::try_from(req.max_tokens)
                .map_err(|_| TranslateError::new("max_tokens", "`max_tokens` is too large."))?,
        ),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req
            .stop_sequences
            .clone()
            .filter(|s| !s.is_empty())
            .map(strata_api::types::Stop::Many),
        user: req
            .metadata
            .as_ref()
            .and_then(|m| m.get("user_id"))
            .and_then(Value::as_str)
            .map(str::to_string),
        ..Default::default()
    };
    if stream {
        chat.stream = Some(true);
        chat.stream_options = Some(StreamOptions {
            include_usage: Some(true),
            continuous_usage_stats: None,
        });
    }
    if let Some(tools) = &req.tools {
        if !tools.is_empty() {
            chat.tools = Some(Value::Array(tools.iter().map(chat_tool).collect()));
        }
    }
    if let Some(OutputFormat::JsonSchema { schema }) =
        req.output_config.as_ref().and_then(|o| o.format.as_ref())
    {
        chat.response_format = Some(ResponseFormat {
            kind: "json_schema".into(),
            json_schema: Some(json!({"name": "output", "schema": schema})),
        });
    }
    if let Some(choice) = &req.tool_choice {
        let (value, parallel) = chat_tool_choice(choice);
        chat.tool_choice = Some(value);
        if parallel == Some(true) {
            chat.parallel_tool_calls = Some(false);
        }
    }
    Ok(chat)
}

/// A Messages tool as a chat function tool.
fn chat_tool(t: &Tool) -> Value {
    let mut f = json!({"name": t.name, "parameters": t.input_schema});
    if let Some(d) = &t.description {
        f["description"] = Value::String(d.clone());
    }
    json!({"type": "function", "function": f})
}

/// Chat's `tool_choice`, and whether parallel calls are disabled.
fn chat_tool_choice(c: &ToolChoice) -> (Value, Option<bool>) {
    match c {
        ToolChoice::Auto {
            disable_parallel_tool_use,
        } => (json!("auto"), *disable_parallel_tool_use),
        ToolChoice::Any {
            disable_parallel_tool_use,
        } => (json!("required"), *disable_parallel_tool_use),
        ToolChoice::Tool {
            name,
            disable_parallel_tool_use,
        } => (
            json!({"type": "function", "function": {"name": name}}),
            *disable_parallel_tool_use,
        ),
        ToolChoice::None => (json!("none"), None),
    }
}

/// Appends message `i` as chat messages: a user message's `tool_result` blocks become
/// `tool` messages (before its other content), an assistant's `tool_use` blocks its
/// `tool_calls`.
fn push_message(
    out: &mut Vec<RequestMessage>,
    m: &Message,
    i: usize,
) -> Result<(), TranslateError> {
    let blocks = match &m.content {
        Content::Text(t) => {
            let role = match m.role {
                MessageRole::User => Role::User,
                MessageRole::Assistant => Role::Assistant,
            };
            out.push(RequestMessage::new(role, t.clone()));
            return Ok(());
        }
        Content::Blocks(b) => b,
    };
    match m.role {
        MessageRole::User => push_user_blocks(out, blocks, i),
        MessageRole::Assistant => {
            out.push(assistant_message(blocks, i)?);
            Ok(())
        }
    }
}

fn push_user_blocks(
    out: &mut Vec<RequestMessage>,
    blocks: &[ContentBlock],
    i: usize,
) -> Result<(), TranslateError> {
    let mut parts = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        match b {
            ContentBlock::Text { text } => parts.push(ContentPart::text(text.clone())),
            ContentBlock::Image { source } => parts.push(image_part(source.to_url())),
            ContentBlock::ToolResult {
                tool_use_id,
                content,
                is_error,
            } => {
                let mut text = content.as_ref().map(tool_result_text).unwrap_or_default();
                if *is_error == Some(true) {
                    text = format!("Error: {text}");
                }
                out.push(RequestMessage {
                    role: Role::Tool.as_str().into(),
                    content: Some(MessageContent::Text(text)),
                    name: None,
                    tool_calls: None,
                    tool_call_id: Some(tool_use_id.clone()),
                });
            }
            ContentBlock::ToolUse { .. } => {
                return Err(TranslateError::new(
                    format!("messages[{i}].content[{j}]"),
                    "`tool_use` blocks belong to assistant messages.",
                ))
            }
            ContentBlock::Thinking { .. } | ContentBlock::RedactedThinking { .. } => {}
        }
    }
    if !parts.is_empty() {
        let content = match parts.as_slice() {
            [p] if p.kind == "text" => MessageContent::Text(p.text.clone().unwrap_or_default()),
            _ => MessageContent::Parts(parts),
        };
        out.push(RequestMessage {
            role: Role::User.as_str().into(),
            content: Some(content),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        });
    }
    Ok(())
}

fn image_part(url: String) -> ContentPart {
    let mut p = ContentPart::text("");
    p.kind = "image_url".into();
    p.text = None;
    p.image_url = Some(json!({ "url": url }));
    p
}

/// A tool result's text (text blocks joined; other blocks are not text).
fn tool_result_text(c: &ToolResultContent) -> String {
    match c {
        ToolResultContent::Text(t) => t.clone(),
        ToolResultContent::Blocks(b) => b
            .iter()
            .filter_map(|b| match b {
                ContentBlock::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

fn assistant_message(blocks: &[ContentBlock], i: usize) -> Result<RequestMessage, TranslateError> {
    let mut text = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        match b {
            ContentBlock::Text { text: t } => text.push_str(t),
            ContentBlock::ToolUse { id, name, input } => {
                let args = serde_json::to_string(input).unwrap_or_else(|_| "{}".into());
                calls.push(chat_tool_call(id, name, &args));
            }
            ContentBlock::Thinking { .. } | ContentBlock::RedactedThinking { .. } => {}
            ContentBlock::Image { .. } | ContentBlock::ToolResult { .. } => {
                return Err(TranslateError::new(
                    format!("messages[{i}].content[{j}]"),
                    "Assistant messages carry only `text`, `tool_use` and thinking blocks.",
                ))
            }
        }
    }
    Ok(RequestMessage {
        role: Role::Assistant.as_str().into(),
        content: (!text.is_empty() || calls.is_empty()).then_some(MessageContent::Text(text)),
        name: None,
        tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
        tool_call_id: None,
    })
}

/// The Messages stop reason (and matched stop sequence) of a chat choice's finish.
/// `stop_sequences` are the request's: a `stop` whose vLLM `stop_reason` is one of them
/// is `stop_sequence`.
pub fn stop_reason_of(
    finish: Option<FinishReason>,
    matched: Option<&ChatStop>,
    stop_sequences: &[String],
) -> (StopReason, Option<String>) {
    match finish {
        Some(FinishReason::Length) => (StopReason::MaxTokens, None),
        Some(FinishReason::ToolCalls) | Some(FinishReason::FunctionCall) => {
            (StopReason::ToolUse, None)
        }
        Some(FinishReason::ContentFilter) => (StopReason::Refusal, None),
        _ => match matched {
            Some(ChatStop::Text(s)) if stop_sequences.iter().any(|x| x == s) => {
                (StopReason::StopSequence, Some(s.clone()))
            }
            _ => (StopReason::EndTurn, None),
        },
    }
}

/// The Messages answer for a chat answer (its first choice). `id` is the message id the
/// client sees.
pub fn chat_to_messages(
    chat: &ChatCompletionResponse,
    stop_sequences: &[String],
    id: &str,
) -> MessagesResponse {
    let mut content = Vec::new();
    let (mut stop_reason, mut stop_sequence) = (StopReason::EndTurn, None);
    if let Some(choice) = chat.choices.first() {
        if let Some(t) = choice.message.content.as_deref().filter(|t| !t.is_empty()) {
            content.push(ContentBlock::Text { text: t.into() });
        }
        for call in choice.message.tool_calls.iter().flatten() {
            let (id, name, args) = read_tool_call(call);
            content.push(ContentBlock::ToolUse {
                id,
                name,
                input: arguments_object(&args),
            });
        }
        (stop_reason, stop_sequence) = stop_reason_of(
            choice.finish_reason,
            choice.stop_reason.as_ref(),
            stop_sequences,
        );
        // A model that called tools but said `stop` still handed over its turn.
        if choice
            .message
            .tool_calls
            .as_ref()
            .is_some_and(|c| !c.is_empty())
            && stop_reason == StopReason::EndTurn
        {
            stop_reason = StopReason::ToolUse;
        }
    }
    if content.is_empty() {
        content.push(ContentBlock::Text {
            text: String::new(),
        });
    }
    MessagesResponse {
        id: id.to_string(),
        kind: OBJECT_MESSAGE.into(),
        role: MessageRole::Assistant,
        content,
        model: chat.model.clone(),
        stop_reason: Some(stop_reason),
        stop_sequence,
        usage: MessagesUsage {
            input_tokens: chat.usage.prompt_tokens.into(),
            output_tokens: chat.usage.completion_tokens.into(),
            cache_creation_input_tokens: None,
            cache_read_input_tokens: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn system_blocks_tools_and_results_become_chat_messages() {
        let r = req(json!({
            "model": "m", "max_tokens": 32, "stop_sequences": ["END"], "stream": true,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "tu_1", "name": "get", "input": {"city": "Paris"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "tu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "thanks"}
                ]}
            ],
            "tools": [{"name": "get", "description": "weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get", "disable_parallel_tool_use": true},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}
        }));
        let chat = serde_json::to_value(messages_to_chat(&r).unwrap()).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "a\n\nb"},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "checking", "tool_calls": [
                    {"id": "tu_1", "type": "function", "function": {"name": "get", "arguments": "{\"city\":\"Paris\"}"}}
                ]},
                {"role": "tool", "content": "sunny", "tool_call_id": "tu_1"},
                {"role": "user", "content": "thanks"}
            ])
        );
        assert_eq!(chat["max_tokens"], 32);
        assert_eq!(chat["stop"], json!(["END"]));
        assert_eq!(chat["stream_options"]["include_usage"], true);
        assert_eq!(
            chat["tools"][0],
            json!({"type": "function", "function": {"name": "get", "description": "weather", "parameters": {"type": "object"}}})
        );
        assert_eq!(
            chat["tool_choice"],
            json!({"type": "function", "function": {"name": "get"}})
        );
        assert_eq!(chat["parallel_tool_calls"], false);
        assert_eq!(
            chat["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}})
        );
    }

    #[test]
    fn a_tool_use_block_from_the_user_is_refused() {
        let r = req(json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}
        ]}));
        let e = messages_to_chat(&r).unwrap_err();
        assert_eq!(e.param, "messages[0].content[0]");
    }

    fn chat_answer(message: Value, finish: &str, stop_reason: Value) -> ChatCompletionResponse {
        serde_json::from_value(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        }))
        .unwrap()
    }

    #[test]
    fn stop_reasons_map_as_anthropic_names_them() {
        let msg = json!({"role": "assistant", "content": "hi"});
        let stop = |finish, sr: Value, seqs: &[String]| {
            let m = chat_to_messages(&chat_answer(msg.clone(), finish, sr), seqs, "msg_1");
            (m.stop_reason.unwrap(), m.stop_sequence)
        };
        assert_eq!(stop("stop", Value::Null, &[]), (StopReason::EndTurn, None));
        assert_eq!(
            stop("length", Value::Null, &[]),
            (StopReason::MaxTokens, None)
        );
        let seqs = vec!["END".to_string()];
        assert_eq!(
            stop("stop", json!("END"), &seqs),
            (StopReason::StopSequence, Some("END".into()))
        );
        // An EOS token id is not a stop sequence.
        assert_eq!(stop("stop", json!(2), &seqs), (StopReason::EndTurn, None));
    }

    #[test]
    fn tool_calls_become_tool_use_blocks() {
        let msg = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Paris\"}"}}
        ]});
        let m = chat_to_messages(&chat_answer(msg, "tool_calls", Value::Null), &[], "msg_1");
        assert_eq!(m.stop_reason, Some(StopReason::ToolUse));
        assert_eq!(
            serde_json::to_value(&m.content).unwrap(),
            json!([{"type": "tool_use", "id": "call_1", "name": "get", "input": {"city": "Paris"}}])
        );
        assert_eq!(m.usage.input_tokens, 7);
        assert_eq!(m.usage.output_tokens, 3);
    }
}
