//! The lark rules for one function in Qwen3-Coder's XML format: after `<function=`, its
//! name, then its declared parameters in the schema's order (each required one present,
//! each optional one at most once), each value held to its property's schema the way
//! the parser reads it back ([`Kind`]): strings as text that cannot close the value early
//! (nor read back as `null`), with their length bounds and choices; every other type as
//! JSON text of its schema (`%json`).

use serde_json::Value;

use super::lark::{lit, rx};
use super::qwen3_xml::{Kind, FUNCTION_END, PARAMETER, PARAMETER_END};
use super::Function;
use crate::structured::with_json_options;

/// Longest `minLength` or `maxLength` written into a value's regex; a longer bound is not
/// enforced.
const MAX_BOUNDED_LENGTH: u64 = 4096;

/// Rules `f_{i}` and its parameters' for `f`.
pub(super) fn function_rules(i: usize, f: &Function) -> String {
    let mut g = String::new();
    let props = f
        .parameters
        .get("properties")
        .and_then(Value::as_object)
        .filter(|p| !p.is_empty());
    let required: Vec<&str> = f
        .parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut body = vec![lit(&format!("{}>\n", f.name))];
    match props {
        Some(props) => {
            for (j, (key, schema)) in props.iter().enumerate() {
                let optional = if required.contains(&key.as_str()) {
                    ""
                } else {
                    "?"
                };
                body.push(format!("p_{i}_{j}{optional}"));
                g.push_str(&format!(
                    "p_{i}_{j}: {} v_{i}_{j}\n",
                    lit(&format!("{PARAMETER}{key}>\n")),
                ));
                g.push_str(&value_rule(&format!("v_{i}_{j}"), schema));
            }
        }
        None if f.parameters.get("additionalProperties") != Some(&Value::Bool(false)) => {
            // No declared parameters: any names, string values.
            body.push(format!("p_{i}_any*"));
            g.push_str(&format!(
                "p_{i}_any: {} NAME_{i} \">\\n\" v_{i}_any\n",
                lit(PARAMETER),
            ));
            g.push_str(&format!("NAME_{i}: /[A-Za-z0-9_.\\-]{{1,64}}/\n"));
            g.push_str(&value_rule(&format!("v_{i}_any"), &Value::Null));
        }
        None => {}
    }
    body.push(lit(&format!("{FUNCTION_END}\n</tool_call>")));
    g.insert_str(0, &format!("f_{i}: {}\n", body.join(" ")));
    g
}

/// The text that closes a value.
fn close() -> String {
    format!("\n{PARAMETER_END}\n")
}

/// The rule `name` for a value of `schema` and the text that closes it.
fn value_rule(name: &str, schema: &Value) -> String {
    let kind = Kind::of((!schema.is_null()).then_some(schema));
    match kind {
        Kind::Str => string_rule(name, schema),
        Kind::Null => format!("{name}: {}\n", lit(&format!("null{}", close()))),
        Kind::Integer | Kind::Number | Kind::Boolean | Kind::Json => format!(
            "{name}: %json {} {}\n",
            with_json_options(schema.clone()),
            lit(&close())
        ),
    }
}

/// A string value and its close: one of its choices, or text within its length bounds.
/// Value and close are one lexeme: text that may still grow into `</parameter>` cannot
/// be told from the close until the close is whole.
fn string_rule(name: &str, schema: &Value) -> String {
    let choices: Vec<&str> = schema
        .get("enum")
        .and_then(Value::as_array)
        .map(|e| e.iter().filter_map(Value::as_str).collect())
        .or_else(|| schema.get("const").and_then(Value::as_str).map(|c| vec![c]))
        .unwrap_or_default()
        .into_iter()
        .filter(|c| usable(c))
        .collect();
    if !choices.is_empty() {
        let alts: Vec<String> = choices
            .iter()
            .map(|c| lit(&format!("{c}{}", close())))
            .collect();
        return format!("{name}: {}\n", alts.join(" | "));
    }
    // A bound past MAX_BOUNDED_LENGTH is not written (a huge repetition count would make
    // the lexer's automaton huge), as for maxLength.
    let min = schema
        .get("minLength")
        .and_then(Value::as_u64)
        .filter(|&m| m <= MAX_BOUNDED_LENGTH)
        .unwrap_or(0);
    let max = schema
        .get("maxLength")
        .and_then(Value::as_u64)
        .filter(|&m| m <= MAX_BOUNDED_LENGTH);
    let bounds = match max {
        Some(max) => format!("{{{},{}}}", min.min(max), max),
        None => format!("{{{min},}}"),
    };
    let token = name.to_uppercase();
    let end = rx(&close());
    let forbidden: Vec<String> = [PARAMETER_END, PARAMETER, FUNCTION_END]
        .iter()
        .map(|f| rx(f))
        .collect();
    format!(
        "{name}: {token}\n{token}: /(?s:.){bounds}{end}/ & ~/(?s:.*)({})(?s:.*){end}/ & ~/[nN][uU][lL][lL]{end}/\n",
        forbidden.join("|")
    )
}

/// Whether a literal string value reads back as itself.
fn usable(s: &str) -> bool {
    ![PARAMETER_END, PARAMETER, FUNCTION_END]
        .iter()
        .any(|t| s.contains(t))
        && !s.eq_ignore_ascii_case("null")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parameters_in_schema_order_with_required_ones_present() {
        let f = Function {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1},
            }, "required": ["city", "days"]}),
            strict: true,
        };
        let g = function_rules(0, &f);
        assert!(
            g.starts_with(
                "f_0: \"get_weather>\\n\" p_0_0 p_0_1? p_0_2 \"</function>\\n</tool_call>\"\n"
            ),
            "{g}"
        );
        assert!(g.contains("p_0_0: \"<parameter=city>\\n\" v_0_0\n"), "{g}");
        assert!(
            g.contains("V_0_0: /(?s:.){0,16}\\n<\\/parameter>\\n/ & ~/"),
            "{g}"
        );
        assert!(
            g.contains("v_0_1: \"c\\n</parameter>\\n\" | \"f\\n</parameter>\\n\"\n"),
            "{g}"
        );
        assert!(g.contains("v_0_2: %json {"), "{g}");
    }

    #[test]
    fn undeclared_parameters_only_when_the_schema_allows_them() {
        let open = Function {
            name: "f".into(),
            parameters: json!({"type": "object"}),
            strict: false,
        };
        assert!(function_rules(0, &open).contains("p_0_any*"));
        let closed = Function {
            name: "f".into(),
            parameters: json!({"type": "object", "additionalProperties": false}),
            strict: true,
        };
        assert_eq!(
            function_rules(0, &closed),
            "f_0: \"f>\\n\" \"</function>\\n</tool_call>\"\n"
        );
    }

    #[test]
    fn length_bounds_past_the_limit_are_not_written() {
        let f = |min: u64, max: Option<u64>| {
            let mut p = json!({"type": "string", "minLength": min});
            if let Some(m) = max {
                p["maxLength"] = json!(m);
            }
            function_rules(
                0,
                &Function {
                    name: "f".into(),
                    parameters: json!({"type": "object", "properties": {"s": p},
                                       "required": ["s"]}),
                    strict: true,
                },
            )
        };
        assert!(f(3, Some(9)).contains("/(?s:.){3,9}"));
        assert!(f(5, None).contains("/(?s:.){5,}"));
        // A huge minimum (or maximum) is left out rather than written into the regex.
        let g = f(u64::MAX, None);
        assert!(g.contains("/(?s:.){0,}"), "{g}");
        assert!(!g.contains(&u64::MAX.to_string()), "{g}");
        let g = f(4097, Some(1_000_000));
        assert!(g.contains("/(?s:.){0,}"), "{g}");
    }
}
