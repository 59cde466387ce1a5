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
use crate::metrics::{EngineMetrics, FinishedRequest};
use crate::model::{Llama, SeqInput};
use crate::sampler::{SampleOutput, Sampler};
use crate::scheduler::{
    BlockHashFn, LoraBlockHashFn, Policy, SchedulerConfig, StepBudget, StepPlan, StepPlanner,
};
use crate::sequence::{FinishReason, GenerationRequest, SeqEvent, Sequence, TokenLogprob};
use crate::spec_decode::{linear_prices, propose, SpecConfig, StepCosts, PRIOR_ROW_COST};
use crate::structured::GrammarStep;
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
    /// Prompt-lookup speculative decoding; off when `None`.
    pub speculative: Option<SpecConfig>,
    /// Distinct LoRA adapters in one step (`--max-loras`); `None` when LoRA is off.
    pub max_loras: Option<usize>,
    /// The time a step that carries decodes should stay within (`--step-time-budget-ms`):
    /// prefill chunks beside decodes are sized to it from the measured step cost. `None`:
    /// only `max_num_batched_tokens` bounds a step.
    pub step_time_budget: Option<Duration>,
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
    scheduler: StepPlanner,
    metrics: Arc<EngineMetrics>,
    shared: Arc<Shared>,
    rng: StdRng,
    eos_ids: Vec<u32>,
    next_seq: u64,
    kv_events: Option<KvEventSink>,
    speculative: Option<SpecConfig>,
    /// Times of decode-only steps, which price speculative rows (unless configured).
    step_costs: StepCosts,
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
        );
        scheduler.max_loras = config.max_loras;
        scheduler.budget = StepBudget::new(config.step_time_budget);
        if config.prefix_caching {
            scheduler.set_lora_hash(lora_block_hash_fn(&config.hash_seed, config.block_size));
        }
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
            speculative: config.speculative,
            step_costs: StepCosts::default(),
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
        self.metrics.set_queue(waiting, running);
        self.metrics
            .kv_cache_usage_perc
            .set(self.scheduler.pool.usage());
        if let Some(max) = self.scheduler.max_loras {
            self.metrics.set_lora_info(
                max,
                &self.scheduler.running_loras(),
                &self.scheduler.waiting_loras(),
            );
        }
    }

    /// Appends n-gram proposals to every decoding sequence that may speculate, so the
    /// planner schedules them with its pending token.
    fn propose_drafts(&mut self) {
        let Some(spec) = self.speculative else {
            return;
        };
        let ctx = self.model.config.context_len;
        // Sequences decoding this step: extra rows cost more the more of them there are.
        let batch = self
            .scheduler
            .running
            .iter()
            .filter(|s| s.num_pending() == 1)
            .count();
        let max = spec.num_speculative_tokens;
        let prices = match spec.row_cost {
            Some(c) => linear_prices(c, batch, max),
            None => {
                let fallback = self.step_costs.row_cost().unwrap_or(PRIOR_ROW_COST);
                self.step_costs.prices(batch, max, fallback)
            }
        };
        for seq in self.scheduler.running.iter_mut() {
            if !seq.speculative
                || seq.grammar.is_some()
                || seq.num_pending() != 1
                || seq.num_output() == 0
            {
                continue;
            }
            let budget = seq.spec.budget(&spec, batch, &prices);
            if budget == 0 {
                continue;
            }
            // Room for every proposal plus the token sampled after them, within both
            // max_tokens and the context.
            let by_length = seq.max_tokens.saturating_sub(seq.num_output() + 1);
            let by_context = ctx.saturating_sub(seq.tokens.len() + 1);
            let drafts = propose(&seq.tokens, &spec, budget.min(by_length).min(by_context));
            seq.num_draft = drafts.len();
            seq.tokens.extend_from_slice(&drafts);
        }
    }

    /// After planning: proposals of a preempted, unscheduled or partly scheduled sequence
    /// are dropped (a partly scheduled one runs just its pending token). Returns which
    /// running sequences carried proposals into planning, so their spare blocks can be
    /// released after the step.
    fn settle_drafts(&mut self, plan: &mut StepPlan) -> Vec<bool> {
        let bs = self.scheduler.config.block_size;
        for seq in self.scheduler.waiting.iter_mut() {
            if seq.num_draft > 0 {
                seq.drop_drafts();
                seq.block_hashes.truncate(seq.tokens.len() / bs);
            }
        }
        let running = &mut self.scheduler.running;
        let mut had = vec![false; running.len()];
        let mut planned: Vec<Option<usize>> = vec![None; running.len()];
        for (k, w) in plan.work.iter().enumerate() {
            planned[w.index] = Some(k);
        }
        for (i, seq) in running.iter_mut().enumerate() {
            if seq.num_draft == 0 {
                continue;
            }
            had[i] = true;
            match planned[i] {
                Some(k) if plan.work[k].num_tokens == seq.num_pending() => {}
                Some(k) => {
                    seq.drop_drafts();
                    plan.work[k].num_tokens = 1;
                }
                None => seq.drop_drafts(),
            }
        }
        had
    }

    fn step(&mut self) {
        self.propose_drafts();
        let mut plan = self.scheduler.schedule();
        let had_drafts = self.settle_drafts(&mut plan);
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
        self.metrics
            .record_step(plan.work.iter().map(|w| w.num_tokens).sum());
        let now = Instant::now();
        // A step of decode rows only (each sequence's pending token and proposals) is
        // timed for the speculative row price.
        let mut decode_only = true;
        let mut tails = Vec::with_capacity(plan.work.len());
        let mut loras = Vec::with_capacity(plan.work.len());
        let inputs: Vec<SeqInput<'_>> = plan
            .work
            .iter()
            .map(|w| {
                let seq = &self.scheduler.running[w.index];
                let start = seq.num_computed;
                let complete = start + w.num_tokens == seq.tokens.len();
                // The pending token's row and one per proposal.
                tails.push(if complete { 1 + seq.num_draft } else { 0 });
                decode_only &= complete && start >= seq.prompt_len;
                loras.push(seq.lora.as_deref());
                SeqInput {
                    tokens: &seq.tokens[start..start + w.num_tokens],
                    start_pos: start,
                    block_table: &seq.block_table,
                    want_logits: complete,
                    prompt_len: seq.prompt_len,
                }
            })
            .collect();
        let result = self
            .model
            .forward_rows_lora(&mut self.cache, &inputs, &tails, &loras);
        drop(inputs);
        drop(loras);
        // The step's cost feeds the planner's step-time budget.
        let step_tokens: usize = plan.work.iter().map(|w| w.num_tokens).sum();
        self.scheduler
            .observe_step(step_tokens, now.elapsed().as_secs_f64());
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
        let mut row_logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); running.len()];
        for (w, logits) in plan.work.iter().zip(logits) {
            let seq = &mut running[w.index];
            if seq.times.first_scheduled.is_none() {
                seq.times.first_scheduled = Some(now);
            }
            seq.num_computed += w.num_tokens;
            row_logits[w.index] = logits;
        }
        let mut samples = sample_all(running, row_logits, &self.eos_ids);
        if decode_only && self.speculative.is_some() {
            // With sampling, which every extra row also pays for.
            self.step_costs
                .observe(step_tokens, now.elapsed().as_secs_f64());
        }

        let mut finished: Vec<(usize, FinishReason, Option<String>)> = Vec::new();
        for w in &plan.work {
            let Some(sample) = samples[w.index].take() else {
                continue;
            };
            let seq = &mut self.scheduler.running[w.index];
            let proposed = seq.num_draft;
            // Rows were sampled in order until one disagreed with its proposal: all
            // but the last sampled token confirmed a proposal.
            let accepted = sample.outs.len().saturating_sub(1).min(proposed);
            if proposed > 0 {
                self.metrics.spec_decode.record(proposed, accepted);
                seq.spec.record(proposed, accepted);
            }
            seq.drop_drafts();
            // Keys and values stay valid up to the last accepted proposal; the rejected
            // ones' slots are rewritten when those positions are computed again.
            seq.num_computed = seq.tokens.len() + accepted;
            if let Some(err) = sample.error {
                seq.num_computed = seq.num_computed.min(seq.tokens.len());
                finished.push((w.index, FinishReason::Error(err), None));
                continue;
            }
            let last = sample.outs.len().saturating_sub(1);
            for (j, out) in sample.outs.into_iter().enumerate() {
                if let Some(reason) = self.emit(w.index, out, sample.grammar_done && j == last) {
                    finished.push((w.index, reason.0, reason.1));
                    break;
                }
            }
            let seq = &mut self.scheduler.running[w.index];
            seq.num_computed = seq.num_computed.min(seq.tokens.len().saturating_sub(1));
        }
        // Give back the blocks of rejected proposals.
        for (i, had) in had_drafts.into_iter().enumerate() {
            if had {
                self.scheduler.release_unneeded_blocks(i);
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

    /// Appends one sampled token to `running[index]`, streams it and returns why the
    /// sequence ends there, if it does. `grammar_done`: the structured-output grammar is
    /// complete with this token.
    fn emit(
        &mut self,
        index: usize,
        out: SampleOutput,
        grammar_done: bool,
    ) -> Option<(FinishReason, Option<String>)> {
        let seq = &mut self.scheduler.running[index];
        seq.tokens.push(out.token);
        self.metrics.generation_tokens.inc();
        let t = Instant::now();
        match seq.times.last_token {
            None => {
                seq.times.first_token = Some(t);
                // Like vLLM: the whole prompt, cached or not, once per request.
                self.metrics
                    .record_prompt(seq.prompt_len, seq.cached_tokens);
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
        let is_eos = self.eos_ids.contains(&out.token);
        let is_stop_token = (!config.ignore_eos && is_eos)
            || config.stop_token_ids.contains(&out.token)
            || (grammar_done && is_eos);
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
            Some((FinishReason::Stop, stop))
        } else if let Some(s) = step.stopped {
            Some((FinishReason::Stop, Some(s)))
        } else if grammar_done {
            // The grammar is complete and nothing can follow: the structured output ends.
            Some((FinishReason::Stop, None))
        } else if seq.num_output() >= seq.max_tokens
            || seq.tokens.len() >= self.model.config.context_len
        {
            Some((FinishReason::Length, None))
        } else {
            None
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
        self.metrics.record_request(FinishedRequest {
            prompt_tokens: seq.prompt_len,
            generation_tokens: seq.num_output(),
            cached_tokens: seq.cached_tokens,
            inference_time: t.first_scheduled.map(|s| now.duration_since(s)),
        });
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
            times: t,
        });
    }
}

/// One sequence's sampling result for a step.
struct SeqSample {
    /// Tokens sampled from the rows in order, stopping after the first that differs from
    /// its proposal (or at the last row).
    outs: Vec<SampleOutput>,
    /// The structured-output grammar is complete after the last of `outs`.
    grammar_done: bool,
    /// The grammar failed; the sequence ends with this error.
    error: Option<String>,
}

/// Samples one sequence's rows: row `i` is the distribution after the pending token and
/// the first `i` proposals. Penalties see exactly the tokens a one-at-a-time decode would
/// have seen, and each sample is one draw from the sequence's own random stream, so an
/// accepted proposal is the token the same seed would have produced without speculation.
fn sample_seq(seq: &mut Sequence, rows: Vec<Vec<f32>>, eos_ids: &[u32]) -> Option<SeqSample> {
    if rows.is_empty() {
        return None;
    }
    let mut result = SeqSample {
        outs: Vec::with_capacity(rows.len()),
        grammar_done: false,
        error: None,
    };
    let proposed = seq.num_draft;
    let base = seq.tokens.len() - proposed;
    for (i, mut logits) in rows.into_iter().enumerate() {
        let allowed = match seq.grammar.as_mut().map(|g| g.mask_logits(&mut logits)) {
            None => None,
            Some(Ok(a)) => Some(a),
            Some(Err(e)) => {
                result.error = Some(e.to_string());
                return Some(result);
            }
        };
        let (prompt, output) = seq.tokens[..base + i].split_at(seq.prompt_len);
        let mut out = seq.sampler.sample(&mut logits, prompt, output, eos_ids);
        if let (Some(g), Some(allowed)) = (seq.grammar.as_mut(), allowed) {
            if !allowed.contains(out.token) {
                // Sampling's own masks removed every token the grammar allows (only
                // `min_tokens` hiding EOS can): the grammar wins.
                out.token = allowed.best;
            }
            match g.accept(out.token) {
                Ok(GrammarStep::Done) => result.grammar_done = true,
                Ok(GrammarStep::Continue) => {}
                Err(e) => {
                    result.error = Some(e.to_string());
                    return Some(result);
                }
            }
        }
        let confirms = i < proposed && seq.tokens[base + i] == out.token;
        result.outs.push(out);
        if !confirms {
            break;
        }
    }
    Some(result)
}

/// Samples every sequence given its logit rows (`logits[i]` belongs to `running[i]`).
/// Each sequence has its own sampler, random stream and grammar, so the sequences are
/// sampled (and their grammar masks computed) in parallel with the same results as one
/// after another.
fn sample_all(
    running: &mut [Sequence],
    logits: Vec<Vec<Vec<f32>>>,
    eos_ids: &[u32],
) -> Vec<Option<SeqSample>> {
    let sample = |(seq, rows): (&mut Sequence, Vec<Vec<f32>>)| sample_seq(seq, rows, eos_ids);
    if logits.iter().filter(|r| !r.is_empty()).count() > 1 {
        running.par_iter_mut().zip(logits).map(sample).collect()
    } else {
        running.iter_mut().zip(logits).map(sample).collect()
    }
}

/// The block hash of a sequence with a LoRA adapter: the adapter's name is an extra key of
/// every block, ahead of the salt (PROTOCOLS §3).
fn lora_block_hash_fn(seed: &str, block_size: usize) -> LoraBlockHashFn {
    let hasher = BlockHasher::new(seed, block_size);
    Box::new(move |parent, tokens, lora, salt| {
        let parent = parent.map(|p| BlockHash(*p));
        let extra = block_extra_keys(0, Some(lora), salt);
        hasher
            .hash_block(parent.as_ref(), tokens, extra.as_deref())
            .0
    })
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
