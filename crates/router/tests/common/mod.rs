//! The router harness the proxy and disaggregation tests share: a router on a loopback
//! port in front of the given endpoints, ready once every endpoint is.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use strata_router::config::RouterConfig;
use strata_router::Router;

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub struct Harness {
    pub router: Router,
    pub base: String,
    pub client: HttpClient,
}

/// Polls `f` every 10 ms until it holds, failing the test after 10 s.
pub async fn wait_for<F: Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Serves a router over `config` on a loopback port; returns once every endpoint is ready
/// with fresh metrics.
pub async fn start(config: RouterConfig) -> Harness {
    let n = config.endpoints.len();
    let router = Router::new(config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = strata_router::proxy::app(router.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let r = router.clone();
    wait_for("endpoints ready with metrics", || {
        let s = r.status();
        async move { s.len() == n && s.iter().all(|e| e.ready && !e.stale) }
    })
    .await;
    Harness {
        router,
        base,
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}
