//! The layer in front of the router's proxy on `strata up`'s port. Three jobs:
//!
//! - **Hold at zero, per pool.** A request with a body (a `POST`, on any path the router
//!   forwards) whose `model` belongs to a pool ([`PoolSet`]) with no ready replica waits
//!   (counted in that pool's `held`, the signal its autoscaler reads for activation) until
//!   one is, or until `hold_timeout`; then it goes on to the router, or, if the pool is
//!   still cold, gets a 503 with `Retry-After`. So a request sent to a pool scaled to zero
//!   waits for the cold start and succeeds. A `model` no pool serves is left to the router
//!   (which may know an adapter loaded at run time), or answered 404 when no replica at all
//!   is ready. The model is read by the router's own intake (`strata_router::intake`):
//!   the same lean view, whatever the API, and nothing else in the body is judged here.
//! - **`/v1/models` over every pool**: what the replicas list, plus every configured model
//!   and adapter they did not (a pool scaled to zero lists nothing itself).
//! - **Per-version step statistics** for rollouts ([`VersionStatsBook`]). The router names
//!   the replica that served each answer (`x-gateway-destination-endpoint-served`); the
//!   replica's version is its group ([`GroupMap`]). For each version it counts requests
//!   and errors, and records TTFT (time to the first body chunk of a stream; the whole
//!   answer for a non-streamed one) and ITL (gaps between stream chunks) as seen here, at
//!   the front, so both versions are measured the same way whatever engine runs them. A
//!   stream that ends without `[DONE]` is an error of its version; a 5xx that names no
//!   replica (every attempt failed) cannot be attributed and is counted apart.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use strata_api::error::ApiError;
use strata_api::http::error_response;
use strata_api::StreamWatch;
use strata_controller::rollout::VersionStats;
use strata_router::headers::{REQUEST_ID, SERVED_BY};
use strata_router::intake::{self, ModelField};
use strata_router::Router;

use crate::fleet::GroupMap;
use crate::pools::{PoolRoute, PoolSet};

/// Latency samples kept per version per step (beyond this, new samples are dropped).
pub const MAX_SAMPLES: usize = 50_000;

#[derive(Debug, Default, Clone)]
struct Book {
    requests: u64,
    errors: u64,
    ttft: Vec<f64>,
    itl: Vec<f64>,
}

/// What each version served since the last [`VersionStatsBook::reset`].
#[derive(Debug, Default)]
pub struct VersionStatsBook {
    books: Mutex<HashMap<String, Book>>,
    unattributed_errors: AtomicU64,
}

/// The `q` quantile of unsorted samples: the one sample-percentile definition
/// (`strata_api::stats`, numpy's "linear"), the same as `strata bench` reports.
pub use strata_api::stats::quantile;

impl VersionStatsBook {
    pub fn reset(&self) {
        self.books.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    pub fn stats(&self, version: &str) -> VersionStats {
        let books = self.books.lock().unwrap_or_else(|e| e.into_inner());
        match books.get(version) {
            Some(b) => VersionStats {
                requests: b.requests,
                errors: b.errors,
                ttft_p90_secs: quantile(&b.ttft, 0.9),
                itl_p90_secs: quantile(&b.itl, 0.9),
            },
            None => VersionStats::default(),
        }
    }

    pub fn unattributed_errors(&self) -> u64 {
        self.unattributed_errors.load(Ordering::Relaxed)
    }

    /// One finished request of `version`.
    pub fn record(&self, version: &str, ok: bool, ttft: Option<f64>, itl: &[f64]) {
        let mut books = self.books.lock().unwrap_or_else(|e| e.into_inner());
        let b = books.entry(version.to_string()).or_default();
        b.requests += 1;
        if !ok {
            b.errors += 1;
        }
        if let Some(t) = ttft {
            if b.ttft.len() < MAX_SAMPLES {
                b.ttft.push(t);
            }
        }
        let room = MAX_SAMPLES.saturating_sub(b.itl.len());
        b.itl.extend(itl.iter().take(room));
    }

    fn unattributed(&self) {
        self.unattributed_errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// The state of the front layer.
#[derive(Clone)]
pub struct Front {
    pub router: Router,
    pub pools: Arc<PoolSet>,
    pub hold_timeout: Duration,
    pub groups: GroupMap,
    pub book: Arc<VersionStatsBook>,
}

struct Held(Arc<AtomicU32>);

impl Held {
    fn new(c: &Arc<AtomicU32>) -> Held {
        c.fetch_add(1, Ordering::AcqRel);
        Held(c.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Records one streamed request when its body ends (or the client goes away).
struct StreamRecord {
    book: Arc<VersionStatsBook>,
    version: String,
    start: Instant,
    last: Option<Instant>,
    ttft: Option<f64>,
    itl: Vec<f64>,
    watch: StreamWatch,
    finished: bool,
}

impl StreamRecord {
    fn chunk(&mut self, bytes: &[u8]) {
        let now = Instant::now();
        match self.last {
            None => self.ttft = Some(now.duration_since(self.start).as_secs_f64()),
            Some(prev) => {
                if self.itl.len() < 4096 {
                    self.itl.push(now.duration_since(prev).as_secs_f64());
                }
            }
        }
        self.last = Some(now);
        self.watch.feed(bytes);
    }
}

impl Drop for StreamRecord {
    fn drop(&mut self) {
        // A client that leaves early is not the replica's fault: only a stream that ran to
        // its end without `[DONE]` counts as an error.
        if self.finished {
            self.watch.finish();
        }
        if self.finished || self.watch.saw_done() {
            let ok = self.watch.ended_well();
            self.book
                .record(&self.version, ok, self.ttft, &std::mem::take(&mut self.itl));
        }
    }
}

/// Whether a request carries a body the router routes by (its `model`).
fn has_body(req: &Request) -> bool {
    matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH)
}

/// What a request body says about its model.
#[derive(Debug, PartialEq)]
enum Asked {
    Model(String),
    /// JSON without a `model` string.
    Missing,
    /// Not a JSON object: the router (or the replica) says what is wrong with it.
    Unreadable,
}

fn requested_model(content_type: Option<&str>, body: &[u8]) -> Asked {
    match intake::probe_model(content_type, body) {
        Some(ModelField::Named(m)) => Asked::Model(m),
        Some(_) => Asked::Missing,
        None => Asked::Unreadable,
    }
}

/// Waits (counted in the pool's `held`) until the pool has a ready replica or `timeout`
/// has passed; whether it has one.
async fn hold_for(router: &Router, pool: &PoolRoute, timeout: Duration) -> bool {
    if pool.ready(router) {
        return true;
    }
    let _held = Held::new(&pool.held);
    let deadline = tokio::time::Instant::now() + timeout;
    tracing::debug!(pool = %pool.name, "no replica ready: holding a request for the cold start");
    loop {
        if pool.ready(router) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GET /v1/models`: the router's union of what the replicas list, with every configured
/// model and adapter added.
async fn models(front: &Front, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let rid = resp.headers().get(REQUEST_ID).cloned();
    let listed = if resp.status().is_success() {
        match axum::body::to_bytes(resp.into_body(), 16 << 20).await {
            Ok(bytes) => serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("data").and_then(|d| d.as_array()).cloned())
                .unwrap_or_default(),
            Err(_) => Vec::new(),
        }
    } else {
        Vec::new()
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = front.pools.models_list(listed, created);
    let mut out = Response::new(Body::from(body.to_string()));
    out.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(rid) = rid {
        out.headers_mut().insert(REQUEST_ID, rid);
    }
    out
}

/// The middleware (see the module docs).
pub async fn layer(State(front): State<Front>, req: Request, next: Next) -> Response {
    if req.method() == Method::GET && req.uri().path() == "/v1/models" {
        return models(&front, req, next).await;
    }
    if !has_body(&req) {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let max = front.router.config().max_body_bytes;
    let Ok(bytes) = axum::body::to_bytes(body, max).await else {
        let e = ApiError::too_large(format!(
            "The request body exceeds the limit of {max} bytes."
        ));
        return error_response(&e, None);
    };
    if let Err(refused) = admit(&front, &parts, &bytes).await {
        return refused;
    }
    let req = Request::from_parts(parts, Body::from(bytes));
    let start = Instant::now();
    let resp = next.run(req).await;
    measure(&front, resp, start)
}

/// Lets a request on once its pool can serve it: a cold pool holds it until a replica is
/// ready (a 503 with `Retry-After` when none is in time). A `model` no pool serves is
/// left to the router, or answered 404 when no replica at all is ready.
async fn admit(front: &Front, parts: &Parts, bytes: &[u8]) -> Result<(), Response> {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let asked = requested_model(content_type, bytes);
    if let Some(pool) = pool_for(front, &asked, parts.uri.path()).map_err(|refusal| *refusal)? {
        let ready = hold_for(&front.router, pool, front.hold_timeout).await;
        if !ready {
            let e = ApiError::unavailable(format!(
                "No replica of `{}` is ready yet (waited {:.0} s for one to start); retry later.",
                pool.name,
                front.hold_timeout.as_secs_f64()
            ));
            return Err(error_response(&e, Some(pool.retry_after_secs)));
        }
    } else if let Asked::Model(m) = &asked {
        if !front.router.any_ready() {
            return Err(error_response(&ApiError::model_not_found(m), None));
        }
    }
    Ok(())
}

/// The pool a request is for, by its `model`; none when no pool serves it or the API
/// needs no model. A body without a `model` is refused when the API needs one and more
/// than one pool could be meant.
fn pool_for<'a>(
    front: &'a Front,
    asked: &Asked,
    path: &str,
) -> Result<Option<&'a PoolRoute>, Box<Response>> {
    match asked {
        Asked::Model(m) => Ok(front.pools.find(m)),
        // A body without a usable `model`: with one pool it can only be meant for it (the
        // replica answers what is wrong with it).
        _ if front.pools.0.len() == 1 => Ok(front.pools.0.first()),
        // An API that needs no model (tokenizing, an operation on a replica): the router
        // sends it to any ready replica.
        Asked::Missing if !intake::route(path).api.needs_model() => Ok(None),
        Asked::Missing => {
            let e = ApiError::invalid(
                "model",
                format!(
                    "`model` is required: this server serves {}.",
                    front.pools.names().join(", ")
                ),
            );
            Err(Box::new(error_response(&e, None)))
        }
        Asked::Unreadable => Ok(None),
    }
}

/// Counts an answer for the version whose replica served it ([`VersionStatsBook`]): a 5xx
/// as an error (apart when it names no replica), a 4xx not at all (the client's doing),
/// a whole answer with its time as TTFT, and a stream as it passes ([`watch_stream`]).
fn measure(front: &Front, resp: Response, start: Instant) -> Response {
    let status = resp.status();
    let version = resp
        .headers()
        .get(SERVED_BY)
        .and_then(|v| v.to_str().ok())
        .and_then(|e| front.groups.group_of(e));
    let Some(version) = version else {
        if status.is_server_error() {
            front.book.unattributed();
        }
        return resp;
    };
    if status.is_server_error() {
        front.book.record(&version, false, None, &[]);
        return resp;
    }
    if !status.is_success() {
        // 4xx: the client's doing, not the version's.
        return resp;
    }
    let sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !sse {
        let ttft = start.elapsed().as_secs_f64();
        front.book.record(&version, true, Some(ttft), &[]);
        return resp;
    }
    watch_stream(front.book.clone(), version, start, resp)
}

/// A streamed answer passed on chunk by chunk, each timed as it passes ([`StreamRecord`]);
/// the request is recorded for `version` when the stream ends.
fn watch_stream(
    book: Arc<VersionStatsBook>,
    version: String,
    start: Instant,
    resp: Response,
) -> Response {
    let (parts, body) = resp.into_parts();
    let rec = StreamRecord {
        book,
        version,
        start,
        last: None,
        ttft: None,
        itl: Vec::new(),
        watch: StreamWatch::new(),
        finished: false,
    };
    let stream = futures_util::stream::unfold(
        (body.into_data_stream(), Some(rec)),
        |(mut data, rec)| async move {
            let mut rec = rec?;
            match data.next().await {
                Some(Ok(chunk)) => {
                    rec.chunk(&chunk);
                    Some((Ok::<_, axum::Error>(chunk), (data, Some(rec))))
                }
                Some(Err(e)) => {
                    rec.finished = true;
                    drop(rec);
                    Some((Err(e), (data, None)))
                }
                None => {
                    rec.finished = true;
                    None
                }
            }
        },
    );
    Response::from_parts(parts, Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_requested_model_is_read_from_the_body() {
        let asked = |b: &str| requested_model(Some("application/json"), b.as_bytes());
        assert_eq!(
            asked(r#"{"model":"m","input":"x"}"#),
            Asked::Model("m".into())
        );
        assert_eq!(asked(r#"{"input":"x"}"#), Asked::Missing);
        assert_eq!(asked(r#"{"model":7}"#), Asked::Missing);
        assert_eq!(asked(r#"{"model":null}"#), Asked::Missing);
        assert_eq!(asked("{not json"), Asked::Unreadable);
        assert_eq!(asked("[1, 2]"), Asked::Unreadable);
    }

    #[test]
    fn quantiles_and_books() {
        assert_eq!(quantile(&[], 0.9), None);
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        // The same definition `strata bench` reports (numpy's "linear").
        assert!((quantile(&v, 0.9).unwrap() - 9.1).abs() < 1e-9);
        assert_eq!(quantile(&v, 1.0), Some(10.0));
        assert_eq!(quantile(&[3.0], 0.9), Some(3.0));

        let b = VersionStatsBook::default();
        b.record("new", true, Some(0.1), &[0.01, 0.02]);
        b.record("new", false, None, &[]);
        b.record("old", true, Some(0.2), &[]);
        let s = b.stats("new");
        assert_eq!((s.requests, s.errors), (2, 1));
        assert_eq!(s.ttft_p90_secs, Some(0.1));
        assert!((s.itl_p90_secs.unwrap() - 0.019).abs() < 1e-12);
        assert_eq!(b.stats("old").requests, 1);
        assert_eq!(b.stats("ghost"), VersionStats::default());
        b.reset();
        assert_eq!(b.stats("new").requests, 0);
    }

    #[test]
    fn a_stream_counts_once_and_only_when_it_ends() {
        let book = Arc::new(VersionStatsBook::default());
        let rec = |finished, done| {
            let mut r = StreamRecord {
                book: book.clone(),
                version: "v".into(),
                start: Instant::now(),
                last: None,
                ttft: None,
                itl: Vec::new(),
                watch: StreamWatch::new(),
                finished,
            };
            r.chunk(b"data: {}\n\n");
            r.chunk(if done {
                b"data: [DONE]\n\n"
            } else {
                b"data: {}\n\n"
            });
            r
        };
        drop(rec(true, true));
        drop(rec(true, false)); // ended without [DONE]: an error
                                // A terminator split over chunks at every byte still counts as finished; content
                                // that merely quotes `[DONE]` does not.
        for (stream, ok) in [
            (&b"data: {}\n\ndata: [DONE]\n\n"[..], true),
            (&b"data: {\"text\":\"[DONE]\"}\n\n"[..], false),
        ] {
            let before = book.stats("bytes");
            let mut r = StreamRecord {
                book: book.clone(),
                version: "bytes".into(),
                start: Instant::now(),
                last: None,
                ttft: None,
                itl: Vec::new(),
                watch: StreamWatch::new(),
                finished: true,
            };
            for b in stream {
                r.chunk(std::slice::from_ref(b));
            }
            drop(r);
            let after = book.stats("bytes");
            assert_eq!(after.requests, before.requests + 1);
            assert_eq!(after.errors - before.errors, u64::from(!ok), "{stream:?}");
        }
        drop(rec(false, false)); // the client left: not counted
        let s = book.stats("v");
        assert_eq!((s.requests, s.errors), (2, 1));
        assert!(s.ttft_p90_secs.is_some() && s.itl_p90_secs.is_some());
    }
}
