//! The upstream HTTP client: hyper's pooled HTTP/1.1 client (the router's, with
//! keep-alive and `TCP_NODELAY`) for `http://` upstreams, and reqwest with rustls for
//! `https://` ones when the crate is built with the `tls` feature.
//!
//! Requests go to a URI parsed once when the config is loaded, with a prebuilt
//! `Authorization` value, so a try builds no strings. Answers come back as an
//! `http::Response` over a boxed body whatever the client, so the request path has one
//! way to read or stream them.

use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method, Request, Response, Uri};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use strata_router::client::{http_client, HttpClient};

/// Errors of an upstream body (connection cut, malformed chunk).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// An upstream answer's body, whichever client fetched it.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BodyError>;

/// Why a try got no response headers.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Could not connect, or the connection broke before the response headers.
    #[error("upstream unreachable: {0}")]
    Connect(String),
    /// The connect timeout passed.
    #[error("upstream connect timed out")]
    Timeout,
}

/// Both clients, built once per gateway.
#[derive(Clone)]
pub struct UpstreamClient {
    http: HttpClient,
    #[cfg(feature = "tls")]
    tls: reqwest::Client,
}

impl std::fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamClient").finish_non_exhaustive()
    }
}

impl UpstreamClient {
    pub fn new(connect_timeout: Duration) -> Result<UpstreamClient, SendError> {
        Ok(UpstreamClient {
            http: http_client(connect_timeout).map_err(|e| SendError::Connect(e.to_string()))?,
            #[cfg(feature = "tls")]
            tls: reqwest::Client::builder()
                .no_proxy()
                .tcp_nodelay(true)
                .pool_max_idle_per_host(1024)
                .pool_idle_timeout(Duration::from_secs(90))
                .connect_timeout(connect_timeout)
                .build()
                .map_err(|e| SendError::Connect(e.to_string()))?,
        })
    }

    /// POSTs a JSON body, with the W3C `traceparent` when the request is traced. Any
    /// status comes back as a response; only a failure to get response headers is an
    /// error. Bounding the wait is the caller's job.
    pub async fn post_json(
        &self,
        uri: &Uri,
        body: Bytes,
        request_id: (&'static str, &HeaderValue),
        auth: Option<&HeaderValue>,
        traceparent: Option<&HeaderValue>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        #[cfg(feature = "tls")]
        if uri.scheme_str() == Some("https") {
            return self
                .post_tls(uri, body, request_id, auth, traceparent)
                .await;
        }
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        let h = req.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(HeaderName::from_static(request_id.0), request_id.1.clone());
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, a.clone());
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
            Err(e) => Err(SendError::Connect(e.to_string())),
        }
    }

    #[cfg(feature = "tls")]
    async fn post_tls(
        &self,
        uri: &Uri,
        body: Bytes,
        request_id: (&'static str, &HeaderValue),
        auth: Option<&HeaderValue>,
        traceparent: Option<&HeaderValue>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        let mut rb = self
            .tls
            .post(uri.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .header(request_id.0, request_id.1.clone())
            .body(body);
        if let Some(a) = auth {
            rb = rb.header(header::AUTHORIZATION, a.clone());
        }
        if let Some(tp) = traceparent {
            rb = rb.header(strata_api::trace::TRACEPARENT, tp.clone());
        }
        match rb.send().await {
            Ok(resp) => {
                let resp: Response<reqwest::Body> = resp.into();
                Ok(resp.map(|b| b.map_err(BodyError::from).boxed_unsync()))
            }
            Err(e) if e.is_timeout() => Err(SendError::Timeout),
            Err(e) => Err(SendError::Connect(e.to_string())),
        }
    }
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
    fn timeout_is_found_in_the_cause_chain() {
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timeout");
        assert!(is_timeout(&Wrap(timed_out)));
        assert!(!is_timeout(&Wrap(std::io::Error::other("refused"))));
    }
}
