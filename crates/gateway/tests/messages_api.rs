//! Anthropic's Messages API on the gateway: translated to chat for an upstream that
//! speaks only chat (whole, streamed, a tool-use round trip, count_tokens over the
//! upstream's `/tokenize`), passed through to one that speaks it (vLLM's recorded
//! answers), charged like chat; bad input gets Anthropic's error shape and costs nothing.

mod common;
#[path = "common/scripted.rs"]
mod scripted;

use std::sync::Arc;

use common::*;
use serde_json::{json, Value};
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::store::{Store, UsageFilter};
use strata_gateway::RunningGateway;

struct Setup {
    gw: RunningGateway,
    up: scripted::Scripted,
    store: Arc<SqliteStore>,
    key: String,
}

async fn setup() -> Setup {
    let up = scripted::spawn().await;
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let gw = gateway_with(&scripted::yaml(&up.url), Some(store.clone())).await;
    let key = key(&gw, "acme");
    Setup { gw, up, store, key }
}

/// POSTs with Anthropic's headers (`x-api-key`, `anthropic-version`).
async fn post_anthropic(s: &Setup, path: &str, key: &str, body: &Value) -> (u16, String) {
    let resp = client()
        .post(format!("{}{path}", s.gw.url()))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

async fn ledger(s: &Setup, want: u64) -> (u64, u64, u64) {
    ledger_totals(&s.gw, &s.store, want).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_is_answered_through_chat_and_charged() {
    let s = setup().await;
    let body = json!({
        "model": "m", "max_tokens": 16,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": "hello"}]
    });
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "Hello there!"}])
    );
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["usage"], json!({"input_tokens": 5, "output_tokens": 3}));
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(
        sent["messages"],
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}])
    );
    assert_eq!(sent["max_tokens"], 16);
    assert_eq!(ledger(&s, 1).await, (1, 5, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_message_has_anthropics_events_and_is_charged() {
    let s = setup().await;
    let body = json!({"model": "m", "max_tokens": 16, "stream": true,
        "messages": [{"role": "user", "content": "hello"}]});
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &body).await;
    assert_eq!(status, 200, "{text}");
    let evs = sse_events(&text);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for (name, data) in &evs {
        assert_eq!(data["type"], name.as_str(), "the event name is the type");
    }
    let text: String = evs
        .iter()
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "Hello there!");
    assert_eq!(evs[6].1["delta"]["stop_reason"], "end_turn");
    assert_eq!(evs[6].1["usage"]["output_tokens"], 3);
    // The chat request asked for the usage chunk, and the ledger has it.
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert_eq!(ledger(&s, 1).await, (1, 5, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_use_round_trip_whole_and_streamed() {
    let s = setup().await;
    let tools = json!([{"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let first = json!({"model": "m", "max_tokens": 32, "tools": tools,
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &first).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["stop_reason"], "tool_use");
    assert_eq!(
        v["content"],
        json!([{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}])
    );
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(sent["tool_choice"], "required");
    assert_eq!(sent["tools"][0]["function"]["name"], "get_weather");

    // The result goes back as a tool_result block; the model answers in text.
    let second = json!({"model": "m", "max_tokens": 32, "tools": tools,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": v["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]}
    ]});
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &second).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["content"][0]["text"], "Hello there!");
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(
        sent["messages"][2],
        json!({"role": "tool", "content": "sunny", "tool_call_id": "call_1"})
    );
    assert_eq!(
        sent["messages"][1]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Paris\"}"
    );

    // Streamed: a tool_use block whose input arrives as input_json_delta pieces.
    let mut streamed = first.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &streamed).await;
    assert_eq!(status, 200, "{text}");
    let evs = sse_events(&text);
    assert_eq!(evs[1].1["content_block"]["type"], "tool_use");
    assert_eq!(evs[1].1["content_block"]["name"], "get_weather");
    let json_text: String = evs
        .iter()
        .filter_map(|(_, d)| d["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&json_text).unwrap(),
        json!({"city": "Paris"})
    );
    let delta = evs.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");
    assert_eq!(ledger(&s, 3).await.0, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_uses_the_upstream_tokenizer_and_charges_no_tokens() {
    let s = setup().await;
    let body = json!({"model": "m", "system": "Be brief.",
        "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                     {"role": "user", "content": "bye"}]});
    let (status, text) = post_anthropic(&s, "/v1/messages/count_tokens", &s.key, &body).await;
    assert_eq!(status, 200, "{text}");
    // System + three messages, ten tokens each by the scripted tokenizer.
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        json!({"input_tokens": 40})
    );
    let sent = s.up.seen.last("/tokenize").unwrap();
    assert_eq!(sent["add_generation_prompt"], true);
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "Be brief."})
    );
    let (requests, input, output) = ledger(&s, 1).await;
    assert_eq!((requests, input, output), (1, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_speaks_messages_gets_the_body_as_sent() {
    let s = setup().await;
    let body =
        json!({"model": "v", "max_tokens": 24, "messages": [{"role": "user", "content": "hi"}]});
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &body).await;
    assert_eq!(status, 200, "{text}");
    let expected: Value = serde_json::from_str(&scripted::fixture("messages.json")).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), expected);
    assert_eq!(
        s.up.seen.last("/v1/messages").unwrap()["messages"],
        body["messages"]
    );
    assert!(s.up.seen.last("/v1/chat/completions").is_none());
    assert_eq!(ledger(&s, 1).await, (1, 26, 24));

    // Streamed: vLLM's events as recorded; the usage in them is charged.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &streamed).await;
    assert_eq!(status, 200);
    assert_eq!(
        sse_events(&text),
        sse_events(&scripted::fixture("messages-stream.sse"))
    );
    assert_eq!(ledger(&s, 2).await, (2, 26 + 33, 24 + 8));

    let count = json!({"model": "v", "messages": [{"role": "user", "content": "hi"}]});
    let (status, _) = post_anthropic(&s, "/v1/messages/count_tokens", &s.key, &count).await;
    // The scripted upstream has no count_tokens route: its 404 comes back in Anthropic's shape.
    assert_eq!(status, 404);
}

fn assert_anthropic_error(text: &str, kind: &str) -> String {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    assert_eq!(v["type"], "error", "{text}");
    assert_eq!(v["error"]["type"], kind, "{text}");
    v["error"]["message"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_anthropics_error_shape_and_costs_nothing() {
    let s = setup().await;
    let ok = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]});
    let cases: Vec<(&str, String, Value, u16, &str)> = vec![
        (
            "/v1/messages",
            s.key.clone(),
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/messages",
            s.key.clone(),
            json!({"model": "m", "max_tokens": 8, "messages": []}),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/messages",
            s.key.clone(),
            json!({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/messages",
            s.key.clone(),
            json!({"model": "m", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/messages",
            s.key.clone(),
            json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/messages",
            s.key.clone(),
            json!("not an object"),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/messages",
            "sk-wrong".into(),
            ok.clone(),
            401,
            "authentication_error",
        ),
        (
            "/v1/messages",
            s.key.clone(),
            json!({"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}),
            404,
            "not_found_error",
        ),
        (
            "/v1/messages/count_tokens",
            s.key.clone(),
            json!({"model": "m"}),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/messages/count_tokens",
            "sk-wrong".into(),
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
            401,
            "authentication_error",
        ),
    ];
    for (path, key, body, status, kind) in cases {
        let (got, text) = post_anthropic(&s, path, &key, &body).await;
        assert_eq!(got, status, "{path} {body}: {text}");
        assert_anthropic_error(&text, kind);
    }
    // A body over the limit is refused before it is read.
    let big = "x".repeat(2 * 1024 * 1024);
    let huge =
        json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": big}]});
    let (got, text) = post_anthropic(&s, "/v1/messages", &s.key, &huge).await;
    assert_eq!(got, 413, "{text}");
    assert_anthropic_error(&text, "request_too_large");
    // Nothing reached the model and nothing was charged.
    assert_eq!(s.up.seen.count(), 0);
    s.gw.gateway.flush_usage();
    let rows = s.store.usage(&UsageFilter::default()).unwrap();
    assert!(
        rows.iter()
            .all(|r| r.input_tokens == 0 && r.output_tokens == 0 && r.cost_micros == 0),
        "{rows:?}"
    );
}

/// With guardrails configured, a model whose upstream speaks Messages and Responses is
/// served by translation through chat, where the guardrails read every text: the upstream
/// sees a chat request, a word in the answer is redacted (whole and streamed, the stream
/// keeping Anthropic's `event:` names) or blocks it (an Anthropic `error` event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guardrails_translate_a_pass_through_model_and_keep_anthropic_events() {
    let up = scripted::spawn().await;
    let url = up.url.clone();
    let guard = |action: &str| {
        format!(
            "{}guardrails:\n  patterns:\n    - {{kind: custom, regex: \"there\", action: {action}, input: false}}\n",
            scripted::yaml(&url)
        )
    };
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let gw = gateway_with(&guard("redact"), Some(store.clone())).await;
    let s = Setup {
        key: key(&gw, "acme"),
        gw,
        up,
        store,
    };
    let body =
        json!({"model": "v", "max_tokens": 24, "messages": [{"role": "user", "content": "hi"}]});
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["type"], "message", "{text}");
    assert_eq!(
        v["content"][0]["text"], "Hello [REDACTED:custom]!",
        "{text}"
    );
    assert!(
        s.up.seen.last("/v1/messages").is_none(),
        "not passed through"
    );
    assert!(s.up.seen.last("/v1/chat/completions").is_some());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &streamed).await;
    assert_eq!(status, 200, "{text}");
    let evs = sse_events(&text);
    assert_eq!(evs.first().unwrap().0, "message_start", "{text}");
    assert_eq!(evs.last().unwrap().0, "message_stop", "{text}");
    for (name, data) in &evs {
        assert_eq!(data["type"], name.as_str(), "every event named: {text}");
    }
    let said: String = evs
        .iter()
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(said, "Hello [REDACTED:custom]!", "{text}");

    // Responses, likewise translated.
    let resp = client()
        .post(format!("{}/v1/responses", s.gw.url()))
        .bearer_auth(&s.key)
        .json(&json!({"model": "v", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let r: Value = resp.json().await.unwrap();
    assert_eq!(
        r["output"][0]["content"][0]["text"], "Hello [REDACTED:custom]!",
        "{r}"
    );
    assert!(
        s.up.seen.last("/v1/responses").is_none(),
        "not passed through"
    );
    s.gw.shutdown().await;

    // A block: the whole answer is refused, the stream ends with Anthropic's error event.
    let gw = gateway_with(&guard("block"), None).await;
    let k = key(&gw, "acme");
    let s = Setup {
        key: k,
        gw,
        up: s.up,
        store: s.store,
    };
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &body).await;
    assert_eq!(status, 400, "{text}");
    assert!(assert_anthropic_error(&text, "invalid_request_error").contains("withheld"));
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &streamed).await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("there"), "{text}");
    let evs = sse_events(&text);
    let (name, data) = evs.last().unwrap();
    assert_eq!(name, "error", "{text}");
    assert_eq!(data["type"], "error");
    assert_eq!(data["error"]["type"], "api_error");
    assert!(evs.iter().all(|(n, _)| n != "message_stop"), "{text}");
    s.gw.shutdown().await;
}

/// A streamed request whose upstream answers 2xx with a body that is not an event stream:
/// the body is read within `server.max_response_bytes`, and one larger is refused in
/// Anthropic's shape (a 502), not read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_request_answered_with_a_large_json_body_is_bounded() {
    use axum::response::IntoResponse;
    let big = "x".repeat(64 * 1024);
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move || {
            let big = big.clone();
            async move {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    json!({"padding": big}).to_string(),
                )
                    .into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let yaml = format!(
        "upstreams:\n  - {{name: u, base_url: \"{url}\"}}\nmodels:\n  - {{name: m, targets: [{{upstream: u}}]}}\nserver: {{max_response_bytes: 4096}}\n"
    );
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let gw = gateway_with(&yaml, Some(store.clone())).await;
    let k = key(&gw, "acme");
    let s = Setup {
        key: k,
        gw,
        up: scripted::spawn().await,
        store,
    };
    let body = json!({"model": "m", "max_tokens": 8, "stream": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let (status, text) = post_anthropic(&s, "/v1/messages", &s.key, &body).await;
    assert_eq!(status, 502, "{text}");
    let msg = assert_anthropic_error(&text, "api_error");
    assert!(msg.contains("4096 bytes"), "{msg}");
    s.gw.shutdown().await;
}
