//! The engine's bookkeeping of its blocks on the KV tier: what it copied out (remembered
//! with the parent, tokens and adapter it was committed with, until the tier answers) and
//! what it announced as stored there, both bounded, turned into CPU-medium KV events.

use std::collections::{BTreeMap, HashMap};

use crate::kv::block_pool::{BlockLora, HashKey, KeyHashState, PoolEvent};
use crate::kv::offload::TierChange;

/// What was committed into a block, kept from its eviction until the tier acknowledges
/// it, for the CPU-medium `BlockStored` event.
#[derive(Debug, Clone)]
pub(super) struct TierMeta {
    pub(super) parent: Option<HashKey>,
    pub(super) tokens: Vec<u32>,
    pub(super) lora: Option<BlockLora>,
}

/// Keys in insertion order with at most `cap` of them: inserting past the cap pushes the
/// oldest out (returned to the caller).
pub(super) struct Bounded<V> {
    map: HashMap<HashKey, (u64, V), KeyHashState>,
    order: BTreeMap<u64, HashKey>,
    next: u64,
    cap: usize,
}

impl<V> Bounded<V> {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            map: HashMap::default(),
            order: BTreeMap::new(),
            next: 0,
            cap: cap.max(1),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn contains(&self, k: &HashKey) -> bool {
        self.map.contains_key(k)
    }

    /// Inserts (or renews) `k`; returns the entry pushed out past the cap, if any.
    pub(super) fn insert(&mut self, k: HashKey, v: V) -> Option<(HashKey, V)> {
        if let Some((seq, _)) = self.map.remove(&k) {
            self.order.remove(&seq);
        }
        let seq = self.next;
        self.next += 1;
        self.map.insert(k, (seq, v));
        self.order.insert(seq, k);
        if self.map.len() <= self.cap {
            return None;
        }
        let (_, oldest) = self.order.pop_first()?;
        self.map.remove(&oldest).map(|(_, v)| (oldest, v))
    }

    pub(super) fn remove(&mut self, k: &HashKey) -> Option<V> {
        let (seq, v) = self.map.remove(k)?;
        self.order.remove(&seq);
        Some(v)
    }

    /// Every key, oldest first, emptying the set.
    pub(super) fn drain_keys(&mut self) -> Vec<HashKey> {
        self.map.clear();
        std::mem::take(&mut self.order).into_values().collect()
    }
}

/// The engine's view of its blocks on the KV tier.
pub(super) struct TierState {
    /// Evicted blocks copied to the offloader, not yet acknowledged by the tier.
    pub(super) remembered: Bounded<TierMeta>,
    /// Blocks announced as stored on the tier (CPU medium).
    pub(super) announced: Bounded<()>,
    /// Tier events not yet published.
    pub(super) events: Vec<PoolEvent>,
}

impl TierState {
    /// Remembered evictions per pool block, and announced tier blocks per pool block:
    /// the tier usually holds several times what one engine's cache does.
    const REMEMBER_PER_BLOCK: usize = 4;
    const ANNOUNCE_PER_BLOCK: usize = 16;
    const MIN_CAP: usize = 1024;

    pub(super) fn new(num_blocks: usize) -> Self {
        Self {
            remembered: Bounded::new((num_blocks * Self::REMEMBER_PER_BLOCK).max(Self::MIN_CAP)),
            announced: Bounded::new((num_blocks * Self::ANNOUNCE_PER_BLOCK).max(Self::MIN_CAP)),
            events: Vec::new(),
        }
    }

    /// Turns what the offloader learned into CPU-medium events: a stored block is
    /// announced once, with what it was committed with (a block the engine does not
    /// remember, e.g. one it forgot past the cap, is not announced); a removed block is
    /// withdrawn if it was announced; a lost log withdraws every announced block.
    pub(super) fn apply(&mut self, change: TierChange) {
        match change {
            TierChange::Stored(hashes) => {
                for h in hashes {
                    let Some(meta) = self.remembered.remove(&h) else {
                        continue;
                    };
                    if self.announced.contains(&h) {
                        self.announced.insert(h, ());
                        continue;
                    }
                    self.events.push(PoolEvent::TierStored {
                        hash: h,
                        parent: meta.parent,
                        tokens: meta.tokens,
                        lora: meta.lora,
                    });
                    if let Some((old, ())) = self.announced.insert(h, ()) {
                        // Past the cap the oldest announcement is withdrawn, so what the
                        // router counts never exceeds what the engine tracks.
                        self.events.push(PoolEvent::TierRemoved { hash: old });
                    }
                }
            }
            TierChange::Removed(hashes) => {
                for h in hashes {
                    self.remembered.remove(&h);
                    if self.announced.remove(&h).is_some() {
                        self.events.push(PoolEvent::TierRemoved { hash: h });
                    }
                }
            }
            TierChange::Lost => {
                for h in self.announced.drain_keys() {
                    self.events.push(PoolEvent::TierRemoved { hash: h });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_announcements_stay_bounded_and_are_withdrawn_on_removal_or_loss() {
        let mut tier = TierState {
            remembered: Bounded::new(3),
            announced: Bounded::new(2),
            events: Vec::new(),
        };
        let h = |i: u8| [i; 32];
        let meta = |i: u8| TierMeta {
            parent: None,
            tokens: vec![u32::from(i)],
            lora: None,
        };
        for i in 1..=4 {
            tier.remembered.insert(h(i), meta(i));
        }
        // Remembered past its cap: the oldest (1) is forgotten and never announced.
        assert_eq!(tier.remembered.len(), 3);
        tier.apply(TierChange::Stored(vec![h(1), h(2), h(3)]));
        let stored = |e: &PoolEvent| match e {
            PoolEvent::TierStored { hash, .. } => Some(hash[0]),
            _ => None,
        };
        let removed = |e: &PoolEvent| match e {
            PoolEvent::TierRemoved { hash } => Some(hash[0]),
            _ => None,
        };
        let ev = std::mem::take(&mut tier.events);
        assert_eq!(ev.iter().filter_map(stored).collect::<Vec<_>>(), vec![2, 3]);
        assert!(ev.iter().all(|e| removed(e).is_none()));
        // A third announcement pushes the oldest (2) out, withdrawn at once.
        tier.apply(TierChange::Stored(vec![h(4)]));
        let ev = std::mem::take(&mut tier.events);
        assert_eq!(ev.iter().filter_map(stored).collect::<Vec<_>>(), vec![4]);
        assert_eq!(ev.iter().filter_map(removed).collect::<Vec<_>>(), vec![2]);
        assert_eq!(tier.announced.len(), 2);
        // Removal of an announced block withdraws it; of an unknown one, nothing.
        tier.apply(TierChange::Removed(vec![h(3), h(9)]));
        let ev = std::mem::take(&mut tier.events);
        assert_eq!(ev.iter().filter_map(removed).collect::<Vec<_>>(), vec![3]);
        assert_eq!(ev.len(), 1);
        // A lost log withdraws whatever is still announced.
        tier.remembered.insert(h(5), meta(5));
        tier.apply(TierChange::Stored(vec![h(5)]));
        tier.events.clear();
        tier.apply(TierChange::Lost);
        let mut gone: Vec<u8> = tier.events.iter().filter_map(removed).collect();
        gone.sort();
        assert_eq!(gone, vec![4, 5]);
        assert_eq!(tier.announced.len(), 0);
        // Announcing the same block twice emits it once.
        tier.events.clear();
        tier.remembered.insert(h(6), meta(6));
        tier.apply(TierChange::Stored(vec![h(6)]));
        tier.remembered.insert(h(6), meta(6));
        tier.apply(TierChange::Stored(vec![h(6)]));
        assert_eq!(tier.events.iter().filter_map(stored).count(), 1);
    }
}
