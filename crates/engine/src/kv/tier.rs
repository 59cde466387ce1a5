//! The shared KV tier: one process per machine that keeps KV blocks the engines evicted, so
//! an engine (the same or another) can fetch a prefix instead of recomputing it.
//!
//! Blocks are kept apart per [`BlockSpec`] (model, shape, dtype): any number of engines and
//! models share one tier, and a block is only ever served to a client of its own spec. Two
//! levels, both bounded in bytes and ordered least recently used first across all specs:
//! memory, and optionally a disk directory. A block pushed out of memory spills to disk (when
//! there is one and the block fits), a disk hit is promoted back to memory, and a block
//! counts as evicted only when it leaves the tier entirely. Every such departure goes into a
//! bounded eviction log that engines poll ([`crate::kv::transfer::Evictions`]), so what they
//! announced as stored on the tier they also announce as removed.
//!
//! The log's sequence numbers start at the process's start time in microseconds: a tier
//! that restarts numbers above anything its previous life handed out, so an engine that
//! polls with an old number learns that its earlier announcements are void.
//!
//! Disk files are named by the block's hex hash under one subdirectory per spec (a digest
//! of the spec), written to a temporary name and renamed, so a reader never sees half a
//! block. A tier starts empty: block files a previous run left behind are removed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::kv::block_pool::HashKey;
use crate::kv::tls::KvAcceptor;
use crate::kv::transfer::{
    self, BlockData, BlockSource, BlockSpec, BoxFuture, Evictions, ServeLimits,
};

/// The tier's bounds.
#[derive(Debug, Clone)]
pub struct TierConfig {
    pub memory_bytes: u64,
    /// A directory for blocks pushed out of memory, and its bound in bytes.
    pub disk: Option<(PathBuf, u64)>,
    /// Eviction-log entries kept; older ones are dropped (pollers then see `complete: false`).
    pub log_entries: usize,
}

impl TierConfig {
    pub const DEFAULT_LOG_ENTRIES: usize = 1 << 16;

    pub fn memory(memory_bytes: u64) -> Self {
        Self {
            memory_bytes,
            disk: None,
            log_entries: Self::DEFAULT_LOG_ENTRIES,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("KV tier disk directory {path}: {source}")]
    Disk {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("KV tier: {0}")]
    Listen(std::io::Error),
}

/// Where a block lives.
#[derive(Debug)]
enum Place {
    Memory(Vec<u8>),
    Disk,
}

#[derive(Debug)]
struct Entry {
    place: Place,
    /// Its key in the LRU of its level.
    tick: u64,
}

/// One spec's blocks.
#[derive(Debug)]
struct Space {
    spec: BlockSpec,
    /// Its disk subdirectory (when the tier has a disk).
    dir: Option<PathBuf>,
    blocks: HashMap<HashKey, Entry>,
}

/// The tier's state: bounded, LRU, per spec. Not thread-safe by itself; [`Tier`] wraps it.
#[derive(Debug)]
pub struct TierStore {
    config: TierConfig,
    spaces: Vec<Space>,
    space_of: HashMap<BlockSpec, usize>,
    /// Ticks order both LRUs; every touch takes a fresh one.
    clock: u64,
    memory_lru: BTreeMap<u64, (usize, HashKey)>,
    disk_lru: BTreeMap<u64, (usize, HashKey)>,
    memory_used: u64,
    disk_used: u64,
    /// (seq, space, hash) of every block that left the tier, oldest first.
    log: VecDeque<(u64, usize, HashKey)>,
    /// The next sequence number to hand out.
    next_seq: u64,
    /// The oldest seq an answer is complete from (the log holds everything at or after it).
    floor: u64,
}

/// Counts for logs and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    pub memory_blocks: usize,
    pub memory_bytes: u64,
    pub disk_blocks: usize,
    pub disk_bytes: u64,
}

impl TierStore {
    /// An empty tier. With a disk directory, creates it and removes block files a previous
    /// run left there.
    pub fn new(config: TierConfig) -> Result<Self, TierError> {
        let base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
            .max(1);
        Self::with_base(config, base)
    }

    fn with_base(config: TierConfig, base: u64) -> Result<Self, TierError> {
        if let Some((dir, _)) = &config.disk {
            let err = |source| TierError::Disk {
                path: dir.clone(),
                source,
            };
            std::fs::create_dir_all(dir).map_err(err)?;
            clear_stale(dir).map_err(err)?;
        }
        Ok(Self {
            config,
            spaces: Vec::new(),
            space_of: HashMap::new(),
            clock: 0,
            memory_lru: BTreeMap::new(),
            disk_lru: BTreeMap::new(),
            memory_used: 0,
            disk_used: 0,
            log: VecDeque::new(),
            next_seq: base,
            floor: base,
        })
    }

    pub fn stats(&self) -> TierStats {
        TierStats {
            memory_blocks: self.memory_lru.len(),
            memory_bytes: self.memory_used,
            disk_blocks: self.disk_lru.len(),
            disk_bytes: self.disk_used,
        }
    }

    fn space(&mut self, spec: &BlockSpec) -> Result<usize, String> {
        if let Some(&i) = self.space_of.get(spec) {
            return Ok(i);
        }
        let dir = match &self.config.disk {
            Some((root, _)) => {
                let dir = root.join(spec_dir_name(spec));
                std::fs::create_dir_all(&dir)
                    .map_err(|e| format!("creating {}: {e}", dir.display()))?;
                Some(dir)
            }
            None => None,
        };
        let i = self.spaces.len();
        self.spaces.push(Space {
            spec: spec.clone(),
            dir,
            blocks: HashMap::new(),
        });
        self.space_of.insert(spec.clone(), i);
        Ok(i)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Stores blocks of `spec` (most recently used from now). A block already held is
    /// refreshed (and promoted to memory if it was on disk), never stored twice. A block
    /// that fits nowhere is stored and at once evicted, so pollers hear of it like any other.
    pub fn put(&mut self, spec: &BlockSpec, blocks: Vec<BlockData>) -> Result<(), String> {
        let size = spec.block_bytes();
        if let Some(b) = blocks.iter().find(|b| b.bytes.len() != size) {
            return Err(format!(
                "a block of {} bytes where {spec} has {size}",
                b.bytes.len()
            ));
        }
        let s = self.space(spec)?;
        for b in blocks {
            self.insert_memory(s, b.hash, b.bytes);
        }
        self.enforce_bounds();
        Ok(())
    }

    /// Makes `bytes` the most recent block in memory: a block held in memory is only
    /// touched (the copy given is dropped), one on disk is promoted (its file removed), a new
    /// one is added. The bounds are enforced by the caller.
    fn insert_memory(&mut self, s: usize, hash: HashKey, bytes: Vec<u8>) {
        let tick = self.tick();
        let len = bytes.len() as u64;
        let space = &mut self.spaces[s];
        match space.blocks.get_mut(&hash) {
            Some(e) => {
                let old = std::mem::replace(&mut e.tick, tick);
                if matches!(e.place, Place::Disk) {
                    self.disk_lru.remove(&old);
                    self.disk_used -= len;
                    if let Some(dir) = &space.dir {
                        let _ = std::fs::remove_file(dir.join(hex::encode(hash)));
                    }
                    e.place = Place::Memory(bytes);
                    self.memory_used += len;
                } else {
                    self.memory_lru.remove(&old);
                }
            }
            None => {
                space.blocks.insert(
                    hash,
                    Entry {
                        place: Place::Memory(bytes),
                        tick,
                    },
                );
                self.memory_used += len;
            }
        }
        self.memory_lru.insert(tick, (s, hash));
    }

    /// Makes a block held in memory the most recent.
    fn touch(&mut self, s: usize, hash: HashKey) {
        let tick = self.tick();
        if let Some(e) = self.spaces[s].blocks.get_mut(&hash) {
            let old = std::mem::replace(&mut e.tick, tick);
            self.memory_lru.remove(&old);
            self.memory_lru.insert(tick, (s, hash));
        }
    }

    /// Memory over its bound: the least recent blocks spill to disk (or leave); disk over its
    /// bound: the least recent disk blocks leave.
    fn enforce_bounds(&mut self) {
        while self.memory_used > self.config.memory_bytes {
            let Some((_, (s, hash))) = self.memory_lru.pop_first() else {
                break;
            };
            let Some(entry) = self.spaces[s].blocks.remove(&hash) else {
                continue;
            };
            let Place::Memory(bytes) = entry.place else {
                continue;
            };
            self.memory_used -= bytes.len() as u64;
            if !self.spill(s, hash, &bytes) {
                self.log_departure(s, hash);
            }
        }
        let disk_bound = self.config.disk.as_ref().map_or(0, |(_, b)| *b);
        while self.disk_used > disk_bound {
            let Some((_, (s, hash))) = self.disk_lru.pop_first() else {
                break;
            };
            self.drop_disk_block(s, hash);
            self.log_departure(s, hash);
        }
    }

    /// Writes a block pushed out of memory to disk; false when there is no room or no disk
    /// (or the write failed: the block is then simply gone).
    fn spill(&mut self, s: usize, hash: HashKey, bytes: &[u8]) -> bool {
        let Some((_, disk_bound)) = &self.config.disk else {
            return false;
        };
        if bytes.len() as u64 > *disk_bound {
            return false;
        }
        let Some(dir) = &self.spaces[s].dir else {
            return false;
        };
        let name = hex::encode(hash);
        let tmp = dir.join(format!("{name}.tmp"));
        let written =
            std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, dir.join(&name)));
        if let Err(e) = written {
            tracing::warn!(error = %e, dir = %dir.display(), "KV tier could not spill a block to disk; dropping it");
            let _ = std::fs::remove_file(&tmp);
            return false;
        }
        let tick = self.tick();
        self.spaces[s].blocks.insert(
            hash,
            Entry {
                place: Place::Disk,
                tick,
            },
        );
        self.disk_lru.insert(tick, (s, hash));
        self.disk_used += bytes.len() as u64;
        true
    }

    fn drop_disk_block(&mut self, s: usize, hash: HashKey) {
        let size = self.spaces[s].spec.block_bytes() as u64;
        if let Some(e) = self.spaces[s].blocks.remove(&hash) {
            debug_assert!(matches!(e.place, Place::Disk));
            self.disk_used -= size;
        }
        if let Some(dir) = &self.spaces[s].dir {
            let _ = std::fs::remove_file(dir.join(hex::encode(hash)));
        }
    }

    fn log_departure(&mut self, s: usize, hash: HashKey) {
        self.log.push_back((self.next_seq, s, hash));
        self.next_seq += 1;
        while self.log.len() > self.config.log_entries.max(1) {
            if let Some((seq, _, _)) = self.log.pop_front() {
                self.floor = seq + 1;
            }
        }
    }

    /// The leading run of `hashes` held for `spec`, in order, each made most recent (disk
    /// hits are promoted to memory). The bounds are enforced once the run is read, not per
    /// block, so a run longer than memory does not write its own blocks back to disk one by
    /// one; between calls both bounds hold exactly.
    pub fn get(&mut self, spec: &BlockSpec, hashes: &[HashKey]) -> Vec<BlockData> {
        let Some(&s) = self.space_of.get(spec) else {
            return Vec::new();
        };
        let size = spec.block_bytes();
        let mut out = Vec::new();
        for &hash in hashes {
            match self.spaces[s].blocks.get(&hash).map(|e| &e.place) {
                None => break,
                Some(Place::Memory(b)) => {
                    out.push(BlockData {
                        hash,
                        bytes: b.clone(),
                    });
                    self.touch(s, hash);
                }
                Some(Place::Disk) => {
                    let path = self.spaces[s]
                        .dir
                        .as_ref()
                        .map(|d| d.join(hex::encode(hash)));
                    match path.map(std::fs::read) {
                        Some(Ok(b)) if b.len() == size => {
                            self.insert_memory(s, hash, b.clone());
                            out.push(BlockData { hash, bytes: b });
                        }
                        other => {
                            // Gone or damaged under us: it has left the tier.
                            if let Some(Err(e)) = other {
                                tracing::warn!(error = %e, "KV tier lost a disk block");
                            }
                            if let Some(e) = self.spaces[s].blocks.get(&hash) {
                                self.disk_lru.remove(&e.tick);
                            }
                            self.drop_disk_block(s, hash);
                            self.log_departure(s, hash);
                            break;
                        }
                    }
                }
            }
        }
        self.enforce_bounds();
        out
    }

    /// Whether `spec` holds `hash` (and where), without touching its recency.
    pub fn holds(&self, spec: &BlockSpec, hash: &HashKey) -> Option<bool> {
        let s = *self.space_of.get(spec)?;
        self.spaces[s]
            .blocks
            .get(hash)
            .map(|e| matches!(e.place, Place::Memory(_)))
    }

    /// Blocks of `spec` that left the tier at or after `seq`.
    pub fn evictions_since(&self, spec: &BlockSpec, seq: u64) -> Evictions {
        let head = self.next_seq;
        if seq > head {
            // A number this tier never handed out: from an earlier life of a tier at this
            // address, or a confused client.
            return Evictions {
                next: head,
                hashes: Vec::new(),
                complete: false,
            };
        }
        let space = self.space_of.get(spec).copied();
        let from = self.log.partition_point(|(s, _, _)| *s < seq);
        let hashes = self
            .log
            .range(from..)
            .filter(|(_, s, _)| Some(*s) == space)
            .map(|(_, _, h)| *h)
            .collect();
        Evictions {
            next: head,
            hashes,
            complete: seq >= self.floor,
        }
    }
}

/// A spec's subdirectory: a digest, so model ids with any characters make a safe name.
fn spec_dir_name(spec: &BlockSpec) -> String {
    let digest = Sha256::digest(spec.to_string().as_bytes());
    format!("spec-{}", hex::encode(&digest[..8]))
}

/// Removes what an earlier tier left in `dir`: block files (64 hex characters, maybe with
/// `.tmp`) in `spec-*` subdirectories, then those subdirectories if empty. Anything else is
/// left alone.
fn clear_stale(dir: &Path) -> std::io::Result<()> {
    for sub in std::fs::read_dir(dir)? {
        let sub = sub?;
        let name = sub.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with("spec-") || !sub.file_type()?.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(sub.path())? {
            let f = f?;
            let fname = f.file_name();
            let fname = fname.to_string_lossy();
            let stem = fname.strip_suffix(".tmp").unwrap_or(&fname);
            if stem.len() == 64 && stem.bytes().all(|b| b.is_ascii_hexdigit()) {
                std::fs::remove_file(f.path())?;
            }
        }
        let _ = std::fs::remove_dir(sub.path());
    }
    Ok(())
}

/// The tier as a transfer endpoint's [`BlockSource`]: any valid spec, no pins.
#[derive(Debug, Clone)]
pub struct Tier {
    store: Arc<Mutex<TierStore>>,
}

impl Tier {
    pub fn new(store: TierStore) -> Self {
        Self {
            store: Arc::new(Mutex::new(store)),
        }
    }

    pub fn stats(&self) -> TierStats {
        lock(&self.store).stats()
    }

    /// Runs `f` on the store off the async threads (disk reads and writes happen inside).
    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut TierStore) -> T + Send + 'static,
    ) -> impl std::future::Future<Output = Option<T>> + Send + 'static {
        let store = self.store.clone();
        async move {
            tokio::task::spawn_blocking(move || f(&mut lock(&store)))
                .await
                .ok()
        }
    }
}

fn lock(store: &Mutex<TierStore>) -> std::sync::MutexGuard<'_, TierStore> {
    // Every edit of the store keeps its counters and maps in step before it can fail, so
    // a panic elsewhere leaves it usable.
    store.lock().unwrap_or_else(|p| p.into_inner())
}

impl BlockSource for Tier {
    fn accepts(&self, spec: &BlockSpec) -> bool {
        spec.validate().is_ok()
    }

    fn get(
        &self,
        spec: &BlockSpec,
        hashes: Vec<HashKey>,
        _release: Option<String>,
    ) -> BoxFuture<Vec<BlockData>> {
        let spec = spec.clone();
        let fut = self.blocking(move |t| t.get(&spec, &hashes));
        Box::pin(async move { fut.await.unwrap_or_default() })
    }

    fn put(&self, spec: &BlockSpec, blocks: Vec<BlockData>) -> BoxFuture<Result<(), String>> {
        let spec = spec.clone();
        let fut = self.blocking(move |t| t.put(&spec, blocks));
        Box::pin(async move {
            fut.await
                .unwrap_or_else(|| Err("the tier failed storing blocks".into()))
        })
    }

    fn evictions_since(&self, spec: &BlockSpec, seq: u64) -> Evictions {
        lock(&self.store).evictions_since(spec, seq)
    }

    fn release(&self, _pin: String) -> BoxFuture<()> {
        // The tier pins nothing: a block stays until the LRU pushes it out.
        Box::pin(async {})
    }
}

/// What `strata kv-tier` runs with.
#[derive(Debug, Clone)]
pub struct TierOptions {
    pub listen: SocketAddr,
    pub config: TierConfig,
    /// Plain TCP, or TLS (`--tls-cert`/`--tls-key`; with `--tls-client-ca`, engines must
    /// present a certificate that CA signed).
    pub tls: KvAcceptor,
}

/// Parses a byte count: a number with an optional unit, `KiB`/`MiB`/`GiB`/`TiB` (also `K`,
/// `M`, `G`, `T`) in powers of 1024, `KB`/`MB`/`GB`/`TB` in powers of 1000, `B` or nothing
/// for bytes. Fractions are allowed (`1.5GiB`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown size unit `{other}` in `{s}`")),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 512MiB, 2GiB, 1000000)"))?;
    let v = (n * mult).round();
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(format!("size `{s}` is out of range"));
    }
    Ok(v as u64)
}

/// `strata kv-tier`: serves a tier on `opts.listen` until Ctrl-C or SIGTERM.
pub async fn run_tier(opts: TierOptions) -> Result<(), TierError> {
    let store = TierStore::new(opts.config.clone())?;
    let tier = Tier::new(store);
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(TierError::Listen)?;
    let addr = listener.local_addr().map_err(TierError::Listen)?;
    match &opts.config.disk {
        Some((dir, bytes)) => tracing::info!(
            %addr,
            memory_bytes = opts.config.memory_bytes,
            disk_dir = %dir.display(),
            disk_bytes = bytes,
            "KV tier listening"
        ),
        None => {
            tracing::info!(%addr, memory_bytes = opts.config.memory_bytes, "KV tier listening (memory only)")
        }
    }
    let source: Arc<dyn BlockSource> = Arc::new(tier.clone());
    let (shutdown, limits) = (strata_api::http::shutdown_signal(), ServeLimits::default());
    transfer::serve_on(listener, opts.tls, source, shutdown, limits)
        .await
        .map_err(TierError::Listen)?;
    let st = tier.stats();
    tracing::info!(
        memory_blocks = st.memory_blocks,
        disk_blocks = st.disk_blocks,
        "KV tier stopped"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::cache::KvDtype;
    use crate::kv::transfer::TransferClient;
    use std::time::Duration;

    /// Blocks of 2*1*2*2*2 = 16 bytes.
    fn spec(model: &str) -> BlockSpec {
        BlockSpec {
            model: model.into(),
            block_size: 2,
            n_layer: 1,
            slot_width: 2,
            dtype: KvDtype::F16,
            scales_per_slot: 0,
        }
    }
    const B: u64 = 16;

    fn h(n: u8) -> HashKey {
        [n; 32]
    }

    fn blk(n: u8) -> BlockData {
        BlockData {
            hash: h(n),
            bytes: vec![n; B as usize],
        }
    }

    fn put(t: &mut TierStore, sp: &BlockSpec, ns: &[u8]) {
        t.put(sp, ns.iter().map(|&n| blk(n)).collect()).unwrap();
    }

    fn held(t: &TierStore, sp: &BlockSpec, ns: &[u8]) -> Vec<Option<bool>> {
        ns.iter().map(|&n| t.holds(sp, &h(n))).collect()
    }

    const BASE: u64 = 1000;

    fn mem_store(blocks: u64) -> TierStore {
        TierStore::with_base(TierConfig::memory(blocks * B), BASE).unwrap()
    }

    fn disk_store(dir: &Path, mem_blocks: u64, disk_bytes: u64, log: usize) -> TierStore {
        let config = TierConfig {
            memory_bytes: mem_blocks * B,
            disk: Some((dir.to_path_buf(), disk_bytes)),
            log_entries: log,
        };
        TierStore::with_base(config, BASE).unwrap()
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("strata-tier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn memory_is_lru_and_its_bound_holds_exactly() {
        let sp = spec("m");
        let mut t = mem_store(3);
        put(&mut t, &sp, &[1, 2, 3]);
        assert_eq!(t.stats().memory_bytes, 3 * B);
        // Reading 1 makes it recent, so 2 is the one to go.
        assert_eq!(t.get(&sp, &[h(1)]), vec![blk(1)]);
        put(&mut t, &sp, &[4]);
        assert_eq!(
            held(&t, &sp, &[1, 2, 3, 4]),
            [Some(true), None, Some(true), Some(true)]
        );
        assert_eq!(t.stats().memory_bytes, 3 * B);
        assert_eq!(t.evictions_since(&sp, BASE).hashes, vec![h(2)]);

        // One byte short of three blocks holds two.
        let mut t = TierStore::with_base(TierConfig::memory(3 * B - 1), BASE).unwrap();
        put(&mut t, &sp, &[1, 2, 3]);
        assert_eq!(t.stats().memory_blocks, 2);
        assert_eq!(held(&t, &sp, &[1]), [None]);
    }

    #[test]
    fn get_returns_the_leading_run_per_spec() {
        let (a, b) = (spec("a"), spec("b"));
        let mut t = mem_store(10);
        put(&mut t, &a, &[1, 2, 4]);
        put(&mut t, &b, &[3]);
        assert_eq!(t.get(&a, &[h(1), h(2), h(3), h(4)]), vec![blk(1), blk(2)]);
        // The same hash under another spec is another block.
        assert!(t.get(&b, &[h(1)]).is_empty());
        assert!(t.get(&spec("c"), &[h(1)]).is_empty());
        // Blocks of the wrong size are refused whole.
        let bad = BlockData {
            hash: h(9),
            bytes: vec![0; 3],
        };
        assert!(t.put(&a, vec![blk(8), bad]).is_err());
        assert_eq!(t.holds(&a, &h(8)), None);
    }

    #[test]
    fn a_re_put_refreshes_without_storing_twice() {
        let sp = spec("m");
        let mut t = mem_store(2);
        put(&mut t, &sp, &[1, 2]);
        put(&mut t, &sp, &[1]);
        assert_eq!(
            t.stats(),
            TierStats {
                memory_blocks: 2,
                memory_bytes: 2 * B,
                ..Default::default()
            }
        );
        put(&mut t, &sp, &[3]);
        assert_eq!(held(&t, &sp, &[1, 2, 3]), [Some(true), None, Some(true)]);
    }

    #[test]
    fn memory_spills_to_disk_and_disk_hits_come_back() {
        let dir = tempdir("spill");
        let sp = spec("m");
        let mut t = disk_store(&dir, 2, 2 * B, 100);
        put(&mut t, &sp, &[1, 2, 3, 4]);
        assert_eq!(
            held(&t, &sp, &[1, 2, 3, 4]),
            [Some(false), Some(false), Some(true), Some(true)]
        );
        assert_eq!(
            t.stats(),
            TierStats {
                memory_blocks: 2,
                memory_bytes: 2 * B,
                disk_blocks: 2,
                disk_bytes: 2 * B
            }
        );
        let sub = dir.join(spec_dir_name(&sp));
        let mut files: Vec<String> = std::fs::read_dir(&sub)
            .unwrap()
            .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(files, vec![hex::encode(h(1)), hex::encode(h(2))]);
        // Nothing has left the tier yet.
        assert!(t.evictions_since(&sp, BASE).hashes.is_empty());

        // A disk hit is promoted; memory's least recent (3) spills in its place.
        assert_eq!(t.get(&sp, &[h(1)]), vec![blk(1)]);
        assert_eq!(
            held(&t, &sp, &[1, 2, 3, 4]),
            [Some(true), Some(false), Some(false), Some(true)]
        );
        assert!(!sub.join(hex::encode(h(1))).exists());
        assert!(sub.join(hex::encode(h(3))).exists());

        // Disk full: its least recent block (2) leaves the tier, and only then is logged.
        put(&mut t, &sp, &[5]);
        assert_eq!(held(&t, &sp, &[2]), [None]);
        assert!(!sub.join(hex::encode(h(2))).exists());
        assert_eq!(t.evictions_since(&sp, BASE).hashes, vec![h(2)]);
        assert_eq!(t.stats().disk_bytes, 2 * B);
        assert_eq!(t.stats().memory_bytes, 2 * B);

        // A block file lost under the tier counts as a departure, not an error.
        std::fs::remove_file(sub.join(hex::encode(h(3)))).unwrap();
        assert!(t.get(&sp, &[h(3)]).is_empty());
        assert_eq!(t.evictions_since(&sp, BASE).hashes, vec![h(2), h(3)]);
        assert_eq!(t.stats().disk_blocks, 1);

        // A new tier on the same directory starts empty.
        std::fs::write(dir.join("keep.txt"), b"not ours").unwrap();
        let t2 = disk_store(&dir, 2, 2 * B, 100);
        assert_eq!(t2.stats(), TierStats::default());
        assert_eq!(std::fs::read_dir(&sub).map(|d| d.count()).unwrap_or(0), 0);
        assert!(dir.join("keep.txt").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn without_room_anywhere_a_block_leaves_at_once() {
        let dir = tempdir("noroom");
        let sp = spec("m");
        // Memory holds nothing, disk holds one block.
        let mut t = disk_store(&dir, 0, B, 100);
        put(&mut t, &sp, &[1, 2]);
        assert_eq!(held(&t, &sp, &[1, 2]), [None, Some(false)]);
        assert_eq!(t.evictions_since(&sp, BASE).hashes, vec![h(1)]);
        let mut t = mem_store(0);
        put(&mut t, &sp, &[7]);
        assert_eq!(t.evictions_since(&sp, BASE).hashes, vec![h(7)]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_eviction_log_is_bounded_and_says_when_it_was_cut() {
        let (a, b) = (spec("a"), spec("b"));
        let mut t = TierStore::with_base(
            TierConfig {
                log_entries: 3,
                ..TierConfig::memory(B)
            },
            BASE,
        )
        .unwrap();
        // Memory holds one block across both specs.
        put(&mut t, &a, &[1, 2]); // a:1 leaves, seq 1000
        put(&mut t, &b, &[3]); // a:2 leaves, seq 1001
        put(&mut t, &a, &[4]); // b:3 leaves, seq 1002
        let ev = t.evictions_since(&a, BASE);
        assert_eq!(
            ev,
            Evictions {
                next: BASE + 3,
                hashes: vec![h(1), h(2)],
                complete: true
            }
        );
        assert_eq!(t.evictions_since(&b, BASE).hashes, vec![h(3)]);
        assert_eq!(t.evictions_since(&a, BASE + 1).hashes, vec![h(2)]);
        assert_eq!(
            t.evictions_since(&a, BASE + 2).hashes,
            Vec::<HashKey>::new()
        );
        put(&mut t, &a, &[5]); // a:4 leaves, seq 1003; the log drops seq 1000
        let ev = t.evictions_since(&a, BASE);
        assert!(!ev.complete);
        assert_eq!(ev.next, BASE + 4);
        assert!(t.evictions_since(&a, BASE + 1).complete);
        assert_eq!(t.evictions_since(&a, BASE + 3).hashes, vec![h(4)]);
        // Nothing new since the head.
        assert_eq!(
            t.evictions_since(&a, BASE + 4),
            Evictions {
                next: BASE + 4,
                hashes: vec![],
                complete: true
            }
        );
        // A number from the future (a tier that restarted, numbering from a later clock, is
        // the usual case from the other side): not complete.
        assert!(!t.evictions_since(&a, BASE + 100).complete);
        let restarted = TierStore::with_base(TierConfig::memory(B), BASE + 50).unwrap();
        assert!(!restarted.evictions_since(&a, BASE + 4).complete);
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5 GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("64kb"), Ok(64_000));
        for bad in ["", "MiB", "12XB", "-1", "1e400GiB", "1.2.3"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn the_tier_serves_puts_and_gets_over_the_protocol() {
        let (a, b) = (spec("a"), spec("b"));
        let tier = Tier::new(mem_store(4));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(transfer::serve(listener, Arc::new(tier.clone()), async {
            let _ = stopped.await;
        }));
        let t = Duration::from_secs(5);
        let mut ca = TransferClient::connect(addr, &a, t).await.unwrap();
        let mut cb = TransferClient::connect(addr, &b, t).await.unwrap();
        ca.put(vec![blk(1), blk(2)]).await.unwrap();
        cb.put(vec![blk(1)]).await.unwrap();
        assert_eq!(
            ca.get(&[h(1), h(2), h(3)], Some("ignored")).await.unwrap(),
            vec![blk(1), blk(2)]
        );
        assert_eq!(cb.get(&[h(2)], None).await.unwrap(), vec![]);
        // Five blocks for four places: a's block 1 was read last but b's is older.
        ca.put(vec![blk(3), blk(4)]).await.unwrap();
        assert_eq!(tier.stats().memory_blocks, 4);
        assert!(cb.get(&[h(1)], None).await.unwrap().is_empty());
        let ev = cb.evictions_since(0).await.unwrap();
        assert!(!ev.complete);
        assert_eq!(ev.hashes, vec![h(1)]);
        let head = ev.next;
        ca.put(vec![blk(5)]).await.unwrap();
        let ev = ca.evictions_since(head).await.unwrap();
        assert!(ev.complete);
        assert_eq!(ev.hashes.len(), 1);
        ca.release("nothing-pinned").await.unwrap();
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }
}
