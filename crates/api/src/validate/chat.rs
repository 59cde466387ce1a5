//! Chat requests (and the chat form of `/tokenize`) into typed values.

use serde::Serialize;
use serde_json::Value;

use super::sampling::{chat_logprobs, SamplingParams};
use super::shared::SharedChecks;
use crate::error::ApiError;
use crate::types::{
    ChatCompletionRequest, ContentPart, MessageContent, RequestMessage, Role, TokenizeRequest,
};

/// A checked chat message: known role, text content. Serializes as `{"role", "content"}`,
/// the shape chat templates expect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// Its text. Array content has its text parts joined with `"\n"` (as vLLM does for
    /// string-content chat templates); an assistant message with `null` content (tool
    /// calls only) has `""`.
    pub content: String,
}

impl ChatMessage {
    /// A message from parts.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: content.into(),
        }
    }
}

/// A checked `/v1/chat/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedChat {
    /// Requested model; `None` means "the default model" (vLLM allows omitting it). The
    /// server checks it against what it serves.
    pub model: Option<String>,
    /// At least one message.
    pub messages: Vec<ChatMessage>,
    /// Sampling and output controls.
    pub sampling: SamplingParams,
    /// Stream Server-Sent Events.
    pub stream: bool,
    /// Streaming only: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Streaming only: put running usage in every chunk.
    pub continuous_usage_stats: bool,
    /// Append the assistant header after the messages. Default true, or false when
    /// `continue_final_message` is set and this was not sent.
    pub add_generation_prompt: bool,
    /// Leave the final message open for the model to continue. Default false.
    pub continue_final_message: bool,
    /// Add special tokens (BOS) on top of the template. Default false.
    pub add_special_tokens: bool,
    /// vLLM's chat `echo`: prefix the output with the last message when it is the
    /// assistant's. Default false.
    pub echo: bool,
    /// Tool definitions for the chat template (an array), if sent.
    pub tools: Option<Value>,
    /// Extra chat-template variables (an object), if sent.
    pub chat_template_kwargs: Option<Value>,
    /// End-user id, for logs.
    pub user: Option<String>,
}

/// Checks a chat request: messages, sampling, streaming flags and unsupported features.
///
/// Errors name the offending field (`messages[2].role`, `top_p`, `stream_options`, ...).
pub fn validate_chat(mut req: ChatCompletionRequest) -> Result<ValidatedChat, ApiError> {
    let fields = req.take_sampling_fields();
    let messages = validate_messages(req.messages)?;
    let shared = SharedChecks::output(fields)?;
    let (add_generation_prompt, continue_final_message) =
        generation_prompt_flags(req.add_generation_prompt, req.continue_final_message)?;
    if let Some(tools) = &req.tools {
        if !tools.is_array() && !tools.is_null() {
            return Err(ApiError::invalid(
                "tools",
                "tools must be an array of tool definitions.",
            ));
        }
    }
    if let Some(kwargs) = &req.chat_template_kwargs {
        if !kwargs.is_object() {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                "chat_template_kwargs must be an object.",
            ));
        }
    }
    let shared = shared.sampling(chat_logprobs(req.logprobs, req.top_logprobs)?)?;

    Ok(ValidatedChat {
        model: req.model,
        messages,
        sampling: shared.sampling,
        stream: shared.stream,
        include_usage: shared.include_usage,
        continuous_usage_stats: shared.continuous_usage_stats,
        add_generation_prompt,
        continue_final_message,
        add_special_tokens: req.add_special_tokens.unwrap_or(false),
        echo: req.echo.unwrap_or(false),
        tools: req.tools.filter(|t| !t.is_null()),
        chat_template_kwargs: req.chat_template_kwargs,
        user: shared.user,
    })
}

/// Resolves `add_generation_prompt` and `continue_final_message`, which contradict each
/// other. Unlike vLLM, sending only `continue_final_message: true` is enough: the default
/// of `add_generation_prompt` then becomes false.
fn generation_prompt_flags(
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
) -> Result<(bool, bool), ApiError> {
    let cont = continue_final_message.unwrap_or(false);
    match add_generation_prompt {
        Some(true) if cont => Err(ApiError::invalid(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true.",
        )),
        Some(add) => Ok((add, cont)),
        None => Ok((!cont, cont)),
    }
}

/// Checks every message: known role, text-only content, content present unless the
/// message is the assistant's.
pub fn validate_messages(messages: Vec<RequestMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages must contain at least one message.",
        ));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| validate_message(i, m))
        .collect()
}

fn validate_message(i: usize, message: RequestMessage) -> Result<ChatMessage, ApiError> {
    let role = Role::from_name(&message.role).ok_or_else(|| {
        ApiError::invalid(
            format!("messages[{i}].role"),
            format!(
                "Unknown role {:?} in messages[{i}]; expected one of system, developer, user, assistant, tool.",
                message.role
            ),
        )
    })?;
    let content = match message.content {
        Some(MessageContent::Text(text)) => text,
        Some(MessageContent::Parts(parts)) => join_text_parts(i, parts)?,
        None if role == Role::Assistant => String::new(),
        None => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                format!(
                    "messages[{i}].content is required for role '{}'.",
                    role.as_str()
                ),
            ))
        }
    };
    Ok(ChatMessage { role, content })
}

fn join_text_parts(i: usize, parts: Vec<ContentPart>) -> Result<String, ApiError> {
    let param = || format!("messages[{i}].content");
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.into_iter().enumerate() {
        if part.kind != "text" {
            return Err(ApiError::invalid(
                param(),
                format!(
                    "messages[{i}].content[{j}] has type '{}', but this model accepts text only.",
                    part.kind
                ),
            ));
        }
        match part.text {
            Some(text) => texts.push(text),
            None => {
                return Err(ApiError::invalid(
                    param(),
                    format!("messages[{i}].content[{j}] is a text part without 'text'."),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// What `/tokenize` should tokenize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeInput {
    /// Plain text (may be empty: it tokenizes to nothing, or just BOS).
    Prompt(String),
    /// Messages to render with the chat template first.
    Chat {
        /// At least one message.
        messages: Vec<ChatMessage>,
        /// Append the assistant header.
        add_generation_prompt: bool,
        /// Leave the final message open.
        continue_final_message: bool,
    },
}

/// A checked `/tokenize` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatedTokenize {
    /// Requested model, if named.
    pub model: Option<String>,
    /// Text or messages.
    pub input: TokenizeInput,
    /// Add BOS etc.; defaults to true for a prompt, false for messages (vLLM's defaults).
    pub add_special_tokens: bool,
    /// Also return each token's text.
    pub return_token_strs: bool,
}

/// Checks a `/tokenize` request: exactly one of `prompt` and `messages`.
pub fn validate_tokenize(req: TokenizeRequest) -> Result<ValidatedTokenize, ApiError> {
    let (input, default_special) = match (req.prompt, req.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "Send either 'prompt' or 'messages', not both.",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "Either 'prompt' or 'messages' is required.",
            ))
        }
        (Some(prompt), None) => (TokenizeInput::Prompt(prompt), true),
        (None, Some(messages)) => {
            let messages = validate_messages(messages)?;
            let (add_generation_prompt, continue_final_message) =
                generation_prompt_flags(req.add_generation_prompt, req.continue_final_message)?;
            (
                TokenizeInput::Chat {
                    messages,
                    add_generation_prompt,
                    continue_final_message,
                },
                false,
            )
        }
    };
    Ok(ValidatedTokenize {
        model: req.model,
        input,
        add_special_tokens: req.add_special_tokens.unwrap_or(default_special),
        return_token_strs: req.return_token_strs.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_prompt_flag_resolution() {
        assert_eq!(generation_prompt_flags(None, None).unwrap(), (true, false));
        assert_eq!(
            generation_prompt_flags(None, Some(true)).unwrap(),
            (false, true)
        );
        assert_eq!(
            generation_prompt_flags(Some(false), Some(true)).unwrap(),
            (false, true)
        );
        assert_eq!(
            generation_prompt_flags(Some(false), None).unwrap(),
            (false, false)
        );
        let err = generation_prompt_flags(Some(true), Some(true)).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("continue_final_message"));
    }

    #[test]
    fn chat_message_serializes_for_templates() {
        let m = ChatMessage::new(Role::User, "hi");
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            serde_json::json!({"role": "user", "content": "hi"})
        );
    }
}
