//! Prefix indexes: which endpoint already holds which prefix of a request.
//!
//! - [`approx`]: for engines that publish no KV events. The router remembers which
//!   prompt-text chunks it sent where (xxhash64 chain, one LRU per endpoint), PROTOCOLS §6.
//! - [`precise`]: mirrors every endpoint's KV cache from its KV events (PROTOCOLS §4),
//!   block hash → endpoints per tier.
//! - [`hashing`]: vLLM-compatible block hashes of token ids (PROTOCOLS §3), so a request's
//!   blocks can be looked up in the precise index.
//!
//! Both indexes answer the same question the same way: walk the request's chained block
//! hashes from the start and, per endpoint, count how many leading blocks it holds. A
//! chained hash stands for its whole prefix, so the walk stops for an endpoint at its
//! first miss. Endpoint sets are bitsets over slots ([`SlotSet`]), which keeps the walk at
//! one AND per block. Pure and synchronous: no clock, no I/O.

pub mod approx;
pub mod flat;
pub mod hashing;
pub mod precise;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use smallvec::SmallVec;

use crate::endpoint::EndpointId;

/// A map keyed by block hash. Keys are already uniform hashes, so hashing them again with
/// SipHash (the std default) only costs time on the scheduling path; instead each key is
/// mixed with a per-process random key and one multiply, which keeps an adversary who can
/// choose prompts from aiming at one bucket without knowing the key.
pub type BlockMap<V> = HashMap<u64, V, BlockHashState>;

/// The [`BuildHasher`] of [`BlockMap`].
#[derive(Debug, Clone, Copy)]
pub struct BlockHashState {
    key: u64,
}

impl Default for BlockHashState {
    fn default() -> Self {
        static KEY: OnceLock<u64> = OnceLock::new();
        let key =
            *KEY.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0u64) | 1);
        BlockHashState { key }
    }
}

impl BuildHasher for BlockHashState {
    type Hasher = BlockHasherState;
    fn build_hasher(&self) -> BlockHasherState {
        BlockHasherState {
            key: self.key,
            h: 0,
        }
    }
}

/// The hasher of [`BlockHashState`].
#[derive(Debug, Clone, Copy)]
pub struct BlockHasherState {
    key: u64,
    h: u64,
}

impl Hasher for BlockHasherState {
    fn finish(&self) -> u64 {
        self.h
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.h.rotate_left(8) ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        let x = (n ^ self.key).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.h = x ^ (x >> 29);
    }
}

/// A set of endpoint slots. The first 64 slots live inline, so the common case allocates
/// nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotSet {
    first: u64,
    /// Words for slots 64 and up; boxed so a set costs 16 bytes in the index tables
    /// (which hold one per block hash), where a bare `Vec` would cost 32.
    #[allow(clippy::box_collection)]
    more: Option<Box<Vec<u64>>>,
}

impl SlotSet {
    /// The empty set.
    pub const fn new() -> Self {
        SlotSet {
            first: 0,
            more: None,
        }
    }

    #[inline]
    fn word(&self, i: usize) -> u64 {
        if i == 0 {
            self.first
        } else {
            self.more
                .as_ref()
                .and_then(|m| m.get(i - 1))
                .copied()
                .unwrap_or(0)
        }
    }

    fn word_mut(&mut self, i: usize) -> &mut u64 {
        if i == 0 {
            &mut self.first
        } else {
            let more = self.more.get_or_insert_with(Box::default);
            if more.len() < i {
                more.resize(i, 0);
            }
            &mut more[i - 1]
        }
    }

    fn words(&self) -> usize {
        1 + self.more.as_ref().map_or(0, |m| m.len())
    }

    #[inline]
    pub fn insert(&mut self, id: EndpointId) {
        let i = id.0 as usize;
        *self.word_mut(i / 64) |= 1 << (i % 64);
    }

    pub fn remove(&mut self, id: EndpointId) {
        let i = id.0 as usize;
        if i / 64 < self.words() {
            *self.word_mut(i / 64) &= !(1 << (i % 64));
        }
    }

    #[inline]
    pub fn contains(&self, id: EndpointId) -> bool {
        let i = id.0 as usize;
        self.word(i / 64) & (1 << (i % 64)) != 0
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.first == 0 && self.more.iter().flat_map(|m| m.iter()).all(|w| *w == 0)
    }

    pub fn len(&self) -> usize {
        self.first.count_ones() as usize
            + self
                .more
                .iter()
                .flat_map(|m| m.iter())
                .map(|w| w.count_ones() as usize)
                .sum::<usize>()
    }

    /// `self & other`.
    #[inline]
    pub fn and(&self, other: &SlotSet) -> SlotSet {
        // Fast path (at most 64 slots on either side): one word, nothing allocated. Same
        // result as the general case, which also leaves `more` empty for one word.
        if self.more.is_none() || other.more.is_none() {
            return SlotSet {
                first: self.first & other.first,
                more: None,
            };
        }
        let n = self.words().min(other.words());
        let mut out = SlotSet {
            first: self.first & other.first,
            more: None,
        };
        for i in 1..n {
            *out.word_mut(i) = self.word(i) & other.word(i);
        }
        out
    }

    /// `self | other`.
    #[inline]
    pub fn or(&self, other: &SlotSet) -> SlotSet {
        if self.more.is_none() && other.more.is_none() {
            return SlotSet {
                first: self.first | other.first,
                more: None,
            };
        }
        let n = self.words().max(other.words());
        let mut out = SlotSet {
            first: self.first | other.first,
            more: None,
        };
        for i in 1..n {
            *out.word_mut(i) = self.word(i) | other.word(i);
        }
        out
    }

    /// `self & !other`.
    #[inline]
    pub fn and_not(&self, other: &SlotSet) -> SlotSet {
        if self.more.is_none() {
            return SlotSet {
                first: self.first & !other.first,
                more: None,
            };
        }
        let mut out = SlotSet {
            first: self.first & !other.first,
            more: None,
        };
        for i in 1..self.words() {
            *out.word_mut(i) = self.word(i) & !other.word(i);
        }
        out
    }

    /// The members, ascending.
    pub fn iter(&self) -> impl Iterator<Item = EndpointId> + '_ {
        (0..self.words()).flat_map(move |w| {
            let mut bits = self.word(w);
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                Some(EndpointId(w as u32 * 64 + b))
            })
        })
    }
}

impl FromIterator<EndpointId> for SlotSet {
    fn from_iter<I: IntoIterator<Item = EndpointId>>(iter: I) -> Self {
        let mut s = SlotSet::new();
        for id in iter {
            s.insert(id);
        }
        s
    }
}

/// Per-endpoint result of a prefix walk.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefixMatch {
    /// Leading blocks held (in any tier).
    pub blocks: u32,
    /// Of those, how many only in a lower tier (host memory).
    pub lower_tier: u32,
}

/// Walks `blocks` from the start over `candidates`, calling `holders(hash)` for the
/// (upper-tier, lower-tier) sets holding each block, and returns one [`PrefixMatch`] per
/// candidate, in the order of `candidates`.
pub(crate) fn walk<'a>(
    blocks: &[u64],
    candidates: &[EndpointId],
    prefetch: impl Fn(u64),
    holders: impl FnMut(u64) -> Option<(&'a SlotSet, Option<&'a SlotSet>)>,
) -> Vec<PrefixMatch> {
    let mut out = vec![PrefixMatch::default(); candidates.len()];
    walk_into(
        blocks,
        candidates.iter().copied(),
        prefetch,
        holders,
        &mut out,
    );
    out
}

/// Slots a walk tracks without touching the heap; more spill to one allocation.
const INLINE_SLOTS: usize = 128;

/// [`walk`] into a caller's buffer: `out[i]` is set for the `i`-th of `candidates`
/// (`out` must be at least that long). Allocates nothing for up to 128 endpoint slots.
/// `prefetch(hash)` may start loading a block's table slot before `holders` reads it.
pub(crate) fn walk_into<'a>(
    blocks: &[u64],
    candidates: impl Iterator<Item = EndpointId> + Clone,
    prefetch: impl Fn(u64),
    mut holders: impl FnMut(u64) -> Option<(&'a SlotSet, Option<&'a SlotSet>)>,
    out: &mut [PrefixMatch],
) {
    out.iter_mut().for_each(|m| *m = PrefixMatch::default());
    if blocks.is_empty() {
        return;
    }
    let mut alive = SlotSet::new();
    let mut max_slot = None;
    for c in candidates.clone() {
        alive.insert(c);
        max_slot = max_slot.max(Some(c.0 as usize));
    }
    let Some(max_slot) = max_slot else { return };
    // slot → (matched, lower) accumulators, only for the slots that are still alive.
    let mut matched: SmallVec<[PrefixMatch; INLINE_SLOTS]> =
        smallvec::smallvec![PrefixMatch::default(); max_slot + 1];
    let mut stop = blocks.len();
    // Look blocks up a group at a time: the lookups are independent cache misses in a
    // large table, so the next group's slots are prefetched while this group is looked
    // up and walked; stopping after each group keeps a request nobody holds cheap.
    const GROUP: usize = 8;
    let mut found: [Option<(&SlotSet, Option<&SlotSet>)>; GROUP] = [None; GROUP];
    blocks.iter().take(GROUP).for_each(|&h| prefetch(h));
    'walk: for (g, group) in blocks.chunks(GROUP).enumerate() {
        blocks
            .iter()
            .skip((g + 1) * GROUP)
            .take(GROUP)
            .for_each(|&h| prefetch(h));
        for (f, &h) in found.iter_mut().zip(group) {
            *f = holders(h);
        }
        for (j, entry) in found[..group.len()].iter().enumerate() {
            let i = g * GROUP + j;
            let Some((upper, lower)) = *entry else {
                stop = i;
                break 'walk;
            };
            let next = match lower {
                Some(l) => alive.and(&upper.or(l)),
                None => alive.and(upper),
            };
            if let Some(l) = lower {
                if !l.is_empty() {
                    for id in next.and(l).and_not(upper).iter() {
                        matched[id.0 as usize].lower_tier += 1;
                    }
                }
            }
            if next != alive {
                for id in alive.and_not(&next).iter() {
                    matched[id.0 as usize].blocks = i as u32;
                }
                alive = next;
            }
            if alive.is_empty() {
                break 'walk;
            }
        }
    }
    for id in alive.iter() {
        matched[id.0 as usize].blocks = stop as u32;
    }
    for (slot, c) in out.iter_mut().zip(candidates) {
        *slot = matched[c.0 as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<EndpointId> {
        v.iter().map(|i| EndpointId(*i)).collect()
    }

    #[test]
    fn slot_set_ops_across_words() {
        let a: SlotSet = ids(&[0, 3, 64, 130]).into_iter().collect();
        let b: SlotSet = ids(&[3, 130, 5]).into_iter().collect();
        assert_eq!(a.and(&b).iter().collect::<Vec<_>>(), ids(&[3, 130]));
        assert_eq!(a.or(&b).len(), 5);
        assert_eq!(a.and_not(&b).iter().collect::<Vec<_>>(), ids(&[0, 64]));
        assert!(a.contains(EndpointId(64)) && !a.contains(EndpointId(65)));
        let mut c = a.clone();
        for id in ids(&[0, 3, 64, 130]) {
            c.remove(id);
        }
        assert!(c.is_empty());
        c.remove(EndpointId(1000));
        assert!(c.is_empty());
    }
}

#[cfg(test)]
mod walk_properties {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// The straightforward answer: per candidate, count leading blocks it holds in either
    /// tier, and of those the ones held only in the lower tier.
    fn reference(
        blocks: &[u64],
        candidates: &[EndpointId],
        table: &HashMap<u64, (SlotSet, SlotSet)>,
    ) -> Vec<PrefixMatch> {
        candidates
            .iter()
            .map(|&c| {
                let mut m = PrefixMatch::default();
                for h in blocks {
                    let Some((u, l)) = table.get(h) else { break };
                    if u.contains(c) {
                        m.blocks += 1;
                    } else if l.contains(c) {
                        m.blocks += 1;
                        m.lower_tier += 1;
                    } else {
                        break;
                    }
                }
                m
            })
            .collect()
    }

    proptest! {
        #[test]
        fn walk_equals_reference(
            entries in proptest::collection::vec(
                (0u64..40, proptest::collection::vec(0u32..140, 0..6), proptest::collection::vec(0u32..140, 0..4)),
                0..60,
            ),
            blocks in proptest::collection::vec(0u64..40, 0..30),
            cand_slots in proptest::collection::btree_set(0u32..140, 0..20),
        ) {
            let mut table: HashMap<u64, (SlotSet, SlotSet)> = HashMap::new();
            for (h, up, low) in entries {
                let e = table.entry(h).or_default();
                up.into_iter().for_each(|s| e.0.insert(EndpointId(s)));
                low.into_iter().for_each(|s| e.1.insert(EndpointId(s)));
            }
            let candidates: Vec<EndpointId> = cand_slots.into_iter().map(EndpointId).collect();
            let got = walk(&blocks, &candidates, |_| {}, |h| table.get(&h).map(|(u, l)| (u, Some(l))));
            prop_assert_eq!(got, reference(&blocks, &candidates, &table));
        }
    }
}
