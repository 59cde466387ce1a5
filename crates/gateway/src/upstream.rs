//! The upstream HTTP client: hyper's pooled HTTP/1.1 client (the router's, with
//! keep-alive and `TCP_NODELAY`) for `http://` and `https://` upstreams alike. TLS is
//! rustls on `ring`, verifying servers against the system's roots plus, per upstream, the
//! CAs of its `ca_file` (an upstream with one gets a client of its own).
//!
//! Requests go to a URI parsed once when the config is loaded, with prebuilt auth headers
//! (the provider's, [`crate::provider`]), so a try builds no strings. A refused
//! certificate is told apart from other connect errors ([`SendError::Tls`]). Answers come back as an
//! `http::Response` over a boxed body, so the request path has one way to read or stream
//! them.

use std::path::Path;
use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method, Request, Response, Uri};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use strata_router::client::{upstream_client, HttpClient, UpstreamTls};

/// Errors of an upstream body (connection cut, malformed chunk).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// An upstream answer's body, whichever client fetched it.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BodyError>;

/// How long a connect (TCP and the TLS handshake together) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a try got no response headers.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Could not connect (refused, TLS handshake or certificate refused), or the connection
    /// broke before the response headers.
    #[error("upstream unreachable: {0}")]
    Connect(String),
    /// The TLS handshake failed: the server's certificate was refused (unknown issuer,
    /// expired, issued for another name) or the handshake itself broke.
    #[error("upstream TLS: {0}")]
    Tls(String),
    /// The connect timeout passed.
    #[error("upstream connect timed out")]
    Timeout,
}

/// The pooled client, built once per gateway (and once per upstream with a `ca_file`).
#[derive(Clone)]
pub struct UpstreamClient {
    http: HttpClient,
}

impl std::fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamClient").finish_non_exhaustive()
    }
}

impl UpstreamClient {
    /// A client trusting the system's roots and, when given, every CA in `ca_file` (PEM);
    /// an unreadable or empty file is an error here, at load, never at request time.
    pub fn new(
        connect_timeout: Duration,
        ca_file: Option<&Path>,
    ) -> Result<UpstreamClient, SendError> {
        let tls = UpstreamTls {
            ca: ca_file.map(Path::to_path_buf),
            ..Default::default()
        };
        Ok(UpstreamClient {
            http: upstream_client(connect_timeout, &tls, None)
                .map_err(|e| SendError::Connect(e.to_string()))?,
        })
    }

    /// POSTs a body of `content_type` (JSON, or a client's multipart form), with the
    /// upstream's `auth` headers and the W3C `traceparent` when the request is traced. Any
    /// status comes back as a response; only a failure to get response headers is an
    /// error. Bounding the wait is the caller's job.
    pub async fn post(
        &self,
        uri: &Uri,
        body: Bytes,
        content_type: &HeaderValue,
        request_id: (&'static str, &HeaderValue),
        auth: &[(HeaderName, HeaderValue)],
        traceparent: Option<&HeaderValue>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        let h = req.headers_mut();
        h.insert(header::CONTENT_TYPE, content_type.clone());
        h.insert(HeaderName::from_static(request_id.0), request_id.1.clone());
        for (name, value) in auth {
            h.insert(name.clone(), value.clone());
        }
        if let Some(tp) = traceparent {
            h.insert(
                HeaderName::from_static(strata_api::trace::TRACEPARENT),
                tp.clone(),
            );
        }
        match self.http.request(req).await {
            Ok(resp) => Ok(resp.map(|b| b.map_err(BodyError::from).boxed_unsync())),
            Err(e) if is_timeout(&e) => Err(SendError::Timeout),
            Err(e) if is_tls(&e) => Err(SendError::Tls(error_chain(&e))),
            Err(e) => Err(SendError::Connect(error_chain(&e))),
        }
    }
}

/// An error with its causes, `: `-joined (the TLS reason sits deep in hyper's chain).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        let s = err.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = err.source();
    }
    out
}

/// True when an error's cause chain holds an I/O timeout (the connect timeout).
fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

/// True when an error's cause chain holds a TLS error: rustls's, carried by the handshake
/// in an I/O error, itself wrapped in another by the connector (an I/O error's `source`
/// skips what it wraps, so each is opened with `get_ref`).
fn is_tls(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let mut inner: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(i) = inner {
            if i.downcast_ref::<rustls::Error>().is_some() {
                return true;
            }
            inner = i
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .map(|b| b as &(dyn std::error::Error + 'static));
        }
        cur = err.source();
    }
    false
}

/// The `Authorization` value for an upstream key; `None` when the key cannot be sent
/// in a header (control characters).
pub fn bearer(key: &str) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_str(&format!("Bearer {key}")).ok()?;
    v.set_sensitive(true);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_refuses_header_breaking_keys() {
        assert_eq!(
            bearer("sk-1").map(|v| v.to_str().unwrap_or_default().to_string()),
            Some("Bearer sk-1".to_string())
        );
        assert!(bearer("sk\n1").is_none());
    }

    /// An error wrapping an I/O error, as the client's connect errors do.
    #[derive(Debug)]
    struct Wrap(std::io::Error);

    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("client error")
        }
    }

    impl std::error::Error for Wrap {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn tls_errors_are_told_apart() {
        let cert = rustls::Error::InvalidCertificate(rustls::CertificateError::Expired);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, cert);
        // The connector wraps the handshake's I/O error in another.
        assert!(is_tls(&Wrap(std::io::Error::other(io))));
        assert!(!is_tls(&Wrap(std::io::Error::other("refused"))));
    }

    #[test]
    fn timeout_is_found_in_the_cause_chain() {
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timeout");
        assert!(is_timeout(&Wrap(timed_out)));
        assert!(!is_timeout(&Wrap(std::io::Error::other("refused"))));
    }
}
