//! `kind: router` upstreams: an in-process router over engine replicas picks the replica
//! of each try; the gateway forwards there and reports how it went.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use strata_gateway::{Config, RunningGateway};
use strata_mock::{Fault, MockConfig, MockEngine};

/// Fast readiness and scraping so replicas join (and leave) within a few tens of ms.
const FAST: &str = "{scrape_interval_ms: 10, health_interval_ms: 20, stale_after_ms: 2000, circuit: {failures: 2, open_ms: 60000}}";

fn router_yaml(endpoints: &[String]) -> String {
    let list = endpoints
        .iter()
        .map(|e| format!("\"{e}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"
upstreams:
  - name: pool
    kind: router
    endpoints: [{list}]
    router: {FAST}
models:
  - name: m
    targets: [{{upstream: pool}}]
    retries: 0
    price: {{input_per_1m: 0, output_per_1m: 1000000}}
"#
    )
}

async fn slow_mock(tokens: usize, itl_ms: u64) -> MockEngine {
    MockEngine::spawn(MockConfig {
        model: "m".into(),
        output_tokens: tokens,
        itl: Duration::from_millis(itl_ms),
        ..Default::default()
    })
    .await
    .unwrap()
}

fn router_of(gw: &RunningGateway) -> strata_router::Router {
    let resolved = gw.gateway.config.get();
    resolved.upstreams["pool"]
        .router
        .as_ref()
        .expect("pool is a router upstream")
        .router
        .clone()
}

/// Polls the embedded router until `pred` holds for its endpoint states (10 s at most).
async fn wait_for(
    gw: &RunningGateway,
    what: &str,
    pred: impl Fn(&[strata_router::router::EndpointStatus]) -> bool,
) {
    for _ in 0..1000 {
        if pred(&router_of(gw).status()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}: {:?}", router_of(gw).status());
}

async fn all_ready(gw: &RunningGateway, n: usize) {
    wait_for(gw, "replicas ready", |s| {
        s.len() == n && s.iter().all(|e| e.ready)
    })
    .await;
}

fn varied_body(i: usize) -> serde_json::Value {
    json!({"model": "m", "messages": [{"role": "user", "content": format!("question number {i}: {}", "x".repeat(i % 7))}], "max_tokens": 4})
}

#[tokio::test]
async fn requests_spread_over_replicas_and_survive_one_dying() {
    let a = mock("m").await;
    let b = mock("m").await;
    let gw = gateway(&router_yaml(&[a.url(), b.url()])).await;
    all_ready(&gw, 2).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    for i in 0..40 {
        let (status, headers, body) = post(&url, Some(&k), &varied_body(i)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(headers["x-strata-upstream"], "pool");
        assert!(headers.contains_key(strata_router::proxy::SERVED_BY));
    }
    let (na, nb) = (a.requests(), b.requests());
    assert_eq!(na + nb, 40);
    assert!(na > 0 && nb > 0, "both replicas get traffic: a={na} b={nb}");

    // One replica dies: every request still succeeds, served by the other.
    a.shutdown().await;
    let before = b.requests();
    for i in 0..20 {
        let (status, _, body) = post(&url, Some(&k), &varied_body(100 + i)).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(b.requests() - before, 20);
    // Nothing is left counted in flight.
    wait_for(&gw, "in-flight back to zero", |s| {
        s.iter().all(|e| e.in_flight == 0)
    })
    .await;
    gw.shutdown().await;
}

#[tokio::test]
async fn a_replica_that_is_not_ready_gets_nothing() {
    let a = mock("m").await;
    let b = mock("m").await;
    let gw = gateway(&router_yaml(&[a.url(), b.url()])).await;
    all_ready(&gw, 2).await;
    b.set_fault(Fault::NotReady);
    let b_url = b.url();
    wait_for(&gw, "b not ready", |s| {
        s.iter().any(|e| e.spec.url == b_url && !e.ready)
    })
    .await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let b_before = b.requests();
    for i in 0..20 {
        assert_eq!(post(&url, Some(&k), &varied_body(i)).await.0, 200);
    }
    assert_eq!(b.requests(), b_before, "a replica not ready gets nothing");
    assert_eq!(a.requests(), 20);

    // Nothing ready at all: an OpenAI-shaped 503, not a hang.
    a.set_fault(Fault::NotReady);
    wait_for(&gw, "none ready", |s| s.iter().all(|e| !e.ready)).await;
    let (status, _, body) = post(&url, Some(&k), &varied_body(0)).await;
    assert_eq!(status, 503, "{body}");
    assert_openai_error(&body);
    gw.shutdown().await;
}

#[tokio::test]
async fn streams_pass_through_and_a_client_leaving_releases_the_replica() {
    let a = slow_mock(8, 0).await;
    let gw = gateway(&router_yaml(&[a.url()])).await;
    all_ready(&gw, 1).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let mut body = varied_body(1);
    body["stream"] = json!(true);
    body["max_tokens"] = json!(8);
    let resp = client()
        .post(&url)
        .bearer_auth(&k)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(text.matches("data: ").count() >= 9, "{text}");
    // Usage from the stream's usage chunk reaches the ledger.
    let mut cost = serde_json::Value::Null;
    for _ in 0..200 {
        cost = admin_get(&gw, "/admin/usage").await.1["total_cost_micros"].clone();
        if cost == 8_000_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(cost, 8_000_000);
    wait_for(&gw, "stream released", |s| s[0].in_flight == 0).await;

    // A long stream that the client abandons after the first chunk.
    let slow = slow_mock(500, 20).await;
    let gw2 = gateway(&router_yaml(&[slow.url()])).await;
    all_ready(&gw2, 1).await;
    let k2 = key(&gw2, "t");
    body["max_tokens"] = json!(500);
    let mut resp = client()
        .post(format!("{}/v1/chat/completions", gw2.url()))
        .bearer_auth(&k2)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.chunk().await.unwrap().is_some());
    wait_for(&gw2, "stream in flight", |s| s[0].in_flight == 1).await;
    drop(resp);
    wait_for(&gw2, "abandoned stream released", |s| s[0].in_flight == 0).await;
    // The replica is not blamed for the client leaving.
    let st = router_of(&gw2).status();
    assert!(st[0].ready, "{st:?}");
    gw.shutdown().await;
    gw2.shutdown().await;
}

#[tokio::test]
async fn a_replica_cut_mid_stream_is_reported_and_the_next_request_avoids_it() {
    let a = mock("m").await;
    let b = mock("m").await;
    let gw = gateway(&router_yaml(&[a.url(), b.url()])).await;
    all_ready(&gw, 2).await;
    a.set_fault(Fault::CloseMidStream { after_chunks: 2 });
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    // Stream until replica a has failed twice (its circuit opens at 2 failures).
    let a_url = a.url();
    for i in 0..40 {
        let mut body = varied_body(i);
        body["stream"] = json!(true);
        let resp = client()
            .post(&url)
            .bearer_auth(&k)
            .json(&body)
            .send()
            .await
            .unwrap();
        let _ = resp.text().await;
        let open = router_of(&gw)
            .status()
            .iter()
            .any(|e| e.spec.url == a_url && !e.ready);
        if open {
            break;
        }
    }
    wait_for(&gw, "a's circuit open", |s| {
        s.iter().any(|e| e.spec.url == a_url && !e.ready)
    })
    .await;
    let a_before = a.requests();
    for i in 0..10 {
        let (status, _, body) = post(&url, Some(&k), &varied_body(200 + i)).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(a.requests(), a_before, "an open circuit gets nothing");
    gw.shutdown().await;
}

#[tokio::test]
async fn bad_router_configs_are_refused_at_load() {
    for (yaml, needle) in [
        (
            router_yaml(&["http://127.0.0.1:notaport".into()]),
            "bad endpoint URL",
        ),
        (
            router_yaml(&["ftp://127.0.0.1:9".into()]),
            "bad endpoint URL",
        ),
        (
            router_yaml(&["https://127.0.0.1".into()]),
            "bad endpoint URL",
        ),
        (
            router_yaml(&["bogus=http://127.0.0.1:9".into()]),
            "unknown engine kind",
        ),
        (
            router_yaml(&["http://127.0.0.1:9".into(), "127.0.0.1:9".into()]),
            "listed twice",
        ),
        (router_yaml(&[]), "needs `endpoints`"),
        (
            router_yaml(&["http://127.0.0.1:9".into()])
                .replace("    router: {", "    base_url: http://x:1\n    router: {"),
            "not `base_url`",
        ),
        (
            router_yaml(&["http://127.0.0.1:9".into()])
                .replace("scrape_interval_ms", "scrape_intervl"),
            "upstream `pool`",
        ),
    ] {
        let err = Config::from_yaml(&yaml).expect_err(&yaml).to_string();
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }
    // An https endpoint (TLS to the engine, verified as the router's upstream_tls says) is
    // accepted, and so is a structured endpoint spec.
    Config::from_yaml(&router_yaml(&["https://127.0.0.1:9".into()])).unwrap();
    let ok = router_yaml(&[]).replace(
        "endpoints: []",
        "endpoints: [{url: '127.0.0.1:9', kind: sglang, labels: {zone: a}}]",
    );
    Config::from_yaml(&ok).unwrap();
}

#[tokio::test]
async fn reload_replaces_endpoints_without_dropping_streams_in_flight() {
    let a = slow_mock(40, 10).await;
    let b = mock("m").await;
    let gw = gateway(&router_yaml(&[a.url()])).await;
    all_ready(&gw, 1).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let mut body = varied_body(1);
    body["stream"] = json!(true);
    body["max_tokens"] = json!(40);
    let mut resp = client()
        .post(&url)
        .bearer_auth(&k)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut text = String::new();
    let first = resp.chunk().await.unwrap().unwrap();
    text.push_str(&String::from_utf8_lossy(&first));

    // Same router settings, new endpoint list: the live router is kept and synced.
    let before = router_of(&gw);
    gw.gateway
        .config
        .replace(Config::from_yaml(&router_yaml(&[b.url()])).unwrap())
        .unwrap();
    assert_eq!(router_of(&gw).endpoints(), vec![b.url()]);
    assert_eq!(before.endpoints(), vec![b.url()], "same router, synced");
    // Changed settings: a new router is built.
    gw.gateway
        .config
        .replace(
            Config::from_yaml(&router_yaml(&[b.url()]).replace("open_ms: 60000", "open_ms: 500"))
                .unwrap(),
        )
        .unwrap();
    assert_eq!(router_of(&gw).config().circuit.open_ms, 500);

    // The stream started before both reloads finishes intact.
    while let Some(c) = resp.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&c));
    }
    assert!(text.contains("data: [DONE]"), "{text}");

    all_ready(&gw, 1).await;
    let a_before = a.requests();
    for i in 0..5 {
        assert_eq!(post(&url, Some(&k), &varied_body(i)).await.0, 200);
    }
    assert_eq!(b.requests(), 5);
    assert_eq!(a.requests(), a_before);
    gw.shutdown().await;
}
