//! The grammars that hold tool calls to their schemas (llguidance's lark syntax): the
//! parser's own wire format around each callable function's `parameters` schema, so
//! every call the model writes parses and its arguments validate.
//!
//! - [`call_grammar`]: `tool_choice` `required` or a named function; the output is calls.
//! - [`auto_grammar`]: `auto`; the output is free text until the parser's start marker
//!   appears (a lazy lexeme that ends at the marker), and from there it is calls, held
//!   like the above. Text may not spell a marker the parser would read as a call's start
//!   anywhere else, so every call the parser finds went through the grammar.

use super::lark::{lit, rx, without};
use super::{xml_grammar, Function, ToolParser};
use crate::reasoning::ReasoningParser;
use crate::structured::with_json_options;

/// Where a parser's calls sit in the output.
struct Layout {
    /// Text before the first call's function name (the same for every function).
    lead: &'static str,
    /// Text before each later call's function name.
    open: &'static str,
    /// Between one call's end and the next call's `open`.
    between: &'static str,
    /// After the last call.
    after: &'static str,
    /// What starts the calls under `auto`.
    trigger: Trigger,
}

enum Trigger {
    /// This text, anywhere (it is a prefix of `lead`); text may not contain any of
    /// `forbidden` (the trigger among them).
    Marker {
        marker: &'static str,
        forbidden: &'static [&'static str],
    },
    /// Calls only at the start of the output, after optional whitespace (text may not
    /// start with `{`).
    AtStart,
}

fn layout(parser: ToolParser) -> Option<Layout> {
    match parser {
        ToolParser::Hermes => Some(Layout {
            lead: "<tool_call>\n{\"name\": ",
            open: "<tool_call>\n{\"name\": ",
            between: "\n",
            after: "",
            trigger: Trigger::Marker {
                marker: "<tool_call>",
                forbidden: &["<tool_call>"],
            },
        }),
        ToolParser::Llama3Json => Some(Layout {
            lead: "{\"name\": ",
            open: "{\"name\": ",
            between: "; ",
            after: "",
            trigger: Trigger::AtStart,
        }),
        ToolParser::Mistral => Some(Layout {
            lead: "[TOOL_CALLS][{\"name\": ",
            open: "{\"name\": ",
            between: ", ",
            after: "]",
            trigger: Trigger::Marker {
                marker: "[TOOL_CALLS]",
                forbidden: &["[TOOL_CALLS]"],
            },
        }),
        ToolParser::Qwen3Xml => Some(Layout {
            lead: "<tool_call>\n<function=",
            open: "<tool_call>\n<function=",
            between: "\n",
            after: "",
            trigger: Trigger::Marker {
                marker: "<tool_call>",
                forbidden: &["<tool_call>", "<function="],
            },
        }),
        // Arguments are Python literals, not JSON: no schema grammar for them.
        ToolParser::Pythonic => None,
    }
}

/// The rules after a call's function name starts: `fn` is one of the callable
/// functions, each `f_i` its name, its arguments and the end of its call.
fn function_rules(parser: ToolParser, functions: &[&Function]) -> String {
    let mut g = String::new();
    let alts: Vec<String> = (0..functions.len()).map(|i| format!("f_{i}")).collect();
    g.push_str(&format!("fn: {}\n", alts.join(" | ")));
    for (i, f) in functions.iter().enumerate() {
        if parser == ToolParser::Qwen3Xml {
            g.push_str(&xml_grammar::function_rules(i, f));
            continue;
        }
        let (key, close) = match parser {
            ToolParser::Hermes => ("arguments", "}\n</tool_call>"),
            ToolParser::Llama3Json => ("parameters", "}"),
            _ => ("arguments", "}"),
        };
        let head = format!("{}, \"{key}\": ", lit(&f.name));
        g.push_str(&format!("f_{i}: {} args_{i} {}\n", lit(&head), lit(close)));
        let schema = with_json_options(f.parameters.clone());
        g.push_str(&format!("args_{i}: %json {schema}\n"));
    }
    g
}

/// The calls after `first` (the text that opens the first call's name): one call, or
/// several when `parallel`, then the layout's end.
fn calls(l: &Layout, first: &str, parallel: bool) -> String {
    let mut parts = Vec::new();
    if !first.is_empty() {
        parts.push(lit(first));
    }
    parts.push("fn".to_string());
    if parallel {
        parts.push(format!("({} {} fn)*", lit(l.between), lit(l.open)));
    }
    if !l.after.is_empty() {
        parts.push(lit(l.after));
    }
    parts.join(" ")
}

/// The grammar for `required` or a named function: calls of `functions` in `parser`'s
/// format (one, or several when `parallel`); `None` for a format that cannot be
/// enforced.
pub fn call_grammar(parser: ToolParser, functions: &[&Function], parallel: bool) -> Option<String> {
    let l = layout(parser)?;
    let mut g = format!("start: {}\n", calls(&l, l.lead, parallel));
    g.push_str(&function_rules(parser, functions));
    Some(g)
}

/// The grammar for `auto`: text, or text up to the parser's start marker and then calls
/// held as in [`call_grammar`]; `None` for a format that cannot be enforced.
pub fn auto_grammar(parser: ToolParser, functions: &[&Function], parallel: bool) -> Option<String> {
    let l = layout(parser)?;
    let mut g = String::new();
    match l.trigger {
        Trigger::Marker { marker, forbidden } => {
            let rest = l.lead.strip_prefix(marker).unwrap_or(l.lead);
            g.push_str(&format!(
                "start: TEXT | triggered {}\n",
                calls(&l, rest, parallel)
            ));
            g.push_str(&format!("TEXT: /(?s:.*)/ & {}\n", without(forbidden)));
            // Lazy: the lexeme ends at the marker's first appearance.
            g.push_str("triggered[lazy]: TRIGGERED\n");
            let others: Vec<&str> = forbidden.iter().copied().filter(|f| *f != marker).collect();
            let mut triggered = format!("TRIGGERED: /(?s:.*){}/", rx(marker));
            if !others.is_empty() {
                triggered.push_str(&format!(" & {}", without(&others)));
            }
            g.push_str(&triggered);
            g.push('\n');
        }
        Trigger::AtStart => {
            g.push_str(&format!("start: TEXT | LEAD {}\n", calls(&l, "", parallel)));
            g.push_str("TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*\\{(?s:.*)/\n");
            g.push_str(&format!("LEAD: /[ \\t\\r\\n]*{}/\n", rx(l.lead)));
        }
    }
    g.push_str(&function_rules(parser, functions));
    Some(g)
}

/// `grammar` held back until a reasoning model's thinking ends, as `reasoning` splits it:
/// `deepseek_r1` thinks first, up to `</think>` (the template may have opened the block);
/// `qwen3` may open with a `<think>` block. The thinking is free text (a lazy lexeme that
/// ends at the first `</think>`); the calls' grammar starts after it.
pub fn after_reasoning(grammar: &str, reasoning: ReasoningParser) -> String {
    let calls = grammar.replacen("start:", "calls:", 1);
    let start = match reasoning {
        ReasoningParser::DeepSeekR1 => "start: thinking SPACE? calls\n",
        ReasoningParser::Qwen3 => "start: (\"<think>\" thinking SPACE?)? calls\n",
    };
    format!(
        "{start}thinking[lazy]: THINKING\nTHINKING: /(?s:.*)<\\/think>/\nSPACE: /[ \\t\\r\\n]+/\n{calls}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Function {
        Function {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            strict: false,
        }
    }

    #[test]
    fn hermes_grammar_names_each_function() {
        let f = weather();
        let g = call_grammar(ToolParser::Hermes, &[&f], false).expect("hermes");
        assert!(
            g.starts_with("start: \"<tool_call>\\n{\\\"name\\\": \" fn\n"),
            "{g}"
        );
        assert!(
            g.contains(r#"f_0: "\"get_weather\", \"arguments\": " args_0 "}\n</tool_call>""#),
            "{g}"
        );
        assert!(g.contains("args_0: %json {"), "{g}");
        assert!(call_grammar(ToolParser::Pythonic, &[&f], true).is_none());
    }

    #[test]
    fn auto_grammars_trigger_on_the_marker() {
        let f = weather();
        let g = auto_grammar(ToolParser::Hermes, &[&f], true).expect("hermes");
        assert!(
            g.starts_with("start: TEXT | triggered \"\\n{\\\"name\\\": \" fn (\"\\n\" \"<tool_call>\\n{\\\"name\\\": \" fn)*\n"),
            "{g}"
        );
        assert!(g.contains("TRIGGERED: /(?s:.*)<tool_call>/\n"), "{g}");
        let g = auto_grammar(ToolParser::Qwen3Xml, &[&f], false).expect("xml");
        assert!(
            g.contains("TRIGGERED: /(?s:.*)<tool_call>/ & ~/(?s:.*)(<function=)(?s:.*)/"),
            "{g}"
        );
        let g = auto_grammar(ToolParser::Mistral, &[&f], false).expect("mistral");
        assert!(g.contains(r"TRIGGERED: /(?s:.*)\[TOOL_CALLS\]/"), "{g}");
        assert!(
            g.starts_with("start: TEXT | triggered \"[{\\\"name\\\": \" fn \"]\""),
            "{g}"
        );
        let g = auto_grammar(ToolParser::Llama3Json, &[&f], false).expect("llama");
        assert!(g.starts_with("start: TEXT | LEAD fn\n"), "{g}");
    }

    #[test]
    fn calls_after_the_thinking() {
        let f = weather();
        let g = call_grammar(ToolParser::Hermes, &[&f], false).expect("hermes");
        let r1 = after_reasoning(&g, ReasoningParser::DeepSeekR1);
        assert!(
            r1.starts_with("start: thinking SPACE? calls\nthinking[lazy]: THINKING\nTHINKING: /(?s:.*)<\\/think>/\n"),
            "{r1}"
        );
        assert_eq!(r1.matches("start:").count(), 1, "{r1}");
        let q = after_reasoning(&g, ReasoningParser::Qwen3);
        assert!(
            q.starts_with("start: (\"<think>\" thinking SPACE?)? calls\n"),
            "{q}"
        );
        assert!(q.contains("\ncalls: \"<tool_call>"), "{q}");
    }
}
