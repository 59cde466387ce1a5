//! TLS to engines and the services' keys, end to end on loopback with a chain made here:
//! an `https://` engine is served through the router (its certificate verified against
//! the operator's CA), with the engine key in place of the caller's; an engine whose
//! certificate the router cannot verify (unknown CA, another name) or that wants a client
//! certificate the router lacks is never ready; callers without the router's key get an
//! OpenAI-shaped 401 and the engine never hears of them.

mod tls_chain;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use strata_api::edge::{serve, EdgeLimits};
use strata_api::tls::{Identity, TlsFiles};
use strata_mock::MockConfig;
use strata_router::client::{upstream_client, HttpClient, UpstreamTls};
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};
use strata_router::Router;
use tls_chain::{Ca, Dir};

/// The `Authorization` header of every `/v1/...` request an engine received.
type Seen = Arc<Mutex<Vec<Option<String>>>>;

struct Engine {
    addr: SocketAddr,
    seen: Seen,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// The mock engine's routes behind the edge server over TLS.
async fn https_engine(files: TlsFiles) -> Engine {
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let app = strata_mock::app(MockConfig::default(), "tls-engine".into()).layer(
        axum::middleware::from_fn(move |req: Request, next: Next| {
            let record = record.clone();
            async move {
                if req.uri().path().starts_with("/v1/") {
                    let auth = req
                        .headers()
                        .get("authorization")
                        .map(|v| v.to_str().unwrap_or("?").to_string());
                    record.lock().unwrap().push(auth);
                }
                next.run(req).await
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let limits = EdgeLimits {
        tls: Some(files),
        ..EdgeLimits::default()
    };
    tokio::spawn(serve(listener, app, limits, async move {
        let _ = rx.await;
    }));
    Engine {
        addr,
        seen,
        _stop: tx,
    }
}

fn config(url: &str, tls: UpstreamTls) -> RouterConfig {
    RouterConfig {
        scrape_interval_ms: 20,
        health_interval_ms: 50,
        stale_after_ms: 2000,
        endpoints: vec![EndpointSpec::new(url, EngineKind::Vllm)
            .normalized()
            .unwrap()],
        upstream_tls: tls,
        // A request that finds no ready replica is answered soon (503), not held.
        admission: strata_router::config::AdmissionSection {
            queue_timeout_ms: 200,
            ..Default::default()
        },
        ..RouterConfig::default()
    }
}

fn trusting(ca: PathBuf) -> UpstreamTls {
    UpstreamTls {
        ca: Some(ca),
        ..UpstreamTls::default()
    }
}

struct Front {
    router: Router,
    base: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn front(config: RouterConfig) -> Front {
    let router = Router::new(config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = strata_router::proxy::app(router.clone());
    tokio::spawn(serve(listener, app, EdgeLimits::default(), async move {
        let _ = rx.await;
    }));
    Front {
        router,
        base,
        _stop: tx,
    }
}

/// Whether every endpoint of `router` is ready within `wait`.
async fn ready_within(router: &Router, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if router.status().iter().all(|e| e.ready) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn client() -> HttpClient {
    upstream_client(Duration::from_secs(2), &UpstreamTls::default(), None).unwrap()
}

async fn call(
    method: Method,
    url: &str,
    auth: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, hyper::HeaderMap, Value) {
    let mut req = hyper::Request::builder().method(method).uri(url);
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = req
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("answered in time")
        .unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (parts.status, parts.headers, json)
}

fn chat() -> Value {
    json!({"model": "mock", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_engine_is_served_through_the_router_with_the_engine_key() {
    let dir = Dir::new("engine-key");
    let ca = Ca::new("strata test CA");
    let ca_file = dir.ca_file("ca.pem", &ca);
    let engine = https_engine(dir.server("engine", &ca, &["127.0.0.1"], None)).await;
    let url = format!("https://{}", engine.addr);
    let mut cfg = config(&url, trusting(ca_file.clone()));
    cfg.api_key = Some("sk-router".into());
    cfg.engine_api_key = Some("sk-engine".into());
    let f = front(cfg).await;
    assert!(ready_within(&f.router, Duration::from_secs(10)).await);

    let chat_url = format!("{}/v1/chat/completions", f.base);
    let (status, headers, body) = call(
        Method::POST,
        &chat_url,
        Some("Bearer sk-router"),
        Some(chat()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(
        headers[strata_router::proxy::SERVED_BY].to_str().unwrap(),
        engine.addr.to_string()
    );
    // The engine got the engine key, never the caller's.
    assert_eq!(
        engine.seen.lock().unwrap().clone(),
        vec![Some("Bearer sk-engine".to_string())]
    );

    // No key, a wrong key, another scheme: 401 in OpenAI's shape, nothing forwarded.
    for auth in [
        None,
        Some("Bearer sk-wrong"),
        Some("Basic c2stcm91dGVy"),
        Some("Bearer "),
    ] {
        let (status, headers, body) = call(Method::POST, &chat_url, auth, Some(chat())).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{auth:?}");
        assert_eq!(body["error"]["type"], "authentication_error", "{body}");
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("API key"));
        assert_eq!(headers["www-authenticate"], "Bearer");
    }
    for path in ["/v1/models", "/debug/endpoints", "/v1/anything"] {
        let (status, _, _) = call(Method::GET, &format!("{}{path}", f.base), None, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
    }
    assert_eq!(
        engine.seen.lock().unwrap().len(),
        1,
        "no 401 reached the engine"
    );
    // Probes and scrapes stay open.
    for path in ["/health", "/metrics"] {
        let (status, _, _) = call(Method::GET, &format!("{}{path}", f.base), None, None).await;
        assert_eq!(status, StatusCode::OK, "{path}");
    }
    let (status, _, models) = call(
        Method::GET,
        &format!("{}/v1/models", f.base),
        Some("bearer sk-router"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(models["data"][0]["id"], "mock");

    // A router with no engine key passes the caller's header on unchanged.
    let open = front(config(&url, trusting(ca_file))).await;
    assert!(ready_within(&open.router, Duration::from_secs(10)).await);
    let (status, _, _) = call(
        Method::POST,
        &format!("{}/v1/chat/completions", open.base),
        Some("Bearer caller-key"),
        Some(chat()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        engine
            .seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .flatten()
            .as_deref(),
        Some("Bearer caller-key")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_the_router_cannot_verify_is_never_ready() {
    let dir = Dir::new("verify");
    let ca = Ca::new("strata test CA");
    let ca_file = dir.ca_file("ca.pem", &ca);
    let good = https_engine(dir.server("good", &ca, &["localhost"], None)).await;
    // By name: `localhost` is what the certificate names.
    let by_name = format!("https://localhost:{}", good.addr.port());
    let ok = front(config(&by_name, trusting(ca_file.clone()))).await;
    assert!(ready_within(&ok.router, Duration::from_secs(10)).await);

    // The same engine through its IP: the certificate does not name it.
    let by_ip = format!("https://{}", good.addr);
    let wrong_name = front(config(&by_ip, trusting(ca_file.clone()))).await;
    // The system roots alone do not know the test CA.
    let unknown_ca = front(config(&by_name, UpstreamTls::default())).await;
    // Plain HTTP to a TLS port gets no answer either.
    let plain = front(config(
        &format!("http://{}", good.addr),
        UpstreamTls::default(),
    ))
    .await;
    for (what, f) in [
        ("wrong name", &wrong_name),
        ("unknown CA", &unknown_ca),
        ("plain", &plain),
    ] {
        assert!(
            !ready_within(&f.router, Duration::from_millis(800)).await,
            "{what}: ready"
        );
        let (status, _, body) = call(
            Method::POST,
            &format!("{}/v1/chat/completions", f.base),
            None,
            Some(chat()),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{what}: {body}");
    }
    assert!(good.seen.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_to_an_engine_needs_the_router_certificate() {
    let dir = Dir::new("mtls");
    let ca = Ca::new("strata test CA");
    let ca_file = dir.ca_file("ca.pem", &ca);
    let clients = Ca::new("strata clients CA");
    let clients_file = dir.ca_file("clients.pem", &clients);
    let engine = https_engine(dir.server("engine", &ca, &["127.0.0.1"], Some(clients_file))).await;
    let url = format!("https://{}", engine.addr);

    let Identity { cert, key } = dir.client("router", &clients);
    let with_cert = UpstreamTls {
        ca: Some(ca_file.clone()),
        cert: Some(cert),
        key: Some(key),
    };
    let f = front(config(&url, with_cert)).await;
    assert!(ready_within(&f.router, Duration::from_secs(10)).await);
    let (status, _, body) = call(
        Method::POST,
        &format!("{}/v1/chat/completions", f.base),
        None,
        Some(chat()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let without = front(config(&url, trusting(ca_file))).await;
    assert!(!ready_within(&without.router, Duration::from_millis(800)).await);
    assert_eq!(engine.seen.lock().unwrap().len(), 1);
}

#[test]
fn upstream_tls_files_that_do_not_load_fail_the_router_at_start() {
    let dir = Dir::new("bad");
    let missing = config(
        "https://127.0.0.1:1",
        trusting(dir.0.join("missing-ca.pem")),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let err = Router::new(missing)
        .err()
        .expect("a missing CA file is an error");
    assert!(err.to_string().contains("missing-ca.pem"), "{err}");
    let half = UpstreamTls {
        cert: Some(dir.write("c.pem", "x")),
        ..UpstreamTls::default()
    };
    assert!(Router::new(config("https://127.0.0.1:1", half)).is_err());
    let garbage = UpstreamTls {
        ca: Some(dir.write("garbage.pem", "-----BEGIN CERTIFICATE-----\n!!\n")),
        ..UpstreamTls::default()
    };
    assert!(Router::new(config("https://127.0.0.1:1", garbage)).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_never_finishes_the_handshake_fails_at_the_connect_timeout() {
    // Accepts TCP connections and never says a word.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            open.push(s);
        }
    });
    let client =
        upstream_client(Duration::from_millis(300), &UpstreamTls::default(), None).unwrap();
    let started = std::time::Instant::now();
    let r = strata_router::client::fetch(
        &client,
        Method::GET,
        &format!("https://{addr}/health"),
        None,
        Duration::from_secs(10),
        1024,
    )
    .await;
    assert!(
        matches!(&r, Err(strata_router::client::FetchError::Connect(_))),
        "{r:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    held.abort();
}
