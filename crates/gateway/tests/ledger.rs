//! The usage ledger is written off the request path, in batches; shutting down loses no
//! row.

mod common;

use std::sync::Arc;

use common::*;
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::store::{Store, UsageFilter};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_flushes_every_queued_ledger_row() {
    let m = mock("m").await;
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let gw = gateway_with(
        &yaml_one(
            &m.url(),
            "m",
            "    price: {input_per_1m: 1000000, output_per_1m: 0}",
            "",
        ),
        Some(store.clone()),
    )
    .await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (url, k) = (url.clone(), k.clone());
        tasks.spawn(async move {
            for _ in 0..25 {
                assert_eq!(post(&url, Some(&k), &chat_body("m")).await.0, 200);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    // No admin read (which would flush first): straight to shutdown.
    let gateway = gw.gateway.clone();
    gw.shutdown().await;
    gateway.close();
    let rows = store.usage(&UsageFilter::default()).unwrap();
    let requests: u64 = rows.iter().map(|r| r.requests).sum();
    assert_eq!(requests, 200, "{rows:?}");
    let cost: i64 = rows.iter().map(|r| r.cost_micros).sum();
    assert!(cost > 0);
    // Spend reached the key's stored row too.
    let keys = store.list_keys().unwrap();
    assert_eq!(keys[0].spend_micros, cost);
}
