//! The block pool: which KV blocks are free, who holds the others, and which full blocks
//! hold which prefix (the prefix cache).
//!
//! Invariants:
//! - every block is either in the free queue (ref count 0) or held (ref count > 0), never
//!   both;
//! - a block in `cached` maps back to its hash in `hashes`, and vice versa; a free block
//!   keeps its hash, so a later request with the same prefix can take it back, until the
//!   block is evicted (handed out again for other content);
//! - the free queue is least recently used first: blocks without a hash go to the front
//!   (nothing to lose), released blocks with a hash go to the back, a sequence's blocks in
//!   reverse order so its tail (the least shareable part) is evicted first.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use super::prefix_table::PrefixTable;

/// A block's content hash (PROTOCOLS §3, SHA-256).
pub type HashKey = [u8; 32];

/// The hasher of the prefix-cache table. Its keys are already uniform content hashes, so
/// SipHash (the std default) over 32 bytes only costs time on every commit and lookup;
/// instead the key's four words are folded with a per-process random key and a multiply
/// each, which still keeps a client who chooses prompts from aiming at one bucket without
/// knowing the key.
#[derive(Debug, Clone, Copy)]
pub struct KeyHashState {
    key: u64,
}

impl Default for KeyHashState {
    fn default() -> Self {
        static KEY: OnceLock<u64> = OnceLock::new();
        let key =
            *KEY.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0u64) | 1);
        KeyHashState { key }
    }
}

impl BuildHasher for KeyHashState {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            key: self.key,
            h: self.key,
        }
    }
}

/// See [`KeyHashState`].
#[derive(Debug, Clone, Copy)]
pub struct KeyHasher {
    key: u64,
    h: u64,
}

const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.h = (self.h ^ u64::from_le_bytes(w) ^ self.key)
                .wrapping_mul(MIX)
                .rotate_left(29);
        }
    }
    fn write_usize(&mut self, n: usize) {
        // The slice length prefix: every key is 32 bytes, but fold it in anyway.
        self.write(&n.to_le_bytes());
    }
    fn finish(&self) -> u64 {
        let x = self.h.wrapping_mul(MIX);
        x ^ (x >> 32)
    }
}

/// The LoRA adapter a block's keys and values belong to: vLLM's `lora_id` and `lora_name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLora {
    pub id: i64,
    pub name: String,
}

/// Changes to the cache, for the KV-event publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolEvent {
    Stored {
        hash: HashKey,
        parent: Option<HashKey>,
        tokens: Vec<u32>,
        /// The LoRA adapter the block was computed with (KV events name it).
        lora: Option<BlockLora>,
    },
    Removed {
        hash: HashKey,
    },
    Cleared,
    /// A block this engine evicted is now held by the shared KV tier (host memory or
    /// disk): announced as `BlockStored` with `medium: "CPU"`. Parent, tokens and adapter
    /// are the ones the block had when it was evicted.
    TierStored {
        hash: HashKey,
        parent: Option<HashKey>,
        tokens: Vec<u32>,
        lora: Option<BlockLora>,
    },
    /// A block announced by [`PoolEvent::TierStored`] left the tier (or the engine can
    /// no longer vouch for it): `BlockRemoved` with `medium: "CPU"`.
    TierRemoved {
        hash: HashKey,
    },
}

/// A cached block the pool just evicted, with what named it (recorded only while
/// [`BlockPool::set_track_evictions`] is on). Its slots still hold its keys and values
/// until the block is written again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictedBlock {
    pub block: u32,
    pub hash: HashKey,
    pub parent: Option<HashKey>,
    pub tokens: Vec<u32>,
    pub lora: Option<BlockLora>,
}

/// What a named block was committed with, kept for its eviction record.
#[derive(Debug, Clone)]
struct BlockMeta {
    parent: Option<HashKey>,
    tokens: Vec<u32>,
    lora: Option<BlockLora>,
}

const NIL: u32 = u32::MAX;

/// A doubly linked list over block ids with O(1) push, pop and removal from the middle.
/// A block's links and its queued flag sit side by side, so a removal touches the block's
/// entry and its two neighbours' rather than three arrays' worth of each.
#[derive(Debug)]
struct FreeQueue {
    links: Vec<Link>,
    head: u32,
    tail: u32,
    len: usize,
}

/// One block's place in the [`FreeQueue`].
#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    queued: bool,
}

impl FreeQueue {
    fn new(n: usize) -> Self {
        let mut q = Self {
            links: vec![
                Link {
                    prev: NIL,
                    next: NIL,
                    queued: false
                };
                n
            ],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for b in 0..n as u32 {
            q.push_back(b);
        }
        q
    }

    fn push_back(&mut self, b: u32) {
        debug_assert!(!self.links[b as usize].queued);
        self.links[b as usize] = Link {
            prev: self.tail,
            next: NIL,
            queued: true,
        };
        if self.tail == NIL {
            self.head = b;
        } else {
            self.links[self.tail as usize].next = b;
        }
        self.tail = b;
        self.len += 1;
    }

    fn push_front(&mut self, b: u32) {
        debug_assert!(!self.links[b as usize].queued);
        self.links[b as usize] = Link {
            prev: NIL,
            next: self.head,
            queued: true,
        };
        if self.head == NIL {
            self.tail = b;
        } else {
            self.links[self.head as usize].prev = b;
        }
        self.head = b;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        let link = self.links[b as usize];
        if !link.queued {
            return;
        }
        let (p, n) = (link.prev, link.next);
        if p == NIL {
            self.head = n;
        } else {
            self.links[p as usize].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.links[n as usize].prev = p;
        }
        self.links[b as usize] = Link {
            prev: NIL,
            next: NIL,
            queued: false,
        };
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }
}

/// Owner of the KV blocks' bookkeeping and the prefix cache.
#[derive(Debug)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    hashes: Vec<Option<HashKey>>,
    /// The named blocks by hash (the keys are `hashes`' entries).
    cached: PrefixTable<HashKey, KeyHashState>,
    free: FreeQueue,
    prefix_caching: bool,
    events: Vec<PoolEvent>,
    /// Whether `Stored` events carry the block's tokens (the KV-event wire format wants
    /// them; a consumer that reads only hashes, like the simulator, saves a copy per block).
    event_tokens: bool,
    /// Whether cache changes are recorded as events at all (on by default).
    events_on: bool,
    /// Per block, what it was committed with; `None` unless evictions are tracked (the
    /// tier needs the parent and tokens of an evicted block, nobody else does).
    meta: Option<Vec<Option<BlockMeta>>>,
    /// Cached blocks evicted since the last [`BlockPool::drain_evicted`].
    evicted: Vec<EvictedBlock>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, prefix_caching: bool) -> Self {
        Self {
            ref_counts: vec![0; num_blocks],
            hashes: vec![None; num_blocks],
            cached: PrefixTable::new(num_blocks, KeyHashState::default()),
            free: FreeQueue::new(num_blocks),
            prefix_caching,
            events: Vec::new(),
            event_tokens: true,
            events_on: true,
            meta: None,
            evicted: Vec::new(),
        }
    }

    /// Records every cached block that `allocate` evicts (see [`Self::drain_evicted`]);
    /// off by default, and then nothing is kept.
    pub fn set_track_evictions(&mut self, on: bool) {
        self.meta = on.then(|| vec![None; self.ref_counts.len()]);
        self.evicted.clear();
    }

    /// The cached blocks evicted since the last call, oldest first. Their slots are
    /// intact until the caller writes into the blocks it allocated.
    pub fn drain_evicted(&mut self) -> std::vec::Drain<'_, EvictedBlock> {
        self.evicted.drain(..)
    }

    /// References held on `block` (0: free); 0 for an id out of range.
    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts.get(block as usize).copied().unwrap_or(0)
    }

    /// Blocks named in the prefix cache (held or free).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Leaves the tokens out of `Stored` events (empty) when `false`; on by default.
    pub fn set_event_tokens(&mut self, on: bool) {
        self.event_tokens = on;
    }

    /// Records no events when `false` (a caller nobody listens to, like a simulated
    /// replica behind a router that reads no KV events); on by default.
    pub fn set_events(&mut self, on: bool) {
        self.events_on = on;
        if !on {
            self.events = Vec::new();
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks nobody holds (cached or not): what `allocate` can hand out.
    pub fn num_free(&self) -> usize {
        self.free.len
    }

    /// Fraction of blocks held by sequences, 0..=1 (cached free blocks count as free).
    pub fn usage(&self) -> f64 {
        if self.ref_counts.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len as f64 / self.ref_counts.len() as f64
    }

    /// The block holding `hash`, if cached.
    pub fn cached_block(&self, hash: &HashKey) -> Option<u32> {
        self.cached.get(hash, &self.hashes)
    }

    /// Every cached (hash, block) pair, in block order, for checks against a mirror built
    /// from events.
    pub fn cached_blocks(&self) -> impl Iterator<Item = (&HashKey, u32)> {
        // A block has a hash exactly when the table names it.
        self.hashes
            .iter()
            .enumerate()
            .filter_map(|(b, h)| h.as_ref().map(|h| (h, b as u32)))
    }

    /// How many leading `hashes` are cached (no side effects).
    pub fn count_hits(&self, hashes: &[HashKey]) -> usize {
        if !self.prefix_caching {
            return 0;
        }
        hashes
            .iter()
            .take_while(|h| self.cached.get(h, &self.hashes).is_some())
            .count()
    }

    /// Takes a reference on the cached blocks of the leading `hashes` (all must be cached:
    /// call [`count_hits`](Self::count_hits) first) and returns them.
    pub fn acquire_cached(&mut self, hashes: &[HashKey]) -> Vec<u32> {
        let mut blocks = Vec::with_capacity(hashes.len());
        for h in hashes {
            let Some(b) = self.cached.get(h, &self.hashes) else {
                break;
            };
            if self.ref_counts[b as usize] == 0 {
                self.free.remove(b);
            }
            self.ref_counts[b as usize] += 1;
            blocks.push(b);
        }
        blocks
    }

    /// Takes `n` free blocks, evicting least recently used cached ones, or none at all
    /// when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        let mut blocks = Vec::new();
        self.allocate_into(n, &mut blocks).then_some(blocks)
    }

    /// [`BlockPool::allocate`] onto the end of `blocks` (a sequence's block table, which
    /// then needs no list of its own per allocation); whether it took them. All or
    /// nothing: `blocks` is unchanged when fewer than `n` are free.
    pub fn allocate_into(&mut self, n: usize, blocks: &mut Vec<u32>) -> bool {
        if n > self.free.len {
            return false;
        }
        blocks.reserve(n);
        let start = blocks.len();
        // In three passes, so that the cache misses of one pass overlap: the blocks off
        // the queue (a chain of links) with each one's entry loading, then the prefix
        // table's slot of each evicted name loading, then the evictions.
        for _ in 0..n {
            let Some(b) = self.free.pop_front() else {
                // Unreachable: `free.len` counted at least `n`. Put back what was taken,
                // in its order.
                for &b in blocks[start..].iter().rev() {
                    self.free.push_front(b);
                }
                blocks.truncate(start);
                return false;
            };
            if let Some(h) = self.hashes.get(b as usize) {
                crate::prefetch::prefetch(h);
            }
            blocks.push(b);
        }
        if self.prefix_caching {
            for &b in &blocks[start..] {
                if let Some(Some(h)) = self.hashes.get(b as usize) {
                    self.cached.prefetch(h);
                }
            }
        }
        for &b in &blocks[start..] {
            if let Some(h) = self.hashes[b as usize] {
                let named = self.cached.get(&h, &self.hashes) == Some(b);
                if named {
                    self.cached.remove(&h, &self.hashes);
                }
                self.hashes[b as usize] = None;
                if named {
                    if self.events_on {
                        self.events.push(PoolEvent::Removed { hash: h });
                    }
                    if let Some(meta) = self.meta.as_mut().and_then(|m| m[b as usize].take()) {
                        self.evicted.push(EvictedBlock {
                            block: b,
                            hash: h,
                            parent: meta.parent,
                            tokens: meta.tokens,
                            lora: meta.lora,
                        });
                    }
                }
            }
            self.ref_counts[b as usize] = 1;
        }
        true
    }

    /// Starts loading what [`Self::commit`] of `block` as `hash` reads (its entry and the
    /// prefix table's slot for `hash`), so that a step's commits wait on their cache
    /// misses together rather than one after another.
    #[inline]
    pub fn prefetch_commit(&self, block: u32, hash: &HashKey) {
        if !self.prefix_caching {
            return;
        }
        if let Some(h) = self.hashes.get(block as usize) {
            crate::prefetch::prefetch(h);
        }
        self.cached.prefetch(hash);
    }

    /// Records that held block `block` is full with `tokens` whose chained hash is `hash`.
    /// A block whose content is already cached elsewhere stays unnamed.
    pub fn commit(&mut self, block: u32, hash: HashKey, parent: Option<HashKey>, tokens: &[u32]) {
        self.commit_lora(block, hash, parent, tokens, None);
    }

    /// [`Self::commit`] for a block computed with a LoRA adapter (its hash already
    /// includes the adapter's name).
    pub fn commit_lora(
        &mut self,
        block: u32,
        hash: HashKey,
        parent: Option<HashKey>,
        tokens: &[u32],
        lora: Option<&BlockLora>,
    ) {
        if !self.prefix_caching || self.hashes[block as usize].is_some() {
            return;
        }
        if !self.cached.insert(&hash, block, &self.hashes) {
            return;
        }
        self.hashes[block as usize] = Some(hash);
        if let Some(meta) = self.meta.as_mut() {
            meta[block as usize] = Some(BlockMeta {
                parent,
                tokens: tokens.to_vec(),
                lora: lora.cloned(),
            });
        }
        if self.events_on {
            self.events.push(PoolEvent::Stored {
                hash,
                parent,
                tokens: if self.event_tokens {
                    tokens.to_vec()
                } else {
                    Vec::new()
                },
                lora: lora.cloned(),
            });
        }
    }

    /// Drops one reference to each of a sequence's blocks (given in table order).
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let Some(rc) = self.ref_counts.get_mut(b as usize) else {
                continue;
            };
            debug_assert!(*rc > 0, "release of a free block {b}");
            if *rc == 0 {
                continue;
            }
            *rc -= 1;
            if *rc == 0 {
                if self.hashes[b as usize].is_some() {
                    self.free.push_back(b);
                } else {
                    self.free.push_front(b);
                }
            }
        }
    }

    /// Forgets every cached prefix. Refused (false) while any block is held, as a reset
    /// under running sequences would name blocks that are being written.
    pub fn reset(&mut self) -> bool {
        if self.free.len != self.ref_counts.len() {
            return false;
        }
        self.cached.clear();
        for h in self.hashes.iter_mut() {
            *h = None;
        }
        if let Some(meta) = self.meta.as_mut() {
            meta.iter_mut().for_each(|m| *m = None);
        }
        if self.events_on {
            self.events.push(PoolEvent::Cleared);
        }
        true
    }

    /// Cache changes since the last call.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        std::mem::take(&mut self.events)
    }

    /// [`Self::take_events`] for a caller that handles each change in place: the buffer
    /// keeps its capacity, so a pool that is drained every step stops allocating it.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, PoolEvent> {
        self.events.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> HashKey {
        [i; 32]
    }

    #[test]
    fn allocate_and_release_round_trip() {
        let mut pool = BlockPool::new(4, true);
        let a = pool.allocate(3).expect("3 of 4 free");
        assert_eq!(a.len(), 3);
        assert_eq!(pool.num_free(), 1);
        assert!(pool.allocate(2).is_none(), "all-or-nothing");
        assert_eq!(pool.num_free(), 1);
        pool.release(&a);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(pool.usage(), 0.0);
        let mut b = pool.allocate(4).expect("all free again");
        b.sort();
        assert_eq!(b, vec![0, 1, 2, 3]);
    }

    #[test]
    fn allocate_into_appends_all_or_nothing() {
        let mut pool = BlockPool::new(4, true);
        let mut table = pool.allocate(1).expect("one");
        assert!(pool.allocate_into(2, &mut table));
        assert_eq!(table.len(), 3);
        assert!(!pool.allocate_into(2, &mut table), "one free, two asked");
        assert_eq!((table.len(), pool.num_free()), (3, 1), "nothing taken");
        assert!(pool.allocate_into(1, &mut table));
        table.sort();
        assert_eq!(table, vec![0, 1, 2, 3]);
        assert!((0..4).all(|b| pool.ref_count(b) == 1));
    }

    #[test]
    fn released_cached_blocks_are_reusable_until_evicted_lru_first() {
        let mut pool = BlockPool::new(4, true);
        let a = pool.allocate(2).expect("two");
        pool.commit(a[0], h(1), None, &[1, 2]);
        pool.commit(a[1], h(2), Some(h(1)), &[3, 4]);
        pool.release(&a);
        assert_eq!(pool.count_hits(&[h(1), h(2), h(3)]), 2);
        // Two uncached blocks go first; the cached ones survive.
        let b = pool.allocate(2).expect("two more");
        assert!(!b.contains(&a[0]) && !b.contains(&a[1]));
        assert_eq!(pool.count_hits(&[h(1), h(2)]), 2);
        // The next allocation evicts the tail block (h2) before the head block (h1).
        let c = pool.allocate(1).expect("one");
        assert_eq!(c, vec![a[1]]);
        assert_eq!(pool.count_hits(&[h(1), h(2)]), 1);
        let events = pool.take_events();
        assert_eq!(events.last(), Some(&PoolEvent::Removed { hash: h(2) }));
    }

    #[test]
    fn acquiring_a_cached_block_takes_it_out_of_the_free_queue() {
        let mut pool = BlockPool::new(2, true);
        let a = pool.allocate(1).expect("one");
        pool.commit(a[0], h(9), None, &[7]);
        pool.release(&a);
        assert_eq!(pool.num_free(), 2);
        let got = pool.acquire_cached(&[h(9)]);
        assert_eq!(got, a);
        assert_eq!(pool.num_free(), 1);
        // Shared: a second holder, then both release.
        let again = pool.acquire_cached(&[h(9)]);
        assert_eq!(again, a);
        pool.release(&got);
        assert_eq!(pool.num_free(), 1, "still held once");
        pool.release(&again);
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    fn duplicate_content_stays_unnamed_and_reset_needs_an_idle_pool() {
        let mut pool = BlockPool::new(3, true);
        let a = pool.allocate(2).expect("two");
        pool.commit(a[0], h(5), None, &[1]);
        pool.commit(a[1], h(5), None, &[1]);
        assert_eq!(pool.cached_block(&h(5)), Some(a[0]));
        assert!(!pool.reset(), "blocks are held");
        pool.release(&a);
        assert!(pool.reset());
        assert_eq!(pool.count_hits(&[h(5)]), 0);
        assert_eq!(pool.take_events().last(), Some(&PoolEvent::Cleared));
    }

    #[test]
    fn drained_events_and_events_without_tokens() {
        let mut pool = BlockPool::new(4, true);
        let a = pool.allocate(2).expect("two");
        pool.commit(a[0], h(1), None, &[1, 2]);
        let drained: Vec<PoolEvent> = pool.drain_events().collect();
        assert!(matches!(&drained[..], [PoolEvent::Stored { tokens, .. }] if tokens == &[1, 2]));
        assert!(pool.drain_events().next().is_none(), "drained once");
        pool.set_event_tokens(false);
        pool.commit(a[1], h(2), Some(h(1)), &[3, 4]);
        let events = pool.take_events();
        assert!(matches!(
            &events[..],
            [PoolEvent::Stored { hash, parent: Some(p), tokens, .. }]
                if *hash == h(2) && *p == h(1) && tokens.is_empty()
        ));
        assert_eq!(pool.count_hits(&[h(1), h(2)]), 2, "caching is unchanged");
    }

    #[test]
    fn a_pool_without_events_records_none_and_caches_the_same() {
        let mut pool = BlockPool::new(2, true);
        pool.set_events(false);
        let a = pool.allocate(2).expect("two");
        pool.commit(a[0], h(1), None, &[1, 2]);
        pool.commit(a[1], h(2), Some(h(1)), &[3, 4]);
        assert_eq!(pool.count_hits(&[h(1), h(2)]), 2, "both named");
        pool.release(&a);
        let e = pool.allocate(1).expect("evicts the chain's tail");
        assert_eq!(pool.count_hits(&[h(1), h(2)]), 1, "h2 evicted");
        pool.release(&e);
        assert!(pool.reset());
        assert!(
            pool.take_events().is_empty(),
            "no Stored, Removed or Cleared"
        );
        pool.set_events(true);
        let b = pool.allocate(1).expect("one");
        pool.commit(b[0], h(3), None, &[5, 6]);
        assert_eq!(pool.take_events().len(), 1, "on again");
    }

    #[test]
    fn tracked_evictions_carry_what_named_the_block_and_untracked_keep_nothing() {
        let mut pool = BlockPool::new(2, true);
        let a = pool.allocate(2).expect("two");
        pool.commit(a[0], h(1), None, &[1, 2]);
        pool.release(&a);
        pool.allocate(2).expect("evicts h1");
        assert_eq!(pool.drain_evicted().count(), 0, "not tracked");
        pool.release(&[0, 1]);

        pool.set_track_evictions(true);
        let lora = BlockLora {
            id: 2,
            name: "x".into(),
        };
        let a = pool.allocate(2).expect("two");
        pool.commit(a[0], h(3), None, &[5, 6]);
        pool.commit_lora(a[1], h(4), Some(h(3)), &[7, 8], Some(&lora));
        pool.release(&a);
        assert_eq!(pool.num_cached(), 2);
        assert_eq!(pool.ref_count(a[0]), 0);
        let b = pool.allocate(2).expect("evicts both");
        assert_eq!(pool.ref_count(b[0]), 1);
        let ev: Vec<EvictedBlock> = pool.drain_evicted().collect();
        // The tail (h4) goes first, as release queued it first.
        assert_eq!(
            ev,
            vec![
                EvictedBlock {
                    block: a[1],
                    hash: h(4),
                    parent: Some(h(3)),
                    tokens: vec![7, 8],
                    lora: Some(lora),
                },
                EvictedBlock {
                    block: a[0],
                    hash: h(3),
                    parent: None,
                    tokens: vec![5, 6],
                    lora: None,
                },
            ]
        );
        assert_eq!(pool.drain_evicted().count(), 0, "drained once");
        // Reset forgets names without evicting anything.
        pool.commit(b[0], h(9), None, &[1, 1]);
        pool.release(&b);
        assert!(pool.reset());
        pool.allocate(2).expect("two");
        assert_eq!(pool.drain_evicted().count(), 0);
    }

    #[test]
    fn without_prefix_caching_nothing_is_cached() {
        let mut pool = BlockPool::new(2, false);
        let a = pool.allocate(1).expect("one");
        pool.commit(a[0], h(1), None, &[1]);
        pool.release(&a);
        assert_eq!(pool.count_hits(&[h(1)]), 0);
        assert!(pool.take_events().is_empty());
    }
}
