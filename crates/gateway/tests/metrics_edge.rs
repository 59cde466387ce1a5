//! `/metrics` shows per-tenant series (tokens, cost, cache outcomes) only with the metrics
//! key or on the metrics listener; the edge bounds of `server:` in gateway.yaml reach the
//! edge server.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use strata_gateway::RunningGateway;

async fn page(url: &str, key: Option<&str>) -> (u16, String) {
    let mut rb = client().get(url);
    if let Some(k) = key {
        rb = rb.bearer_auth(k);
    }
    let resp = rb.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// One cacheable request from tenant `team-a`, so every kind of tenant series exists.
async fn traffic(gw: &RunningGateway) {
    let k = key(gw, "team-a");
    let mut body = chat_body("m");
    body["temperature"] = serde_json::json!(0);
    let (s, _, _) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(&k),
        &body,
    )
    .await;
    assert_eq!(s, 200);
}

fn has_tenant_series(text: &str) -> bool {
    text.contains("tenant=\"team-a\"")
}

#[tokio::test]
async fn tenant_series_need_the_metrics_key() {
    let m = mock("m").await;
    let yaml = yaml_one(
        &m.url(),
        "m",
        "    price: {input_per_1m: 1, output_per_1m: 1}",
        "cache: {enabled: true}\nmetrics: {key: a-metrics-key-of-16+}",
    );
    let gw = gateway(&yaml).await;
    traffic(&gw).await;
    let url = format!("{}/metrics", gw.url());
    let (s, public) = page(&url, None).await;
    assert_eq!(s, 200);
    assert!(
        public.contains("strata_gateway_requests_total{model=\"m\",status=\"200\"} 1"),
        "{public}"
    );
    assert!(!has_tenant_series(&public), "{public}");
    assert!(!public.contains("strata_gateway_tokens_total"), "{public}");
    assert!(public.trim_end().ends_with("# EOF"));
    let (s, body) = page(&url, Some("wrong-key-wrong-key")).await;
    assert_eq!(s, 401, "{body}");
    assert_openai_error(&serde_json::from_str(&body).unwrap());
    let (s, full) = page(&url, Some("a-metrics-key-of-16+")).await;
    assert_eq!(s, 200);
    for series in [
        "strata_gateway_tokens_total{tenant=\"team-a\",model=\"m\",kind=\"output\"} 8",
        "strata_gateway_cost_usd_total{tenant=\"team-a\",model=\"m\"}",
        "strata_gateway_cache_outcomes_total{tenant=\"team-a\",outcome=\"miss\"} 1",
        "strata_gateway_requests_total{model=\"m\",status=\"200\"} 1",
    ] {
        assert!(full.contains(series), "{series}\n{full}");
    }
    assert_eq!(full.matches("# EOF").count(), 1, "one exposition: {full}");
    gw.shutdown().await;
}

#[tokio::test]
async fn without_a_key_or_listener_no_tenant_series_and_the_listener_shows_them() {
    let m = mock("m").await;
    // No metrics key and no listener: tenant series are never served.
    let yaml = yaml_one(
        &m.url(),
        "m",
        "",
        "cache: {enabled: true}\nmetrics: {key_env: STRATA_TEST_NO_SUCH_VAR_IS_SET}",
    );
    assert!(strata_gateway::Config::from_yaml(&yaml).is_ok());
    let err =
        strata_gateway::ConfigHandle::fixed(strata_gateway::Config::from_yaml(&yaml).unwrap())
            .err()
            .unwrap()
            .to_string();
    assert!(err.contains("STRATA_TEST_NO_SUCH_VAR_IS_SET"), "{err}");

    let listen = yaml_one(
        &m.url(),
        "m",
        "",
        "cache: {enabled: true}\nmetrics: {listen: \"127.0.0.1:0\"}",
    );
    let gw = gateway(&listen).await;
    traffic(&gw).await;
    let (_, main) = page(&format!("{}/metrics", gw.url()), Some(METRICS_KEY)).await;
    assert!(
        !has_tenant_series(&main),
        "the main port never shows them: {main}"
    );
    let side = gw.metrics_addr.expect("metrics listener bound");
    let (s, text) = page(&format!("http://{side}/metrics"), None).await;
    assert_eq!(s, 200);
    assert!(has_tenant_series(&text), "{text}");
    let (s, _) = page(&format!("http://{side}/v1/models"), None).await;
    assert_eq!(s, 404, "the listener serves /metrics alone");
    gw.shutdown().await;
    // The listener stops with the gateway.
    assert!(std::net::TcpStream::connect(side).is_err());
}

#[test]
fn bad_metrics_and_edge_config_is_refused() {
    for (extra, want) in [
        ("metrics: {key: short}", "at least 16"),
        (
            "metrics: {key: aaaaaaaaaaaaaaaaaaaa, key_env: X}",
            "not both",
        ),
        ("metrics: {listen: nowhere}", "metrics.listen"),
        ("server: {max_connections: 0}", "server.max_connections"),
        ("server: {header_timeout_ms: 0}", "server.header_timeout_ms"),
        ("server: {max_header_bytes: 10}", "max_header_bytes"),
        ("server: {idle_timeout_ms: 10}", "unknown field"),
    ] {
        let err = strata_gateway::Config::from_yaml(extra)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(want), "{extra}: {err}");
    }
}

#[tokio::test]
async fn edge_bounds_from_gateway_yaml_reach_the_server() {
    let m = mock("m").await;
    let yaml = yaml_one(
        &m.url(),
        "m",
        "",
        "server: {max_header_bytes: 2048, header_timeout_ms: 300, max_connections: 64}",
    );
    let gw = gateway(&yaml).await;
    // A head larger than max_header_bytes: 431 in OpenAI's shape.
    let big = "x".repeat(4096);
    let resp = client()
        .get(format!("{}/health", gw.url()))
        .header("x-big", &big)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 431);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_openai_error(&body);
    // A connection that sends nothing is closed after header_timeout_ms (not minutes).
    let addr = gw.addr;
    let closed_after = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let started = Instant::now();
        let mut buf = [0u8; 512];
        let _ = s.write_all(b"GET /health HTTP/1.1\r\n");
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
        started.elapsed()
    })
    .await
    .unwrap();
    assert!(
        closed_after < Duration::from_secs(3),
        "closed after {closed_after:?}"
    );
    // A normal request is served.
    let (s, _) = page(&format!("{}/health", gw.url()), None).await;
    assert_eq!(s, 200);
    gw.shutdown().await;
}
