//! [`HolderTable`]: the approximate index's hash → holders table, 16 bytes a hash.
//!
//! A fleet's approximate index remembers tens of millions of hashes, nearly every one
//! held by a single endpoint. Each slot of the table is the hash and one packed word:
//! either that one holder inline (its endpoint slot and its position in that endpoint's
//! LRU queue), or the number of an entry in a side list that keeps the set of several
//! holders. A holder's position is the endpoint's own count of queue pushes
//! ([`super::approx`]), so the queue stores hashes alone and knows each entry's position
//! from where it sits.
//!
//! Invariant: a hash in the table has at least one holder; an entry of the side list is
//! referenced by exactly one hash, or is on the free list.

use std::borrow::Cow;
use std::num::NonZeroU64;

use super::flat::FlatMap;
use super::SlotSet;
use crate::endpoint::EndpointId;

/// Bits of an inline holder's endpoint slot.
const SLOT_BITS: u32 = 16;
/// Bits of an inline holder's position (plus one).
const POS_BITS: u32 = 63 - SLOT_BITS;

/// One hash's holders in a word. Bit 0 set: at most one holder inline, its endpoint slot
/// in bits 1..=16 and its position plus one above them (zero there: no holder yet, the
/// default while an entry is being filled). Bit 0 clear: `(index + 1) << 1` of a
/// [`Many`] in the side list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packed(NonZeroU64);

impl Default for Packed {
    fn default() -> Self {
        Packed(NonZeroU64::MIN)
    }
}

/// What a [`Packed`] word says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum View {
    Empty,
    One { slot: u32, pos: u64 },
    Many(usize),
}

impl Packed {
    fn view(self) -> View {
        let raw = self.0.get();
        if raw & 1 == 1 {
            let slot = ((raw >> 1) & ((1 << SLOT_BITS) - 1)) as u32;
            match raw >> (1 + SLOT_BITS) {
                0 => View::Empty,
                pos1 => View::One {
                    slot,
                    pos: pos1 - 1,
                },
            }
        } else {
            View::Many((raw >> 1) as usize - 1)
        }
    }

    /// One holder inline, if its slot and position fit.
    fn one(slot: u32, pos: u64) -> Option<Packed> {
        if slot >= 1 << SLOT_BITS || pos >= (1 << POS_BITS) - 1 {
            return None;
        }
        NonZeroU64::new(1 | (u64::from(slot) << 1) | ((pos + 1) << (1 + SLOT_BITS))).map(Packed)
    }

    fn many(index: usize) -> Packed {
        // (index + 1) << 1 is at least 2; side-list indexes stay far below 2^62.
        Packed(NonZeroU64::MIN.saturating_add(2 * index as u64 + 1))
    }
}

/// The holders of a hash held by several endpoints (or by one that does not fit inline).
#[derive(Debug, Clone, Default)]
struct Many {
    set: SlotSet,
    /// (slot, position), one per member of `set`.
    members: Vec<(u32, u64)>,
}

/// Hash → the endpoints holding it, each with its position in its LRU queue.
#[derive(Debug, Clone, Default)]
pub(super) struct HolderTable {
    map: FlatMap<Packed>,
    many: Vec<Many>,
    free: Vec<usize>,
}

impl HolderTable {
    /// Distinct hashes held.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Room for `n` hashes without growing.
    pub(super) fn reserve(&mut self, n: usize) {
        self.map.reserve(n);
    }

    /// Starts loading `h`'s slot into cache.
    #[inline]
    pub(super) fn prefetch(&self, h: u64) {
        self.map.prefetch(h);
    }

    /// `slot`'s position for `h`, if it holds it.
    #[inline]
    pub(super) fn position(&self, h: u64, slot: u32) -> Option<u64> {
        match self.map.get(&h)?.view() {
            View::Empty => None,
            View::One { slot: s, pos } => (s == slot).then_some(pos),
            View::Many(i) => self.many[i]
                .members
                .iter()
                .find(|(s, _)| *s == slot)
                .map(|(_, p)| *p),
        }
    }

    /// The endpoints holding `h`.
    #[inline]
    pub(super) fn holders(&self, h: u64) -> Option<Cow<'_, SlotSet>> {
        Some(match self.map.get(&h)?.view() {
            View::Empty => Cow::Owned(SlotSet::new()),
            View::One { slot, .. } => Cow::Owned(SlotSet::single(EndpointId(slot))),
            View::Many(i) => Cow::Borrowed(&self.many[i].set),
        })
    }

    /// Sets `slot`'s position for `h`; whether `slot` held `h` before.
    pub(super) fn set_position(&mut self, h: u64, slot: u32, pos: u64) -> bool {
        let word = self.map.get_or_default(h);
        let held = match word.view() {
            View::Many(i) => {
                let m = &mut self.many[i];
                if let Some(e) = m.members.iter_mut().find(|(s, _)| *s == slot) {
                    e.1 = pos;
                    return true;
                }
                m.members.push((slot, pos));
                m.set.insert(EndpointId(slot));
                return false;
            }
            View::One { slot: s, pos: p } if s != slot => {
                *word = side_insert(&mut self.many, &mut self.free, vec![(s, p), (slot, pos)]);
                return false;
            }
            View::One { .. } => true,
            View::Empty => false,
        };
        *word = Packed::one(slot, pos)
            .unwrap_or_else(|| side_insert(&mut self.many, &mut self.free, vec![(slot, pos)]));
        held
    }

    /// Takes `slot` out of `h`'s holders, and `h` out of the table when none is left.
    pub(super) fn remove(&mut self, h: u64, slot: u32) {
        let Some(word) = self.map.get_mut(&h) else {
            return;
        };
        let empty = match word.view() {
            View::Empty => true,
            View::One { slot: s, .. } => s == slot,
            View::Many(i) => {
                let m = &mut self.many[i];
                m.members.retain(|(s, _)| *s != slot);
                m.set.remove(EndpointId(slot));
                match *m.members.as_slice() {
                    [] => {
                        side_free(&mut self.many, &mut self.free, i);
                        true
                    }
                    [(s, p)] => {
                        if let Some(one) = Packed::one(s, p) {
                            *word = one;
                            side_free(&mut self.many, &mut self.free, i);
                        }
                        false
                    }
                    _ => false,
                }
            }
        };
        if empty {
            self.map.remove(&h);
        }
    }
}

/// Puts a holder set in the side list; its packed reference.
fn side_insert(many: &mut Vec<Many>, free: &mut Vec<usize>, members: Vec<(u32, u64)>) -> Packed {
    let set = members.iter().map(|&(s, _)| EndpointId(s)).collect();
    let entry = Many { set, members };
    let i = match free.pop() {
        Some(i) => {
            many[i] = entry;
            i
        }
        None => {
            many.push(entry);
            many.len() - 1
        }
    };
    Packed::many(i)
}

/// Releases side-list entry `i` for reuse.
fn side_free(many: &mut [Many], free: &mut Vec<usize>, i: usize) {
    many[i] = Many::default();
    free.push(i);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashMap};

    #[test]
    fn a_hash_held_by_one_endpoint_costs_sixteen_bytes() {
        assert_eq!(std::mem::size_of::<Option<(u64, Packed)>>(), 16);
    }

    #[test]
    fn packing_round_trips_at_the_edges() {
        let max_pos = (1 << POS_BITS) - 2;
        for (slot, pos) in [(0, 0), (65_535, 0), (0, max_pos), (65_535, max_pos), (7, 9)] {
            let p = Packed::one(slot, pos).expect("fits");
            assert_eq!(p.view(), View::One { slot, pos });
        }
        assert_eq!(Packed::one(65_536, 0), None);
        assert_eq!(Packed::one(0, max_pos + 1), None);
        assert_eq!(Packed::default().view(), View::Empty);
        for i in [0, 1, 12_345, usize::MAX >> 3] {
            assert_eq!(Packed::many(i).view(), View::Many(i));
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(u64, u32, u64),
        Remove(u64, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Slots past 16 bits and huge positions take the side list even for one holder.
        let slot = prop_oneof![4 => 0u32..4, 1 => Just(70_000u32)];
        let pos = prop_oneof![4 => 0u64..1000, 1 => Just(u64::MAX - 3)];
        prop_oneof![
            3 => (0u64..12, slot.clone(), pos).prop_map(|(h, s, p)| Op::Set(h, s, p)),
            2 => (0u64..12, slot).prop_map(|(h, s)| Op::Remove(h, s)),
        ]
    }

    proptest! {
        // Each case checks every hash and slot after every operation: fewer cases keep it
        // a couple of seconds in a debug build.
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The table answers as a map of hash → (slot → position) does, and its side
        /// list never holds more entries than hashes that need one.
        #[test]
        fn behaves_like_a_map_of_maps(ops in proptest::collection::vec(op(), 0..300)) {
            let mut table = HolderTable::default();
            let mut want: HashMap<u64, BTreeMap<u32, u64>> = HashMap::new();
            for op in ops {
                match op {
                    Op::Set(h, s, p) => {
                        let held = want.entry(h).or_default().insert(s, p).is_some();
                        prop_assert_eq!(table.set_position(h, s, p), held);
                    }
                    Op::Remove(h, s) => {
                        if let Some(m) = want.get_mut(&h) {
                            m.remove(&s);
                            if m.is_empty() {
                                want.remove(&h);
                            }
                        }
                        table.remove(h, s);
                    }
                }
                prop_assert_eq!(table.len(), want.len());
                for h in 0u64..12 {
                    let holders = want.get(&h);
                    for s in [0u32, 1, 2, 3, 70_000] {
                        prop_assert_eq!(table.position(h, s), holders.and_then(|m| m.get(&s)).copied());
                    }
                    let set = table.holders(h).map(|c| c.into_owned());
                    let want_set: Option<SlotSet> =
                        holders.map(|m| m.keys().map(|&s| EndpointId(s)).collect());
                    prop_assert_eq!(set, want_set);
                }
                prop_assert!(table.many.len() - table.free.len() <= want.len());
            }
        }
    }
}
