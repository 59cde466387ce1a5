//! Cascade routing end to end: the cheap model answers when its answer passes the checks,
//! the request escalates to the next model when it does not (both tries charged), and the
//! request classifier sends matching prompts straight to the last model.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::store::{Store, UsageFilter};
use strata_gateway::Config;
use strata_mock::{MockConfig, MockEngine};

async fn engine(model: &str) -> MockEngine {
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

fn yaml(small: &str, large: &str) -> String {
    format!(
        r#"
upstreams:
  - {{name: a, base_url: "{small}"}}
  - {{name: b, base_url: "{large}"}}
models:
  - name: small
    targets: [{{upstream: a}}]
    price: {{input_per_1m: 0, output_per_1m: 1000000}}
  - name: large
    targets: [{{upstream: b}}]
    price: {{input_per_1m: 0, output_per_1m: 10000000}}
  - name: auto
    cascade: {{models: [small, large], escalate_patterns: ["(?i)\\bprove\\b"]}}
"#
    )
}

fn ask(text: &str, max_tokens: u64) -> serde_json::Value {
    json!({"model": "auto", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascade_accepts_escalates_and_classifies_and_charges_every_try() {
    let small = engine("small").await;
    let large = engine("large").await;
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let gw = gateway_with(&yaml(&small.url(), &large.url()), Some(store.clone())).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());

    // The small model finishes on its own (8 tokens < 100): its answer stands.
    let (status, headers, body) = post(&url, Some(&k), &ask("what is 2+2?", 100)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-strata-cascade"], "small;accepted");
    assert_eq!((small.requests(), large.requests()), (1, 0));

    // Cut by max_tokens: escalated to the large model, which answers whatever it says.
    let (status, headers, body) = post(&url, Some(&k), &ask("write an essay", 4)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-strata-cascade"], "large;length");
    assert_eq!(headers["x-strata-model"], "large");
    assert_eq!((small.requests(), large.requests()), (2, 1));

    // The classifier sends a matching prompt straight to the large model.
    let (status, headers, _) = post(&url, Some(&k), &ask("Prove it, please", 100)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-strata-cascade"], "large;pattern");
    assert_eq!((small.requests(), large.requests()), (2, 2));

    // Streamed: classified on the request only.
    let mut streamed = ask("prove this", 100);
    streamed["stream"] = json!(true);
    let resp = client()
        .post(&url)
        .bearer_auth(&k)
        .json(&streamed)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-strata-cascade"], "large;pattern");
    assert!(resp.text().await.unwrap().contains("[DONE]"));

    // Both tries of the escalated request are charged, each at its model's price.
    gw.gateway.flush_usage();
    let rows = store.usage(&UsageFilter::default()).unwrap();
    let by_model = |m: &str| rows.iter().find(|r| r.model == m).cloned().unwrap();
    let (s, l) = (by_model("small"), by_model("large"));
    assert_eq!(s.requests, 2);
    assert_eq!(s.cost_micros, 8_000_000 + 4_000_000);
    assert_eq!(l.requests, 3);
    assert_eq!(l.cost_micros, 40_000_000 + 80_000_000 + 80_000_000);

    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains(r#"strata_gateway_cascade_total{model="large",reason="length"} 1"#),
        "{metrics}"
    );
    assert!(metrics
        .contains(r#"strata_gateway_cascade_escalations_total{from="small",reason="length"} 1"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascade_escalates_past_a_model_that_is_down() {
    let large = engine("large").await;
    // Nothing listens on this port.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let gw = gateway(&yaml(&dead, &large.url()).replace(
        "targets: [{upstream: a}]",
        "targets: [{upstream: a}]\n    retries: 0",
    ))
    .await;
    let k = key(&gw, "t");
    let (status, headers, body) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(&k),
        &ask("hello", 100),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-strata-cascade"], "large;failed");
}

#[test]
fn cascade_configs_are_checked_at_load() {
    let base = yaml("http://127.0.0.1:1", "http://127.0.0.1:2");
    assert!(Config::from_yaml(&base).is_ok());
    for (from, to) in [
        ("models: [small, large]", "models: [small, nope]"),
        ("models: [small, large]", "models: [small]"),
        ("models: [small, large]", "models: [small, auto]"),
        (r#"["(?i)\\bprove\\b"]"#, r#"["("]"#),
    ] {
        let bad = base.replace(from, to);
        assert_ne!(bad, base);
        assert!(Config::from_yaml(&bad).is_err(), "accepted: {to}");
    }
    let with_targets = base.replace(
        "  - name: auto\n",
        "  - name: auto\n    targets: [{upstream: a}]\n",
    );
    assert!(Config::from_yaml(&with_targets).is_err());
}
