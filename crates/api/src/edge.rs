//! The HTTP/1.1 server every Strata front runs (feature `http`): the connection hygiene a
//! server facing untrusted clients needs, done once.
//!
//! `axum::serve` sets no timer, so a connection that sends its head one byte a second, sends
//! half a chunked body, or sends nothing at all stays open for as long as the client likes,
//! and it accepts connections until the process runs out of file descriptors, at which
//! point nobody is answered and nothing says why. [`serve`] bounds each of those:
//!
//! 1. **Connections**: at most [`EdgeLimits::max_connections`] at once (never more than
//!    three quarters of the process's descriptor limit). One more is answered with an
//!    OpenAI-shaped 503 and `Retry-After`, then closed; it never waits in a backlog.
//! 2. **Request heads**: a head must arrive within [`EdgeLimits::header_timeout`], counted
//!    from the moment the connection is ready for a request (so the same bound closes a
//!    keep-alive connection idle that long), and be at most
//!    [`EdgeLimits::max_header_bytes`]: a larger one is a 431 in OpenAI's shape.
//! 3. **Request bodies**: a body must keep arriving: [`EdgeLimits::body_timeout`] of grace,
//!    then at least [`EdgeLimits::body_min_bytes_per_sec`]. A body that stalls fails the
//!    handler's read (the handler answers 400 and the connection is closed), so half a
//!    chunked body cannot pin a handler.
//! 4. **Descriptors**: an `accept` that fails because the process is out of descriptors is
//!    logged and retried after a pause, never a busy loop and never the end of the server.
//! 5. **TLS** (with [`EdgeLimits::tls`], flags `--tls-cert`, `--tls-key`,
//!    `--tls-client-ca`): every connection is HTTPS. The handshake happens inside the
//!    connection's slot and must finish within the head timeout; the certificate follows
//!    its file ([`crate::tls::ServerTls`]); with a client CA, a client without a
//!    certificate that CA signed is refused at the handshake (mutual TLS).
//!
//! Shutdown stops accepting, asks every connection to finish its request in flight, and
//! returns once they have (the caller bounds how long it waits, as with `axum::serve`).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::error::ApiError;
use crate::http::DEFAULT_RETRY_AFTER_SECS;
use crate::tls::{ServerTls, TlsFiles};

/// The bounds [`serve`] enforces. `Default` holds a thousand slow clients without refusing a
/// legitimate request, on a process with the usual 1,024-descriptor soft limit raised to its
/// hard limit (which [`serve`] does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeLimits {
    /// Most connections open at once; more are refused with a 503.
    pub max_connections: usize,
    /// Time to receive a request head, from when the connection is ready for one.
    pub header_timeout: Duration,
    /// Largest request head (request line and headers) in bytes; larger is a 431.
    pub max_header_bytes: usize,
    /// Grace for a request body before the minimum rate applies.
    pub body_timeout: Duration,
    /// Slowest sustained body upload accepted after the grace, in bytes a second.
    pub body_min_bytes_per_sec: u64,
    /// Serve HTTPS with these files; `None` serves plain HTTP.
    pub tls: Option<TlsFiles>,
}

impl Default for EdgeLimits {
    fn default() -> Self {
        EdgeLimits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            body_timeout: Duration::from_secs(30),
            body_min_bytes_per_sec: 8 * 1024,
            tls: None,
        }
    }
}

/// The limits as flags, for each role's `clap::Args` (flattened).
#[derive(Debug, Clone, clap::Args)]
pub struct EdgeArgs {
    /// Most HTTP connections open at once; one more is refused with a 503 (the process's
    /// descriptor limit also bounds it, at three quarters).
    #[arg(long, default_value_t = 4096)]
    pub http_max_connections: usize,
    /// Seconds to receive a request's head, counted from when the connection is ready for
    /// it (so it also closes keep-alive connections idle that long).
    #[arg(long, default_value_t = 30)]
    pub http_header_timeout_secs: u64,
    /// Largest request head in bytes (request line and headers); larger gets a 431.
    #[arg(long, default_value_t = 64 * 1024)]
    pub http_max_header_bytes: usize,
    /// Seconds of grace to send a request body, after which it must keep arriving at
    /// `--http-body-min-rate` bytes a second or the request fails.
    #[arg(long, default_value_t = 30)]
    pub http_body_timeout_secs: u64,
    /// Slowest sustained request-body upload accepted after the grace, in bytes a second.
    #[arg(long, default_value_t = 8 * 1024)]
    pub http_body_min_rate: u64,
    /// Serve HTTPS with this certificate chain (PEM, the server's certificate first).
    /// The file is watched: a renewed certificate is used from the next handshake on.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key of `--tls-cert` (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: clients must present a certificate signed by a CA in this PEM file.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl EdgeArgs {
    /// The limits these flags ask for.
    pub fn limits(&self) -> EdgeLimits {
        EdgeLimits {
            max_connections: self.http_max_connections.max(1),
            header_timeout: Duration::from_secs(self.http_header_timeout_secs.max(1)),
            max_header_bytes: self.http_max_header_bytes.max(1024),
            body_timeout: Duration::from_secs(self.http_body_timeout_secs.max(1)),
            body_min_bytes_per_sec: self.http_body_min_rate.max(1),
            tls: self.tls_files(),
        }
    }

    /// The certificate files these flags name, if any.
    pub fn tls_files(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            client_ca: self.tls_client_ca.clone(),
        })
    }
}

impl Default for EdgeArgs {
    fn default() -> Self {
        let d = EdgeLimits::default();
        EdgeArgs {
            http_max_connections: d.max_connections,
            http_header_timeout_secs: d.header_timeout.as_secs(),
            http_max_header_bytes: d.max_header_bytes,
            http_body_timeout_secs: d.body_timeout.as_secs(),
            http_body_min_rate: d.body_min_bytes_per_sec,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
        }
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown` resolves, then drains: no new
/// connection, every open one finishes its request in flight, and this returns when all
/// have closed. With [`EdgeLimits::tls`], certificate files that do not load are an
/// `InvalidInput` error before anything is served.
pub async fn serve<F>(
    listener: TcpListener,
    app: Router,
    limits: EdgeLimits,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let tls = match &limits.tls {
        Some(files) => Some(Arc::new(ServerTls::load(files.clone(), &[b"http/1.1"])?)),
        None => None,
    };
    let capacity = limits.max_connections.min(descriptor_budget()).max(1);
    let slots = Arc::new(Semaphore::new(capacity));
    // Refusals are answered by their own small pool, so a flood past the cap cannot turn
    // into unbounded tasks; past it, a connection is closed without a word.
    let refusals = Arc::new(Semaphore::new(64));
    let app = app.layer(axum::middleware::from_fn_with_state(
        Arc::new(limits.clone()),
        check_head_size,
    ));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => accepted,
            // Reap finished connections as they end, so the set stays as small as the load.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(conn) => conn,
            Err(e) => {
                accept_failed(&e).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if let Ok(permit) = refusals.clone().try_acquire_owned() {
                let tls = tls.clone();
                tokio::spawn(async move {
                    refuse(stream, tls.as_deref(), capacity).await;
                    drop(permit);
                });
            }
            continue;
        };
        let (app, limits, stop, tls) = (app.clone(), limits.clone(), stop_rx.clone(), tls.clone());
        conns.spawn(async move {
            let _ = stream.set_nodelay(true);
            match tls {
                None => serve_connection(stream, peer, app, limits, stop).await,
                Some(tls) => match tls.accept(stream, limits.header_timeout).await {
                    Ok(stream) => serve_connection(stream, peer, app, limits, stop).await,
                    Err(e) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                },
            }
            drop(slot);
        });
    }
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// One connection: hyper's HTTP/1.1 state machine with a timer (so the head timeout is
/// real), each request's body wrapped in [`RateBoundBody`], and a graceful close when the
/// server stops.
async fn serve_connection<S>(
    stream: S,
    peer: SocketAddr,
    app: Router,
    limits: EdgeLimits,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let body_limits = (limits.body_timeout, limits.body_min_bytes_per_sec);
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let app = app.clone();
        async move {
            let mut req: Request =
                req.map(|b| Body::new(RateBoundBody::new(b, body_limits.0, body_limits.1)));
            req.extensions_mut()
                .insert(axum::extract::ConnectInfo(peer));
            app.oneshot(req).await
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // hyper's own bound is the hard stop (a bare 431); the middleware answers in
        // OpenAI's shape below it.
        .max_buf_size((limits.max_header_bytes * 2).max(8192))
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = stop.wait_for(|stopping| *stopping) => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// A 431 in OpenAI's shape for a head over the bound (hyper's buffer, twice the bound, is
/// the hard stop for anything larger).
async fn check_head_size(
    axum::extract::State(limits): axum::extract::State<Arc<EdgeLimits>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let head: usize = req.uri().to_string().len()
        + req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>();
    if head > limits.max_header_bytes {
        let mut e = ApiError::invalid_no_param(format!(
            "The request head is {head} bytes; this server accepts at most {}.",
            limits.max_header_bytes
        ))
        .with_code("request_header_fields_too_large");
        e.status = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE.as_u16();
        let mut resp = e.into_response();
        resp.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        return resp;
    }
    next.run(req).await
}

/// Answers a connection past the cap with a 503 and closes it, within a second (the TLS
/// handshake, when the server speaks TLS, included).
async fn refuse(stream: TcpStream, tls: Option<&ServerTls>, capacity: usize) {
    let started = Instant::now();
    let within = Duration::from_secs(1);
    match tls {
        None => answer_refusal(stream, capacity, within).await,
        Some(tls) => {
            if let Ok(stream) = tls.accept(stream, within).await {
                let left = within.saturating_sub(started.elapsed());
                answer_refusal(stream, capacity, left).await;
            }
        }
    }
}

async fn answer_refusal<S>(mut stream: S, capacity: usize, within: Duration)
where
    S: AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    let body = ApiError::unavailable(format!(
        "This server has {capacity} connections open, its limit; retry shortly."
    ))
    .with_code("too_many_connections")
    .to_json_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: {DEFAULT_RETRY_AFTER_SECS}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(within, async {
        let _ = stream.write_all(answer.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// What to do when `accept` fails: out of descriptors (or memory) is the process's limit,
/// not the client's fault; pause so the loop does not spin, and say so once a second at
/// most. Anything else (a connection reset before it was accepted) is the client's.
async fn accept_failed(e: &io::Error) {
    let out_of_resources = matches!(e.raw_os_error(), Some(code) if code == libc::EMFILE || code == libc::ENFILE)
        || e.kind() == io::ErrorKind::OutOfMemory;
    if out_of_resources {
        static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
        let say = LAST.lock().map(|mut last| {
            let now = std::time::Instant::now();
            let due = last.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1));
            if due {
                *last = Some(now);
            }
            due
        });
        if say.unwrap_or(true) {
            tracing::warn!(error = %e, "out of file descriptors: not accepting for 100 ms");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    } else {
        tracing::debug!(error = %e, "accept failed");
    }
}

/// Three quarters of the descriptor soft limit, after raising it to the hard limit: the rest
/// is for upstream connections, files and the listener itself.
fn descriptor_budget() -> usize {
    #[cfg(unix)]
    {
        if let Some(soft) = raise_descriptor_limit() {
            return usize::try_from(soft / 4 * 3).unwrap_or(usize::MAX).max(1);
        }
    }
    usize::MAX
}

#[cfg(unix)]
fn raise_descriptor_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit write to/read from the struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    Some(lim.rlim_cur)
}

/// A request body that must keep arriving: `grace`, then `min_rate` bytes a second on
/// average since the request started. Past that it yields an error, which fails the
/// handler's read.
struct RateBoundBody<B> {
    inner: B,
    started: Instant,
    grace: Duration,
    min_rate: u64,
    received: u64,
    deadline: Pin<Box<Sleep>>,
}

impl<B> RateBoundBody<B> {
    fn new(inner: B, grace: Duration, min_rate: u64) -> Self {
        let started = Instant::now();
        RateBoundBody {
            inner,
            started,
            grace,
            min_rate,
            received: 0,
            deadline: Box::pin(tokio::time::sleep_until(started + grace)),
        }
    }

    fn allowed_until(&self) -> Instant {
        let extra = Duration::from_secs_f64(self.received as f64 / self.min_rate as f64);
        self.started + self.grace + extra
    }
}

/// The error a stalled body ends with.
#[derive(Debug)]
pub struct BodyTooSlow;

impl std::fmt::Display for BodyTooSlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body did not arrive in time")
    }
}

impl std::error::Error for BodyTooSlow {}

impl<B> HttpBody for RateBoundBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received += data.len() as u64;
                    let until = this.allowed_until();
                    this.deadline.as_mut().reset(until);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTooSlow)))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
