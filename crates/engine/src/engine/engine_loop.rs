//! The engine thread: it sleeps until there is work (or a pin to expire), applies the
//! commands that arrived, drops sequences nobody listens to, runs one step, and publishes
//! the step's KV events and gauges. Between two steps it answers the handle's commands.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::kv::block_pool::HashKey;
use crate::kv::cache::KvCache;
use crate::kv::transfer::{BlockData, BlockSpec};
use crate::metrics::EngineMetrics;
use crate::model::Llama;
use crate::sampler::Sampler;
use crate::scheduler::{SchedulerConfig, StepBudget, StepPlanner};
use crate::sequence::{FinishReason, Sequence};

use super::block_identity::{block_hash_fn, lora_block_hash_fn};
use super::cached_index::CachedIndex;
use super::drafts::Drafter;
use super::handle::{BlockStats, Command, Shared};
use super::kv_link::KvLink;
use super::output::SeqOutput;
use super::pins::Pins;
use super::{EngineConfig, KvEventSink};
use crate::tokenizer::Tokenizer;

/// Everything the engine thread owns. The step's stages (`step.rs`) work on these fields.
pub(super) struct EngineLoop {
    pub(super) model: Arc<Llama>,
    pub(super) cache: KvCache,
    pub(super) scheduler: StepPlanner,
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
        config: EngineConfig,
        metrics: Arc<EngineMetrics>,
        shared: Arc<Shared>,
    ) -> Self {
        let cache = KvCache::with_heads(
            model.config.n_layer,
            config.num_blocks,
            config.block_size,
            model.config.n_kv_head,
            model.config.head_dim,
            config.kv_dtype,
        );
        let mut scheduler = StepPlanner::new(
            SchedulerConfig {
                block_size: config.block_size,
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
                policy: config.policy,
            },
            config.num_blocks,
            config
                .prefix_caching
                .then(|| block_hash_fn(&config.hash_seed, config.block_size)),
        )
        .with_budget(StepBudget::new(config.step_time_budget));
        scheduler.max_loras = config.max_loras;
        if config.prefix_caching {
            scheduler.set_lora_hash(lora_block_hash_fn(&config.hash_seed, config.block_size));
        }
        let output = SeqOutput::new(tokenizer, model.config.context_len, metrics.clone());
        Self {
            cache,
            scheduler,
            shared,
            rng: StdRng::seed_from_u64(config.seed),
            next_seq: 0,
            kv_events: None,
            cached_index: CachedIndex::default(),
            drafter: config.speculative.map(Drafter::new),
            output,
            pins: Pins::new(config.num_blocks, config.block_size, config.pin_timeout),
            kv: KvLink::new(config.num_blocks, metrics.clone()),
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
        self.kv.offload_to(&mut self.scheduler.pool, tx);
    }

    pub(super) fn run(&mut self, rx: Receiver<Command>) {
        loop {
            // Block for work when idle (waking for the next pin to expire); otherwise take
            // whatever has arrived.
            if !self.scheduler.has_work() {
                let mut wait = Duration::from_millis(500);
                if let Some(next) = self.pins.next_expiry() {
                    wait = wait.min(next.saturating_duration_since(Instant::now()));
                }
                match rx.recv_timeout(wait) {
                    Ok(cmd) => self.handle(cmd),
                    Err(RecvTimeoutError::Timeout) => {
                        self.pins.expire(&mut self.scheduler.pool, Instant::now());
                        self.publish_gauges();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.pins.expire(&mut self.scheduler.pool, Instant::now());
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
                self.scheduler.add(seq);
            }
            Command::CachedHashes(reply) => {
                let hashes = self
                    .scheduler
                    .pool
                    .cached_blocks()
                    .map(|(h, _)| *h)
                    .collect();
                let _ = reply.send(hashes);
            }
            Command::ResetPrefixCache(reply) => {
                let ok = self.scheduler.pool.reset();
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
                    self.pins.release(&mut self.scheduler.pool, &pin);
                }
                let _ = reply.send(out);
            }
            Command::ReleasePin(pin) => self.pins.release(&mut self.scheduler.pool, &pin),
            Command::Tier(change) => {
                // Announce at once (not after the next step): the tier's answers come about
                // once a second, and whoever asks the loop anything after a change sees its
                // events published and its gauge set.
                self.kv.tier_changed(change);
                self.flush_kv_events();
                self.metrics
                    .set_tier_blocks(self.scheduler.pool.num_cached(), self.kv.num_announced());
            }
            Command::Stats(reply) => {
                let pool = &self.scheduler.pool;
                let _ = reply.send(BlockStats {
                    num_blocks: pool.num_blocks(),
                    free: pool.num_free(),
                    cached: pool.num_cached(),
                    pinned: self.pins.num_pinned(),
                    pins: self.pins.len(),
                    tier_announced: self.kv.num_announced(),
                    tier_remembered: self.kv.num_remembered(),
                });
            }
        }
    }

    /// Copies of the leading cached run of `hashes` (at most one transfer frame).
    fn export(&self, hashes: &[HashKey]) -> Vec<BlockData> {
        let pool = &self.scheduler.pool;
        let max = self.blocks_per_frame();
        let mut out = Vec::new();
        for h in hashes.iter().take(max) {
            let Some(block) = pool.cached_block(h) else {
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
        let mut events = self.scheduler.pool.take_events();
        self.cached_index.apply(&events);
        self.kv.take_events(&mut events);
        if let (Some(sink), false) = (self.kv_events.as_mut(), events.is_empty()) {
            sink(events, self.scheduler.config.block_size);
        }
    }

    /// Aborts sequences nobody listens to any more, freeing their blocks.
    fn drop_abandoned(&mut self) {
        for seq in self.scheduler.take_abandoned() {
            self.output
                .finish(seq, (FinishReason::Abort, None), Vec::new());
        }
    }

    fn publish_gauges(&self) {
        let waiting = self.scheduler.waiting().len();
        let running = self.scheduler.running().len();
        // Submissions racing with this store are counted again at the next step.
        self.shared.waiting.store(waiting, Ordering::Release);
        self.shared.running.store(running, Ordering::Release);
        self.metrics.set_queue(waiting, running);
        self.metrics
            .kv_cache_usage_perc
            .set(self.scheduler.pool.usage());
        self.metrics
            .set_tier_blocks(self.scheduler.pool.num_cached(), self.kv.num_announced());
        if let Some(max) = self.scheduler.max_loras {
            self.metrics.set_lora_info(
                max,
                &self.scheduler.running_loras(),
                &self.scheduler.waiting_loras(),
            );
        }
    }
}
