//! [`FlatMap`]: the table behind both prefix indexes, block hash → endpoint sets.
//!
//! A scheduling decision looks up every block of the request, and in a table of 100k
//! blocks nearly every lookup is a cache miss. This table is built for that: one flat
//! array of `(hash, value)` slots with linear probing, so a lookup touches one slot (one
//! cache line, sometimes the next), and the slot a key starts from is known from its
//! hash alone, so [`FlatMap::prefetch`] can start the misses of a whole group of blocks
//! before any of them is needed.
//!
//! Invariants: the slot count is zero or a power of two and at least `2 × len` (the
//! table grows first: at that load linear probing averages 1.5 slots per hit and 2.5 per
//! miss, where at 0.8 it would be 3 and 13), so every probe ends at an empty slot; a key sits between its
//! home slot and the first empty slot after it (deletion shifts later entries back to
//! keep this, so no tombstones).

use std::hash::BuildHasher;

use super::BlockHashState;

/// Block hash → `V`, open addressing with linear probing.
#[derive(Debug, Clone)]
pub struct FlatMap<V> {
    slots: Vec<Option<(u64, V)>>,
    len: usize,
    state: BlockHashState,
}

impl<V> Default for FlatMap<V> {
    fn default() -> Self {
        FlatMap {
            slots: Vec::new(),
            len: 0,
            state: BlockHashState::default(),
        }
    }
}

impl<V> FlatMap<V> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slot `key`'s probe starts from (the slot count must be non-zero).
    #[inline]
    fn home(&self, key: u64) -> usize {
        // The hasher's high bits are its best mixed (a multiply).
        let bits = self.slots.len().trailing_zeros();
        (self.state.hash_one(key) >> (64 - bits)) as usize
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            match &self.slots[i] {
                None => return None,
                Some((k, _)) if *k == key => return Some(i),
                Some(_) => i = (i + 1) & mask,
            }
        }
    }

    /// Starts loading `key`'s home slot into cache; no effect on the contents.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        let slot = &self.slots[self.home(key)];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // SAFETY: a prefetch is only a hint: it reads nothing into the program, cannot
            // fault, and `sse` (which it needs) is part of every x86_64 target.
            unsafe { _mm_prefetch::<_MM_HINT_T0>((slot as *const Option<(u64, V)>).cast()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = slot;
    }

    #[inline]
    pub fn get(&self, key: &u64) -> Option<&V> {
        let i = self.find(*key)?;
        self.slots[i].as_ref().map(|(_, v)| v)
    }

    pub fn get_mut(&mut self, key: &u64) -> Option<&mut V> {
        let i = self.find(*key)?;
        self.slots[i].as_mut().map(|(_, v)| v)
    }

    /// The value of `key`, inserted as `V::default()` when absent.
    pub fn get_or_default(&mut self, key: u64) -> &mut V
    where
        V: Default,
    {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            match &self.slots[i] {
                Some((k, _)) if *k == key => break,
                Some(_) => i = (i + 1) & mask,
                None => {
                    self.slots[i] = Some((key, V::default()));
                    self.len += 1;
                    break;
                }
            }
        }
        match &mut self.slots[i] {
            Some((_, v)) => v,
            // Just found or filled above.
            None => unreachable!("slot {i} was just filled"),
        }
    }

    fn grow(&mut self) {
        self.rebuild((self.slots.len() * 2).max(16));
    }

    /// Room for `n` keys in all without growing: a caller that knows how many keys are
    /// coming saves the rebuilds (and the fresh memory) of every doubling on the way.
    /// A hint: when no table that large can be had, nothing changes.
    pub fn reserve(&mut self, n: usize) {
        let Some(cap) = n.checked_mul(2).and_then(usize::checked_next_power_of_two) else {
            return;
        };
        let cap = cap.max(16);
        if cap <= self.slots.len() {
            return;
        }
        let mut slots = Vec::new();
        if slots.try_reserve_exact(cap).is_ok() {
            slots.resize_with(cap, || None);
            self.refill(slots);
        }
    }

    /// Moves every entry into a table of `cap` slots (a power of two, at least `2 × len`).
    fn rebuild(&mut self, cap: usize) {
        self.refill((0..cap).map(|_| None).collect());
    }

    /// Moves every entry into `slots` (empty, a power of two long, at least `2 × len`).
    fn refill(&mut self, slots: Vec<Option<(u64, V)>>) {
        let old = std::mem::replace(&mut self.slots, slots);
        self.len = 0;
        for (k, v) in old.into_iter().flatten() {
            self.place(k, v);
        }
    }

    /// Puts a key known to be absent into a table with room.
    fn place(&mut self, key: u64, value: V) {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        while self.slots[i].is_some() {
            i = (i + 1) & mask;
        }
        self.slots[i] = Some((key, value));
        self.len += 1;
    }

    pub fn remove(&mut self, key: &u64) -> Option<V> {
        let mut hole = self.find(*key)?;
        let (_, value) = self.slots[hole].take()?;
        self.len -= 1;
        // Backward shift: move later entries of the run into the hole when their home
        // slot does not lie (cyclically) between the hole and where they sit.
        let mask = self.slots.len() - 1;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let Some((k, _)) = &self.slots[j] else { break };
            let home = self.home(*k);
            let dist_home = j.wrapping_sub(home) & mask;
            let dist_hole = j.wrapping_sub(hole) & mask;
            if dist_home >= dist_hole {
                self.slots[hole] = self.slots[j].take();
                hole = j;
            }
        }
        Some(value)
    }

    /// Keeps the entries for which `keep` returns true.
    pub fn retain(&mut self, mut keep: impl FnMut(&u64, &mut V) -> bool) {
        let cap = self.slots.len();
        let old = std::mem::replace(&mut self.slots, (0..cap).map(|_| None).collect());
        self.len = 0;
        for (k, mut v) in old.into_iter().flatten() {
            if keep(&k, &mut v) {
                self.place(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        Add(u64, u32),
        Remove(u64),
        Retain(u32),
        Reserve(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Small key ranges make long runs and many collisions of home slots.
        prop_oneof![
            4 => (0u64..200, any::<u32>()).prop_map(|(k, v)| Op::Add(k, v)),
            2 => (0u64..200).prop_map(Op::Remove),
            1 => (1u32..5).prop_map(Op::Retain),
            1 => (0u16..600).prop_map(Op::Reserve),
            1 => (any::<u64>(), any::<u32>()).prop_map(|(k, v)| Op::Add(k, v)),
        ]
    }

    proptest! {
        #[test]
        fn behaves_like_a_hash_map(ops in proptest::collection::vec(op(), 0..400)) {
            let mut flat: FlatMap<u32> = FlatMap::default();
            let mut want: HashMap<u64, u32> = HashMap::new();
            for op in &ops {
                match *op {
                    Op::Add(k, v) => {
                        *flat.get_or_default(k) += v % 7;
                        *want.entry(k).or_default() += v % 7;
                    }
                    Op::Remove(k) => prop_assert_eq!(flat.remove(&k), want.remove(&k)),
                    Op::Retain(m) => {
                        flat.retain(|k, _| k % u64::from(m) != 0);
                        want.retain(|k, _| k % u64::from(m) != 0);
                    }
                    Op::Reserve(n) => flat.reserve(usize::from(n)),
                }
                prop_assert_eq!(flat.len(), want.len());
            }
            for k in 0..200u64 {
                prop_assert_eq!(flat.get(&k), want.get(&k));
                flat.prefetch(k);
            }
            for (k, v) in &want {
                prop_assert_eq!(flat.get(k), Some(v));
            }
        }
    }

    #[test]
    fn a_reserved_table_takes_that_many_keys_without_growing() {
        let mut m: FlatMap<u32> = FlatMap::default();
        m.get_or_default(7);
        m.reserve(1000);
        let slots = m.slots.len();
        assert!(slots >= 2000, "{slots} slots");
        for k in 0..999u64 {
            *m.get_or_default(k * 31 + 1) += 1;
        }
        assert_eq!(m.slots.len(), slots, "grew");
        assert_eq!(m.len(), 1000);
        assert_eq!(m.get(&7), Some(&0));
        // Smaller than the table, or more than any machine holds: no change.
        m.reserve(10);
        m.reserve(usize::MAX / 2);
        m.reserve(usize::MAX / 64);
        assert_eq!(m.slots.len(), slots);
    }

    #[test]
    fn empty_table_answers_nothing() {
        let mut m: FlatMap<u8> = FlatMap::default();
        assert!(m.get(&1).is_none() && m.get_mut(&1).is_none() && m.remove(&1).is_none());
        m.prefetch(1);
        m.retain(|_, _| true);
        assert!(m.is_empty());
    }
}
