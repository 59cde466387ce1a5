//! Behaviour with a real `redis-server` (Debian package `redis-server`): shared limits and
//! cache across two gateway replicas, and the configured failure mode when Redis dies.
//! These tests FAIL (never skip) when `redis-server` is not installed.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use strata_gateway::store::sqlite::SqliteStore;

struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    async fn start() -> Redis {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `redis-server` ({e}); install the Debian package `redis-server`"
                )
            });
        let r = Redis { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                use std::io::{Read, Write};
                s.set_read_timeout(Some(Duration::from_millis(500)))
                    .unwrap();
                if s.write_all(b"PING\r\n").is_ok() {
                    let mut buf = [0u8; 7];
                    if s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n" {
                        return r;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not come up on port {port}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sends `total` requests with `concurrency` workers alternating between the two URLs;
/// returns (admitted, refused with 429, other).
async fn hammer(
    urls: [String; 2],
    key: &str,
    total: usize,
    concurrency: usize,
) -> (usize, usize, usize) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let next = next.clone();
        let urls = urls.clone();
        let key = key.to_string();
        tasks.push(tokio::spawn(async move {
            let c = client();
            let (mut ok, mut limited, mut other) = (0, 0, 0);
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= total {
                    break;
                }
                let resp = c
                    .post(format!("{}/v1/chat/completions", urls[i % 2]))
                    .bearer_auth(&key)
                    .json(&chat_body("m"))
                    .send()
                    .await
                    .unwrap();
                match resp.status().as_u16() {
                    200 => ok += 1,
                    429 => limited += 1,
                    _ => other += 1,
                }
                let _ = resp.bytes().await;
            }
            (ok, limited, other)
        }));
    }
    let mut sum = (0, 0, 0);
    for t in tasks {
        let (a, b, c) = t.await.unwrap();
        sum = (sum.0 + a, sum.1 + b, sum.2 + c);
    }
    sum
}

async fn two_gateways(yaml: &str) -> (RunningGateway2, String) {
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let a = gateway_with(yaml, Some(store.clone())).await;
    let b = gateway_with(yaml, Some(store)).await;
    let k = key(&a, "t");
    b.gateway.refresh_from_store().unwrap();
    ((a, b), k)
}

type RunningGateway2 = (
    strata_gateway::RunningGateway,
    strata_gateway::RunningGateway,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_sharing_redis_admit_at_most_the_limit() {
    const LIMIT: usize = 100;
    let redis = Redis::start().await;
    let m = mock("m").await;
    let extra = format!(
        "limits: {{backend: redis, redis_url: \"{}\", on_backend_error: closed, redis_timeout_ms: 2000, default_key: {{rpm: {LIMIT}}}}}",
        redis.url()
    );
    let ((a, b), k) = two_gateways(&yaml_one(&m.url(), "m", "", &extra)).await;
    let started = Instant::now();
    let (ok, limited, other) = hammer([a.url(), b.url()], &k, 3 * LIMIT, 16).await;
    let elapsed = started.elapsed().as_secs_f64();
    // GCRA refills at LIMIT per minute, so allow what refilled during the run.
    let bound = (LIMIT as f64 * 1.02 + elapsed * LIMIT as f64 / 60.0).floor() as usize;
    assert_eq!(other, 0);
    assert_eq!(ok + limited, 3 * LIMIT);
    assert!(ok >= LIMIT, "the whole burst is admitted: {ok}");
    assert!(ok <= bound, "admitted {ok} > {bound} over {elapsed:.2}s");
    assert_eq!(m.requests() as usize, ok);
    a.shutdown().await;
    b.shutdown().await;

    // The same setup with per-process memory limits admits about twice the limit: the
    // shared bound above is what Redis buys.
    let m2 = mock("m").await;
    let extra = format!("limits: {{default_key: {{rpm: {LIMIT}}}}}");
    let ((a, b), k) = two_gateways(&yaml_one(&m2.url(), "m", "", &extra)).await;
    let (ok, _, _) = hammer([a.url(), b.url()], &k, 3 * LIMIT, 16).await;
    assert!(ok >= 2 * LIMIT - 2, "memory limits are per replica: {ok}");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn redis_going_away_follows_the_failure_mode() {
    let mut redis = Redis::start().await;
    let m = mock("m").await;
    let yaml = |mode: &str| {
        yaml_one(
            &m.url(),
            "m",
            "",
            &format!(
                "limits: {{backend: redis, redis_url: \"{}\", on_backend_error: {mode}, redis_timeout_ms: 300, default_key: {{rpm: 1000}}}}",
                redis.url()
            ),
        )
    };
    let open = gateway(&yaml("open")).await;
    let closed = gateway(&yaml("closed")).await;
    let ko = key(&open, "t");
    let kc = key(&closed, "t");
    let url_open = format!("{}/v1/chat/completions", open.url());
    let url_closed = format!("{}/v1/chat/completions", closed.url());
    assert_eq!(post(&url_open, Some(&ko), &chat_body("m")).await.0, 200);
    assert_eq!(post(&url_closed, Some(&kc), &chat_body("m")).await.0, 200);
    redis.stop();
    let before = m.requests();
    for _ in 0..3 {
        let (s, _, body) = post(&url_open, Some(&ko), &chat_body("m")).await;
        assert_eq!(s, 200, "fail open admits: {body}");
        let (s, _, body) = post(&url_closed, Some(&kc), &chat_body("m")).await;
        assert_eq!(s, 503, "fail closed refuses: {body}");
        assert_eq!(
            assert_openai_error(&body)["type"],
            "service_unavailable_error"
        );
    }
    assert_eq!(
        m.requests() - before,
        3,
        "only the fail-open requests reached the model"
    );
    let text = metrics_text(&open).await;
    assert!(
        text.contains("strata_gateway_backend_errors_total{backend=\"ratelimit\"}"),
        "{text}"
    );
    open.shutdown().await;
    closed.shutdown().await;
}

#[tokio::test]
async fn redis_cache_is_shared_by_replicas_but_never_across_tenants() {
    let mut redis = Redis::start().await;
    let m = mock("m").await;
    let extra = format!(
        "cache: {{enabled: true, backend: redis, redis_url: \"{}\", ttl_secs: 60}}",
        redis.url()
    );
    let ((a, b), ka) = two_gateways(&yaml_one(&m.url(), "m", "", &extra)).await;
    let kb = key(&a, "other");
    b.gateway.refresh_from_store().unwrap();
    let mut body = chat_body("m");
    body["seed"] = json!(1);
    let (s, h, first) = post(
        &format!("{}/v1/chat/completions", a.url()),
        Some(&ka),
        &body,
    )
    .await;
    assert_eq!((s, h["x-strata-cache"].to_str().unwrap()), (200, "miss"));
    let (s, h, hit) = post(
        &format!("{}/v1/chat/completions", b.url()),
        Some(&ka),
        &body,
    )
    .await;
    assert_eq!((s, h["x-strata-cache"].to_str().unwrap()), (200, "hit"));
    assert_eq!(hit["id"], first["id"]);
    let (s, h, theirs) = post(
        &format!("{}/v1/chat/completions", b.url()),
        Some(&kb),
        &body,
    )
    .await;
    assert_eq!((s, h["x-strata-cache"].to_str().unwrap()), (200, "miss"));
    assert_ne!(theirs["id"], first["id"]);
    assert_eq!(m.requests(), 2);
    // Redis gone: the cached question is a miss answered by the model, and both the failed
    // lookup and the failed store are counted.
    redis.stop();
    let (s, h, _) = post(
        &format!("{}/v1/chat/completions", b.url()),
        Some(&ka),
        &body,
    )
    .await;
    assert_eq!((s, h["x-strata-cache"].to_str().unwrap()), (200, "miss"));
    assert_eq!(m.requests(), 3);
    let text = metrics_text(&b).await;
    assert!(
        text.contains("strata_gateway_backend_errors_total{backend=\"cache\"} 2"),
        "{text}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// `x-strata-cache` of one chat request.
async fn cache_outcome(url: &str, key: &str, text: &str) -> String {
    let body = json!({"model": "m", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": text}]});
    let (status, headers, _) = post(&format!("{url}/v1/chat/completions"), Some(key), &body).await;
    assert_eq!(status, 200);
    headers
        .get("x-strata-cache")
        .map_or(String::new(), |v| v.to_str().unwrap().to_string())
}

/// Waits (bounded) until a gateway's semantic index holds `n` entries.
async fn index_reaches(gw: &strata_gateway::RunningGateway, n: usize) {
    let index = gw.gateway.semantic.as_ref().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while index.len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(index.len(), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semantic_entries_are_shared_by_replicas_but_never_across_tenants() {
    const FRANCE: &str = "What is the capital city of France?";
    const FRANCE_AGAIN: &str = "Tell me the capital of France.";
    const GERMANY: &str = "What is the capital of Germany?";
    let mut redis = Redis::start().await;
    let embed = fixture_embeddings().await;
    let m = mock("m").await;
    let yaml = format!(
        r#"
upstreams:
  - {{name: up, base_url: "{}"}}
  - {{name: local-embed, base_url: "{embed}"}}
models:
  - name: m
    targets: [{{upstream: up}}]
  - name: minilm
    targets: [{{upstream: local-embed, model: all-minilm-l6-v2}}]
limits: {{redis_timeout_ms: 300}}
cache:
  semantic: {{enabled: true, embedding_model: minilm, redis_url: "{}"}}
"#,
        m.url(),
        redis.url()
    );
    let ((a, b), t) = two_gateways(&yaml).await;
    let other = key(&a, "other");
    b.gateway.refresh_from_store().unwrap();

    assert_eq!(cache_outcome(&a.url(), &t, FRANCE).await, "miss");
    // B learns A's entry from the shared stream, and answers a paraphrase with it.
    index_reaches(&b, 1).await;
    assert_eq!(cache_outcome(&b.url(), &t, FRANCE_AGAIN).await, "semantic");
    assert_eq!(m.requests(), 1);
    // Never across tenants: another tenant's same question goes to the model.
    assert_eq!(cache_outcome(&b.url(), &other, FRANCE).await, "miss");
    assert_eq!(m.requests(), 2);
    // B's entry travels to A too, in that tenant's scope only.
    index_reaches(&a, 2).await;
    assert_eq!(
        cache_outcome(&a.url(), &other, FRANCE_AGAIN).await,
        "semantic"
    );
    assert_eq!(m.requests(), 2);
    // A replica that starts later reads the stream from the beginning: warm at once.
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let c = gateway_with(&yaml, Some(store)).await;
    index_reaches(&c, 2).await;

    // Redis gone: each replica keeps its own index and keeps answering.
    redis.stop();
    assert_eq!(cache_outcome(&a.url(), &t, GERMANY).await, "miss");
    assert_eq!(cache_outcome(&a.url(), &t, FRANCE_AGAIN).await, "semantic");
    let text = metrics_text(&a).await;
    assert!(
        text.contains("strata_gateway_backend_errors_total{backend=\"semantic_cache\"}"),
        "{text}"
    );
    a.shutdown().await;
    b.shutdown().await;
    c.shutdown().await;
}
