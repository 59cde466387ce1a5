//! The request path's settle stage runs exactly once per admitted request, also when the
//! client goes away before the answer (the request future is dropped mid-try).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::store::{Store, UsageFilter};
use strata_mock::{MockConfig, MockEngine};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_mid_try_keeps_the_ledger_row_exactly_once() {
    // An upstream slow enough that the client gives up while the gateway waits on it.
    let slow = MockEngine::spawn(MockConfig {
        model: "m".into(),
        output_tokens: 4,
        ttft: Duration::from_millis(1500),
        ..Default::default()
    })
    .await
    .unwrap();
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let gw = gateway_with(
        &yaml_one(
            &slow.url(),
            "m",
            "    retries: 0",
            "limits: {default_key: {tpm: 100000}}",
        ),
        Some(store.clone()),
    )
    .await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let quick = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let res = quick
        .post(&url)
        .bearer_auth(&k)
        .json(&chat_body("m"))
        .send()
        .await;
    assert!(res.is_err(), "the client should have timed out: {res:?}");

    // The row arrives once the gateway notices the closed connection (well before the
    // upstream would have answered and the gateway would have settled normally).
    let deadline = Instant::now() + Duration::from_secs(1);
    let requests = loop {
        gw.gateway.flush_usage();
        let rows = store.usage(&UsageFilter::default()).unwrap();
        let n: u64 = rows.iter().map(|r| r.requests).sum();
        if n > 0 || Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(requests, 1, "the abandoned request left no ledger row");

    // Wait for the slow upstream's answer to be abandoned entirely, then make sure no
    // second row appears for the same request (exactly once).
    tokio::time::sleep(Duration::from_millis(1600)).await;
    gw.gateway.flush_usage();
    let rows = store.usage(&UsageFilter::default()).unwrap();
    let n: u64 = rows.iter().map(|r| r.requests).sum();
    assert_eq!(n, 1, "settled twice: {rows:?}");
    assert_eq!(rows[0].input_tokens + rows[0].output_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refund_after_client_gone_is_visible_in_the_token_limit() {
    let slow = MockEngine::spawn(MockConfig {
        model: "m".into(),
        output_tokens: 4,
        ttft: Duration::from_millis(1500),
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = gateway(&yaml_one(
        &slow.url(),
        "m",
        "    retries: 0",
        "limits: {default_key: {tpm: 1000}}",
    ))
    .await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let quick = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    // Each request is estimated at 3 prompt + 8 output tokens.
    for _ in 0..3 {
        let _ = quick
            .post(&url)
            .bearer_auth(&k)
            .json(&chat_body("m"))
            .send()
            .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The limiter's state, read from the headers of a request that is answered.
    let remaining = {
        let resp = client()
            .post(&url)
            .bearer_auth(&k)
            .json(&chat_body("m"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .unwrap();
        resp.headers()["x-ratelimit-remaining-tokens"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    // Only this request's own estimate (11) is charged before it settles; without the
    // refunds the three abandoned requests would still hold 33 more (less the ~16 tokens
    // the bucket refills in the second this takes).
    assert!(remaining >= 1000 - 11 - 1, "remaining {remaining}");
}
