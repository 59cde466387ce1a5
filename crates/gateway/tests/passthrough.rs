//! What the gateway sends upstream and what it reads back: the request body is forwarded
//! byte for byte unless the gateway must change it (model alias, streamed usage), and
//! `usage` is read from answers of any shape without breaking on malformed ones.

mod common;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use common::*;
use parking_lot::Mutex;
use serde_json::{json, Value};

/// A loopback upstream that records every request body and its headers, and answers each
/// with a fixed status, content type and body.
struct Capture {
    url: String,
    seen: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Capture {
    async fn start(status: u16, content_type: &'static str, answer: &'static str) -> Capture {
        let seen: Arc<Mutex<Vec<(HeaderMap, Bytes)>>> = Arc::default();
        let s2 = seen.clone();
        let app = axum::Router::new().fallback(move |headers: HeaderMap, body: Bytes| {
            let seen = s2.clone();
            async move {
                seen.lock().push((headers, body));
                (
                    StatusCode::from_u16(status).unwrap(),
                    [(header::CONTENT_TYPE, content_type)],
                    answer,
                )
                    .into_response()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Capture { url, seen, task }
    }

    fn bodies(&self) -> Vec<Bytes> {
        self.seen.lock().iter().map(|(_, b)| b.clone()).collect()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const ANSWER: &str = r#"{"usage":{"completion_tokens":5,"prompt_tokens":11,"total_tokens":16,"details":{"x":[1,2,{"y":null}]}},"id":"c-1","object":"chat.completion","model":"up-model","choices":[{"index":0,"message":{"role":"assistant","content":"hi \"there\" \u00e9"},"finish_reason":"stop"}]}"#;

/// Sends a raw body with a key; returns status and body text.
async fn post_raw(url: &str, key: &str, body: &'static str) -> (u16, String) {
    let resp = client()
        .post(url)
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

/// The upstream key the configs below read from the environment; set once per process.
fn set_upstream_key() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| std::env::set_var("STRATA_TEST_UPSTREAM_KEY", "sk-upstream-1"));
}

fn yaml(url: &str, upstream_model: Option<&str>) -> String {
    let target = match upstream_model {
        Some(m) => format!("{{upstream: up, model: {m}}}"),
        None => "{upstream: up}".to_string(),
    };
    format!(
        "upstreams:\n  - {{name: up, base_url: \"{url}\", api_key_env: STRATA_TEST_UPSTREAM_KEY}}\nmodels:\n  - name: m\n    aliases: [m-alias]\n    targets: [{target}]\n    price: {{input_per_1m: 1000000, output_per_1m: 2000000}}\n"
    )
}

#[tokio::test]
async fn the_request_body_is_forwarded_as_sent_when_nothing_changes_it() {
    set_upstream_key();
    let up = Capture::start(200, "application/json", ANSWER).await;
    let gw = gateway(&yaml(&up.url, None)).await;
    let k = key(&gw, "t");
    // Odd spacing, key order, unknown fields and escapes: all must reach the upstream
    // exactly as sent.
    const BODY: &str = "{ \"messages\" : [{\"role\":\"user\",\"content\":\"caf\\u00e9 \\\"q\\\"\"}],\n  \"model\":\"m\", \"max_tokens\": 4, \"vendor_x\": {\"deep\": [1, 2.50, null]} }";
    let (status, text) = post_raw(&format!("{}/v1/chat/completions", gw.url()), &k, BODY).await;
    assert_eq!(status, 200, "{text}");
    // The answer is relayed as the upstream wrote it.
    assert_eq!(text, ANSWER);
    assert_eq!(up.bodies(), vec![Bytes::from_static(BODY.as_bytes())]);
    let (headers, _) = up.seen.lock()[0].clone();
    assert_eq!(headers["authorization"], "Bearer sk-upstream-1");
    assert_eq!(headers["content-type"], "application/json");
    assert!(headers["x-request-id"].to_str().unwrap().starts_with("gw-"));
    // Usage read from the answer (usage first, nested extra fields): $11 + $10.
    let (_, usage) = admin_get(&gw, "/admin/usage").await;
    assert_eq!(usage["data"][0]["input_tokens"], 11, "{usage}");
    assert_eq!(usage["data"][0]["output_tokens"], 5, "{usage}");
    assert_eq!(usage["total_cost_micros"], 21_000_000, "{usage}");
    gw.shutdown().await;
}

#[tokio::test]
async fn the_body_is_rewritten_when_the_model_or_stream_options_change() {
    set_upstream_key();
    let up = Capture::start(200, "application/json", ANSWER).await;
    let gw = gateway(&yaml(&up.url, Some("up-model"))).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    const BODY: &str =
        r#"{"model":"m-alias","messages":[{"role":"user","content":"hi"}],"vendor_x":7}"#;
    let (status, text) = post_raw(&url, &k, BODY).await;
    assert_eq!(status, 200, "{text}");
    let sent: Value = serde_json::from_slice(&up.bodies()[0]).unwrap();
    assert_eq!(sent["model"], "up-model");
    assert_eq!(sent["vendor_x"], 7, "other fields kept: {sent}");
    assert_eq!(sent["messages"][0]["content"], "hi");
    gw.shutdown().await;

    // A streamed request gains `stream_options.include_usage`, keeping what was there.
    let up = Capture::start(200, "text/event-stream", "data: [DONE]\n\n").await;
    let gw = gateway(&yaml(&up.url, None)).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    const STREAM: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":false,"vendor":1}}"#;
    let (status, _) = post_raw(&url, &k, STREAM).await;
    assert_eq!(status, 200);
    let sent: Value = serde_json::from_slice(&up.bodies()[0]).unwrap();
    assert_eq!(
        sent["stream_options"],
        json!({"include_usage": true, "vendor": 1})
    );
    // Already asked for: forwarded as sent.
    const STREAM_OK: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}"#;
    let (status, _) = post_raw(&url, &k, STREAM_OK).await;
    assert_eq!(status, 200);
    assert_eq!(up.bodies()[1], Bytes::from_static(STREAM_OK.as_bytes()));
    gw.shutdown().await;
}

#[tokio::test]
async fn malformed_upstream_answers_are_relayed_and_charged_the_estimate() {
    set_upstream_key();
    for answer in [
        "this is not json",
        r#"{"choices":[],"usage":{"prompt_tokens":"eleven","completion_tokens":5}}"#,
        r#"{"choices":[],"usage":null}"#,
        r#"{"choices":[], "usage": {"prompt_tokens": 3"#,
    ] {
        let up = Capture::start(200, "application/json", answer).await;
        let gw = gateway(&yaml(&up.url, None)).await;
        let k = key(&gw, "t");
        // 4 characters of prompt → 1 token; max_tokens 2 → estimate 1 + 2.
        const BODY: &str =
            r#"{"model":"m","messages":[{"role":"user","content":"abcd"}],"max_tokens":2}"#;
        let (status, text) = post_raw(&format!("{}/v1/chat/completions", gw.url()), &k, BODY).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(text, answer);
        let (_, usage) = admin_get(&gw, "/admin/usage").await;
        assert_eq!(usage["data"][0]["input_tokens"], 1, "{answer}: {usage}");
        assert_eq!(usage["data"][0]["output_tokens"], 2, "{answer}: {usage}");
        // The gateway still serves.
        let (status, _) = post_raw(&format!("{}/v1/chat/completions", gw.url()), &k, BODY).await;
        assert_eq!(status, 200);
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn shape_errors_name_the_field_and_never_reach_the_upstream() {
    set_upstream_key();
    let up = Capture::start(200, "application/json", ANSWER).await;
    let gw = gateway(&yaml(&up.url, None)).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let cases: [(&str, &'static str, Option<&str>); 6] = [
        (
            chat.as_str(),
            r#"{"model":"m","messages":[],"max_tokens":2}"#,
            Some("messages"),
        ),
        (
            chat.as_str(),
            r#"{"model":"m","messages":"hi"}"#,
            Some("messages"),
        ),
        (
            chat.as_str(),
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
            Some("temperature"),
        ),
        (chat.as_str(), r#"["model","m"]"#, None),
        (chat.as_str(), r#"{"model":"m","messages":[{"#, None),
        (chat.as_str(), "", None),
    ];
    for (url, body, param) in cases {
        let (status, text) = post_raw(url, &k, body).await;
        assert_eq!(status, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let e = assert_openai_error(&v);
        match param {
            Some(p) => assert_eq!(e["param"], p, "{body}: {text}"),
            None => assert!(e["param"].is_null(), "{body}: {text}"),
        }
    }
    assert!(up.bodies().is_empty());
    gw.shutdown().await;
}

const CONTEXT_ERROR: &str = r#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;

#[tokio::test]
async fn an_upstream_client_error_reaches_the_client_as_that_error_never_a_503() {
    let up = Capture::start(400, "application/json", CONTEXT_ERROR).await;
    // A context-length error moves on to the fallback (it may have a larger window); when
    // that answers the same, the client gets the 400, not a retryable 503.
    let yaml = format!(
        "upstreams:\n  - {{name: up, base_url: \"{}\"}}\nmodels:\n  - name: m\n    targets: [{{upstream: up}}]\n    retries: 2\n    fallbacks: [m2]\n  - name: m2\n    targets: [{{upstream: up}}]\n    retries: 2\n",
        up.url
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .bearer_auth(&k)
        .json(&chat_body("m"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    assert!(resp.headers().get(header::RETRY_AFTER).is_none());
    let body: Value = resp.json().await.unwrap();
    let sent: Value = serde_json::from_str(CONTEXT_ERROR).unwrap();
    assert_eq!(body, sent, "the upstream's error as it sent it");
    assert_eq!(
        up.bodies().len(),
        2,
        "one try per target, no retries of a 400"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_client_cannot_name_where_an_engine_connects() {
    set_upstream_key();
    let up = Capture::start(200, "application/json", ANSWER).await;
    let gw = gateway(&yaml(&up.url, None)).await;
    let k = key(&gw, "t");
    const BODY: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"vendor_x":7,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_host":"10.9.9.9","remote_port":5557,"remote_engine_id":"e","remote_block_ids":[1,2],"remote_request_id":"r"}}"#;
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .bearer_auth(&k)
        .header("content-type", "application/json")
        .header("x-prefiller-host-port", "10.9.9.9:8000")
        .header("x-prefiller-url", "http://10.9.9.9:8000")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let (headers, body) = up.seen.lock()[0].clone();
    let sent: Value = serde_json::from_slice(&body).unwrap();
    assert!(sent.get("kv_transfer_params").is_none(), "{sent}");
    assert_eq!(sent["vendor_x"], 7, "other fields kept: {sent}");
    assert_eq!(sent["messages"][0]["content"], "hi");
    assert!(
        headers
            .keys()
            .all(|h| !h.as_str().starts_with("x-prefiller-")),
        "{headers:?}"
    );
    gw.shutdown().await;
}
