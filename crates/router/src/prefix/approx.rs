//! The approximate prefix index (PROTOCOLS §6), for engines that publish no KV events.
//!
//! The router cannot see an engine's cache, so it remembers what it sent where: the
//! prompt text is cut into chunks of `block_size_tokens × 4` bytes (about four bytes per
//! token), each chunk's hash chains the previous one (xxhash64 seeded by the model name,
//! so equal text for different models never matches), and after each pick the chosen
//! endpoint is recorded as holding every chunk of the request. Each endpoint keeps at most
//! `capacity` hashes, least recently used evicted first, as a stand-in for its cache size.
//!
//! Invariant: `holders[h]` contains slot `e` with tick `t` exactly when `(t, h)` is in
//! `lru[e].order` (with older, stale entries for `h` possibly before it), and `lru[e].len`
//! counts the hashes `e` holds.

use std::borrow::Cow;
use std::collections::VecDeque;

use xxhash_rust::xxh64::{xxh64, Xxh64};

use super::flat::FlatMap;
use super::{walk, walk_into, PrefixMatch, SlotSet};
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

/// The endpoints holding one hash, each with the tick of its last use there.
///
/// Nearly every hash is held by one endpoint, so that case is inline (16 bytes in the
/// table, no allocation); a hash held by several keeps their set and ticks boxed.
#[derive(Debug, Clone, Default)]
enum Holders {
    /// Only while an entry is being filled.
    #[default]
    Empty,
    One {
        slot: u32,
        tick: u64,
    },
    Many(Box<ManyHolders>),
}

#[derive(Debug, Clone, Default)]
struct ManyHolders {
    set: SlotSet,
    /// (slot, tick of last use), one per member of `set`.
    ticks: Vec<(u32, u64)>,
}

impl Holders {
    /// The tick of `slot`'s last use of this hash, if it holds it.
    fn tick_of(&self, slot: u32) -> Option<u64> {
        match self {
            Holders::Empty => None,
            Holders::One { slot: s, tick } => (*s == slot).then_some(*tick),
            Holders::Many(m) => m.ticks.iter().find(|(s, _)| *s == slot).map(|(_, t)| *t),
        }
    }

    /// Sets `slot`'s tick; whether `slot` held the hash before.
    fn set_tick(&mut self, slot: u32, tick: u64) -> bool {
        match self {
            Holders::One { slot: s, tick: t } if *s == slot => {
                *t = tick;
                true
            }
            Holders::Empty => {
                *self = Holders::One { slot, tick };
                false
            }
            Holders::One { slot: s, tick: t } => {
                let (s, t) = (*s, *t);
                let set = [s, slot].into_iter().map(EndpointId).collect();
                *self = Holders::Many(Box::new(ManyHolders {
                    set,
                    ticks: vec![(s, t), (slot, tick)],
                }));
                false
            }
            Holders::Many(m) => {
                if let Some(e) = m.ticks.iter_mut().find(|(s, _)| *s == slot) {
                    e.1 = tick;
                    return true;
                }
                m.ticks.push((slot, tick));
                m.set.insert(EndpointId(slot));
                false
            }
        }
    }

    /// Takes `slot` out; whether no holder is left.
    fn remove(&mut self, slot: u32) -> bool {
        match self {
            Holders::Empty => true,
            Holders::One { slot: s, .. } => *s == slot,
            Holders::Many(m) => {
                m.ticks.retain(|(s, _)| *s != slot);
                m.set.remove(EndpointId(slot));
                match m.ticks.as_slice() {
                    [] => true,
                    &[(slot, tick)] => {
                        *self = Holders::One { slot, tick };
                        false
                    }
                    _ => false,
                }
            }
        }
    }

    /// The holders as a set.
    #[inline]
    fn set(&self) -> Cow<'_, SlotSet> {
        match self {
            Holders::Empty => Cow::Owned(SlotSet::new()),
            Holders::One { slot, .. } => Cow::Owned(SlotSet::single(EndpointId(*slot))),
            Holders::Many(m) => Cow::Borrowed(&m.set),
        }
    }
}

/// One endpoint's LRU order. The tick of its last use of each hash it holds lives in the
/// index's table ([`Holders`]), beside the hash: no per-endpoint map.
#[derive(Debug, Default, Clone)]
struct EndpointLru {
    /// Hashes held.
    len: usize,
    /// (tick, hash) in the order of use, oldest first. A use of a hash already held
    /// leaves its older entry here, stale (its tick no longer the one in the table):
    /// eviction skips those, and the queue is compacted when they are half of it. This
    /// keeps the order of a tick-sorted map at a fraction of its cost per recorded block.
    order: VecDeque<(u64, u64)>,
}

/// Text-chunk hashes → endpoints that were sent them.
#[derive(Debug, Clone)]
pub struct ApproxIndex {
    config: ApproxConfig,
    holders: FlatMap<Holders>,
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

    /// Whether `(tick, h)` is `slot`'s last use of `h`.
    fn is_current(&self, slot: u32, tick: u64, h: u64) -> bool {
        self.holders
            .get(&h)
            .is_some_and(|e| e.tick_of(slot) == Some(tick))
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
            if !self
                .holders
                .get_or_default(h)
                .set_tick(endpoint.0, self.tick)
            {
                lru.len += 1;
            }
            if lru.order.len() == lru.order.capacity() {
                // Grow by a quarter, not double: a fleet's queues hold tens of millions
                // of entries, and doubling leaves up to half of that unused.
                lru.order.reserve_exact((lru.order.len() / 4).max(16));
            }
            lru.order.push_back((self.tick, h));
        }
        let cap = self.config.capacity_per_endpoint;
        while self.lru[slot].len > cap {
            // The least recently used hash, taken out.
            let Some((tick, h)) = self.lru[slot].order.pop_front() else {
                break;
            };
            if self.is_current(endpoint.0, tick, h) {
                self.lru[slot].len -= 1;
                self.forget(h, endpoint);
            }
        }
        self.compact(endpoint.0);
    }

    /// Drops `slot`'s stale order entries when they are half of its queue.
    fn compact(&mut self, slot: u32) {
        let Some(lru) = self.lru.get_mut(slot as usize) else {
            return;
        };
        if lru.order.len() > 2 * lru.len + 64 {
            let mut order = std::mem::take(&mut lru.order);
            order.retain(|&(tick, h)| self.is_current(slot, tick, h));
            self.lru[slot as usize].order = order;
        }
    }

    fn forget(&mut self, h: u64, endpoint: EndpointId) {
        if let Some(e) = self.holders.get_mut(&h) {
            if e.remove(endpoint.0) {
                self.holders.remove(&h);
            }
        }
    }

    /// Forgets everything about an endpoint (it was removed).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        let Some(lru) = self.lru.get_mut(endpoint.0 as usize) else {
            return;
        };
        // Every hash held has its current entry in the order.
        let order = std::mem::take(lru).order;
        for (tick, h) in order {
            if self.is_current(endpoint.0, tick, h) {
                self.forget(h, endpoint);
            }
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
            |h| self.holders.get(&h).map(|e| (e.set(), None)),
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
            |h| self.holders.get(&h).map(|e| (e.set(), None)),
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
    fn a_hash_held_by_one_endpoint_costs_one_table_slot() {
        // Key and holders with its tick: no allocation, no per-endpoint map entry.
        assert_eq!(std::mem::size_of::<Option<(u64, Holders)>>(), 24);
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
        assert!(matches!(
            idx.holders.get(&7),
            Some(Holders::One { slot: 300, .. })
        ));
        idx.remove_endpoint(b);
        assert!(idx.is_empty());
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
