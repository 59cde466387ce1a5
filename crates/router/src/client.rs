//! The upstream HTTP client (hyper, HTTP/1.1, pooled keep-alive connections; `https://`
//! endpoints over rustls) and small helpers for the data layer's GETs.
//!
//! What it trusts: the system's roots plus `upstream_tls.ca`; with `upstream_tls.cert` and
//! `key` it presents a client certificate (mutual TLS with engines that ask for one). With
//! `engine_api_key` every request it sends carries `Authorization: Bearer <key>`, in place
//! of whatever the client sent: the router's scrapes, tokenize calls and forwarded requests
//! alike.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{HeaderValue, AUTHORIZATION};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use strata_api::tls::{Identity, TlsError};

/// Requests carry a fully read body; responses stream.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<Bounded<HttpsConnector<HttpConnector>>, Full<Bytes>>,
    /// `Bearer <engine_api_key>`, set on every request.
    engine_auth: Option<HeaderValue>,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient")
            .field("engine_auth", &self.engine_auth.is_some())
            .finish_non_exhaustive()
    }
}

impl HttpClient {
    /// Sends `req` (with the engine key, when there is one, as its `Authorization`).
    pub fn request(&self, mut req: Request<Full<Bytes>>) -> ResponseFuture {
        if let Some(auth) = &self.engine_auth {
            req.headers_mut().insert(AUTHORIZATION, auth.clone());
        }
        self.inner.request(req)
    }
}

/// A connector whose whole connect (TCP, then the TLS handshake for `https://`) must finish
/// within `within`: an endpoint that accepts and then says nothing fails the attempt like a
/// refused connection instead of holding it.
#[derive(Clone)]
pub struct Bounded<C> {
    inner: C,
    within: Duration,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower_service::Service<Uri> for Bounded<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let within = self.within;
        Box::pin(async move {
            match tokio::time::timeout(within, connecting).await {
                Ok(done) => done.map_err(Into::into),
                Err(_) => Err(format!("no connection (TCP and TLS) within {within:?}").into()),
            }
        })
    }
}

/// `upstream_tls` in `router.yaml` (flags `--upstream-tls-ca`, `--upstream-tls-cert`,
/// `--upstream-tls-key`): how `https://` endpoints are verified and what the router
/// presents to them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamTls {
    /// PEM file of CAs trusted besides the system's roots.
    pub ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for engines that require one; with `key`.
    pub cert: Option<PathBuf>,
    /// Private key of `cert` (PEM).
    pub key: Option<PathBuf>,
}

/// Why the upstream client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("upstream TLS: {0}")]
    Tls(#[from] TlsError),
    #[error("upstream_tls: `cert` and `key` go together")]
    HalfIdentity,
    #[error("engine_api_key is not a valid header value")]
    BadEngineKey,
}

impl UpstreamTls {
    /// The client certificate, when both halves are given.
    pub fn identity(&self) -> Result<Option<Identity>, ClientError> {
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Ok(Some(Identity {
                cert: cert.clone(),
                key: key.clone(),
            })),
            (None, None) => Ok(None),
            _ => Err(ClientError::HalfIdentity),
        }
    }
}

/// A pooled client for `http://` and `https://` endpoints with a connect timeout (TCP and
/// TLS handshake together) and `TCP_NODELAY`, verifying servers as `tls` says and sending
/// `engine_api_key`.
pub fn upstream_client(
    connect_timeout: Duration,
    tls: &UpstreamTls,
    engine_api_key: Option<&str>,
) -> Result<HttpClient, ClientError> {
    let engine_auth = engine_api_key
        .map(|key| {
            let mut v = HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| ClientError::BadEngineKey)?;
            v.set_sensitive(true);
            Ok::<_, ClientError>(v)
        })
        .transpose()?;
    // hyper-rustls sets the ALPN list itself (HTTP/1.1 only here).
    let config = strata_api::tls::client_config(tls.ca.as_deref(), tls.identity()?.as_ref(), &[])?;
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(connect_timeout));
    conn.set_nodelay(true);
    conn.enforce_http(false);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*config).clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(conn);
    let bounded = Bounded {
        inner: https,
        within: connect_timeout,
    };
    let inner = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(256)
        .build(bounded);
    Ok(HttpClient { inner, engine_auth })
}

/// A client with the defaults: system roots, no client certificate, no engine key.
pub fn http_client(connect_timeout: Duration) -> Result<HttpClient, ClientError> {
    upstream_client(connect_timeout, &UpstreamTls::default(), None)
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
