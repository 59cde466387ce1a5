//! Shapes shared by several endpoints: `stop`, `stream_options`, `response_format`, prompts,
//! usage and finish reasons.

use serde::{Deserialize, Serialize};

/// `stop`: OpenAI accepts one string or a list of strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum Stop {
    /// `"stop": "\n"`
    One(String),
    /// `"stop": ["\n", "User:"]`
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings as a list, whichever form was sent.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`, only meaningful with `stream: true`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` and empty `choices` before `[DONE]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
    /// vLLM: put running `usage` in every chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuous_usage_stats: Option<bool>,
}

/// `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
/// `{"type": "json_schema", "json_schema": {...}}`. Kept loose; validation decides what is
/// supported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseFormat {
    /// The format name (`type` on the wire).
    #[serde(rename = "type")]
    pub kind: String,
    /// The schema object for `json_schema`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<serde_json::Value>,
}

/// A completion prompt or embedding input: OpenAI's four accepted forms.
///
/// Token ids are `i64` on the wire so that a negative or oversized id reaches validation
/// and is reported precisely rather than as "did not match any variant".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
)]
pub enum Prompt {
    /// `"prompt": "Once upon a time"`
    Text(String),
    /// `"prompt": [9906, 1917]`
    Tokens(Vec<i64>),
    /// `"prompt": ["a", "b"]`
    TextBatch(Vec<String>),
    /// `"prompt": [[9906], [1917]]`
    TokenBatch(Vec<Vec<i64>>),
}

impl Default for Prompt {
    fn default() -> Self {
        Prompt::Text(String::new())
    }
}

/// Cache details of the prompt, as OpenAI reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// Token accounting of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt (after the chat template).
    pub prompt_tokens: u32,
    /// Tokens generated, over all choices.
    #[serde(default)]
    pub completion_tokens: u32,
    /// `prompt_tokens + completion_tokens`.
    pub total_tokens: u32,
    /// Present when the server reports prefix-cache hits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// Usage with `total_tokens` computed (saturating) and no cache details.
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: None,
        }
    }

    /// Adds `prompt_tokens_details.cached_tokens`.
    #[must_use]
    pub fn with_cached_tokens(mut self, cached_tokens: u32) -> Self {
        self.prompt_tokens_details = Some(PromptTokensDetails { cached_tokens });
        self
    }
}

/// Why a choice stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop string, stop token or EOS was produced.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The model called tools.
    ToolCalls,
    /// Output was filtered.
    ContentFilter,
    /// Legacy function calling.
    FunctionCall,
    /// vLLM: the request was aborted.
    Abort,
    /// vLLM: generation failed.
    Error,
}

/// vLLM's `stop_reason`: the stop token id or stop string that ended a choice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopReason {
    /// A token from `stop_token_ids`.
    TokenId(u32),
    /// A string from `stop`.
    Text(String),
}

/// vLLM's `kv_transfer_params` (PROTOCOLS §11): the request field a disaggregating proxy
/// sends to the prefill engine and then to the decode engine, and the top-level response
/// field the prefill engine answers with. Every field is optional on the wire; fields this
/// project does not read (newer vLLM releases add some) are kept in `extra` and passed on
/// unchanged.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// To the prefill engine: compute the prompt, keep its KV for a remote decoder.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// To the decode engine: the prompt's KV waits on a remote prefill engine.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// The prefill engine's id.
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    /// The prefill engine's blocks holding the prompt, in table order.
    #[serde(default)]
    pub remote_block_ids: Option<Vec<u64>>,
    /// Where the prefill engine serves its blocks.
    #[serde(default)]
    pub remote_host: Option<String>,
    #[serde(default)]
    pub remote_port: Option<u16>,
    /// Anything else a peer sent, kept verbatim.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl KvTransferParams {
    /// What a proxy sends to the prefill engine (step 1 of PROTOCOLS §11).
    pub fn prefill_request() -> Self {
        Self {
            do_remote_decode: true,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stop_accepts_string_or_list() {
        let one: Stop = serde_json::from_value(json!("\n")).unwrap();
        assert_eq!(one.into_vec(), vec!["\n".to_string()]);
        let many: Stop = serde_json::from_value(json!(["a", "b"])).unwrap();
        assert_eq!(many.into_vec(), vec!["a".to_string(), "b".to_string()]);
        let err = serde_json::from_value::<Stop>(json!(3)).unwrap_err();
        assert!(err.to_string().contains("a string or an array of strings"));
    }

    #[test]
    fn prompt_forms() {
        let cases = [
            (json!("hi"), Prompt::Text("hi".into())),
            (json!([1, 2]), Prompt::Tokens(vec![1, 2])),
            (
                json!(["a", "b"]),
                Prompt::TextBatch(vec!["a".into(), "b".into()]),
            ),
            (
                json!([[1], [2, 3]]),
                Prompt::TokenBatch(vec![vec![1], vec![2, 3]]),
            ),
            (json!([]), Prompt::Tokens(vec![])),
        ];
        for (value, want) in cases {
            let got: Prompt = serde_json::from_value(value.clone()).unwrap();
            assert_eq!(got, want, "{value}");
            assert_eq!(serde_json::to_value(&got).unwrap(), value);
        }
    }

    #[test]
    fn usage_total_and_cached_details() {
        let u = Usage::new(10, 5);
        assert_eq!(u.total_tokens, 15);
        assert_eq!(
            serde_json::to_value(u).unwrap(),
            json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15})
        );
        let u = u.with_cached_tokens(8);
        assert_eq!(
            serde_json::to_value(u).unwrap()["prompt_tokens_details"],
            json!({"cached_tokens": 8})
        );
        assert_eq!(Usage::new(u32::MAX, 1).total_tokens, u32::MAX);
    }

    #[test]
    fn finish_and_stop_reasons_wire_names() {
        assert_eq!(
            serde_json::to_value(FinishReason::ToolCalls).unwrap(),
            json!("tool_calls")
        );
        assert_eq!(
            serde_json::to_value(FinishReason::Length).unwrap(),
            json!("length")
        );
        let r: StopReason = serde_json::from_value(json!(128009)).unwrap();
        assert_eq!(r, StopReason::TokenId(128009));
        let r: StopReason = serde_json::from_value(json!("</s>")).unwrap();
        assert_eq!(r, StopReason::Text("</s>".into()));
    }

    #[test]
    fn kv_transfer_params_read_vllm_answers_and_keep_unknown_fields() {
        let answer = json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "e1", "remote_block_ids": [3, 4],
            "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1
        });
        let p: KvTransferParams = serde_json::from_value(answer.clone()).unwrap();
        assert!(p.do_remote_prefill && !p.do_remote_decode);
        assert_eq!(p.remote_block_ids, Some(vec![3, 4]));
        assert_eq!(p.remote_port, Some(5600));
        assert_eq!(p.extra.get("tp_size"), Some(&json!(1)));
        // What a decoder is sent back is what the prefill engine answered.
        assert_eq!(serde_json::to_value(&p).unwrap(), answer);
        let first = serde_json::to_value(KvTransferParams::prefill_request()).unwrap();
        assert_eq!(first["do_remote_decode"], json!(true));
        assert_eq!(first["remote_host"], json!(null));
        assert!(serde_json::from_value::<KvTransferParams>(json!({"remote_port": 70000})).is_err());
    }
}
