//! Disaggregated serving end to end (PROTOCOLS §11, issue 21): real engines on loopback
//! ports, a prefill engine handing a prompt's KV blocks to a decode engine through
//! `kv_transfer_params` and through `x-prefiller-host-port`, the shared tier, peers that
//! stall or die mid-transfer, pins and their timeout, and what is refused. Every path must
//! give the same greedy tokens as colocated serving.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_engine::auth::AuthOptions;
use strata_engine::kv::hashing::BlockHash;
use strata_engine::kv::peers::KvPeers;
use strata_engine::kv::tier::{Tier, TierConfig, TierStore};
use strata_engine::kv::transfer::{self, BlockSource};
use strata_engine::kv_events::{decode_batch, KvEvent};
use strata_engine::server::{EngineOptions, KvRole};
use zeromq::{Socket, SocketRecv, SubSocket};

use common::kv_engine::{start, Engine, MODEL};

/// `--kv-peers` listing exactly `addrs`.
fn peers(addrs: &[SocketAddr]) -> KvPeers {
    let list: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    KvPeers::parse(&list).expect("peer list")
}

fn opts(role: KvRole) -> EngineOptions {
    EngineOptions {
        kv_role: role,
        num_blocks: Some(64),
        max_model_len: Some(512),
        ..EngineOptions::default()
    }
}

/// A POST with extra headers; the answer as JSON (a string when it is not JSON).
fn post(addr: SocketAddr, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(common::READ_TIMEOUT))
        .expect("timeout");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("write head");
    let _ = s.write_all(body.as_bytes());
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let (status, text) = common::parse_response(&raw);
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

/// Sum of a metric's samples whose line contains `label` (all of them when `None`).
fn metric(addr: SocketAddr, name: &str, label: Option<&str>) -> f64 {
    let (status, text) = common::request(addr, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.split(['{', ' ']).next() == Some(name) && label.is_none_or(|lb| l.contains(lb))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn path_count(addr: SocketAddr, path: &str) -> f64 {
    metric(
        addr,
        "strata:kv_transfer_requests_total",
        Some(&format!("path=\"{path}\"")),
    )
}

/// Waits (bounded) until the engine holds no block: every sequence and pin let go.
fn settles_free(addr: SocketAddr, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let usage = metric(addr, "vllm:kv_cache_usage_perc", None);
        if usage == 0.0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "blocks still held after {within:?}: usage {usage}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Waits (bounded) until the engine holds blocks: the gauge is published a moment after
/// the step whose answer went out.
fn becomes_held(addr: SocketAddr, within: Duration) {
    let deadline = Instant::now() + within;
    while metric(addr, "vllm:kv_cache_usage_perc", None) == 0.0 {
        assert!(Instant::now() < deadline, "no block held within {within:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn reset(addr: SocketAddr) {
    let (status, _) = common::request(addr, "POST", "/reset_prefix_cache", b"");
    assert_eq!(status, 200, "reset the prefix cache");
}

/// A prompt of several full blocks (about 90 tokens).
fn prompt_text() -> String {
    format!(
        "{} What did he write on the last night?",
        "The lighthouse keeper wrote in his log every night. ".repeat(8)
    )
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

fn with(mut body: Value, key: &str, value: Value) -> Value {
    body.as_object_mut()
        .expect("object")
        .insert(key.into(), value);
    body
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

fn cached_of(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// Prefills `prompt` on `a` for a remote decoder under `request_id`; the answer's
/// `kv_transfer_params`.
fn prefill(a: &Engine, prompt: &str, request_id: &str) -> Value {
    let body = with(
        completion(prompt, 1),
        "kv_transfer_params",
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    let (status, answer) = post(
        a.http,
        "/v1/completions",
        &body,
        &[("x-request-id", request_id)],
    );
    assert_eq!(status, 200, "{answer}");
    answer["kv_transfer_params"].clone()
}

fn assert_400(status: u16, body: &Value, param: &str) {
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], param, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

#[test]
fn remote_prefill_and_the_prefiller_header_give_the_colocated_output() {
    let a = start(
        EngineOptions {
            kv_transfer_port: 1, // any non-zero: the endpoint itself is bound by `start`
            ..opts(KvRole::Prefill)
        },
        true,
    );
    // The decode engine may contact A's transfer endpoint and (for the header) its HTTP port.
    let b = start(
        EngineOptions {
            kv_peers: peers(&[a.transfer.expect("A serves blocks"), a.http]),
            ..opts(KvRole::Decode)
        },
        false,
    );
    let a_port = a.transfer.expect("A serves blocks").port();
    let prompt = prompt_text();

    // (a) colocated, on the decode engine itself; then it forgets the prompt.
    let (status, colocated) = post(b.http, "/v1/completions", &completion(&prompt, 8), &[]);
    assert_eq!(status, 200, "{colocated}");
    let want = text_of(&colocated);
    let prompt_tokens = colocated["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(prompt_tokens >= 64, "{prompt_tokens}");
    reset(b.http);

    // (b) vLLM's proxy protocol: prefill on A, decode on B with A's answer.
    let params = prefill(&a, &prompt, "req-b");
    assert_eq!(params["do_remote_prefill"], true, "{params}");
    assert_eq!(params["do_remote_decode"], false, "{params}");
    assert_eq!(params["remote_host"], "127.0.0.1", "{params}");
    assert_eq!(params["remote_port"], a_port, "{params}");
    assert_eq!(params["remote_request_id"], "req-b", "{params}");
    assert!(params["remote_engine_id"].as_str().is_some(), "{params}");
    let blocks = params["remote_block_ids"]
        .as_array()
        .expect("block ids")
        .len() as u64;
    assert_eq!(blocks, prompt_tokens / 16, "{params}");
    // The pin holds A's blocks until B pulls them.
    becomes_held(a.http, Duration::from_secs(10));
    let body = with(completion(&prompt, 8), "kv_transfer_params", params);
    let (status, decoded) = post(
        b.http,
        "/v1/completions",
        &body,
        &[("x-request-id", "req-b")],
    );
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(text_of(&decoded), want, "remote prefill changed the output");
    let cached = cached_of(&decoded);
    assert!(
        cached > 0 && cached.is_multiple_of(16) && cached <= blocks * 16,
        "{decoded}"
    );
    settles_free(a.http, Duration::from_secs(10));
    assert_eq!(path_count(b.http, "remote_prefill"), 1.0);
    assert_eq!(path_count(b.http, "fallback"), 0.0);
    assert_eq!(
        metric(
            b.http,
            "strata:kv_transfer_blocks_total",
            Some("direction=\"received\"")
        ),
        blocks as f64
    );
    assert_eq!(
        metric(
            a.http,
            "strata:kv_transfer_blocks_total",
            Some("direction=\"sent\"")
        ),
        blocks as f64
    );
    assert_eq!(
        metric(b.http, "strata:kv_transfer_seconds_count", None),
        1.0
    );

    // (c) the picker's header: B runs phase 1 against A itself.
    reset(b.http);
    reset(a.http);
    let a_http = a.http.to_string();
    let (status, decoded) = post(
        b.http,
        "/v1/completions",
        &completion(&prompt, 8),
        &[
            ("x-prefiller-host-port", &a_http),
            ("x-request-id", "req-c"),
        ],
    );
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(
        text_of(&decoded),
        want,
        "the header path changed the output"
    );
    assert!(cached_of(&decoded) > 0, "{decoded}");
    assert_eq!(path_count(b.http, "remote_prefill"), 2.0);
    settles_free(a.http, Duration::from_secs(10));

    // A chat request prefilled for a remote decoder answers with the parameters too.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                      "max_tokens": 1, "temperature": 0,
                      "kv_transfer_params": {"do_remote_decode": true}});
    let (status, answer) = post(a.http, "/v1/chat/completions", &chat, &[]);
    assert_eq!(status, 200, "{answer}");
    let p = &answer["kv_transfer_params"];
    assert_eq!(p["do_remote_prefill"], true, "{answer}");
    // Without an x-request-id the pin is named by the response id's own.
    assert!(p["remote_request_id"].as_str().is_some(), "{answer}");
    let release = json!({"do_remote_prefill": true, "remote_host": "127.0.0.1",
                         "remote_port": a_port, "remote_request_id": p["remote_request_id"]});
    let chat = with(chat, "kv_transfer_params", release);
    let (status, decoded) = post(b.http, "/v1/chat/completions", &chat, &[]);
    assert_eq!(status, 200, "{decoded}");
    settles_free(a.http, Duration::from_secs(10));

    bad_kv_transfer_params_are_refused(&a, &b);
}

/// Every kind of bad `kv_transfer_params` is an OpenAI-shaped 400 naming it, and the
/// engines keep serving.
fn bad_kv_transfer_params_are_refused(a: &Engine, b: &Engine) {
    let base = completion("Hello there", 2);
    let kv = |p: Value| with(base.clone(), "kv_transfer_params", p);
    let cases: Vec<(SocketAddr, Value)> = vec![
        // The prefill side cannot stream or fork its answer.
        (
            a.http,
            with(kv(json!({"do_remote_decode": true})), "stream", json!(true)),
        ),
        (
            a.http,
            with(kv(json!({"do_remote_decode": true})), "n", json!(2)),
        ),
        // A decode engine keeps no blocks for others.
        (b.http, kv(json!({"do_remote_decode": true}))),
        (
            b.http,
            kv(json!({"do_remote_decode": true, "do_remote_prefill": true,
                      "remote_host": "127.0.0.1", "remote_port": 9})),
        ),
        (b.http, kv(json!({"do_remote_prefill": true}))),
        (
            b.http,
            kv(json!({"do_remote_prefill": true, "remote_host": "127.0.0.1"})),
        ),
        (
            b.http,
            kv(json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": 0})),
        ),
        (
            b.http,
            kv(
                json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": 70000}),
            ),
        ),
        (
            b.http,
            kv(json!({"do_remote_prefill": true, "remote_host": "not a host/", "remote_port": 9})),
        ),
        (
            b.http,
            kv(
                json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": 9,
                      "remote_request_id": 7}),
            ),
        ),
        (b.http, kv(json!("yes"))),
    ];
    for (addr, body) in cases {
        let (status, answer) = post(addr, "/v1/completions", &body, &[]);
        assert_400(status, &answer, "kv_transfer_params");
    }
    for bad in ["nonsense", "127.0.0.1:0", "bad host:80", "127.0.0.1:99999"] {
        let (status, answer) = post(
            b.http,
            "/v1/completions",
            &base,
            &[("x-prefiller-host-port", bad)],
        );
        assert_400(status, &answer, "x-prefiller-host-port");
    }
    for addr in [a.http, b.http] {
        let (status, answer) = post(addr, "/v1/completions", &base, &[]);
        assert_eq!(status, 200, "{answer}");
    }
}

/// Accepts connections and never answers (kept open until the test ends).
fn stalled_peer() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in l.incoming().flatten() {
            held.push(s);
        }
    });
    addr
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// A TCP proxy to `target` that passes the first `cut_after` bytes of each answer and then
/// drops both sides: a peer that dies mid-transfer.
fn dying_proxy(target: SocketAddr, cut_after: usize) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for client in l.incoming().flatten() {
            let Ok(upstream) = TcpStream::connect(target) else {
                continue;
            };
            let (mut c_read, mut u_write) = (
                client.try_clone().expect("clone"),
                upstream.try_clone().expect("clone"),
            );
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_read, &mut u_write);
            });
            std::thread::spawn(move || {
                let (mut u_read, mut c_write) = (upstream, client);
                let mut passed = 0;
                let mut buf = [0u8; 1024];
                while passed < cut_after {
                    let n = match u_read.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n.min(cut_after - passed),
                    };
                    if c_write.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    passed += n;
                }
                let _ = c_write.shutdown(std::net::Shutdown::Both);
                let _ = u_read.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    addr
}

#[test]
fn a_stalled_or_dying_prefill_peer_falls_back_and_pins_time_out() {
    let pin_timeout = Duration::from_secs(2);
    let a = start(
        EngineOptions {
            kv_transfer_port: 1,
            kv_pin_timeout: pin_timeout,
            ..opts(KvRole::Prefill)
        },
        true,
    );
    let timeout = Duration::from_millis(1500);
    let stalled = stalled_peer();
    let closed = closed_port();
    let a_transfer = a.transfer.expect("A serves blocks");
    let dying = dying_proxy(a_transfer, 4096);
    let local = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let b = start(
        EngineOptions {
            kv_transfer_timeout: timeout,
            kv_peers: peers(&[stalled, local(closed), a_transfer, dying]),
            ..opts(KvRole::Both)
        },
        false,
    );
    let prompt = prompt_text();
    let (status, colocated) = post(b.http, "/v1/completions", &completion(&prompt, 6), &[]);
    assert_eq!(status, 200, "{colocated}");
    let want = text_of(&colocated);

    let remote = |port: u16| {
        with(
            completion(&prompt, 6),
            "kv_transfer_params",
            json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port,
                   "remote_request_id": "gone"}),
        )
    };
    let mut fallbacks = 0.0;
    for (what, port, prefill_first) in [
        ("stalled", stalled.port(), false),
        ("refused", closed, false),
        // A live peer that holds none of the prompt's blocks (never computed it).
        ("empty", a.transfer.expect("A serves blocks").port(), false),
        ("dying", dying.port(), true),
    ] {
        reset(b.http);
        if prefill_first {
            let params = prefill(&a, &prompt, "req-dying");
            assert_eq!(params["do_remote_prefill"], true, "{params}");
        }
        let started = Instant::now();
        let (status, answer) = post(b.http, "/v1/completions", &remote(port), &[]);
        let took = started.elapsed();
        assert_eq!(status, 200, "{what}: {answer}");
        assert_eq!(
            text_of(&answer),
            want,
            "{what}: the recomputed output differs"
        );
        assert_eq!(cached_of(&answer), 0, "{what}: {answer}");
        // The transfer gave up within its timeout; the rest is the prompt's compute.
        assert!(took < timeout + Duration::from_secs(60), "{what}: {took:?}");
        fallbacks += 1.0;
        assert_eq!(path_count(b.http, "fallback"), fallbacks, "{what}");
    }
    assert_eq!(path_count(b.http, "remote_prefill"), 0.0);
    settles_free(b.http, Duration::from_secs(10));

    // A prefill nobody pulls keeps its blocks only until the pin timeout (the one cut off
    // above included).
    settles_free(a.http, pin_timeout + Duration::from_secs(10));
    let params = prefill(&a, "A different prompt about the sea and its ships, long enough to fill a block or two of the cache.", "req-unpulled");
    assert!(
        !params["remote_block_ids"]
            .as_array()
            .expect("ids")
            .is_empty(),
        "{params}"
    );
    let pinned_at = Instant::now();
    becomes_held(a.http, pin_timeout / 2);
    settles_free(a.http, pin_timeout + Duration::from_secs(10));
    assert!(
        pinned_at.elapsed() + Duration::from_millis(500) >= pin_timeout,
        "the pin went before its timeout: {:?}",
        pinned_at.elapsed()
    );

    // An engine without a transfer endpoint cannot prefill for others.
    let (status, answer) = post(
        b.http,
        "/v1/completions",
        &with(
            completion("Hi", 1),
            "kv_transfer_params",
            json!({"do_remote_decode": true}),
        ),
        &[],
    );
    assert_400(status, &answer, "kv_transfer_params");
}

/// A listener that counts the connections it accepts (held open, never answered).
fn counting_listener() -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let n = Arc::new(AtomicUsize::new(0));
    let count = n.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in l.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            held.push(s);
        }
    });
    (addr, n)
}

/// A prefill engine's HTTP port as a liar would run it: every request (counted) gets a
/// phase-1 answer naming `transfer` as the block endpoint.
fn fake_prefiller(transfer: SocketAddr) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let n = Arc::new(AtomicUsize::new(0));
    let count = n.clone();
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
            // The head, then the body it announces.
            let mut raw = Vec::new();
            let mut buf = [0u8; 4096];
            let body_len = loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break None,
                    Ok(k) => raw.extend_from_slice(&buf[..k]),
                }
                let text = String::from_utf8_lossy(&raw).to_ascii_lowercase();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    break Some(end + 4 + len);
                }
            };
            let Some(total) = body_len else { continue };
            while raw.len() < total {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => raw.extend_from_slice(&buf[..k]),
                }
            }
            let body = json!({"id": "cmpl-fake", "object": "text_completion", "model": MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
                    "remote_host": "127.0.0.1", "remote_port": transfer.port(),
                    "remote_block_ids": [0], "remote_engine_id": "fake",
                    "remote_request_id": "fake"}})
            .to_string();
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (addr, n)
}

/// Issue 29: a peer a client names is refused with a 400 naming the field and never
/// contacted (a listener counts 0 connections), on an engine with a `--kv-peers` list and
/// on an open engine without one; a listed prefill engine whose answer names an unlisted
/// block endpoint costs a recompute, not a connection; and without `--kv-peers`, an engine
/// that requires an API key lets its key holders (the router) name peers.
#[test]
fn client_named_kv_peers_are_refused_and_never_contacted() {
    let (target, connections) = counting_listener();
    let (prefiller, prefiller_calls) = fake_prefiller(target);
    let prompt = prompt_text();
    let named = with(
        completion(&prompt, 2),
        "kv_transfer_params",
        json!({"do_remote_prefill": true, "remote_host": "127.0.0.1",
               "remote_port": target.port(), "remote_request_id": "r"}),
    );
    let listed = start(
        EngineOptions {
            kv_peers: peers(&[prefiller]),
            ..opts(KvRole::Decode)
        },
        false,
    );
    let open = start(opts(KvRole::Decode), false);
    let target_text = target.to_string();
    for (what, e) in [("listed", &listed), ("open", &open)] {
        let (status, answer) = post(e.http, "/v1/completions", &named, &[]);
        assert_400(status, &answer, "kv_transfer_params.remote_host");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(&target_text), "{what}: {answer}");
        let (status, answer) = post(
            e.http,
            "/v1/completions",
            &completion(&prompt, 2),
            &[("x-prefiller-host-port", &target_text)],
        );
        assert_400(status, &answer, "x-prefiller-host-port");
        let chat = json!({"model": MODEL, "max_tokens": 1,
                          "messages": [{"role": "user", "content": prompt}],
                          "kv_transfer_params": named["kv_transfer_params"]});
        let (status, answer) = post(e.http, "/v1/chat/completions", &chat, &[]);
        assert_400(status, &answer, "kv_transfer_params.remote_host");
    }
    // The open engine does not call an unlisted prefill engine either.
    let (status, answer) = post(
        open.http,
        "/v1/completions",
        &completion(&prompt, 2),
        &[("x-prefiller-host-port", &prefiller.to_string())],
    );
    assert_400(status, &answer, "x-prefiller-host-port");
    assert_eq!(prefiller_calls.load(Ordering::SeqCst), 0);

    // A listed prefill engine that names an unlisted block endpoint: phase 1 runs, the pull
    // does not; the decode engine recomputes.
    let (status, answer) = post(
        listed.http,
        "/v1/completions",
        &completion(&prompt, 2),
        &[("x-prefiller-host-port", &prefiller.to_string())],
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(prefiller_calls.load(Ordering::SeqCst), 1);
    assert_eq!(path_count(listed.http, "fallback"), 1.0);
    assert_eq!(path_count(listed.http, "remote_prefill"), 0.0);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        connections.load(Ordering::SeqCst),
        0,
        "a refused peer was contacted"
    );

    // No --kv-peers but --api-key: a caller without the key gets a 401 and contacts nothing;
    // a key holder may name the peer (nothing answers there: the engine recomputes).
    let keyed = start(
        EngineOptions {
            auth: AuthOptions {
                api_keys: vec!["internal-key".into()],
                ..AuthOptions::default()
            },
            kv_transfer_timeout: Duration::from_millis(500),
            ..opts(KvRole::Decode)
        },
        false,
    );
    let (status, answer) = post(keyed.http, "/v1/completions", &named, &[]);
    assert_eq!(status, 401, "{answer}");
    assert_eq!(connections.load(Ordering::SeqCst), 0);
    let (status, answer) = post(
        keyed.http,
        "/v1/completions",
        &named,
        &[("authorization", "Bearer internal-key")],
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(connections.load(Ordering::SeqCst), 1);
    assert_eq!(path_count(keyed.http, "fallback"), 1.0);
}

/// A KV tier listening on `listener`, bounded to `blocks` blocks of `block_bytes`, served in
/// process like `strata kv-tier`.
fn start_tier(listener: TcpListener, block_bytes: usize, blocks: usize) -> Tier {
    let tier = Tier::new(
        TierStore::new(TierConfig::memory((block_bytes * blocks) as u64)).expect("tier store"),
    );
    let source: Arc<dyn BlockSource> = Arc::new(tier.clone());
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).expect("tier listener");
            transfer::serve(l, source, std::future::pending())
                .await
                .expect("tier serves");
        });
    });
    tier
}

/// Forwards every KV event an engine publishes on `port` (tagged by type and medium).
fn subscribe(port: u16) -> std::sync::mpsc::Receiver<KvEvent> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let mut sub = SubSocket::new();
            sub.subscribe("kv@").await.expect("subscribe");
            sub.connect(&format!("tcp://127.0.0.1:{port}"))
                .await
                .expect("connect");
            while let Ok(msg) = sub.recv().await {
                let frames = msg.into_vec();
                let batch = decode_batch(frames[2].as_ref()).expect("payload decodes");
                for ev in batch.events {
                    if tx.send(ev).is_err() {
                        return;
                    }
                }
            }
        });
    });
    rx
}

/// Sends one-token completions of distinct filler prompts to an engine, to push other
/// blocks out of its cache.
struct Filler<'a> {
    addr: SocketAddr,
    events: &'a std::sync::mpsc::Receiver<KvEvent>,
    block_size: usize,
    /// Prompts sent so far (each filler is numbered, so none repeats).
    sent: usize,
}

impl Filler<'_> {
    /// Sends fillers worded with `word`, one each `pause`, reading the KV events after
    /// each, until `done` holds; fails with `what` after 30 s.
    fn until(
        &mut self,
        seen: &mut TierSeen,
        (word, pause): (&str, Duration),
        what: &str,
        done: impl Fn(&TierSeen) -> bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done(seen) {
            assert!(Instant::now() < deadline, "{what}");
            self.sent += 1;
            let filler = format!("{word} {}: ", self.sent).repeat(24);
            let (status, v) = post(self.addr, "/v1/completions", &completion(&filler, 1), &[]);
            assert_eq!(status, 200, "{v}");
            std::thread::sleep(pause);
            seen.drain(self.events, self.block_size);
        }
    }
}

/// What the subscriber has seen so far: wire hashes stored and removed on the CPU medium.
#[derive(Default)]
struct TierSeen {
    stored: std::collections::HashSet<u64>,
    removed: std::collections::HashSet<u64>,
}

impl TierSeen {
    fn drain(&mut self, rx: &std::sync::mpsc::Receiver<KvEvent>, block_size: usize) {
        while let Ok(ev) = rx.try_recv() {
            match ev {
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    medium,
                    ..
                } if medium.as_deref() == Some("CPU") => {
                    assert_eq!(token_ids.len(), block_hashes.len() * block_size);
                    self.stored.extend(block_hashes);
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } if medium.as_deref() == Some("CPU") => {
                    for h in block_hashes {
                        assert!(
                            self.stored.contains(&h),
                            "CPU removal of a block never announced"
                        );
                        self.removed.insert(h);
                    }
                }
                _ => {}
            }
        }
    }
}

fn tokens_of(addr: SocketAddr, prompt: &str) -> Vec<u32> {
    let (status, v) = post(
        addr,
        "/tokenize",
        &json!({"model": MODEL, "prompt": prompt}),
        &[],
    );
    assert_eq!(status, 200, "{v}");
    v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn blocks_evicted_to_the_tier_are_announced_fetched_and_removed_without_leaks() {
    let events_port = closed_port();
    let tier_blocks = 16;
    // A's cache is small: each new prompt evicts the previous ones to the tier.
    let small = |tier| EngineOptions {
        num_blocks: Some(16),
        max_model_len: Some(256),
        kv_tier: Some(tier),
        ..EngineOptions::default()
    };
    // The engines need the tier's address, its bound needs their block size: bind first,
    // serve once A is up (connections wait in the backlog meanwhile).
    let tier_listener = TcpListener::bind("127.0.0.1:0").expect("bind tier");
    let tier_addr = tier_listener.local_addr().expect("tier addr");
    let a = start(
        EngineOptions {
            kv_events_endpoint: Some(format!("tcp://127.0.0.1:{events_port}")),
            kv_events_topic: Some("kv@a@smollm2".into()),
            ..small(tier_addr)
        },
        false,
    );
    let block_bytes = a.state.engine.block_spec().block_bytes();
    let tier = start_tier(tier_listener, block_bytes, tier_blocks);
    let b = start(
        EngineOptions {
            num_blocks: Some(64),
            ..small(tier_addr)
        },
        false,
    );
    let events = subscribe(events_port);
    // The subscription reaches the publisher asynchronously: reset until one arrives.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        reset(a.http);
        if events.recv_timeout(Duration::from_millis(200)).is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "the subscriber never connected");
    }

    let prompt = tokens_of(a.http, &prompt_text());
    let block_size = 16;
    let wire: Vec<u64> = a
        .state
        .engine
        .block_hashes(&prompt, None, None)
        .iter()
        .map(|h| BlockHash(*h).to_u64())
        .collect();
    assert!(wire.len() >= 4, "{}", wire.len());
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0});
    let (status, first) = post(a.http, "/v1/completions", &body, &[]);
    assert_eq!(status, 200, "{first}");
    let want = text_of(&first);

    // Other prompts push the first out of A's cache, onto the tier.
    let mut seen = TierSeen::default();
    let mut fill = Filler {
        addr: a.http,
        events: &events,
        block_size,
        sent: 0,
    };
    fill.until(
        &mut seen,
        ("Note", Duration::from_millis(200)),
        "the prompt's blocks never reached the tier",
        |seen| wire.iter().all(|h| seen.stored.contains(h)),
    );
    assert!(seen.removed.is_empty(), "nothing left the tier yet");

    // (d) B has never seen the prompt: it fetches its blocks from the tier.
    let (status, fetched) = post(b.http, "/v1/completions", &body, &[]);
    assert_eq!(status, 200, "{fetched}");
    assert_eq!(
        text_of(&fetched),
        want,
        "blocks from the tier changed the output"
    );
    let cached = cached_of(&fetched);
    assert!(cached >= 16 * (wire.len() as u64 - 1), "{fetched}");
    assert_eq!(path_count(b.http, "tier"), 1.0);
    assert!(
        metric(
            b.http,
            "strata:kv_transfer_blocks_total",
            Some("direction=\"received\"")
        ) >= wire.len() as f64 - 1.0
    );

    // More evictions overflow the tier: it drops the oldest, and A announces their removal.
    fill.until(
        &mut seen,
        ("Entry", Duration::from_millis(300)),
        "the tier never dropped the prompt's blocks",
        |seen| wire.iter().any(|h| seen.removed.contains(h)),
    );
    // Nothing leaks: both pools are free once idle, the tier stays within its bound, and
    // what A counts on the tier is what it announced there and has not seen leave.
    settles_free(a.http, Duration::from_secs(10));
    settles_free(b.http, Duration::from_secs(10));
    assert!(
        tier.stats().memory_blocks <= tier_blocks,
        "{:?}",
        tier.stats()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        seen.drain(&events, block_size);
        let on_tier = (seen.stored.len() - seen.removed.len()) as f64;
        assert!(on_tier <= tier_blocks as f64, "{on_tier}");
        let counted = metric(a.http, "strata:kv_tier_blocks", Some("medium=\"CPU\""));
        if counted == on_tier {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "A counts {counted} blocks on the tier, its events say {on_tier}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
