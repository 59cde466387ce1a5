//! Tool calling through the HTTP server in process, on the default 135M model with
//! `--enable-auto-tool-choice --tool-call-parser hermes` (and `qwen3_xml`): `required` at
//! temperature 1.0 always gives a call whose arguments validate, a named function is the
//! one called (streamed as OpenAI streams calls), under `auto` every call the model starts
//! validates, the whole call / result / answer loop, and each bad input is an
//! OpenAI-shaped 400 naming its field.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Instant;

use common::post;
use serde_json::{json, Value};
use strata_engine::options::ToolOptions;
use strata_engine::reasoning::ReasoningParser;
use strata_engine::server::EngineOptions;
use strata_engine::tools::ToolParser;

const MODEL: &str = "smollm2-135m-instruct";

fn serve_with(parser: ToolParser) -> SocketAddr {
    common::serve(&EngineOptions {
        tools: ToolOptions {
            auto_tool_choice: true,
            parser: Some(parser),
            chat_template: None,
            reasoning_parser: None,
        },
        ..Default::default()
    })
}

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| serve_with(ToolParser::Hermes))
}

fn xml_server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| serve_with(ToolParser::Qwen3Xml))
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city", "unit"],
                "additionalProperties": false
            }
        }},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "The time in a timezone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 16}},
                "required": ["timezone"]
            },
            "strict": true
        }}
    ])
}

/// Checks `args` against one of [`tools`]' schemas (the keywords they use).
fn validate(name: &str, args: &Value) -> Result<(), String> {
    let tools = tools();
    let schema = tools
        .as_array()
        .and_then(|t| t.iter().find(|t| t["function"]["name"] == name))
        .map(|t| t["function"]["parameters"].clone())
        .ok_or_else(|| format!("unknown function {name}"))?;
    let obj = args.as_object().ok_or("arguments are not an object")?;
    let props = schema["properties"].as_object().ok_or("schema")?;
    for req in schema["required"].as_array().ok_or("schema")? {
        let req = req.as_str().ok_or("schema")?;
        if !obj.contains_key(req) {
            return Err(format!("missing {req} in {args}"));
        }
    }
    for (k, v) in obj {
        let Some(p) = props.get(k) else {
            return Err(format!("unexpected property {k} in {args}"));
        };
        let s = v.as_str().ok_or(format!("{k} is not a string in {args}"))?;
        if let Some(max) = p["maxLength"].as_u64() {
            if s.chars().count() as u64 > max {
                return Err(format!("{k} longer than {max} in {args}"));
            }
        }
        if let Some(e) = p["enum"].as_array() {
            if !e.contains(v) {
                return Err(format!("{k} not in its enum in {args}"));
            }
        }
    }
    Ok(())
}

fn request(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}],
        "tools": tools(),
        "max_tokens": 64,
        "temperature": 1.0,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// The one call of a choice, checked: its shape, finish reason and arguments.
fn the_call(resp: &Value) -> Value {
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{resp}");
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert_eq!(calls.len(), 1, "{resp}");
    let call = &calls[0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().is_some_and(|s| !s.is_empty()), "{call}");
    let name = call["function"]["name"].as_str().expect("name");
    let args: Value = serde_json::from_str(
        call["function"]["arguments"]
            .as_str()
            .expect("arguments string"),
    )
    .expect("arguments are JSON");
    if let Err(e) = validate(name, &args) {
        panic!("{e}: {resp}");
    }
    call.clone()
}

/// `count` seeded requests, five at a time, each `extra` plus its seed; the answers.
fn seeded(addr: SocketAddr, count: u64, extra: Value) -> Vec<Value> {
    let per = count.div_ceil(5);
    let handles: Vec<_> = (0..5u64)
        .map(|w| {
            let extra = extra.clone();
            std::thread::spawn(move || {
                (w * per..((w + 1) * per).min(count))
                    .map(|seed| {
                        let mut body = request(extra.clone());
                        body["seed"] = json!(seed);
                        let (status, resp) = post(addr, "/v1/chat/completions", &body);
                        assert_eq!(status, 200, "{resp}");
                        resp
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    handles
        .into_iter()
        .flat_map(|h| h.join().expect("worker"))
        .collect()
}

#[test]
fn required_calls_validate_at_temperature_one() {
    let t = Instant::now();
    let answers = seeded(
        server(),
        50,
        json!({"tool_choice": "required", "parallel_tool_calls": false}),
    );
    let names: Vec<Value> = answers
        .iter()
        .map(|resp| the_call(resp)["function"]["name"].clone())
        .collect();
    assert_eq!(names.len(), 50);
    eprintln!(
        "50 required calls in {:.1} s ({} get_weather)",
        t.elapsed().as_secs_f64(),
        names.iter().filter(|n| *n == "get_weather").count()
    );
}

#[test]
fn qwen3_xml_required_calls_validate_at_temperature_one() {
    let t = Instant::now();
    let answers = seeded(
        xml_server(),
        20,
        json!({"tool_choice": "required", "parallel_tool_calls": false}),
    );
    for resp in &answers {
        the_call(resp);
    }
    eprintln!(
        "20 qwen3_xml required calls in {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

/// A conversation that shows the model hermes' call format (an earlier turn answered
/// with a call, as text), so it starts calls by itself under `auto`.
fn few_shot() -> Value {
    json!([
        {"role": "system", "content": "To call a tool, answer with <tool_call>\n{\"name\": NAME, \"arguments\": ARGS}\n</tool_call>."},
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"unit\": \"celsius\"}}\n</tool_call>"},
        {"role": "user", "content": "And what is the weather in Paris?"},
    ])
}

#[test]
fn auto_calls_the_model_starts_validate_at_temperature_one() {
    let answers = seeded(
        server(),
        30,
        json!({
            "messages": few_shot(),
            "tool_choice": "auto",
            "parallel_tool_calls": false,
            "max_tokens": 96,
        }),
    );
    let mut calls = 0;
    for resp in &answers {
        let choice = &resp["choices"][0];
        if choice["message"]["tool_calls"].is_array() {
            the_call(resp);
            calls += 1;
        } else if choice["finish_reason"] != "length" {
            // A call the model started is held to the format, so none ends up as text.
            let content = choice["message"]["content"].as_str().unwrap_or_default();
            assert!(!content.contains("<tool_call>"), "{resp}");
        }
    }
    eprintln!("auto: {calls} of 30 answers called a tool");
    assert!(
        calls > 0,
        "no answer started a call: the check above checked nothing"
    );
}

#[test]
fn named_function_is_called_and_streams_as_openai_does() {
    named_call_streams(server());
}

#[test]
fn qwen3_xml_named_function_streams_to_the_whole_answer() {
    named_call_streams(xml_server());
}

fn named_call_streams(addr: SocketAddr) {
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let (status, resp) = post(
        addr,
        "/v1/chat/completions",
        &request(json!({"tool_choice": named, "seed": 7})),
    );
    assert_eq!(status, 200, "{resp}");
    let call = the_call(&resp);
    assert_eq!(call["function"]["name"], "get_time");
    assert!(resp["choices"][0]["message"]["content"].is_null(), "{resp}");

    let body = request(json!({"tool_choice": named, "seed": 7, "stream": true}));
    let (status, text) = common::request(
        addr,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    let mut args = String::new();
    let mut first: Option<Value> = None;
    let mut finish = Value::Null;
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(line).expect("chunk");
        let choice = &chunk["choices"][0];
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
        for tc in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert_eq!(tc["index"], 0, "{tc}");
            if first.is_none() {
                first = Some(tc.clone());
            } else {
                assert!(
                    tc.get("id").is_none(),
                    "only the first delta has an id: {tc}"
                );
            }
            args.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    let first = first.expect("a tool-call delta");
    assert_eq!(first["type"], "function");
    assert_eq!(first["function"]["name"], "get_time");
    assert!(first["id"].is_string());
    assert_eq!(finish, "tool_calls");
    // Same seed, same call: the stream reassembles to the whole answer's arguments.
    assert_eq!(
        args,
        call["function"]["arguments"].as_str().unwrap_or_default()
    );
}

#[test]
fn call_result_answer_loop() {
    let addr = server();
    let (status, resp) = post(
        addr,
        "/v1/chat/completions",
        &request(json!({"tool_choice": "required", "parallel_tool_calls": false, "seed": 3})),
    );
    assert_eq!(status, 200, "{resp}");
    let call = the_call(&resp);
    let body = request(json!({
        "messages": [
            {"role": "user", "content": "What is the weather in Paris, and what time is it there?"},
            {"role": "assistant", "content": null, "tool_calls": [call.clone()]},
            {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees and sunny; 14:05"},
        ],
        "tool_choice": "none",
        "temperature": 0.0,
        "max_tokens": 24,
    }));
    let (status, resp) = post(addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{resp}");
    let message = &resp["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none(), "{resp}");
    assert!(
        message["content"]
            .as_str()
            .is_some_and(|c| !c.trim().is_empty()),
        "a final answer in words: {resp}"
    );
}

fn assert_400(resp: &(u16, Value), param: &str) {
    let (status, body) = resp;
    assert_eq!(*status, 400, "{body}");
    let e = &body["error"];
    assert_eq!(e["param"], param, "{body}");
    assert_eq!(e["type"], "invalid_request_error", "{body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e.get("code").is_some(), "{body}");
}

#[test]
fn bad_tool_input_is_a_400_naming_the_field() {
    let addr = server();
    let chat = |extra: Value| post(addr, "/v1/chat/completions", &request(extra));
    let bad_schema =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]);
    assert_400(
        &chat(json!({"tools": bad_schema})),
        "tools[0].function.parameters",
    );
    let not_object = json!([{"type": "function", "function": {"name": "f", "parameters": [1]}}]);
    assert_400(
        &chat(json!({"tools": not_object})),
        "tools[0].function.parameters",
    );
    let unknown = json!({"type": "function", "function": {"name": "nope"}});
    assert_400(&chat(json!({"tool_choice": unknown})), "tool_choice");
    assert_400(
        &chat(json!({"tools": [], "tool_choice": "required"})),
        "tool_choice",
    );
    let many: Vec<Value> = (0..129)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    assert_400(&chat(json!({"tools": many})), "tools");
    let huge = "x".repeat(300 * 1024);
    let big = json!([{"type": "function", "function": {"name": "f", "description": huge}}]);
    assert_400(&chat(json!({"tools": big})), "tools");
    assert_400(&chat(json!({"tool_choice": "sometimes"})), "tool_choice");
    let bad_name = json!([{"type": "function", "function": {"name": "a b"}}]);
    assert_400(&chat(json!({"tools": bad_name})), "tools[0].function.name");
    // The server still answers after all of that.
    let (status, _) = chat(json!({"tool_choice": "none", "max_tokens": 2}));
    assert_eq!(status, 200);
}

#[test]
fn without_the_flags_auto_and_required_are_refused_as_vllm_does() {
    let addr = common::serve(&EngineOptions::default());
    let (status, body) = post(
        addr,
        "/v1/chat/completions",
        &request(json!({"tool_choice": "auto"})),
    );
    assert_400(&(status, body.clone()), "tool_choice");
    assert!(
        body["error"]["message"].as_str().is_some_and(
            |m| m.contains("--enable-auto-tool-choice") && m.contains("--tool-call-parser")
        ),
        "{body}"
    );
    let (status, body) = post(
        addr,
        "/v1/chat/completions",
        &request(json!({"tool_choice": "required"})),
    );
    assert_400(&(status, body.clone()), "tool_choice");
    // Tools without tool_choice: rendered, not parsed (vLLM's default without the flag).
    let (status, body) = post(
        addr,
        "/v1/chat/completions",
        &request(json!({"max_tokens": 4})),
    );
    assert_eq!(status, 200, "{body}");
    assert!(body["choices"][0]["message"].get("tool_calls").is_none());
}

#[test]
fn with_a_reasoning_parser_required_calls_come_after_the_thinking() {
    // qwen3's reasoning may open the answer with a <think> block; the call's grammar
    // starts after it. The 135M model is no reasoning model: some answers think until
    // max_tokens cuts them. Every answer is a call that validates, or thinking that was
    // cut; never text, never a broken call.
    let addr = common::serve(&EngineOptions {
        tools: ToolOptions {
            auto_tool_choice: true,
            parser: Some(ToolParser::Hermes),
            chat_template: None,
            reasoning_parser: Some(ReasoningParser::Qwen3),
        },
        ..Default::default()
    });
    let answers = seeded(
        addr,
        10,
        json!({"tool_choice": "required", "parallel_tool_calls": false, "max_tokens": 96}),
    );
    let mut calls = 0;
    for resp in &answers {
        let choice = &resp["choices"][0];
        if choice["finish_reason"] == "tool_calls" {
            the_call(resp);
            calls += 1;
        } else {
            assert_eq!(choice["finish_reason"], "length", "{resp}");
            assert!(choice["message"]["content"].is_null(), "{resp}");
            assert!(choice["message"]["reasoning_content"].is_string(), "{resp}");
        }
    }
    eprintln!("with qwen3 reasoning: {calls} of 10 answers called");
    assert!(calls > 0, "no answer got past its thinking");
}
