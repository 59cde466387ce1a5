//! What runs beside the HTTP server: the engine's block-transfer endpoint (its cached
//! blocks, served from the loop, for decode engines to pull) and the offloader that sends
//! evicted blocks to the tier.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::engine::EngineHandle;
use crate::kv::block_pool::HashKey;
use crate::kv::offload;
use crate::kv::transfer::{self, BlockData, BlockSource, BlockSpec, BoxFuture, Evictions};
use crate::server::state::AppState;

/// How often the offloader asks the tier which blocks it dropped.
const TIER_POLL: Duration = Duration::from_secs(1);

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
        if !state.kv.advertise(advertise_host, addr.port()) {
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
        let acceptor = state
            .kv
            .tls
            .as_ref()
            .map(|t| t.acceptor.clone())
            .unwrap_or_default();
        let tls = acceptor.is_tls();
        let limits = transfer::ServeLimits::default();
        let serve = transfer::serve_on(listener, acceptor, source, shutdown, limits);
        services.endpoint = Some(tokio::spawn(serve));
        services.stop = Some(stop_tx);
        services.transfer_addr = Some(addr);
        tracing::info!(%addr, advertised = %advertise_host, role = %state.kv.role, tls, "serving KV blocks");
    }
    if let (Some(tier), Some(rx)) = (state.kv.tier, state.kv.take_evicted()) {
        // A weak reference: the offloader must not keep the engine alive (it ends when the
        // loop drops its sender, which needs every handle gone).
        let weak: Weak<AppState> = Arc::downgrade(state);
        let on_change = Box::new(move |change: offload::TierChange| {
            if let Some(state) = weak.upgrade() {
                state.engine.tier_changed(change);
            }
        });
        services.offloader = Some(offload::spawn_offloader(
            state.kv.connector(),
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
