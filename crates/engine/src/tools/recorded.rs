//! Every parser on the default model's own outputs in its format
//! (`tests/fixtures/tool_outputs/recorded.json`, made by `record.py` there), plus vLLM
//! 0.32's recorded hermes answer: streamed in several chunkings the deltas reassemble to
//! the whole answer; an answer the engine finished as `tool_calls` parses into calls whose
//! arguments validate against the request's schemas; one that ended as text is all
//! content, and so is one cut by `max_tokens` inside a call.

use serde_json::Value;

use super::test_util::check_all_chunkings_with;
use super::{plan_tools, Function, ToolParser};

const RECORDED: &str = include_str!("../../tests/fixtures/tool_outputs/recorded.json");

/// `args` against `schema` for the keywords the recorded tools use.
fn validate(schema: &Value, args: &Value) -> Result<(), String> {
    let obj = args.as_object().ok_or("arguments are not an object")?;
    let props = schema["properties"].as_object().ok_or("schema")?;
    for req in schema["required"].as_array().into_iter().flatten() {
        let req = req.as_str().ok_or("schema")?;
        if !obj.contains_key(req) {
            return Err(format!("missing {req}"));
        }
    }
    for (k, v) in obj {
        let Some(p) = props.get(k) else {
            if schema["additionalProperties"] == Value::Bool(false) {
                return Err(format!("undeclared {k}"));
            }
            continue;
        };
        match p["type"].as_str() {
            Some("string") => {
                let s = v.as_str().ok_or(format!("{k} is not a string"))?;
                if p["maxLength"]
                    .as_u64()
                    .is_some_and(|m| s.chars().count() as u64 > m)
                {
                    return Err(format!("{k} is too long"));
                }
                if p["enum"].as_array().is_some_and(|e| !e.contains(v)) {
                    return Err(format!("{k} is outside its enum"));
                }
            }
            Some("integer") => {
                let n = v.as_i64().ok_or(format!("{k} is not an integer"))?;
                let lo = p["minimum"].as_i64().unwrap_or(i64::MIN);
                let hi = p["maximum"].as_i64().unwrap_or(i64::MAX);
                if n < lo || n > hi {
                    return Err(format!("{k} is out of range"));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[test]
fn the_models_recorded_outputs_in_every_format() {
    let recorded: Value = serde_json::from_str(RECORDED).expect("fixture");
    let tools = &recorded["tools"];
    let mut seen = std::collections::BTreeMap::new();
    for o in recorded["outputs"].as_array().expect("outputs") {
        let name = o["parser"].as_str().expect("parser");
        let parser = ToolParser::from_name(name).expect("known parser");
        let text = o["text"].as_str().expect("text");
        let what = format!("{name} {} seed {}: {text:?}", o["mode"], o["seed"]);
        let functions: Vec<Function> = plan_tools(true, Some(parser), Some(tools), None, None)
            .expect("tools")
            .functions;
        if o["finish_reason"] == "length" {
            // Cut by max_tokens: the whole answer is content when a call is cut (a stream
            // keeps the calls it already sent: `stream.rs`).
            let parsed = parser.parse(text, &functions, || "id".into());
            if text.contains(match parser {
                ToolParser::Mistral => "[TOOL_CALLS]",
                ToolParser::Pythonic => "[",
                _ => "<tool_call>",
            }) {
                assert!(parsed.calls.is_empty(), "{what}");
                assert_eq!(parsed.content.as_deref(), Some(text), "{what}");
            }
            continue;
        }
        let parsed = check_all_chunkings_with(parser, text, &functions);
        if o["finish_reason"] == "tool_calls" {
            assert!(!parsed.calls.is_empty(), "{what}");
            for call in &parsed.calls {
                let f = functions
                    .iter()
                    .find(|f| f.name == call.name)
                    .unwrap_or_else(|| panic!("unknown function in {what}"));
                let args: Value = serde_json::from_str(&call.arguments).expect("JSON");
                if let Err(e) = validate(&f.parameters, &args) {
                    panic!("{e}: {} in {what}", call.arguments);
                }
            }
            *seen.entry(name).or_insert(0) += 1;
        } else {
            assert!(parsed.calls.is_empty(), "{what}");
            assert_eq!(parsed.content.as_deref(), Some(text), "{what}");
        }
    }
    // Every parser has calls among its recordings.
    for name in ToolParser::NAMES {
        assert!(seen.get(name).is_some_and(|&n| n > 0), "{name}: {seen:?}");
    }
}

#[test]
fn vllm_recorded_hermes_answers_are_content() {
    // vLLM 0.32 with --tool-call-parser hermes on the same model
    // (../shared/peers/fixtures/vllm-0.32/api/tool_required.json and tool_named.json):
    // a truncated call whose arguments are a bare string is no call.
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"Paris\"}\n</";
    let p = check_all_chunkings_with(ToolParser::Hermes, text, &[]);
    assert!(p.calls.is_empty());
    assert_eq!(p.content.as_deref(), Some(text));
}
