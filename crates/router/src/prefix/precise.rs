//! The precise prefix index: a mirror of every endpoint's KV cache, fed by its KV events
//! (PROTOCOLS §4), keyed by the wire block hash.
//!
//! Tier-aware: a block stored with `medium` `"GPU"` (or none) is in the upper tier, any
//! other medium (`"CPU"`, an offload tier) in the lower one; scorers count lower-tier hits
//! at a discount because they must be copied back before use.
//!
//! Invariant: no entry has both sets empty (entries are dropped when their last holder
//! goes).

use std::borrow::Cow;

use strata_api::kv_events::{KvEvent, MEDIUM_GPU};

use super::flat::FlatMap;
use super::{walk, walk_into, PrefixMatch, SlotSet};
use crate::endpoint::EndpointId;

#[derive(Debug, Clone, Default)]
struct Holders {
    upper: SlotSet,
    lower: SlotSet,
}

/// Block hash → endpoints holding it, per tier.
#[derive(Debug, Clone, Default)]
pub struct PreciseIndex {
    blocks: FlatMap<Holders>,
}

fn is_upper(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case(MEDIUM_GPU))
}

impl PreciseIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event from `endpoint`.
    pub fn apply(&mut self, endpoint: EndpointId, event: &KvEvent) {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                medium,
                ..
            } => {
                let upper = is_upper(medium.as_deref());
                for h in block_hashes {
                    let e = self.blocks.get_or_default(*h);
                    if upper {
                        e.upper.insert(endpoint);
                    } else {
                        e.lower.insert(endpoint);
                    }
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                let upper = is_upper(medium.as_deref());
                for h in block_hashes {
                    if let Some(e) = self.blocks.get_mut(h) {
                        if upper {
                            e.upper.remove(endpoint);
                        } else {
                            e.lower.remove(endpoint);
                        }
                        if e.upper.is_empty() && e.lower.is_empty() {
                            self.blocks.remove(h);
                        }
                    }
                }
            }
            KvEvent::AllBlocksCleared => self.remove_endpoint(endpoint),
        }
    }

    /// Forgets every block of `endpoint` (cache cleared, endpoint removed, or events lost).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        self.blocks.retain(|_, e| {
            e.upper.remove(endpoint);
            e.lower.remove(endpoint);
            !(e.upper.is_empty() && e.lower.is_empty())
        });
    }

    /// Distinct block hashes held anywhere.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Whether `endpoint` holds `hash` in any tier.
    pub fn holds(&self, endpoint: EndpointId, hash: u64) -> bool {
        self.blocks
            .get(&hash)
            .is_some_and(|e| e.upper.contains(endpoint) || e.lower.contains(endpoint))
    }

    /// Per candidate, how many leading blocks it holds and how many of those only in the
    /// lower tier.
    pub fn match_prefix(&self, blocks: &[u64], candidates: &[EndpointId]) -> Vec<PrefixMatch> {
        walk(
            blocks,
            candidates,
            |h| self.blocks.prefetch(h),
            |h| {
                self.blocks
                    .get(&h)
                    .map(|e| (Cow::Borrowed(&e.upper), Some(&e.lower)))
            },
        )
    }

    /// [`PreciseIndex::match_prefix`] into a caller's buffer (`out[i]` for the `i`-th
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
            |h| self.blocks.prefetch(h),
            |h| {
                self.blocks
                    .get(&h)
                    .map(|e| (Cow::Borrowed(&e.upper), Some(&e.lower)))
            },
            out,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], medium: Option<&str>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 16,
            lora_id: None,
            medium: medium.map(str::to_string),
            lora_name: None,
        }
    }

    #[test]
    fn events_build_and_shrink_the_mirror() {
        let mut idx = PreciseIndex::new();
        let (a, b) = (EndpointId(0), EndpointId(1));
        idx.apply(a, &stored(&[1, 2, 3], Some("GPU")));
        idx.apply(b, &stored(&[1, 2], None));
        idx.apply(b, &stored(&[3], Some("CPU")));
        let m = idx.match_prefix(&[1, 2, 3, 4], &[a, b]);
        assert_eq!((m[0].blocks, m[0].lower_tier), (3, 0));
        assert_eq!((m[1].blocks, m[1].lower_tier), (3, 1));
        idx.apply(
            a,
            &KvEvent::BlockRemoved {
                block_hashes: vec![2],
                medium: Some("GPU".into()),
            },
        );
        let m = idx.match_prefix(&[1, 2, 3], &[a, b]);
        assert_eq!(m[0].blocks, 1, "a chain stops at the first missing block");
        assert_eq!(m[1].blocks, 3);
        idx.apply(b, &KvEvent::AllBlocksCleared);
        assert!(!idx.holds(b, 1));
        assert!(idx.holds(a, 1) && idx.holds(a, 3));
        assert_eq!(idx.len(), 2);
        // Removing what was never stored is harmless.
        idx.apply(
            b,
            &KvEvent::BlockRemoved {
                block_hashes: vec![99],
                medium: None,
            },
        );
        idx.remove_endpoint(a);
        assert!(idx.is_empty());
    }
}
