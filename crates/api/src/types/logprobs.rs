//! Log-probability shapes. Chat and legacy completions report them differently:
//!
//! * chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
//!   "bytes"}]}]}`, one entry per generated token;
//! * completions: four parallel arrays `{"tokens", "token_logprobs", "top_logprobs",
//!   "text_offset"}`, where `top_logprobs[i]` is an object `{token: logprob}` and the first
//!   prompt token (with `echo`) has `null` entries because nothing predicts it.
//!
//! JSON has no infinities: `serde_json` writes `-inf` as `null`, which clients then fail to
//! parse as a number. Producers should pass every value through [`finite_logprob`], which
//! clamps to [`LOGPROB_FLOOR`] as vLLM does.

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// The value written for a log-probability of `-inf` (or NaN), matching vLLM.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// `logprob` clamped into what JSON can carry: non-finite or below-floor values become
/// [`LOGPROB_FLOOR`].
pub fn finite_logprob(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob.max(LOGPROB_FLOOR)
    } else if logprob == f32::INFINITY {
        0.0
    } else {
        LOGPROB_FLOOR
    }
}

/// One alternative token in chat logprobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the token (useful when a token is part of a character); `null` when
    /// not available.
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
}

/// One generated token in chat logprobs, with its top alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the token, or `null`.
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
    /// The `top_logprobs` most likely tokens at this position (possibly empty).
    #[serde(default)]
    pub top_logprobs: Vec<TopLogprob>,
}

/// `choices[i].logprobs` of a chat completion or chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    /// Per-token entries; `null` when there are none.
    #[serde(default)]
    pub content: Option<Vec<ChatTokenLogprob>>,
}

/// `{token: logprob}` kept in rank order (a JSON object on the wire).
///
/// A `Vec` rather than a map so the most likely token is written first, as vLLM does.
/// Two token ids can decode to the same text; producers should keep only the first such
/// entry, since a JSON object with duplicate keys is read differently by different parsers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (token, logprob) in &self.0 {
            map.serialize_entry(token, logprob)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for TopLogprobMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor;
        impl<'de> Visitor<'de> for MapVisitor {
            type Value = TopLogprobMap;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object mapping tokens to log-probabilities")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
                // Cap the pre-allocation: the size hint comes from the input.
                let mut entries = Vec::with_capacity(access.size_hint().unwrap_or(0).min(64));
                while let Some(entry) = access.next_entry::<String, f32>()? {
                    entries.push(entry);
                }
                Ok(TopLogprobMap(entries))
            }
        }
        deserializer.deserialize_map(MapVisitor)
    }
}

/// `choices[i].logprobs` of a legacy completion: parallel arrays, one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Log-probability of each token; `null` for the first echoed prompt token.
    pub token_logprobs: Vec<Option<f32>>,
    /// Top alternatives at each position; `null` for the first echoed prompt token.
    pub top_logprobs: Vec<Option<TopLogprobMap>>,
    /// Character offset of each token in the returned text.
    pub text_offset: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finite_logprob_clamps() {
        assert_eq!(finite_logprob(f32::NEG_INFINITY), LOGPROB_FLOOR);
        assert_eq!(finite_logprob(f32::NAN), LOGPROB_FLOOR);
        assert_eq!(finite_logprob(-1e9), LOGPROB_FLOOR);
        assert_eq!(finite_logprob(f32::INFINITY), 0.0);
        assert_eq!(finite_logprob(-0.25), -0.25);
    }

    #[test]
    fn top_logprob_map_keeps_rank_order() {
        let map = TopLogprobMap(vec![("zeta".into(), -0.1), ("alpha".into(), -2.5)]);
        let text = serde_json::to_string(&map).unwrap();
        assert_eq!(text, r#"{"zeta":-0.1,"alpha":-2.5}"#);
        let back: TopLogprobMap = serde_json::from_str(&text).unwrap();
        assert_eq!(back, map);
        assert!(serde_json::from_str::<TopLogprobMap>("[1]").is_err());
    }

    #[test]
    fn completion_logprobs_echo_nulls() {
        let lp = CompletionLogprobs {
            tokens: vec!["Hello".into(), " world".into()],
            token_logprobs: vec![None, Some(-1.5)],
            top_logprobs: vec![None, Some(TopLogprobMap(vec![(" world".into(), -1.5)]))],
            text_offset: vec![0, 5],
        };
        let value = serde_json::to_value(&lp).unwrap();
        assert_eq!(
            value,
            json!({
                "tokens": ["Hello", " world"],
                "token_logprobs": [null, -1.5],
                "top_logprobs": [null, {" world": -1.5}],
                "text_offset": [0, 5]
            })
        );
        assert_eq!(
            serde_json::from_value::<CompletionLogprobs>(value).unwrap(),
            lp
        );
    }

    #[test]
    fn chat_logprobs_shape() {
        let lp = ChatLogprobs {
            content: Some(vec![ChatTokenLogprob {
                token: "Hi".into(),
                logprob: -0.5,
                bytes: Some(vec![72, 105]),
                top_logprobs: vec![TopLogprob {
                    token: "Hi".into(),
                    logprob: -0.5,
                    bytes: None,
                }],
            }]),
        };
        assert_eq!(
            serde_json::to_value(&lp).unwrap(),
            json!({"content": [{
                "token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": null}]
            }]})
        );
    }
}
