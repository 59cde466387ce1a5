//! A subscriber rebuilds the engine's prefix cache from its ZMQ KV events alone, through a
//! mixed workload that evicts, and ends with exactly the engine's own block map.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;
use strata_engine::kv::hashing::BlockHash;
use strata_engine::kv_events::{decode_batch, KvEvent};
use strata_engine::server::{self, EngineOptions};
use zeromq::{Socket, SocketRecv, SubSocket};

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn apply(mirror: &mut HashSet<u64>, events: Vec<KvEvent>, seen: &mut Vec<&'static str>) {
    for ev in events {
        seen.push(ev.type_name());
        match ev {
            KvEvent::BlockStored { block_hashes, .. } => mirror.extend(block_hashes),
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    assert!(mirror.remove(&h), "removal of a block never stored: {h}");
                }
            }
            KvEvent::AllBlocksCleared => mirror.clear(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_built_from_events_matches_the_engine_block_map() {
    let port = free_port();
    let opts = EngineOptions {
        model_path: common::model_path(),
        model_name: "smollm2-135m-instruct".into(),
        // Room for about two requests at a time: later prompts evict earlier prefixes.
        num_blocks: Some(24),
        kv_events_endpoint: Some(format!("tcp://127.0.0.1:{port}")),
        kv_events_topic: Some("kv@test@smollm2".into()),
        ..EngineOptions::default()
    };
    let loaded = tokio::task::spawn_blocking(move || server::load(&opts).expect("load"))
        .await
        .expect("join");
    let state = loaded.state.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind http");
    let addr = listener.local_addr().expect("addr");
    let app = server::router(state.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let mut sub = SubSocket::new();
    sub.subscribe("kv@").await.expect("subscribe");
    sub.connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .expect("connect");
    let client = reqwest_like::Client::new(addr);
    // The subscription reaches the publisher asynchronously: reset the (empty) cache, which
    // publishes AllBlocksCleared, until the subscriber sees one.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        assert_eq!(client.post("/reset_prefix_cache", "").await.0, 200);
        if let Ok(Ok(msg)) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            let frames = msg.into_vec();
            assert_eq!(frames[0].as_ref(), b"kv@test@smollm2");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "subscriber never connected"
        );
    }

    // Collect events in the background while the workload runs.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut last_seq = None;
        while let Ok(msg) = sub.recv().await {
            let frames = msg.into_vec();
            let seq = u64::from_be_bytes(frames[1].as_ref().try_into().expect("8-byte seq"));
            if let Some(prev) = last_seq {
                assert_eq!(seq, prev + 1, "sequence numbers are consecutive");
            }
            last_seq = Some(seq);
            let batch = decode_batch(frames[2].as_ref()).expect("payload decodes");
            if tx.send(batch.events).is_err() {
                return;
            }
        }
    });

    // Mixed workload: shared prefixes (hits), distinct long prompts (evictions), a stream.
    let shared = "Background: the quick brown fox jumps over the lazy dog. ".repeat(8);
    for i in 0..10 {
        let prompt = if i % 3 == 0 {
            format!("{shared} Question {i}: what did the fox do?")
        } else {
            format!(
                "{} Unique text {i}.",
                format!("Topic {i} is different. ").repeat(12)
            )
        };
        let body = json!({"prompt": prompt, "max_tokens": 8 + i, "temperature": 0});
        let (status, text) = client.post("/v1/completions", &body.to_string()).await;
        assert_eq!(status, 200, "{text}");
    }

    // Events of the last step are flushed right after it; give the publisher a moment.
    let mut mirror = HashSet::new();
    let mut seen = Vec::new();
    let quiet = Duration::from_millis(500);
    while let Ok(Some(events)) = tokio::time::timeout(quiet, rx.recv()).await {
        apply(&mut mirror, events, &mut seen);
    }
    let engine: HashSet<u64> = state
        .engine
        .cached_block_hashes()
        .await
        .iter()
        .map(|h| BlockHash(*h).to_u64())
        .collect();
    assert!(seen.contains(&"BlockStored"), "{seen:?}");
    assert!(
        seen.contains(&"BlockRemoved"),
        "the workload was meant to evict: {seen:?}"
    );
    assert!(!engine.is_empty());
    assert_eq!(mirror, engine, "mirror differs from the engine's block map");
}

/// A tiny HTTP/1.1 client over tokio (Connection: close), enough for these calls.
mod reqwest_like {
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    pub struct Client(SocketAddr);

    impl Client {
        pub fn new(addr: SocketAddr) -> Self {
            Self(addr)
        }

        pub async fn post(&self, path: &str, body: &str) -> (u16, String) {
            let mut s = tokio::net::TcpStream::connect(self.0)
                .await
                .expect("connect");
            let req = format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            s.write_all(req.as_bytes()).await.expect("write");
            let mut out = String::new();
            s.read_to_string(&mut out).await.expect("read");
            let status = out
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .expect("status");
            (status, out)
        }
    }
}
