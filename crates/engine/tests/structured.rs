//! Structured outputs on the default model, through the HTTP server in process: for 20
//! schemas every output parses and validates, at temperature 0 and 1, alone and batched
//! with unconstrained requests; regexes and choices hold; constraints that cannot be
//! enforced are a 400 naming the problem; and the grammar masks every token of a wrong
//! document while passing every token of a right one (with the mask time measured).

mod common;

use common::post;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use strata_api::validate::StructuredOutput;
use strata_engine::server::EngineOptions;
use strata_engine::structured::{GrammarCompiler, GrammarStep};
use strata_engine::tokenizer::Tokenizer;

const MODEL: &str = "smollm2-135m-instruct";

fn start(opts: EngineOptions) -> SocketAddr {
    common::serve(&opts)
}

fn chat(content: &str, temperature: f64, seed: u64, extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 300,
        "temperature": temperature,
        "seed": seed,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

fn with_schema(name: &str, schema: &Value) -> Value {
    json!({"response_format": {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": schema, "strict": true}
    }})
}

/// A JSON-schema checker for the keywords the test schemas use (enough to fail on any
/// violation of them).
fn validate(schema: &Value, v: &Value, root: &Value, path: &str) -> Result<(), String> {
    let err = |m: String| Err(format!("{path}: {m} (value {v})"));
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.trim_start_matches("#/$defs/");
        return validate(&root["$defs"][name], v, root, path);
    }
    if let Some(alts) = schema.get("anyOf").and_then(Value::as_array) {
        if !alts.iter().any(|s| validate(s, v, root, path).is_ok()) {
            return err("matches no anyOf alternative".into());
        }
    }
    if let Some(c) = schema.get("const") {
        if c != v {
            return err(format!("is not the const {c}"));
        }
    }
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return err("is not in the enum".into());
        }
    }
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let ok = types.iter().any(|t| match *t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            // JSON Schema: any number with no fractional part (`-0` included).
            "integer" => v.as_f64().is_some_and(|x| x.fract() == 0.0),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            _ => false,
        });
        if !ok {
            return err(format!("is not of type {t}"));
        }
    }
    if let Some(x) = v.as_f64() {
        let bound = |k: &str| schema.get(k).and_then(Value::as_f64);
        if bound("minimum").is_some_and(|m| x < m)
            || bound("maximum").is_some_and(|m| x > m)
            || bound("exclusiveMinimum").is_some_and(|m| x <= m)
            || bound("exclusiveMaximum").is_some_and(|m| x >= m)
        {
            return err("is out of bounds".into());
        }
    }
    if let Some(s) = v.as_str() {
        let n = s.chars().count() as u64;
        let len = |k: &str| schema.get(k).and_then(Value::as_u64);
        if len("minLength").is_some_and(|m| n < m) || len("maxLength").is_some_and(|m| n > m) {
            return err("has a length out of bounds".into());
        }
    }
    if let Some(a) = v.as_array() {
        let n = a.len() as u64;
        let len = |k: &str| schema.get(k).and_then(Value::as_u64);
        if len("minItems").is_some_and(|m| n < m) || len("maxItems").is_some_and(|m| n > m) {
            return err("has an item count out of bounds".into());
        }
        if let Some(items) = schema.get("items") {
            for (i, x) in a.iter().enumerate() {
                validate(items, x, root, &format!("{path}[{i}]"))?;
            }
        }
    }
    if let Some(o) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        for r in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let r = r.as_str().unwrap_or_default();
            if !o.contains_key(r) {
                return err(format!("lacks required '{r}'"));
            }
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(s) => validate(s, x, root, &format!("{path}.{k}"))?,
                None if schema.get("additionalProperties") == Some(&json!(false)) => {
                    return err(format!("has extra property '{k}'"));
                }
                None => {}
            }
        }
    }
    Ok(())
}

/// (what to ask for, schema): nested objects, arrays, enums, bounded numbers, required,
/// anyOf, `$ref`, const, nullable types, top-level arrays and scalars.
fn schemas() -> Vec<(&'static str, Value)> {
    let int = |lo: i64, hi: i64| json!({"type": "integer", "minimum": lo, "maximum": hi});
    let s = |max: u64| json!({"type": "string", "maxLength": max});
    vec![
        (
            "a person with a name and an age",
            json!({"type": "object", "properties": {"name": s(20), "age": int(0, 120)},
                   "required": ["name", "age"], "additionalProperties": false}),
        ),
        (
            "a person with an address",
            json!({"type": "object", "properties": {
                "name": s(20),
                "address": {"type": "object", "properties": {
                    "street": s(30), "city": s(20), "zip": int(10000, 99999)},
                    "required": ["street", "city", "zip"], "additionalProperties": false}},
                "required": ["name", "address"], "additionalProperties": false}),
        ),
        (
            "tags for a blog post about cooking",
            json!({"type": "object", "properties": {"tags": {"type": "array", "items": s(12),
                   "minItems": 1, "maxItems": 4}}, "required": ["tags"],
                   "additionalProperties": false}),
        ),
        (
            "the colour of the sky",
            json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                   "required": ["color"], "additionalProperties": false}),
        ),
        (
            "a confidence score",
            json!({"type": "object", "properties": {"score": {"type": "number", "minimum": 0,
                   "maximum": 1}}, "required": ["score"], "additionalProperties": false}),
        ),
        (
            "whether it worked",
            json!({"type": "object", "properties": {"ok": {"type": "boolean"},
                   "note": {"type": "null"}}, "required": ["ok", "note"],
                   "additionalProperties": false}),
        ),
        (
            "a small value",
            json!({"type": "object", "properties": {"value": {"anyOf": [int(-5, 5), s(8)]}},
                   "required": ["value"], "additionalProperties": false}),
        ),
        (
            "a short shopping list",
            json!({"type": "object", "properties": {"items": {"type": "array", "maxItems": 3,
                   "items": {"type": "object", "properties": {"id": int(1, 99), "label": s(10)},
                   "required": ["id", "label"], "additionalProperties": false}}},
                   "required": ["items"], "additionalProperties": false}),
        ),
        (
            "some digits",
            json!({"type": "array", "items": int(0, 9), "minItems": 2, "maxItems": 5}),
        ),
        (
            "a line segment",
            json!({"$defs": {"Point": {"type": "object", "properties": {"x": int(-100, 100),
                   "y": int(-100, 100)}, "required": ["x", "y"], "additionalProperties": false}},
                   "type": "object", "properties": {"start": {"$ref": "#/$defs/Point"},
                   "end": {"$ref": "#/$defs/Point"}}, "required": ["start", "end"],
                   "additionalProperties": false}),
        ),
        (
            "a report header",
            json!({"type": "object", "properties": {"version": {"const": 2},
                   "kind": {"const": "report"}}, "required": ["version", "kind"],
                   "additionalProperties": false}),
        ),
        (
            "a setting",
            json!({"type": "object", "properties": {"a": int(0, 10), "b": s(5)},
                   "required": ["a"], "additionalProperties": false}),
        ),
        (
            "a temperature",
            json!({"type": "object", "properties": {"t": {"type": "number",
                   "exclusiveMinimum": 0, "exclusiveMaximum": 100}}, "required": ["t"],
                   "additionalProperties": false}),
        ),
        (
            "a nested value",
            json!({"type": "object", "properties": {"a": {"type": "object", "properties": {
                   "b": {"type": "object", "properties": {"c": int(0, 3)}, "required": ["c"],
                   "additionalProperties": false}}, "required": ["b"],
                   "additionalProperties": false}}, "required": ["a"],
                   "additionalProperties": false}),
        ),
        (
            "a level and a code",
            json!({"type": "object", "properties": {"level": {"enum": [1, 2, 3]},
                   "code": {"type": "string", "minLength": 2, "maxLength": 4}},
                   "required": ["level", "code"], "additionalProperties": false}),
        ),
        (
            "a shape",
            json!({"anyOf": [
                {"type": "object", "properties": {"kind": {"const": "circle"}, "r": int(1, 9)},
                 "required": ["kind", "r"], "additionalProperties": false},
                {"type": "object", "properties": {"kind": {"const": "square"},
                 "side": int(1, 9)}, "required": ["kind", "side"],
                 "additionalProperties": false}]}),
        ),
        (
            "a middle name, if any",
            json!({"type": "object", "properties": {"middle_name": {"type": ["string", "null"],
                   "maxLength": 10}}, "required": ["middle_name"],
                   "additionalProperties": false}),
        ),
        (
            "meeting days",
            json!({"type": "object", "properties": {"days": {"type": "array",
                   "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1, "maxItems": 3}},
                   "required": ["days"], "additionalProperties": false}),
        ),
        (
            "a product",
            json!({"type": "object", "properties": {
                "sku": s(8), "name": s(16), "price": {"type": "number", "minimum": 0,
                "maximum": 1000}, "in_stock": {"type": "boolean"}, "qty": int(0, 500),
                "category": {"enum": ["tools", "food", "toys"]},
                "dims": {"type": "array", "items": int(1, 99), "minItems": 3, "maxItems": 3},
                "discount": {"type": ["number", "null"], "minimum": 0, "maximum": 0.5}},
                "required": ["sku", "name", "price", "in_stock", "qty", "category", "dims",
                             "discount"], "additionalProperties": false}),
        ),
        ("a number between 10 and 20", int(10, 20)),
    ]
}

/// Checks one response: finished by the grammar, parses, validates.
fn check(what: &str, schema: &Value, status: u16, body: &Value) -> String {
    assert_eq!(status, 200, "{what}: {body}");
    let choice = &body["choices"][0];
    let text = choice["message"]["content"].as_str().expect("content");
    assert_eq!(choice["finish_reason"], "stop", "{what}: {text}");
    let v: Value = serde_json::from_str(text)
        .unwrap_or_else(|e| panic!("{what}: output is not JSON ({e}): {text}"));
    if let Err(e) = validate(schema, &v, schema, "$") {
        panic!("{what}: {e}; output {text}");
    }
    text.to_string()
}

#[test]
fn twenty_schemas_give_valid_json_at_temperature_0_and_1_alone_and_batched() {
    let addr = start(EngineOptions {
        num_blocks: Some(512),
        max_model_len: Some(1024),
        ..EngineOptions::default()
    });
    let schemas = schemas();
    assert_eq!(schemas.len(), 20);

    // Alone, greedy.
    let mut alone = Vec::new();
    for (i, (what, schema)) in schemas.iter().enumerate() {
        let body = chat(
            &format!("Reply in JSON: {what}."),
            0.0,
            i as u64,
            with_schema(&format!("s{i}"), schema),
        );
        let (status, resp) = post(addr, "/v1/chat/completions", &body);
        alone.push(check(what, schema, status, &resp));
    }

    // Batched: every schema greedy and sampled, with unconstrained requests alongside.
    let mut handles = Vec::new();
    for (i, (what, schema)) in schemas.iter().cloned().enumerate() {
        for temperature in [0.0, 1.0] {
            let schema = schema.clone();
            handles.push(std::thread::spawn(move || {
                let body = chat(
                    &format!("Reply in JSON: {what}."),
                    temperature,
                    i as u64,
                    with_schema(&format!("s{i}"), &schema),
                );
                let (status, resp) = post(addr, "/v1/chat/completions", &body);
                (Some((i, temperature)), check(what, &schema, status, &resp))
            }));
        }
    }
    for k in 0..4 {
        handles.push(std::thread::spawn(move || {
            let body = chat(
                "Write a sentence about rivers.",
                1.0,
                k,
                json!({"max_tokens": 24}),
            );
            let (status, resp) = post(addr, "/v1/chat/completions", &body);
            assert_eq!(status, 200, "{resp}");
            (None, resp["choices"][0]["message"]["content"].to_string())
        }));
    }
    for h in handles {
        let (key, text) = h.join().expect("request thread");
        // Masks do not depend on the batch: greedy batched equals greedy alone.
        if let Some((i, t)) = key {
            if t == 0.0 {
                assert_eq!(text, alone[i], "schema {i} batched vs alone");
            }
        }
    }
}

#[test]
fn regexes_choices_and_json_objects_hold_and_bad_constraints_are_400s() {
    let addr = start(EngineOptions {
        num_blocks: Some(128),
        max_model_len: Some(512),
        ..EngineOptions::default()
    });
    for temperature in [0.0, 1.0] {
        let (status, resp) = post(
            addr,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "A product code:", "max_tokens": 40,
                    "temperature": temperature, "seed": 3, "guided_regex": "[A-Z]{3}-[0-9]{2,4}"}),
        );
        assert_eq!(status, 200, "{resp}");
        let text = resp["choices"][0]["text"].as_str().expect("text");
        let (letters, digits) = text.split_once('-').expect("a dash");
        assert!(
            letters.len() == 3 && letters.chars().all(|c| c.is_ascii_uppercase()),
            "{text}"
        );
        assert!(
            (2..=4).contains(&digits.len()) && digits.chars().all(|c| c.is_ascii_digit()),
            "{text}"
        );

        let (status, resp) = post(
            addr,
            "/v1/chat/completions",
            &chat(
                "Pick a colour.",
                temperature,
                5,
                json!({"guided_choice": ["red", "green", "dark blue"]}),
            ),
        );
        assert_eq!(status, 200, "{resp}");
        let text = resp["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(["red", "green", "dark blue"].contains(&text), "{text}");

        let (status, resp) = post(
            addr,
            "/v1/chat/completions",
            &chat(
                "Describe a cat in JSON.",
                temperature,
                7,
                json!({"response_format": {"type": "json_object"}, "max_tokens": 200, "n": 2}),
            ),
        );
        assert_eq!(status, 200, "{resp}");
        for c in resp["choices"].as_array().unwrap() {
            let text = c["message"]["content"].as_str().unwrap();
            if c["finish_reason"] == "stop" {
                let v: Value = serde_json::from_str(text).expect(text);
                assert!(v.is_object(), "{text}");
            } else {
                // Out of tokens mid-object (OpenAI's behaviour too): still a JSON prefix.
                assert_eq!(c["finish_reason"], "length");
                assert!(text.starts_with('{'), "{text}");
            }
        }
    }

    // Constraints that cannot be enforced: 400s naming the problem; the server goes on.
    let bad = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                   "schema": {"type": "object", "if": {"type": "object"}, "then": {}}}}}),
            "response_format",
            "Unimplemented keys: [\"if\", \"then\"]",
        ),
        (
            json!({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}),
            "response_format",
            "minimum (5) is greater than maximum (1)",
        ),
        (
            json!({"guided_json": {"type": "wobbly"}}),
            "response_format",
            "wobbly",
        ),
        (
            json!({"guided_regex": "(unclosed"}),
            "guided_regex",
            "unclosed group",
        ),
        (
            json!({"guided_json": {"type": "object"}, "guided_regex": "a"}),
            "guided_regex",
            "",
        ),
        (json!({"guided_choice": []}), "guided_choice", ""),
    ];
    for (extra, param, names) in bad {
        let (status, resp) = post(
            addr,
            "/v1/chat/completions",
            &chat("hi", 0.0, 0, extra.clone()),
        );
        assert_eq!(status, 400, "{extra}: {resp}");
        assert_eq!(resp["error"]["param"], param, "{extra}: {resp}");
        assert_eq!(resp["error"]["type"], "invalid_request_error");
        let msg = resp["error"]["message"].as_str().unwrap();
        assert!(msg.contains(names), "{extra}: {msg}");
    }
    let (status, _) = post(
        addr,
        "/v1/chat/completions",
        &chat("hi", 0.0, 0, json!({"max_tokens": 2})),
    );
    assert_eq!(status, 200);
}

#[test]
fn the_mask_passes_a_valid_document_token_by_token_and_refuses_a_wrong_one() {
    let tokenizer = Arc::new(Tokenizer::from_gguf_path(common::model_path()).expect("tokenizer"));
    let t = Instant::now();
    let compiler = GrammarCompiler::new(tokenizer.clone()).expect("compiler");
    let trie_time = t.elapsed();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["name", "tags", "n"], "additionalProperties": false});
    let constraint = StructuredOutput::JsonSchema {
        name: None,
        schema,
        strict: true,
    };
    let good = r#"{"name": "Ada", "tags": ["a", "b"], "n": 42}"#;
    let tokens = tokenizer.encode(good, false, false).unwrap();
    let mut g = compiler.compile(&constraint).expect("compile");
    for (i, &tok) in tokens.iter().enumerate() {
        assert!(g.is_allowed(tok).unwrap(), "token {i} of {good} refused");
        let step = g.accept(tok).unwrap();
        assert_eq!(
            step == GrammarStep::Done,
            i + 1 == tokens.len(),
            "token {i}: {step:?}"
        );
    }
    let per_token = g.mask_time / g.masks.max(1) as u32;
    println!(
        "trie built in {trie_time:?}; {} masks, {per_token:?} per token",
        g.masks
    );

    // Out of range, an extra property, a wrong enum value: each is refused at the token
    // where it goes wrong.
    for bad in [
        r#"{"name": "Ada", "tags": [], "n": 51}"#,
        r#"{"name": "Ada", "extra": 1}"#,
        r#"{"name": "Ada", "tags": ["c"]"#,
    ] {
        let tokens = tokenizer.encode(bad, false, false).unwrap();
        let mut g = compiler.compile(&constraint).expect("compile");
        let refused = tokens.iter().any(|&tok| {
            if !g.is_allowed(tok).unwrap() {
                return true;
            }
            g.accept(tok).unwrap();
            false
        });
        assert!(refused, "{bad} passed the grammar");
    }
}
