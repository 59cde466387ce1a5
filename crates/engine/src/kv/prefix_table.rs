//! The prefix cache's table: block content hash → block id, for the block pool.
//!
//! The pool already keeps every named block's hash (`hashes[block]`), so the table keeps
//! no key of its own: one `u64` per slot, the block id and 32 bits of the key's table hash
//! (a tag: a probe compares it first and reads the block's full hash only when it
//! matches). Open addressing with linear probing in a table of at least twice the blocks,
//! fixed at creation: a pool names at most one hash per block, so it never grows, and at
//! that load a probe averages under 1.5 slots per hit and 2.5 per miss. A `HashMap` of the
//! 32-byte keys took about four times the memory: a fleet of simulated replicas holds tens
//! of millions of named blocks.
//!
//! Invariants: every entry's block has that entry's key in `hashes`; a key sits between
//! its home slot and the first empty slot after it (removal shifts later entries back to
//! keep this, so no tombstones). The home slot is the tag's top bits, so moving an entry
//! needs no read of its key.

use std::hash::{BuildHasher, Hash};
use std::marker::PhantomData;

/// A free slot: zero, so that a new table's pages stay untouched until used (an entry's
/// low half is its block id plus one, never zero).
const EMPTY: u64 = 0;

/// The block of a non-empty slot.
#[inline]
fn block_of(slot: u64) -> u32 {
    (slot as u32).wrapping_sub(1)
}

/// Content hash (`K`, hashed by `S`) → block, keys read from the pool's `hashes`.
#[derive(Debug)]
pub(crate) struct PrefixTable<K, S> {
    /// `tag << 32 | (block + 1)`, or [`EMPTY`].
    slots: Vec<u64>,
    /// log2 of the slot count (at most 32).
    bits: u32,
    len: usize,
    state: S,
    key: PhantomData<K>,
}

impl<K: Eq + Hash, S: BuildHasher> PrefixTable<K, S> {
    /// A table for a pool of `num_blocks` blocks, hashing keys with `state`.
    pub(crate) fn new(num_blocks: usize, state: S) -> Self {
        let n = num_blocks
            .saturating_mul(2)
            .max(16)
            .checked_next_power_of_two()
            .unwrap_or(1 << 32)
            .min(1 << 32);
        PrefixTable {
            slots: vec![EMPTY; n],
            bits: n.trailing_zeros(),
            len: 0,
            state,
            key: PhantomData,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn tag(&self, key: &K) -> u32 {
        (self.state.hash_one(key) >> 32) as u32
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        (u64::from(tag) >> (32 - self.bits)) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Starts loading `key`'s home slot into cache; no effect on the contents.
    #[inline]
    pub(crate) fn prefetch(&self, key: &K) {
        if let Some(slot) = self.slots.get(self.home(self.tag(key))) {
            crate::prefetch::prefetch(slot);
        }
    }

    /// The slot holding `key`, or the empty slot where it would go.
    #[inline]
    fn probe(&self, key: &K, hashes: &[Option<K>]) -> (usize, bool) {
        let tag = self.tag(key);
        let mask = self.mask();
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return (i, false);
            }
            if (s >> 32) as u32 == tag
                && hashes.get(block_of(s) as usize).and_then(Option::as_ref) == Some(key)
            {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }

    /// The block named `key`.
    #[inline]
    pub(crate) fn get(&self, key: &K, hashes: &[Option<K>]) -> Option<u32> {
        match self.probe(key, hashes) {
            (i, true) => Some(block_of(self.slots[i])),
            _ => None,
        }
    }

    /// Names `block` `key` unless some block already has that name (then `false`). The
    /// caller then sets `hashes[block]` to `key`.
    pub(crate) fn insert(&mut self, key: &K, block: u32, hashes: &[Option<K>]) -> bool {
        if self.len + 1 >= self.slots.len() || block == u32::MAX {
            // Only a pool of 2^31 blocks or more could fill it; `u32::MAX` is no block.
            return false;
        }
        match self.probe(key, hashes) {
            (_, true) => false,
            (i, false) => {
                self.slots[i] = (u64::from(self.tag(key)) << 32) | (u64::from(block) + 1);
                self.len += 1;
                true
            }
        }
    }

    /// Forgets `key`; the block it named, if any.
    pub(crate) fn remove(&mut self, key: &K, hashes: &[Option<K>]) -> Option<u32> {
        let (mut hole, found) = self.probe(key, hashes);
        if !found {
            return None;
        }
        let block = block_of(self.slots[hole]);
        self.slots[hole] = EMPTY;
        self.len -= 1;
        // Backward shift: move later entries of the run into the hole when their home
        // slot does not lie (cyclically) between the hole and where they sit.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            let home = self.home((s >> 32) as u32);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                self.slots[j] = EMPTY;
                hole = j;
            }
        }
        Some(block)
    }

    pub(crate) fn clear(&mut self) {
        self.slots.iter_mut().for_each(|s| *s = EMPTY);
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::hash_map::RandomState;
    use std::collections::HashMap;

    type HashKey = [u8; 32];

    fn key(k: u8) -> HashKey {
        let mut h = [0u8; 32];
        h[0] = k;
        h[31] = k.wrapping_mul(7);
        h
    }

    proptest! {
        /// Behaves as a map from key to block, the pool's `hashes` kept alongside as the
        /// pool keeps them.
        #[test]
        fn behaves_like_a_hash_map(ops in proptest::collection::vec((0u8..3, 0u8..60, 0u32..24), 0..300)) {
            let blocks = 24usize;
            let mut t = PrefixTable::new(blocks, RandomState::new());
            let mut hashes: Vec<Option<HashKey>> = vec![None; blocks];
            let mut want: HashMap<HashKey, u32> = HashMap::new();
            for (op, k, b) in ops {
                let k = key(k);
                match op {
                    0 if hashes[b as usize].is_none() => {
                        let fresh = !want.contains_key(&k);
                        prop_assert_eq!(t.insert(&k, b, &hashes), fresh);
                        if fresh {
                            hashes[b as usize] = Some(k);
                            want.insert(k, b);
                        }
                    }
                    1 => {
                        let got = t.remove(&k, &hashes);
                        prop_assert_eq!(got, want.remove(&k));
                        if let Some(b) = got {
                            hashes[b as usize] = None;
                        }
                    }
                    _ => prop_assert_eq!(t.get(&k, &hashes), want.get(&k).copied()),
                }
                prop_assert_eq!(t.len(), want.len());
            }
            for (k, b) in &want {
                prop_assert_eq!(t.get(k, &hashes), Some(*b));
            }
            t.clear();
            prop_assert_eq!(t.len(), 0);
            prop_assert_eq!(t.get(&key(0), &hashes), None);
        }
    }
}
