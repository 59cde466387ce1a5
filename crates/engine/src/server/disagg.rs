//! Prefill/decode disaggregation and the shared KV tier, as the engine server sees them
//! (PROTOCOLS §11, i21).
//!
//! A request's `kv_transfer_params` (or the `x-prefiller-host-port` header an endpoint
//! picker adds) is checked at the edge and turned into a [`KvPlan`]; [`prepare`] then does
//! the network part before the request reaches the engine thread: it pulls the prompt's
//! blocks from the prefill engine that holds them, or looks them up in the tier, and hands
//! them to the loop as `imported` blocks. Every network step is bounded, and any failure
//! only means the engine recomputes what it could not fetch: a peer can slow a request
//! down by at most the transfer timeout, never fail or hang it.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use bytes::Bytes;
use strata_api::types::KvTransferParams;
use strata_api::ApiError;

use super::{AppState, KvRole};
use crate::engine::EngineHandle;
use crate::kv::block_pool::HashKey;
use crate::kv::offload;
use crate::kv::transfer::{
    self, BlockData, BlockSource, BlockSpec, BoxFuture, Evictions, TransferClient, TransferError,
};
use crate::metrics::TransferPath;

/// Blocks the engine loop may queue for the offloader before it drops copies.
pub(super) const EVICTED_QUEUE: usize = 256;
/// How long a tier lookup may delay a request: the tier is on this machine, so an answer
/// that takes longer means it is overloaded and recomputing is the better bet.
const TIER_LOOKUP_TIMEOUT: Duration = Duration::from_millis(250);
/// How often the offloader asks the tier which blocks it dropped.
const TIER_POLL: Duration = Duration::from_secs(1);
/// Largest phase-1 answer read from a prefill engine (it is one short completion).
const MAX_PREFILL_ANSWER: usize = 1 << 20;
/// The request header an endpoint picker names the prefill engine in (llm-d's).
pub(super) const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The `kv_transfer_params` extra field naming the pin a decoder releases.
const REMOTE_REQUEST_ID: &str = "remote_request_id";

/// What the server knows about disaggregation and the tier.
pub struct KvState {
    pub role: KvRole,
    /// This engine's id in `remote_engine_id`.
    pub engine_id: String,
    pub transfer_timeout: Duration,
    pub tier: Option<SocketAddr>,
    pub prefix_caching: bool,
    /// `remote_host` and `remote_port`, once the transfer endpoint listens.
    advertised: OnceLock<(String, u16)>,
    /// The loop's evicted-block copies, until the offloader takes them.
    evicted: Mutex<Option<tokio::sync::mpsc::Receiver<BlockData>>>,
}

impl KvState {
    pub(super) fn new(
        opts: &super::EngineOptions,
        evicted: Option<tokio::sync::mpsc::Receiver<BlockData>>,
    ) -> Self {
        let n: u64 = rand::random();
        Self {
            role: opts.kv_role,
            engine_id: format!("strata-{n:016x}"),
            transfer_timeout: opts.kv_transfer_timeout,
            tier: opts.kv_tier.filter(|_| opts.prefix_caching),
            prefix_caching: opts.prefix_caching,
            advertised: OnceLock::new(),
            evicted: Mutex::new(evicted),
        }
    }

    /// Where decoders pull this engine's blocks from; `None` without an endpoint.
    pub fn advertised(&self) -> Option<(String, u16)> {
        self.advertised.get().cloned()
    }
}

/// What a request asked for, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum KvPlan {
    /// Colocated: local prefix hits, then the tier.
    Local,
    /// Prefill for a remote decoder: keep the prompt's blocks under this pin.
    Prefill { pin: String },
    /// The prompt's blocks wait on a prefill engine's transfer endpoint.
    Remote {
        host: String,
        port: u16,
        release: Option<String>,
    },
    /// Run phase 1 against this prefill engine's HTTP endpoint first, then pull.
    Prefiller {
        host: String,
        port: u16,
        request_id: String,
    },
}

/// Checks a request's `kv_transfer_params` and `x-prefiller-host-port` against what this
/// engine can do; what cannot be honoured is a 400 naming the parameter.
pub(super) fn plan(
    state: &AppState,
    params: Option<&KvTransferParams>,
    headers: &HeaderMap,
    stream: bool,
    n: u32,
    job_id: &str,
) -> Result<KvPlan, ApiError> {
    const P: &str = "kv_transfer_params";
    let header_id = super::request_id(headers);
    let Some(p) = params else {
        return prefiller_plan(state, headers, n, header_id);
    };
    if p.do_remote_decode && p.do_remote_prefill {
        return Err(ApiError::invalid(
            P,
            "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill.",
        ));
    }
    if p.do_remote_decode {
        if stream {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode needs `stream: false` (the prefill answer \
                 carries the transfer parameters).",
            ));
        }
        if n > 1 {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode needs `n: 1`.",
            ));
        }
        if state.kv.role == KvRole::Decode {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode: this engine runs with --kv-role decode.",
            ));
        }
        if !state.kv.prefix_caching {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode: this engine runs without prefix caching, \
                 so it has no blocks to hand over.",
            ));
        }
        if state.kv.advertised.get().is_none() {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode: this engine has no KV transfer endpoint \
                 (start it with --kv-transfer-port).",
            ));
        }
        return Ok(KvPlan::Prefill {
            pin: header_id.unwrap_or_else(|| job_id.to_string()),
        });
    }
    if p.do_remote_prefill {
        let (Some(host), Some(port)) = (p.remote_host.as_deref(), p.remote_port) else {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_prefill needs remote_host and remote_port.",
            ));
        };
        check_host_port(host, port).map_err(|m| ApiError::invalid(P, m))?;
        let release = match p.extra.get(REMOTE_REQUEST_ID) {
            None | Some(serde_json::Value::Null) => header_id,
            Some(serde_json::Value::String(s)) if !s.is_empty() && s.len() <= 256 => {
                Some(s.clone())
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    P,
                    "kv_transfer_params.remote_request_id must be a non-empty string of at \
                     most 256 bytes.",
                ))
            }
        };
        return Ok(KvPlan::Remote {
            host: host.to_string(),
            port,
            release,
        });
    }
    Ok(KvPlan::Local)
}

/// The `x-prefiller-host-port` form: the picker chose a prefill engine and left phase 1 to
/// this (decode) engine.
fn prefiller_plan(
    state: &AppState,
    headers: &HeaderMap,
    n: u32,
    header_id: Option<String>,
) -> Result<KvPlan, ApiError> {
    let Some(value) = headers.get(PREFILLER_HEADER) else {
        return Ok(KvPlan::Local);
    };
    let bad = |m: String| ApiError::invalid(PREFILLER_HEADER, m);
    let text = value
        .to_str()
        .map_err(|_| bad(format!("{PREFILLER_HEADER} is not ASCII text.")))?;
    let (host, port) = split_host_port(text.trim()).ok_or_else(|| {
        bad(format!(
            "{PREFILLER_HEADER} must be `host:port`, got `{}`.",
            text.chars().take(80).collect::<String>()
        ))
    })?;
    check_host_port(&host, port).map_err(bad)?;
    // Several choices cannot share one prefill's pin, and an engine without prefix caching
    // cannot take blocks in: serve those colocated, which is always correct.
    if n > 1 || !state.kv.prefix_caching {
        return Ok(KvPlan::Local);
    }
    let request_id = header_id.unwrap_or_else(|| super::random_id("pd"));
    Ok(KvPlan::Prefiller {
        host,
        port,
        request_id,
    })
}

/// `host:port`, with `[v6]:port` for IPv6 literals.
fn split_host_port(s: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest.split_once("]:")?;
        (h, p)
    } else {
        s.rsplit_once(':')?
    };
    let port: u16 = port.parse().ok()?;
    Some((host.to_string(), port))
}

/// A host that is an IP address or a DNS name (RFC 1123 labels), and a port other than 0.
fn check_host_port(host: &str, port: u16) -> Result<(), String> {
    if port == 0 {
        return Err("remote_port must be between 1 and 65535.".into());
    }
    if host.parse::<IpAddr>().is_ok() || is_hostname(host) {
        Ok(())
    } else {
        Err(format!(
            "remote_host `{}` is neither an IP address nor a host name.",
            host.chars().take(80).collect::<String>()
        ))
    }
}

fn is_hostname(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// What a plan produced for the engine: blocks to install, and the pin to keep.
#[derive(Default)]
pub(super) struct Prepared {
    pub imported: Vec<BlockData>,
    pub pin: Option<String>,
}

/// Why a remote prefill's blocks did not arrive (logged; the engine recomputes).
#[derive(Debug, thiserror::Error)]
enum PullError {
    #[error("cannot resolve {0}")]
    Resolve(String),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error("the transfer timeout passed")]
    Timeout,
    #[error("the prefill call failed: {0}")]
    Prefill(String),
}

/// The request's prompt as the engine will see it, for naming its blocks.
pub(super) struct PromptRef<'a> {
    pub tokens: &'a [u32],
    pub salt: Option<&'a str>,
    pub lora: Option<&'a str>,
    /// The route (`/v1/chat/completions` or `/v1/completions`), for phase 1.
    pub path: &'a str,
    /// The request body as received, for phase 1.
    pub body: &'a Bytes,
}

/// Does a plan's network part: pulls or looks up the blocks the engine lacks.
pub(super) async fn prepare(state: &AppState, plan: &KvPlan, prompt: PromptRef<'_>) -> Prepared {
    let kv = &state.kv;
    // A prefill for a remote decoder computes (or finds in the tier) like a colocated one.
    let pin = match plan {
        KvPlan::Prefill { pin } => Some(pin.clone()),
        _ => None,
    };
    let fetches_remote = matches!(plan, KvPlan::Remote { .. } | KvPlan::Prefiller { .. });
    if !kv.prefix_caching || (!fetches_remote && kv.tier.is_none()) {
        record_path(state, TransferPath::Local);
        return Prepared {
            imported: Vec::new(),
            pin,
        };
    }
    let engine = &state.engine;
    let spec = block_spec(engine).await;
    let hashes = engine.block_hashes(prompt.tokens, prompt.salt, prompt.lora);
    let local = engine.cached_index().leading(&hashes);
    let mut wanted: &[HashKey] = &hashes[local..];
    wanted = &wanted[..wanted.len().min(transfer::MAX_HASHES_PER_GET)];
    let mut imported = Vec::new();
    let mut path = TransferPath::Local;
    // A prefill on another engine only pays when there is something to fetch.
    let skip_phase_one = matches!(plan, KvPlan::Prefiller { .. }) && wanted.is_empty();
    if fetches_remote && !skip_phase_one {
        let deadline = Instant::now() + kv.transfer_timeout;
        let started = Instant::now();
        let result = match tokio::time::timeout_at(
            deadline.into(),
            remote(state, &spec, plan, wanted, &prompt),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(PullError::Timeout),
        };
        match result {
            Ok(blocks) => {
                record_received(state, blocks.len(), started.elapsed());
                path = if wanted.is_empty() {
                    TransferPath::Local
                } else if blocks.len() < wanted.len() {
                    tracing::warn!(
                        got = blocks.len(),
                        want = wanted.len(),
                        "remote prefill sent fewer blocks than the prompt has; recomputing the rest"
                    );
                    TransferPath::Fallback
                } else {
                    TransferPath::RemotePrefill
                };
                imported = blocks;
            }
            Err(e) => {
                tracing::warn!(error = %e, "remote prefill failed; recomputing the prompt");
                path = TransferPath::Fallback;
            }
        }
    }
    // Short answers keep what arrived; the tier may have the rest.
    if let (Some(tier), true) = (kv.tier, imported.len() < wanted.len()) {
        let rest = &wanted[imported.len()..];
        let started = Instant::now();
        let found = offload::tier_lookup(tier, &spec, rest, TIER_LOOKUP_TIMEOUT).await;
        record_received(state, found.len(), started.elapsed());
        if !found.is_empty() && path == TransferPath::Local {
            path = TransferPath::Tier;
        }
        imported.extend(found);
    }
    record_path(state, path);
    Prepared { imported, pin }
}

/// Phase 1 when the plan asks for it, then the pull; the caller bounds the whole.
async fn remote(
    state: &AppState,
    spec: &BlockSpec,
    plan: &KvPlan,
    wanted: &[HashKey],
    prompt: &PromptRef<'_>,
) -> Result<Vec<BlockData>, PullError> {
    let (host, port, release) = match plan {
        KvPlan::Remote {
            host,
            port,
            release,
        } => (host.clone(), *port, release.clone()),
        KvPlan::Prefiller {
            host,
            port,
            request_id,
        } => {
            let answer = phase_one(host, *port, prompt, request_id).await?;
            let (Some(h), Some(p)) = (answer.remote_host.clone(), answer.remote_port) else {
                return Err(PullError::Prefill(
                    "the answer carries no remote_host/remote_port".into(),
                ));
            };
            check_host_port(&h, p).map_err(PullError::Prefill)?;
            let release = match answer.extra.get(REMOTE_REQUEST_ID) {
                Some(serde_json::Value::String(s)) => s.clone(),
                _ => request_id.clone(),
            };
            (h, p, Some(release))
        }
        KvPlan::Local | KvPlan::Prefill { .. } => return Ok(Vec::new()),
    };
    let addr = resolve(&host, port).await?;
    let mut client = TransferClient::connect(addr, spec, state.kv.transfer_timeout).await?;
    if wanted.is_empty() {
        // Everything is cached here already: only let the prefill engine drop its pin.
        if let Some(pin) = &release {
            client.release(pin).await?;
        }
        return Ok(Vec::new());
    }
    Ok(client.get(wanted, release.as_deref()).await?)
}

/// The engine's block spec; its first computation hashes the weights file, so it runs
/// off the async threads.
async fn block_spec(engine: &EngineHandle) -> BlockSpec {
    let e = engine.clone();
    match tokio::task::spawn_blocking(move || e.block_spec()).await {
        Ok(spec) => spec,
        // The blocking pool refuses work only at shutdown; computing it here is still right.
        Err(_) => engine.block_spec(),
    }
}

async fn resolve(host: &str, port: u16) -> Result<SocketAddr, PullError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    tokio::net::lookup_host((host, port))
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| PullError::Resolve(format!("{host}:{port}")))
}

/// vLLM's proxy step 1 against `host:port`: the same body with `kv_transfer_params:
/// prefill_request()`, `max_tokens: 1`, `stream: false` and the same `x-request-id`; the
/// answer's `kv_transfer_params`.
async fn phase_one(
    host: &str,
    port: u16,
    prompt: &PromptRef<'_>,
    request_id: &str,
) -> Result<KvTransferParams, PullError> {
    use http_body_util::{BodyExt, Full, Limited};
    let fail = |m: String| PullError::Prefill(m);
    let mut body: serde_json::Value =
        serde_json::from_slice(prompt.body).map_err(|e| fail(e.to_string()))?;
    let obj = body
        .as_object_mut()
        .ok_or_else(|| fail("the body is not an object".into()))?;
    let params = serde_json::to_value(KvTransferParams::prefill_request())
        .map_err(|e| fail(e.to_string()))?;
    obj.insert("kv_transfer_params".into(), params);
    obj.insert("max_tokens".into(), 1.into());
    obj.insert("stream".into(), false.into());
    // What would contradict a one-token, non-streamed answer.
    for k in ["max_completion_tokens", "stream_options", "min_tokens"] {
        obj.remove(k);
    }
    let body = serde_json::to_vec(&body).map_err(|e| fail(e.to_string()))?;

    let addr = resolve(host, port).await?;
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| fail(format!("connect {addr}: {e}")))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| fail(e.to_string()))?;
    // The connection task ends with this exchange (the guard aborts it on every exit).
    let conn = AbortOnDrop(tokio::spawn(conn));
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let req = hyper::Request::post(prompt.path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header("x-request-id", request_id)
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| fail(e.to_string()))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let status = resp.status();
    let bytes = Limited::new(resp.into_body(), MAX_PREFILL_ANSWER)
        .collect()
        .await
        .map_err(|e| fail(format!("reading the answer: {e}")))?
        .to_bytes();
    drop(conn);
    if !status.is_success() {
        return Err(fail(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        )));
    }
    let answer: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| fail(format!("answer: {e}")))?;
    let params = answer
        .get("kv_transfer_params")
        .cloned()
        .ok_or_else(|| fail("the answer carries no kv_transfer_params".into()))?;
    serde_json::from_value(params).map_err(|e| fail(format!("kv_transfer_params: {e}")))
}

struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The answer's `kv_transfer_params` for a request prefilled for a remote decoder.
pub(super) fn prefill_answer(state: &AppState, pin: &str, blocks: &[u32]) -> KvTransferParams {
    let (host, port) = state.kv.advertised().unzip();
    let mut extra = serde_json::Map::new();
    extra.insert(REMOTE_REQUEST_ID.into(), pin.into());
    KvTransferParams {
        do_remote_decode: false,
        do_remote_prefill: true,
        remote_engine_id: Some(state.kv.engine_id.clone()),
        remote_block_ids: Some(blocks.iter().map(|&b| b as u64).collect()),
        remote_host: host,
        remote_port: port,
        extra,
    }
}

fn record_path(state: &AppState, path: TransferPath) {
    state.metrics.record_transfer_request(path);
}

/// One pull's time (the loop counts the blocks when it installs them).
fn record_received(state: &AppState, blocks: usize, elapsed: Duration) {
    if blocks > 0 {
        state.metrics.observe_transfer(elapsed);
    }
}

/// The engine's transfer endpoint serves its cached blocks from the loop.
struct EngineBlocks {
    engine: EngineHandle,
    spec: BlockSpec,
}

impl BlockSource for EngineBlocks {
    fn accepts(&self, spec: &BlockSpec) -> bool {
        *spec == self.spec
    }

    fn get(
        &self,
        _spec: &BlockSpec,
        hashes: Vec<HashKey>,
        release: Option<String>,
    ) -> BoxFuture<Vec<BlockData>> {
        let engine = self.engine.clone();
        Box::pin(async move { engine.export_blocks(hashes, release).await })
    }

    fn put(&self, _spec: &BlockSpec, _blocks: Vec<BlockData>) -> BoxFuture<Result<(), String>> {
        Box::pin(async {
            Err("an engine does not store pushed blocks; put them to a KV tier".to_string())
        })
    }

    fn evictions_since(&self, _spec: &BlockSpec, seq: u64) -> Evictions {
        Evictions {
            next: seq,
            hashes: Vec::new(),
            complete: true,
        }
    }

    fn release(&self, pin: String) -> BoxFuture<()> {
        self.engine.release_pin(pin);
        Box::pin(async {})
    }

    fn own_spec(&self) -> Option<BlockSpec> {
        Some(self.spec.clone())
    }
}

/// What runs beside the HTTP server: the transfer endpoint and the tier offloader.
pub struct KvServices {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    endpoint: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    offloader: Option<tokio::task::JoinHandle<()>>,
    transfer_addr: Option<SocketAddr>,
}

impl KvServices {
    /// Where the transfer endpoint listens, when it runs.
    pub fn transfer_addr(&self) -> Option<SocketAddr> {
        self.transfer_addr
    }

    /// Stops the endpoint (open transfers are cut: decoders recompute) and the offloader.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(endpoint) = self.endpoint.take() {
            match tokio::time::timeout(Duration::from_secs(2), endpoint).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "KV transfer endpoint failed"),
                Ok(Err(e)) => tracing::warn!(error = %e, "KV transfer endpoint task failed"),
                Err(_) => tracing::warn!("KV transfer endpoint did not stop in time"),
            }
        }
        if let Some(offloader) = self.offloader.take() {
            offloader.abort();
        }
    }
}

impl Drop for KvServices {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(o) = self.offloader.take() {
            o.abort();
        }
    }
}

/// Starts the transfer endpoint on `transfer` (advertising `advertise_host` and the
/// listener's port as `remote_host`/`remote_port`) and, with a tier configured, the
/// offloader. Must run inside a tokio runtime; call it once per loaded engine.
pub fn start_kv_services(
    state: &Arc<AppState>,
    transfer: Option<tokio::net::TcpListener>,
    advertise_host: &str,
) -> std::io::Result<KvServices> {
    let mut services = KvServices {
        stop: None,
        endpoint: None,
        offloader: None,
        transfer_addr: None,
    };
    if let Some(listener) = transfer {
        let addr = listener.local_addr()?;
        if state
            .kv
            .advertised
            .set((advertise_host.to_string(), addr.port()))
            .is_err()
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "this engine's KV transfer endpoint is already running",
            ));
        }
        let source = Arc::new(EngineBlocks {
            engine: state.engine.clone(),
            spec: state.engine.block_spec(),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stop_rx.await;
        };
        services.endpoint = Some(tokio::spawn(transfer::serve(listener, source, shutdown)));
        services.stop = Some(stop_tx);
        services.transfer_addr = Some(addr);
        tracing::info!(%addr, advertised = %advertise_host, role = %state.kv.role, "serving KV blocks");
    }
    let evicted = state
        .kv
        .evicted
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let (Some(tier), Some(rx)) = (state.kv.tier, evicted) {
        // A weak reference: the offloader must not keep the engine alive (it ends when the
        // loop drops its sender, which needs every handle gone).
        let weak: Weak<AppState> = Arc::downgrade(state);
        let on_change = Box::new(move |change: offload::TierChange| {
            if let Some(state) = weak.upgrade() {
                state.engine.tier_changed(change);
            }
        });
        services.offloader = Some(offload::spawn_offloader(
            tier,
            state.engine.block_spec(),
            rx,
            TIER_POLL,
            on_change,
        ));
        tracing::info!(%tier, "offloading evicted KV blocks to the tier");
    }
    Ok(services)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_forms() {
        assert_eq!(
            split_host_port("10.0.0.7:8001"),
            Some(("10.0.0.7".into(), 8001))
        );
        assert_eq!(split_host_port("[::1]:9"), Some(("::1".into(), 9)));
        assert_eq!(
            split_host_port("prefill-0.svc:80"),
            Some(("prefill-0.svc".into(), 80))
        );
        assert_eq!(split_host_port("nohost"), None);
        assert_eq!(split_host_port("h:70000"), None);
        assert_eq!(split_host_port("[::1]9"), None);
    }

    #[test]
    fn hosts_must_be_ips_or_names() {
        for ok in [
            "127.0.0.1",
            "::1",
            "localhost",
            "prefill-0.ns.svc.cluster.local",
            "a.",
        ] {
            assert!(check_host_port(ok, 1).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a b",
            "-a",
            "a..b",
            "http://x",
            "x/y",
            "é",
            &"a".repeat(64),
        ] {
            assert!(check_host_port(bad, 1).is_err(), "{bad}");
        }
        assert!(check_host_port("127.0.0.1", 0).is_err());
    }
}
