//! Helpers shared by the gateway's end-to-end tests: mock engines, a gateway on an
//! ephemeral loopback port, keys and a plain HTTP client.
#![allow(dead_code)]

pub mod tls;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::{Config, ConfigHandle, CreateKey, Gateway, GatewayOptions, RunningGateway};
use strata_mock::{MockConfig, MockEngine};

pub const ADMIN: &str = "admin-secret-for-tests";

pub async fn mock(model: &str) -> MockEngine {
    MockEngine::spawn(MockConfig {
        model: model.into(),
        output_tokens: 8,
        ttft: Duration::ZERO,
        itl: Duration::ZERO,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// The metrics key every test gateway gets (unless its config sets `metrics:` itself), so
/// tests that read the per-tenant series send it ([`metrics_text`]).
pub const METRICS_KEY: &str = "metrics-key-for-tests";

pub async fn gateway_with(yaml: &str, store: Option<Arc<SqliteStore>>) -> RunningGateway {
    gateway_with_clock(yaml, store, None).await
}

/// A gateway whose wall clock (budget periods, ledger times) the test sets.
pub async fn gateway_with_clock(
    yaml: &str,
    store: Option<Arc<SqliteStore>>,
    clock: Option<Arc<dyn strata_gateway::clock::Clock>>,
) -> RunningGateway {
    let mut config = Config::from_yaml(yaml).unwrap();
    if config.metrics == Default::default() {
        config.metrics.key = Some(METRICS_KEY.into());
    }
    let store = match store {
        Some(s) => s,
        None => Arc::new(SqliteStore::in_memory().unwrap()),
    };
    let gw = Gateway::new(
        Arc::new(ConfigHandle::fixed(config).unwrap()),
        store,
        GatewayOptions {
            admin_key: Some(ADMIN.into()),
            seed: Some(7),
            clock,
        },
    )
    .unwrap();
    strata_gateway::spawn(gw, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

/// A gateway's whole `/metrics` page, tenant series included (sent with [`METRICS_KEY`]).
pub async fn metrics_text(gw: &RunningGateway) -> String {
    client()
        .get(format!("{}/metrics", gw.url()))
        .bearer_auth(METRICS_KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

pub async fn gateway(yaml: &str) -> RunningGateway {
    gateway_with(yaml, None).await
}

pub fn key(gw: &RunningGateway, tenant: &str) -> String {
    key_with(
        gw,
        CreateKey {
            tenant: tenant.into(),
            ..Default::default()
        },
    )
}

pub fn key_with(gw: &RunningGateway, req: CreateKey) -> String {
    gw.gateway.create_key(req).unwrap().0
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

pub fn chat_body(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8})
}

/// POSTs JSON with a bearer key; returns status, headers and parsed body (Null if not JSON).
pub async fn post(
    url: &str,
    key: Option<&str>,
    body: &Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut rb = client().post(url).json(body);
    if let Some(k) = key {
        rb = rb.bearer_auth(k);
    }
    let resp = rb.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.unwrap();
    (
        status,
        headers,
        serde_json::from_str(&text).unwrap_or(Value::Null),
    )
}

pub async fn admin_get(gw: &RunningGateway, path: &str) -> (u16, Value) {
    let resp = client()
        .get(format!("{}{path}", gw.url()))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// Asserts the OpenAI error shape and returns the error object.
pub fn assert_openai_error(body: &Value) -> &Value {
    let e = &body["error"];
    assert!(e["message"].is_string(), "{body}");
    assert!(e["type"].is_string(), "{body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{body}"
    );
    e
}

pub fn yaml_one(url: &str, model: &str, extra_model: &str, extra: &str) -> String {
    format!(
        r#"
upstreams:
  - {{name: up, base_url: "{url}"}}
models:
  - name: {model}
    targets: [{{upstream: up}}]
{extra_model}
{extra}
"#
    )
}

/// The usual end-to-end setup: one mock engine serving `m` behind a gateway configured by
/// [`yaml_one`] (with `extra_model` and `extra`), and the gateway's chat URL. Bind `mock`
/// to a name even when unused: the engine lives as long as that binding.
pub struct OneModel {
    pub mock: MockEngine,
    pub gw: RunningGateway,
    /// The gateway's `/v1/chat/completions`.
    pub chat: String,
}

pub async fn one_model(extra_model: &str, extra: &str) -> OneModel {
    let mock = mock("m").await;
    let gw = gateway(&yaml_one(&mock.url(), "m", extra_model, extra)).await;
    let chat = format!("{}/v1/chat/completions", gw.url());
    OneModel { mock, gw, chat }
}

/// Real all-MiniLM-L6-v2 vectors by sentence (`tests/fixtures/minilm/reference.json`).
pub fn minilm_fixture() -> HashMap<String, Vec<f32>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/minilm/reference.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["text"].as_str().unwrap().to_string(),
                serde_json::from_value(i["embedding"].clone()).unwrap(),
            )
        })
        .collect()
}

/// An OpenAI-compatible `/v1/embeddings` that answers the fixture's vectors (and 404 for
/// a text it does not know, which the gateway treats as "no embedding").
pub async fn fixture_embeddings() -> String {
    let table = Arc::new(minilm_fixture());
    let app = axum::Router::new().route(
        "/v1/embeddings",
        axum::routing::post(move |axum::Json(req): axum::Json<Value>| {
            let table = table.clone();
            async move {
                let text = req["input"].as_str().unwrap_or_default();
                match table.get(text) {
                    Some(v) => (
                        axum::http::StatusCode::OK,
                        axum::Json(json!({"object": "list", "model": "all-minilm-l6-v2",
                            "data": [{"object": "embedding", "index": 0, "embedding": v}]})),
                    ),
                    None => (
                        axum::http::StatusCode::NOT_FOUND,
                        axum::Json(json!({"error": {"message": "unknown text"}})),
                    ),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    url
}

/// The content of a streamed chat answer: every `delta.content` joined, and whether it
/// ended with `[DONE]`.
pub fn sse_content(text: &str) -> (String, bool) {
    let mut out = String::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        for c in v["choices"].as_array().unwrap() {
            if let Some(t) = c["delta"]["content"].as_str() {
                out.push_str(t);
            }
        }
    }
    (out, done)
}

/// A stream's events as `(event name, JSON data)` (Anthropic's and the Responses API's
/// streams name every event).
pub fn sse_events(text: &str) -> Vec<(String, Value)> {
    let mut dec = strata_api::SseDecoder::new();
    dec.feed(text.as_bytes())
        .unwrap()
        .into_iter()
        .map(|e| (e.event.clone().unwrap_or_default(), e.json().unwrap()))
        .collect()
}

/// `(requests, input tokens, output tokens)` in `store`'s ledger once `want` requests are
/// in (streamed requests settle when their stream ends; at most 2 s).
pub async fn ledger_totals(gw: &RunningGateway, store: &SqliteStore, want: u64) -> (u64, u64, u64) {
    use strata_gateway::store::{Store, UsageFilter};
    let mut last = (0, 0, 0);
    for _ in 0..100 {
        gw.gateway.flush_usage();
        let rows = store.usage(&UsageFilter::default()).unwrap();
        last = rows.iter().fold((0, 0, 0), |a, r| {
            (
                a.0 + r.requests,
                a.1 + r.input_tokens,
                a.2 + r.output_tokens,
            )
        });
        if last.0 >= want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    last
}
