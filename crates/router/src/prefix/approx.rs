//! The approximate prefix index (PROTOCOLS §6), for engines that publish no KV events.
//!
//! The router cannot see an engine's cache, so it remembers what it sent where: the
//! prompt text is cut into chunks of `block_size_tokens × 4` bytes (about four bytes per
//! token), each chunk's hash chains the previous one (xxhash64 seeded by the model name,
//! so equal text for different models never matches), and after each pick the chosen
//! endpoint is recorded as holding every chunk of the request. Each endpoint keeps at most
//! `capacity` hashes, least recently used evicted first, as a stand-in for its cache size.
//!
//! Invariant: `holders[h]` contains slot `e` exactly when `lru[e]` contains `h`.

use std::collections::VecDeque;

use xxhash_rust::xxh64::{xxh64, Xxh64};

use super::flat::FlatMap;
use super::{walk, walk_into, BlockMap, PrefixMatch, SlotSet};
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

#[derive(Debug, Default, Clone)]
struct EndpointLru {
    /// hash → tick of last use.
    last: BlockMap<u64>,
    /// (tick, hash) in the order of use, oldest first. A use of a hash already held
    /// leaves its older entry here, stale (its tick no longer `last[hash]`): eviction
    /// skips those, and the queue is compacted when they are half of it. This keeps
    /// the order of a tick-sorted map at a fraction of its cost per recorded block.
    order: VecDeque<(u64, u64)>,
}

impl EndpointLru {
    fn is_current(&self, tick: u64, h: u64) -> bool {
        self.last.get(&h) == Some(&tick)
    }

    /// The least recently used hash, taken out.
    fn pop_oldest(&mut self) -> Option<u64> {
        while let Some((tick, h)) = self.order.pop_front() {
            if self.is_current(tick, h) {
                self.last.remove(&h);
                return Some(h);
            }
        }
        None
    }

    fn compact(&mut self) {
        if self.order.len() > 2 * self.last.len() + 64 {
            let last = &self.last;
            self.order.retain(|(tick, h)| last.get(h) == Some(tick));
        }
    }
}

/// Text-chunk hashes → endpoints that were sent them.
#[derive(Debug, Clone)]
pub struct ApproxIndex {
    config: ApproxConfig,
    holders: FlatMap<SlotSet>,
    lru: Vec<EndpointLru>,
    tick: u64,
}

impl ApproxIndex {
    pub fn new(config: ApproxConfig) -> Self {
        ApproxIndex {
            config,
            holders: FlatMap::default(),
            lru: Vec::new(),
            tick: 0,
        }
    }

    pub fn config(&self) -> &ApproxConfig {
        &self.config
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
        for &h in blocks.iter().rev() {
            self.tick += 1;
            let lru = &mut self.lru[slot];
            if lru.last.insert(h, self.tick).is_none() {
                self.holders.get_or_default(h).insert(endpoint);
            }
            lru.order.push_back((self.tick, h));
        }
        let cap = self.config.capacity_per_endpoint;
        while self.lru[slot].last.len() > cap {
            let Some(h) = self.lru[slot].pop_oldest() else {
                break;
            };
            self.forget(h, endpoint);
        }
        self.lru[slot].compact();
    }

    fn forget(&mut self, h: u64, endpoint: EndpointId) {
        if let Some(set) = self.holders.get_mut(&h) {
            set.remove(endpoint);
            if set.is_empty() {
                self.holders.remove(&h);
            }
        }
    }

    /// Forgets everything about an endpoint (it was removed).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        let Some(lru) = self.lru.get_mut(endpoint.0 as usize) else {
            return;
        };
        let hashes: Vec<u64> = std::mem::take(lru).last.into_keys().collect();
        for h in hashes {
            self.forget(h, endpoint);
        }
    }

    /// Distinct hashes held by any endpoint.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Per candidate, how many leading blocks it holds.
    pub fn match_prefix(&self, blocks: &[u64], candidates: &[EndpointId]) -> Vec<PrefixMatch> {
        walk(
            blocks,
            candidates,
            |h| self.holders.prefetch(h),
            |h| self.holders.get(&h).map(|s| (s, None)),
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
            |h| self.holders.get(&h).map(|s| (s, None)),
            out,
        )
    }
}

/// Chained xxhash64 over `chunk`-byte pieces of `text`, seeded by the model name.
pub fn hash_text(model: &str, text: &str, chunk: usize, max_blocks: usize) -> Vec<u64> {
    let seed = xxh64(model.as_bytes(), 0);
    let mut prev = seed;
    text.as_bytes()
        .chunks_exact(chunk.max(1))
        .take(max_blocks)
        .map(|piece| {
            let mut h = Xxh64::new(seed);
            h.update(&prev.to_le_bytes());
            h.update(piece);
            prev = h.digest();
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
