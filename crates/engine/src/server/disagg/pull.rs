//! The network part of a plan, before the request reaches the engine thread: pull the
//! prompt's blocks from the prefill engine that holds them (running phase 1 against it
//! first when the picker left that to this engine), or look them up in the tier, and hand
//! them to the loop as `imported` blocks. Every step is bounded by the transfer timeout,
//! and any failure only means the engine recomputes what it could not fetch.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use bytes::Bytes;
use strata_api::types::KvTransferParams;

use super::params::{KvPlan, REMOTE_REQUEST_ID};
use crate::engine::EngineHandle;
use crate::kv::block_pool::HashKey;
use crate::kv::offload;
use crate::kv::peers::check_host_port;
use crate::kv::tls::KvConnector;
use crate::kv::transfer::{self, BlockData, BlockSpec, TransferClient, TransferError};
use crate::metrics::TransferPath;
use crate::server::state::AppState;

/// How long a tier lookup may delay a request: the tier is on this machine, so an answer
/// that takes longer means it is overloaded and recomputing is the better bet.
const TIER_LOOKUP_TIMEOUT: Duration = Duration::from_millis(250);
/// Largest phase-1 answer read from a prefill engine (it is one short completion).
const MAX_PREFILL_ANSWER: usize = 1 << 20;

/// What a plan produced for the engine: blocks to install, and the pin to keep.
#[derive(Default)]
pub(in crate::server) struct Prepared {
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
pub(in crate::server) struct PromptRef<'a> {
    pub tokens: &'a [u32],
    pub salt: Option<&'a str>,
    pub lora: Option<&'a str>,
    /// The route (`/v1/chat/completions` or `/v1/completions`), for phase 1.
    pub path: &'a str,
    /// The request body as received, for phase 1.
    pub body: &'a Bytes,
}

/// Does a plan's network part: pulls or looks up the blocks the engine lacks.
pub(in crate::server) async fn prepare(
    state: &AppState,
    plan: &KvPlan,
    prompt: PromptRef<'_>,
) -> Prepared {
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
        let connector = state.kv.connector();
        let found = offload::tier_lookup(&connector, tier, &spec, rest, TIER_LOOKUP_TIMEOUT).await;
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
            let key = state.kv.outbound_key.as_deref();
            // Over TLS when KV transfer is (`--kv-tls`): the prefill engine's HTTP port
            // then serves its certificate, and this engine presents its own.
            let connector = state.kv.connector().for_http();
            let answer = phase_one(&connector, host, *port, prompt, request_id, key).await?;
            let (Some(h), Some(p)) = (answer.remote_host.clone(), answer.remote_port) else {
                return Err(PullError::Prefill(
                    "the answer carries no remote_host/remote_port".into(),
                ));
            };
            check_host_port(&h, p).map_err(PullError::Prefill)?;
            // The prefill engine names its transfer endpoint: it too must be a peer this
            // engine may contact.
            state.kv.check_peer(&h, p).map_err(PullError::Prefill)?;
            let release = match answer.extra.get(REMOTE_REQUEST_ID) {
                Some(serde_json::Value::String(s)) => s.clone(),
                _ => request_id.clone(),
            };
            (h, p, Some(release))
        }
        KvPlan::Local | KvPlan::Prefill { .. } => return Ok(Vec::new()),
    };
    let addr = resolve(&host, port).await?;
    let connector = state.kv.connector();
    let timeout = state.kv.transfer_timeout;
    let mut client = TransferClient::connect_with(&connector, addr, &host, spec, timeout).await?;
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

/// vLLM's proxy step 1 against `host:port` (through `connector`: plain, or TLS verifying
/// the peer by `host`): the same body with `kv_transfer_params: prefill_request()`,
/// `max_tokens: 1`, `stream: false` and the same `x-request-id`, with this engine's API key
/// when it has one; the answer's `kv_transfer_params`.
async fn phase_one(
    connector: &KvConnector,
    host: &str,
    port: u16,
    prompt: &PromptRef<'_>,
    request_id: &str,
    key: Option<&str>,
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
    let stream = connector
        .connect(addr, host)
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
    let mut req = hyper::Request::post(prompt.path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header("x-request-id", request_id);
    if let Some(key) = key {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let req = req
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

fn record_path(state: &AppState, path: TransferPath) {
    state.metrics.record_transfer_request(path);
}

/// One pull's time (the loop counts the blocks when it installs them).
fn record_received(state: &AppState, blocks: usize, elapsed: Duration) {
    if blocks > 0 {
        state.metrics.observe_transfer(elapsed);
    }
}
