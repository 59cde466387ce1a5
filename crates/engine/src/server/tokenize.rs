//! `POST /tokenize` and `POST /detokenize` (vLLM's), and the chat-template rendering they
//! share with chat completions, so a client can count a conversation's tokens exactly as
//! the engine will.

use std::sync::Arc;

use axum::extract::{Request, State};
use strata_api::types::{DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse};
use strata_api::validate::{
    parse_json, validate_tokenize, ChatMessage as ApiMessage, TokenizeInput,
};
use strata_api::ApiError;

use super::generate::token_text;
use super::http::{json_response, read_body, ApiResult};
use super::state::AppState;
use crate::chat_template::{ChatMessage, RenderExtras};

/// The conversation through the model's chat template; a template error is a 400 on
/// `messages`.
pub(super) fn render_chat(
    state: &AppState,
    messages: &[ApiMessage],
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    let messages: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage::new(m.role.as_str(), m.content.clone()))
        .collect();
    render_messages(
        state,
        &messages,
        add_generation_prompt,
        &RenderExtras::default(),
    )
}

/// Messages (with their tool fields) through the chat template, with the request's
/// tools and `chat_template_kwargs`; a template error is a 400 on `messages`.
pub(super) fn render_messages(
    state: &AppState,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    extras: &RenderExtras,
) -> Result<String, ApiError> {
    state
        .template
        .render_with(messages, add_generation_prompt, extras)
        .map_err(|e| ApiError::invalid("messages", format!("Chat template error: {e}")))
}

pub(super) async fn tokenize(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let (_, body) = read_body(&state, req).await?;
    let parsed: TokenizeRequest = parse_json(&body)?;
    let t = validate_tokenize(parsed)?;
    state.check_model(t.model.as_deref())?;
    let (text, parse_special) = match &t.input {
        TokenizeInput::Prompt(p) => (p.clone(), false),
        TokenizeInput::Chat {
            messages,
            add_generation_prompt,
            ..
        } => (render_chat(&state, messages, *add_generation_prompt)?, true),
    };
    let tokens = state
        .tokenizer
        .encode(&text, t.add_special_tokens, parse_special)
        .map_err(|e| ApiError::invalid("prompt", format!("Cannot tokenize: {e}")))?;
    let mut resp = TokenizeResponse::new(tokens, state.max_model_len);
    if t.return_token_strs {
        resp.token_strs = Some(
            resp.tokens
                .iter()
                .map(|&id| token_text(&state.tokenizer, id))
                .collect(),
        );
    }
    Ok(json_response(&resp))
}

pub(super) async fn detokenize(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let (_, body) = read_body(&state, req).await?;
    let parsed: DetokenizeRequest = parse_json(&body)?;
    state.check_model(parsed.model.as_deref())?;
    state.check_token_ids(&parsed.tokens, "tokens")?;
    let prompt = state
        .tokenizer
        .decode(&parsed.tokens, false)
        .map_err(|e| ApiError::invalid("tokens", format!("Cannot detokenize: {e}")))?;
    Ok(json_response(&DetokenizeResponse { prompt }))
}
