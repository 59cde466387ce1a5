//! KV events from a ZMQ publisher feed the precise prefix index, and a precise-prefix
//! profile then sends a request to the replica that holds its blocks.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use strata_api::kv_events::{encode_batch, seq_bytes, EventEncoding, KvEvent, KvEventBatch};
use strata_mock::{MockConfig, MockEngine};
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};
use strata_router::prefix::hashing::{BlockHasher, DEFAULT_HASH_SEED};
use strata_router::{EndpointPickerConfig, Router};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

fn message(seq: u64, events: Vec<KvEvent>) -> ZmqMessage {
    let payload = encode_batch(
        &KvEventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        },
        EventEncoding::Map,
    );
    let mut m = ZmqMessage::from(Bytes::from_static(b"kv@test@m"));
    m.push_back(Bytes::copy_from_slice(&seq_bytes(seq)));
    m.push_back(Bytes::from(payload));
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_steer_requests_to_the_replica_holding_the_prefix() {
    let a = MockEngine::spawn(MockConfig {
        model: "m".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let b = MockEngine::spawn(MockConfig {
        model: "m".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut publisher = PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();

    let mut spec_b = EndpointSpec::new(b.url(), EngineKind::Strata);
    spec_b.kv_events = Some(endpoint);
    let config = RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        endpoints: vec![EndpointSpec::new(a.url(), EngineKind::Strata), spec_b],
        // Precise prefix dominates; queue and KV are equal on idle mocks.
        scheduling: Some(EndpointPickerConfig::weighted(&[
            ("queue-scorer", 1.0),
            ("precise-prefix-cache-scorer", 10.0),
        ])),
        ..RouterConfig::default()
    };
    let router = Router::new(config).unwrap();
    assert!(router.uses_precise());

    // A prompt of 64 token ids = 4 blocks of 16; b announces it holds them all.
    let tokens: Vec<u32> = (1000..1064).collect();
    let hashes = BlockHasher::new(DEFAULT_HASH_SEED, 16).hash_tokens(&tokens, None, None);
    assert_eq!(hashes.len(), 4);
    let stored = KvEvent::BlockStored {
        block_hashes: hashes.clone(),
        parent_block_hash: None,
        token_ids: tokens.clone(),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
    };
    // The subscription reaches the publisher asynchronously: publish until it lands.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut seq = 0;
    loop {
        publisher
            .send(message(seq, vec![stored.clone()]))
            .await
            .unwrap();
        seq += 1;
        let v = router.debug_json();
        if v["precise_index_blocks"] == 4
            && v["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["ready"] == true)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "events never arrived: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = strata_router::proxy::app(router.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    for _ in 0..5 {
        let body = json!({"model": "m", "prompt": tokens, "max_tokens": 2}).to_string();
        let req = Request::post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let replica = resp.headers()["x-mock-replica"]
            .to_str()
            .unwrap()
            .to_string();
        let _ = resp.into_body().collect().await.unwrap();
        assert_eq!(replica, b.replica(), "the replica holding the blocks");
    }
    let text = router.metrics().encode();
    assert!(
        text.contains("strata_router_prefix_hit_ratio{index=\"precise\"} 1.0"),
        "{text}"
    );
    // A text prompt needs /tokenize, which the mock lacks: the request still goes through
    // (approximate fallback).
    let body = json!({"model": "m", "prompt": "some text", "max_tokens": 2}).to_string();
    let req = Request::post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    assert_eq!(client.request(req).await.unwrap().status(), StatusCode::OK);

    // Eviction: b drops the first block, so nobody holds the chain any more.
    publisher
        .send(message(
            seq,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![hashes[0]],
                medium: Some("GPU".into()),
            }],
        ))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while router.debug_json()["precise_index_blocks"] != 3 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A sequence gap resets b's mirror rather than trusting it.
    publisher.send(message(seq + 5, vec![])).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while router.debug_json()["precise_index_blocks"] != 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A stub engine: `/tokenize` answers fixed token ids, `/v1/completions` names the stub.
async fn stub_engine(name: &'static str, tokens: Vec<u32>) -> String {
    use axum::routing::{get, post};
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(|| async { "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.1\n" }),
        )
        .route(
            "/tokenize",
            post(move || {
                let tokens = tokens.clone();
                async move {
                    axum::Json(json!({"count": tokens.len(), "max_model_len": 2048, "tokens": tokens}))
                }
            }),
        )
        .route(
            "/v1/completions",
            post(move |headers: axum::http::HeaderMap| async move {
                let rid = headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string);
                axum::Json(json!({"served_by": name, "request_id": rid}))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_prompts_are_tokenized_by_an_engine_for_the_precise_index() {
    let tokens: Vec<u32> = (7..7 + 48).collect();
    let a = stub_engine("a", tokens.clone()).await;
    let b = stub_engine("b", tokens.clone()).await;
    let mut publisher = PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let mut spec_b = EndpointSpec::new(b, EngineKind::Vllm);
    spec_b.kv_events = Some(endpoint);
    let router = Router::new(RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        endpoints: vec![EndpointSpec::new(a, EngineKind::Vllm), spec_b],
        scheduling: Some(EndpointPickerConfig::weighted(&[(
            "precise-prefix-cache-scorer",
            1.0,
        )])),
        ..RouterConfig::default()
    })
    .unwrap();
    let hashes = BlockHasher::new(DEFAULT_HASH_SEED, 16).hash_tokens(&tokens, None, Some("salt"));
    let stored = KvEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: None,
        token_ids: tokens.clone(),
        block_size: 16,
        lora_id: None,
        medium: None,
        lora_name: None,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut seq = 0;
    loop {
        publisher
            .send(message(seq, vec![stored.clone()]))
            .await
            .unwrap();
        seq += 1;
        let v = router.debug_json();
        if v["precise_index_blocks"] == 3
            && v["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["ready"] == true)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "events never arrived: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = strata_router::proxy::app(router.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    for _ in 0..4 {
        // The salt is part of the first block's hash: the router must hash it too.
        let body = json!({"model": "m", "prompt": "any text", "cache_salt": "salt"}).to_string();
        let req = Request::post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .header("x-request-id", "rid-7")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let v: serde_json::Value =
            serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v["served_by"], "b");
        assert_eq!(v["request_id"], "rid-7", "x-request-id reaches the replica");
    }
    let text = router.metrics().encode();
    assert!(
        text.contains("strata_router_prefix_hit_ratio{index=\"precise\"} 1.0"),
        "{text}"
    );
}
