//! The router on loopback in front of mock engines: routing, streaming, retries, faults,
//! admission, bad input and the data layer.

use std::collections::HashSet;
use std::future::IntoFuture;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use strata_mock::{EngineKind as MockKind, Fault, MockConfig, MockEngine};
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};
use strata_router::Router;

mod common;
use common::{start, wait_for, Harness};

async fn mock(model: &str) -> MockEngine {
    MockEngine::spawn(MockConfig {
        model: model.into(),
        kind: MockKind::Vllm,
        output_tokens: 4,
        ..Default::default()
    })
    .await
    .unwrap()
}

fn fast_config(mocks: &[&MockEngine]) -> RouterConfig {
    RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        scrape_timeout_ms: 200,
        stale_after_ms: 200,
        endpoints: mocks
            .iter()
            .map(|m| EndpointSpec::new(m.url(), EngineKind::Vllm))
            .collect(),
        ..RouterConfig::default()
    }
}

struct Resp {
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: Bytes,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Harness {
    async fn send(&self, method: Method, path: &str, body: &str, headers: &[(&str, &str)]) -> Resp {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = self
            .client
            .request(b.body(Full::new(Bytes::from(body.to_string()))).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Resp {
            status,
            headers: parts.headers,
            body,
        }
    }

    async fn chat(&self, body: Value) -> Resp {
        self.send(Method::POST, "/v1/chat/completions", &body.to_string(), &[])
            .await
    }
}

fn chat_body(model: &str, stream: bool) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hello there"}], "stream": stream})
}

fn assert_openai_error(r: &Resp, status: u16) {
    assert_eq!(r.status.as_u16(), status, "{}", r.text());
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_streams_and_propagates_request_ids() {
    let (a, b) = (mock("m").await, mock("m").await);
    let h = start(fast_config(&[&a, &b])).await;
    let r = h
        .send(
            Method::POST,
            "/v1/chat/completions",
            &chat_body("m", false).to_string(),
            &[("x-request-id", "req-123")],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.header("x-request-id"), Some("req-123"));
    assert!(r.header("x-mock-replica").is_some());
    assert!(r.header("x-gateway-destination-endpoint-served").is_some());
    assert_eq!(r.json()["object"], "chat.completion");

    // A generated id when the client sends none.
    let r = h.chat(chat_body("m", false)).await;
    assert!(r.header("x-request-id").is_some_and(|v| v.len() >= 8));

    // Streaming passes SSE through, ending in [DONE].
    let r = h.chat(chat_body("m", true)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let text = r.text();
    assert!(text.contains("chat.completion.chunk"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    // Text completions, token prompts and the other routes.
    let r = h
        .send(
            Method::POST,
            "/v1/completions",
            &json!({"model": "m", "prompt": [1, 2, 3]}).to_string(),
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let r = h.send(Method::GET, "/v1/models", "", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["data"][0]["id"], "m");
    let r = h.send(Method::GET, "/health", "", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h.send(Method::GET, "/metrics", "", &[]).await;
    let text = r.text();
    for name in [
        "strata_router_picks_total",
        "strata_router_schedule_duration_seconds_bucket",
        "strata_router_prefix_index_blocks",
        "strata_router_prefix_hit_ratio",
        "strata_router_endpoint_waiting",
        "strata_router_endpoint_ready",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    let r = h.send(Method::GET, "/debug/endpoints", "", &[]).await;
    let v = r.json();
    assert_eq!(v["endpoints"].as_array().unwrap().len(), 2);
    assert_eq!(v["endpoints"][0]["ready"], true);
    assert_eq!(a.requests() + b.requests(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_never_reach_a_replica() {
    let a = mock("m").await;
    let mut cfg = fast_config(&[&a]);
    cfg.endpoints[0].model = Some("m".into());
    cfg.max_body_bytes = 4096;
    let h = start(cfg).await;
    // What the router cannot route: answered here, nothing reaches the replica.
    let cases: Vec<(&str, String, u16)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400),
        ("/v1/chat/completions", "[]".into(), 400),
        (
            "/v1/completions",
            json!({"model": "other", "prompt": "x"}).to_string(),
            404,
        ),
        (
            "/v1/chat/completions",
            format!(
                "{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
                "x".repeat(5000)
            ),
            413,
        ),
        ("/v1/embeddings", "7".into(), 400),
        ("/v1/embeddings", json!({"model": 3}).to_string(), 400),
        ("/nope", "{}".into(), 404),
    ];
    for (path, body, status) in cases {
        let r = h.send(Method::POST, path, &body, &[]).await;
        assert_openai_error(&r, status);
    }
    let r = h.send(Method::GET, "/v1/chat/completions", "", &[]).await;
    assert_openai_error(&r, 405);
    let r = h
        .send(
            Method::POST,
            "/v1/chat/completions",
            &chat_body("m", false).to_string(),
            &[("x-strata-scheduling-profile", "ghost")],
        )
        .await;
    assert_openai_error(&r, 400);
    assert_eq!(a.requests(), 0, "no malformed request reached the replica");

    // What the engine validates is its to judge (issue 26): these used to be refused here;
    // now each reaches the replica and its own answer, success or error, comes back
    // unchanged (the same status and error the replica gives when asked directly).
    let judged: Vec<(&str, Value)> = vec![
        ("/v1/chat/completions", json!({"model": "m"})),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": []}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}),
        ),
        ("/v1/completions", json!({"model": "m", "prompt": ""})),
        (
            "/v1/completions",
            json!({"model": "m", "prompt": "x", "max_tokens": -1}),
        ),
    ];
    let direct = Harness {
        router: h.router.clone(),
        base: a.url(),
        client: h.client.clone(),
    };
    for (i, (path, body)) in judged.iter().enumerate() {
        let want = direct
            .send(Method::POST, path, &body.to_string(), &[])
            .await;
        let got = h.send(Method::POST, path, &body.to_string(), &[]).await;
        assert_eq!(got.status, want.status, "{body}: {}", got.text());
        if want.status.is_success() {
            assert_eq!(got.json()["object"], want.json()["object"], "{body}");
        } else {
            assert_eq!(got.json(), want.json(), "{body}");
        }
        assert_eq!(
            a.requests(),
            2 * (i as u64 + 1),
            "{body} reached the replica"
        );
    }
    // Still serving afterwards.
    assert_eq!(h.chat(chat_body("m", false)).await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_is_retried_around_and_gets_nothing_new() {
    let slow = MockEngine::spawn(MockConfig {
        model: "m".into(),
        ttft: Duration::from_secs(30),
        ..Default::default()
    })
    .await
    .unwrap();
    let b = mock("m").await;
    // Make the slow replica the scheduler's clear favourite.
    b.set_gauges(4, 0, 0.7);
    let h = start(fast_config(&[&slow, &b])).await;
    let hb = h.client.clone();
    let base = h.base.clone();
    let pending = tokio::spawn(async move {
        let req = Request::post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(chat_body("m", false).to_string())))
            .unwrap();
        let resp = hb.request(req).await.unwrap();
        let replica = resp.headers().get("x-mock-replica").cloned();
        let status = resp.status();
        (
            status,
            replica,
            resp.into_body().collect().await.unwrap().to_bytes(),
        )
    });
    wait_for("the request to reach the slow replica", || {
        let n = slow.in_flight();
        async move { n == 1 }
    })
    .await;
    let slow_url = slow.url();
    slow.shutdown().await;
    let (status, replica, body) = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, StatusCode::OK, "{body:?}");
    assert_eq!(
        replica.unwrap().to_str().unwrap(),
        b.replica(),
        "retried on the live replica"
    );
    let before = b.requests();
    for _ in 0..10 {
        let r = h.chat(chat_body("m", false)).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.header("x-mock-replica"), Some(b.replica()));
    }
    assert_eq!(b.requests() - before, 10);
    let st = h.router.status();
    let dead = st.iter().find(|e| e.spec.url == slow_url).unwrap();
    assert!(!dead.ready, "{dead:?}");
    let text = h.router.metrics().encode();
    let retried: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("strata_router_retried_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    assert!(retried >= 1, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_mid_way_ends_with_an_error_event() {
    let a = mock("m").await;
    a.set_fault(Fault::CloseMidStream { after_chunks: 2 });
    let h = start(fast_config(&[&a])).await;
    let r = h.chat(chat_body("m", true)).await;
    assert_eq!(r.status, StatusCode::OK);
    let text = r.text();
    assert!(text.contains("chat.completion.chunk"), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let v: Value = serde_json::from_str(last.trim_start_matches("data: ")).unwrap();
    assert!(v["error"]["message"].is_string(), "{last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_cut_before_any_byte_is_retried_and_5xx_opens_the_circuit() {
    let (a, b) = (mock("m").await, mock("m").await);
    b.set_gauges(4, 0, 0.7); // a is preferred
    let mut cfg = fast_config(&[&a, &b]);
    cfg.circuit.failures = 3;
    cfg.circuit.open_ms = 60_000;
    let h = start(cfg).await;
    a.set_fault(Fault::CloseMidStream { after_chunks: 0 });
    let r = h.chat(chat_body("m", false)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(r.header("x-mock-replica"), Some(b.replica()));
    a.set_fault(Fault::Status(503));
    for _ in 0..10 {
        let r = h.chat(chat_body("m", false)).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.header("x-mock-replica"), Some(b.replica()));
    }
    assert_eq!(
        a.requests(),
        3,
        "the circuit opened after 3 consecutive failures"
    );
    let st = h.router.status();
    assert!(st.iter().any(|e| e.circuit.is_open()));
    // With every replica failing, the client gets the upstream's 5xx, not a hang.
    b.set_fault(Fault::Status(500));
    let r = h.chat(chat_body("m", false)).await;
    assert_eq!(r.status.as_u16(), 500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_or_garbage_metrics_are_stale_never_fatal() {
    let (a, b, c) = (mock("m").await, mock("m").await, mock("m").await);
    let h = start(fast_config(&[&a, &b, &c])).await;
    a.set_fault(Fault::HangMetrics);
    b.set_fault(Fault::GarbageMetrics);
    let r = h.router.clone();
    let (ua, ub) = (a.url(), b.url());
    wait_for("a and b to go stale", || {
        let s = r.status();
        let (ua, ub) = (ua.clone(), ub.clone());
        async move {
            s.iter()
                .filter(|e| (e.spec.url == ua || e.spec.url == ub) && e.stale)
                .count()
                == 2
        }
    })
    .await;
    for e in h.router.status() {
        assert!(
            e.ready,
            "stale metrics do not make an endpoint unready: {e:?}"
        );
    }
    let st = h.router.status();
    assert!(st
        .iter()
        .find(|e| e.spec.url == ub)
        .unwrap()
        .last_error
        .as_deref()
        .unwrap()
        .contains("metrics"));
    // Fresh c wins the scoring; everything is still served.
    for _ in 0..6 {
        let r = h.chat(chat_body("m", false)).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("x-mock-replica"), Some(c.replica()));
    }
    assert!(h
        .router
        .metrics()
        .encode()
        .contains("strata_router_scrape_errors_total"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_is_not_ready_gets_nothing() {
    let (a, b) = (mock("m").await, mock("m").await);
    let h = start(fast_config(&[&a, &b])).await;
    a.set_fault(Fault::NotReady);
    let r = h.router.clone();
    let ua = a.url();
    wait_for("a unready", || {
        let s = r.status();
        let ua = ua.clone();
        async move { s.iter().any(|e| e.spec.url == ua && !e.ready) }
    })
    .await;
    let before = a.requests();
    for _ in 0..10 {
        assert_eq!(h.chat(chat_body("m", false)).await.status, StatusCode::OK);
    }
    assert_eq!(a.requests(), before);
    b.set_fault(Fault::NotReady);
    let r = h.router.clone();
    wait_for("none ready", || {
        let s = r.status();
        async move { s.iter().all(|e| !e.ready) }
    })
    .await;
    assert_openai_error(&h.chat(chat_body("m", false)).await, 503);
    assert_openai_error(&h.send(Method::GET, "/health", "", &[]).await, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_cancels_the_upstream_request() {
    let a = mock("m").await;
    let h = start(fast_config(&[&a])).await;
    a.set_fault(Fault::Hang);
    let client = h.client.clone();
    let base = h.base.clone();
    let task = tokio::spawn(async move {
        let req = Request::post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(chat_body("m", true).to_string())))
            .unwrap();
        let _ = client.request(req).await;
    });
    wait_for("the upstream request", || {
        let n = a.in_flight();
        async move { n == 1 }
    })
    .await;
    task.abort();
    wait_for("the upstream request to be cancelled", || {
        let n = a.in_flight();
        async move { n == 0 }
    })
    .await;
    let r = h.router.clone();
    wait_for("router in-flight back to 0", || {
        let s = r.status();
        async move { s[0].in_flight == 0 }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_requests_get_429_while_saturated_others_wait() {
    let a = mock("m").await;
    let mut cfg = fast_config(&[&a]);
    cfg.admission.queue_timeout_ms = 100;
    cfg.admission.objectives.insert("batch".into(), -1);
    let h = start(cfg).await;
    a.set_gauges(10, 0, 0.1);
    let r = h.router.clone();
    wait_for("saturation", || {
        let s = r.saturated();
        async move { s }
    })
    .await;
    let body = chat_body("m", false).to_string();
    let r = h
        .send(
            Method::POST,
            "/v1/chat/completions",
            &body,
            &[("x-gateway-inference-objective", "batch")],
        )
        .await;
    assert_openai_error(&r, 429);
    assert_eq!(r.header("retry-after"), Some("1"));
    let mut sheddable = chat_body("m", false);
    sheddable["priority"] = json!(-5);
    assert_openai_error(&h.chat(sheddable).await, 429);
    assert_eq!(a.requests(), 0);
    // Priority 0 waits out its time to live (the queue timeout, short here), then is
    // evicted with 503: the engines never see it.
    let r = h.chat(chat_body("m", false)).await;
    assert_openai_error(&r, 503);
    assert_eq!(a.requests(), 0);
    let text = h.router.metrics().encode();
    assert!(text.contains("strata_router_shed_total 2"), "{text}");
    assert!(text.contains("strata_router_queued_total 1"), "{text}");
    assert!(
        text.contains("strata_router_flow_evicted_total{reason=\"ttl\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("strata_router_flow_refused_total{reason=\"shed\"} 2"),
        "{text}"
    );
    // Capacity returns: sheddable requests pass again.
    a.set_gauges(0, 0, 0.1);
    let r = h.router.clone();
    wait_for("unsaturated", || {
        let s = !r.saturated();
        async move { s }
    })
    .await;
    let r = h
        .send(
            Method::POST,
            "/v1/chat/completions",
            &body,
            &[("x-gateway-inference-objective", "batch")],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_pool_changes_drain_and_split() {
    let (a, b) = (mock("m").await, mock("m").await);
    let mut cfg = fast_config(&[&a]);
    cfg.scheduling = Some(strata_router::EndpointPickerConfig::weighted(&[(
        "round-robin-scorer",
        1.0,
    )]));
    let h = start(cfg).await;
    let mut spec = EndpointSpec::new(b.url(), EngineKind::Vllm);
    spec.group = Some("canary".into());
    h.router.add_endpoint(spec.clone()).unwrap();
    assert!(h.router.add_endpoint(spec).is_err(), "duplicates refused");
    let r = h.router.clone();
    wait_for("b ready", || {
        let s = r.status();
        async move { s.len() == 2 && s.iter().all(|e| e.ready) }
    })
    .await;
    // Split: everything to the canary group.
    h.router.set_split(strata_router::TrafficSplit(
        [("canary".to_string(), 1.0)].into_iter().collect(),
    ));
    for _ in 0..5 {
        assert_eq!(
            h.chat(chat_body("m", false)).await.header("x-mock-replica"),
            Some(b.replica())
        );
    }
    h.router.set_split(Default::default());
    // Draining b: only a.
    h.router.set_draining(&b.url(), true).unwrap();
    for _ in 0..5 {
        assert_eq!(
            h.chat(chat_body("m", false)).await.header("x-mock-replica"),
            Some(a.replica())
        );
    }
    h.router.set_draining(&b.url(), false).unwrap();
    let seen: HashSet<String> =
        futures_util::future::join_all((0..6).map(|_| h.chat(chat_body("m", false))))
            .await
            .iter()
            .map(|r| r.header("x-mock-replica").unwrap().to_string())
            .collect();
    assert_eq!(seen.len(), 2, "round-robin reaches both");
    h.router.remove_endpoint(&a.url()).unwrap();
    assert!(h.router.remove_endpoint(&a.url()).is_err());
    for _ in 0..3 {
        assert_eq!(
            h.chat(chat_body("m", false)).await.header("x-mock-replica"),
            Some(b.replica())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoints_file_is_watched() {
    let (a, b) = (mock("m").await, mock("m").await);
    let dir = std::env::temp_dir().join(format!("strata-router-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("endpoints.txt");
    std::fs::write(&path, format!("{}\n", a.url())).unwrap();
    let h = start(fast_config(&[&a])).await;
    tokio::spawn(strata_router::server::watch_endpoints_file(
        h.router.clone(),
        path.clone(),
        Vec::new(),
        Duration::from_millis(20),
    ));
    // Modification times can be coarse: rewrite until the change is seen.
    let want = vec![b.url()];
    let r = h.router.clone();
    let p = path.clone();
    let contents = format!("endpoints:\n  - url: {}\n    kind: strata\n", b.url());
    wait_for("the file change to apply", || {
        let _ = std::fs::write(&p, &contents);
        let eps = r.endpoints();
        let want = want.clone();
        async move { eps == want }
    })
    .await;
    std::fs::write(&path, "endpoints: [").unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        h.router.endpoints(),
        vec![b.url()],
        "a broken file is ignored"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `/v1/models` lists what every ready endpoint serves, also when endpoints carry `model`
/// labels (the scheduler's model filter must not refuse a request that names no model).
#[tokio::test]
async fn models_lists_the_union_over_labelled_endpoints() {
    let a = mock("alpha").await;
    let b = mock("beta").await;
    let c = mock("beta").await;
    let mut config = fast_config(&[&a, &b, &c]);
    config.endpoints[0].model = Some("alpha".into());
    config.endpoints[1].model = Some("beta".into());
    config.endpoints[2].model = Some("beta".into());
    let h = start(config).await;
    let r = h.send(Method::GET, "/v1/models", "", &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "list");
    let mut ids: Vec<String> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    assert_eq!(ids, ["alpha", "beta"]);

    // With the only "alpha" endpoint gone, "beta" is still listed; with none ready, 503.
    let a_url = a.url();
    a.shutdown().await;
    h.router.remove_endpoint(&a_url).unwrap();
    let r = h.send(Method::GET, "/v1/models", "", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["data"].as_array().unwrap().len(), 1);
    h.router.remove_endpoint(&b.url()).unwrap();
    h.router.remove_endpoint(&c.url()).unwrap();
    let r = h.send(Method::GET, "/v1/models", "", &[]).await;
    assert_openai_error(&r, 503);
}

/// The last SSE event of a stream, parsed.
fn last_event(text: &str) -> Value {
    let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
    serde_json::from_str(last.trim_start_matches("data: ")).unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminator_split_at_every_byte_ends_the_stream_cleanly() {
    let a = MockEngine::spawn(MockConfig {
        model: "m".into(),
        output_tokens: 3,
        split_stream_bytes: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let h = start(fast_config(&[&a])).await;
    for _ in 0..3 {
        let r = h.chat(chat_body("m", true)).await;
        assert_eq!(r.status, StatusCode::OK);
        let text = r.text();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(
            !text.contains("\"error\""),
            "no error event appended: {text}"
        );
    }
    // Nothing was counted against the replica: its circuit stays closed.
    let st = h.router.status();
    assert!(!st[0].circuit.is_open() && st[0].ready, "{:?}", st[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_that_quotes_done_does_not_hide_a_broken_stream() {
    let a = MockEngine::spawn(MockConfig {
        model: "m".into(),
        output_tokens: 6,
        token_text: " [DONE]".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    a.set_fault(Fault::CloseMidStream { after_chunks: 2 });
    let h = start(fast_config(&[&a])).await;
    let r = h.chat(chat_body("m", true)).await;
    let text = r.text();
    assert!(text.contains("[DONE]"), "the content quotes it: {text}");
    assert!(
        last_event(&text)["error"]["message"].is_string(),
        "the cut stream ends with an error event: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_without_metrics_are_routed_by_in_flight_counts() {
    // Two OpenAI-compatible backends whose /metrics is not served at all (a plain proxy, a
    // hosted API, llama.cpp without --metrics).
    let (a, b) = (mock("m").await, mock("m").await);
    a.set_fault(Fault::NoMetrics);
    b.set_fault(Fault::NoMetrics);
    let router = Router::new(fast_config(&[&a, &b])).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(axum::serve(listener, strata_router::proxy::app(router.clone())).into_future());
    let r = router.clone();
    wait_for("both ready, with their load unknown", || {
        let s = r.status();
        async move {
            s.len() == 2
                && s.iter()
                    .all(|e| e.ready && e.load_unknown && e.last_error.is_some())
        }
    })
    .await;
    let h = Harness {
        router,
        base,
        client: Client::builder(TokioExecutor::new()).build_http(),
    };
    let started = std::time::Instant::now();
    for i in 0..20 {
        let body = json!({"model": "m", "stream": false, "messages": [
            {"role": "user", "content": format!("question number {i} about something else entirely")}
        ]});
        let t = std::time::Instant::now();
        let r = h.chat(body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "held {:?}: an endpoint without metrics must not wait for the admission timeout",
            t.elapsed()
        );
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // Least-request with random ties: both got traffic.
    assert!(
        a.requests() > 0 && b.requests() > 0,
        "{} / {}",
        a.requests(),
        b.requests()
    );
    // The debug view says why.
    let d = h
        .send(Method::GET, "/debug/endpoints", "", &[])
        .await
        .json();
    for e in d["endpoints"].as_array().unwrap() {
        assert_eq!(e["load_unknown"], true, "{e}");
        assert_eq!(e["saturated"], false, "{e}");
    }
}
