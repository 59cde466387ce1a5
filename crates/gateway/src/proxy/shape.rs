//! The request and answer bodies as the gateway reads them: the route's shape check (one
//! parse), prompt size, the prompt text for the embedded routers' prefix index, and the
//! `usage` of an answer.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use strata_api::types::{ChatCompletionRequest, CompletionRequest, EmbeddingRequest};
use strata_api::{parse_json, ApiError};

use super::route::Route;

/// Total characters of prompt text (messages' contents, `prompt`, `input`).
pub(crate) fn prompt_chars(body: &Value) -> usize {
    fn text_len(v: &Value) -> usize {
        match v {
            Value::String(s) => s.chars().count(),
            Value::Array(items) => items.iter().map(text_len).sum(),
            Value::Object(o) => o.get("text").map_or(0, text_len),
            _ => 0,
        }
    }
    let mut n = 0;
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        n += msgs
            .iter()
            .map(|m| m.get("content").map_or(0, text_len))
            .sum::<usize>();
    }
    n += body.get("prompt").map_or(0, text_len);
    n += body.get("input").map_or(0, text_len);
    n
}

/// The prompt as one text (role and content of each message, or the prompt), the key
/// of the embedded routers' approximate prefix index.
pub(crate) fn prompt_prefix_text(body: &Value) -> String {
    fn push_text(out: &mut String, v: &Value) {
        match v {
            Value::String(s) => out.push_str(s),
            Value::Array(items) => items.iter().for_each(|i| push_text(out, i)),
            Value::Object(o) => {
                if let Some(t) = o.get("text") {
                    push_text(out, t);
                }
            }
            _ => {}
        }
    }
    let mut out = String::new();
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        for m in msgs {
            if let Some(role) = m.get("role").and_then(Value::as_str) {
                out.push_str(role);
            }
            out.push('\n');
            if let Some(c) = m.get("content") {
                push_text(&mut out, c);
            }
            out.push('\n');
        }
    }
    for field in ["prompt", "input"] {
        if let Some(p) = body.get(field) {
            push_text(&mut out, p);
        }
    }
    out
}

/// The body checked against the route's request type, parsed once. On failure the
/// error is the one [`parse_json`] gives (it names the faulty field).
pub(crate) fn check_shape(route: Route, bytes: &[u8]) -> Result<Value, ApiError> {
    fn typed<T: DeserializeOwned>(value: &Value, bytes: &[u8]) -> Result<T, ApiError> {
        T::deserialize(value).map_err(|e| {
            parse_json::<T>(bytes)
                .err()
                .unwrap_or_else(|| ApiError::invalid_no_param(format!("Invalid request body: {e}")))
        })
    }
    let value: Value = match serde_json::from_slice(bytes) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            let err = match route {
                Route::Chat => parse_json::<ChatCompletionRequest>(bytes).err(),
                Route::Completions => parse_json::<CompletionRequest>(bytes).err(),
                Route::Embeddings => parse_json::<EmbeddingRequest>(bytes).err(),
            };
            return Err(err.unwrap_or_else(|| {
                ApiError::invalid_no_param("Request body must be a JSON object.")
            }));
        }
    };
    match route {
        Route::Chat => {
            let r: ChatCompletionRequest = typed(&value, bytes)?;
            if r.messages.is_empty() {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` must not be empty.",
                ));
            }
        }
        Route::Completions => {
            typed::<CompletionRequest>(&value, bytes)?;
        }
        Route::Embeddings => {
            typed::<EmbeddingRequest>(&value, bytes)?;
        }
    }
    Ok(value)
}

/// The token counts of an answer's (or a stream chunk's) `usage`, read without building
/// the rest of the document: other fields are skipped, not kept.
#[derive(Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<UsageCounts>,
}

#[derive(Deserialize)]
struct UsageCounts {
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

/// `(prompt_tokens, completion_tokens)` of an answer; `None` when it is not JSON or has
/// no usable `usage` (then the estimate is charged).
pub(crate) fn usage_from_json(bytes: &[u8]) -> Option<(u64, u64)> {
    let u = serde_json::from_slice::<UsageOnly>(bytes).ok()?.usage?;
    Some((u.prompt_tokens, u.completion_tokens.unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_chars_counts_text_fields() {
        let v = serde_json::json!({"messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "de"}]}]});
        assert_eq!(prompt_chars(&v), 5);
        assert_eq!(prompt_chars(&serde_json::json!({"prompt": ["ab", "c"]})), 3);
    }
}
