//! The server's side of the engine: [`EngineHandle`] queues requests (refusing past the
//! waiting limit or while draining) and sends the loop the [`Command`]s it answers between
//! two steps; [`Shared`] holds the counters the loop publishes for it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use crate::kv::block_pool::HashKey;
use crate::kv::hashing::BlockHasher;
use crate::kv::offload::TierChange;
use crate::kv::transfer::{BlockData, BlockSpec};
use crate::metrics::EngineMetrics;
use crate::options::EngineOptions;
use crate::sequence::GenerationRequest;

use super::block_identity::{prompt_block_hashes, BlockSpecCell};
use super::cached_index::CachedIndex;

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the engine queue is full ({0} waiting)")]
    QueueFull(usize),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

pub(super) enum Command {
    Add(Box<GenerationRequest>),
    /// Forget every cached prefix; answers whether it could (no block may be in use).
    ResetPrefixCache(tokio::sync::oneshot::Sender<bool>),
    /// The hashes currently naming cached blocks.
    CachedHashes(tokio::sync::oneshot::Sender<Vec<HashKey>>),
    /// Copies out the leading cached run of `hashes`, then drops the pin `release`.
    Export {
        hashes: Vec<HashKey>,
        release: Option<String>,
        reply: tokio::sync::oneshot::Sender<Vec<BlockData>>,
    },
    ReleasePin(String),
    Tier(TierChange),
    Stats(tokio::sync::oneshot::Sender<BlockStats>),
}

/// Where the KV blocks are, for leak checks and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockStats {
    pub num_blocks: usize,
    /// Nobody holds them (cached or not).
    pub free: usize,
    /// Named in the prefix cache (held or free).
    pub cached: usize,
    /// References held by pins (a block pinned twice counts twice).
    pub pinned: usize,
    /// Pins alive.
    pub pins: usize,
    /// Blocks announced on the KV tier.
    pub tier_announced: usize,
    /// Evicted blocks remembered for tier announcements (awaiting the tier's answer).
    pub tier_remembered: usize,
}

/// Counters shared between the loop and the server.
#[derive(Default)]
pub(super) struct Shared {
    pub(super) waiting: AtomicUsize,
    pub(super) running: AtomicUsize,
    draining: AtomicBool,
}

/// The server's side of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    shared: Arc<Shared>,
    pub metrics: Arc<EngineMetrics>,
    max_waiting: usize,
    cached: CachedIndex,
    spec: Arc<BlockSpecCell>,
    /// `None` without prefix caching (no block is ever named).
    hasher: Option<Arc<BlockHasher>>,
}

impl EngineHandle {
    pub(super) fn new(
        tx: Sender<Command>,
        shared: Arc<Shared>,
        metrics: Arc<EngineMetrics>,
        opts: &EngineOptions,
        cached: CachedIndex,
        spec: Arc<BlockSpecCell>,
    ) -> Self {
        let (seed, block_size) = (&opts.prefix_caching_hash_seed, opts.block_size);
        Self {
            tx,
            shared,
            metrics,
            max_waiting: opts.max_waiting,
            cached,
            spec,
            hasher: opts
                .prefix_caching
                .then(|| Arc::new(BlockHasher::new(seed, block_size))),
        }
    }

    /// Queues a request; its tokens arrive on `req.events`.
    pub fn submit(&self, req: GenerationRequest) -> Result<(), SubmitError> {
        if self.shared.draining.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        let waiting = self.shared.waiting.fetch_add(1, Ordering::AcqRel);
        if waiting >= self.max_waiting {
            self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::QueueFull(waiting));
        }
        self.tx.send(Command::Add(Box::new(req))).map_err(|_| {
            self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            SubmitError::ShuttingDown
        })
    }

    /// Clears the prefix cache (publishing AllBlocksCleared). False while requests hold
    /// blocks or when the engine is gone.
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Command::ResetPrefixCache(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// The hashes naming cached blocks right now (for checks against KV-event mirrors).
    pub async fn cached_block_hashes(&self) -> Vec<HashKey> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Command::CachedHashes(tx)).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// What a peer's blocks must match to be installed here (model identity, block size,
    /// layers, slot width, KV dtype). The first call digests the weights file.
    pub fn block_spec(&self) -> BlockSpec {
        self.spec.get()
    }

    /// Copies out the leading run of `hashes` that is cached here (pinned or merely
    /// cached), between two steps, at most one transfer frame of blocks; then drops the
    /// pin `release`, if given. Empty when the engine is gone.
    pub async fn export_blocks(
        &self,
        hashes: Vec<HashKey>,
        release: Option<String>,
    ) -> Vec<BlockData> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let cmd = Command::Export {
            hashes,
            release,
            reply: tx,
        };
        if self.tx.send(cmd).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Drops a pin (a decoder found the blocks elsewhere or gave up); unknown pins are
    /// ignored.
    pub fn release_pin(&self, pin: String) {
        let _ = self.tx.send(Command::ReleasePin(pin));
    }

    /// The shared index of cached block hashes (a cheap clone).
    pub fn cached_index(&self) -> CachedIndex {
        self.cached.clone()
    }

    /// What the offloader learned from the tier; the loop announces it as CPU-medium KV
    /// events.
    pub fn tier_changed(&self, change: TierChange) {
        let _ = self.tx.send(Command::Tier(change));
    }

    /// The prompt's full-block hashes exactly as the planner will name them (`lora`:
    /// the adapter's name). Empty without prefix caching.
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        salt: Option<&str>,
        lora: Option<&str>,
    ) -> Vec<HashKey> {
        match &self.hasher {
            Some(h) => prompt_block_hashes(h, tokens, salt, lora),
            None => Vec::new(),
        }
    }

    /// Where the blocks are right now (zeros when the engine is gone).
    pub async fn block_stats(&self) -> BlockStats {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Command::Stats(tx)).is_err() {
            return BlockStats::default();
        }
        rx.await.unwrap_or_default()
    }

    /// Requests queued or running.
    pub fn in_flight(&self) -> usize {
        self.shared.waiting.load(Ordering::Acquire) + self.shared.running.load(Ordering::Acquire)
    }

    /// Stops accepting new requests (in-flight ones carry on).
    pub fn start_draining(&self) {
        self.shared.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::Acquire)
    }
}
