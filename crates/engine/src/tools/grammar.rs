//! The grammar that enforces `tool_choice: "required"` or a named function: the parser's
//! own wire format around each callable function's `parameters` schema (llguidance's
//! lark syntax with `%json` rules), so every call the model writes parses and its
//! arguments validate.

use serde_json::Value;

use super::{Function, ToolParser};
use crate::structured::with_json_options;

/// The wire format of one parser: text before the calls, around each call's name and
/// arguments, between calls, and after them.
struct Wire {
    before: &'static str,
    open: &'static str,
    /// Between the name and the arguments.
    mid: &'static str,
    close: &'static str,
    between: &'static str,
    after: &'static str,
}

fn wire(parser: ToolParser) -> Option<Wire> {
    match parser {
        ToolParser::Hermes => Some(Wire {
            before: "",
            open: "<tool_call>\n{\"name\": ",
            mid: ", \"arguments\": ",
            close: "}\n</tool_call>",
            between: "\n",
            after: "",
        }),
        ToolParser::Llama3Json => Some(Wire {
            before: "",
            open: "{\"name\": ",
            mid: ", \"parameters\": ",
            close: "}",
            between: "; ",
            after: "",
        }),
        ToolParser::Mistral => Some(Wire {
            before: "[TOOL_CALLS][",
            open: "{\"name\": ",
            mid: ", \"arguments\": ",
            close: "}",
            between: ", ",
            after: "]",
        }),
        // Arguments are Python literals, not JSON: no schema grammar for them.
        ToolParser::Pythonic => None,
    }
}

fn lit(s: &str) -> String {
    Value::from(s).to_string()
}

/// The lark grammar for calls of `functions` in `parser`'s format (one call, or several
/// when `parallel`); `None` for a parser whose format cannot be enforced.
pub fn call_grammar(parser: ToolParser, functions: &[&Function], parallel: bool) -> Option<String> {
    let w = wire(parser)?;
    let mut g = String::new();
    let calls = if parallel {
        format!("call ({} call)*", lit(w.between))
    } else {
        "call".to_string()
    };
    let mut start = vec![calls];
    if !w.before.is_empty() {
        start.insert(0, lit(w.before));
    }
    if !w.after.is_empty() {
        start.push(lit(w.after));
    }
    g.push_str(&format!("start: {}\n", start.join(" ")));
    let alts: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, f) in functions.iter().enumerate() {
        let head = format!("{}{}{}", w.open, lit(&f.name), w.mid);
        g.push_str(&format!(
            "call_{i}: {} args_{i} {}\n",
            lit(&head),
            lit(w.close)
        ));
        let schema = with_json_options(f.parameters.clone());
        g.push_str(&format!("args_{i}: %json {schema}\n"));
    }
    Some(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hermes_grammar_names_each_function() {
        let f = Function {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            strict: false,
        };
        let g = call_grammar(ToolParser::Hermes, &[&f], false).expect("hermes");
        assert!(g.starts_with("start: call\n"), "{g}");
        assert!(
            g.contains(
                r#"call_0: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " args_0"#
            ),
            "{g}"
        );
        assert!(g.contains("args_0: %json {"), "{g}");
        assert!(call_grammar(ToolParser::Pythonic, &[&f], true).is_none());
    }
}
