//! `/v1/embeddings` requests into typed values (PROTOCOLS §9).

use crate::error::ApiError;
use crate::types::{EmbeddingRequest, EncodingFormat, Prompt};

/// OpenAI's limit on inputs in one embeddings request.
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// One checked input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmbeddingInput {
    /// Non-empty text to tokenize.
    Text(String),
    /// Non-empty token ids, used as they are; the engine checks them against its vocabulary.
    Tokens(Vec<u32>),
}

/// How long inputs are treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    /// An input over the model's limit is refused (the default).
    Refuse,
    /// Cut to the model's limit (`truncate_prompt_tokens: -1`).
    ModelLimit,
    /// Cut to this many tokens (positive; the engine refuses more than its limit).
    Tokens(usize),
}

/// A checked `/v1/embeddings` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedEmbeddings {
    /// Requested model; `None` means the served one.
    pub model: Option<String>,
    /// 1 to [`MAX_EMBEDDING_INPUTS`] inputs, in order.
    pub inputs: Vec<EmbeddingInput>,
    pub encoding_format: EncodingFormat,
    /// Requested vector length, positive; the engine decides whether it can give it.
    pub dimensions: Option<usize>,
    pub truncation: Truncation,
    pub add_special_tokens: bool,
    pub user: Option<String>,
}

/// Checks an embeddings request: 1 to 2,048 inputs, none empty, token ids in `u32`, a
/// positive `dimensions`, a valid `truncate_prompt_tokens`.
pub fn validate_embeddings(req: EmbeddingRequest) -> Result<ValidatedEmbeddings, ApiError> {
    let inputs = match req.input {
        Prompt::Text(t) => vec![EmbeddingInput::Text(t)],
        Prompt::Tokens(ids) => vec![EmbeddingInput::Tokens(token_ids(ids, "input")?)],
        Prompt::TextBatch(texts) => texts.into_iter().map(EmbeddingInput::Text).collect(),
        Prompt::TokenBatch(lists) => lists
            .into_iter()
            .enumerate()
            .map(|(i, ids)| token_ids(ids, &format!("input[{i}]")).map(EmbeddingInput::Tokens))
            .collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid(
            "input",
            "input must not be empty; send at least one string or token list.",
        ));
    }
    if inputs.len() > MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!(
                "input holds {} items; at most {MAX_EMBEDDING_INPUTS} are allowed per request.",
                inputs.len()
            ),
        ));
    }
    let single = inputs.len() == 1;
    for (i, input) in inputs.iter().enumerate() {
        let empty = match input {
            EmbeddingInput::Text(t) => t.is_empty(),
            EmbeddingInput::Tokens(t) => t.is_empty(),
        };
        if empty {
            let param = if single {
                "input".to_string()
            } else {
                format!("input[{i}]")
            };
            return Err(ApiError::invalid(
                param,
                "input must not contain an empty string or an empty token list.",
            ));
        }
    }
    let dimensions = match req.dimensions {
        None => None,
        Some(d) if d > 0 => Some(usize::try_from(d).map_err(|_| {
            ApiError::invalid("dimensions", format!("dimensions {d} is too large."))
        })?),
        Some(d) => {
            return Err(ApiError::invalid(
                "dimensions",
                format!("dimensions must be a positive integer, got {d}."),
            ))
        }
    };
    let truncation = match req.truncate_prompt_tokens {
        None => Truncation::Refuse,
        Some(-1) => Truncation::ModelLimit,
        Some(k) if k > 0 => Truncation::Tokens(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(ApiError::invalid(
                "truncate_prompt_tokens",
                format!("truncate_prompt_tokens must be -1 or a positive integer, got {k}."),
            ))
        }
    };
    Ok(ValidatedEmbeddings {
        model: req.model,
        inputs,
        encoding_format: req.encoding_format.unwrap_or_default(),
        dimensions,
        truncation,
        add_special_tokens: req.add_special_tokens.unwrap_or(true),
        user: req.user,
    })
}

fn token_ids(ids: Vec<i64>, param: &str) -> Result<Vec<u32>, ApiError> {
    ids.into_iter()
        .map(|id| {
            u32::try_from(id).map_err(|_| {
                ApiError::invalid(
                    param,
                    format!("{param} contains {id}, which is not a valid token id."),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::parse_json;

    fn check(body: &str) -> Result<ValidatedEmbeddings, ApiError> {
        validate_embeddings(parse_json::<EmbeddingRequest>(body.as_bytes())?)
    }

    #[test]
    fn the_four_input_forms() {
        let v = check(r#"{"input": "hi"}"#).unwrap();
        assert_eq!(v.inputs, vec![EmbeddingInput::Text("hi".into())]);
        assert_eq!(v.encoding_format, EncodingFormat::Float);
        assert!(v.add_special_tokens);
        assert_eq!(v.truncation, Truncation::Refuse);
        let v = check(r#"{"input": ["a", "b"], "encoding_format": "base64"}"#).unwrap();
        assert_eq!(v.inputs.len(), 2);
        assert_eq!(v.encoding_format, EncodingFormat::Base64);
        let v = check(r#"{"input": [101, 102]}"#).unwrap();
        assert_eq!(v.inputs, vec![EmbeddingInput::Tokens(vec![101, 102])]);
        let v = check(r#"{"input": [[101], [7, 8]], "truncate_prompt_tokens": -1}"#).unwrap();
        assert_eq!(v.inputs[1], EmbeddingInput::Tokens(vec![7, 8]));
        assert_eq!(v.truncation, Truncation::ModelLimit);
        let v = check(r#"{"input": "x", "truncate_prompt_tokens": 5, "dimensions": 384}"#).unwrap();
        assert_eq!(v.truncation, Truncation::Tokens(5));
        assert_eq!(v.dimensions, Some(384));
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"input": ""}"#, "input"),
            (r#"{"input": ["a", ""]}"#, "input[1]"),
            (r#"{"input": []}"#, "input"),
            (r#"{"input": [[1], []]}"#, "input[1]"),
            (r#"{"input": [-1]}"#, "input"),
            (r#"{"input": [[1], [4294967296]]}"#, "input[1]"),
            (r#"{"input": "a", "dimensions": 0}"#, "dimensions"),
            (
                r#"{"input": "a", "truncate_prompt_tokens": 0}"#,
                "truncate_prompt_tokens",
            ),
            (
                r#"{"input": "a", "encoding_format": "int8"}"#,
                "encoding_format",
            ),
            (r#"{"input": 5}"#, "input"),
            (r#"{"model": "m"}"#, "input"),
        ];
        for (body, param) in cases {
            let err = check(body).unwrap_err();
            assert_eq!(err.status, 400, "{body}");
            assert_eq!(err.param.as_deref(), Some(*param), "{body}: {err}");
        }
    }

    #[test]
    fn at_most_2048_inputs() {
        let ok = format!(r#"{{"input": [{}]}}"#, vec!["\"a\""; 2048].join(","));
        assert_eq!(check(&ok).unwrap().inputs.len(), 2048);
        let over = format!(r#"{{"input": [{}]}}"#, vec!["\"a\""; 2049].join(","));
        let err = check(&over).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input"));
        assert!(err.message.contains("2049"), "{}", err.message);
        let tokens = format!(r#"{{"input": [{}]}}"#, vec!["[1]"; 2049].join(","));
        assert!(check(&tokens).is_err());
    }
}
