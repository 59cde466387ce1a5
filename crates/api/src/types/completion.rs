//! `/v1/completions` (OpenAI's legacy text completions): request, response and chunk.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::common::{
    FinishReason, KvTransferParams, Prompt, ResponseFormat, Stop, StopReason, StreamOptions, Usage,
};
use super::logprobs::CompletionLogprobs;
use super::OBJECT_TEXT_COMPLETION;

/// Body of `POST /v1/completions`: OpenAI's fields plus vLLM's sampling extensions.
///
/// See [`crate::validate::validate_completion`] for the checks and defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// Served model name; may be omitted (vLLM then uses the default model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Text or token ids to continue.
    pub prompt: Prompt,
    /// Text after the insertion point (not supported; rejected when non-empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    /// Generate this many and return the best `n` (not supported beyond `n`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best_of: Option<i64>,
    /// Return the prompt in front of the completion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    /// Number of top alternatives per token to return, 0..=20.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<i64>,

    // --- OpenAI sampling and output fields ---
    /// 0..=2; 0 means greedy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, (0, 1].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Number of choices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    /// Stop strings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Output token limit (default: the rest of the context).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    /// Accepted for symmetry with chat; wins over `max_tokens`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<i64>,
    /// Any JSON integer (signed or unsigned 64-bit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<serde_json::Number>,
    /// -2..=2.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// -2..=2.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// Token id (as a string) to additive bias, -100..=100.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// Output format: `text`, `json_object` or `json_schema`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    /// End-user id, for logs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Stream Server-Sent Events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Streaming options (only with `stream: true`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,

    // --- vLLM extensions ---
    /// -1 or 0 disables; otherwise sample among the k most likely tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Minimum probability relative to the most likely token, 0..=1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    /// Multiplicative penalty on repeated tokens; 1 disables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    /// Token ids that end a choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<i64>>,
    /// Keep the matched stop string in the output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub include_stop_str_in_output: Option<bool>,
    /// Keep generating past EOS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Do not stop (on EOS or stop tokens) before this many tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<i64>,
    /// Drop special tokens when detokenizing (default true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    /// Put spaces between special tokens when detokenizing (default true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spaces_between_special_tokens: Option<bool>,
    /// Scheduling priority; lower runs earlier (vLLM's convention).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    /// Salt mixed into prefix-cache hashes so tenants do not share cache entries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// Add BOS etc. when tokenizing a text prompt (default true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
    /// vLLM: constrain the output to JSON matching this schema (an object, or a JSON
    /// string holding one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guided_json: Option<serde_json::Value>,
    /// vLLM: constrain the output to this regular expression.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guided_regex: Option<String>,
    /// vLLM: the output is exactly one of these strings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guided_choice: Option<Vec<String>>,
    /// vLLM: a context-free grammar (refused: not supported).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guided_grammar: Option<String>,
    /// vLLM's newer spelling of the guided fields: `{"json" | "regex" | "choice" |
    /// "json_object": ...}`, kept raw for validation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<serde_json::Value>,
    /// Strata: `false` opts this request out of speculative decoding (default: the
    /// engine's setting).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<bool>,
    /// vLLM: prefill/decode disaggregation (PROTOCOLS §11).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// One choice of a completion or completion chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Position among the `n` choices.
    pub index: u32,
    /// Generated text (the new piece, in a chunk).
    pub text: String,
    /// `null` unless logprobs were requested.
    #[serde(default)]
    pub logprobs: Option<CompletionLogprobs>,
    /// Why generation stopped; `null` until the choice's last chunk.
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// vLLM: the stop string or token that matched; omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
}

/// Response of a non-streaming completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// `cmpl-...`
    pub id: String,
    /// Always `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Generated choices.
    pub choices: Vec<CompletionChoice>,
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

impl CompletionResponse {
    /// A response with `object` set correctly.
    pub fn new(
        id: impl Into<String>,
        created: u64,
        model: impl Into<String>,
        choices: Vec<CompletionChoice>,
        usage: Usage,
    ) -> Self {
        CompletionResponse {
            id: id.into(),
            object: OBJECT_TEXT_COMPLETION.to_string(),
            created,
            model: model.into(),
            choices,
            usage,
            system_fingerprint: None,
            kv_transfer_params: None,
        }
    }
}

/// One streamed completion chunk. OpenAI gives it the same `object` (`text_completion`) as
/// the full response; `usage` is omitted except in the usage chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChunk {
    /// Same id in every chunk of a stream.
    pub id: String,
    /// Always `text_completion`.
    pub object: String,
    /// Unix seconds; same in every chunk.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Choices with news; empty in the final usage chunk.
    pub choices: Vec<CompletionChoice>,
    /// Only in the usage chunk (or every chunk with `continuous_usage_stats`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Build identifier; omitted when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
}

impl CompletionChunk {
    /// A chunk with `object` set correctly and no usage.
    pub fn new(
        id: impl Into<String>,
        created: u64,
        model: impl Into<String>,
        choices: Vec<CompletionChoice>,
    ) -> Self {
        CompletionChunk {
            id: id.into(),
            object: OBJECT_TEXT_COMPLETION.to_string(),
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
    fn chunk_has_null_finish_reason_and_no_usage() {
        let chunk = CompletionChunk::new(
            "cmpl-1",
            3,
            "m",
            vec![CompletionChoice {
                index: 0,
                text: " world".into(),
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }],
        );
        assert_eq!(
            serde_json::to_value(&chunk).unwrap(),
            json!({"id": "cmpl-1", "object": "text_completion", "created": 3, "model": "m",
                   "choices": [{"index": 0, "text": " world", "logprobs": null,
                                "finish_reason": null}]})
        );
    }

    #[test]
    fn response_round_trips() {
        let resp = CompletionResponse::new(
            "cmpl-2",
            9,
            "m",
            vec![CompletionChoice {
                index: 0,
                text: "!".into(),
                logprobs: None,
                finish_reason: Some(FinishReason::Length),
                stop_reason: Some(StopReason::TokenId(2)),
            }],
            Usage::new(4, 1),
        );
        let text = serde_json::to_string(&resp).unwrap();
        assert_eq!(
            serde_json::from_str::<CompletionResponse>(&text).unwrap(),
            resp
        );
        assert!(text.contains(r#""stop_reason":2"#));
    }
}
