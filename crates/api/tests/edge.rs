//! The edge server's bounds, against real sockets on loopback: slow heads are cut at the
//! header timeout without slowing anyone else, a stalled body fails its request, an
//! oversized head is a 431 in OpenAI's shape, and a connection past the cap is refused with
//! an OpenAI-shaped 503 while the ones inside it keep being served.
#![cfg(feature = "http")]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::routing::{get, post};
use axum::Router;
use strata_api::edge::{serve, EdgeLimits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn app() -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/echo",
            post(|body: Bytes| async move { format!("{} bytes", body.len()) }),
        )
}

async fn start(limits: EdgeLimits) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, app(), limits, async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// Sends `raw` and reads until the server closes or `wait` passes; returns what came back.
async fn exchange(addr: SocketAddr, raw: &[u8], wait: Duration) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

async fn get_health(addr: SocketAddr) -> String {
    exchange(
        addr,
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await
}

/// Whether the server has closed `s` (EOF or reset) within `wait`.
async fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_are_cut_and_do_not_delay_a_legitimate_request() {
    let limits = EdgeLimits {
        header_timeout: Duration::from_secs(2),
        ..EdgeLimits::default()
    };
    let (addr, _stop) = start(limits).await;
    // 500 connections that send half a head and then nothing.
    let mut slow = Vec::new();
    for _ in 0..500 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
            .await
            .unwrap();
        slow.push(s);
    }
    let t = Instant::now();
    let answer = get_health(addr).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "a legitimate request waited {:?} behind slow clients",
        t.elapsed()
    );
    // Every slow one is closed at the header timeout (with slack for a loaded machine).
    for s in slow.iter_mut() {
        assert!(closed_within(s, Duration::from_secs(10)).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_at_the_header_timeout() {
    let limits = EdgeLimits {
        header_timeout: Duration::from_secs(1),
        ..EdgeLimits::default()
    };
    let (addr, _stop) = start(limits).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // Kept alive, then nothing: closed soon after the bound, not held open.
    let t = Instant::now();
    assert!(closed_within(&mut s, Duration::from_secs(8)).await);
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_body_is_cut_at_its_timeout() {
    let limits = EdgeLimits {
        body_timeout: Duration::from_secs(1),
        body_min_bytes_per_sec: 1024,
        ..EdgeLimits::default()
    };
    let (addr, _stop) = start(limits).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    // A chunked body that starts and never ends.
    s.write_all(
        b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .unwrap();
    let t = Instant::now();
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the connection was still open after 10 s");
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 4"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
    // A body that arrives in time is served as before.
    let ok = exchange(
        addr,
        b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
        Duration::from_secs(5),
    )
    .await;
    assert!(
        ok.starts_with("HTTP/1.1 200") && ok.ends_with("5 bytes"),
        "{ok}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_head_is_an_openai_shaped_431() {
    let limits = EdgeLimits {
        max_header_bytes: 4096,
        ..EdgeLimits::default()
    };
    let (addr, _stop) = start(limits).await;
    let big = "a".repeat(6000);
    let raw =
        format!("GET /health HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\nconnection: close\r\n\r\n");
    let answer = exchange(addr, raw.as_bytes(), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["error"]["code"], "request_header_fields_too_large");
    assert!(v["error"]["message"].as_str().unwrap().contains("4096"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_the_cap_gets_a_503_and_the_others_are_served() {
    let limits = EdgeLimits {
        max_connections: 4,
        ..EdgeLimits::default()
    };
    let (addr, _stop) = start(limits).await;
    // Four idle connections fill the cap.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = get_health(addr).await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.to_ascii_lowercase().contains("retry-after: 1"));
    let body = refused.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["error"]["code"], "too_many_connections");
    // A held connection is still served, and once they close there is room again.
    held[0]
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    held[0].read_to_end(&mut out).await.unwrap();
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200"));
    drop(held);
    let mut served = false;
    for _ in 0..50 {
        if get_health(addr).await.starts_with("HTTP/1.1 200") {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served, "no room after the held connections closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_request_in_flight_and_stops_accepting() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let slow = Router::new().route(
        "/slow",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            "done"
        }),
    );
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, slow, EdgeLimits::default(), async move {
        let _ = rx.await;
    }));
    let client = tokio::spawn(exchange(
        addr,
        b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n",
        Duration::from_secs(5),
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    tx.send(()).unwrap();
    let answer = client.await.unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("done"),
        "{answer}"
    );
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server did not stop")
        .unwrap()
        .unwrap();
    assert!(TcpStream::connect(addr).await.is_err());
}
