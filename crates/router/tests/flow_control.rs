//! Flow control end to end over mock engines on loopback: fair shares between a noisy and
//! a quiet tenant on a saturated pool, bounds answered with 429, and a request to an empty
//! pool held until an engine starts.
//!
//! The engines publish no metrics, so the router judges their load by its own requests in
//! flight (`saturation.unknown_load_max_in_flight`): a pool of one engine with 2 slots is
//! saturated by a handful of clients, exactly and without timing on scrapes.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use strata_mock::{Fault, MockConfig, MockEngine};
use strata_router::config::RouterConfig;
use strata_router::{EndpointSpec, EngineKind, Router};

use common::{wait_for, HttpClient};

const FLOW: &str = "x-gateway-inference-fairness-id";

struct Front {
    router: Router,
    base: String,
    client: HttpClient,
}

impl Front {
    async fn start(config: RouterConfig) -> Front {
        let router = Router::new(config).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let app = strata_router::proxy::app(router.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Front {
            router,
            base,
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    async fn ready(&self) {
        let r = self.router.clone();
        wait_for("endpoint ready", || {
            let ok = r.any_ready();
            async move { ok }
        })
        .await;
    }

    /// A chat request from `flow`; its status, body and how long it took.
    async fn chat(&self, flow: Option<&str>) -> (StatusCode, Value, Duration) {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let mut b = Request::post(format!("{}/v1/chat/completions", self.base))
            .header("content-type", "application/json");
        if let Some(f) = flow {
            b = b.header(FLOW, f);
        }
        let started = Instant::now();
        let resp = self
            .client
            .request(b.body(Full::new(Bytes::from(body.to_string()))).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, v, started.elapsed())
    }

    async fn get(&self, path: &str) -> Value {
        let resp = self
            .client
            .request(
                Request::get(format!("{}{path}", self.base))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }
}

/// A mock that publishes no metrics and answers in about `ttft + 3 × itl`.
async fn engine(ttft_ms: u64, itl_ms: u64) -> MockEngine {
    let m = MockEngine::spawn(MockConfig {
        model: "m".into(),
        output_tokens: 3,
        ttft: Duration::from_millis(ttft_ms),
        itl: Duration::from_millis(itl_ms),
        ..Default::default()
    })
    .await
    .unwrap();
    m.set_fault(Fault::NoMetrics);
    m
}

/// One endpoint at `url` with `slots` requests in flight at most.
fn config(url: &str, slots: u32) -> RouterConfig {
    let mut c = RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        scrape_timeout_ms: 200,
        endpoints: vec![EndpointSpec::new(url, EngineKind::Vllm)],
        ..RouterConfig::default()
    };
    c.saturation.unknown_load_max_in_flight = slots;
    c
}

fn p90(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let i = ((v.len() as f64 * 0.9).ceil() as usize).clamp(1, v.len());
    v[i - 1]
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Open-loop load for `secs`: the noisy tenant every 10 ms, the quiet one every 100 ms
/// (10× less). Each request names its tenant as its flow, or, with `shared`, none (one
/// flow for all: first come, first served). Latencies of (quiet, noisy), all answered 200.
async fn two_tenants(
    front: &std::sync::Arc<Front>,
    secs: u64,
    shared: bool,
) -> (Vec<Duration>, Vec<Duration>) {
    let mut tasks = Vec::new();
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut n = 0u64;
    loop {
        let at = tick.tick().await;
        if at >= end {
            break;
        }
        let quiet = n % 10 == 5;
        n += 1;
        for who in std::iter::once("noisy").chain(quiet.then_some("quiet")) {
            let f = front.clone();
            tasks.push(tokio::spawn(async move {
                let (status, v, took) = f.chat((!shared).then_some(who)).await;
                assert_eq!(status, StatusCode::OK, "{v}");
                (who, took)
            }));
        }
    }
    let (mut quiet, mut noisy) = (Vec::new(), Vec::new());
    for t in tasks {
        let (who, took) = t.await.unwrap();
        if who == "quiet" {
            quiet.push(took);
        } else {
            noisy.push(took);
        }
    }
    (quiet, noisy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quiet_tenant_keeps_its_fair_share_on_a_saturated_pool() {
    // One engine, two slots, about 40 ms a request: 50 requests/s. The noisy tenant sends
    // 100/s, the quiet one 10/s: the pool is saturated and a queue builds.
    let e = engine(10, 10).await;
    let front = std::sync::Arc::new(Front::start(config(&e.url(), 2)).await);
    front.ready().await;
    // Alone: the quiet tenant's requests one at a time.
    let mut alone = Vec::new();
    for _ in 0..5 {
        let (status, _, took) = front.chat(Some("quiet")).await;
        assert_eq!(status, StatusCode::OK);
        alone.push(took);
    }
    let alone_max = alone.iter().copied().max().unwrap();

    let (quiet, noisy) = two_tenants(&front, 1, false).await;
    let (fair_quiet, fair_noisy) = (p90(quiet.clone()), median(noisy.clone()));
    // Round robin between the two flows: a quiet request waits for at most one noisy
    // request ahead of it per free slot, so it is served within a few service times; the
    // noisy tenant absorbs its own backlog.
    assert!(
        fair_quiet <= alone_max * 3 + Duration::from_millis(60),
        "quiet p90 {fair_quiet:?} vs alone max {alone_max:?} (noisy median {fair_noisy:?})"
    );
    assert!(
        fair_noisy >= fair_quiet * 3,
        "the pool was saturated: noisy median {fair_noisy:?}, quiet p90 {fair_quiet:?}"
    );
    // Everything was answered: the noisy tenant got the capacity the quiet one left.
    assert_eq!(
        quiet.len() + noisy.len() + alone.len(),
        e.requests() as usize
    );

    // The same load in one shared flow (first come, first served, as before flow control):
    // the quiet tenant queues behind the noisy one's backlog.
    let (quiet, _) = two_tenants(&front, 1, true).await;
    let fcfs_quiet = p90(quiet);
    eprintln!(
        "alone max {alone_max:?}; fair: quiet p90 {fair_quiet:?}, noisy median {fair_noisy:?}; shared flow: quiet p90 {fcfs_quiet:?}"
    );
    assert!(
        fcfs_quiet >= fair_quiet * 3,
        "shared flow: quiet p90 {fcfs_quiet:?}, with fair shares {fair_quiet:?}"
    );
    let text = front.router.metrics().encode();
    assert!(
        text.contains("strata_router_flow_dispatched_total{reason=\"queued\"}"),
        "{text}"
    );
    assert!(
        text.contains("strata_router_flow_queue_duration_seconds_count"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_answer_429_and_debug_flows_shows_the_queue() {
    // One slot, a slow engine, one request may wait.
    let e = engine(400, 0).await;
    let mut cfg = config(&e.url(), 1);
    cfg.flow_control.max_requests = Some(1);
    let front = std::sync::Arc::new(Front::start(cfg).await);
    front.ready().await;
    let f = front.clone();
    let first = tokio::spawn(async move { f.chat(Some("a")).await });
    let r = front.router.clone();
    wait_for("first in flight", || {
        let n = r.status()[0].in_flight;
        async move { n == 1 }
    })
    .await;
    let f = front.clone();
    let second = tokio::spawn(async move { f.chat(Some("b")).await });
    wait_for("second queued", || {
        let q = r.flows_json()["flows"]["requests"] == 1;
        async move { q }
    })
    .await;
    let flows = front.get("/debug/flows").await;
    assert_eq!(flows["flows"]["bands"][0]["priority"], 0, "{flows}");
    assert_eq!(
        flows["flows"]["bands"][0]["flows"][0]["flow"], "b",
        "{flows}"
    );
    assert_eq!(flows["room"], 0, "{flows}");
    // The queue is full: the third is refused with an OpenAI-shaped 429.
    let (status, v, _) = front.chat(Some("c")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("waiting"),
        "{v}"
    );
    // The first finishes; the second is dispatched on that completion.
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    assert_eq!(second.await.unwrap().0, StatusCode::OK);
    let text = front.router.metrics().encode();
    assert!(
        text.contains("strata_router_flow_refused_total{reason=\"capacity\"} 1"),
        "{text}"
    );
    assert_eq!(front.get("/debug/flows").await["flows"]["requests"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_an_empty_pool_is_answered_once_an_engine_starts() {
    // The engine's port, free for now.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}");
    let mut cfg = config(&url, 4);
    cfg.flow_control.default_ttl_ms = Some(10_000);
    cfg.flow_control.pool = "chat".into();
    let front = std::sync::Arc::new(Front::start(cfg).await);
    let f = front.clone();
    let held = tokio::spawn(async move { f.chat(Some("t")).await });
    let r = front.router.clone();
    wait_for("held", || {
        let n = r.held_requests();
        async move { n == 1 }
    })
    .await;
    let text = r.metrics().encode();
    assert!(
        text.contains("strata_router_flow_held_requests{pool=\"chat\"} 1"),
        "{text}"
    );
    // Under the name the controller reads (strata_api's one definition of it).
    let (samples, _) = strata_api::prometheus::samples(&text);
    assert!(samples.iter().any(
        |s| s.name == strata_api::model_server::router::FLOW_HELD_REQUESTS
            && s.label("pool") == Some("chat")
            && s.value == 1.0
    ));
    // The engine starts on that port: the held request is answered.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let e = MockEngine::serve(
        MockConfig {
            model: "m".into(),
            output_tokens: 2,
            ..Default::default()
        },
        listener,
    )
    .unwrap();
    let (status, v, took) = held.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(took < Duration::from_secs(10), "answered before its TTL");
    assert_eq!(e.requests(), 1);
    assert_eq!(r.held_requests(), 0);
    let text = r.metrics().encode();
    assert!(
        text.contains("strata_router_flow_held_requests{pool=\"chat\"} 0"),
        "{text}"
    );
}
