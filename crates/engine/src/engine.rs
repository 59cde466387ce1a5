//! The engine loop: one thread owns the model, the KV cache and the scheduler, and turns
//! submitted requests into streamed tokens, one batched forward per step.
//!
//! Requests arrive over a channel ([`EngineHandle::submit`]); each step the loop drops
//! sequences whose submitter went away (freeing their blocks), asks the scheduler for a
//! plan, runs one forward over every scheduled sequence, samples where a sequence's
//! pending tokens are all computed, and reports tokens and finishes on each sequence's
//! own channel.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::kv::block_pool::{BlockLora, BlockPool, HashKey, KeyHashState, PoolEvent};
use crate::kv::cache::{KvCache, KvDtype};
use crate::kv::hashing::{block_extra_keys, BlockHash, BlockHasher};
use crate::kv::offload::TierChange;
use crate::kv::transfer::{BlockData, BlockSpec};
use crate::metrics::{EngineMetrics, FinishedRequest};
use crate::model::{Llama, SeqInput};
use crate::sampler::{SampleOutput, Sampler};
use crate::scheduler::{
    BlockHashFn, LoraBlockHashFn, Policy, SchedulerConfig, StepBudget, StepPlan, StepPlanner,
};
use crate::sequence::{FinishReason, GenerationRequest, SeqEvent, Sequence, TokenLogprob};
use crate::spec_decode::{linear_prices, propose, SpecConfig, StepCosts, PRIOR_ROW_COST};
use crate::structured::GrammarStep;
use crate::tokenizer::Tokenizer;

/// Engine sizing and policy.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    /// How KV-cache entries are stored.
    pub kv_dtype: KvDtype,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Waiting requests beyond this are refused (HTTP 429).
    pub max_waiting: usize,
    pub policy: Policy,
    pub seed: u64,
    /// Share full KV blocks between requests with the same prefix.
    pub prefix_caching: bool,
    /// Seed of the block hashes (vLLM's `PYTHONHASHSEED` counterpart).
    pub hash_seed: String,
    /// Prompt-lookup speculative decoding; off when `None`.
    pub speculative: Option<SpecConfig>,
    /// Distinct LoRA adapters in one step (`--max-loras`); `None` when LoRA is off.
    pub max_loras: Option<usize>,
    /// The time a step that carries decodes should stay within (`--step-time-budget-ms`):
    /// prefill chunks beside decodes are sized to it from the measured step cost. `None`:
    /// only `max_num_batched_tokens` bounds a step.
    pub step_time_budget: Option<Duration>,
    /// How long a finished request's pinned prompt blocks wait for a decoder to pull them
    /// (`--kv-pin-timeout-secs`) before they are released.
    pub pin_timeout: Duration,
    /// The weights file: its SHA-256 (computed once, on the first
    /// [`EngineHandle::block_spec`]) goes into [`BlockSpec::model`], so engines with
    /// different weights never take each other's blocks. `None`: the identity is unique to
    /// this process, and no other engine accepts its blocks.
    pub weights_path: Option<PathBuf>,
}

/// The default of [`EngineConfig::pin_timeout`].
pub const DEFAULT_PIN_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the engine queue is full ({0} waiting)")]
    QueueFull(usize),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

enum Command {
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

/// The hashes of the blocks cached in the engine's pool right now, shared with the server:
/// the loop applies each step's pool changes under a short write lock, readers take a read
/// lock for one lookup.
#[derive(Clone, Default)]
pub struct CachedIndex {
    set: Arc<RwLock<HashSet<HashKey, KeyHashState>>>,
}

impl CachedIndex {
    /// How many leading `hashes` are cached now.
    pub fn leading(&self, hashes: &[HashKey]) -> usize {
        let set = self.set.read().unwrap_or_else(|e| e.into_inner());
        hashes.iter().take_while(|h| set.contains(*h)).count()
    }

    pub fn contains(&self, hash: &HashKey) -> bool {
        self.set
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(hash)
    }

    pub fn len(&self) -> usize {
        self.set.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Follows the pool's own cache changes (the tier's are another medium).
    fn apply(&self, events: &[PoolEvent]) {
        let relevant = events.iter().any(|e| {
            matches!(
                e,
                PoolEvent::Stored { .. } | PoolEvent::Removed { .. } | PoolEvent::Cleared
            )
        });
        if !relevant {
            return;
        }
        let mut set = self.set.write().unwrap_or_else(|e| e.into_inner());
        for e in events {
            match e {
                PoolEvent::Stored { hash, .. } => {
                    set.insert(*hash);
                }
                PoolEvent::Removed { hash } => {
                    set.remove(hash);
                }
                PoolEvent::Cleared => set.clear(),
                PoolEvent::TierStored { .. } | PoolEvent::TierRemoved { .. } => {}
            }
        }
    }
}

/// The block spec of an engine, its model identity computed on first use.
struct SpecCell {
    dims: BlockSpec,
    arch: String,
    weights_path: Option<PathBuf>,
    spec: OnceLock<BlockSpec>,
}

impl SpecCell {
    fn get(&self) -> BlockSpec {
        self.spec
            .get_or_init(|| {
                let weights = match &self.weights_path {
                    Some(p) => match weights_digest(p) {
                        Ok(d) => format!("sha256:{d}"),
                        Err(e) => {
                            tracing::warn!(path = %p.display(), error = %e,
                                "cannot digest the weights; this engine's KV blocks are its own");
                            unique_identity()
                        }
                    },
                    None => unique_identity(),
                };
                BlockSpec {
                    model: format!("{};{weights}", self.arch),
                    ..self.dims.clone()
                }
            })
            .clone()
    }
}

/// A model identity no other engine has (its blocks are never accepted elsewhere).
fn unique_identity() -> String {
    use rand::RngCore;
    format!(
        "unique:{}:{:016x}",
        std::process::id(),
        rand::rng().next_u64()
    )
}

/// The SHA-256 of a weights file, hex.
pub fn weights_digest(path: &std::path::Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// The architecture part of a model identity: every dimension that shapes the KV, and
/// the weight format the numbers are computed in.
fn arch_identity(model: &Llama) -> String {
    let c = &model.config;
    format!(
        "llama:l{}:d{}:f{}:h{}:kv{}x{}:v{}:rope{}:{}",
        c.n_layer,
        c.hidden,
        c.ffn_hidden,
        c.n_head,
        c.n_kv_head,
        c.head_dim,
        c.vocab_size,
        c.rope_theta,
        model.format
    )
}

/// The prefix-cache hashes of the full blocks of `tokens`, exactly as the scheduler names
/// them: chained, with the adapter's name on every block and the salt on the first.
pub fn prompt_block_hashes(
    hasher: &BlockHasher,
    tokens: &[u32],
    salt: Option<&str>,
    lora: Option<&str>,
) -> Vec<HashKey> {
    hasher
        .hash_sequence(tokens, lora, salt)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

/// Counters shared between the loop and the server.
#[derive(Default)]
struct Shared {
    waiting: AtomicUsize,
    running: AtomicUsize,
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
    spec: Arc<SpecCell>,
    /// `None` without prefix caching (no block is ever named).
    hasher: Option<Arc<BlockHasher>>,
}

impl EngineHandle {
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

    /// The prompt's full-block hashes exactly as the scheduler will name them (`lora`:
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

/// Starts the engine thread. Dropping every [`EngineHandle`] ends it. `evicted`: where
/// copies of the cached blocks the pool evicts go (the tier offloader); `None` copies
/// nothing.
pub fn start(
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    metrics: Arc<EngineMetrics>,
    kv_events: Option<KvEventSink>,
    evicted: Option<tokio::sync::mpsc::Sender<BlockData>>,
) -> (EngineHandle, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new(Shared::default());
    let cached = CachedIndex::default();
    let spec = Arc::new(SpecCell {
        dims: BlockSpec {
            model: String::new(),
            block_size: u32::try_from(config.block_size).unwrap_or(u32::MAX),
            n_layer: u32::try_from(model.config.n_layer).unwrap_or(u32::MAX),
            slot_width: u32::try_from(model.kv_slot_width()).unwrap_or(u32::MAX),
            dtype: config.kv_dtype,
        },
        arch: arch_identity(&model),
        weights_path: config.weights_path.clone(),
        spec: OnceLock::new(),
    });
    let handle = EngineHandle {
        tx,
        shared: shared.clone(),
        metrics: metrics.clone(),
        max_waiting: config.max_waiting,
        cached: cached.clone(),
        spec,
        hasher: config
            .prefix_caching
            .then(|| Arc::new(BlockHasher::new(&config.hash_seed, config.block_size))),
    };
    let thread = std::thread::Builder::new()
        .name("strata-engine".into())
        .spawn(move || {
            let mut engine = EngineLoop::new(model, tokenizer, config, metrics, shared, kv_events);
            engine.cached_index = cached;
            if let Some(tx) = evicted {
                engine.scheduler.pool.set_track_evictions(true);
                engine.offload = Some(tx);
            }
            engine.run(rx);
        });
    let thread = match thread {
        Ok(t) => t,
        // Spawning a thread only fails when the OS is out of resources; nothing to serve with.
        Err(e) => panic!("cannot start the engine thread: {e}"),
    };
    (handle, thread)
}

struct EngineLoop {
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    cache: KvCache,
    scheduler: StepPlanner,
    metrics: Arc<EngineMetrics>,
    shared: Arc<Shared>,
    rng: StdRng,
    eos_ids: Vec<u32>,
    next_seq: u64,
    kv_events: Option<KvEventSink>,
    speculative: Option<SpecConfig>,
    /// Times of decode-only steps, which price speculative rows (unless configured).
    step_costs: StepCosts,
    /// Kept current from the pool's events for the server.
    cached_index: CachedIndex,
    /// Finished requests' prompt blocks waiting for a decoder, by pin id.
    pins: HashMap<String, Pin>,
    /// References held by all pins together.
    pinned_total: usize,
    pin_timeout: Duration,
    /// Pins together hold at most this many blocks; the oldest go first beyond it, so a
    /// burst of prefills nobody pulls cannot starve the running requests.
    max_pinned_blocks: usize,
    /// Where copies of evicted cached blocks go (the tier offloader).
    offload: Option<tokio::sync::mpsc::Sender<BlockData>>,
    tier: TierState,
}

/// A finished request's prompt blocks, referenced until pulled, released or expired.
struct Pin {
    blocks: Vec<u32>,
    expires: Instant,
}

/// What was committed into a block, kept from its eviction until the tier acknowledges
/// it, for the CPU-medium `BlockStored` event.
#[derive(Debug, Clone)]
struct TierMeta {
    parent: Option<HashKey>,
    tokens: Vec<u32>,
    lora: Option<BlockLora>,
}

/// Keys in insertion order with at most `cap` of them: inserting past the cap pushes the
/// oldest out (returned to the caller).
struct Bounded<V> {
    map: HashMap<HashKey, (u64, V), KeyHashState>,
    order: BTreeMap<u64, HashKey>,
    next: u64,
    cap: usize,
}

impl<V> Bounded<V> {
    fn new(cap: usize) -> Self {
        Self {
            map: HashMap::default(),
            order: BTreeMap::new(),
            next: 0,
            cap: cap.max(1),
        }
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn contains(&self, k: &HashKey) -> bool {
        self.map.contains_key(k)
    }

    /// Inserts (or renews) `k`; returns the entry pushed out past the cap, if any.
    fn insert(&mut self, k: HashKey, v: V) -> Option<(HashKey, V)> {
        if let Some((seq, _)) = self.map.remove(&k) {
            self.order.remove(&seq);
        }
        let seq = self.next;
        self.next += 1;
        self.map.insert(k, (seq, v));
        self.order.insert(seq, k);
        if self.map.len() <= self.cap {
            return None;
        }
        let (_, oldest) = self.order.pop_first()?;
        self.map.remove(&oldest).map(|(_, v)| (oldest, v))
    }

    fn remove(&mut self, k: &HashKey) -> Option<V> {
        let (seq, v) = self.map.remove(k)?;
        self.order.remove(&seq);
        Some(v)
    }

    /// Every key, oldest first, emptying the set.
    fn drain_keys(&mut self) -> Vec<HashKey> {
        self.map.clear();
        std::mem::take(&mut self.order).into_values().collect()
    }
}

/// The engine's view of its blocks on the KV tier.
struct TierState {
    /// Evicted blocks copied to the offloader, not yet acknowledged by the tier.
    remembered: Bounded<TierMeta>,
    /// Blocks announced as stored on the tier (CPU medium).
    announced: Bounded<()>,
    /// Tier events not yet published.
    events: Vec<PoolEvent>,
}

impl TierState {
    /// Remembered evictions per pool block, and announced tier blocks per pool block:
    /// the tier usually holds several times what one engine's cache does.
    const REMEMBER_PER_BLOCK: usize = 4;
    const ANNOUNCE_PER_BLOCK: usize = 16;
    const MIN_CAP: usize = 1024;

    fn new(num_blocks: usize) -> Self {
        Self {
            remembered: Bounded::new((num_blocks * Self::REMEMBER_PER_BLOCK).max(Self::MIN_CAP)),
            announced: Bounded::new((num_blocks * Self::ANNOUNCE_PER_BLOCK).max(Self::MIN_CAP)),
            events: Vec::new(),
        }
    }

    /// Turns what the offloader learned into CPU-medium events: a stored block is
    /// announced once, with what it was committed with (a block the engine does not
    /// remember, e.g. one it forgot past the cap, is not announced); a removed block is
    /// withdrawn if it was announced; a lost log withdraws every announced block.
    fn apply(&mut self, change: TierChange) {
        match change {
            TierChange::Stored(hashes) => {
                for h in hashes {
                    let Some(meta) = self.remembered.remove(&h) else {
                        continue;
                    };
                    if self.announced.contains(&h) {
                        self.announced.insert(h, ());
                        continue;
                    }
                    self.events.push(PoolEvent::TierStored {
                        hash: h,
                        parent: meta.parent,
                        tokens: meta.tokens,
                        lora: meta.lora,
                    });
                    if let Some((old, ())) = self.announced.insert(h, ()) {
                        // Past the cap the oldest announcement is withdrawn, so what the
                        // router counts never exceeds what the engine tracks.
                        self.events.push(PoolEvent::TierRemoved { hash: old });
                    }
                }
            }
            TierChange::Removed(hashes) => {
                for h in hashes {
                    self.remembered.remove(&h);
                    if self.announced.remove(&h).is_some() {
                        self.events.push(PoolEvent::TierRemoved { hash: h });
                    }
                }
            }
            TierChange::Lost => {
                for h in self.announced.drain_keys() {
                    self.events.push(PoolEvent::TierRemoved { hash: h });
                }
            }
        }
    }
}

/// Copies the blocks the pool just evicted to the offloader, before their slots are
/// written again; a full queue drops the copy (counted). Nothing happens without an
/// offloader (the pool then tracks no evictions).
fn copy_evicted(
    pool: &mut BlockPool,
    cache: &KvCache,
    offload: Option<&tokio::sync::mpsc::Sender<BlockData>>,
    tier: &mut TierState,
    metrics: &EngineMetrics,
) {
    let Some(tx) = offload else { return };
    for e in pool.drain_evicted() {
        if tx.capacity() == 0 || tx.is_closed() {
            metrics.kv_offload_dropped.inc();
            continue;
        }
        let Ok(bytes) = cache.read_block(e.block) else {
            continue;
        };
        match tx.try_send(BlockData {
            hash: e.hash,
            bytes,
        }) {
            Ok(()) => {
                tier.remembered.insert(
                    e.hash,
                    TierMeta {
                        parent: e.parent,
                        tokens: e.tokens,
                        lora: e.lora,
                    },
                );
            }
            Err(_) => {
                metrics.kv_offload_dropped.inc();
            }
        }
    }
}

/// Installs `seq.imported` right before its admission: the run that matches the prompt's
/// own block hashes (from the first imported block's place in the prompt; at the first
/// block of another hash or size, it and the rest are dropped), skipping blocks cached
/// meanwhile. Each is allocated, written into every layer and committed with its hash,
/// parent, tokens and adapter exactly as a computed block (so a `Stored` event goes out),
/// then released to the free queue, where admission takes it as a prefix hit.
fn install_imported(
    pool: &mut BlockPool,
    cache: &mut KvCache,
    offload: Option<&tokio::sync::mpsc::Sender<BlockData>>,
    tier: &mut TierState,
    metrics: &EngineMetrics,
    seq: &mut crate::sequence::Sequence,
) {
    let imported = std::mem::take(&mut seq.imported);
    let bs = cache.block_size;
    let prompt_blocks = (seq.prompt_len / bs).min(seq.block_hashes.len());
    let hashes = &seq.block_hashes[..prompt_blocks];
    let Some(start) = imported
        .first()
        .and_then(|b| hashes.iter().position(|h| *h == b.hash))
    else {
        return;
    };
    let expected = cache.block_bytes();
    let mut run: Vec<(usize, BlockData)> = Vec::new();
    for (k, b) in imported.into_iter().enumerate() {
        let i = start + k;
        if i >= prompt_blocks || b.hash != hashes[i] || b.bytes.len() != expected {
            break;
        }
        if pool.cached_block(&b.hash).is_none() {
            run.push((i, b));
        }
    }
    if run.is_empty() {
        return;
    }
    // Hold the prompt's blocks that are cached already, so the allocation below cannot
    // evict them (they and the installed ones form the prefix admission takes).
    let mut held = Vec::new();
    for h in hashes {
        if pool.cached_block(h).is_some() {
            held.extend(pool.acquire_cached(std::slice::from_ref(h)));
        }
    }
    let n = run.len().min(pool.num_free());
    let blocks = pool.allocate(n).unwrap_or_default();
    copy_evicted(pool, cache, offload, tier, metrics);
    let lora = seq.lora.as_ref().map(|a| BlockLora {
        id: i64::from(a.id),
        name: a.name.clone(),
    });
    let mut installed = 0u64;
    for (&block, (i, data)) in blocks.iter().zip(run) {
        if cache.write_block(block, &data.bytes).is_err() {
            continue;
        }
        let parent = i.checked_sub(1).map(|p| seq.block_hashes[p]);
        pool.commit_lora(
            block,
            data.hash,
            parent,
            &seq.tokens[i * bs..(i + 1) * bs],
            lora.as_ref(),
        );
        seq.installed.push(i);
        installed += 1;
    }
    pool.release(&blocks);
    pool.release(&held);
    metrics.record_transfer_blocks("received", installed);
}

/// Where cache changes go (the ZMQ publisher in production, a channel in tests).
pub type KvEventSink = Box<dyn FnMut(Vec<PoolEvent>, usize) + Send>;

impl EngineLoop {
    fn new(
        model: Arc<Llama>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        metrics: Arc<EngineMetrics>,
        shared: Arc<Shared>,
        kv_events: Option<KvEventSink>,
    ) -> Self {
        let cache = KvCache::with_dtype(
            model.config.n_layer,
            config.num_blocks,
            config.block_size,
            model.kv_slot_width(),
            config.kv_dtype,
        );
        let mut scheduler = StepPlanner::new(
            SchedulerConfig {
                block_size: config.block_size,
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
                policy: config.policy,
            },
            config.num_blocks,
            config
                .prefix_caching
                .then(|| block_hash_fn(&config.hash_seed, config.block_size)),
        );
        scheduler.max_loras = config.max_loras;
        scheduler.budget = StepBudget::new(config.step_time_budget);
        if config.prefix_caching {
            scheduler.set_lora_hash(lora_block_hash_fn(&config.hash_seed, config.block_size));
        }
        let eos_ids = tokenizer.stop_ids().to_vec();
        Self {
            model,
            tokenizer,
            cache,
            scheduler,
            metrics,
            shared,
            rng: StdRng::seed_from_u64(config.seed),
            eos_ids,
            next_seq: 0,
            kv_events,
            speculative: config.speculative,
            step_costs: StepCosts::default(),
            cached_index: CachedIndex::default(),
            pins: HashMap::new(),
            pinned_total: 0,
            pin_timeout: config.pin_timeout,
            max_pinned_blocks: config.num_blocks / 2,
            offload: None,
            tier: TierState::new(config.num_blocks),
        }
    }

    fn run(&mut self, rx: Receiver<Command>) {
        loop {
            // Block for work when idle (waking for the next pin to expire); otherwise take
            // whatever has arrived.
            if !self.scheduler.has_work() {
                let mut wait = Duration::from_millis(500);
                if let Some(next) = self.pins.values().map(|p| p.expires).min() {
                    wait = wait.min(next.saturating_duration_since(Instant::now()));
                }
                match rx.recv_timeout(wait) {
                    Ok(cmd) => self.handle(cmd),
                    Err(RecvTimeoutError::Timeout) => {
                        self.expire_pins(Instant::now());
                        self.publish_gauges();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.expire_pins(Instant::now());
            self.drop_abandoned();
            self.step();
            self.flush_kv_events();
            self.publish_gauges();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add(req) => {
                let req = *req;
                let sampler = Sampler::new(req.sampling.clone(), self.rng.random());
                let seq = Sequence::new(req, sampler, self.next_seq);
                self.next_seq += 1;
                self.scheduler.add(seq);
            }
            Command::CachedHashes(reply) => {
                let hashes = self
                    .scheduler
                    .pool
                    .cached_blocks()
                    .map(|(h, _)| *h)
                    .collect();
                let _ = reply.send(hashes);
            }
            Command::ResetPrefixCache(reply) => {
                let ok = self.scheduler.pool.reset();
                self.flush_kv_events();
                let _ = reply.send(ok);
            }
            Command::Export {
                hashes,
                release,
                reply,
            } => {
                let out = self.export(&hashes);
                if let Some(pin) = release {
                    self.release_pin(&pin);
                }
                let _ = reply.send(out);
            }
            Command::ReleasePin(pin) => self.release_pin(&pin),
            Command::Tier(change) => {
                // Announce at once (not after the next step): the tier's answers come about
                // once a second, and whoever asks the loop anything after a change sees its
                // events published and its gauge set.
                self.tier.apply(change);
                self.flush_kv_events();
                self.metrics
                    .set_tier_blocks(self.scheduler.pool.num_cached(), self.tier.announced.len());
            }
            Command::Stats(reply) => {
                let pool = &self.scheduler.pool;
                let _ = reply.send(BlockStats {
                    num_blocks: pool.num_blocks(),
                    free: pool.num_free(),
                    cached: pool.num_cached(),
                    pinned: self.pinned_total,
                    pins: self.pins.len(),
                    tier_announced: self.tier.announced.len(),
                    tier_remembered: self.tier.remembered.len(),
                });
            }
        }
    }

    /// Copies of the leading cached run of `hashes` (at most one transfer frame).
    fn export(&self, hashes: &[HashKey]) -> Vec<BlockData> {
        let pool = &self.scheduler.pool;
        let max = self.spec_blocks_per_frame();
        let mut out = Vec::new();
        for h in hashes.iter().take(max) {
            let Some(block) = pool.cached_block(h) else {
                break;
            };
            let Ok(bytes) = self.cache.read_block(block) else {
                break;
            };
            out.push(BlockData { hash: *h, bytes });
        }
        self.metrics
            .record_transfer_blocks("sent", out.len() as u64);
        out
    }

    /// Blocks of this cache that fit in one transfer frame.
    fn spec_blocks_per_frame(&self) -> usize {
        BlockSpec {
            model: String::new(),
            block_size: self.cache.block_size as u32,
            n_layer: self.cache.keys.len() as u32,
            slot_width: self.cache.slot_width as u32,
            dtype: self.cache.dtype,
        }
        .blocks_per_frame()
    }

    /// Keeps `running[index]`'s full prompt blocks (the cached leading run of them) under
    /// its pin, making room within the pins' cap by dropping the oldest pins first.
    fn pin_finished(&mut self, index: usize) -> Vec<u32> {
        let bs = self.scheduler.config.block_size;
        let seq = &self.scheduler.running[index];
        let Some(id) = seq.pin.clone() else {
            return Vec::new();
        };
        let n = (seq.prompt_len / bs).min(seq.block_hashes.len());
        let hashes: Vec<HashKey> = seq.block_hashes[..n].to_vec();
        let hits = self
            .scheduler
            .pool
            .count_hits(&hashes)
            .min(self.max_pinned_blocks);
        if hits == 0 {
            // Nothing to keep (a prompt shorter than a block): no pin, so every pin holds
            // at least one block and their number is bounded by the cap.
            return Vec::new();
        }
        while self.pinned_total + hits > self.max_pinned_blocks {
            let Some(oldest) = self
                .pins
                .iter()
                .min_by_key(|(_, p)| p.expires)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            tracing::debug!(pin = %oldest, "pinned blocks at their cap; releasing the oldest pin");
            self.release_pin(&oldest);
        }
        let blocks = self.scheduler.pool.acquire_cached(&hashes[..hits]);
        self.pinned_total += blocks.len();
        let pin = self.pins.entry(id).or_insert_with(|| Pin {
            blocks: Vec::new(),
            expires: Instant::now(),
        });
        pin.blocks.extend_from_slice(&blocks);
        pin.expires = Instant::now() + self.pin_timeout;
        blocks
    }

    fn release_pin(&mut self, id: &str) {
        if let Some(pin) = self.pins.remove(id) {
            self.pinned_total -= pin.blocks.len();
            self.scheduler.pool.release(&pin.blocks);
        }
    }

    /// Releases every pin whose time is up.
    fn expire_pins(&mut self, now: Instant) {
        if self.pins.is_empty() {
            return;
        }
        let expired: Vec<String> = self
            .pins
            .iter()
            .filter(|(_, p)| p.expires <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for id in expired {
            tracing::debug!(pin = %id, "pin expired unpulled");
            self.release_pin(&id);
        }
    }

    fn flush_kv_events(&mut self) {
        let mut events = self.scheduler.pool.take_events();
        self.cached_index.apply(&events);
        events.append(&mut self.tier.events);
        if let (Some(sink), false) = (self.kv_events.as_mut(), events.is_empty()) {
            sink(events, self.scheduler.config.block_size);
        }
    }

    /// Aborts sequences nobody listens to any more, freeing their blocks.
    fn drop_abandoned(&mut self) {
        let mut i = 0;
        while i < self.scheduler.running.len() {
            if self.scheduler.running[i].is_abandoned() {
                let seq = self.scheduler.finish_running(i);
                self.finish(seq, FinishReason::Abort, None, Vec::new());
            } else {
                i += 1;
            }
        }
        let waiting = std::mem::take(&mut self.scheduler.waiting);
        for seq in waiting {
            if seq.is_abandoned() {
                self.finish(seq, FinishReason::Abort, None, Vec::new());
            } else {
                self.scheduler.waiting.push_back(seq);
            }
        }
    }

    fn publish_gauges(&self) {
        let waiting = self.scheduler.waiting.len();
        let running = self.scheduler.running.len();
        // Submissions racing with this store are counted again at the next step.
        self.shared.waiting.store(waiting, Ordering::Release);
        self.shared.running.store(running, Ordering::Release);
        self.metrics.set_queue(waiting, running);
        self.metrics
            .kv_cache_usage_perc
            .set(self.scheduler.pool.usage());
        self.metrics
            .set_tier_blocks(self.scheduler.pool.num_cached(), self.tier.announced.len());
        if let Some(max) = self.scheduler.max_loras {
            self.metrics.set_lora_info(
                max,
                &self.scheduler.running_loras(),
                &self.scheduler.waiting_loras(),
            );
        }
    }

    /// Appends n-gram proposals to every decoding sequence that may speculate, so the
    /// planner schedules them with its pending token.
    fn propose_drafts(&mut self) {
        let Some(spec) = self.speculative else {
            return;
        };
        let ctx = self.model.config.context_len;
        // Sequences decoding this step: extra rows cost more the more of them there are.
        let batch = self
            .scheduler
            .running
            .iter()
            .filter(|s| s.num_pending() == 1)
            .count();
        let max = spec.num_speculative_tokens;
        let prices = match spec.row_cost {
            Some(c) => linear_prices(c, batch, max),
            None => {
                let fallback = self.step_costs.row_cost().unwrap_or(PRIOR_ROW_COST);
                self.step_costs.prices(batch, max, fallback)
            }
        };
        for seq in self.scheduler.running.iter_mut() {
            if !seq.speculative
                || seq.grammar.is_some()
                || seq.num_pending() != 1
                || seq.num_output() == 0
            {
                continue;
            }
            let budget = seq.spec.budget(&spec, batch, &prices);
            if budget == 0 {
                continue;
            }
            // Room for every proposal plus the token sampled after them, within both
            // max_tokens and the context.
            let by_length = seq.max_tokens.saturating_sub(seq.num_output() + 1);
            let by_context = ctx.saturating_sub(seq.tokens.len() + 1);
            let drafts = propose(&seq.tokens, &spec, budget.min(by_length).min(by_context));
            seq.num_draft = drafts.len();
            seq.tokens.extend_from_slice(&drafts);
        }
    }

    /// After planning: proposals of a preempted, unscheduled or partly scheduled sequence
    /// are dropped (a partly scheduled one runs just its pending token). Returns which
    /// running sequences carried proposals into planning, so their spare blocks can be
    /// released after the step.
    fn settle_drafts(&mut self, plan: &mut StepPlan) -> Vec<bool> {
        let bs = self.scheduler.config.block_size;
        for seq in self.scheduler.waiting.iter_mut() {
            if seq.num_draft > 0 {
                seq.drop_drafts();
                seq.block_hashes.truncate(seq.tokens.len() / bs);
            }
        }
        let running = &mut self.scheduler.running;
        let mut had = vec![false; running.len()];
        let mut planned: Vec<Option<usize>> = vec![None; running.len()];
        for (k, w) in plan.work.iter().enumerate() {
            planned[w.index] = Some(k);
        }
        for (i, seq) in running.iter_mut().enumerate() {
            if seq.num_draft == 0 {
                continue;
            }
            had[i] = true;
            match planned[i] {
                Some(k) if plan.work[k].num_tokens == seq.num_pending() => {}
                Some(k) => {
                    seq.drop_drafts();
                    plan.work[k].num_tokens = 1;
                }
                None => seq.drop_drafts(),
            }
        }
        had
    }

    fn step(&mut self) {
        self.propose_drafts();
        let cache = &mut self.cache;
        let offload = self.offload.as_ref();
        let tier = &mut self.tier;
        let metrics = &*self.metrics;
        let mut plan = self.scheduler.schedule_with(&mut |pool, seq| {
            install_imported(pool, cache, offload, tier, metrics, seq)
        });
        // Admissions and growth may have evicted cached blocks: copy them out before this
        // step's forward writes into them.
        copy_evicted(
            &mut self.scheduler.pool,
            &self.cache,
            self.offload.as_ref(),
            &mut self.tier,
            &self.metrics,
        );
        let had_drafts = self.settle_drafts(&mut plan);
        if plan.num_preempted > 0 {
            self.metrics
                .num_preemptions
                .inc_by(plan.num_preempted as u64);
        }
        self.metrics
            .prefix_cache_queries
            .inc_by(plan.prefix_queries as u64);
        self.metrics
            .prefix_cache_hits
            .inc_by(plan.prefix_hits as u64);
        if plan.work.is_empty() {
            return;
        }
        self.metrics
            .record_step(plan.work.iter().map(|w| w.num_tokens).sum());
        let now = Instant::now();
        // A step of decode rows only (each sequence's pending token and proposals) is
        // timed for the speculative row price.
        let mut decode_only = true;
        let mut tails = Vec::with_capacity(plan.work.len());
        let mut loras = Vec::with_capacity(plan.work.len());
        let inputs: Vec<SeqInput<'_>> = plan
            .work
            .iter()
            .map(|w| {
                let seq = &self.scheduler.running[w.index];
                let start = seq.num_computed;
                let complete = start + w.num_tokens == seq.tokens.len();
                // The pending token's row and one per proposal.
                tails.push(if complete { 1 + seq.num_draft } else { 0 });
                decode_only &= complete && start >= seq.prompt_len;
                loras.push(seq.lora.as_deref());
                SeqInput {
                    tokens: &seq.tokens[start..start + w.num_tokens],
                    start_pos: start,
                    block_table: &seq.block_table,
                    want_logits: complete,
                    prompt_len: seq.prompt_len,
                }
            })
            .collect();
        let result = self
            .model
            .forward_rows_lora(&mut self.cache, &inputs, &tails, &loras);
        drop(inputs);
        drop(loras);
        // The step's cost feeds the planner's step-time budget.
        let step_tokens: usize = plan.work.iter().map(|w| w.num_tokens).sum();
        self.scheduler
            .observe_step(step_tokens, now.elapsed().as_secs_f64());
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed; aborting the step's sequences");
                let mut indices: Vec<usize> = plan.work.iter().map(|w| w.index).collect();
                indices.sort_unstable_by(|a, b| b.cmp(a));
                for i in indices {
                    let seq = self.scheduler.finish_running(i);
                    self.finish(seq, FinishReason::Error(e.to_string()), None, Vec::new());
                }
                return;
            }
        };

        let running = &mut self.scheduler.running;
        let mut row_logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); running.len()];
        for (w, logits) in plan.work.iter().zip(logits) {
            let seq = &mut running[w.index];
            if seq.times.first_scheduled.is_none() {
                seq.times.first_scheduled = Some(now);
            }
            seq.num_computed += w.num_tokens;
            row_logits[w.index] = logits;
        }
        let mut samples = sample_all(running, row_logits, &self.eos_ids);
        if decode_only && self.speculative.is_some() {
            // With sampling, which every extra row also pays for.
            self.step_costs
                .observe(step_tokens, now.elapsed().as_secs_f64());
        }

        let mut finished: Vec<(usize, FinishReason, Option<String>)> = Vec::new();
        for w in &plan.work {
            let Some(sample) = samples[w.index].take() else {
                continue;
            };
            let seq = &mut self.scheduler.running[w.index];
            let proposed = seq.num_draft;
            // Rows were sampled in order until one disagreed with its proposal: all
            // but the last sampled token confirmed a proposal.
            let accepted = sample.outs.len().saturating_sub(1).min(proposed);
            if proposed > 0 {
                self.metrics.spec_decode.record(proposed, accepted);
                seq.spec.record(proposed, accepted);
            }
            seq.drop_drafts();
            // Keys and values stay valid up to the last accepted proposal; the rejected
            // ones' slots are rewritten when those positions are computed again.
            seq.num_computed = seq.tokens.len() + accepted;
            if let Some(err) = sample.error {
                seq.num_computed = seq.num_computed.min(seq.tokens.len());
                finished.push((w.index, FinishReason::Error(err), None));
                continue;
            }
            let last = sample.outs.len().saturating_sub(1);
            for (j, out) in sample.outs.into_iter().enumerate() {
                if let Some(reason) = self.emit(w.index, out, sample.grammar_done && j == last) {
                    finished.push((w.index, reason.0, reason.1));
                    break;
                }
            }
            let seq = &mut self.scheduler.running[w.index];
            seq.num_computed = seq.num_computed.min(seq.tokens.len().saturating_sub(1));
        }
        // Give back the blocks of rejected proposals.
        for (i, had) in had_drafts.into_iter().enumerate() {
            if had {
                self.scheduler.release_unneeded_blocks(i);
            }
        }
        // Name the blocks this step filled before finished sequences release theirs.
        self.scheduler.commit_full_blocks();
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason, stop) in finished {
            // A prefill's prompt blocks outlive it under its pin (not when it failed).
            let pinned = match reason {
                FinishReason::Stop | FinishReason::Length => self.pin_finished(i),
                _ => Vec::new(),
            };
            let seq = self.scheduler.finish_running(i);
            self.finish(seq, reason, stop, pinned);
        }
    }

    /// Appends one sampled token to `running[index]`, streams it and returns why the
    /// sequence ends there, if it does. `grammar_done`: the structured-output grammar is
    /// complete with this token.
    fn emit(
        &mut self,
        index: usize,
        out: SampleOutput,
        grammar_done: bool,
    ) -> Option<(FinishReason, Option<String>)> {
        let seq = &mut self.scheduler.running[index];
        seq.tokens.push(out.token);
        self.metrics.generation_tokens.inc();
        let t = Instant::now();
        match seq.times.last_token {
            None => {
                seq.times.first_token = Some(t);
                // Like vLLM: the whole prompt, cached or not, once per request.
                self.metrics.record_prompt_sources(
                    seq.prompt_len,
                    seq.cached_tokens,
                    seq.imported_tokens,
                );
                self.metrics
                    .time_to_first_token
                    .observe((t - seq.times.arrival).as_secs_f64());
            }
            Some(prev) => self
                .metrics
                .inter_token_latency
                .observe((t - prev).as_secs_f64()),
        }
        seq.times.last_token = Some(t);

        let config = seq.sampler.config();
        let is_eos = self.eos_ids.contains(&out.token);
        let is_stop_token = (!config.ignore_eos && is_eos)
            || config.stop_token_ids.contains(&out.token)
            || (grammar_done && is_eos);
        let wants_logprobs = config.logprobs.is_some();
        let text = if is_stop_token {
            String::new()
        } else {
            seq.decoder
                .push(&self.tokenizer, out.token)
                .unwrap_or_default()
        };
        let step = seq.stop.push(&text);
        let logprob = wants_logprobs.then_some(TokenLogprob {
            logprob: out.logprob,
            top: out.top_logprobs,
        });
        let _ = seq.events.send(SeqEvent::Token {
            token: out.token,
            text: step.emit,
            logprob,
        });
        if is_stop_token {
            let stop = self
                .tokenizer
                .token_str(out.token)
                .ok()
                .map(|s| s.to_string());
            Some((FinishReason::Stop, stop))
        } else if let Some(s) = step.stopped {
            Some((FinishReason::Stop, Some(s)))
        } else if grammar_done {
            // The grammar is complete and nothing can follow: the structured output ends.
            Some((FinishReason::Stop, None))
        } else if seq.num_output() >= seq.max_tokens
            || seq.tokens.len() >= self.model.config.context_len
        {
            Some((FinishReason::Length, None))
        } else {
            None
        }
    }

    /// Reports the end of a sequence (its blocks are already released) and records metrics.
    fn finish(
        &mut self,
        mut seq: Sequence,
        reason: FinishReason,
        stop: Option<String>,
        pinned_blocks: Vec<u32>,
    ) {
        // Release text still held by the decoder or the stop matcher, unless the client is
        // gone. After a stop-string match the matcher releases nothing.
        let mut text = String::new();
        if reason != FinishReason::Abort {
            let rest = seq.decoder.finish();
            let step = seq.stop.push(&rest);
            text = step.emit;
            text.push_str(&seq.stop.flush());
        }
        let now = Instant::now();
        let t = seq.times;
        self.metrics.record_finish(reason.as_str());
        self.metrics.record_request(FinishedRequest {
            prompt_tokens: seq.prompt_len,
            generation_tokens: seq.num_output(),
            cached_tokens: seq.cached_tokens,
            inference_time: t.first_scheduled.map(|s| now.duration_since(s)),
        });
        self.metrics
            .e2e_request_latency
            .observe((now - t.arrival).as_secs_f64());
        if let Some(s) = t.first_scheduled {
            self.metrics
                .request_queue_time
                .observe((s - t.arrival).as_secs_f64());
            if let Some(f) = t.first_token {
                self.metrics
                    .request_prefill_time
                    .observe((f - s).as_secs_f64());
                let last = t.last_token.unwrap_or(f);
                self.metrics
                    .request_decode_time
                    .observe((last - f).as_secs_f64());
                let n = seq.num_output();
                if n > 1 {
                    self.metrics
                        .time_per_output_token
                        .observe((last - f).as_secs_f64() / (n - 1) as f64);
                }
            }
        }
        let _ = seq.events.send(SeqEvent::Finished {
            reason,
            stop,
            text,
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.num_output(),
            cached_tokens: seq.cached_tokens,
            times: t,
            pinned_blocks,
        });
    }
}

/// One sequence's sampling result for a step.
struct SeqSample {
    /// Tokens sampled from the rows in order, stopping after the first that differs from
    /// its proposal (or at the last row).
    outs: Vec<SampleOutput>,
    /// The structured-output grammar is complete after the last of `outs`.
    grammar_done: bool,
    /// The grammar failed; the sequence ends with this error.
    error: Option<String>,
}

/// Samples one sequence's rows: row `i` is the distribution after the pending token and
/// the first `i` proposals. Penalties see exactly the tokens a one-at-a-time decode would
/// have seen, and each sample is one draw from the sequence's own random stream, so an
/// accepted proposal is the token the same seed would have produced without speculation.
fn sample_seq(seq: &mut Sequence, rows: Vec<Vec<f32>>, eos_ids: &[u32]) -> Option<SeqSample> {
    if rows.is_empty() {
        return None;
    }
    let mut result = SeqSample {
        outs: Vec::with_capacity(rows.len()),
        grammar_done: false,
        error: None,
    };
    let proposed = seq.num_draft;
    let base = seq.tokens.len() - proposed;
    for (i, mut logits) in rows.into_iter().enumerate() {
        let allowed = match seq.grammar.as_mut().map(|g| g.mask_logits(&mut logits)) {
            None => None,
            Some(Ok(a)) => Some(a),
            Some(Err(e)) => {
                result.error = Some(e.to_string());
                return Some(result);
            }
        };
        let (prompt, output) = seq.tokens[..base + i].split_at(seq.prompt_len);
        let mut out = seq.sampler.sample(&mut logits, prompt, output, eos_ids);
        if let (Some(g), Some(allowed)) = (seq.grammar.as_mut(), allowed) {
            if !allowed.contains(out.token) {
                // Sampling's own masks removed every token the grammar allows (only
                // `min_tokens` hiding EOS can): the grammar wins.
                out.token = allowed.best;
            }
            match g.accept(out.token) {
                Ok(GrammarStep::Done) => result.grammar_done = true,
                Ok(GrammarStep::Continue) => {}
                Err(e) => {
                    result.error = Some(e.to_string());
                    return Some(result);
                }
            }
        }
        let confirms = i < proposed && seq.tokens[base + i] == out.token;
        result.outs.push(out);
        if !confirms {
            break;
        }
    }
    Some(result)
}

/// Samples every sequence given its logit rows (`logits[i]` belongs to `running[i]`).
/// Each sequence has its own sampler, random stream and grammar, so the sequences are
/// sampled (and their grammar masks computed) in parallel with the same results as one
/// after another.
fn sample_all(
    running: &mut [Sequence],
    logits: Vec<Vec<Vec<f32>>>,
    eos_ids: &[u32],
) -> Vec<Option<SeqSample>> {
    let sample = |(seq, rows): (&mut Sequence, Vec<Vec<f32>>)| sample_seq(seq, rows, eos_ids);
    if logits.iter().filter(|r| !r.is_empty()).count() > 1 {
        running.par_iter_mut().zip(logits).map(sample).collect()
    } else {
        running.iter_mut().zip(logits).map(sample).collect()
    }
}

/// The block hash of a sequence with a LoRA adapter: the adapter's name is an extra key of
/// every block, ahead of the salt (PROTOCOLS §3).
fn lora_block_hash_fn(seed: &str, block_size: usize) -> LoraBlockHashFn {
    let hasher = BlockHasher::new(seed, block_size);
    Box::new(move |parent, tokens, lora, salt| {
        let parent = parent.map(|p| BlockHash(*p));
        let extra = block_extra_keys(0, Some(lora), salt);
        hasher
            .hash_block(parent.as_ref(), tokens, extra.as_deref())
            .0
    })
}

/// The prefix-cache block hash (PROTOCOLS §3) as the scheduler calls it.
fn block_hash_fn(seed: &str, block_size: usize) -> BlockHashFn {
    let hasher = BlockHasher::new(seed, block_size);
    Box::new(move |parent, tokens, salt| {
        let parent = parent.map(|p| BlockHash(*p));
        // The scheduler passes the salt for the first block only.
        let extra = block_extra_keys(0, None, salt);
        let extra = extra.as_deref();
        hasher.hash_block(parent.as_ref(), tokens, extra).0
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::block_pool::EvictedBlock;
    use crate::sampler::SamplingConfig;
    use crate::scheduler::{Policy, SchedulerConfig, StepPlanner};
    use crate::sequence::{GenerationRequest, Sequence};
    use rand::Rng;

    const SEED: &str = "0";

    fn request(
        id: &str,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> (
        GenerationRequest,
        tokio::sync::mpsc::UnboundedReceiver<SeqEvent>,
    ) {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let req = GenerationRequest {
            request_id: id.to_string(),
            prompt,
            sampling: SamplingConfig {
                temperature: 0.0,
                ignore_eos: true,
                ..SamplingConfig::default()
            },
            max_tokens,
            stop: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            priority: 0,
            cache_salt: None,
            arrival: Instant::now(),
            events,
            grammar: None,
            speculative: false,
            lora: None,
            imported: Vec::new(),
            pin: None,
        };
        (req, rx)
    }

    fn seq(prompt: Vec<u32>) -> Sequence {
        let (req, _rx) = request("s", prompt, 4);
        Sequence::new(req, Sampler::new(SamplingConfig::default(), 0), 0)
    }

    /// A block's bytes for a cache of `bytes` per block: a pattern that names the block.
    fn pattern(tag: u8, bytes: usize) -> Vec<u8> {
        (0..bytes).map(|i| tag.wrapping_add(i as u8)).collect()
    }

    #[test]
    fn install_takes_the_matching_run_skips_cached_blocks_and_drops_the_rest() {
        let bs = 4;
        let hasher = BlockHasher::new(SEED, bs);
        let prompt: Vec<u32> = (1..=14).collect(); // 3 full blocks and 2 tokens
        let hashes = prompt_block_hashes(&hasher, &prompt, None, None);
        assert_eq!(hashes.len(), 3);
        let metrics = EngineMetrics::new("m", bs, 8);
        let mut tier = TierState::new(8);

        let mut pool = BlockPool::new(8, true);
        let mut cache = KvCache::with_dtype(2, 8, bs, 3, KvDtype::F16);
        let n = cache.block_bytes();
        // Block 1 of the prompt is cached here already.
        let b = pool.allocate(1).unwrap();
        pool.commit(b[0], hashes[1], Some(hashes[0]), &prompt[4..8]);
        pool.release(&b);
        pool.take_events();

        // Blocks 0..3 arrive; block 2 has the wrong size: it is dropped.
        let mut s = seq(prompt.clone());
        s.block_hashes = hashes.clone();
        s.imported = vec![
            BlockData {
                hash: hashes[0],
                bytes: pattern(10, n),
            },
            BlockData {
                hash: hashes[1],
                bytes: pattern(20, n),
            },
            BlockData {
                hash: hashes[2],
                bytes: pattern(30, n - 1),
            },
        ];
        install_imported(&mut pool, &mut cache, None, &mut tier, &metrics, &mut s);
        assert!(s.imported.is_empty(), "taken");
        assert_eq!(s.installed, vec![0]);
        let b0 = pool.cached_block(&hashes[0]).expect("installed");
        assert_eq!(cache.read_block(b0).unwrap(), pattern(10, n));
        assert_eq!(
            pool.cached_block(&hashes[1]),
            Some(b[0]),
            "kept, not replaced"
        );
        assert_eq!(pool.cached_block(&hashes[2]), None);
        assert_eq!(pool.num_free(), 8, "every block back in the free queue");
        assert_eq!(
            pool.take_events(),
            vec![PoolEvent::Stored {
                hash: hashes[0],
                parent: None,
                tokens: prompt[..4].to_vec(),
                lora: None,
            }]
        );

        // A run that starts later in the prompt: its first block's parent is named.
        let mut s = seq(prompt.clone());
        s.block_hashes = hashes.clone();
        s.imported = vec![BlockData {
            hash: hashes[2],
            bytes: pattern(30, n),
        }];
        install_imported(&mut pool, &mut cache, None, &mut tier, &metrics, &mut s);
        assert_eq!(s.installed, vec![2]);
        assert!(matches!(
            &pool.take_events()[..],
            [PoolEvent::Stored { hash, parent: Some(p), .. }] if *hash == hashes[2] && *p == hashes[1]
        ));

        // Blocks of another prompt, or past the prompt's full blocks, install nothing.
        let other = prompt_block_hashes(&hasher, &[9; 8], None, None);
        let mut s = seq(prompt.clone());
        s.block_hashes = hashes.clone();
        s.imported = vec![BlockData {
            hash: other[0],
            bytes: pattern(1, n),
        }];
        install_imported(&mut pool, &mut cache, None, &mut tier, &metrics, &mut s);
        assert!(s.installed.is_empty());
        assert!(pool.take_events().is_empty());
        assert_eq!(pool.num_free(), 8);
    }

    #[test]
    fn evicted_blocks_are_copied_before_an_install_overwrites_them() {
        let bs = 4;
        let hasher = BlockHasher::new(SEED, bs);
        let metrics = EngineMetrics::new("m", bs, 2);
        let mut tier = TierState::new(2);
        let mut pool = BlockPool::new(2, true);
        pool.set_track_evictions(true);
        let mut cache = KvCache::with_dtype(1, 2, bs, 2, KvDtype::F32);
        let n = cache.block_bytes();
        // Both blocks hold an old prompt's cached blocks.
        let old: Vec<u32> = (100..108).collect();
        let old_hashes = prompt_block_hashes(&hasher, &old, None, None);
        let held = pool.allocate(2).unwrap();
        for (i, &b) in held.iter().enumerate() {
            cache.write_block(b, &pattern(50 + i as u8, n)).unwrap();
            let parent = i.checked_sub(1).map(|p| old_hashes[p]);
            pool.commit(b, old_hashes[i], parent, &old[i * bs..(i + 1) * bs]);
        }
        pool.release(&held);

        let prompt: Vec<u32> = (1..=9).collect();
        let hashes = prompt_block_hashes(&hasher, &prompt, None, None);
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let mut s = seq(prompt);
        s.block_hashes = hashes.clone();
        s.imported = hashes
            .iter()
            .map(|h| BlockData {
                hash: *h,
                bytes: pattern(7, n),
            })
            .collect();
        install_imported(
            &mut pool,
            &mut cache,
            Some(&tx),
            &mut tier,
            &metrics,
            &mut s,
        );
        assert_eq!(s.installed, vec![0, 1]);
        // The queue holds one: the first eviction's copy went out with the old bytes (the
        // tail block, evicted first), the second was dropped and counted.
        let copy = rx.try_recv().expect("one copy");
        assert_eq!(copy.hash, old_hashes[1]);
        assert_eq!(copy.bytes, pattern(51, n));
        assert!(rx.try_recv().is_err());
        assert_eq!(metrics.kv_offload_dropped.get(), 1);
        assert_eq!(tier.remembered.len(), 1);
        // The tier acknowledges it: a CPU-medium store with the block's own parent and
        // tokens goes out.
        tier.apply(TierChange::Stored(vec![old_hashes[1], old_hashes[0]]));
        assert_eq!(
            tier.events,
            vec![PoolEvent::TierStored {
                hash: old_hashes[1],
                parent: Some(old_hashes[0]),
                tokens: old[4..8].to_vec(),
                lora: None,
            }]
        );
        assert_eq!(tier.remembered.len(), 0);
        assert_eq!(tier.announced.len(), 1);
        let _ = EvictedBlock {
            block: 0,
            hash: [0; 32],
            parent: None,
            tokens: Vec::new(),
            lora: None,
        };
    }

    #[test]
    fn tier_announcements_stay_bounded_and_are_withdrawn_on_removal_or_loss() {
        let mut tier = TierState {
            remembered: Bounded::new(3),
            announced: Bounded::new(2),
            events: Vec::new(),
        };
        let h = |i: u8| [i; 32];
        let meta = |i: u8| TierMeta {
            parent: None,
            tokens: vec![u32::from(i)],
            lora: None,
        };
        for i in 1..=4 {
            tier.remembered.insert(h(i), meta(i));
        }
        // Remembered past its cap: the oldest (1) is forgotten and never announced.
        assert_eq!(tier.remembered.len(), 3);
        tier.apply(TierChange::Stored(vec![h(1), h(2), h(3)]));
        let stored = |e: &PoolEvent| match e {
            PoolEvent::TierStored { hash, .. } => Some(hash[0]),
            _ => None,
        };
        let removed = |e: &PoolEvent| match e {
            PoolEvent::TierRemoved { hash } => Some(hash[0]),
            _ => None,
        };
        let ev = std::mem::take(&mut tier.events);
        assert_eq!(ev.iter().filter_map(stored).collect::<Vec<_>>(), vec![2, 3]);
        assert!(ev.iter().all(|e| removed(e).is_none()));
        // A third announcement pushes the oldest (2) out, withdrawn at once.
        tier.apply(TierChange::Stored(vec![h(4)]));
        let ev = std::mem::take(&mut tier.events);
        assert_eq!(ev.iter().filter_map(stored).collect::<Vec<_>>(), vec![4]);
        assert_eq!(ev.iter().filter_map(removed).collect::<Vec<_>>(), vec![2]);
        assert_eq!(tier.announced.len(), 2);
        // Removal of an announced block withdraws it; of an unknown one, nothing.
        tier.apply(TierChange::Removed(vec![h(3), h(9)]));
        let ev = std::mem::take(&mut tier.events);
        assert_eq!(ev.iter().filter_map(removed).collect::<Vec<_>>(), vec![3]);
        assert_eq!(ev.len(), 1);
        // A lost log withdraws whatever is still announced.
        tier.remembered.insert(h(5), meta(5));
        tier.apply(TierChange::Stored(vec![h(5)]));
        tier.events.clear();
        tier.apply(TierChange::Lost);
        let mut gone: Vec<u8> = tier.events.iter().filter_map(removed).collect();
        gone.sort();
        assert_eq!(gone, vec![4, 5]);
        assert_eq!(tier.announced.len(), 0);
        // Announcing the same block twice emits it once.
        tier.events.clear();
        tier.remembered.insert(h(6), meta(6));
        tier.apply(TierChange::Stored(vec![h(6)]));
        tier.remembered.insert(h(6), meta(6));
        tier.apply(TierChange::Stored(vec![h(6)]));
        assert_eq!(tier.events.iter().filter_map(stored).count(), 1);
    }

    #[test]
    fn the_handles_block_hashes_are_the_schedulers_names_with_salt_and_adapter() {
        use crate::lora::adapter::tests::{tiny_base, tmp, write_adapter};
        let bs = 4;
        let dir = tmp("engine-hashes");
        write_adapter(&dir, 2, false);
        let mut adapter =
            crate::lora::LoraAdapter::load_peft("sql", &dir, &tiny_base(), 8).unwrap();
        adapter.id = 3;
        let adapter = Arc::new(adapter);
        let hasher = BlockHasher::new(SEED, bs);
        let prompt: Vec<u32> = (20..33).collect(); // 3 full blocks
        let cases: [(Option<&str>, bool); 4] = [
            (None, false),
            (Some("salt"), false),
            (None, true),
            (Some("salt"), true),
        ];
        let mut seen = HashSet::new();
        for (salt, with_lora) in cases {
            let mut planner = StepPlanner::new(
                SchedulerConfig {
                    block_size: bs,
                    max_num_seqs: 4,
                    max_num_batched_tokens: 64,
                    policy: Policy::Fcfs,
                },
                16,
                Some(block_hash_fn(SEED, bs)),
            );
            planner.set_lora_hash(lora_block_hash_fn(SEED, bs));
            let mut s = seq(prompt.clone());
            s.cache_salt = salt.map(str::to_string);
            s.lora = with_lora.then(|| adapter.clone());
            planner.add(s);
            planner.schedule();
            let q = &mut planner.running[0];
            q.num_computed = q.tokens.len();
            planner.commit_full_blocks();
            let committed: Vec<HashKey> = planner
                .pool
                .take_events()
                .into_iter()
                .filter_map(|e| match e {
                    PoolEvent::Stored { hash, .. } => Some(hash),
                    _ => None,
                })
                .collect();
            let ours = prompt_block_hashes(&hasher, &prompt, salt, with_lora.then_some("sql"));
            assert_eq!(committed, ours, "salt {salt:?}, lora {with_lora}");
            assert_eq!(ours.len(), 3);
            assert!(seen.insert(ours[0]), "each naming differs");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Random admissions with good, bad and partial imports, growth, preemption and
    /// finishes over a small pool: every block's references are exactly the running
    /// sequences' tables holding it, at every step and at the end.
    #[test]
    fn installs_finishes_and_preemptions_leak_no_block() {
        let bs = 4;
        let num_blocks = 14;
        let hasher = BlockHasher::new(SEED, bs);
        let metrics = EngineMetrics::new("m", bs, num_blocks);
        let mut tier = TierState::new(num_blocks);
        let mut cache = KvCache::with_dtype(1, num_blocks, bs, 2, KvDtype::F16);
        let n = cache.block_bytes();
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let mut planner = StepPlanner::new(
            SchedulerConfig {
                block_size: bs,
                max_num_seqs: 6,
                max_num_batched_tokens: 32,
                policy: Policy::Fcfs,
            },
            num_blocks,
            Some(block_hash_fn(SEED, bs)),
        );
        planner.pool.set_track_evictions(true);
        let mut rng = StdRng::seed_from_u64(21);
        let mut installed_total = 0;
        let mut preempted = 0;
        for round in 0..400 {
            if rng.random_bool(0.4) {
                // Prompts share one of three prefixes, so imports meet cached blocks.
                let prefix = rng.random_range(0..3u32);
                let len = rng.random_range(5..30usize);
                let prompt: Vec<u32> = (0..len as u32)
                    .map(|i| {
                        if i < 12 {
                            prefix * 100 + i
                        } else {
                            round * 7 + i
                        }
                    })
                    .collect();
                let hashes = prompt_block_hashes(&hasher, &prompt, None, None);
                let mut s = seq(prompt);
                s.max_tokens = rng.random_range(1..24);
                let from = rng.random_range(0..=hashes.len());
                let mut imported: Vec<BlockData> = hashes[from..]
                    .iter()
                    .map(|h| BlockData {
                        hash: *h,
                        bytes: vec![1; n],
                    })
                    .collect();
                match rng.random_range(0..4) {
                    0 => imported.clear(),
                    1 if !imported.is_empty() => {
                        let at = rng.random_range(0..imported.len());
                        imported[at].bytes.pop();
                    }
                    2 if !imported.is_empty() => {
                        let at = rng.random_range(0..imported.len());
                        imported[at].hash[0] ^= 1;
                    }
                    _ => {}
                }
                s.imported = imported;
                planner.add(s);
            }
            let offload = Some(&tx);
            let plan = planner.schedule_with(&mut |pool, s| {
                install_imported(pool, &mut cache, offload, &mut tier, &metrics, s)
            });
            copy_evicted(&mut planner.pool, &cache, Some(&tx), &mut tier, &metrics);
            while rx.try_recv().is_ok() {}
            preempted += plan.num_preempted;
            for w in &plan.work {
                let q = &mut planner.running[w.index];
                q.num_computed += w.num_tokens;
                if q.num_computed == q.tokens.len() {
                    q.tokens.push(rng.random_range(1..50));
                }
            }
            planner.commit_full_blocks();
            let mut i = 0;
            while i < planner.running.len() {
                let q = &planner.running[i];
                if q.num_output() >= q.max_tokens || rng.random_bool(0.02) {
                    let done = planner.finish_running(i);
                    installed_total += done.installed.len();
                } else {
                    i += 1;
                }
            }
            check_references(&planner);
        }
        while !planner.running.is_empty() {
            planner.finish_running(0);
        }
        planner.waiting.clear();
        check_references(&planner);
        assert_eq!(planner.pool.num_free(), num_blocks);
        assert!(installed_total > 0, "some imports were installed");
        assert!(preempted > 0, "the pool was tight enough to preempt");
    }

    fn check_references(planner: &StepPlanner) {
        let pool = &planner.pool;
        let mut held = vec![0u32; pool.num_blocks()];
        for q in &planner.running {
            for &b in &q.block_table {
                held[b as usize] += 1;
            }
        }
        for (b, &n) in held.iter().enumerate() {
            assert_eq!(pool.ref_count(b as u32), n, "block {b}");
        }
        assert_eq!(
            pool.num_free(),
            held.iter().filter(|&&n| n == 0).count(),
            "free means unreferenced"
        );
    }

    #[test]
    fn the_model_identity_follows_the_weights_bytes() {
        let dir = std::env::temp_dir().join(format!("strata-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b, c) = (dir.join("a"), dir.join("b"), dir.join("c"));
        std::fs::write(&a, b"weights one").unwrap();
        std::fs::write(&b, b"weights two").unwrap();
        std::fs::write(&c, b"weights one").unwrap();
        let cell = |path: Option<PathBuf>| SpecCell {
            dims: BlockSpec {
                model: String::new(),
                block_size: 16,
                n_layer: 2,
                slot_width: 8,
                dtype: KvDtype::F16,
            },
            arch: "llama:test".into(),
            weights_path: path,
            spec: OnceLock::new(),
        };
        let spec_a = cell(Some(a.clone())).get();
        assert_eq!(spec_a.block_size, 16);
        assert!(
            spec_a.model.starts_with("llama:test;sha256:"),
            "{}",
            spec_a.model
        );
        // Same bytes at another path: the same model; other bytes: another model.
        assert_eq!(cell(Some(c)).get(), spec_a);
        assert_ne!(cell(Some(b)).get().model, spec_a.model);
        // Computed once: a cell keeps its identity even if the file changes later.
        let once = cell(Some(a.clone()));
        let first = once.get();
        std::fs::write(&a, b"changed").unwrap();
        assert_eq!(once.get(), first);
        // Without readable weights, every engine is a model of its own.
        let missing = cell(Some(dir.join("missing"))).get();
        assert_ne!(missing.model, cell(Some(dir.join("missing"))).get().model);
        assert_ne!(cell(None).get().model, cell(None).get().model);
        assert!(missing.validate().is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    // --- The engine loop with the real model ---

    fn model() -> (Arc<Llama>, Arc<Tokenizer>, PathBuf) {
        static M: OnceLock<(Arc<Llama>, Arc<Tokenizer>, PathBuf)> = OnceLock::new();
        M.get_or_init(|| {
            let path = match std::env::var_os("STRATA_TEST_MODEL") {
                Some(p) => PathBuf::from(p),
                None => crate::model_cache::ModelCache::from_env()
                    .path_of(crate::model_cache::DEFAULT_MODEL),
            };
            assert!(
                path.is_file(),
                "the default model is missing at {}; run `cargo run -p strata-cli -- model pull`",
                path.display()
            );
            let mut file = crate::gguf::GgufFile::open(&path).unwrap();
            let tokenizer = Tokenizer::from_gguf(&file.content).unwrap();
            let model = Llama::from_gguf(&mut file, crate::model::WeightFormat::Gguf).unwrap();
            (Arc::new(model), Arc::new(tokenizer), path)
        })
        .clone()
    }

    fn engine_config(num_blocks: usize, pin_timeout: Duration) -> EngineConfig {
        let (_, _, path) = model();
        EngineConfig {
            block_size: 16,
            num_blocks,
            kv_dtype: KvDtype::F16,
            max_num_seqs: 4,
            max_num_batched_tokens: 512,
            max_waiting: 64,
            policy: Policy::Fcfs,
            seed: 0,
            prefix_caching: true,
            hash_seed: SEED.into(),
            speculative: None,
            max_loras: None,
            step_time_budget: None,
            pin_timeout,
            weights_path: Some(path),
        }
    }

    type Events = std::sync::mpsc::Receiver<Vec<PoolEvent>>;

    fn engine(
        config: EngineConfig,
        evicted: Option<tokio::sync::mpsc::Sender<BlockData>>,
    ) -> (EngineHandle, Events) {
        let (model, tokenizer, _) = model();
        let (tx, rx) = std::sync::mpsc::channel();
        let sink: KvEventSink = Box::new(move |events, _| {
            let _ = tx.send(events);
        });
        let metrics = Arc::new(EngineMetrics::new(
            "m",
            config.block_size,
            config.num_blocks,
        ));
        let (handle, _thread) = start(model, tokenizer, config, metrics, Some(sink), evicted);
        (handle, rx)
    }

    /// What one finished request produced.
    #[derive(Debug)]
    struct Done {
        tokens: Vec<u32>,
        cached: usize,
        pinned: Vec<u32>,
    }

    async fn generate(
        h: &EngineHandle,
        prompt: &[u32],
        max_tokens: usize,
        pin: Option<&str>,
        imported: Vec<BlockData>,
    ) -> Done {
        let (mut req, mut rx) = request("r", prompt.to_vec(), max_tokens);
        req.pin = pin.map(str::to_string);
        req.imported = imported;
        h.submit(req).unwrap();
        let mut tokens = Vec::new();
        let wait = Duration::from_secs(120);
        loop {
            match tokio::time::timeout(wait, rx.recv())
                .await
                .expect("engine answers")
            {
                Some(SeqEvent::Token { token, .. }) => tokens.push(token),
                Some(SeqEvent::Finished {
                    reason,
                    cached_tokens,
                    pinned_blocks,
                    ..
                }) => {
                    assert_eq!(reason, FinishReason::Length);
                    return Done {
                        tokens,
                        cached: cached_tokens,
                        pinned: pinned_blocks,
                    };
                }
                None => panic!("the engine dropped the request"),
            }
        }
    }

    fn prompt(tag: u32, len: usize) -> Vec<u32> {
        (0..len as u32)
            .map(|i| 200 + (i * 37 + tag * 11) % 4000)
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn imported_blocks_decode_the_same_greedy_tokens_as_computed_or_cached_ones() {
        let (prefill, _) = engine(engine_config(64, DEFAULT_PIN_TIMEOUT), None);
        let (decode, _) = engine(engine_config(64, DEFAULT_PIN_TIMEOUT), None);
        let p = prompt(1, 70); // 4 full blocks and 6 tokens
        let spec = prefill.block_spec();
        assert_eq!(spec, decode.block_spec(), "same weights, same spec");
        assert!(spec.model.contains("sha256:"), "{}", spec.model);
        assert!(spec.validate().is_ok());

        // Prefill role: one token, the 4 prompt blocks kept under the pin.
        let first = generate(&prefill, &p, 1, Some("req-1"), Vec::new()).await;
        assert_eq!(first.pinned.len(), 4);
        let stats = prefill.block_stats().await;
        assert_eq!((stats.pins, stats.pinned), (1, 4));
        let hashes = decode.block_hashes(&p, None, None);
        assert_eq!(hashes, prefill.block_hashes(&p, None, None));
        assert_eq!(hashes.len(), 4);
        assert_eq!(prefill.cached_index().leading(&hashes), 4);
        assert_eq!(decode.cached_index().leading(&hashes), 0);
        let mut shared = prefill.cached_index().len();
        assert_eq!(shared, prefill.cached_block_hashes().await.len());

        // The decoder pulls them (releasing the pin) and decodes from them.
        let blocks = prefill
            .export_blocks(hashes.clone(), Some("req-1".into()))
            .await;
        assert_eq!(blocks.len(), 4);
        assert!(blocks.iter().all(|b| b.bytes.len() == spec.block_bytes()));
        let stats = prefill.block_stats().await;
        assert_eq!((stats.pins, stats.pinned, stats.free), (0, 0, 64));
        let remote = generate(&decode, &p, 8, None, blocks).await;
        assert_eq!(remote.cached, 64, "the imported blocks are prefix hits");
        decode.block_stats().await; // after the finishing step's pool changes are published
        assert_eq!(decode.cached_index().leading(&hashes), 4);
        let page = decode.metrics.render();
        assert!(
            page.contains("strata:kv_transfer_blocks_total{direction=\"received\",model_name=\"m\",engine=\"0\"} 4")
                || page.lines().any(|l| l.starts_with("strata:kv_transfer_blocks_total")
                    && l.contains("received") && l.ends_with(" 4")),
            "{page}"
        );
        assert!(page
            .lines()
            .any(|l| l.contains("external_kv_transfer") && l.ends_with(" 64")));
        let sent = prefill.metrics.render();
        assert!(sent
            .lines()
            .any(|l| l.starts_with("strata:kv_transfer_blocks_total")
                && l.contains("sent")
                && l.ends_with(" 4")));

        // The same prompt from the prefill engine's own cache, and computed from scratch.
        let cached = generate(&prefill, &p, 8, None, Vec::new()).await;
        assert_eq!(cached.cached, 64);
        assert!(prefill.reset_prefix_cache().await);
        shared = prefill.cached_index().len();
        assert_eq!(shared, 0, "the index follows a reset");
        let computed = generate(&prefill, &p, 8, None, Vec::new()).await;
        assert_eq!(computed.cached, 0);
        assert_eq!(remote.tokens, computed.tokens);
        assert_eq!(cached.tokens, computed.tokens);
        assert_eq!(computed.tokens.len(), 8);

        // Imports that do not match the prompt are ignored: computed as usual.
        let other = prompt(2, 40);
        let wrong = prefill.export_blocks(hashes.clone(), None).await;
        let alone = generate(&decode, &other, 2, None, wrong).await;
        assert_eq!(alone.cached, 0);
        let stats = decode.block_stats().await;
        assert_eq!(
            stats.free, stats.num_blocks,
            "nothing held after the requests"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn pins_expire_unpulled_or_on_release_and_free_their_blocks() {
        // 10 blocks: pins hold at most 5 together.
        let (h, _) = engine(engine_config(10, Duration::from_secs(5)), None);
        let p = prompt(3, 40); // 2 full blocks
        let done = generate(&h, &p, 1, Some("a"), Vec::new()).await;
        assert_eq!(done.pinned.len(), 2);
        let done = generate(&h, &prompt(4, 40), 1, Some("b"), Vec::new()).await;
        assert_eq!(done.pinned.len(), 2);
        let stats = h.block_stats().await;
        assert_eq!((stats.pins, stats.pinned, stats.free), (2, 4, 6));
        // A prompt shorter than a block has nothing to pin.
        let short = generate(&h, &prompt(5, 10), 1, Some("s"), Vec::new()).await;
        assert!(short.pinned.is_empty());
        assert_eq!(h.block_stats().await.pins, 2);
        // A third pin would pass the cap: the oldest (a) is released for it.
        let c = prompt(6, 40);
        let done = generate(&h, &c, 1, Some("c"), Vec::new()).await;
        assert_eq!(done.pinned.len(), 2);
        let stats = h.block_stats().await;
        assert_eq!((stats.pins, stats.pinned, stats.free), (2, 4, 6));
        h.release_pin("b".into());
        h.release_pin("unknown".into());
        let stats = h.block_stats().await;
        assert_eq!((stats.pins, stats.pinned, stats.free), (1, 2, 8));
        // The idle loop wakes for the expiry on its own.
        let deadline = Instant::now() + Duration::from_secs(20);
        let stats = loop {
            let stats = h.block_stats().await;
            if stats.pins == 0 || Instant::now() > deadline {
                break stats;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!((stats.pins, stats.pinned, stats.free), (0, 0, 10));
        // The blocks stay cached (merely unpinned): an export still finds them.
        let hashes = h.block_hashes(&c, None, None);
        assert_eq!(h.export_blocks(hashes, None).await.len(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn evicted_blocks_go_to_the_offloader_and_tier_changes_become_cpu_events() {
        // 8 blocks of 16 tokens: a second prompt of 120 tokens takes all of them, evicting
        // the first one's blocks.
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let (h, events) = engine(engine_config(8, DEFAULT_PIN_TIMEOUT), Some(tx));
        let p = prompt(5, 50); // 3 full blocks
        generate(&h, &p, 1, None, Vec::new()).await;
        let hashes = h.block_hashes(&p, None, None);
        let before = h.export_blocks(hashes.clone(), None).await;
        assert_eq!(before.len(), 3);
        generate(&h, &prompt(6, 120), 1, None, Vec::new()).await;
        // The loop answers a command only after the step that finished the request has
        // published its pool changes (the index follows them).
        h.block_stats().await;
        assert_eq!(h.cached_index().leading(&hashes), 0, "evicted");
        let mut copies = HashMap::new();
        while let Ok(b) = rx.try_recv() {
            copies.insert(b.hash, b.bytes);
        }
        for b in &before {
            assert_eq!(copies.get(&b.hash), Some(&b.bytes), "copied intact");
        }
        // The tier takes them: CPU-medium stores with the blocks' parents and tokens.
        let stored: Vec<HashKey> = copies.keys().copied().collect();
        h.tier_changed(TierChange::Stored(stored.clone()));
        let stats = h.block_stats().await;
        assert_eq!(stats.tier_announced, stored.len());
        let mut tier_events = Vec::new();
        while let Ok(batch) = events.try_recv() {
            tier_events.extend(batch.into_iter().filter(|e| {
                matches!(
                    e,
                    PoolEvent::TierStored { .. } | PoolEvent::TierRemoved { .. }
                )
            }));
        }
        for (i, hash) in hashes.iter().enumerate() {
            let want = PoolEvent::TierStored {
                hash: *hash,
                parent: i.checked_sub(1).map(|p| hashes[p]),
                tokens: p[i * 16..(i + 1) * 16].to_vec(),
                lora: None,
            };
            assert!(tier_events.contains(&want), "block {i}");
        }
        let page = h.metrics.render();
        assert!(page.lines().any(|l| l.starts_with("strata:kv_tier_blocks")
            && l.contains("CPU")
            && l.ends_with(&format!(" {}", stored.len()))));
        // Removal of one, then loss of the log: each announced block withdrawn once.
        h.tier_changed(TierChange::Removed(vec![hashes[0]]));
        h.tier_changed(TierChange::Lost);
        let stats = h.block_stats().await;
        assert_eq!(stats.tier_announced, 0);
        let mut removed = Vec::new();
        while let Ok(batch) = events.try_recv() {
            for e in batch {
                if let PoolEvent::TierRemoved { hash } = e {
                    removed.push(hash);
                }
            }
        }
        assert_eq!(removed.len(), stored.len());
        assert_eq!(removed[0], hashes[0]);
    }
}
