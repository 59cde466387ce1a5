//! The set of block hashes cached in the engine's pool, shared with the server so it can
//! tell (without asking the loop) how much of a prompt is cached here.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};

use crate::kv::block_pool::{HashKey, KeyHashState, PoolEvent};

/// The hashes of the blocks cached in the engine's pool right now, shared with the server:
/// the loop applies each step's pool changes under a short write lock, readers take a read
/// lock for one lookup.
#[derive(Clone, Default)]
pub struct CachedIndex {
    set: Arc<RwLock<HashSet<HashKey, KeyHashState>>>,
}

impl CachedIndex {
    /// How many leading `hashes` are cached now.
    pub fn leading(&self, hashes: &[HashKey]) -> usize {
        let set = self.set.read().unwrap_or_else(|e| e.into_inner());
        hashes.iter().take_while(|h| set.contains(*h)).count()
    }

    pub fn contains(&self, hash: &HashKey) -> bool {
        self.set
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(hash)
    }

    pub fn len(&self) -> usize {
        self.set.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Follows the pool's own cache changes (the tier's are another medium).
    pub(super) fn apply(&self, events: &[PoolEvent]) {
        let relevant = events.iter().any(|e| {
            matches!(
                e,
                PoolEvent::Stored { .. } | PoolEvent::Removed { .. } | PoolEvent::Cleared
            )
        });
        if !relevant {
            return;
        }
        let mut set = self.set.write().unwrap_or_else(|e| e.into_inner());
        for e in events {
            match e {
                PoolEvent::Stored { hash, .. } => {
                    set.insert(*hash);
                }
                PoolEvent::Removed { hash } => {
                    set.remove(hash);
                }
                PoolEvent::Cleared => set.clear(),
                PoolEvent::TierStored { .. } | PoolEvent::TierRemoved { .. } => {}
            }
        }
    }
}
