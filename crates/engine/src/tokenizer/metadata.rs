//! Typed reads of GGUF metadata values.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use super::{Result, TokenizerError};

fn get<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a Value> {
    md.get(key)
}

pub(super) fn value_as_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

pub(super) fn value_as_f32(v: &Value) -> Option<f32> {
    match v {
        Value::F32(x) => Some(*x),
        Value::F64(x) => Some(*x as f32),
        other => value_as_i64(other).map(|x| x as f32),
    }
}

pub(super) fn get_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match get(md, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(TokenizerError::BadType {
            key: key.to_string(),
            expected: "string",
        }),
    }
}

pub(super) fn get_bool(md: &HashMap<String, Value>, key: &str) -> Result<Option<bool>> {
    match get(md, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => match value_as_i64(v) {
            Some(i) => Ok(Some(i != 0)),
            None => Err(TokenizerError::BadType {
                key: key.to_string(),
                expected: "bool",
            }),
        },
    }
}

pub(super) fn get_array<'a>(
    md: &'a HashMap<String, Value>,
    key: &str,
) -> Result<Option<&'a [Value]>> {
    match get(md, key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.as_slice())),
        Some(_) => Err(TokenizerError::BadType {
            key: key.to_string(),
            expected: "array",
        }),
    }
}

pub(super) fn get_id(md: &HashMap<String, Value>, key: &str) -> Result<Option<i64>> {
    match get(md, key) {
        None => Ok(None),
        Some(v) => value_as_i64(v)
            .map(Some)
            .ok_or_else(|| TokenizerError::BadType {
                key: key.to_string(),
                expected: "integer",
            }),
    }
}
