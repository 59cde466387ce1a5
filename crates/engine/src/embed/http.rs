//! The edge of an engine serving an encoder: bodies read within their limit, the model
//! name checked, answers and errors as JSON, and `/v1/embeddings`-style inputs as checked
//! token ids (what `/classify` takes too).

use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use strata_api::validate::{EmbeddingInput, Truncation, ValidatedEmbeddings};
use strata_api::ApiError;

use super::state::EmbedState;

pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(super) fn error_response(e: ApiError) -> Response {
    strata_api::http::error_response(&e, None)
}

pub(super) fn json_response<T: serde::Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => error_response(ApiError::internal(format!(
            "cannot encode the response: {e}"
        ))),
    }
}

pub(super) async fn read_body(state: &EmbedState, req: Request) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(req.into_body(), state.max_body_bytes)
        .await
        .map_err(|_| ApiError::body_too_large(state.max_body_bytes))
}

pub(super) fn check_model(state: &EmbedState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None => Ok(()),
        Some(m) if m == state.model_name => Ok(()),
        Some(m) => Err(ApiError::model_not_found(m)),
    }
}

/// Each input as checked token ids: tokenized, held to the length limit (or truncated when
/// asked), and within the vocabulary.
pub(super) fn token_inputs(
    state: &EmbedState,
    v: &ValidatedEmbeddings,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let limit = match v.truncation {
        Truncation::Refuse => None,
        Truncation::ModelLimit => Some(state.max_len),
        Truncation::Tokens(k) if k <= state.max_len => Some(k),
        Truncation::Tokens(k) => {
            return Err(ApiError::invalid(
                "truncate_prompt_tokens",
                format!(
                    "truncate_prompt_tokens ({k}) is larger than the model's maximum input \
                     length ({}).",
                    state.max_len
                ),
            ))
        }
    };
    let single = v.inputs.len() == 1;
    let param = |i: usize| {
        if single {
            "input".to_string()
        } else {
            format!("input[{i}]")
        }
    };
    let mut out = Vec::with_capacity(v.inputs.len());
    for (i, input) in v.inputs.iter().enumerate() {
        let mut ids = match input {
            EmbeddingInput::Text(text) => state
                .tokenizer
                .encode(text, v.add_special_tokens, limit)
                .map_err(|e| ApiError::invalid(param(i), format!("Cannot tokenize: {e}")))?,
            EmbeddingInput::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= state.vocab_size) {
                    return Err(ApiError::invalid(
                        param(i),
                        format!(
                            "Token id {bad} is out of vocabulary (size {}).",
                            state.vocab_size
                        ),
                    ));
                }
                let mut ids = ids.clone();
                if let Some(k) = limit {
                    ids.truncate(k);
                }
                ids
            }
        };
        if ids.is_empty() {
            // Text that tokenizes to nothing without special tokens (e.g. only spaces).
            return Err(ApiError::invalid(
                param(i),
                "The input has no tokens to embed.",
            ));
        }
        if ids.len() > state.max_len {
            return Err(ApiError::invalid(
                param(i),
                format!(
                    "This model's maximum input length is {} tokens. However, input {i} has \
                     {} tokens. Please shorten it, or set truncate_prompt_tokens to cut it.",
                    state.max_len,
                    ids.len()
                ),
            ));
        }
        ids.shrink_to_fit();
        out.push(ids);
    }
    Ok(out)
}
