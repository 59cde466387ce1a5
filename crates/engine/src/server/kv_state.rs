//! What the server knows about disaggregation and the tier (PROTOCOLS §11): this engine's
//! role and id, where its transfer endpoint is advertised once it listens, and the loop's
//! evicted-block copies until the offloader takes them.

use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc::Receiver;

use crate::kv::peers::KvPeers;
use crate::kv::transfer::BlockData;
use crate::options::{EngineOptions, KvRole};

/// Blocks the engine loop may queue for the offloader before it drops copies.
pub(super) const EVICTED_QUEUE: usize = 256;

/// What the server knows about disaggregation and the tier.
pub struct KvState {
    pub role: KvRole,
    /// This engine's id in `remote_engine_id`.
    pub engine_id: String,
    pub transfer_timeout: Duration,
    pub tier: Option<SocketAddr>,
    pub prefix_caching: bool,
    /// The peers this engine may connect to (`--kv-peers`).
    pub peers: KvPeers,
    /// Every request that reaches a handler presented the engine's API key.
    pub authenticated: bool,
    /// The key sent with phase-1 calls to prefill engines (this engine's first API key).
    pub outbound_key: Option<String>,
    /// `--kv-tls`: the transfer endpoint, pulls and the tier over mutual TLS; plain TCP
    /// when `None`.
    pub tls: Option<crate::kv::tls::KvTls>,
    /// `remote_host` and `remote_port`, once the transfer endpoint listens.
    advertised: OnceLock<(String, u16)>,
    /// The loop's evicted-block copies, until the offloader takes them.
    evicted: Mutex<Option<Receiver<BlockData>>>,
}

impl KvState {
    pub(super) fn new(opts: &EngineOptions, evicted: Option<Receiver<BlockData>>) -> Self {
        let n: u64 = rand::random();
        Self {
            role: opts.kv_role,
            engine_id: format!("strata-{n:016x}"),
            transfer_timeout: opts.kv_transfer_timeout,
            tier: opts.kv_tier.filter(|_| opts.prefix_caching),
            prefix_caching: opts.prefix_caching,
            peers: opts.kv_peers.clone(),
            authenticated: opts.auth.requires_api_key(),
            outbound_key: opts.auth.outbound_key().map(str::to_string),
            tls: opts.kv_tls.clone(),
            advertised: OnceLock::new(),
            evicted: Mutex::new(evicted),
        }
    }

    /// Whether this engine may connect to `host:port` for KV transfer (`--kv-peers`); the
    /// refusal says why. Checked before any connection is attempted.
    pub fn check_peer(&self, host: &str, port: u16) -> Result<(), String> {
        self.peers.check(host, port, self.authenticated)
    }

    /// Where decoders pull this engine's blocks from; `None` without an endpoint.
    pub fn advertised(&self) -> Option<(String, u16)> {
        self.advertised.get().cloned()
    }

    /// How this engine opens transfer and tier connections (plain, or its KV TLS).
    pub fn connector(&self) -> crate::kv::tls::KvConnector {
        self.tls
            .as_ref()
            .map(|t| t.connector.clone())
            .unwrap_or_default()
    }

    /// Records where the transfer endpoint listens; `false` when one already does (an
    /// engine has one endpoint, so its answers name one place).
    pub(super) fn advertise(&self, host: &str, port: u16) -> bool {
        self.advertised.set((host.to_string(), port)).is_ok()
    }

    /// The evicted-block copies, for the one offloader that takes them.
    pub(super) fn take_evicted(&self) -> Option<Receiver<BlockData>> {
        self.evicted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}
