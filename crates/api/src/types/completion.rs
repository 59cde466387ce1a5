//! `/v1/completions` (OpenAI's legacy text completions): request, response and chunk.

use serde::{Deserialize, Serialize};

use super::common::{FinishReason, KvTransferParams, Prompt, StopReason, Usage};
use super::logprobs::CompletionLogprobs;
use super::sampling::sampling_request;
use super::OBJECT_TEXT_COMPLETION;

sampling_request! {
    /// Body of `POST /v1/completions`: OpenAI's fields plus vLLM's sampling extensions.
    /// The sampling and output fields it shares with chat are declared once, in
    /// `types/sampling.rs`.
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
    }
    after_seed {}
    after_stream_options {}
    after_cache_salt {
        /// Add BOS etc. when tokenizing a text prompt (default true).
        #[serde(skip_serializing_if = "Option::is_none")]
        pub add_special_tokens: Option<bool>,
    }
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
