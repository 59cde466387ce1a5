//! OpenAI's Responses API on the gateway: translated to chat (whole and streamed,
//! function tools, `text.format` schemas), kept per tenant for `GET` and
//! `previous_response_id` (also after a restart, in the SQLite file), passed through to an
//! upstream that speaks it; bad input gets OpenAI's error shape and costs nothing.

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

async fn setup_with(store: Arc<SqliteStore>) -> Setup {
    setup_config(store, "").await
}

/// The scripted upstream's gateway.yaml with `extra` (top-level keys) appended.
async fn setup_config(store: Arc<SqliteStore>, extra: &str) -> Setup {
    let up = scripted::spawn().await;
    let yaml = format!("{}{extra}", scripted::yaml(&up.url));
    let gw = gateway_with(&yaml, Some(store.clone())).await;
    let key = key(&gw, "acme");
    Setup { gw, up, store, key }
}

async fn setup() -> Setup {
    setup_with(Arc::new(SqliteStore::in_memory().unwrap())).await
}

async fn create(s: &Setup, key: &str, body: &Value) -> (u16, String) {
    let resp = client()
        .post(format!("{}/v1/responses", s.gw.url()))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

async fn get(s: &Setup, key: &str, id: &str) -> (u16, Value) {
    let resp = client()
        .get(format!("{}/v1/responses/{id}", s.gw.url()))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn charged(s: &Setup, want: u64) -> (u64, u64, u64) {
    ledger_totals(&s.gw, &s.store, want).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_get_and_continue_a_response() {
    let s = setup().await;
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "instructions": "Be brief.", "input": "hello", "max_output_tokens": 16}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let r: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["output"][0]["type"], "message");
    assert_eq!(r["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(r["output"][0]["content"][0]["text"], "Hello there!");
    assert_eq!(r["usage"]["input_tokens"], 5);
    assert_eq!(r["usage"]["output_tokens"], 3);
    assert_eq!(r["usage"]["total_tokens"], 8);
    assert_eq!(r["instructions"], "Be brief.");
    assert_eq!(r["max_output_tokens"], 16);
    let id = r["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("resp_"));
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(
        sent["messages"],
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}])
    );
    assert_eq!(sent["max_tokens"], 16);

    // GET gives it back; another tenant's key does not find it.
    let (status, got) = get(&s, &s.key, &id).await;
    assert_eq!(status, 200);
    assert_eq!(got, r);
    let other = key(&s.gw, "other");
    let (status, body) = get(&s, &other, &id).await;
    assert_eq!(status, 404);
    assert_openai_error(&body);

    // previous_response_id continues the conversation (instructions are not carried).
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "and then?", "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let r2: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(r2["previous_response_id"], id.as_str());
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(
        sent["messages"],
        json!([
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello there!"},
            {"role": "user", "content": "and then?"}
        ])
    );
    // Another tenant cannot continue it.
    let (status, text) = create(
        &s,
        &other,
        &json!({"model": "m", "input": "x", "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(assert_openai_error(&v)["param"], "previous_response_id");

    // store: false keeps nothing.
    let (_, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "x", "store": false}),
    )
    .await;
    let unstored: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        get(&s, &s.key, unstored["id"].as_str().unwrap()).await.0,
        404
    );
    assert_eq!(charged(&s, 3).await, (3, 15, 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_has_openais_events_and_is_kept() {
    let s = setup().await;
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "hello", "stream": true}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let evs = sse_events(&text);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (name, data)) in evs.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i as u64);
    }
    let done = &evs.last().unwrap().1["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"][0]["content"][0]["text"], "Hello there!");
    assert_eq!(done["usage"]["output_tokens"], 3);
    // Stored before response.completed went out: continued at once.
    let id = done["id"].as_str().unwrap();
    assert_eq!(get(&s, &s.key, id).await.1, *done);
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "more", "previous_response_id": id, "stream": true}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(
        sent["messages"][1],
        json!({"role": "assistant", "content": "Hello there!"})
    );
    assert_eq!(charged(&s, 2).await, (2, 10, 6));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_tools_and_json_schemas_reach_the_model() {
    let s = setup().await;
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "Weather in Paris?", "tools": tools, "tool_choice": "required"}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let r: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        r["output"],
        json!([{"type": "function_call", "id": r["output"][0]["id"], "call_id": "call_1",
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}", "status": "completed"}])
    );
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(sent["tools"][0]["function"]["name"], "get_weather");
    assert_eq!(sent["tool_choice"], "required");

    // The call's output goes back; the model answers in text.
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "tools": tools, "previous_response_id": r["id"],
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(sent["messages"][1]["tool_calls"][0]["id"], "call_1");
    assert_eq!(
        sent["messages"][2],
        json!({"role": "tool", "content": "sunny", "tool_call_id": "call_1"})
    );

    // Streamed function call arguments.
    let (_, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "Weather?", "tools": tools, "stream": true}),
    )
    .await;
    let evs = sse_events(&text);
    let args: String = evs
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(args, "{\"city\": \"Paris\"}");

    // text.format json_schema becomes chat's response_format.
    let schema = json!({"type": "object", "properties": {"answer": {"type": "string"}}});
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": true}}}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let sent = s.up.seen.last("/v1/chat/completions").unwrap();
    assert_eq!(
        sent["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": true}})
    );
    let r: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(r["text"]["format"]["type"], "json_schema");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_survive_a_restart_in_the_sqlite_file() {
    let dir = std::env::temp_dir().join(format!("strata-gw-responses-{}", std::process::id()));
    let path = dir.join("gw.db");
    let _ = std::fs::remove_dir_all(&dir);
    let s = setup_with(Arc::new(SqliteStore::open(&path).unwrap())).await;
    let (_, text) = create(&s, &s.key, &json!({"model": "m", "input": "hello"})).await;
    let id = serde_json::from_str::<Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let k = s.key.clone();
    s.gw.shutdown().await;
    let store = SqliteStore::open(&path).unwrap();
    let row = store.get_response("acme", &id, 0).unwrap().unwrap();
    assert!(
        row.expires_at - row.created_at >= 29 * 24 * 3600,
        "30 days by default"
    );
    let gw = gateway_with(&scripted::yaml(&s.up.url), Some(Arc::new(store))).await;
    // Keys live in the same file: the old key still works and sees its response.
    let resp = client()
        .get(format!("{}/v1/responses/{id}", gw.url()))
        .bearer_auth(&k)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_speaks_responses_gets_the_body_as_sent() {
    let s = setup().await;
    let body =
        json!({"model": "v", "input": "What is the capital of France?", "max_output_tokens": 24});
    let (status, text) = create(&s, &s.key, &body).await;
    assert_eq!(status, 200, "{text}");
    let expected: Value = serde_json::from_str(&scripted::fixture("responses.json")).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), expected);
    assert_eq!(s.up.seen.last("/v1/responses").unwrap(), body);
    assert_eq!(charged(&s, 1).await, (1, 42, 8));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, text) = create(&s, &s.key, &streamed).await;
    assert_eq!(status, 200);
    assert_eq!(
        sse_events(&text),
        sse_events(&scripted::fixture("responses-stream.sse"))
    );
    assert_eq!(charged(&s, 2).await, (2, 42 + 33, 16));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openais_error_shape_and_costs_nothing() {
    let s = setup().await;
    let cases: Vec<(String, Value, u16, Option<&str>)> = vec![
        (s.key.clone(), json!({"input": "x"}), 400, None),
        (s.key.clone(), json!({"model": "m", "input": 5}), 400, None),
        (
            s.key.clone(),
            json!({"model": "m", "input": []}),
            400,
            Some("input"),
        ),
        (
            s.key.clone(),
            json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
            400,
            None,
        ),
        (
            s.key.clone(),
            json!({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}),
            400,
            None,
        ),
        (
            s.key.clone(),
            json!({"model": "m", "input": "x", "previous_response_id": "resp_nope"}),
            400,
            Some("previous_response_id"),
        ),
        (
            s.key.clone(),
            json!({"model": "nope", "input": "x"}),
            404,
            None,
        ),
        (
            "sk-wrong".into(),
            json!({"model": "m", "input": "x"}),
            401,
            None,
        ),
    ];
    for (key, body, status, param) in cases {
        let (got, text) = create(&s, &key, &body).await;
        assert_eq!(got, status, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let err = assert_openai_error(&v);
        if let Some(p) = param {
            assert_eq!(err["param"], p, "{text}");
        }
    }
    let (status, body) = get(&s, "sk-wrong", "resp_x").await;
    assert_eq!(status, 401);
    assert_openai_error(&body);
    let (status, body) = get(&s, &s.key, "resp_missing").await;
    assert_eq!(status, 404);
    assert_openai_error(&body);
    assert_eq!(s.up.seen.count(), 0);
    s.gw.gateway.flush_usage();
    let rows = s.store.usage(&UsageFilter::default()).unwrap();
    assert!(
        rows.iter()
            .all(|r| r.input_tokens == 0 && r.output_tokens == 0 && r.cost_micros == 0),
        "{rows:?}"
    );
}

/// A translated stream that breaks (here: a guardrail blocks the answer) ends with an
/// `error` event numbered after the events before it, not 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_s_error_event_takes_the_next_sequence_number() {
    let s = setup_config(
        Arc::new(SqliteStore::in_memory().unwrap()),
        "guardrails:\n  patterns:\n    - {kind: custom, regex: \"there\", action: block, input: false}\n",
    )
    .await;
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "hello", "stream": true}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let evs = sse_events(&text);
    let (name, error) = evs.last().unwrap();
    assert_eq!(name, "error", "{text}");
    let before: Vec<u64> = evs[..evs.len() - 1]
        .iter()
        .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert!(!before.is_empty(), "{text}");
    assert_eq!(
        error["sequence_number"].as_u64(),
        Some(before.iter().max().unwrap() + 1),
        "{text}"
    );
    s.gw.shutdown().await;
}

/// A short input continuing a long conversation: the client's body is small, the
/// conversation with its history is above `server.max_body_bytes`; the 413 says so, naming
/// `previous_response_id`, and nothing reaches the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_grown_too_long_is_refused_as_such() {
    let s = setup_config(
        Arc::new(SqliteStore::in_memory().unwrap()),
        "server: {max_body_bytes: 2048}\n",
    )
    .await;
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "a".repeat(1200)}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let id = serde_json::from_str::<Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let sent = s.up.seen.count();
    let (status, text) = create(
        &s,
        &s.key,
        &json!({"model": "m", "input": "b".repeat(1200), "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, 413, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let err = assert_openai_error(&v);
    assert_eq!(err["param"], "previous_response_id", "{text}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("conversation is too long"),
        "{text}"
    );
    assert_eq!(s.up.seen.count(), sent, "nothing reached the model");
    s.gw.shutdown().await;
}

/// Passed-through responses belong to the tenant that made them: the gateway records each
/// id (whole and streamed), `GET` serves it to that tenant, that tenant may continue it,
/// and another tenant's `previous_response_id` is not found and never reaches the
/// upstream (which keeps one store for everyone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passed_through_responses_are_kept_per_tenant() {
    let s = setup().await;
    let other = key(&s.gw, "other");
    let (status, text) = create(&s, &s.key, &json!({"model": "v", "input": "hi"})).await;
    assert_eq!(status, 200, "{text}");
    let id = serde_json::from_str::<Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, got) = get(&s, &s.key, &id).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got, serde_json::from_str::<Value>(&text).unwrap());
    let (status, got) = get(&s, &other, &id).await;
    assert_eq!(status, 404, "{got}");
    assert_openai_error(&got);

    // Another tenant naming it: not found, in OpenAI's shape; the upstream never asked.
    let sent = s.up.seen.count();
    let follow = json!({"model": "v", "input": "and?", "previous_response_id": id});
    let (status, text) = create(&s, &other, &follow).await;
    assert_eq!(status, 400, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(assert_openai_error(&v)["param"], "previous_response_id");
    let (status, _) = create(
        &s,
        &s.key,
        &json!({"model": "v", "input": "and?", "previous_response_id": "resp_never_seen"}),
    )
    .await;
    assert_eq!(
        status, 400,
        "an id the upstream may hold but nobody passed here"
    );
    assert_eq!(s.up.seen.count(), sent);

    // Its own tenant continues it upstream.
    let (status, text) = create(&s, &s.key, &follow).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(s.up.seen.last("/v1/responses").unwrap(), follow);

    // Streamed: the id of `response.completed` is recorded before it reaches the client.
    let (status, text) = create(
        &s,
        &other,
        &json!({"model": "v", "input": "hi", "stream": true}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let evs = sse_events(&text);
    let (name, done) = evs.last().unwrap();
    assert_eq!(name, "response.completed");
    let streamed_id = done["response"]["id"].as_str().unwrap().to_string();
    let (status, got) = get(&s, &other, &streamed_id).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got, done["response"]);
    assert_eq!(get(&s, &s.key, &streamed_id).await.0, 404);
    let follow = json!({"model": "v", "input": "and?", "previous_response_id": streamed_id});
    assert_eq!(create(&s, &other, &follow).await.0, 200);
    assert_eq!(create(&s, &s.key, &follow).await.0, 400);

    // `store: false`: nothing recorded, so nothing to read or continue.
    let third = key(&s.gw, "third");
    let (status, _) = create(
        &s,
        &third,
        &json!({"model": "v", "input": "hi", "store": false, "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(get(&s, &third, &streamed_id).await.0, 404);
    assert_eq!(create(&s, &third, &follow).await.0, 400);
}
