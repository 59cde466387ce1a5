//! Request-body parsing that blames the right field.
//!
//! A client that sends `"temperature": "hot"` should hear `param: "temperature"`, not
//! "invalid type at line 1 column 87". `serde_json` reports *what* failed but not *where*
//! once the body has been turned into a [`Value`], and its line/column are useless to an API
//! client. So when typed deserialization fails we ask, for each top-level key, "does this
//! key's value deserialize on its own?" using [`SingleField`], a tiny deserializer that
//! presents the struct visitor with a one-entry map and then stops it with a sentinel
//! before it can complain about missing fields. The first key whose value fails is the
//! `param`. Each key is examined once, so diagnosis costs one more pass over the body and
//! happens only on the error path. If every key is fine the failure must be a missing
//! required field, which serde names in backticks.
//!
//! The fast path parses straight from the text. A body with a duplicated key is rejected by
//! serde's derived structs but accepted by Python's `json` (last value wins), which is what
//! vLLM and OpenAI's servers do; the slow path goes through [`Value`] and so matches them.

use serde::de::value::BorrowedStrDeserializer;
use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, Visitor};
use serde::Deserializer;
use serde_json::{Map, Value};
use std::fmt;

use crate::error::ApiError;

/// Parses a request body into `T`, mapping every failure to a 400 [`ApiError`]:
///
/// * empty body, invalid UTF-8, or malformed JSON: no `param`, message says which;
/// * a body that is valid JSON but not an object: no `param`;
/// * a field of the wrong type or shape: `param` is that top-level field;
/// * a missing required field: `param` is that field.
///
/// Unknown fields are ignored. Intended for the request types in [`crate::types`] (plain
/// structs); for other `T` the field may not be identified and `param` is then `None`.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| {
        ApiError::invalid_no_param(format!(
            "Request body is not valid UTF-8 (invalid byte at offset {}).",
            e.valid_up_to()
        ))
    })?;
    let trimmed = text.trim_start_matches([' ', '\t', '\n', '\r']);
    if trimmed.is_empty() {
        return Err(ApiError::invalid_no_param(
            "Request body is empty; expected a JSON object.",
        ));
    }
    // Derived structs also accept JSON arrays (positional fields), so only take the fast
    // path for something that starts like an object.
    if trimmed.starts_with('{') {
        if let Ok(parsed) = serde_json::from_str::<T>(text) {
            return Ok(parsed);
        }
    }

    let value: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::invalid_no_param(format!("Request body is not valid JSON: {e}")))?;
    let Value::Object(map) = &value else {
        return Err(ApiError::invalid_no_param(format!(
            "Request body must be a JSON object, got {}.",
            json_kind(&value)
        )));
    };
    match T::deserialize(&value) {
        Ok(parsed) => Ok(parsed),
        Err(whole) => Err(blame_field::<T>(map, &whole)),
    }
}

/// Names the JSON type of `value` for messages.
pub(crate) fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Finds the top-level field responsible for `whole` and builds the error.
fn blame_field<T: DeserializeOwned>(
    map: &Map<String, Value>,
    whole: &serde_json::Error,
) -> ApiError {
    for (key, value) in map {
        match T::deserialize(SingleField { key, value }) {
            Ok(_) | Err(FieldCheck::Fine) => {}
            Err(FieldCheck::Failed(reason)) => {
                return ApiError::invalid(
                    key.as_str(),
                    format!("Invalid value for '{key}': {reason}"),
                );
            }
        }
    }
    let message = whole.to_string();
    if let Some(field) = missing_field_name(&message) {
        return ApiError::invalid(field, format!("Field '{field}' is required."));
    }
    ApiError::invalid_no_param(format!("Invalid request body: {message}"))
}

/// Extracts `x` from serde's "missing field `x`" message.
fn missing_field_name(message: &str) -> Option<&str> {
    message
        .strip_prefix("missing field `")?
        .split_once('`')
        .map(|(name, _)| name)
}

/// Outcome of checking one field in isolation.
#[derive(Debug)]
enum FieldCheck {
    /// The field's value deserialized; the visitor was stopped before anything else.
    Fine,
    /// The field's value did not deserialize, for this reason.
    Failed(String),
}

impl fmt::Display for FieldCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldCheck::Fine => f.write_str("field accepted"),
            FieldCheck::Failed(reason) => f.write_str(reason),
        }
    }
}

impl std::error::Error for FieldCheck {}

impl de::Error for FieldCheck {
    fn custom<M: fmt::Display>(msg: M) -> Self {
        FieldCheck::Failed(msg.to_string())
    }
}

/// A deserializer that looks like a map holding only `key: value`, and that ends the visit
/// with [`FieldCheck::Fine`] once that entry has been consumed.
struct SingleField<'a> {
    key: &'a str,
    value: &'a Value,
}

impl<'de> Deserializer<'de> for SingleField<'de> {
    type Error = FieldCheck;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, FieldCheck> {
        visitor.visit_map(SingleFieldAccess {
            key: Some(self.key),
            value: Some(self.value),
        })
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map struct enum identifier ignored_any
    }
}

struct SingleFieldAccess<'a> {
    key: Option<&'a str>,
    value: Option<&'a Value>,
}

impl<'de> MapAccess<'de> for SingleFieldAccess<'de> {
    type Error = FieldCheck;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, FieldCheck> {
        match self.key.take() {
            Some(key) => seed
                .deserialize(BorrowedStrDeserializer::<FieldCheck>::new(key))
                .map(Some),
            // The entry was consumed without error: stop here rather than let the visitor
            // report the (expected) absence of the other fields.
            None => Err(FieldCheck::Fine),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, FieldCheck> {
        match self.value.take() {
            Some(value) => seed
                .deserialize(value)
                .map_err(|e| FieldCheck::Failed(e.to_string())),
            None => Err(FieldCheck::Failed("value requested twice".into())),
        }
    }

    fn size_hint(&self) -> Option<usize> {
        Some(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Probe {
        name: String,
        #[serde(default)]
        count: Option<u32>,
        #[serde(default)]
        tags: Vec<String>,
    }

    #[test]
    fn parses_valid_object() {
        let p: Probe = parse_json(br#"{"name": "a", "count": 3, "other": [1]}"#).unwrap();
        assert_eq!(
            p,
            Probe {
                name: "a".into(),
                count: Some(3),
                tags: vec![]
            }
        );
    }

    #[test]
    fn wrong_type_names_field() {
        let err = parse_json::<Probe>(br#"{"name": "a", "count": "three"}"#).unwrap_err();
        assert_eq!(err.status, 400);
        assert_eq!(err.param.as_deref(), Some("count"));
        assert!(err.message.contains("'count'"), "{}", err.message);
    }

    #[test]
    fn first_bad_field_blamed_even_with_required_missing() {
        let err = parse_json::<Probe>(br#"{"tags": "x"}"#).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tags"));
    }

    #[test]
    fn missing_required_field_named() {
        let err = parse_json::<Probe>(br#"{"count": 1}"#).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("name"));
        assert_eq!(err.message, "Field 'name' is required.");
    }

    #[test]
    fn duplicate_keys_last_wins_like_python() {
        let p: Probe = parse_json(br#"{"name": "a", "name": "b"}"#).unwrap();
        assert_eq!(p.name, "b");
    }

    #[test]
    fn array_body_rejected_even_if_struct_could_read_it() {
        let err = parse_json::<Probe>(br#"["a", 1, []]"#).unwrap_err();
        assert_eq!(err.param, None);
        assert!(err.message.contains("JSON object"), "{}", err.message);
        assert!(err.message.contains("an array"), "{}", err.message);
    }

    #[test]
    fn missing_field_name_parsing() {
        assert_eq!(missing_field_name("missing field `model`"), Some("model"));
        assert_eq!(missing_field_name("invalid type: null"), None);
    }
}
