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
mod lru_holders;
pub mod precise;

use std::borrow::Cow;
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

/// A set of endpoint slots.
///
/// Most index entries are held by one endpoint or a few neighbours, while a fleet may
/// number in the thousands: so a set whose members fit in one 64-slot word keeps that
/// word inline, whichever word it is, and only a set spanning words allocates. A set
/// costs 16 bytes in the index tables (which hold one per block hash) and, for one
/// endpoint out of a thousand, no allocation at all.
#[derive(Debug, Clone)]
pub struct SlotSet(Repr);

#[derive(Debug, Clone)]
enum Repr {
    /// Members only in word `base` (slots `64 × base ..`); `bits == 0` is the empty set,
    /// whatever `base`.
    One { base: u32, bits: u64 },
    /// Words from slot 0. Boxed so the set stays 16 bytes (a bare `Vec` is 24).
    #[allow(clippy::box_collection)]
    Many(Box<Vec<u64>>),
}

impl Default for SlotSet {
    fn default() -> Self {
        SlotSet::new()
    }
}

/// Set equality, whichever representation each side has.
impl PartialEq for SlotSet {
    fn eq(&self, other: &SlotSet) -> bool {
        match (&self.0, &other.0) {
            (Repr::One { base: a, bits: x }, Repr::One { base: b, bits: y }) => {
                x == y && (a == b || *x == 0)
            }
            _ => {
                let n = self.words_hi().max(other.words_hi());
                (0..n).all(|i| self.word(i) == other.word(i))
            }
        }
    }
}

impl Eq for SlotSet {}

impl SlotSet {
    /// The empty set.
    pub const fn new() -> Self {
        SlotSet(Repr::One { base: 0, bits: 0 })
    }

    /// The set of one endpoint.
    #[inline]
    pub fn single(id: EndpointId) -> Self {
        let i = id.0 as usize;
        SlotSet(Repr::One {
            base: (i / 64) as u32,
            bits: 1u64 << (i % 64),
        })
    }

    #[inline]
    fn word(&self, i: usize) -> u64 {
        match &self.0 {
            Repr::One { base, bits } => {
                if *base as usize == i {
                    *bits
                } else {
                    0
                }
            }
            Repr::Many(v) => v.get(i).copied().unwrap_or(0),
        }
    }

    /// One past the last word that may be non-zero.
    #[inline]
    fn words_hi(&self) -> usize {
        match &self.0 {
            Repr::One { base, .. } => *base as usize + 1,
            Repr::Many(v) => v.len(),
        }
    }

    /// The set of `words` (from slot 0), inline when at most one word is non-zero.
    fn from_words(mut words: Vec<u64>) -> SlotSet {
        let mut nonzero = words.iter().enumerate().filter(|(_, w)| **w != 0);
        match (nonzero.next(), nonzero.next()) {
            (None, _) => SlotSet::new(),
            (Some((i, &bits)), None) => SlotSet(Repr::One {
                base: i as u32,
                bits,
            }),
            _ => {
                while words.last() == Some(&0) {
                    words.pop();
                }
                SlotSet(Repr::Many(Box::new(words)))
            }
        }
    }

    #[inline]
    pub fn insert(&mut self, id: EndpointId) {
        let i = id.0 as usize;
        let (w, bit) = (i / 64, 1u64 << (i % 64));
        match &mut self.0 {
            Repr::One { base, bits } if *bits == 0 || *base as usize == w => {
                *base = w as u32;
                *bits |= bit;
            }
            Repr::One { base, bits } => {
                let mut v = vec![0u64; w.max(*base as usize) + 1];
                v[*base as usize] = *bits;
                v[w] |= bit;
                self.0 = Repr::Many(Box::new(v));
            }
            Repr::Many(v) => {
                if v.len() <= w {
                    v.resize(w + 1, 0);
                }
                v[w] |= bit;
            }
        }
    }

    pub fn remove(&mut self, id: EndpointId) {
        let i = id.0 as usize;
        let (w, bit) = (i / 64, 1u64 << (i % 64));
        match &mut self.0 {
            Repr::One { base, bits } => {
                if *base as usize == w {
                    *bits &= !bit;
                }
            }
            Repr::Many(v) => {
                if let Some(x) = v.get_mut(w) {
                    *x &= !bit;
                }
            }
        }
    }

    #[inline]
    pub fn contains(&self, id: EndpointId) -> bool {
        let i = id.0 as usize;
        self.word(i / 64) & (1 << (i % 64)) != 0
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        match &self.0 {
            Repr::One { bits, .. } => *bits == 0,
            Repr::Many(v) => v.iter().all(|w| *w == 0),
        }
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::One { bits, .. } => bits.count_ones() as usize,
            Repr::Many(v) => v.iter().map(|w| w.count_ones() as usize).sum(),
        }
    }

    /// `self & other`.
    #[inline]
    pub fn and(&self, other: &SlotSet) -> SlotSet {
        // Fast path: one side is one word, so the result is that word at most.
        match (&self.0, &other.0) {
            (Repr::One { base, bits }, _) => SlotSet(Repr::One {
                base: *base,
                bits: bits & other.word(*base as usize),
            }),
            (_, Repr::One { base, bits }) => SlotSet(Repr::One {
                base: *base,
                bits: bits & self.word(*base as usize),
            }),
            (Repr::Many(a), Repr::Many(b)) => {
                SlotSet::from_words(a.iter().zip(b.iter()).map(|(x, y)| x & y).collect())
            }
        }
    }

    /// `self | other`.
    #[inline]
    pub fn or(&self, other: &SlotSet) -> SlotSet {
        match (&self.0, &other.0) {
            (Repr::One { bits: 0, .. }, _) => other.clone(),
            (_, Repr::One { bits: 0, .. }) => self.clone(),
            (Repr::One { base: a, bits: x }, Repr::One { base: b, bits: y }) if a == b => {
                SlotSet(Repr::One {
                    base: *a,
                    bits: x | y,
                })
            }
            _ => {
                let n = self.words_hi().max(other.words_hi());
                SlotSet::from_words((0..n).map(|i| self.word(i) | other.word(i)).collect())
            }
        }
    }

    /// `self & !other`.
    #[inline]
    pub fn and_not(&self, other: &SlotSet) -> SlotSet {
        match &self.0 {
            Repr::One { base, bits } => SlotSet(Repr::One {
                base: *base,
                bits: bits & !other.word(*base as usize),
            }),
            Repr::Many(a) => SlotSet::from_words(
                a.iter()
                    .enumerate()
                    .map(|(i, x)| x & !other.word(i))
                    .collect(),
            ),
        }
    }

    /// The members, ascending.
    pub fn iter(&self) -> impl Iterator<Item = EndpointId> + '_ {
        let (lo, hi) = match &self.0 {
            Repr::One { base, .. } => (*base as usize, *base as usize + 1),
            Repr::Many(v) => (0, v.len()),
        };
        (lo..hi).flat_map(move |w| {
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
    holders: impl FnMut(u64) -> Option<(Cow<'a, SlotSet>, Option<&'a SlotSet>)>,
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
    mut holders: impl FnMut(u64) -> Option<(Cow<'a, SlotSet>, Option<&'a SlotSet>)>,
    out: &mut [PrefixMatch],
) {
    out.iter_mut().for_each(|m| *m = PrefixMatch::default());
    let Some(&first) = blocks.first() else { return };
    // A first block nobody holds (every new prompt's) matches nothing anywhere: answered
    // before building the candidates' set and accumulators, which a thousand candidates
    // make the walk's largest cost. Otherwise its holders start the first group.
    let mut first_holders = holders(first);
    if first_holders.is_none() {
        return;
    }
    // The candidates' set, its words filled directly (a thousand inserts one by one
    // cost more than the rest of the walk).
    let Some(max_slot) = candidates.clone().map(|c| c.0 as usize).max() else {
        return;
    };
    let mut words = vec![0u64; max_slot / 64 + 1];
    for c in candidates.clone() {
        words[c.0 as usize / 64] |= 1 << (c.0 % 64);
    }
    let mut alive = SlotSet::from_words(words);
    // slot → (matched, lower) accumulators, only for the slots that are still alive.
    let mut matched: SmallVec<[PrefixMatch; INLINE_SLOTS]> =
        smallvec::smallvec![PrefixMatch::default(); max_slot + 1];
    let mut stop = blocks.len();
    // Look blocks up a group at a time: the lookups are independent cache misses in a
    // large table, so the next group's slots are prefetched while this group is looked
    // up and walked; stopping after each group keeps a request nobody holds cheap.
    const GROUP: usize = 8;
    let mut found: [Option<(Cow<SlotSet>, Option<&SlotSet>)>; GROUP] =
        std::array::from_fn(|_| None);
    blocks.iter().take(GROUP).for_each(|&h| prefetch(h));
    'walk: for (g, group) in blocks.chunks(GROUP).enumerate() {
        blocks
            .iter()
            .skip((g + 1) * GROUP)
            .take(GROUP)
            .for_each(|&h| prefetch(h));
        for (j, (f, &h)) in found.iter_mut().zip(group).enumerate() {
            *f = if g == 0 && j == 0 {
                first_holders.take()
            } else {
                holders(h)
            };
        }
        for (j, entry) in found[..group.len()].iter().enumerate() {
            let i = g * GROUP + j;
            let Some((upper, lower)) = entry else {
                stop = i;
                break 'walk;
            };
            // An empty lower tier (the common case) needs no union, which for a set
            // spanning words would allocate once per block.
            let (upper, lower) = (upper.as_ref(), *lower);
            let next = match lower {
                Some(l) if !l.is_empty() => alive.and(&upper.or(l)),
                _ => alive.and(upper),
            };
            if let Some(l) = lower {
                if !l.is_empty() {
                    for id in next.and(l).and_not(upper).iter() {
                        matched[id.0 as usize].lower_tier += 1;
                    }
                }
            }
            if next != alive {
                // Those dropping out matched `i` blocks; at the first block that is the
                // 0 they start with (most of a large pool, when one endpoint holds it).
                if i > 0 {
                    for id in alive.and_not(&next).iter() {
                        matched[id.0 as usize].blocks = i as u32;
                    }
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

    #[test]
    fn one_far_endpoint_stays_inline_and_sets_stay_small() {
        assert_eq!(std::mem::size_of::<SlotSet>(), 16);
        let mut s = SlotSet::new();
        s.insert(EndpointId(900));
        assert!(matches!(s.0, Repr::One { base: 14, .. }));
        s.insert(EndpointId(901));
        assert!(matches!(s.0, Repr::One { .. }));
        s.insert(EndpointId(3));
        assert!(matches!(s.0, Repr::Many(_)));
        assert_eq!(s.iter().collect::<Vec<_>>(), ids(&[3, 900, 901]));
        // Equal sets are equal whatever their representation.
        let inline: SlotSet = ids(&[900]).into_iter().collect();
        let wide = s.and_not(&ids(&[3, 901]).into_iter().collect());
        assert_eq!(wide, inline);
        s.remove(EndpointId(3));
        s.remove(EndpointId(901));
        assert_eq!(s, inline);
        assert_ne!(s, SlotSet::new());
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

    fn slots() -> impl Strategy<Value = Vec<u32>> {
        // Mostly one word (inline), sometimes spanning several, sometimes far out.
        prop_oneof![
            proptest::collection::vec(0u32..64, 0..5),
            proptest::collection::vec(128u32..192, 0..5),
            proptest::collection::vec(0u32..300, 0..8),
            proptest::collection::vec(0u32..2000, 0..4),
        ]
    }

    proptest! {
        #[test]
        fn slot_set_equals_a_btree_set(a in slots(), b in slots(), gone in slots()) {
            use std::collections::BTreeSet;
            let mut x: SlotSet = a.iter().map(|&i| EndpointId(i)).collect();
            let y: SlotSet = b.iter().map(|&i| EndpointId(i)).collect();
            let mut rx: BTreeSet<u32> = a.iter().copied().collect();
            let ry: BTreeSet<u32> = b.iter().copied().collect();
            for &g in &gone {
                x.remove(EndpointId(g));
                rx.remove(&g);
            }
            let members = |s: &SlotSet| s.iter().map(|e| e.0).collect::<Vec<_>>();
            prop_assert_eq!(members(&x), rx.iter().copied().collect::<Vec<_>>());
            prop_assert_eq!(x.len(), rx.len());
            prop_assert_eq!(x.is_empty(), rx.is_empty());
            prop_assert_eq!(members(&x.and(&y)), rx.intersection(&ry).copied().collect::<Vec<_>>());
            prop_assert_eq!(members(&x.or(&y)), rx.union(&ry).copied().collect::<Vec<_>>());
            prop_assert_eq!(members(&x.and_not(&y)), rx.difference(&ry).copied().collect::<Vec<_>>());
            prop_assert_eq!(x == y, rx == ry);
            prop_assert_eq!(x.and(&y) == y.and(&x), true);
            for i in 0..300u32 {
                prop_assert_eq!(x.contains(EndpointId(i)), rx.contains(&i));
            }
        }

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
            let got = walk(&blocks, &candidates, |_| {}, |h| table.get(&h).map(|(u, l)| (Cow::Borrowed(u), Some(l))));
            prop_assert_eq!(got, reference(&blocks, &candidates, &table));
        }
    }
}
