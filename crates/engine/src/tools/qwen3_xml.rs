//! Qwen3-Coder's XML calls (vLLM's `qwen3_xml`):
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Content is the text before the first `<tool_call>` (or a bare `<function=`). Values are
//! text; each becomes the JSON type its property's schema names ([`Kind`]), as vLLM
//! converts them: `null` is null whatever the type, a value that does not convert stays a
//! string. Arguments are written as Python's `json.dumps` writes them, one parameter at a
//! time once its value is closed, so a streamed prefix is a prefix of the final string.

use serde_json::{Number, Value};

use super::json_scan::partial_tag;
use super::{pythonic, CallView, Function, View};

pub(super) const START: &str = "<tool_call>";
pub(super) const FUNCTION: &str = "<function=";
pub(super) const FUNCTION_END: &str = "</function>";
pub(super) const PARAMETER: &str = "<parameter=";
pub(super) const PARAMETER_END: &str = "</parameter>";

/// The JSON type a parameter's text becomes, from its property schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// The text itself (`string`, no schema, or no `type` with string choices).
    Str,
    Integer,
    Number,
    Boolean,
    /// JSON text (`object`, `array`, or untyped non-string choices).
    Json,
    Null,
}

impl Kind {
    /// The kind of a property schema (`None`: a parameter the schema does not declare).
    pub(super) fn of(schema: Option<&Value>) -> Self {
        let Some(schema) = schema else {
            return Self::Str;
        };
        let ty = match schema.get("type") {
            Some(Value::String(t)) => Some(t.as_str()),
            // `["integer", "null"]`: the first type that is not null.
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).find(|t| *t != "null"),
            _ => None,
        };
        match ty {
            Some("string") => Self::Str,
            Some("integer") => Self::Integer,
            Some("number") => Self::Number,
            Some("boolean") => Self::Boolean,
            Some("object" | "array") => Self::Json,
            Some("null") => Self::Null,
            Some(_) => Self::Str,
            None => {
                let choices = schema
                    .get("enum")
                    .and_then(Value::as_array)
                    .cloned()
                    .or_else(|| schema.get("const").map(|c| vec![c.clone()]));
                match choices {
                    Some(c) if c.iter().any(|v| !v.is_string()) => Self::Json,
                    _ => Self::Str,
                }
            }
        }
    }

    /// The value of a parameter's text (one newline each side already removed).
    pub(super) fn convert(self, text: &str) -> Value {
        if text.eq_ignore_ascii_case("null") {
            return Value::Null;
        }
        let as_string = || Value::String(text.to_string());
        match self {
            Self::Str => as_string(),
            Self::Integer => match serde_json::from_str::<Number>(text.trim()) {
                Ok(n) if n.is_i64() || n.is_u64() => Value::Number(n),
                _ => as_string(),
            },
            Self::Number => match text.trim().parse::<f64>() {
                Ok(f) if f.is_finite() => {
                    if f.fract() == 0.0 && f.abs() < 9.0e15 {
                        Value::from(f as i64)
                    } else {
                        Number::from_f64(f).map_or_else(as_string, Value::Number)
                    }
                }
                _ => as_string(),
            },
            Self::Boolean => Value::Bool(text.trim().eq_ignore_ascii_case("true")),
            Self::Json | Self::Null => serde_json::from_str(text.trim())
                .ok()
                .or_else(|| pythonic::literal_text(text.trim()))
                .unwrap_or_else(as_string),
        }
    }
}

/// The schema of `function`'s parameter `name`, if it declares one.
fn property<'a>(functions: &'a [Function], function: &str, name: &str) -> Option<&'a Value> {
    functions
        .iter()
        .find(|f| f.name == function)
        .and_then(|f| f.parameters.get("properties"))
        .and_then(|p| p.get(name))
}

pub(super) fn view(text: &str, done: bool, functions: &[Function]) -> View {
    let first = [text.find(START), text.find(FUNCTION)]
        .into_iter()
        .flatten()
        .min();
    let Some(first) = first else {
        let held = if done {
            0
        } else {
            partial_tag(text, START).max(partial_tag(text, FUNCTION))
        };
        return View {
            content: text[..text.len() - held].to_string(),
            ..View::default()
        };
    };
    let mut view = View {
        content: text[..first].to_string(),
        ..View::default()
    };
    let mut pos = first;
    while let Some(f) = text[pos..].find(FUNCTION) {
        let name_start = pos + f + FUNCTION.len();
        view.opened += 1;
        let Some(gt) = text[name_start..].find('>') else {
            break;
        };
        let name = text[name_start..name_start + gt].trim().to_string();
        let body_start = name_start + gt + 1;
        let end = text[body_start..]
            .find(FUNCTION_END)
            .map(|e| body_start + e);
        let body = &text[body_start..end.unwrap_or(text.len())];
        let mut arguments = arguments(body, end.is_some(), |param| {
            Kind::of(property(functions, &name, param))
        });
        if end.is_some() {
            arguments.push('}');
        }
        view.calls.push(CallView {
            name,
            arguments,
            done: end.is_some(),
        });
        match end {
            Some(e) => pos = e + FUNCTION_END.len(),
            None => break,
        }
    }
    if view.opened == 0 && done {
        // `<tool_call>` with no function in it: not a call, so all of it is content.
        view.opened = 1;
    }
    view
}

/// The arguments object of a function body, without its closing brace: every parameter
/// whose value is closed (by `</parameter>`, the next `<parameter=`, or the end of a
/// `closed` body). A name given twice keeps its first value.
fn arguments(body: &str, closed: bool, kind: impl Fn(&str) -> Kind) -> String {
    let mut out = String::from("{");
    let mut seen: Vec<&str> = Vec::new();
    let mut pos = 0;
    while let Some(p) = body[pos..].find(PARAMETER) {
        let name_start = pos + p + PARAMETER.len();
        let Some(gt) = body[name_start..].find('>') else {
            break;
        };
        let name = body[name_start..name_start + gt].trim();
        let value_start = name_start + gt + 1;
        let rest = &body[value_start..];
        let ends = [
            rest.find(PARAMETER_END)
                .map(|e| (e, e + PARAMETER_END.len())),
            rest.find(PARAMETER).map(|e| (e, e)),
        ];
        let (value_end, next) = match ends.into_iter().flatten().min() {
            Some((e, n)) => (value_start + e, value_start + n),
            None if closed => (body.len(), body.len()),
            None => break,
        };
        let raw = &body[value_start..value_end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        if !seen.contains(&name) {
            if !seen.is_empty() {
                out.push_str(", ");
            }
            out.push_str(&Value::from(name).to_string());
            out.push_str(": ");
            write_py_json(&mut out, &kind(name).convert(raw));
            seen.push(name);
        }
        pos = next;
    }
    out
}

/// `v` as Python's `json.dumps` writes it (`", "` and `": "` between items, non-ASCII
/// kept), the spelling vLLM's arguments have.
fn write_py_json(out: &mut String, v: &Value) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_json(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::from(k.as_str()).to_string());
                out.push_str(": ");
                write_py_json(out, item);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{check_all_chunkings_with, schema_functions};
    use super::super::ToolParser;
    use super::*;
    use serde_json::json;

    fn functions() -> Vec<Function> {
        schema_functions(&[
            (
                "get_weather",
                json!({"type": "object", "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "opts": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                }}),
            ),
            ("now", json!({"type": "object"})),
        ])
    }

    fn args(a: &str) -> Value {
        serde_json::from_str(a).expect("arguments are JSON")
    }

    #[test]
    fn typed_by_schema_as_qwen3_coder_writes_them() {
        // Qwen3-Coder's own layout: each tag on its line, values between newlines.
        let text = "I'll look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n2.50\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=opts>\n{'deep': None}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>";
        let p = check_all_chunkings_with(ToolParser::Qwen3Xml, text, &functions());
        assert_eq!(p.content.as_deref(), Some("I'll look that up.\n"));
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].name, "get_weather");
        assert_eq!(
            p.calls[0].arguments,
            r#"{"city": "São Paulo", "days": 3, "metric": true, "ratio": 2.5, "tags": ["a", "b"], "opts": {"deep": null}, "note": null}"#
        );
    }

    #[test]
    fn parallel_calls_unknown_parameters_and_multiline_strings() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n\n</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n<parameter=tz>\n5\n</parameter>\n</function>\n</tool_call>";
        let p = check_all_chunkings_with(ToolParser::Qwen3Xml, text, &functions());
        assert_eq!(p.content, None);
        assert_eq!(
            args(&p.calls[0].arguments),
            // A value that is not an integer stays the model's text, as in vLLM.
            json!({"city": "line one\nline two\n", "days": "three"})
        );
        assert_eq!(p.calls[1].name, "now");
        // Not in the schema: a string.
        assert_eq!(p.calls[1].arguments, r#"{"tz": "5"}"#);
    }

    #[test]
    fn bare_function_and_unclosed_parameters() {
        // vLLM also reads a function without the <tool_call> wrapper, and a value closed
        // by the next parameter or the function's end.
        let text = "<function=now>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>";
        let p = check_all_chunkings_with(ToolParser::Qwen3Xml, text, &functions());
        assert_eq!(p.calls[0].arguments, r#"{"a": "x", "b": "y"}"#);
        let p = check_all_chunkings_with(ToolParser::Qwen3Xml, "<function=now>\n</function>", &[]);
        assert_eq!(p.calls[0].arguments, "{}");
    }

    #[test]
    fn text_and_unfinished_calls_are_content() {
        let p = check_all_chunkings_with(
            ToolParser::Qwen3Xml,
            "a <b> c, and <tool is a word; x<function",
            &functions(),
        );
        assert_eq!(
            p.content.as_deref(),
            Some("a <b> c, and <tool is a word; x<function")
        );
        for text in [
            "<tool_call>\n<function=now>\n<parameter=a>\n1\n</parameter>\n",
            "<tool_call>\nnothing here\n</tool_call>",
            "Sure <tool_call>\n<function=get_weather",
        ] {
            let p = ToolParser::Qwen3Xml.parse(text, &functions(), || "id".into());
            assert!(p.calls.is_empty(), "{text:?}");
            assert_eq!(p.content.as_deref(), Some(text));
        }
    }

    #[test]
    fn kinds_of_schemas() {
        assert_eq!(Kind::of(None), Kind::Str);
        assert_eq!(Kind::of(Some(&json!({"enum": ["a", "b"]}))), Kind::Str);
        assert_eq!(Kind::of(Some(&json!({"enum": [1, 2]}))), Kind::Json);
        assert_eq!(
            Kind::of(Some(&json!({"type": ["null", "integer"]}))),
            Kind::Integer
        );
        assert_eq!(Kind::Integer.convert("12"), json!(12));
        assert_eq!(Kind::Integer.convert("1.5"), json!("1.5"));
        assert_eq!(Kind::Number.convert("3.0"), json!(3));
        assert_eq!(Kind::Boolean.convert("yes"), json!(false));
        assert_eq!(Kind::Str.convert("NULL"), Value::Null);
        assert_eq!(Kind::Json.convert("not json"), json!("not json"));
    }
}
