//! The engine loop: one thread owns the model, the KV cache and the scheduler, and turns
//! submitted requests into streamed tokens, one batched forward per step.
//!
//! Requests arrive over a channel ([`EngineHandle::submit`]); each step the loop drops
//! sequences whose submitter went away (freeing their blocks), asks the scheduler for a
//! plan, runs one forward over every scheduled sequence, samples where a sequence's
//! pending tokens are all computed, and reports tokens and finishes on each sequence's
//! own channel.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::kv::block_pool::{HashKey, PoolEvent};
use crate::kv::cache::{KvCache, KvDtype};
use crate::kv::hashing::{block_extra_keys, BlockHash, BlockHasher};
use crate::metrics::EngineMetrics;
use crate::model::{Llama, SeqInput};
use crate::sampler::{SampleOutput, Sampler};
use crate::scheduler::{BlockHashFn, Policy, Scheduler, SchedulerConfig};
use crate::sequence::{FinishReason, GenerationRequest, SeqEvent, Sequence, TokenLogprob};
use crate::tokenizer::Tokenizer;

/// Engine sizing and policy.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    /// How KV-cache entries are stored.
    pub kv_dtype: KvDtype,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Waiting requests beyond this are refused (HTTP 429).
    pub max_waiting: usize,
    pub policy: Policy,
    pub seed: u64,
    /// Share full KV blocks between requests with the same prefix.
    pub prefix_caching: bool,
    /// Seed of the block hashes (vLLM's `PYTHONHASHSEED` counterpart).
    pub hash_seed: String,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the engine queue is full ({0} waiting)")]
    QueueFull(usize),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

enum Command {
    Add(Box<GenerationRequest>),
    /// Forget every cached prefix; answers whether it could (no block may be in use).
    ResetPrefixCache(tokio::sync::oneshot::Sender<bool>),
    /// The hashes currently naming cached blocks.
    CachedHashes(tokio::sync::oneshot::Sender<Vec<HashKey>>),
}

/// Counters shared between the loop and the server.
#[derive(Default)]
struct Shared {
    waiting: AtomicUsize,
    running: AtomicUsize,
    draining: AtomicBool,
}

/// The server's side of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    shared: Arc<Shared>,
    pub metrics: Arc<EngineMetrics>,
    max_waiting: usize,
}

impl EngineHandle {
    /// Queues a request; its tokens arrive on `req.events`.
    pub fn submit(&self, req: GenerationRequest) -> Result<(), SubmitError> {
        if self.shared.draining.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        let waiting = self.shared.waiting.fetch_add(1, Ordering::AcqRel);
        if waiting >= self.max_waiting {
            self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::QueueFull(waiting));
        }
        self.tx.send(Command::Add(Box::new(req))).map_err(|_| {
            self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            SubmitError::ShuttingDown
        })
    }

    /// Clears the prefix cache (publishing AllBlocksCleared). False while requests hold
    /// blocks or when the engine is gone.
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Command::ResetPrefixCache(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// The hashes naming cached blocks right now (for checks against KV-event mirrors).
    pub async fn cached_block_hashes(&self) -> Vec<HashKey> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Command::CachedHashes(tx)).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Requests queued or running.
    pub fn in_flight(&self) -> usize {
        self.shared.waiting.load(Ordering::Acquire) + self.shared.running.load(Ordering::Acquire)
    }

    /// Stops accepting new requests (in-flight ones carry on).
    pub fn start_draining(&self) {
        self.shared.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::Acquire)
    }
}

/// Starts the engine thread. Dropping every [`EngineHandle`] ends it.
pub fn start(
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    metrics: Arc<EngineMetrics>,
    kv_events: Option<KvEventSink>,
) -> (EngineHandle, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new(Shared::default());
    let handle = EngineHandle {
        tx,
        shared: shared.clone(),
        metrics: metrics.clone(),
        max_waiting: config.max_waiting,
    };
    let thread = std::thread::Builder::new()
        .name("strata-engine".into())
        .spawn(move || {
            let mut engine = EngineLoop::new(model, tokenizer, config, metrics, shared, kv_events);
            engine.run(rx);
        });
    let thread = match thread {
        Ok(t) => t,
        // Spawning a thread only fails when the OS is out of resources; nothing to serve with.
        Err(e) => panic!("cannot start the engine thread: {e}"),
    };
    (handle, thread)
}

struct EngineLoop {
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    cache: KvCache,
    scheduler: Scheduler,
    metrics: Arc<EngineMetrics>,
    shared: Arc<Shared>,
    rng: StdRng,
    eos_ids: Vec<u32>,
    next_seq: u64,
    kv_events: Option<KvEventSink>,
}

/// Where cache changes go (the ZMQ publisher in production, a channel in tests).
pub type KvEventSink = Box<dyn FnMut(Vec<PoolEvent>, usize) + Send>;

impl EngineLoop {
    fn new(
        model: Arc<Llama>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        metrics: Arc<EngineMetrics>,
        shared: Arc<Shared>,
        kv_events: Option<KvEventSink>,
    ) -> Self {
        let cache = KvCache::with_dtype(
            model.config.n_layer,
            config.num_blocks,
            config.block_size,
            model.kv_slot_width(),
            config.kv_dtype,
        );
        let scheduler = Scheduler::new(
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
        );
        let eos_ids = tokenizer.stop_ids().to_vec();
        Self {
            model,
            tokenizer,
            cache,
            scheduler,
            metrics,
            shared,
            rng: StdRng::seed_from_u64(config.seed),
            eos_ids,
            next_seq: 0,
            kv_events,
        }
    }

    fn run(&mut self, rx: Receiver<Command>) {
        loop {
            // Block for work when idle; otherwise take whatever has arrived.
            if !self.scheduler.has_work() {
                match rx.recv_timeout(Duration::from_millis(500)) {
                    Ok(cmd) => self.handle(cmd),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
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
        }
    }

    fn flush_kv_events(&mut self) {
        let events = self.scheduler.pool.take_events();
        if let (Some(sink), false) = (self.kv_events.as_mut(), events.is_empty()) {
            sink(events, self.scheduler.config.block_size);
        }
    }

    /// Aborts sequences nobody listens to any more, freeing their blocks.
    fn drop_abandoned(&mut self) {
        let mut i = 0;
        while i < self.scheduler.running.len() {
            if self.scheduler.running[i].is_abandoned() {
                let seq = self.scheduler.finish_running(i);
                self.finish(seq, FinishReason::Abort, None);
            } else {
                i += 1;
            }
        }
        let waiting = std::mem::take(&mut self.scheduler.waiting);
        for seq in waiting {
            if seq.is_abandoned() {
                self.finish(seq, FinishReason::Abort, None);
            } else {
                self.scheduler.waiting.push_back(seq);
            }
        }
    }

    fn publish_gauges(&self) {
        let waiting = self.scheduler.waiting.len();
        let running = self.scheduler.running.len();
        // Submissions racing with this store are counted again at the next step.
        self.shared.waiting.store(waiting, Ordering::Release);
        self.shared.running.store(running, Ordering::Release);
        self.metrics.num_requests_waiting.set(waiting as i64);
        self.metrics.num_requests_running.set(running as i64);
        self.metrics
            .kv_cache_usage_perc
            .set(self.scheduler.pool.usage());
    }

    fn step(&mut self) {
        let plan = self.scheduler.schedule();
        if plan.num_preempted > 0 {
            self.metrics
                .num_preemptions
                .inc_by(plan.num_preempted as u64);
        }
        self.metrics
            .prefix_cache_queries
            .inc_by(plan.prefix_queries as u64);
        self.metrics
            .prefix_cache_hits
            .inc_by(plan.prefix_hits as u64);
        if plan.work.is_empty() {
            return;
        }
        let now = Instant::now();
        let inputs: Vec<SeqInput<'_>> = plan
            .work
            .iter()
            .map(|w| {
                let seq = &self.scheduler.running[w.index];
                let start = seq.num_computed;
                SeqInput {
                    tokens: &seq.tokens[start..start + w.num_tokens],
                    start_pos: start,
                    block_table: &seq.block_table,
                    want_logits: start + w.num_tokens == seq.tokens.len(),
                    prompt_len: seq.prompt_len,
                }
            })
            .collect();
        let result = self.model.forward(&mut self.cache, &inputs);
        drop(inputs);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed; aborting the step's sequences");
                let mut indices: Vec<usize> = plan.work.iter().map(|w| w.index).collect();
                indices.sort_unstable_by(|a, b| b.cmp(a));
                for i in indices {
                    let seq = self.scheduler.finish_running(i);
                    self.finish(seq, FinishReason::Error(e.to_string()), None);
                }
                return;
            }
        };

        let running = &mut self.scheduler.running;
        let mut row_logits: Vec<Option<Vec<f32>>> = vec![None; running.len()];
        for (w, logits) in plan.work.iter().zip(logits) {
            let seq = &mut running[w.index];
            if seq.times.first_scheduled.is_none() {
                seq.times.first_scheduled = Some(now);
            }
            seq.num_computed += w.num_tokens;
            row_logits[w.index] = logits;
        }
        let mut samples = sample_all(running, row_logits, &self.eos_ids);

        let mut finished: Vec<(usize, FinishReason, Option<String>)> = Vec::new();
        for w in &plan.work {
            let Some(out) = samples[w.index].take() else {
                continue;
            };
            let seq = &mut self.scheduler.running[w.index];
            seq.tokens.push(out.token);
            self.metrics.generation_tokens.inc();
            let t = Instant::now();
            match seq.times.last_token {
                None => {
                    seq.times.first_token = Some(t);
                    // Like vLLM: the whole prompt, cached or not, once per request.
                    self.metrics.prompt_tokens.inc_by(seq.prompt_len as u64);
                    self.metrics
                        .time_to_first_token
                        .observe((t - seq.times.arrival).as_secs_f64());
                }
                Some(prev) => self
                    .metrics
                    .inter_token_latency
                    .observe((t - prev).as_secs_f64()),
            }
            seq.times.last_token = Some(t);

            let config = seq.sampler.config();
            let is_stop_token = (!config.ignore_eos && self.eos_ids.contains(&out.token))
                || config.stop_token_ids.contains(&out.token);
            let wants_logprobs = config.logprobs.is_some();
            let text = if is_stop_token {
                String::new()
            } else {
                seq.decoder
                    .push(&self.tokenizer, out.token)
                    .unwrap_or_default()
            };
            let step = seq.stop.push(&text);
            let logprob = wants_logprobs.then_some(TokenLogprob {
                logprob: out.logprob,
                top: out.top_logprobs,
            });
            let _ = seq.events.send(SeqEvent::Token {
                token: out.token,
                text: step.emit,
                logprob,
            });
            if is_stop_token {
                let stop = self
                    .tokenizer
                    .token_str(out.token)
                    .ok()
                    .map(|s| s.to_string());
                finished.push((w.index, FinishReason::Stop, stop));
            } else if let Some(s) = step.stopped {
                finished.push((w.index, FinishReason::Stop, Some(s)));
            } else if seq.num_output() >= seq.max_tokens
                || seq.tokens.len() >= self.model.config.context_len
            {
                finished.push((w.index, FinishReason::Length, None));
            }
        }
        // Name the blocks this step filled before finished sequences release theirs.
        self.scheduler.commit_full_blocks();
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason, stop) in finished {
            let seq = self.scheduler.finish_running(i);
            self.finish(seq, reason, stop);
        }
    }

    /// Reports the end of a sequence (its blocks are already released) and records metrics.
    fn finish(&mut self, mut seq: Sequence, reason: FinishReason, stop: Option<String>) {
        // Release text still held by the decoder or the stop matcher, unless the client is
        // gone. After a stop-string match the matcher releases nothing.
        let mut text = String::new();
        if reason != FinishReason::Abort {
            let rest = seq.decoder.finish();
            let step = seq.stop.push(&rest);
            text = step.emit;
            text.push_str(&seq.stop.flush());
        }
        let now = Instant::now();
        let t = seq.times;
        self.metrics.record_finish(reason.as_str());
        self.metrics
            .e2e_request_latency
            .observe((now - t.arrival).as_secs_f64());
        if let Some(s) = t.first_scheduled {
            self.metrics
                .request_queue_time
                .observe((s - t.arrival).as_secs_f64());
            if let Some(f) = t.first_token {
                self.metrics
                    .request_prefill_time
                    .observe((f - s).as_secs_f64());
                let last = t.last_token.unwrap_or(f);
                self.metrics
                    .request_decode_time
                    .observe((last - f).as_secs_f64());
                let n = seq.num_output();
                if n > 1 {
                    self.metrics
                        .time_per_output_token
                        .observe((last - f).as_secs_f64() / (n - 1) as f64);
                }
            }
        }
        let _ = seq.events.send(SeqEvent::Finished {
            reason,
            stop,
            text,
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.num_output(),
            cached_tokens: seq.cached_tokens,
        });
    }
}

/// Samples the next token of every sequence given logits (`logits[i]` belongs to
/// `running[i]`). Each sequence has its own sampler and random stream, so the sequences
/// are sampled in parallel with the same results as one after another.
fn sample_all(
    running: &mut [Sequence],
    logits: Vec<Option<Vec<f32>>>,
    eos_ids: &[u32],
) -> Vec<Option<SampleOutput>> {
    let sample = |(seq, logits): (&mut Sequence, Option<Vec<f32>>)| {
        let mut logits = logits?;
        let (prompt, output) = seq.tokens.split_at(seq.prompt_len);
        Some(seq.sampler.sample(&mut logits, prompt, output, eos_ids))
    };
    if logits.iter().flatten().count() > 1 {
        running.par_iter_mut().zip(logits).map(sample).collect()
    } else {
        running.iter_mut().zip(logits).map(sample).collect()
    }
}

/// The prefix-cache block hash (PROTOCOLS §3) as the scheduler calls it.
fn block_hash_fn(seed: &str, block_size: usize) -> BlockHashFn {
    let hasher = BlockHasher::new(seed, block_size);
    Box::new(move |parent, tokens, salt| {
        let parent = parent.map(|p| BlockHash(*p));
        // The scheduler passes the salt for the first block only.
        let extra = block_extra_keys(0, None, salt);
        let extra = extra.as_deref();
        hasher.hash_block(parent.as_ref(), tokens, extra).0
    })
}
