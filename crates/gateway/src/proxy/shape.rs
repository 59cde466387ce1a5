//! The request and answer bodies as the gateway reads them: the route's shape check (one
//! parse), prompt size, the prompt text for the embedded routers' prefix index, and the
//! `usage` of an answer.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use strata_api::types::{ChatCompletionRequest, CompletionRequest, EmbeddingRequest};
use strata_api::{parse_json, ApiError};

use super::route::Route;

/// The fields besides `messages` whose text is prompt: OpenAI's `prompt` and `input`,
/// vLLM's rerank (`query`, `documents`) and score (`text_1`, `text_2`, `data_1`, `data_2`).
const PROMPT_FIELDS: [&str; 8] = [
    "prompt",
    "input",
    "query",
    "documents",
    "text_1",
    "text_2",
    "data_1",
    "data_2",
];

/// The messages of a body: `messages`, or each conversation of a batch (a list of lists).
fn each_message(body: &Value) -> impl Iterator<Item = &Value> {
    body.get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .flat_map(|m| match m {
            Value::Array(conv) => conv.iter().collect::<Vec<_>>(),
            other => vec![other],
        })
}

/// Total characters of prompt text (messages' contents and [`PROMPT_FIELDS`]).
pub(crate) fn prompt_chars(body: &Value) -> usize {
    fn text_len(v: &Value) -> usize {
        match v {
            Value::String(s) => s.chars().count(),
            Value::Array(items) => items.iter().map(text_len).sum(),
            Value::Object(o) => o.get("text").map_or(0, text_len),
            _ => 0,
        }
    }
    let mut n = each_message(body)
        .map(|m| m.get("content").map_or(0, text_len))
        .sum::<usize>();
    for field in PROMPT_FIELDS {
        n += body.get(field).map_or(0, text_len);
    }
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
    for m in each_message(body) {
        if let Some(role) = m.get("role").and_then(Value::as_str) {
            out.push_str(role);
        }
        out.push('\n');
        if let Some(c) = m.get("content") {
            push_text(&mut out, c);
        }
        out.push('\n');
    }
    for field in PROMPT_FIELDS {
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
    if route.multipart() {
        return super::form::fields(bytes).map_err(|e| ApiError::invalid_no_param(e.to_string()));
    }
    let value: Value = match serde_json::from_slice(bytes) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            let err = match route {
                Route::Chat => parse_json::<ChatCompletionRequest>(bytes).err(),
                Route::Completions => parse_json::<CompletionRequest>(bytes).err(),
                Route::Embeddings => parse_json::<EmbeddingRequest>(bytes).err(),
                _ => None,
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
        other => check_vllm_shape(other, &value)?,
    }
    Ok(value)
}

/// vLLM's other routes: the fields each cannot do without (the upstream checks the rest
/// and its 400 is relayed).
fn check_vllm_shape(route: Route, v: &Value) -> Result<(), ApiError> {
    let non_empty_array = |f: &str| {
        v.get(f)
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
    };
    match route {
        Route::Tokenize => {
            let prompt = v.get("prompt").is_some_and(Value::is_string);
            if !prompt && !non_empty_array("messages") {
                return Err(ApiError::invalid(
                    "prompt",
                    "`/tokenize` needs a `prompt` string or a non-empty `messages` list.",
                ));
            }
        }
        Route::Detokenize => {
            let ok = v.get("tokens").and_then(Value::as_array).is_some_and(|t| {
                t.iter()
                    .all(|x| x.as_u64().is_some_and(|n| n <= u32::MAX as u64))
            });
            if !ok {
                return Err(ApiError::invalid(
                    "tokens",
                    "`tokens` must be a list of token ids (non-negative integers).",
                ));
            }
        }
        Route::Rerank | Route::RerankV1 | Route::RerankV2 => {
            if !v
                .get("query")
                .is_some_and(|q| q.is_string() || q.is_object())
            {
                return Err(ApiError::invalid("query", "`query` is required."));
            }
            if !non_empty_array("documents") {
                return Err(ApiError::invalid(
                    "documents",
                    "`documents` must be a non-empty list.",
                ));
            }
        }
        Route::ChatBatch => {
            let ok = v
                .get("messages")
                .and_then(Value::as_array)
                .is_some_and(|c| {
                    !c.is_empty()
                        && c.iter()
                            .all(|m| m.as_array().is_some_and(|m| !m.is_empty()))
                });
            if !ok {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` must be a non-empty list of non-empty conversations.",
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// The token counts of an answer's (or a stream chunk's) `usage`, read without building
/// the rest of the document: other fields are skipped, not kept.
#[derive(Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<UsageCounts>,
    /// The Responses API's `response.completed` event holds it in `response`.
    #[serde(default)]
    response: Option<Box<UsageOnly>>,
}

#[derive(Deserialize)]
struct UsageCounts {
    /// `input_tokens` in the Messages and Responses APIs.
    #[serde(default, alias = "input_tokens")]
    prompt_tokens: Option<u64>,
    /// `output_tokens` in the Messages and Responses APIs.
    #[serde(default, alias = "output_tokens")]
    completion_tokens: Option<u64>,
    /// vLLM's rerank usage has only this.
    #[serde(default)]
    total_tokens: Option<u64>,
}

/// `(prompt_tokens, completion_tokens)` of an answer; `None` when it is not JSON or has
/// no usable `usage` (then the estimate is charged). A usage with only `total_tokens`
/// (rerank) counts it all as prompt.
pub(crate) fn usage_from_json(bytes: &[u8]) -> Option<(u64, u64)> {
    let parsed = serde_json::from_slice::<UsageOnly>(bytes).ok()?;
    let u = parsed
        .usage
        .or_else(|| parsed.response.and_then(|r| r.usage))?;
    let completion = u.completion_tokens.unwrap_or(0);
    let prompt = match (u.prompt_tokens, u.total_tokens) {
        (Some(p), _) => p,
        (None, Some(t)) => t.saturating_sub(completion),
        (None, None) => return None,
    };
    Some((prompt, completion))
}

/// The usage of a whole answer on `route`: the tokenizer routes are free (no tokens),
/// the others as [`usage_from_json`] reads them.
pub(crate) fn answer_usage(route: Route, bytes: &[u8]) -> Option<(u64, u64)> {
    if route.free() {
        return Some((0, 0));
    }
    usage_from_json(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_chars_counts_text_fields() {
        let v = serde_json::json!({"messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "de"}]}]});
        assert_eq!(prompt_chars(&v), 5);
        assert_eq!(prompt_chars(&serde_json::json!({"prompt": ["ab", "c"]})), 3);
        let rerank = serde_json::json!({"query": "ab", "documents": ["cd", {"text": "e"}]});
        assert_eq!(prompt_chars(&rerank), 5);
        let batch = serde_json::json!({"messages": [[{"role": "user", "content": "ab"}], [{"role": "user", "content": "c"}]]});
        assert_eq!(prompt_chars(&batch), 3);
    }

    #[test]
    fn usage_reads_rerank_and_pooling_shapes() {
        assert_eq!(
            usage_from_json(br#"{"usage":{"total_tokens":12}}"#),
            Some((12, 0))
        );
        assert_eq!(
            usage_from_json(
                br#"{"usage":{"prompt_tokens":5,"total_tokens":5,"completion_tokens":0}}"#
            ),
            Some((5, 0))
        );
        assert_eq!(usage_from_json(br#"{"usage":{}}"#), None);
        // The Messages and Responses APIs' names, and a Responses stream's last event.
        assert_eq!(
            usage_from_json(
                br#"{"type":"message_delta","usage":{"input_tokens":33,"output_tokens":8}}"#
            ),
            Some((33, 8))
        );
        assert_eq!(
            usage_from_json(br#"{"type":"response.completed","response":{"usage":{"input_tokens":4,"output_tokens":2,"total_tokens":6}}}"#),
            Some((4, 2))
        );
        assert_eq!(
            answer_usage(Route::Tokenize, b"{\"count\": 3}"),
            Some((0, 0))
        );
    }
}
