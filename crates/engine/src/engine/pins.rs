//! A finished prefill's prompt blocks, kept referenced under the request's pin id until a
//! decoder pulls them (export with `release`), the pin is released, or it expires. Pins
//! together hold at most half the pool, the oldest giving way first, so a burst of
//! prefills nobody pulls cannot starve the running requests.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::kv::block_pool::{BlockPool, HashKey};
use crate::sequence::Sequence;

/// A finished request's prompt blocks, referenced until pulled, released or expired.
struct Pin {
    blocks: Vec<u32>,
    expires: Instant,
}

/// Every pin alive, by pin id.
pub(super) struct Pins {
    pins: HashMap<String, Pin>,
    /// References held by all pins together.
    pinned_total: usize,
    timeout: Duration,
    /// Pins together hold at most this many blocks; the oldest go first beyond it.
    max_blocks: usize,
    block_size: usize,
}

impl Pins {
    /// Pins for a pool of `num_blocks` blocks of `block_size` tokens, each kept `timeout`.
    pub(super) fn new(num_blocks: usize, block_size: usize, timeout: Duration) -> Self {
        Self {
            pins: HashMap::new(),
            pinned_total: 0,
            timeout,
            max_blocks: num_blocks / 2,
            block_size,
        }
    }

    /// Pins alive.
    pub(super) fn len(&self) -> usize {
        self.pins.len()
    }

    /// References held by pins (a block pinned twice counts twice).
    pub(super) fn num_pinned(&self) -> usize {
        self.pinned_total
    }

    /// When the next pin expires, if any is alive.
    pub(super) fn next_expiry(&self) -> Option<Instant> {
        self.pins.values().map(|p| p.expires).min()
    }

    /// Keeps `seq`'s full prompt blocks (the cached leading run of them) under its pin,
    /// making room within the pins' cap by dropping the oldest pins first. Call while
    /// `seq` still holds its blocks, after they are committed.
    pub(super) fn keep(&mut self, pool: &mut BlockPool, seq: &Sequence) -> Vec<u32> {
        let Some(id) = seq.pin.clone() else {
            return Vec::new();
        };
        let n = (seq.prompt_len / self.block_size).min(seq.block_hashes.len());
        let hashes: Vec<HashKey> = seq.block_hashes[..n].to_vec();
        let hits = pool.count_hits(&hashes).min(self.max_blocks);
        if hits == 0 {
            // Nothing to keep (a prompt shorter than a block): no pin, so every pin holds
            // at least one block and their number is bounded by the cap.
            return Vec::new();
        }
        while self.pinned_total + hits > self.max_blocks {
            let Some(oldest) = self
                .pins
                .iter()
                .min_by_key(|(_, p)| p.expires)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            tracing::debug!(pin = %oldest, "pinned blocks at their cap; releasing the oldest pin");
            self.release(&oldest, |blocks| pool.release(blocks));
        }
        let blocks = pool.acquire_cached(&hashes[..hits]);
        self.pinned_total += blocks.len();
        let pin = self.pins.entry(id).or_insert_with(|| Pin {
            blocks: Vec::new(),
            expires: Instant::now(),
        });
        pin.blocks.extend_from_slice(&blocks);
        pin.expires = Instant::now() + self.timeout;
        blocks
    }

    /// Drops the pin `id`, handing its blocks to `give_back` (which releases them); an
    /// unknown pin is ignored.
    pub(super) fn release(&mut self, id: &str, give_back: impl FnOnce(&[u32])) {
        if let Some(pin) = self.pins.remove(id) {
            self.pinned_total -= pin.blocks.len();
            give_back(&pin.blocks);
        }
    }

    /// Drops every pin whose time is up, handing each one's blocks to `give_back`.
    pub(super) fn expire(&mut self, now: Instant, mut give_back: impl FnMut(&[u32])) {
        if self.pins.is_empty() {
            return;
        }
        let expired: Vec<String> = self
            .pins
            .iter()
            .filter(|(_, p)| p.expires <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for id in expired {
            tracing::debug!(pin = %id, "pin expired unpulled");
            self.release(&id, &mut give_back);
        }
    }
}
