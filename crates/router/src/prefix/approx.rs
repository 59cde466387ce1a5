//! The approximate prefix index (PROTOCOLS §6), for engines that publish no KV events.
//!
//! The router cannot see an engine's cache, so it remembers what it sent where: the
//! prompt text is cut into chunks of `block_size_tokens × 4` bytes (about four bytes per
//! token), each chunk's hash chains the previous one (xxhash64 seeded by the model name,
//! so equal text for different models never matches), and after each pick the chosen
//! endpoint is recorded as holding every chunk of the request. Each endpoint keeps at most
//! `capacity` hashes, least recently used evicted first, as a stand-in for its cache size.
//!
//! Invariant: `holders[h]` contains slot `e` at position `p` exactly when `h` is the entry
//! of `lru[e].order` at position `p` (with older, stale entries for `h` possibly before
//! it), and `lru[e].len` counts the hashes `e` holds.

use std::collections::VecDeque;

use xxhash_rust::xxh64::xxh64;

use super::lru_holders::HolderTable;
use super::{walk, walk_into, PrefixMatch};
use crate::endpoint::EndpointId;

/// Approximate-index settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxConfig {
    /// Tokens per block; a chunk is `4 ×` this many bytes of prompt text.
    pub block_size_tokens: usize,
    /// Hashes remembered per endpoint.
    pub capacity_per_endpoint: usize,
    /// Longest prompt prefix considered, in blocks.
    pub max_blocks: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        ApproxConfig {
            block_size_tokens: 16,
            capacity_per_endpoint: 65_536,
            max_blocks: 512,
        }
    }
}

/// One endpoint's LRU order.
///
/// A use of a hash pushes it at the back; its position is `base` plus its index (the
/// endpoint's count of pushes), and the table ([`HolderTable`]) keeps, beside the hash,
/// the position of the endpoint's last use of it. An older entry of a hash used again
/// stays in the queue, stale (its position no longer the one in the table): eviction
/// skips those, and the queue is compacted when they are half of it. This keeps the
/// order of a tick-sorted map at 8 bytes an entry and a fraction of its cost per block.
#[derive(Debug, Default, Clone)]
struct EndpointLru {
    /// Hashes held.
    len: usize,
    /// The position of `order[0]`.
    base: u64,
    /// Hashes in the order of use, oldest first.
    order: VecDeque<u64>,
}

/// Text-chunk hashes → endpoints that were sent them.
#[derive(Debug, Clone)]
pub struct ApproxIndex {
    config: ApproxConfig,
    holders: HolderTable,
    lru: Vec<EndpointLru>,
}

impl ApproxIndex {
    pub fn new(config: ApproxConfig) -> Self {
        ApproxIndex {
            config,
            holders: HolderTable::default(),
            lru: Vec::new(),
        }
    }

    pub fn config(&self) -> &ApproxConfig {
        &self.config
    }

    /// Room for `hashes` distinct chunk hashes in all without growing the table.
    pub fn reserve(&mut self, hashes: usize) {
        self.holders.reserve(hashes);
    }

    /// The chained chunk hashes of a prompt (full chunks only, at most `max_blocks`).
    pub fn hash_prompt(&self, model: &str, text: &str) -> Vec<u64> {
        hash_text(
            model,
            text,
            self.config.block_size_tokens.max(1) * 4,
            self.config.max_blocks,
        )
    }

    /// Records that `endpoint` was sent a request with these chunks.
    pub fn record(&mut self, endpoint: EndpointId, blocks: &[u64]) {
        let slot = endpoint.0 as usize;
        if self.lru.len() <= slot {
            self.lru.resize_with(slot + 1, EndpointLru::default);
        }
        // Newest tick to the first block: eviction takes a chain from its tail, and a
        // chain without its first block matches nothing.
        // Every chunk's slot is a cache miss in a large table: start them all first.
        for &h in blocks {
            self.holders.prefetch(h);
        }
        let lru = &mut self.lru[slot];
        for &h in blocks.iter().rev() {
            let pos = lru.base + lru.order.len() as u64;
            if !self.holders.set_position(h, endpoint.0, pos) {
                lru.len += 1;
            }
            if lru.order.len() == lru.order.capacity() {
                // Grow by a quarter, not double: a fleet's queues hold tens of millions
                // of entries, and doubling leaves up to half of that unused.
                lru.order.reserve_exact((lru.order.len() / 4).max(16));
            }
            lru.order.push_back(h);
        }
        let cap = self.config.capacity_per_endpoint;
        while lru.len > cap {
            // The least recently used hash, taken out.
            let Some(h) = lru.order.pop_front() else {
                break;
            };
            let pos = lru.base;
            lru.base += 1;
            if self.holders.position(h, endpoint.0) == Some(pos) {
                lru.len -= 1;
                self.holders.remove(h, endpoint.0);
            }
        }
        self.compact(endpoint.0);
    }

    /// Drops `slot`'s stale order entries when they are half of its queue, renumbering
    /// the rest from `base`. A hash's current entry is its last one in the queue, so
    /// every stale entry is met before its hash is renumbered.
    fn compact(&mut self, slot: u32) {
        let Some(lru) = self.lru.get_mut(slot as usize) else {
            return;
        };
        if lru.order.len() > 2 * lru.len + 64 {
            let holders = &mut self.holders;
            let (base, mut old, mut new) = (lru.base, lru.base, lru.base);
            lru.order.retain(|&h| {
                let current = holders.position(h, slot) == Some(old);
                old += 1;
                if current {
                    holders.set_position(h, slot, new);
                    new += 1;
                }
                current
            });
            debug_assert_eq!(new - base, lru.order.len() as u64);
        }
    }

    /// Forgets everything about an endpoint (it was removed).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        let Some(lru) = self.lru.get_mut(endpoint.0 as usize) else {
            return;
        };
        // Every hash held has its current entry in the order.
        let lru = std::mem::take(lru);
        for (pos, h) in (lru.base..).zip(lru.order) {
            if self.holders.position(h, endpoint.0) == Some(pos) {
                self.holders.remove(h, endpoint.0);
            }
        }
    }

    /// Distinct hashes held by any endpoint.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.len() == 0
    }

    /// Per candidate, how many leading blocks it holds.
    pub fn match_prefix(&self, blocks: &[u64], candidates: &[EndpointId]) -> Vec<PrefixMatch> {
        walk(
            blocks,
            candidates,
            |h| self.holders.prefetch(h),
            |h| self.holders.holders(h).map(|set| (set, None)),
        )
    }

    /// [`ApproxIndex::match_prefix`] into a caller's buffer (`out[i]` for the `i`-th
    /// candidate), allocating nothing on the scheduling path.
    pub fn match_prefix_into(
        &self,
        blocks: &[u64],
        candidates: impl Iterator<Item = EndpointId> + Clone,
        out: &mut [PrefixMatch],
    ) {
        walk_into(
            blocks,
            candidates,
            |h| self.holders.prefetch(h),
            |h| self.holders.holders(h).map(|set| (set, None)),
            out,
        )
    }
}

/// Chained xxhash64 over `chunk`-byte pieces of `text`, seeded by the model name.
pub fn hash_text(model: &str, text: &str, chunk: usize, max_blocks: usize) -> Vec<u64> {
    let mut chain = ChunkChain::new(model);
    text.as_bytes()
        .chunks_exact(chunk.max(1))
        .take(max_blocks)
        .map(|piece| chain.push(|buf| buf.extend_from_slice(piece)))
        .collect()
}

/// [`hash_text`]'s chain one chunk at a time, for a caller that writes each chunk's bytes
/// itself rather than the whole text first (the simulator, which renders token ids as
/// text). Each chunk is hashed in one call over the previous hash and the chunk side by
/// side (the same value as streaming them into one hasher, without its setup per chunk).
#[derive(Debug, Clone)]
pub struct ChunkChain {
    seed: u64,
    /// The previous hash (the seed at first), then the chunk being written.
    buf: Vec<u8>,
}

impl ChunkChain {
    /// A chain seeded by `model`'s name.
    pub fn new(model: &str) -> Self {
        let seed = xxh64(model.as_bytes(), 0);
        ChunkChain {
            seed,
            buf: seed.to_le_bytes().to_vec(),
        }
    }

    /// The next chunk's hash, its bytes appended by `write`.
    pub fn push(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> u64 {
        self.buf.truncate(8);
        write(&mut self.buf);
        let h = xxh64(&self.buf, self.seed);
        self.buf.truncate(0);
        self.buf.extend_from_slice(&h.to_le_bytes());
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::SlotSet;

    fn cfg(cap: usize) -> ApproxConfig {
        ApproxConfig {
            block_size_tokens: 1,
            capacity_per_endpoint: cap,
            max_blocks: 100,
        }
    }

    #[test]
    fn chunks_chain_and_depend_on_model() {
        let idx = ApproxIndex::new(cfg(100));
        let a = idx.hash_prompt("m", "aaaabbbbcc");
        assert_eq!(a.len(), 2, "only full 4-byte chunks");
        let b = idx.hash_prompt("m", "xxxxbbbb");
        assert_ne!(a[1], b[1], "chained: same chunk after a different prefix");
        assert_ne!(a, idx.hash_prompt("other", "aaaabbbbcc"));
        assert_eq!(a, idx.hash_prompt("m", "aaaabbbbcc"));
    }

    #[test]
    fn chunk_hashes_are_the_streamed_chain() {
        // The chain as PROTOCOLS §6 defines it: a hasher seeded by the model's hash, fed
        // the previous hash then the chunk.
        let streamed = |model: &str, text: &str, chunk: usize| {
            let seed = xxh64(model.as_bytes(), 0);
            let mut prev = seed;
            let mut out = Vec::new();
            for piece in text.as_bytes().chunks_exact(chunk) {
                let mut h = xxhash_rust::xxh64::Xxh64::new(seed);
                h.update(&prev.to_le_bytes());
                h.update(piece);
                prev = h.digest();
                out.push(prev);
            }
            out
        };
        let text: String = (0..700)
            .map(|i| char::from(b'a' + (i * 7 % 26) as u8))
            .collect();
        for chunk in [1, 4, 24, 64, 200] {
            assert_eq!(
                hash_text("m", &text, chunk, 1000),
                streamed("m", &text, chunk)
            );
        }
        assert_eq!(hash_text("m", &text, 64, 3), streamed("m", &text, 64)[..3]);
    }

    #[test]
    fn match_is_greedy_from_the_start() {
        let mut idx = ApproxIndex::new(cfg(100));
        let (e0, e1, e2) = (EndpointId(0), EndpointId(1), EndpointId(70));
        let long = idx.hash_prompt("m", "aaaabbbbccccdddd");
        let other = idx.hash_prompt("m", "aaaabbbbzzzz");
        idx.record(e0, &long);
        idx.record(e1, &other);
        let got = idx.match_prefix(&long, &[e0, e1, e2]);
        assert_eq!(
            got.iter().map(|m| m.blocks).collect::<Vec<_>>(),
            vec![4, 2, 0]
        );
        // A request whose first block nobody holds matches nothing.
        let fresh = idx.hash_prompt("m", "qqqqbbbb");
        assert!(idx
            .match_prefix(&fresh, &[e0, e1])
            .iter()
            .all(|m| m.blocks == 0));
    }

    proptest::proptest! {
        // Each case checks every hash on every endpoint after every operation: fewer,
        // shorter cases keep it well under a second.
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// The index holds, per endpoint, exactly what a plain LRU list would: the
        /// `capacity` most recently recorded hashes, a request's first block the most
        /// recent of its chain.
        #[test]
        fn lru_equals_a_plain_lru_list(
            ops in proptest::collection::vec(
                (0u32..3, proptest::collection::vec(0u64..24, 0..6), proptest::bool::weighted(0.05)),
                0..120,
            ),
        ) {
            let cap = 5;
            let mut idx = ApproxIndex::new(cfg(cap));
            // Per endpoint: hashes, least recently used first.
            let mut want: Vec<Vec<u64>> = vec![Vec::new(); 3];
            for (e, blocks, remove) in ops {
                let id = EndpointId(e * 70); // slots in different words
                if remove {
                    idx.remove_endpoint(id);
                    want[e as usize].clear();
                    continue;
                }
                idx.record(id, &blocks);
                let list = &mut want[e as usize];
                for &h in blocks.iter().rev() {
                    list.retain(|x| *x != h);
                    list.push(h);
                }
                while list.len() > cap {
                    list.remove(0);
                }
                for h in 0u64..24 {
                    for (w, list) in want.iter().enumerate() {
                        let got = idx.match_prefix(&[h], &[EndpointId(w as u32 * 70)])[0].blocks;
                        proptest::prop_assert_eq!(got == 1, list.contains(&h), "hash {} endpoint {}", h, w);
                    }
                }
                let distinct: std::collections::HashSet<u64> = want.iter().flatten().copied().collect();
                proptest::prop_assert_eq!(idx.len(), distinct.len());
            }
        }
    }

    #[test]
    fn holders_move_between_one_and_many() {
        let mut idx = ApproxIndex::new(cfg(100));
        let (a, b) = (EndpointId(1), EndpointId(300));
        idx.record(a, &[7]);
        idx.record(b, &[7]);
        assert_eq!(
            idx.match_prefix(&[7], &[a, b])
                .iter()
                .map(|m| m.blocks)
                .collect::<Vec<_>>(),
            vec![1, 1]
        );
        idx.remove_endpoint(a);
        assert_eq!(idx.holders.position(7, 1), None);
        assert_eq!(idx.holders.position(7, 300), Some(0));
        assert_eq!(
            idx.holders.holders(7).map(|s| s.into_owned()),
            Some(SlotSet::single(b))
        );
        idx.remove_endpoint(b);
        assert!(idx.is_empty());
    }

    #[test]
    fn compaction_keeps_the_order_and_renumbers_what_it_keeps() {
        let mut idx = ApproxIndex::new(cfg(4));
        let e = EndpointId(3);
        // 3 hashes used 200 times each: the queue compacts several times over.
        for _ in 0..200 {
            idx.record(e, &[10, 11, 12]);
        }
        let lru = &idx.lru[3];
        assert!(lru.order.len() <= 2 * lru.len + 64, "compacted");
        for (pos, &h) in (lru.base..).zip(&lru.order) {
            let current = idx.holders.position(h, 3) == Some(pos);
            let last = lru.order.iter().rposition(|&x| x == h) == Some((pos - lru.base) as usize);
            assert_eq!(current, last, "hash {h} at {pos}");
        }
        // Five hashes for four places: the least recently used goes, 12 (a chain's tail
        // is its oldest block), then 11 with one more.
        idx.record(e, &[20, 21]);
        let held = |idx: &ApproxIndex, h| idx.match_prefix(&[h], &[e])[0].blocks == 1;
        assert!(!held(&idx, 12) && held(&idx, 11) && held(&idx, 10));
        idx.record(e, &[22]);
        assert!(!held(&idx, 11) && held(&idx, 10) && held(&idx, 20) && held(&idx, 22));
        assert_eq!(idx.len(), 4);
    }

    #[test]
    fn lru_evicts_oldest_per_endpoint_and_removal_forgets() {
        let mut idx = ApproxIndex::new(cfg(3));
        let e = EndpointId(2);
        idx.record(e, &[1, 2, 3]); // the chain's tail is the oldest
        idx.record(e, &[2]); // refresh 2
        idx.record(e, &[4]); // evicts 3, the tail
        assert_eq!(idx.len(), 3);
        assert_eq!(idx.match_prefix(&[1, 2, 3], &[e])[0].blocks, 2);
        assert_eq!(idx.match_prefix(&[3], &[e])[0].blocks, 0);
        idx.record(e, &[5]); // evicts 1 (older than the refreshed 2)
        assert_eq!(idx.match_prefix(&[1], &[e])[0].blocks, 0);
        assert_eq!(idx.match_prefix(&[2], &[e])[0].blocks, 1);
        idx.record(EndpointId(0), &[2]);
        idx.remove_endpoint(e);
        assert_eq!(idx.len(), 1, "only the other endpoint's hash remains");
        assert_eq!(idx.match_prefix(&[2], &[EndpointId(0)])[0].blocks, 1);
    }
}
