//! Tool-call answers through the gateway, from Strata's engine in process (the default
//! 135M model with `--enable-auto-tool-choice --tool-call-parser hermes`, so the calls are
//! real and enforced): a tool-call answer is never served from the response cache (a
//! plain deterministic answer is, as the control), and output guardrails see the calls'
//! arguments, redacting inside them while they stay JSON, or withholding the answer.

mod common;

use common::*;
use serde_json::{json, Value};
use strata_engine::options::ToolOptions;
use strata_engine::server::EngineOptions;
use strata_engine::tools::ToolParser;

const MODEL: &str = "smollm2-135m-instruct";

/// The engine serving the default model with the hermes parser on a loopback port, on a
/// runtime of its own; its base URL.
fn engine() -> String {
    use strata_engine::model_cache::{ModelCache, DEFAULT_MODEL};
    let path = match std::env::var_os("STRATA_TEST_MODEL") {
        Some(p) => std::path::PathBuf::from(p),
        None => ModelCache::from_env().path_of(DEFAULT_MODEL),
    };
    assert!(
        path.is_file(),
        "the default model is missing at {}; run `cargo run -p strata-cli -- model pull`",
        path.display()
    );
    let opts = EngineOptions {
        model_path: path,
        model_name: MODEL.into(),
        tools: ToolOptions {
            auto_tool_choice: true,
            parser: Some(ToolParser::Hermes),
            chat_template: None,
            reasoning_parser: None,
        },
        ..Default::default()
    };
    let loaded = strata_engine::server::load(&opts).expect("load the model");
    let app = strata_engine::server::router(loaded.state.clone());
    let addr = strata_mock::serve_on_thread(app, loaded).expect("engine address");
    format!("http://{addr}")
}

/// A function whose one parameter can only be an e-mail address, so the enforced call
/// carries one.
fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "send_mail",
        "parameters": {
            "type": "object",
            "properties": {"to": {"type": "string", "enum": ["ada@example.com"]}},
            "required": ["to"],
            "additionalProperties": false
        }
    }}])
}

fn call_request(seed: u64) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Mail Ada that the build is green."}],
        "tools": tools(),
        "tool_choice": "required",
        "parallel_tool_calls": false,
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 48,
    })
}

fn arguments(resp: &Value) -> Value {
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{resp}");
    let args = choice["message"]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap_or_else(|| panic!("a call: {resp}"));
    serde_json::from_str(args).unwrap_or_else(|e| panic!("arguments are JSON ({e}): {resp}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_answers_skip_the_cache_and_guardrails_see_their_arguments() {
    let engine = tokio::task::spawn_blocking(engine).await.expect("engine");

    // The response cache on, no guardrails.
    let gw = gateway(&yaml_one(
        &engine,
        MODEL,
        "",
        "cache: {enabled: true, ttl_secs: 60}",
    ))
    .await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let k = key(&gw, "t");
    let (s, h, first) = post(&url, Some(&k), &call_request(5)).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(arguments(&first), json!({"to": "ada@example.com"}));
    assert_eq!(h["x-strata-cache"], "miss");
    let (s, h, again) = post(&url, Some(&k), &call_request(5)).await;
    assert_eq!(s, 200, "{again}");
    assert_eq!(h["x-strata-cache"], "miss", "a tool call is never replayed");
    assert_ne!(
        first["choices"][0]["message"]["tool_calls"][0]["id"],
        again["choices"][0]["message"]["tool_calls"][0]["id"],
        "each call has its own id"
    );
    // The control: a deterministic answer in words is stored and served.
    let plain = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "temperature": 0,
        "max_tokens": 4,
    });
    let (_, h, _) = post(&url, Some(&k), &plain).await;
    assert_eq!(h["x-strata-cache"], "miss");
    let (_, h, _) = post(&url, Some(&k), &plain).await;
    assert_eq!(h["x-strata-cache"], "hit");
    gw.shutdown().await;

    // Output guardrails: the address inside the arguments is redacted, and the
    // arguments are still a JSON object.
    let redact = "guardrails:\n  patterns:\n    - {kind: email, action: redact}\n";
    let gw = gateway(&yaml_one(&engine, MODEL, "", redact)).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let k = key(&gw, "t");
    let (s, _, resp) = post(&url, Some(&k), &call_request(6)).await;
    assert_eq!(s, 200, "{resp}");
    assert_eq!(arguments(&resp), json!({"to": "[REDACTED:email]"}));
    gw.shutdown().await;

    // Blocking: the answer is withheld; and an earlier turn's call in the history is
    // input the guardrails see (refused before the model).
    let block = "guardrails:\n  patterns:\n    - {kind: email, action: block}\n";
    let gw = gateway(&yaml_one(&engine, MODEL, "", block)).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let k = key(&gw, "t");
    let (s, _, resp) = post(&url, Some(&k), &call_request(7)).await;
    assert_eq!(s, 400, "{resp}");
    assert_eq!(assert_openai_error(&resp)["code"], "guardrail_blocked");
    let history = json!({
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "Mail her."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "send_mail", "arguments": "{\"to\": \"ada@example.com\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sent"},
        ],
        "tools": tools(),
        "max_tokens": 4,
    });
    let (s, _, resp) = post(&url, Some(&k), &history).await;
    assert_eq!(s, 400, "{resp}");
    assert_eq!(assert_openai_error(&resp)["code"], "guardrail_blocked");
    gw.shutdown().await;
}
