//! The tool-call grammars on the default model's tokenizer, token by token: for each
//! enforceable parser, `required` passes a call written in the parser's wire format (and
//! the parser reads it back into arguments that validate) and refuses a call that breaks
//! the schema; `auto` passes plain text, passes text followed by a valid call, and refuses
//! a call that breaks the schema once the parser's start marker has appeared.

mod common;

use std::sync::{Arc, OnceLock};

use serde_json::{json, Value};
use strata_engine::reasoning::ReasoningParser;
use strata_engine::structured::{GrammarCompiler, GrammarStep};
use strata_engine::tokenizer::Tokenizer;
use strata_engine::tools::{after_reasoning, auto_grammar, call_grammar, Function, ToolParser};

fn compiler() -> &'static (Arc<Tokenizer>, GrammarCompiler) {
    static C: OnceLock<(Arc<Tokenizer>, GrammarCompiler)> = OnceLock::new();
    C.get_or_init(|| {
        let tokenizer =
            Arc::new(Tokenizer::from_gguf_path(common::model_path()).expect("tokenizer"));
        let compiler = GrammarCompiler::new(tokenizer.clone()).expect("compiler");
        (tokenizer, compiler)
    })
}

fn functions() -> Vec<Function> {
    vec![
        Function {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            }, "required": ["city", "unit"], "additionalProperties": false}),
            strict: true,
        },
        Function {
            name: "get_time".into(),
            parameters: json!({"type": "object", "properties": {
                "timezone": {"type": "string"}}, "required": ["timezone"]}),
            strict: false,
        },
    ]
}

/// Where a text's walk through a grammar ended.
#[derive(Debug, PartialEq)]
enum Walk {
    /// Every token passed; whether the grammar accepts the whole text.
    Passed { accepting: bool },
    /// The grammar refused the token that starts at this byte.
    Refused(usize),
}

fn walk(lark: &str, text: &str) -> Walk {
    let (tokenizer, compiler) = compiler();
    let mut g = compiler
        .compile_lark(lark)
        .unwrap_or_else(|e| panic!("{e}\n{lark}"));
    let tokens = tokenizer.encode(text, false, false).expect("encode");
    let mut at = 0;
    for (i, &tok) in tokens.iter().enumerate() {
        if !g.is_allowed(tok).expect("mask") {
            return Walk::Refused(at);
        }
        let step = g.accept(tok).expect("accept");
        at += tokenizer.decode(&[tok], false).expect("decode").len();
        if step == GrammarStep::Done {
            return Walk::Passed {
                accepting: i + 1 == tokens.len(),
            };
        }
    }
    Walk::Passed {
        accepting: g.is_accepting(),
    }
}

/// A call of `get_weather` in each format: valid (Paris, celsius, 3 days) or with a unit
/// outside its enum.
fn call(parser: ToolParser, unit: &str) -> String {
    match parser {
        ToolParser::Hermes => format!(
            "<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\", \"unit\": \"{unit}\", \"days\": 3}}}}\n</tool_call>"
        ),
        ToolParser::Llama3Json => format!(
            "{{\"name\": \"get_weather\", \"parameters\": {{\"city\": \"Paris\", \"unit\": \"{unit}\", \"days\": 3}}}}"
        ),
        ToolParser::Mistral => format!(
            "[TOOL_CALLS][{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\", \"unit\": \"{unit}\", \"days\": 3}}}}]"
        ),
        ToolParser::Qwen3Xml => format!(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n{unit}\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        ),
        ToolParser::Pythonic => unreachable!("not enforced"),
    }
}

const ENFORCED: [ToolParser; 4] = [
    ToolParser::Hermes,
    ToolParser::Llama3Json,
    ToolParser::Mistral,
    ToolParser::Qwen3Xml,
];

#[test]
fn required_grammars_pass_valid_calls_and_refuse_wrong_ones() {
    let fs = functions();
    let refs: Vec<&Function> = fs.iter().collect();
    for parser in ENFORCED {
        let g = call_grammar(parser, &refs, false).expect("enforceable");
        let good = call(parser, "celsius");
        assert_eq!(
            walk(&g, &good),
            Walk::Passed { accepting: true },
            "{parser:?}: {good}"
        );
        let parsed = parser.parse(&good, &fs, || "id".into());
        assert_eq!(parsed.calls.len(), 1, "{parser:?}: {parsed:?}");
        let args: Value = serde_json::from_str(&parsed.calls[0].arguments).expect("JSON");
        assert_eq!(
            args,
            json!({"city": "Paris", "unit": "celsius", "days": 3}),
            "{parser:?}"
        );
        let bad = call(parser, "kelvin");
        assert!(
            matches!(walk(&g, &bad), Walk::Refused(_)),
            "{parser:?} passed {bad}"
        );
        // Plain text is not a call.
        assert!(
            matches!(walk(&g, "It is sunny."), Walk::Refused(0)),
            "{parser:?}"
        );
    }
    // Parallel: two calls joined by the format's separator.
    let g = call_grammar(ToolParser::Qwen3Xml, &refs, true).expect("xml");
    let two = format!(
        "{}\n<tool_call>\n<function=get_time>\n<parameter=timezone>\nCET\n</parameter>\n</function>\n</tool_call>",
        call(ToolParser::Qwen3Xml, "celsius")
    );
    assert_eq!(walk(&g, &two), Walk::Passed { accepting: true });
    // A required parameter left out, an undeclared one under strict: refused.
    let missing = "<tool_call>\n<function=get_weather>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>";
    assert!(matches!(walk(&g, missing), Walk::Refused(_)));
    let extra = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=wind>\n";
    assert!(matches!(walk(&g, extra), Walk::Refused(_)));
}

#[test]
fn auto_grammars_free_text_until_the_marker_then_hold_the_call() {
    let fs = functions();
    let refs: Vec<&Function> = fs.iter().collect();
    for parser in ENFORCED {
        let g = auto_grammar(parser, &refs, false).expect("enforceable");
        let text = "Let me check the weather for you <b>now</b>. ";
        assert_eq!(
            walk(&g, text),
            Walk::Passed { accepting: true },
            "{parser:?}: plain text"
        );
        // Llama 3 calls come only at the start; the others after any text.
        let lead = if parser == ToolParser::Llama3Json {
            ""
        } else {
            text
        };
        let good = format!("{lead}{}", call(parser, "celsius"));
        assert_eq!(
            walk(&g, &good),
            Walk::Passed { accepting: true },
            "{parser:?}: {good}"
        );
        let parsed = parser.parse(&good, &fs, || "id".into());
        assert_eq!(parsed.calls.len(), 1, "{parser:?}: {parsed:?}");
        let bad = format!("{lead}{}", call(parser, "kelvin"));
        assert!(
            matches!(walk(&g, &bad), Walk::Refused(at) if at > lead.len()),
            "{parser:?} passed {bad}"
        );
    }
    // Qwen3 XML: a bare `<function=` (which the parser would read as a call) cannot be
    // written as text.
    let g = auto_grammar(ToolParser::Qwen3Xml, &refs, true).expect("xml");
    assert!(matches!(
        walk(&g, "Sure: <function=get_time>"),
        Walk::Refused(_)
    ));
    // Llama 3: text cannot start with `{` unless it is a call.
    let g = auto_grammar(ToolParser::Llama3Json, &refs, true).expect("llama");
    assert!(matches!(walk(&g, "{\"answer\": 42}"), Walk::Refused(_)));
    assert_eq!(
        walk(&g, "The answer is {42}."),
        Walk::Passed { accepting: true }
    );
}

#[test]
fn with_a_reasoning_parser_the_call_comes_after_the_thinking() {
    let fs = functions();
    let refs: Vec<&Function> = fs.iter().collect();
    let call = call(ToolParser::Hermes, "celsius");
    let g = call_grammar(ToolParser::Hermes, &refs, false).expect("hermes");
    // deepseek_r1: thinking first (the template opened the block), then the call.
    let r1 = after_reasoning(&g, ReasoningParser::DeepSeekR1);
    let thought = format!("The user wants <b>weather</b>; call it.</think>\n\n{call}");
    assert_eq!(walk(&r1, &thought), Walk::Passed { accepting: true });
    let wrong = "Thinking.</think>\n\nIt is sunny.";
    assert!(matches!(walk(&r1, wrong), Walk::Refused(_)));
    // Without `</think>` a call is still thinking, not an answer.
    assert_eq!(walk(&r1, &call), Walk::Passed { accepting: false });
    // qwen3: a `<think>` block or none.
    let q = after_reasoning(&g, ReasoningParser::Qwen3);
    assert_eq!(walk(&q, &call), Walk::Passed { accepting: true });
    let thought = format!("<think>\nWeather, so get_weather.\n</think>\n\n{call}");
    assert_eq!(walk(&q, &thought), Walk::Passed { accepting: true });
    assert!(matches!(walk(&q, "Sure!"), Walk::Refused(_)));
}
