//! The router in the simulation: the real scheduling library (`EndpointPicker` with the
//! profiles, filters, scorers and pickers of `router.yaml`, and both prefix indexes), fed
//! what a live router is fed: each replica's scraped metrics and its KV events.
//!
//! Only the glue a live `Router` has around the picker lives here, done the same way: the
//! candidates list, in-flight counts, the request number for round-robin, recording the
//! request's prompt chunks on the chosen endpoint in the approximate index after the pick,
//! the counts flow control's room is measured by (sent and finished since each scrape),
//! and applying KV events to the precise index. Every choice is the library's.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use strata_api::kv_events::KvEvent;
use strata_router::endpoint::{EndpointId, EndpointSpec, EngineKind};
use strata_router::prefix::approx::{ApproxConfig, ApproxIndex, ChunkChain};
use strata_router::prefix::precise::PreciseIndex;
use strata_router::scheduling::flow::PoolView;
use strata_router::scheduling::saturation::{pool_room, SaturationConfig};
use strata_router::scheduling::{
    Candidate, Context, EndpointMetrics, PickDecision, PickScratch, SchedRequest, ScheduleError,
};
use strata_router::{EndpointPicker, RouterConfig};

use crate::error::SimError;

/// One cache change as a replica announces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvChange {
    pub stored: bool,
    pub hash: u64,
}

/// What a replica's `/metrics` says (the values the router reads).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scrape {
    pub waiting: f64,
    pub running: f64,
    pub kv: f64,
    pub block_size: u32,
    pub num_blocks: u64,
}

/// The router's state: candidates, indexes, the picker and its seeded RNG.
pub struct SimRouter {
    picker: EndpointPicker,
    uses_precise: bool,
    approx_config: ApproxConfig,
    stale_after: Duration,
    /// The saturation thresholds flow control's room is measured by.
    saturation: SaturationConfig,
    cands: Vec<Candidate>,
    /// The one spec every replica has (the same server, model and kind; the picker reads
    /// nothing else of it): shared, so a pick over a thousand replicas reads it from one
    /// place.
    spec: Arc<EndpointSpec>,
    /// Endpoint slot → its position in `cands` (a thousand replicas scrape every 50 ms:
    /// a linear search per update would dominate the run).
    pos: Vec<Option<usize>>,
    approx: ApproxIndex,
    precise: PreciseIndex,
    rng: StdRng,
    seq: u64,
    /// KV events not yet delivered: (when announced, endpoint, change).
    kv_queue: VecDeque<(Duration, EndpointId, KvChange)>,
    kv_delay: Duration,
    /// Scratch events, refilled for each delivery so that delivering allocates nothing.
    stored: KvEvent,
    removed: KvEvent,
    /// The picker's working lists, kept between picks.
    scratch: PickScratch,
}

impl SimRouter {
    /// A router scheduling with `config`'s picker, its RNG seeded with `seed`; KV events
    /// reach the precise index `kv_delay` after the replica announces them.
    pub fn new(config: &RouterConfig, seed: u64, kv_delay: Duration) -> Result<Self, SimError> {
        let picker_config = config.picker_config();
        let picker = picker_config
            .build()
            .map_err(|e| SimError::config("routing config", e.to_string()))?;
        Ok(SimRouter {
            picker,
            uses_precise: picker_config.uses_precise(),
            approx_config: config.approx_config(),
            stale_after: config.stale_after(),
            saturation: config.saturation_config(),
            cands: Vec::new(),
            spec: Arc::new(EndpointSpec::new("sim://replica", EngineKind::Strata)),
            pos: Vec::new(),
            approx: ApproxIndex::new(config.approx_config()),
            precise: PreciseIndex::new(),
            rng: StdRng::seed_from_u64(seed),
            seq: 0,
            kv_queue: VecDeque::new(),
            kv_delay,
            stored: KvEvent::BlockStored {
                block_hashes: Vec::with_capacity(1),
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: 0,
                lora_id: None,
                medium: None,
                lora_name: None,
            },
            removed: KvEvent::BlockRemoved {
                block_hashes: Vec::with_capacity(1),
                medium: None,
            },
            scratch: PickScratch::default(),
        })
    }

    /// Whether the profile scores with the precise (KV-event) index, so requests need
    /// token block hashes and replicas' KV events matter.
    pub fn uses_precise(&self) -> bool {
        self.uses_precise
    }

    pub fn candidates(&self) -> &[Candidate] {
        &self.cands
    }

    /// Adds an endpoint (ready, no metrics yet), as the live router adds one from its
    /// endpoints file.
    pub fn add(&mut self, id: EndpointId) {
        if let Some(i) = self.slot_pos(id) {
            self.cands.remove(i);
            self.reindex();
        }
        self.cands.push(Candidate::with_spec(id, self.spec.clone()));
        let slot = id.0 as usize;
        if self.pos.len() <= slot {
            self.pos.resize(slot + 1, None);
        }
        self.pos[slot] = Some(self.cands.len() - 1);
    }

    fn slot_pos(&self, id: EndpointId) -> Option<usize> {
        self.pos.get(id.0 as usize).copied().flatten()
    }

    fn reindex(&mut self) {
        self.pos.iter_mut().for_each(|p| *p = None);
        for (i, c) in self.cands.iter().enumerate() {
            self.pos[c.id.0 as usize] = Some(i);
        }
    }

    /// Removes an endpoint and everything the indexes know of it, including events still
    /// on their way (its slot may be reused).
    pub fn remove(&mut self, id: EndpointId) {
        if let Some(i) = self.slot_pos(id) {
            self.cands.remove(i);
            self.reindex();
        }
        self.approx.remove_endpoint(id);
        self.precise.remove_endpoint(id);
        self.kv_queue.retain(|(_, e, _)| *e != id);
    }

    fn cand_mut(&mut self, id: EndpointId) -> Option<&mut Candidate> {
        let i = self.slot_pos(id)?;
        self.cands.get_mut(i)
    }

    pub fn set_draining(&mut self, id: EndpointId, draining: bool) {
        if let Some(c) = self.cand_mut(id) {
            c.draining = draining;
        }
    }

    /// A scrape of `id`'s `/metrics` at `now`.
    pub fn scraped(&mut self, id: EndpointId, now: Duration, m: &Scrape) {
        let Scrape {
            waiting,
            running,
            kv,
            block_size,
            num_blocks,
        } = *m;
        if let Some(c) = self.cand_mut(id) {
            match &mut c.metrics {
                Some(m) => {
                    m.waiting = waiting;
                    m.running = running;
                    m.kv_use = Some(kv);
                    m.updated = now;
                }
                None => {
                    c.metrics = Some(EndpointMetrics {
                        waiting,
                        running,
                        kv_use: Some(kv),
                        block_size: Some(block_size),
                        num_blocks: Some(num_blocks),
                        updated: now,
                        ..Default::default()
                    })
                }
            }
            // The scrape shows what was sent and finished before it.
            c.sent_since_scrape = 0;
            c.done_since_scrape = 0;
        }
    }

    /// Queues KV events announced by `id` at `now`.
    pub fn announce(
        &mut self,
        id: EndpointId,
        now: Duration,
        changes: impl Iterator<Item = KvChange>,
    ) {
        if !self.uses_precise {
            return;
        }
        self.kv_queue.extend(changes.map(|c| (now, id, c)));
    }

    /// Applies every KV event that has arrived by `now`.
    pub fn deliver(&mut self, now: Duration) {
        while let Some(&(at, id, change)) = self.kv_queue.front() {
            if at + self.kv_delay > now {
                break;
            }
            self.kv_queue.pop_front();
            let event = if change.stored {
                &mut self.stored
            } else {
                &mut self.removed
            };
            if let KvEvent::BlockStored { block_hashes, .. }
            | KvEvent::BlockRemoved { block_hashes, .. } = event
            {
                block_hashes.clear();
                block_hashes.push(change.hash);
            }
            self.precise.apply(id, event);
        }
    }

    /// The approximate index's chunk hashes of a token prompt. The live router hashes the
    /// prompt text in chunks of `block_size_tokens × 4` bytes; the simulation writes each
    /// token as 4 bytes of text, so one chunk is exactly one block of tokens (written
    /// straight into the hash chain, with no text of the whole prompt).
    pub fn approx_blocks(&self, model: &str, tokens: &[u32]) -> Vec<u64> {
        let c = &self.approx_config;
        let chunk_tokens = c.block_size_tokens.max(1);
        let mut chain = ChunkChain::new(model);
        tokens
            .chunks_exact(chunk_tokens)
            .take(c.max_blocks)
            .map(|block| chain.push(|buf| block_text(block, buf)))
            .collect()
    }

    /// One decision at `now`, then the live router's bookkeeping: the request number, the
    /// prompt's chunks recorded on the pick in the approximate index, and one more request
    /// in flight there.
    pub fn pick(
        &mut self,
        now: Duration,
        req: &mut SchedRequest,
    ) -> Result<PickDecision, ScheduleError> {
        self.deliver(now);
        req.seq = self.seq;
        self.seq += 1;
        let ctx = Context {
            now,
            stale_after: self.stale_after,
            approx: Some(&self.approx),
            precise: Some(&self.precise),
        };
        // Only the pick is used: its fallbacks are not ordered (the same pick, the same
        // draws).
        let decision = self.picker.schedule_first(
            &ctx,
            req,
            &self.cands,
            None,
            &mut self.rng,
            &mut self.scratch,
        )?;
        let first = decision.pick();
        self.approx.record(first, &req.approx_blocks);
        if let Some(c) = self.cand_mut(first) {
            c.in_flight += 1;
            c.sent_since_scrape += 1;
        }
        Ok(decision)
    }

    /// A request on `id` finished.
    pub fn finished(&mut self, id: EndpointId) {
        if let Some(c) = self.cand_mut(id) {
            c.in_flight = c.in_flight.saturating_sub(1);
            c.done_since_scrape = c.done_since_scrape.saturating_add(1);
        }
    }

    /// Sizes the approximate index's table once for `prompts` prompts of `tokens` tokens
    /// that share nothing (each chunk a new hash), at most as many as `endpoints`
    /// endpoints keep, rather than doubling it on the way (each doubling a fresh table and
    /// every entry moved).
    pub fn reserve_prompt_chunks(&mut self, prompts: usize, tokens: usize, endpoints: usize) {
        let c = &self.approx_config;
        let chunks = (tokens / c.block_size_tokens.max(1)).min(c.max_blocks);
        let kept = c.capacity_per_endpoint.saturating_mul(endpoints);
        self.approx
            .reserve(prompts.saturating_mul(chunks).min(kept));
    }

    /// The pool as flow control sees it at `now`, as the live router measures it.
    pub fn pool_view(&self, now: Duration) -> PoolView {
        PoolView {
            ready: self.any_ready(),
            room: pool_room(&self.cands, now, &self.saturation),
        }
    }

    /// Frees both prefix indexes and the KV events on their way (the run is over: the
    /// report does not read them, and at scale they are gigabytes).
    pub fn free_indexes(&mut self) {
        self.approx = ApproxIndex::new(self.approx_config);
        self.precise = PreciseIndex::new();
        self.kv_queue = VecDeque::new();
    }

    /// Whether any endpoint could take a request now.
    pub fn any_ready(&self) -> bool {
        self.cands.iter().any(|c| c.ready && !c.draining)
    }
}

/// Token ids as the simulation's prompt text, appended to `out`: 4 characters a token,
/// 6 bits each, high first.
fn block_text(tokens: &[u32], out: &mut Vec<u8>) {
    const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    // Whole four-byte appends: copying into a slice of a length the compiler does not
    // see is a call to `memcpy` per token.
    out.reserve(4 * tokens.len());
    for &t in tokens {
        let d = |shift: u32| DIGITS[((t >> shift) & 63) as usize];
        out.extend_from_slice(&[d(18), d(12), d(6), d(0)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_router::prefix::approx::hash_text;

    #[test]
    fn prompt_chunks_hash_as_the_live_router_hashes_the_prompt_text() {
        let config = RouterConfig::default();
        let router = SimRouter::new(&config, 1, Duration::ZERO).unwrap();
        let c = config.approx_config();
        let b = c.block_size_tokens;
        const DIGITS: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let text = |tokens: &[u32]| -> String {
            tokens
                .iter()
                .flat_map(|&t| {
                    [18, 12, 6, 0].map(|s| DIGITS.as_bytes()[((t >> s) & 63) as usize] as char)
                })
                .collect()
        };
        // Whole blocks, a partial last block, more blocks than the index keeps, none.
        for len in [4 * b, 4 * b + 3, (c.max_blocks + 2) * b, b - 1, 0] {
            let tokens: Vec<u32> = (0..len as u32).map(|i| i * 7919 % 151_000).collect();
            let want = hash_text("m", &text(&tokens), b * 4, c.max_blocks);
            assert_eq!(router.approx_blocks("m", &tokens), want, "{len} tokens");
            assert_eq!(want.len(), (len / b).min(c.max_blocks));
        }
    }
}
