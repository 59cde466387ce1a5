//! KV events from a ZMQ publisher feed the precise prefix index, and a precise-prefix
//! profile then sends a request to the replica that holds its blocks.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
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

/// Publishes each feed's event, one sequence number per round, until the router's precise
/// index holds `blocks` blocks and every endpoint is ready (the subscription reaches the
/// publisher asynchronously). Returns the next unused sequence number.
async fn publish_until_indexed(
    router: &Router,
    feeds: &mut [(&mut PubSocket, &KvEvent)],
    blocks: u64,
) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut seq = 0;
    loop {
        for (publisher, event) in feeds.iter_mut() {
            publisher
                .send(message(seq, vec![(*event).clone()]))
                .await
                .unwrap();
        }
        seq += 1;
        let v = router.debug_json();
        if v["precise_index_blocks"] == blocks
            && v["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["ready"] == true)
        {
            return seq;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "events never arrived: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Serves `router`'s proxy on loopback: its base URL and a client.
async fn serve(router: &Router) -> (String, Client<HttpConnector, Full<Bytes>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = strata_router::proxy::app(router.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (base, Client::builder(TokioExecutor::new()).build_http())
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
    let seq = publish_until_indexed(&router, &mut [(&mut publisher, &stored)], 4).await;

    let (base, client) = serve(&router).await;
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
    publish_until_indexed(&router, &mut [(&mut publisher, &stored)], 3).await;
    let (base, client) = serve(&router).await;
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

// ---------------------------------------------------------------------------------------
// Replay (PROTOCOLS §4): a fake publisher that keeps every message for replay, and can
// "lose" messages (kept for replay, never sent live) to make sequence gaps.
// ---------------------------------------------------------------------------------------

type Buffer = std::sync::Arc<std::sync::Mutex<Vec<(u64, Vec<u8>)>>>;

struct Feed {
    publisher: PubSocket,
    seq: u64,
    buffer: Buffer,
}

impl Feed {
    fn payload(events: Vec<KvEvent>) -> Vec<u8> {
        encode_batch(
            &KvEventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: Some(0),
            },
            EventEncoding::Map,
        )
    }

    /// Publishes live and keeps for replay.
    async fn publish(&mut self, events: Vec<KvEvent>) {
        let payload = Self::payload(events);
        self.buffer
            .lock()
            .unwrap()
            .push((self.seq, payload.clone()));
        let mut m = ZmqMessage::from(Bytes::from_static(b"kv@test@m"));
        m.push_back(Bytes::copy_from_slice(&seq_bytes(self.seq)));
        m.push_back(Bytes::from(payload));
        self.publisher.send(m).await.unwrap();
        self.seq += 1;
    }

    /// Keeps for replay only: the subscriber misses it live.
    fn lose(&mut self, events: Vec<KvEvent>) {
        let payload = Self::payload(events);
        self.buffer.lock().unwrap().push((self.seq, payload));
        self.seq += 1;
    }
}

/// A replay ROUTER socket over `buffer`, answering as the engine's publisher does; with
/// `answer = false` it takes requests and never replies.
async fn replay_server(buffer: Buffer, answer: bool) -> String {
    use zeromq::{RouterSocket, SocketRecv};
    let mut socket = RouterSocket::new();
    let addr = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    tokio::spawn(async move {
        while let Ok(request) = socket.recv().await {
            if !answer {
                continue;
            }
            let frames = request.into_vec();
            let identity = frames[0].clone();
            let delimited = frames.len() == 3;
            let start = strata_api::kv_events::parse_seq(frames.last().unwrap()).unwrap();
            let reply = |seq: [u8; 8], payload: Bytes| {
                let mut m = ZmqMessage::from(identity.clone());
                if delimited {
                    m.push_back(Bytes::new());
                }
                m.push_back(Bytes::copy_from_slice(&seq));
                m.push_back(payload);
                m
            };
            let batches: Vec<(u64, Vec<u8>)> = buffer
                .lock()
                .unwrap()
                .iter()
                .filter(|(s, _)| *s >= start)
                .cloned()
                .collect();
            for (s, p) in batches {
                let _ = socket.send(reply(seq_bytes(s), Bytes::from(p))).await;
            }
            let _ = socket
                .send(reply(
                    strata_api::kv_events::END_SEQ.to_be_bytes(),
                    Bytes::new(),
                ))
                .await;
        }
    });
    addr
}

fn stored(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: vec![],
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
    }
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Some("GPU".into()),
    }
}

/// A router with one endpoint whose events come from a fresh [`Feed`] and whose replay
/// socket answers (or not); returns once the subscription delivers.
async fn replay_setup(answer: bool, timeout_ms: u64) -> (Router, MockEngine, Feed) {
    let engine = MockEngine::spawn(MockConfig {
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
    let buffer = Buffer::default();
    let mut spec = EndpointSpec::new(engine.url(), EngineKind::Strata);
    spec.kv_events = Some(endpoint);
    spec.kv_events_replay = Some(replay_server(buffer.clone(), answer).await);
    let mut config = RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        endpoints: vec![spec],
        scheduling: Some(EndpointPickerConfig::weighted(&[(
            "precise-prefix-cache-scorer",
            1.0,
        )])),
        ..RouterConfig::default()
    };
    config.precise.replay_timeout_ms = timeout_ms;
    let router = Router::new(config).unwrap();
    let mut feed = Feed {
        publisher,
        seq: 0,
        buffer,
    };
    // The subscription lands asynchronously: publish a probe until it is seen.
    let url = engine.url();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !router.precise_holds(&url, 1) {
        feed.publish(vec![stored(&[1])]).await;
        assert!(tokio::time::Instant::now() < deadline, "no events arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (router, engine, feed)
}

/// Publishes a marker block and waits until it is applied: everything published
/// before it has been processed too.
async fn settle(router: &Router, url: &str, feed: &mut Feed, marker: u64) {
    feed.publish(vec![stored(&[marker])]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !router.precise_holds(url, marker) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "marker {marker} never applied: {}",
            router.debug_json()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn counter(router: &Router, name: &str) -> u64 {
    let text = router.metrics().encode();
    text.lines()
        .find(|l| l.starts_with(&format!("strata_router_{name}_total{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_filled_by_replay_gives_the_same_index_as_no_gap() {
    let (router, engine, mut feed) = replay_setup(true, 2000).await;
    let url = engine.url();
    feed.publish(vec![stored(&[10, 11, 12, 13])]).await;
    settle(&router, &url, &mut feed, 100).await;
    // Lost live: a store, and a removal of a block the mirror holds.
    feed.lose(vec![stored(&[20, 21])]);
    feed.lose(vec![removed(&[13])]);
    feed.publish(vec![stored(&[30])]).await;
    settle(&router, &url, &mut feed, 101).await;

    // The same events applied without a gap.
    let mut want = strata_router::prefix::precise::PreciseIndex::new();
    let id = strata_router::endpoint::EndpointId(0);
    for (_, payload) in feed.buffer.lock().unwrap().iter() {
        for ev in &strata_api::kv_events::decode_batch(payload).unwrap().events {
            want.apply(id, ev);
        }
    }
    for h in [1, 10, 11, 12, 13, 20, 21, 30, 100, 101] {
        assert_eq!(
            router.precise_holds(&url, h),
            want.holds(id, h),
            "block {h}"
        );
    }
    assert!(
        !router.precise_holds(&url, 13),
        "the lost removal was replayed"
    );
    assert!(
        router.precise_holds(&url, 20),
        "the lost store was replayed"
    );
    assert_eq!(router.debug_json()["precise_index_blocks"], want.len());
    assert!(counter(&router, "kv_replays") >= 1);
    assert_eq!(counter(&router, "kv_replay_failures"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_replay_cannot_fill_clears_the_endpoints_entries() {
    let (router, engine, mut feed) = replay_setup(true, 2000).await;
    let url = engine.url();
    feed.publish(vec![stored(&[10, 11, 12, 13])]).await;
    settle(&router, &url, &mut feed, 100).await;
    feed.lose(vec![removed(&[13])]);
    feed.lose(vec![stored(&[20])]);
    // The publisher's buffer no longer reaches back to the gap.
    let lost_from = feed.seq - 2;
    feed.buffer.lock().unwrap().retain(|(s, _)| *s > lost_from);
    feed.publish(vec![stored(&[30])]).await;
    settle(&router, &url, &mut feed, 101).await;
    for h in [1, 10, 11, 12, 13, 20, 100] {
        assert!(!router.precise_holds(&url, h), "block {h} was not dropped");
    }
    assert!(
        router.precise_holds(&url, 30),
        "rebuilt from the live stream"
    );
    assert_eq!(router.debug_json()["precise_index_blocks"], 2);
    assert_eq!(counter(&router, "kv_replay_failures"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_socket_that_never_answers_is_bounded_by_the_timeout() {
    let (router, engine, mut feed) = replay_setup(false, 200).await;
    let url = engine.url();
    feed.publish(vec![stored(&[10, 11])]).await;
    settle(&router, &url, &mut feed, 100).await;
    let failures = counter(&router, "kv_replay_failures");
    feed.lose(vec![removed(&[11])]);
    let started = tokio::time::Instant::now();
    feed.publish(vec![stored(&[30])]).await;
    // The live stream resumes after the timeout, with the mirror dropped.
    settle(&router, &url, &mut feed, 101).await;
    assert!(started.elapsed() < Duration::from_secs(8));
    assert!(!router.precise_holds(&url, 10) && !router.precise_holds(&url, 11));
    assert!(router.precise_holds(&url, 30));
    assert_eq!(counter(&router, "kv_replay_failures"), failures + 1);
}

// ---------------------------------------------------------------------------------------
// LoRA adapters in block hashes (PROTOCOLS §3).
// ---------------------------------------------------------------------------------------

#[test]
fn adapter_requests_hash_with_the_adapter_name_like_the_engine() {
    // The "lora name" case of the engine's fixture (vLLM reference values).
    let fixture: serde_json::Value = serde_json::from_str(include_str!(
        "../../engine/tests/fixtures/block_hashes.json"
    ))
    .unwrap();
    let case = fixture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "lora name")
        .unwrap();
    assert_eq!(case["seed"], DEFAULT_HASH_SEED);
    let tokens: Vec<u32> = serde_json::from_value(case["tokens"].clone()).unwrap();
    let want: Vec<u64> = case["hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["u64"].as_u64().unwrap())
        .collect();
    let mut spec = EndpointSpec::new("http://127.0.0.1:9", EngineKind::Vllm);
    spec.model = Some("base".into());
    spec.lora = vec!["sql-adapter".into()];
    let router = Router::new(RouterConfig {
        endpoints: vec![spec],
        ..RouterConfig::default()
    })
    .unwrap();
    let lora = router.lora_adapter("sql-adapter");
    assert_eq!(lora.as_deref(), Some("sql-adapter"));
    assert_eq!(
        router.lora_adapter("base"),
        None,
        "the base model is no adapter"
    );
    assert_eq!(
        router
            .precise_blocks(&tokens, lora.as_deref(), None)
            .chain(16),
        want
    );
    assert_ne!(router.precise_blocks(&tokens, None, None).chain(16), want);
    // The approximate index keys on the requested name too.
    let text = "a shared system prompt, long enough for a few chunks. ".repeat(6);
    let (adapter, base) = (
        router.approx_blocks("sql-adapter", &text),
        router.approx_blocks("base", &text),
    );
    assert_eq!(adapter.len(), 5);
    assert!(adapter.iter().all(|h| !base.contains(h)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_prefixes_match_the_adapters_blocks_never_the_base_models() {
    let tokens: Vec<u32> = (500..564).collect();
    let base_host = stub_engine("base-holder", tokens.clone()).await;
    let lora_host = stub_engine("adapter-holder", tokens.clone()).await;
    let hasher = BlockHasher::new(DEFAULT_HASH_SEED, 16);
    // Each engine publishes what it holds: the same tokens, cached for the base model on
    // one and for the adapter on the other.
    let mut specs = Vec::new();
    let mut feeds = Vec::new();
    for (url, lora) in [(&base_host, None), (&lora_host, Some("sql"))] {
        let mut publisher = PubSocket::new();
        let endpoint = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .unwrap()
            .to_string();
        let mut spec = EndpointSpec::new(url.clone(), EngineKind::Vllm);
        spec.model = Some("m".into());
        spec.lora = vec!["sql".into()];
        spec.kv_events = Some(endpoint);
        specs.push(spec);
        let event = KvEvent::BlockStored {
            block_hashes: hasher.hash_tokens(&tokens, lora, None),
            parent_block_hash: None,
            token_ids: tokens.clone(),
            block_size: 16,
            lora_id: lora.map(|_| 1),
            medium: Some("GPU".into()),
            lora_name: lora.map(str::to_string),
        };
        feeds.push((publisher, event));
    }
    let router = Router::new(RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        endpoints: specs,
        scheduling: Some(EndpointPickerConfig::weighted(&[(
            "precise-prefix-cache-scorer",
            1.0,
        )])),
        ..RouterConfig::default()
    })
    .unwrap();
    let mut refs: Vec<(&mut PubSocket, &KvEvent)> =
        feeds.iter_mut().map(|(p, e)| (p, &*e)).collect();
    publish_until_indexed(&router, &mut refs, 8).await;
    let (base, client) = serve(&router).await;
    for (model, want) in [("sql", "adapter-holder"), ("m", "base-holder")] {
        for _ in 0..4 {
            let body = json!({"model": model, "prompt": tokens, "max_tokens": 2}).to_string();
            let req = Request::post(format!("{base}/v1/completions"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .unwrap();
            let resp = client.request(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            let v: serde_json::Value =
                serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes())
                    .unwrap();
            assert_eq!(v["served_by"], want, "model {model}");
        }
    }
    let text = router.metrics().encode();
    assert!(
        text.contains("strata_router_prefix_hit_ratio{index=\"precise\"} 1.0"),
        "every request found its own blocks: {text}"
    );
}

/// Endpoints that name their blocks with different block sizes (vLLM on CPU needs a multiple
/// of 32; a Strata engine defaults to 16) behind one router: each request's prompt is hashed
/// with each candidate's own block size, so both endpoints' blocks are found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_of_different_block_sizes_are_each_matched_with_their_own() {
    let engine = |block_size| {
        MockEngine::spawn(MockConfig {
            model: "m".into(),
            block_size,
            ..Default::default()
        })
    };
    let (a, b) = (engine(16).await.unwrap(), engine(32).await.unwrap());
    let (mut pub_a, mut pub_b) = (PubSocket::new(), PubSocket::new());
    let ep_a = pub_a.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let ep_b = pub_b.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut spec_a = EndpointSpec::new(a.url(), EngineKind::Strata);
    spec_a.kv_events = Some(ep_a);
    let mut spec_b = EndpointSpec::new(b.url(), EngineKind::Vllm);
    spec_b.kv_events = Some(ep_b);
    let config = RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        endpoints: vec![spec_a, spec_b],
        scheduling: Some(EndpointPickerConfig::weighted(&[
            ("queue-scorer", 1.0),
            ("precise-prefix-cache-scorer", 10.0),
        ])),
        // The configured size is 16: right for a, wrong for b.
        ..RouterConfig::default()
    };
    let router = Router::new(config).unwrap();

    // a holds prompt p16 as 4 blocks of 16; b holds prompt p32 as 2 blocks of 32.
    let p16: Vec<u32> = (2000..2064).collect();
    let p32: Vec<u32> = (3000..3064).collect();
    let stored = |tokens: &[u32], block_size: usize| KvEvent::BlockStored {
        block_hashes: BlockHasher::new(DEFAULT_HASH_SEED, block_size)
            .hash_tokens(tokens, None, None),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
    };
    let (ev_a, ev_b) = (stored(&p16, 16), stored(&p32, 32));
    publish_until_indexed(&router, &mut [(&mut pub_a, &ev_a), (&mut pub_b, &ev_b)], 6).await;
    // Each endpoint hashes with its own size, learnt from its metrics and its events.
    let sizes: Vec<(String, u32)> = router
        .status()
        .into_iter()
        .map(|s| (s.spec.url, s.block_size))
        .collect();
    assert!(
        sizes.contains(&(a.url(), 16)) && sizes.contains(&(b.url(), 32)),
        "{sizes:?}"
    );
    let chains = router.precise_blocks(&p32, None, None);
    assert_eq!(chains.chain(32).len(), 2);
    assert_eq!(chains.chain(16).len(), 4);

    let (base, client) = serve(&router).await;
    for (prompt, want) in [(&p32, b.replica()), (&p16, a.replica())] {
        for _ in 0..4 {
            let body = json!({"model": "m", "prompt": prompt, "max_tokens": 2}).to_string();
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
            assert_eq!(replica, want, "the replica holding the prompt's blocks");
        }
    }
    let text = router.metrics().encode();
    assert!(
        text.contains("strata_router_prefix_hit_ratio{index=\"precise\"} 1.0"),
        "every block of every request was found: {text}"
    );
}
