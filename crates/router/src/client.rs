//! The upstream HTTP client (hyper, HTTP/1.1, pooled keep-alive connections) and small
//! helpers for the data layer's GETs.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Requests carry a fully read body; responses stream.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled client with a connect timeout and `TCP_NODELAY`.
pub fn http_client(connect_timeout: Duration) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(connect_timeout));
    conn.set_nodelay(true);
    conn.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(256)
        .build(conn)
}

/// Why a small fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Nothing listens there (or the connection broke before a response).
    #[error("connect: {0}")]
    Connect(String),
    #[error("timed out")]
    Timeout,
    #[error("body: {0}")]
    Body(String),
    #[error("bad request: {0}")]
    Build(String),
}

/// A request with a bounded wait and a bounded body.
pub async fn fetch(
    client: &HttpClient,
    method: Method,
    url: &str,
    body: Option<Bytes>,
    timeout: Duration,
    max_body: usize,
) -> Result<(StatusCode, Bytes), FetchError> {
    let mut builder = Request::builder().method(method).uri(url);
    if body.is_some() {
        builder = builder.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    let req = builder
        .body(Full::new(body.unwrap_or_default()))
        .map_err(|e| FetchError::Build(e.to_string()))?;
    let work = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| FetchError::Connect(e.to_string()))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), max_body)
            .collect()
            .await
            .map_err(|e| FetchError::Body(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| FetchError::Timeout)?
}
