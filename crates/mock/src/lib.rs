//! A fast fake OpenAI-compatible engine.
//!
//! `strata-mock` answers the client API (PROTOCOLS §1) with fixed text and exports the
//! metric names of a chosen engine kind (PROTOCOLS §2), without loading a model. It exists
//! for two jobs:
//!
//! - **tests** of the router, gateway, controller and load generator, which need replicas
//!   that can be told to fail in specific ways ([`Fault`]) and to report chosen load
//!   ([`MockEngine::set_gauges`]);
//! - **overhead benchmarks** (`strata engine --mock`), where the backend must never be the
//!   bottleneck so that what is measured is the proxy in front of it.
//!
//! Responses are deterministic: completion `k` of a request is the word `" tok"` repeated
//! `output_tokens` times (capped by `max_tokens` / `max_completion_tokens`), one word per
//! streamed chunk, with the configured time to first token and inter-token gap. Prompt
//! token counts are whitespace-separated words (or the length of a token-id prompt), so that
//! a caller's accounting can be checked against what it sent.
//!
//! Prefill/decode disaggregation (PROTOCOLS §11): a request whose `kv_transfer_params` say
//! `do_remote_decode: true` is answered (not streamed) with top-level `kv_transfer_params`
//! as a vLLM prefill engine answers (`do_remote_prefill: true`, this replica as
//! `remote_engine_id`, its address as `remote_host`/`remote_port`, one block id per
//! `block_size` prompt tokens), unless [`MockConfig::kv_transfer`] is off. Every completion
//! request is recorded ([`MockEngine::received`], `GET /mock/received`) with what a proxy
//! sent: its `kv_transfer_params`, token limits, `stream` and `x-request-id`.
//!
//! A mock running in a child process (a test that needs real processes, such as the
//! controller's local driver) takes its load from a file instead
//! ([`MockConfig::gauges_file`]), so the test can change it from outside.
//!
//! [`MockEngine::shutdown`] is abrupt like a killed process: the listener closes and every
//! open connection, streams included, is cut.

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod complete;
mod thread_server;
pub use thread_server::serve_on_thread;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use strata_api::error::ApiError;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use strata_api::model_server::BlockSizeMetric;
/// Which engine's metric names `/metrics` uses: the shared definition.
pub use strata_api::model_server::EngineKind;

/// A way for the mock to misbehave, set at run time with [`MockEngine::set_fault`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    /// Serve normally.
    #[default]
    None,
    /// Answer every completion request with this HTTP status and an OpenAI-shaped error.
    Status(u16),
    /// Accept completion requests and never answer them (until the client goes away).
    Hang,
    /// `/metrics` never answers.
    HangMetrics,
    /// `/metrics` answers 200 with bytes that are not the Prometheus text format.
    GarbageMetrics,
    /// `/metrics` is not served at all (404), like a plain OpenAI-compatible proxy, a hosted
    /// API, or llama.cpp's server without `--metrics`.
    NoMetrics,
    /// `/health` answers 503 (the replica is up but not ready).
    NotReady,
    /// Streamed completions send this many content chunks, then the connection is cut
    /// (no finish chunk, no `[DONE]`); non-streamed completions are cut before any byte.
    CloseMidStream { after_chunks: usize },
}

/// How a mock engine behaves.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// The model name it serves (`/v1/models` and the `model` check).
    pub model: String,
    pub kind: EngineKind,
    /// Tokens per completion when the request does not ask for fewer.
    pub output_tokens: usize,
    /// Delay before the first token.
    pub ttft: Duration,
    /// Delay between tokens.
    pub itl: Duration,
    /// Name reported in `x-mock-replica` and response ids (default: the bound address).
    pub replica: Option<String>,
    /// Reported KV block size (`cache_config_info`).
    pub block_size: u32,
    /// Reported KV block count (`cache_config_info`).
    pub num_blocks: u32,
    /// The text of each generated token (default `" tok"`).
    pub token_text: String,
    /// Streamed answers are written one byte per body chunk, so every SSE event (and the
    /// `[DONE]` terminator) is split across network chunks.
    pub split_stream_bytes: bool,
    /// Answer phase 1 of a disaggregated request (`kv_transfer_params.do_remote_decode`)
    /// with `kv_transfer_params`, as a prefill engine does; off: answer it as any request
    /// (an engine that does not speak the protocol).
    pub kv_transfer: bool,
    /// `/metrics` reads its gauges from this JSON file on every request (`{"waiting": 2,
    /// "running": 1, "kv_usage": 0.1}`; a missing key, or an unreadable file, is 0)
    /// instead of taking [`MockEngine::set_gauges`]: the file is how a test sets the load
    /// of a mock in another process. Read per request, so a change is seen by the next
    /// scrape, never a poll interval later.
    pub gauges_file: Option<PathBuf>,
}

/// Most requests [`MockEngine::received`] keeps (the oldest go first).
pub const MAX_RECEIVED: usize = 1024;

/// What one completion request carried, as the mock received it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Received {
    /// `chat` or `completions`.
    pub api: String,
    pub request_id: Option<String>,
    /// Prompt tokens as the mock counts them (words).
    pub prompt_tokens: u64,
    pub kv_transfer_params: Option<Value>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub stream: bool,
    pub stream_options: bool,
    /// The `x-prefiller-host-port` header (llm-d's prefill engine for a decoder).
    pub prefiller: Option<String>,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            model: "mock".to_string(),
            kind: EngineKind::Vllm,
            output_tokens: 16,
            ttft: Duration::ZERO,
            itl: Duration::ZERO,
            replica: None,
            block_size: 16,
            num_blocks: 1024,
            token_text: " tok".to_string(),
            split_stream_bytes: false,
            kv_transfer: true,
            gauges_file: None,
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Gauges {
    waiting: u64,
    running: u64,
    kv_usage: f64,
}

impl Gauges {
    /// The gauges in a [`MockConfig::gauges_file`]; zeros where it cannot be read.
    async fn read(path: &Path) -> Gauges {
        let Ok(text) = tokio::fs::read_to_string(path).await else {
            return Gauges::default();
        };
        let v: Value = serde_json::from_str(&text).unwrap_or_default();
        let number = |key: &str| v[key].as_f64().filter(|x| x.is_finite() && *x >= 0.0);
        Gauges {
            // Counts written as `2.0` are still counts.
            waiting: number("waiting").map_or(0, |x| x as u64),
            running: number("running").map_or(0, |x| x as u64),
            kv_usage: number("kv_usage").unwrap_or(0.0),
        }
    }
}

struct Shared {
    config: MockConfig,
    replica: String,
    /// Where it listens, for the `remote_host`/`remote_port` of a phase-1 answer.
    addr: Option<SocketAddr>,
    received: Mutex<std::collections::VecDeque<Received>>,
    fault: Mutex<Fault>,
    gauges: Mutex<Gauges>,
    requests: AtomicU64,
    in_flight: AtomicU64,
    next_id: AtomicU64,
}

impl Shared {
    fn fault(&self) -> Fault {
        *self.fault.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn gauges(&self) -> Gauges {
        *self.gauges.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn record(&self, r: Received) {
        let mut q = self.received.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= MAX_RECEIVED {
            q.pop_front();
        }
        q.push_back(r);
    }
    fn received(&self) -> Vec<Received> {
        self.received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

/// A running mock engine. Dropping it stops it like [`MockEngine::shutdown`].
pub struct MockEngine {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for MockEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockEngine")
            .field("addr", &self.addr)
            .field("replica", &self.shared.replica)
            .finish()
    }
}

impl MockEngine {
    /// Starts a mock on `127.0.0.1` at an ephemeral port.
    pub async fn spawn(config: MockConfig) -> std::io::Result<MockEngine> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        MockEngine::serve(config, listener)
    }

    /// Starts a mock on an already bound listener.
    pub fn serve(config: MockConfig, listener: TcpListener) -> std::io::Result<MockEngine> {
        let addr = listener.local_addr()?;
        let replica = config.replica.clone().unwrap_or_else(|| addr.to_string());
        let shared = Arc::new(Shared {
            config,
            replica,
            addr: Some(addr),
            received: Mutex::default(),
            fault: Mutex::new(Fault::None),
            gauges: Mutex::new(Gauges::default()),
            requests: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
        });
        let (stop, stopped) = watch::channel(false);
        let app = router(shared.clone());
        let task = tokio::spawn(accept_loop(listener, app, stopped));
        Ok(MockEngine {
            addr,
            shared,
            stop,
            task: Some(task),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The replica name in `x-mock-replica` and response ids.
    pub fn replica(&self) -> &str {
        &self.shared.replica
    }

    pub fn set_fault(&self, fault: Fault) {
        *self.shared.fault.lock().unwrap_or_else(|e| e.into_inner()) = fault;
    }

    /// What `/metrics` reports: queued requests, running requests (added to the requests
    /// the mock is actually serving) and KV-cache use in 0..1.
    pub fn set_gauges(&self, waiting: u64, running: u64, kv_usage: f64) {
        *self.shared.gauges.lock().unwrap_or_else(|e| e.into_inner()) = Gauges {
            waiting,
            running,
            kv_usage,
        };
    }

    /// Completion requests received so far (chat and text, including failed ones).
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// The completion requests received so far (at most [`MAX_RECEIVED`], oldest first).
    pub fn received(&self) -> Vec<Received> {
        self.shared.received()
    }

    /// Completion requests being answered right now.
    pub fn in_flight(&self) -> u64 {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Stops serving at once: the port refuses connections and open ones are cut.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for MockEngine {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn accept_loop(listener: TcpListener, app: Router, mut stopped: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let service = hyper_util::service::TowerToHyperService::new(app.clone());
                connections.spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.abort_all();
    while connections.join_next().await.is_some() {}
}

/// The mock's routes over a fresh state, for serving it on a listener of one's own
/// (`strata engine --mock`). Faults and gauges stay at their defaults.
pub fn app(config: MockConfig, replica: String) -> Router {
    router(Arc::new(Shared {
        config,
        addr: replica.parse().ok(),
        replica,
        received: Mutex::default(),
        fault: Mutex::new(Fault::None),
        gauges: Mutex::new(Gauges::default()),
        requests: AtomicU64::new(0),
        in_flight: AtomicU64::new(0),
        next_id: AtomicU64::new(0),
    }))
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(complete::chat))
        .route("/v1/completions", post(complete::completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/mock/received", get(received))
        .fallback(|| async { error(ApiError::not_found("unknown route")) })
        .with_state(shared)
}

fn error(err: ApiError) -> Response {
    let status = StatusCode::from_u16(err.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        err.to_json_string(),
    )
        .into_response()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": s.config.model, "object": "model", "created": unix_now(), "owned_by": "strata-mock"}]
    }))
    .into_response()
}

async fn received(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(s.received()).into_response()
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    if s.fault() == Fault::NotReady {
        return error(ApiError::unavailable("not ready"));
    }
    StatusCode::OK.into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    match s.fault() {
        Fault::HangMetrics => return std::future::pending::<Response>().await,
        Fault::GarbageMetrics => {
            return (
                StatusCode::OK,
                "\u{0}{{{ this is not # the prometheus format ]]]\n",
            )
                .into_response()
        }
        Fault::NoMetrics => return StatusCode::NOT_FOUND.into_response(),
        _ => {}
    }
    let g = match &s.config.gauges_file {
        Some(path) => Gauges::read(path).await,
        None => s.gauges(),
    };
    let running = g.running + s.in_flight.load(Ordering::SeqCst);
    let text = render_metrics(&s.config, g.waiting, running, g.kv_usage);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// `/metrics` text for `kind` with these gauge values, under the names that kind exports
/// (`strata_api::model_server`).
pub fn render_metrics(config: &MockConfig, waiting: u64, running: u64, kv_usage: f64) -> String {
    use std::fmt::Write;
    let names = config.kind.metric_names();
    // vLLM-style servers label every series with the model; llama.cpp and trtllm-serve don't.
    let labels = match config.kind {
        EngineKind::Vllm | EngineKind::Strata => {
            format!("{{model_name=\"{}\",engine=\"0\"}}", config.model)
        }
        EngineKind::Sglang => format!("{{model_name=\"{}\"}}", config.model),
        EngineKind::Trtllm | EngineKind::Llamacpp => String::new(),
    };
    let mut out = String::new();
    let mut gauge = |name: &str, labels: &str, value: &dyn std::fmt::Display| {
        // Writing into a String cannot fail.
        let _ = write!(out, "# TYPE {name} gauge\n{name}{labels} {value}\n");
    };
    gauge(names.waiting, &labels, &waiting);
    gauge(names.running, &labels, &running);
    if let Some(kv) = names.kv_use.first() {
        gauge(kv, &labels, &kv_usage);
    }
    match names.block_size {
        Some(BlockSizeMetric::Label { metric, label }) => {
            let info = format!(
                "{{{label}=\"{}\",num_gpu_blocks=\"{}\"}}",
                config.block_size, config.num_blocks
            );
            gauge(metric, &info, &1);
        }
        Some(BlockSizeMetric::Value(metric)) => gauge(metric, "", &config.block_size),
        None => {}
    }
    out
}
