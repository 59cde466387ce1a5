//! The engine thread: it sleeps until there is work (or a pin to expire), applies the
//! commands that arrived, drops sequences nobody listens to, runs one step, and publishes
//! the step's KV events and gauges. Between two steps it answers the handle's commands.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::kv::block_pool::{HashKey, PoolEvent};
use crate::kv::cache::KvCache;
use crate::kv::transfer::{BlockData, BlockSpec};
use crate::metrics::EngineMetrics;
use crate::model::Llama;
use crate::options::EngineOptions;
use crate::planner::StepPlanner;
use crate::sampler::Sampler;
use crate::sequence::{FinishReason, Sequence};

use super::block_identity::{block_hash_fn, lora_block_hash_fn};
use super::cached_index::CachedIndex;
use super::drafts::Drafter;
use super::handle::{BlockStats, Command, Shared};
use super::kv_link::KvLink;
use super::output::SeqOutput;
use super::pins::Pins;
use super::KvEventSink;
use crate::tokenizer::Tokenizer;

/// Everything the engine thread owns. The step's stages (`step.rs`) work on these fields.
pub(super) struct EngineLoop {
    pub(super) model: Arc<Llama>,
    pub(super) cache: KvCache,
    pub(super) planner: StepPlanner,
    pub(super) metrics: Arc<EngineMetrics>,
    shared: Arc<Shared>,
    rng: StdRng,
    next_seq: u64,
    kv_events: Option<KvEventSink>,
    /// Kept current from the pool's events for the server.
    cached_index: CachedIndex,
    /// Prompt-lookup speculation; `None` when off.
    pub(super) drafter: Option<Drafter>,
    pub(super) output: SeqOutput,
    pub(super) pins: Pins,
    pub(super) kv: KvLink,
}

impl EngineLoop {
    pub(super) fn new(
        model: Arc<Llama>,
        tokenizer: Arc<Tokenizer>,
        opts: &EngineOptions,
        num_blocks: usize,
        metrics: Arc<EngineMetrics>,
        shared: Arc<Shared>,
    ) -> Self {
        let block_size = opts.block_size;
        let cache = KvCache::with_heads(
            model.config.n_layer,
            num_blocks,
            block_size,
            model.config.n_kv_head,
            model.config.head_dim,
            opts.kv_dtype(&model),
        );
        let seed = &opts.prefix_caching_hash_seed;
        let mut planner = StepPlanner::new(
            opts,
            num_blocks,
            opts.prefix_caching.then(|| block_hash_fn(seed, block_size)),
        );
        if opts.prefix_caching {
            planner.set_lora_hash(lora_block_hash_fn(seed, block_size));
        }
        let output = SeqOutput::new(tokenizer, model.config.context_len, metrics.clone());
        Self {
            cache,
            planner,
            shared,
            rng: StdRng::seed_from_u64(opts.seed),
            next_seq: 0,
            kv_events: None,
            cached_index: CachedIndex::default(),
            drafter: opts.speculative.map(Drafter::new),
            output,
            pins: Pins::new(num_blocks, block_size, opts.kv_pin_timeout),
            kv: KvLink::new(num_blocks, metrics.clone()),
            metrics,
            model,
        }
    }

    /// Publishes the pool's and the tier's changes to `sink` after each step (and keeps
    /// `cached` current for the server).
    pub(super) fn publish_to(&mut self, sink: Option<KvEventSink>, cached: CachedIndex) {
        self.kv_events = sink;
        self.cached_index = cached;
    }

    /// Copies the cached blocks the pool evicts to `tx` (the tier offloader).
    pub(super) fn offload_to(&mut self, tx: tokio::sync::mpsc::Sender<BlockData>) {
        self.planner.set_track_evictions(true);
        self.kv.offload_to(tx);
    }

    pub(super) fn run(&mut self, rx: Receiver<Command>) {
        loop {
            // Block for work when idle (waking for the next pin to expire); otherwise take
            // whatever has arrived.
            if !self.planner.has_work() {
                let mut wait = Duration::from_millis(500);
                if let Some(next) = self.pins.next_expiry() {
                    wait = wait.min(next.saturating_duration_since(Instant::now()));
                }
                match rx.recv_timeout(wait) {
                    Ok(cmd) => self.handle(cmd),
                    Err(RecvTimeoutError::Timeout) => {
                        self.expire_pins();
                        self.publish_gauges();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.expire_pins();
            self.drop_abandoned();
            self.step();
            self.flush_kv_events();
            self.publish_gauges();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add(req) => {
                let req = *req;
                let sampler = Sampler::new(req.sampling.clone(), self.rng.random());
                let seq = Sequence::new(req, sampler, self.next_seq);
                self.next_seq += 1;
                self.planner.add(seq);
            }
            Command::CachedHashes(reply) => {
                let hashes = self.planner.cached_hashes().copied().collect();
                let _ = reply.send(hashes);
            }
            Command::ResetPrefixCache(reply) => {
                let ok = self.planner.reset_prefix_cache();
                self.flush_kv_events();
                let _ = reply.send(ok);
            }
            Command::Export {
                hashes,
                release,
                reply,
            } => {
                let out = self.export(&hashes);
                if let Some(pin) = release {
                    self.release_pin(&pin);
                }
                let _ = reply.send(out);
            }
            Command::ReleasePin(pin) => self.release_pin(&pin),
            Command::Tier(change) => {
                // Announce at once (not after the next step): the tier's answers come about
                // once a second, and whoever asks the loop anything after a change sees its
                // events published and its gauge set.
                self.kv.tier_changed(change);
                self.flush_kv_events();
                self.metrics
                    .set_tier_blocks(self.planner.num_cached_blocks(), self.kv.num_announced());
            }
            Command::Stats(reply) => {
                let planner = &self.planner;
                let _ = reply.send(BlockStats {
                    num_blocks: planner.num_blocks(),
                    free: planner.num_free_blocks(),
                    cached: planner.num_cached_blocks(),
                    pinned: self.pins.num_pinned(),
                    pins: self.pins.len(),
                    tier_announced: self.kv.num_announced(),
                    tier_remembered: self.kv.num_remembered(),
                });
            }
        }
    }

    /// Releases the pin `id` (an unknown one is ignored), giving its blocks back.
    fn release_pin(&mut self, id: &str) {
        let planner = &mut self.planner;
        self.pins.release(id, |blocks| planner.release_held(blocks));
    }

    /// Releases every pin whose time is up.
    fn expire_pins(&mut self) {
        let planner = &mut self.planner;
        self.pins
            .expire(Instant::now(), |blocks| planner.release_held(blocks));
    }

    /// Copies of the leading cached run of `hashes` (at most one transfer frame).
    fn export(&self, hashes: &[HashKey]) -> Vec<BlockData> {
        let max = self.blocks_per_frame();
        let mut out = Vec::new();
        for h in hashes.iter().take(max) {
            let Some(block) = self.planner.cached_block(h) else {
                break;
            };
            let Ok(bytes) = self.cache.read_block(block) else {
                break;
            };
            out.push(BlockData { hash: *h, bytes });
        }
        self.metrics
            .record_transfer_blocks("sent", out.len() as u64);
        out
    }

    /// Blocks of this cache that fit in one transfer frame.
    fn blocks_per_frame(&self) -> usize {
        BlockSpec::of_cache(String::new(), &self.cache).blocks_per_frame()
    }

    pub(super) fn flush_kv_events(&mut self) {
        let mut events: Vec<PoolEvent> = self.planner.drain_kv_events().collect();
        self.cached_index.apply(&events);
        self.kv.take_events(&mut events);
        if let (Some(sink), false) = (self.kv_events.as_mut(), events.is_empty()) {
            sink(events, self.planner.block_size());
        }
    }

    /// Aborts sequences nobody listens to any more, freeing their blocks.
    fn drop_abandoned(&mut self) {
        for seq in self.planner.take_abandoned() {
            self.output
                .finish(seq, (FinishReason::Abort, None), Vec::new());
        }
    }

    fn publish_gauges(&self) {
        let waiting = self.planner.num_waiting();
        let running = self.planner.num_running();
        // Submissions racing with this store are counted again at the next step.
        self.shared.waiting.store(waiting, Ordering::Release);
        self.shared.running.store(running, Ordering::Release);
        self.metrics.set_queue(waiting, running);
        self.metrics
            .kv_cache_usage_perc
            .set(self.planner.kv_usage());
        self.metrics
            .set_tier_blocks(self.planner.num_cached_blocks(), self.kv.num_announced());
        if let Some(max) = self.planner.max_loras() {
            self.metrics.set_lora_info(
                max,
                &self.planner.running_loras(),
                &self.planner.waiting_loras(),
            );
        }
    }
}
