//! A modelled engine replica: the engine's own step planner and block pool
//! (`strata_engine::planner::StepPlanner`), driven through the same contract the engine
//! thread keeps, with the forward pass replaced by the step-time model.
//!
//! The engine loop (`crates/engine/src/engine/step.rs`) per step: plan, run one forward
//! over the plan, advance every planned sequence (named by its `SeqId`) by its tokens,
//! sample those whose pending tokens are all computed, finish the ones at their length,
//! then the planner's after-step rule (`StepPlanner::commit_and_retire`: name the blocks
//! the step filled, release the finished), and publish the cache changes. Here the forward is a wait of `StepModel::step_time` in
//! virtual time and sampling is a deterministic token id (the simulated clients ask for
//! `ignore_eos`, as `strata bench` does by default).

use strata_api::block_hash::BlockHash;
use strata_engine::kv::block_pool::{HashKey, PoolEvent};
use strata_engine::options::EngineOptions;
use strata_engine::planner::{BlockHashFn, SeqId, StepPlan, StepPlanner};
use strata_engine::sampler::{Sampler, SamplingConfig};
use strata_engine::sequence::{GenerationRequest, SeqEvent, Sequence};
use tokio::sync::mpsc::UnboundedSender;
use xxhash_rust::xxh3::Xxh3;

use crate::profile::{StepModel, StepShape};
use crate::routing::KvChange;
use strata_engine::prefetch::prefetch;

/// The prefix-cache block hash used in simulation: chained like the engine's (parent,
/// tokens, salt), but xxh3 instead of SHA-256 over CBOR, since only equality matters to
/// every decision and a million requests would otherwise spend most of their time hashing.
pub fn fast_block_hash(parent: Option<&HashKey>, tokens: &[u32], salt: Option<&str>) -> HashKey {
    // One-shot hashing of one buffer on the stack: the streaming hasher's state is half a
    // kilobyte to set up per block. Blocks too large for the buffer stream.
    const MAX: usize = 32 + 4 * 64;
    let mut buf = [0u8; MAX];
    let a = if tokens.len() <= 64 && salt.is_none() {
        let mut n = 0;
        // Whole fixed-size stores: a `copy_from_slice` of a length the compiler does not
        // see is a call to `memcpy`, per token.
        if let (Some(p), Some(head)) = (parent, buf.first_chunk_mut::<32>()) {
            *head = *p;
            n = 32;
        }
        let (words, _) = buf[n..].as_chunks_mut::<4>();
        for (w, t) in words.iter_mut().zip(tokens) {
            *w = t.to_le_bytes();
        }
        n += 4 * tokens.len();
        xxhash_rust::xxh3::xxh3_128(&buf[..n]).to_le_bytes()
    } else {
        let mut h = Xxh3::new();
        if let Some(p) = parent {
            h.update(p);
        }
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        if let Some(s) = salt {
            h.update(s.as_bytes());
        }
        h.digest128().to_le_bytes()
    };
    // The second half is derived, so the wire form (the last 8 bytes) depends on all of it.
    let b = xxhash_rust::xxh3::xxh3_128(&a).to_le_bytes();
    // Two whole 16-byte stores (a byte-by-byte copy took as long as both hashes).
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&a);
    out[16..].copy_from_slice(&b);
    out
}

/// The wire (`u64`) hashes of every full block of `tokens`, as KV events name them.
pub fn wire_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent: Option<HashKey> = None;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            let h = fast_block_hash(parent.as_ref(), block, None);
            parent = Some(h);
            BlockHash(h).to_u64()
        })
        .collect()
}

/// What one finished step produced.
#[derive(Default)]
pub struct StepResult {
    /// Requests that got a token this step: (request id, tokens out so far).
    pub tokens: Vec<(u64, u32)>,
    /// Requests that finished, with their sequence (its generated tokens and cache hits).
    pub finished: Vec<Sequence>,
    /// Cache changes, for the router's precise index.
    pub kv: Vec<KvChange>,
}

/// One engine replica.
pub struct SimEngine {
    planner: StepPlanner,
    /// The step in flight, if any, with its tokens and modelled seconds.
    plan: Option<(StepPlan, usize, f64)>,
    context_len: usize,
    events_tx: UnboundedSender<SeqEvent>,
    pub steps: u64,
    pub preemptions: u64,
    /// Scratch: the sequences finishing this step (kept to reuse its allocation).
    done: Vec<(SeqId, ())>,
}

impl SimEngine {
    /// A replica of an engine started with `opts` (the `strata engine` flags the simulator
    /// takes: block size, batch limits, policy, prefix caching, step-time target), with
    /// `num_blocks` KV blocks. `events_tx` is a sender whose receiver the simulation keeps
    /// open (nothing is sent on it: the simulation reads the sequences).
    pub fn new(
        opts: &EngineOptions,
        num_blocks: usize,
        context_len: usize,
        events_tx: UnboundedSender<SeqEvent>,
    ) -> SimEngine {
        let hash: Option<BlockHashFn> = opts
            .prefix_caching
            .then(|| Box::new(fast_block_hash) as BlockHashFn);
        let mut planner = StepPlanner::new(opts, num_blocks, hash);
        // KV events reach the router as hashes only: the tokens would be copied per block
        // for nothing.
        planner.set_kv_event_tokens(false);
        SimEngine {
            planner,
            plan: None,
            context_len,
            events_tx,
            steps: 0,
            preemptions: 0,
            done: Vec::new(),
        }
    }

    /// Queues a request; `id` orders admissions (FCFS) and names it in results.
    pub fn submit(&mut self, id: u64, prompt: Vec<u32>, max_tokens: usize) {
        let req = GenerationRequest {
            request_id: String::new(),
            prompt,
            sampling: SamplingConfig::default(),
            max_tokens,
            stop: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            priority: 0,
            cache_salt: None,
            arrival: std::time::Instant::now(),
            events: self.events_tx.clone(),
            grammar: None,
            speculative: false,
            lora: None,
            imported: Vec::new(),
            pin: None,
        };
        let sampler = Sampler::new(SamplingConfig::default(), id);
        let mut seq = Sequence::new(req, sampler, id);
        // The hash of every block it will fill, without regrowing the list on the way.
        let len = (seq.tokens.len() + max_tokens).min(self.context_len);
        seq.block_hashes
            .reserve_exact(len / self.planner.block_size().max(1));
        self.planner.add(seq);
    }

    /// Whether the replica's cache changes are collected for the router (`finish_step`'s
    /// `out.kv`); on by default. Off for a router that reads no KV events, which would
    /// drop every change anyway.
    pub fn set_kv_events(&mut self, on: bool) {
        self.planner.set_kv_events(on);
    }

    pub fn busy(&self) -> bool {
        self.plan.is_some()
    }

    pub fn has_work(&self) -> bool {
        self.planner.has_work()
    }

    /// Plans a step and returns how long its forward takes, or `None` when there is
    /// nothing to run.
    pub fn start_step(&mut self, model: &StepModel) -> Option<f64> {
        debug_assert!(self.plan.is_none());
        let plan = self.planner.plan();
        self.preemptions += plan.num_preempted as u64;
        if plan.work.is_empty() {
            return None;
        }
        let mut shape = StepShape::default();
        let mut tokens = 0;
        for w in &plan.work {
            let seq = self.planner.seq(w.id);
            let start = seq.num_computed;
            let logits = start + w.num_tokens == seq.tokens.len();
            shape.add(start as u64, w.num_tokens as u64, logits);
            tokens += w.num_tokens;
        }
        let secs = model.step_time(&shape);
        self.plan = Some((plan, tokens, secs));
        self.steps += 1;
        Some(secs)
    }

    /// Ends the step in flight: advances, samples, finishes, names the filled blocks and
    /// adds the cache changes to `out.kv`.
    pub fn finish_step(&mut self, out: &mut StepResult) {
        out.tokens.clear();
        out.finished.clear();
        let Some((plan, tokens, secs)) = self.plan.take() else {
            return;
        };
        // The step's cost feeds the planner's step-time budget, as in the engine.
        self.planner.observe_step(tokens, secs);
        let mut done = std::mem::take(&mut self.done);
        done.clear();
        // Where each sampled token goes: one miss per sequence, started together.
        for w in &plan.work {
            let seq = self.planner.seq(w.id);
            prefetch(seq.tokens.as_ptr().wrapping_add(seq.tokens.len()));
        }
        for w in &plan.work {
            let seq = self.planner.seq_mut(w.id);
            seq.num_computed += w.num_tokens;
            if seq.num_computed != seq.tokens.len() {
                continue; // a prefill chunk that yields no logits yet
            }
            let pos = seq.tokens.len() as u64;
            seq.tokens.push(sampled_token(seq.arrival_seq, pos));
            out.tokens.push((seq.arrival_seq, seq.num_output() as u32));
            if seq.num_output() >= seq.max_tokens || seq.tokens.len() >= self.context_len {
                done.push((w.id, ()));
            }
        }
        let finished = self.planner.commit_and_retire(&mut done, |_, _, _| ());
        out.finished
            .extend(finished.into_iter().map(|(seq, (), ())| seq));
        self.done = done;
        for e in self.planner.drain_kv_events() {
            match e {
                PoolEvent::Stored { hash, .. } => out.kv.push(KvChange {
                    stored: true,
                    hash: BlockHash(hash).to_u64(),
                }),
                PoolEvent::Removed { hash } => out.kv.push(KvChange {
                    stored: false,
                    hash: BlockHash(hash).to_u64(),
                }),
                // The simulator has no KV tier.
                PoolEvent::Cleared
                | PoolEvent::TierStored { .. }
                | PoolEvent::TierRemoved { .. } => {}
            }
        }
    }

    pub fn waiting(&self) -> usize {
        self.planner.num_waiting()
    }

    pub fn running(&self) -> usize {
        self.planner.num_running()
    }

    pub fn kv_usage(&self) -> f64 {
        self.planner.kv_usage()
    }
}

/// A generated token: deterministic in (request, position), inside the token-id range
/// `strata bench` prompts use.
fn sampled_token(request: u64, pos: u64) -> u32 {
    let r = strata_bench::prompt::TOKEN_ID_RANGE;
    let span = u64::from(r.end - r.start);
    r.start + (strata_bench::prompt::mix(&[request, pos]) % span) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{HardwareProfile, ModelProfile};

    #[test]
    fn kv_events_name_blocks_as_the_router_hashes_prompts() {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let opts = EngineOptions::default();
        let mut e = SimEngine::new(&opts, 64, 8192, tx);
        let model = StepModel::new(
            HardwareProfile::named("h100").unwrap(),
            ModelProfile::named("llama-3.1-8b").unwrap(),
            1,
        )
        .unwrap();
        let prompt: Vec<u32> = (0..100).map(|i| 1000 + i * 7).collect();
        e.submit(0, prompt.clone(), 3);
        let mut out = StepResult::default();
        let mut stored = Vec::new();
        while e.has_work() {
            assert!(e.start_step(&model).is_some());
            e.finish_step(&mut out);
            stored.extend(out.kv.drain(..).filter(|c| c.stored).map(|c| c.hash));
        }
        // 100 prompt + 2 fed-back tokens: six full blocks of 16, named in chain order.
        assert_eq!(stored.len(), 6);
        assert_eq!(stored, wire_hashes(&prompt, 16)[..6].to_vec());
        // A second request with the same prompt finds them in the prefix cache.
        e.submit(1, prompt.clone(), 1);
        e.start_step(&model);
        assert_eq!(e.planner.running().next().unwrap().cached_tokens, 96);
    }

    /// Eight streams decoding when a long prompt arrives: the modelled seconds of each
    /// step that carried decodes after it, and whether the prompt finished.
    fn steps_beside_a_long_prompt(budget: Option<std::time::Duration>) -> (Vec<f64>, bool) {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let opts = EngineOptions {
            step_time_budget: budget,
            ..EngineOptions::default()
        };
        let mut e = SimEngine::new(&opts, 4096, 16384, tx);
        let model = StepModel::new(
            HardwareProfile::named("h100").unwrap(),
            ModelProfile::named("llama-3.1-8b").unwrap(),
            1,
        )
        .unwrap();
        let mut out = StepResult::default();
        for id in 0..8 {
            e.submit(
                id,
                (0..64).map(|i| 1000 + id as u32 * 100 + i).collect(),
                400,
            );
        }
        for _ in 0..20 {
            e.start_step(&model);
            e.finish_step(&mut out);
        }
        e.submit(99, (0..8000).map(|i| 2000 + i).collect(), 1);
        let (mut steps, mut done) = (Vec::new(), false);
        while !done && steps.len() < 300 {
            let Some(t) = e.start_step(&model) else { break };
            steps.push(t);
            e.finish_step(&mut out);
            done = out.finished.iter().any(|s| s.arrival_seq == 99);
        }
        (steps, done)
    }

    #[test]
    fn the_step_time_target_holds_steps_with_decodes_as_in_the_engine() {
        let (off, done_off) = steps_beside_a_long_prompt(None);
        let longest_off = off.iter().copied().fold(0f64, f64::max);
        let target = longest_off / 3.0;
        let (on, done_on) =
            steps_beside_a_long_prompt(Some(std::time::Duration::from_secs_f64(target)));
        assert!(
            done_off && done_on,
            "the long prompt must finish either way"
        );
        // Off, 2048-token chunks set the step; on, the prompt takes more, shorter steps.
        assert!(on.len() > off.len(), "{} vs {} steps", on.len(), off.len());
        // The first chunk is sized by a cost fit that has seen decode steps only; from the
        // second on the fit knows prefill too. Its linear model trails attention's growth
        // with context a little, hence the margin.
        for (i, t) in on.iter().enumerate().skip(1) {
            assert!(
                *t <= target * 1.15,
                "step {i}: {t} s against a {target} s target"
            );
        }
        assert!(on[0] < longest_off / 2.0, "first step {} s", on[0]);
    }
}
