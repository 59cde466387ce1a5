//! vLLM's other routes through the gateway: tokenize, detokenize, rerank (three paths),
//! score (two), pooling, classify and the chat batch reach the upstream on the same path,
//! with the key checked, the model resolved, limits applied and the usage the answer
//! carries booked (none for the tokenizer routes); bad bodies are OpenAI-shaped 400s that
//! never reach the upstream.

mod common;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, Uri};
use axum::response::IntoResponse;
use common::*;
use parking_lot::Mutex;
use serde_json::{json, Value};

/// A loopback vLLM stand-in: records (path, headers, body) and answers each route the
/// way vLLM does (its usage fields included).
struct FakeVllm {
    url: String,
    seen: Arc<Mutex<Vec<(String, HeaderMap, Value)>>>,
    task: tokio::task::JoinHandle<()>,
}

fn answer(path: &str) -> Value {
    match path {
        "/tokenize" => json!({"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]}),
        "/detokenize" => json!({"prompt": "hello"}),
        "/rerank" | "/v1/rerank" | "/v2/rerank" => json!({
            "id": "rerank-1", "model": "m",
            "usage": {"total_tokens": 21},
            "results": [{"index": 1, "document": {"text": "b"}, "relevance_score": 0.9}]
        }),
        "/score" | "/v1/score" => json!({
            "id": "score-1", "object": "list", "model": "m",
            "data": [{"index": 0, "object": "score", "score": 0.7}],
            "usage": {"prompt_tokens": 13, "total_tokens": 13, "completion_tokens": 0}
        }),
        "/pooling" | "/classify" => json!({
            "id": "p-1", "object": "list", "model": "m",
            "data": [{"index": 0, "object": "pooling", "data": [0.1, 0.2]}],
            "usage": {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}
        }),
        "/v1/chat/completions/batch" => json!({
            "id": "b-1", "object": "chat.completion", "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"},
                {"index": 1, "message": {"role": "assistant", "content": "b"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
        }),
        _ => {
            json!({"error": {"message": "no such route", "type": "NotFoundError", "param": null, "code": 404}})
        }
    }
}

impl FakeVllm {
    async fn start() -> FakeVllm {
        let seen: Arc<Mutex<Vec<(String, HeaderMap, Value)>>> = Arc::default();
        let s2 = seen.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let seen = s2.clone();
            async move {
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                seen.lock().push((uri.path().to_string(), headers, v));
                (
                    [(header::CONTENT_TYPE, "application/json")],
                    answer(uri.path()).to_string(),
                )
                    .into_response()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeVllm { url, seen, task }
    }

    fn paths(&self) -> Vec<String> {
        self.seen.lock().iter().map(|(p, _, _)| p.clone()).collect()
    }
}

impl Drop for FakeVllm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn yaml(url: &str, extra: &str) -> String {
    format!(
        "upstreams:\n  - {{name: up, base_url: \"{url}\", api_key_env: STRATA_GW_VLLM_ROUTES_KEY}}\n\
         models:\n  - name: m\n    aliases: [m-alias]\n    targets: [{{upstream: up}}]\n    \
         price: {{input_per_1m: 1000000, output_per_1m: 1000000}}\n{extra}"
    )
}

/// (route, body, expected input tokens, expected output tokens)
fn cases() -> Vec<(&'static str, Value, u64, u64)> {
    vec![
        (
            "/tokenize",
            json!({"model": "m-alias", "prompt": "hello there"}),
            0,
            0,
        ),
        (
            "/detokenize",
            json!({"model": "m-alias", "tokens": [1, 2, 3]}),
            0,
            0,
        ),
        (
            "/rerank",
            json!({"model": "m-alias", "query": "q", "documents": ["a", "b"]}),
            21,
            0,
        ),
        (
            "/v1/rerank",
            json!({"model": "m-alias", "query": "q", "documents": ["a", "b"]}),
            21,
            0,
        ),
        (
            "/v2/rerank",
            json!({"model": "m-alias", "query": "q", "documents": ["a", "b"]}),
            21,
            0,
        ),
        (
            "/score",
            json!({"model": "m-alias", "text_1": "a", "text_2": ["b"]}),
            13,
            0,
        ),
        (
            "/v1/score",
            json!({"model": "m-alias", "text_1": "a", "text_2": ["b"]}),
            13,
            0,
        ),
        ("/pooling", json!({"model": "m-alias", "input": "a"}), 7, 0),
        ("/classify", json!({"model": "m-alias", "input": "a"}), 7, 0),
        (
            "/v1/chat/completions/batch",
            json!({"model": "m-alias", "messages": [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]]}),
            9,
            2,
        ),
    ]
}

#[tokio::test]
async fn every_vllm_route_passes_through_with_auth_and_usage() {
    std::env::set_var("STRATA_GW_VLLM_ROUTES_KEY", "sk-up");
    let up = FakeVllm::start().await;
    let gw = gateway(&yaml(&up.url, "")).await;
    for (i, (path, body, input, output)) in cases().into_iter().enumerate() {
        let url = format!("{}{path}", gw.url());
        // No key: a 401, nothing sent upstream.
        let (status, _, err) = post(&url, None, &body).await;
        assert_eq!(status, 401, "{path}: {err}");
        assert_openai_error(&err);
        assert_eq!(
            up.paths().len(),
            i,
            "{path}: nothing forwarded without a key"
        );

        let tenant = format!("t{i}");
        let k = key(&gw, &tenant);
        let (status, _, got) = post(&url, Some(&k), &body).await;
        assert_eq!(status, 200, "{path}: {got}");
        assert_eq!(got, answer(path), "{path}: answer relayed");
        let (seen_path, headers, sent) = up.seen.lock().last().cloned().unwrap();
        assert_eq!(seen_path, path, "same path upstream");
        assert_eq!(sent["model"], "m", "{path}: the alias resolved");
        assert_eq!(headers["authorization"], "Bearer sk-up");

        let (_, usage) = admin_get(&gw, &format!("/admin/usage?tenant={tenant}")).await;
        let row = &usage["data"][0];
        assert_eq!(row["requests"], 1, "{path}: {usage}");
        assert_eq!(row["input_tokens"], input, "{path}: {usage}");
        assert_eq!(row["output_tokens"], output, "{path}: {usage}");
        assert_eq!(
            row["cost_micros"],
            ((input + output) * 1_000_000) as i64,
            "{path}: {usage}"
        );
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn bad_bodies_on_vllm_routes_are_openai_400s_never_forwarded() {
    std::env::set_var("STRATA_GW_VLLM_ROUTES_KEY", "sk-up");
    let up = FakeVllm::start().await;
    let gw = gateway(&yaml(&up.url, "")).await;
    let k = key(&gw, "t");
    for (path, body, param) in [
        ("/tokenize", json!({"model": "m"}), Some("prompt")),
        (
            "/detokenize",
            json!({"model": "m", "tokens": ["a"]}),
            Some("tokens"),
        ),
        (
            "/detokenize",
            json!({"model": "m", "tokens": [-1]}),
            Some("tokens"),
        ),
        (
            "/rerank",
            json!({"model": "m", "documents": ["a"]}),
            Some("query"),
        ),
        (
            "/v2/rerank",
            json!({"model": "m", "query": "q", "documents": []}),
            Some("documents"),
        ),
        (
            "/v1/chat/completions/batch",
            json!({"model": "m", "messages": [[]]}),
            Some("messages"),
        ),
        ("/score", json!({"text_1": "a", "text_2": "b"}), None),
        ("/pooling", json!([1, 2]), None),
    ] {
        let (status, _, err) = post(&format!("{}{path}", gw.url()), Some(&k), &body).await;
        assert_eq!(status, 400, "{path} {body}: {err}");
        let e = assert_openai_error(&err);
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{path}: {err}");
        }
    }
    // An unknown model is a 404, as on chat.
    let (status, _, err) = post(
        &format!("{}/classify", gw.url()),
        Some(&k),
        &json!({"model": "nope", "input": "a"}),
    )
    .await;
    assert_eq!(status, 404, "{err}");
    assert!(up.paths().is_empty(), "nothing forwarded: {:?}", up.paths());
    // Nothing booked for refused requests.
    let (_, usage) = admin_get(&gw, "/admin/usage?tenant=t").await;
    assert_eq!(usage["total_requests"], 0, "{usage}");
    // A streamed ask on a route that does not stream is answered whole.
    let (status, _, got) = post(
        &format!("{}/v1/rerank", gw.url()),
        Some(&k),
        &json!({"model": "m", "query": "q", "documents": ["a"], "stream": true}),
    )
    .await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["usage"]["total_tokens"], 21);
    gw.shutdown().await;
}

#[tokio::test]
async fn request_limits_apply_to_vllm_routes() {
    std::env::set_var("STRATA_GW_VLLM_ROUTES_KEY", "sk-up");
    let up = FakeVllm::start().await;
    let gw = gateway(&yaml(&up.url, "")).await;
    let k = key_with(
        &gw,
        strata_gateway::CreateKey {
            tenant: "t".into(),
            rpm: Some(2),
            ..Default::default()
        },
    );
    let body = json!({"model": "m", "prompt": "hi"});
    let url = format!("{}/tokenize", gw.url());
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(post(&url, Some(&k), &body).await.0);
        }
        v
    };
    assert_eq!(statuses, vec![200, 200, 429]);
    assert_eq!(up.paths().len(), 2);
    gw.shutdown().await;
}
