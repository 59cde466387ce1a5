//! `/v1/embeddings`: request and response.

use serde::{Deserialize, Serialize};

use super::common::Prompt;
use super::{OBJECT_EMBEDDING, OBJECT_LIST};

/// How embedding vectors are encoded in the response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    /// A JSON array of numbers.
    #[default]
    Float,
    /// Base64 of the little-endian `f32` bytes.
    Base64,
}

/// Body of `POST /v1/embeddings`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingRequest {
    /// Served model name; may be omitted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Text(s) or token ids to embed (same four forms as a completion prompt).
    pub input: Prompt,
    /// `float` (default) or `base64`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoding_format: Option<EncodingFormat>,
    /// Truncate vectors to this many dimensions (Matryoshka models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<i64>,
    /// End-user id, for logs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// vLLM's extension: cut each input to this many tokens instead of refusing a long one
    /// (`-1`: the model's limit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's extension: add the model's special tokens (`[CLS]`, `[SEP]`) to text inputs.
    /// Default true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
}

/// An embedding, as numbers or as base64 text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    /// `encoding_format: float`.
    Float(Vec<f32>),
    /// `encoding_format: base64`.
    Base64(String),
}

/// One embedding in the response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingData {
    /// Always `embedding`.
    pub object: String,
    /// The vector.
    pub embedding: EmbeddingVector,
    /// Position of the input it embeds.
    pub index: u32,
}

impl EmbeddingData {
    /// An entry with `object` set.
    pub fn new(index: u32, embedding: EmbeddingVector) -> Self {
        EmbeddingData {
            object: OBJECT_EMBEDDING.to_string(),
            embedding,
            index,
        }
    }
}

/// Token accounting of an embedding request (OpenAI reports no completion tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbeddingUsage {
    /// Tokens embedded.
    pub prompt_tokens: u32,
    /// Same as `prompt_tokens`.
    pub total_tokens: u32,
}

/// Response of `POST /v1/embeddings`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingResponse {
    /// Always `list`.
    pub object: String,
    /// One entry per input.
    pub data: Vec<EmbeddingData>,
    /// The served model name.
    pub model: String,
    /// Token accounting.
    pub usage: EmbeddingUsage,
}

impl EmbeddingResponse {
    /// A response with `object` set and usage computed from `prompt_tokens`.
    pub fn new(model: impl Into<String>, data: Vec<EmbeddingData>, prompt_tokens: u32) -> Self {
        EmbeddingResponse {
            object: OBJECT_LIST.to_string(),
            data,
            model: model.into(),
            usage: EmbeddingUsage {
                prompt_tokens,
                total_tokens: prompt_tokens,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn request_as_openai_client_sends_it() {
        let req: EmbeddingRequest = serde_json::from_value(json!({
            "input": ["hello", "world"], "model": "e5", "encoding_format": "base64"
        }))
        .unwrap();
        assert_eq!(
            req.input,
            Prompt::TextBatch(vec!["hello".into(), "world".into()])
        );
        assert_eq!(req.encoding_format, Some(EncodingFormat::Base64));
    }

    #[test]
    fn response_shape() {
        let resp = EmbeddingResponse::new(
            "e5",
            vec![
                EmbeddingData::new(0, EmbeddingVector::Float(vec![0.5, -1.0])),
                EmbeddingData::new(1, EmbeddingVector::Base64("AAAAPw==".into())),
            ],
            4,
        );
        let v = serde_json::to_value(&resp).unwrap();
        assert_eq!(
            v,
            json!({"object": "list", "model": "e5",
                   "data": [{"object": "embedding", "embedding": [0.5, -1.0], "index": 0},
                            {"object": "embedding", "embedding": "AAAAPw==", "index": 1}],
                   "usage": {"prompt_tokens": 4, "total_tokens": 4}})
        );
        assert_eq!(
            serde_json::from_value::<EmbeddingResponse>(v).unwrap(),
            resp
        );
    }
}
