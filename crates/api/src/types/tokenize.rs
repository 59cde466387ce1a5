//! vLLM's `POST /tokenize` and `POST /detokenize`.
//!
//! vLLM accepts two tokenize bodies, one with `prompt` and one with `messages` (rendered
//! through the chat template first). Both are one struct here with the two fields optional,
//! so a body with neither or both gets a precise error from
//! [`crate::validate::validate_tokenize`] instead of an opaque "did not match any variant".

use serde::{Deserialize, Serialize};

use super::chat::RequestMessage;

/// Body of `POST /tokenize`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenizeRequest {
    /// Served model name; may be omitted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Completion form: the text to tokenize.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Chat form: messages to render with the chat template, then tokenize.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<RequestMessage>>,
    /// Chat form: append the assistant header (default true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub add_generation_prompt: Option<bool>,
    /// Chat form: leave the final message open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continue_final_message: Option<bool>,
    /// Add BOS etc. (default true for `prompt`, false for `messages`, as in vLLM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
    /// Also return each token's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub return_token_strs: Option<bool>,
}

/// Response of `POST /tokenize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizeResponse {
    /// `tokens.len()`.
    pub count: usize,
    /// The model's context length.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Each token's text, when `return_token_strs` was set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

impl TokenizeResponse {
    /// A response with `count` filled in.
    pub fn new(tokens: Vec<u32>, max_model_len: usize) -> Self {
        TokenizeResponse {
            count: tokens.len(),
            max_model_len,
            tokens,
            token_strs: None,
        }
    }
}

/// Body of `POST /detokenize`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetokenizeRequest {
    /// Served model name; may be omitted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Token ids to turn back into text.
    pub tokens: Vec<u32>,
}

/// Response of `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetokenizeResponse {
    /// The decoded text (vLLM calls it `prompt`).
    pub prompt: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tokenize_both_forms_parse() {
        let p: TokenizeRequest =
            serde_json::from_value(json!({"model": "m", "prompt": "Hello"})).unwrap();
        assert_eq!(p.prompt.as_deref(), Some("Hello"));
        assert!(p.messages.is_none());
        let c: TokenizeRequest = serde_json::from_value(json!({
            "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false
        }))
        .unwrap();
        assert_eq!(c.messages.map(|m| m.len()), Some(1));
        assert_eq!(c.add_generation_prompt, Some(false));
    }

    #[test]
    fn tokenize_response_counts() {
        let r = TokenizeResponse::new(vec![1, 2, 3], 4096);
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]})
        );
    }

    #[test]
    fn detokenize_shapes() {
        let d: DetokenizeRequest = serde_json::from_value(json!({"tokens": [9906]})).unwrap();
        assert_eq!(d.tokens, vec![9906]);
        assert!(serde_json::from_value::<DetokenizeRequest>(json!({"tokens": [-1]})).is_err());
        assert_eq!(
            serde_json::to_value(DetokenizeResponse {
                prompt: "Hello".into()
            })
            .unwrap(),
            json!({"prompt": "Hello"})
        );
    }
}
