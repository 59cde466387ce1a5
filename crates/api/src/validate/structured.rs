//! Structured outputs (PROTOCOLS §10): `response_format` and vLLM's `guided_json`,
//! `guided_regex`, `guided_choice` and `structured_outputs` extras, checked into one
//! [`StructuredOutput`].
//!
//! Only the shape and size are checked here; whether every schema keyword can be enforced
//! is decided by the engine's grammar compiler, which needs the tokenizer, and is also a
//! 400 naming the keyword.

use serde_json::Value;

use crate::error::ApiError;
use crate::types::sampling::SamplingFields;
use crate::types::ResponseFormat;

/// Largest JSON schema accepted, in bytes of its compact serialization. Grammar
/// compilation time and memory grow with the schema; this bounds both per request.
pub const MAX_SCHEMA_BYTES: usize = 32 * 1024;
/// Deepest nesting of objects and arrays accepted in a schema.
pub const MAX_SCHEMA_DEPTH: usize = 32;
/// Longest `guided_regex` accepted, in bytes.
pub const MAX_REGEX_BYTES: usize = 4096;
/// Most `guided_choice` entries accepted.
pub const MAX_CHOICES: usize = 256;
/// Longest single `guided_choice` entry, in bytes.
pub const MAX_CHOICE_BYTES: usize = 1024;

/// A constraint on the generated text.
#[derive(Debug, Clone, PartialEq)]
pub enum StructuredOutput {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON matching a schema (`json_schema` or `guided_json`). The grammar always
    /// enforces the schema; `strict` is kept for logs (OpenAI's non-strict mode only
    /// means "best effort", which an enforced schema also satisfies).
    JsonSchema {
        /// The schema's name from `response_format.json_schema.name`, if sent.
        name: Option<String>,
        /// An object schema.
        schema: Value,
        /// `response_format.json_schema.strict`.
        strict: bool,
    },
    /// Text matching a regular expression (Rust `regex` syntax, anchored at both ends).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

/// Resolves the request's constraint, if any. At most one source may be set. Takes the
/// guided fields out of `fields` (it keeps what it checks); `response_format` stays.
pub(crate) fn structured_output(
    fields: &mut SamplingFields,
) -> Result<Option<StructuredOutput>, ApiError> {
    let mut found: Vec<(&'static str, StructuredOutput)> = Vec::new();
    if let Some(rf) = &fields.response_format {
        if let Some(s) = from_response_format(rf)? {
            found.push(("response_format", s));
        }
    }
    if fields.guided_grammar.is_some() {
        return Err(ApiError::invalid(
            "guided_grammar",
            "guided_grammar is not supported; use guided_json, guided_regex or guided_choice.",
        ));
    }
    if let Some(schema) = fields.guided_json.take() {
        let schema = match schema {
            // vLLM also takes the schema as a JSON string.
            Value::String(s) => serde_json::from_str(&s).map_err(|e| {
                ApiError::invalid(
                    "guided_json",
                    format!("guided_json is a string but not JSON: {e}"),
                )
            })?,
            other => other,
        };
        found.push((
            "guided_json",
            json_schema("guided_json", schema, None, false)?,
        ));
    }
    if let Some(rx) = fields.guided_regex.take() {
        found.push(("guided_regex", regex("guided_regex", rx)?));
    }
    if let Some(choices) = fields.guided_choice.take() {
        found.push(("guided_choice", choice("guided_choice", choices)?));
    }
    if let Some(so) = fields.structured_outputs.take() {
        if let Some(s) = from_structured_outputs(so)? {
            found.push(("structured_outputs", s));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
        return Err(ApiError::invalid(
            found[1].0,
            format!(
                "Only one structured-output constraint may be sent; got {}.",
                names.join(", ")
            ),
        ));
    }
    Ok(found.pop().map(|(_, s)| s))
}

fn from_response_format(rf: &ResponseFormat) -> Result<Option<StructuredOutput>, ApiError> {
    match rf.kind.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some(StructuredOutput::JsonObject)),
        "json_schema" => {
            let param = "response_format.json_schema";
            let Some(js) = &rf.json_schema else {
                return Err(ApiError::invalid(
                    param,
                    "response_format of type 'json_schema' needs a 'json_schema' object.",
                ));
            };
            let Some(obj) = js.as_object() else {
                return Err(ApiError::invalid(
                    param,
                    "response_format.json_schema must be an object with 'name' and 'schema'.",
                ));
            };
            let name = match obj.get("name") {
                None | Some(Value::Null) => None,
                Some(Value::String(n)) => {
                    if n.is_empty()
                        || n.len() > 64
                        || !n
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                    {
                        return Err(ApiError::invalid(
                            "response_format.json_schema.name",
                            "response_format.json_schema.name must be 1 to 64 characters of \
                             a-z, A-Z, 0-9, '_' or '-'.",
                        ));
                    }
                    Some(n.clone())
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        "response_format.json_schema.name must be a string.",
                    ))
                }
            };
            let strict = match obj.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.strict",
                        "response_format.json_schema.strict must be a boolean.",
                    ))
                }
            };
            let Some(schema) = obj.get("schema") else {
                return Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "response_format.json_schema.schema is required.",
                ));
            };
            json_schema(
                "response_format.json_schema.schema",
                schema.clone(),
                name,
                strict,
            )
            .map(Some)
        }
        kind => Err(ApiError::invalid(
            "response_format",
            format!(
                "Unknown response_format type '{kind}'; expected 'text', 'json_object' or 'json_schema'."
            ),
        )),
    }
}

/// vLLM's `structured_outputs: {"json" | "regex" | "choice" | "json_object": ...}`.
fn from_structured_outputs(value: Value) -> Result<Option<StructuredOutput>, ApiError> {
    let param = "structured_outputs";
    let Value::Object(obj) = value else {
        return Err(ApiError::invalid(
            param,
            "structured_outputs must be an object.",
        ));
    };
    let mut found = Vec::new();
    for (key, v) in obj {
        if v.is_null() {
            continue;
        }
        let p = format!("structured_outputs.{key}");
        match key.as_str() {
            "json" => {
                let schema = match v {
                    Value::String(s) => serde_json::from_str(&s).map_err(|e| {
                        ApiError::invalid(p.clone(), format!("{p} is a string but not JSON: {e}"))
                    })?,
                    other => other,
                };
                found.push(json_schema(&p, schema, None, false)?);
            }
            "regex" => match v {
                Value::String(rx) => found.push(regex(&p, rx)?),
                _ => {
                    return Err(ApiError::invalid(
                        p.clone(),
                        format!("{p} must be a string."),
                    ))
                }
            },
            "choice" => {
                let choices: Vec<String> = serde_json::from_value(v).map_err(|_| {
                    ApiError::invalid(p.clone(), format!("{p} must be an array of strings."))
                })?;
                found.push(choice(&p, choices)?);
            }
            "json_object" => match v {
                Value::Bool(true) => found.push(StructuredOutput::JsonObject),
                Value::Bool(false) => {}
                _ => {
                    return Err(ApiError::invalid(
                        p.clone(),
                        format!("{p} must be a boolean."),
                    ))
                }
            },
            "grammar" | "structural_tag" => {
                return Err(ApiError::invalid(
                    p.clone(),
                    format!("{p} is not supported; use json, regex, choice or json_object."),
                ))
            }
            // Backend hints (whitespace patterns, backend names) do not change the output
            // contract; anything else is unknown and refused rather than ignored.
            "disable_fallback"
            | "disable_any_whitespace"
            | "disable_additional_properties"
            | "whitespace_pattern"
            | "backend" => {}
            _ => {
                return Err(ApiError::invalid(
                    p.clone(),
                    format!("Unknown structured_outputs field '{key}'."),
                ))
            }
        }
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            param,
            "structured_outputs must name exactly one of json, regex, choice or json_object.",
        ));
    }
    Ok(found.pop())
}

fn json_schema(
    param: &str,
    schema: Value,
    name: Option<String>,
    strict: bool,
) -> Result<StructuredOutput, ApiError> {
    if !schema.is_object() {
        return Err(ApiError::invalid(
            param,
            format!("{param} must be a JSON schema object."),
        ));
    }
    let bytes = serde_json::to_vec(&schema)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if bytes > MAX_SCHEMA_BYTES {
        return Err(ApiError::invalid(
            param,
            format!("{param} is {bytes} bytes; the largest schema accepted is {MAX_SCHEMA_BYTES} bytes."),
        ));
    }
    let depth = depth(&schema);
    if depth > MAX_SCHEMA_DEPTH {
        return Err(ApiError::invalid(
            param,
            format!("{param} nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted."),
        ));
    }
    Ok(StructuredOutput::JsonSchema {
        name,
        schema,
        strict,
    })
}

fn regex(param: &str, rx: String) -> Result<StructuredOutput, ApiError> {
    if rx.is_empty() {
        return Err(ApiError::invalid(
            param,
            format!("{param} must not be empty."),
        ));
    }
    if rx.len() > MAX_REGEX_BYTES {
        return Err(ApiError::invalid(
            param,
            format!(
                "{param} is {} bytes; at most {MAX_REGEX_BYTES} are accepted.",
                rx.len()
            ),
        ));
    }
    Ok(StructuredOutput::Regex(rx))
}

fn choice(param: &str, choices: Vec<String>) -> Result<StructuredOutput, ApiError> {
    if choices.is_empty() {
        return Err(ApiError::invalid(
            param,
            format!("{param} must list at least one choice."),
        ));
    }
    if choices.len() > MAX_CHOICES {
        return Err(ApiError::invalid(
            param,
            format!(
                "{param} lists {} choices; at most {MAX_CHOICES} are accepted.",
                choices.len()
            ),
        ));
    }
    if let Some(i) = choices
        .iter()
        .position(|c| c.is_empty() || c.len() > MAX_CHOICE_BYTES)
    {
        return Err(ApiError::invalid(
            format!("{param}[{i}]"),
            format!("{param}[{i}] must be 1 to {MAX_CHOICE_BYTES} bytes long."),
        ));
    }
    Ok(StructuredOutput::Choice(choices))
}

/// Nesting depth of objects and arrays (a scalar is 0), without recursion so a hostile
/// document cannot exhaust the stack.
fn depth(v: &Value) -> usize {
    let mut max = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        match v {
            Value::Object(m) => {
                max = max.max(d + 1);
                stack.extend(m.values().map(|c| (c, d + 1)));
            }
            Value::Array(a) => {
                max = max.max(d + 1);
                stack.extend(a.iter().map(|c| (c, d + 1)));
            }
            _ => {}
        }
    }
    max
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn depth_counts_containers() {
        assert_eq!(depth(&json!(1)), 0);
        assert_eq!(depth(&json!({"a": [1, {"b": 2}]})), 3);
    }
}
