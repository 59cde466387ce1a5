//! Who runs this step: a token budget split between running decodes and (chunked)
//! prefills, block allocation, and preemption by recompute when blocks run out.
//!
//! Each step is planned stall-free, as Sarathi-Serve and vLLM's chunked prefill do: every
//! running decode goes first (one token, plus any speculative proposals); prefills in
//! progress and then waiting sequences (admitted in order: FCFS, or lowest `priority` value
//! first, as vLLM) share what is left. When the step carries decodes, that remainder is
//! also bounded by a step-time target ([`StepBudget`]): a fitted cost model of recent steps
//! turns the target into tokens, so a long prompt arrives in chunks that keep every
//! decode's inter-token gap bounded, while still progressing by at least
//! [`StepBudget::min_prefill_tokens`] every step. A step without decodes stalls no one
//! and takes the whole `max_num_batched_tokens`.
//!
//! When a running sequence cannot get a block, the sequence that should yield (newest under
//! FCFS, the highest `priority` value under the priority policy) is preempted: its blocks
//! are freed and it returns to the front of the queue, to recompute its KV from its tokens
//! when it is admitted again.

mod step_budget;

use std::collections::VecDeque;

use crate::kv::block_pool::{BlockLora, BlockPool, HashKey};
use crate::sequence::Sequence;

pub use step_budget::{StepBudget, StepCost};

/// Computes a full block's prefix-cache hash from its parent's hash, its tokens and the
/// sequence's cache salt (mixed into the first block only). Supplied by the engine so the
/// scheduler stays independent of the hash scheme.
pub type BlockHashFn = Box<dyn Fn(Option<&HashKey>, &[u32], Option<&str>) -> HashKey + Send>;

/// The block hash of a sequence that runs with a LoRA adapter: parent, tokens, the
/// adapter's name (an extra key of every block, as vLLM's), and the salt (first block).
pub type LoraBlockHashFn =
    Box<dyn Fn(Option<&HashKey>, &[u32], &str, Option<&str>) -> HashKey + Send>;

/// Order in which waiting requests are admitted and running ones preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Fcfs,
    Priority,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fcfs" => Ok(Self::Fcfs),
            "priority" => Ok(Self::Priority),
            other => Err(format!(
                "unknown scheduling policy `{other}` (fcfs or priority)"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub policy: Policy,
}

/// One sequence's work in a step: run `num_tokens` tokens from `num_computed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub index: usize,
    pub num_tokens: usize,
}

/// The result of scheduling one step.
#[derive(Debug, Default)]
pub struct StepPlan {
    /// Indices into [`StepPlanner::running`].
    pub work: Vec<Scheduled>,
    pub num_preempted: usize,
    /// Prompt tokens looked up in the prefix cache at admission, and how many were found.
    pub prefix_queries: usize,
    pub prefix_hits: usize,
}

/// The planner owns who waits and who runs: sequences enter through [`StepPlanner::add`]
/// and leave through [`StepPlanner::finish_running`], [`StepPlanner::retire`] (or
/// [`StepPlanner::end_step`]) and [`StepPlanner::take_abandoned`], each releasing the
/// blocks it held exactly once. Callers change a sequence's own state (its tokens, what is
/// computed) through [`StepPlanner::running_mut`], never the queues.
pub struct StepPlanner {
    pub config: SchedulerConfig,
    pub pool: BlockPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// What bounds a step with decodes beside the token budget (none by default; the
    /// engine sets its `--step-time-budget-ms`).
    pub budget: StepBudget,
    hash: Option<BlockHashFn>,
    /// Hashes blocks of sequences with a LoRA adapter; without it their blocks are never
    /// named (so never shared with the base model's or another adapter's).
    lora_hash: Option<LoraBlockHashFn>,
    /// Distinct LoRA adapters among the running sequences at most (`--max-loras`); a
    /// waiting sequence with another adapter is passed over until a slot frees.
    pub max_loras: Option<usize>,
}

impl StepPlanner {
    /// `hash`: the block hash function; `None` disables prefix caching.
    pub fn new(config: SchedulerConfig, num_blocks: usize, hash: Option<BlockHashFn>) -> Self {
        Self {
            config,
            pool: BlockPool::new(num_blocks, hash.is_some()),
            waiting: VecDeque::new(),
            running: Vec::new(),
            budget: StepBudget::default(),
            hash,
            lora_hash: None,
            max_loras: None,
        }
    }

    /// Sets how blocks of sequences with a LoRA adapter are hashed.
    pub fn set_lora_hash(&mut self, f: LoraBlockHashFn) {
        self.lora_hash = Some(f);
    }

    /// Sets the step budget (builder style).
    pub fn with_budget(mut self, budget: StepBudget) -> Self {
        self.budget = budget;
        self
    }

    /// Feeds the cost model: the last step ran `tokens` tokens in `secs` seconds.
    pub fn observe_step(&mut self, tokens: usize, secs: f64) {
        self.budget.cost.observe(tokens, secs);
    }

    /// Extends `seq.block_hashes` to every full block of its tokens. A sequence with an
    /// adapter goes through `lora_hash` (and names no block without one).
    fn update_hashes(
        hash: &BlockHashFn,
        lora_hash: Option<&LoraBlockHashFn>,
        block_size: usize,
        seq: &mut Sequence,
    ) {
        let lora = seq.lora.as_ref().map(|a| a.name.clone());
        if lora.is_some() && lora_hash.is_none() {
            return;
        }
        let full = seq.tokens.len() / block_size;
        while seq.block_hashes.len() < full {
            let i = seq.block_hashes.len();
            let parent = i.checked_sub(1).map(|p| seq.block_hashes[p]);
            let salt = if i == 0 {
                seq.cache_salt.as_deref()
            } else {
                None
            };
            let tokens = &seq.tokens[i * block_size..(i + 1) * block_size];
            let h = match (&lora, lora_hash) {
                (Some(name), Some(lh)) => lh(parent.as_ref(), tokens, name, salt),
                _ => hash(parent.as_ref(), tokens, salt),
            };
            seq.block_hashes.push(h);
        }
    }

    /// Names the blocks that the last step filled, so later requests can share them.
    /// Call after advancing `num_computed`.
    pub fn commit_full_blocks(&mut self) {
        let Some(hash) = &self.hash else { return };
        let bs = self.config.block_size;
        // First hash what filled and start loading where each name goes: a prompt's
        // blocks are committed together, each a miss in the pool.
        for seq in self.running.iter_mut() {
            let full = (seq.num_computed / bs).min(seq.block_table.len());
            if seq.num_committed >= full {
                continue;
            }
            Self::update_hashes(hash, self.lora_hash.as_ref(), bs, seq);
            let full = full.min(seq.block_hashes.len());
            for i in seq.num_committed..full {
                self.pool
                    .prefetch_commit(seq.block_table[i], &seq.block_hashes[i]);
            }
        }
        for seq in self.running.iter_mut() {
            let full = (seq.num_computed / bs).min(seq.block_table.len());
            if seq.num_committed >= full {
                continue;
            }
            let lora = seq.lora.as_ref().map(|a| BlockLora {
                id: i64::from(a.id),
                name: a.name.clone(),
            });
            // Blocks past the hashes (an adapter's, with no way to hash them) stay unnamed.
            let full = full.min(seq.block_hashes.len());
            for i in seq.num_committed..full {
                let parent = i.checked_sub(1).map(|p| seq.block_hashes[p]);
                self.pool.commit_lora(
                    seq.block_table[i],
                    seq.block_hashes[i],
                    parent,
                    &seq.tokens[i * bs..(i + 1) * bs],
                    lora.as_ref(),
                );
            }
            seq.num_committed = seq.num_committed.max(full);
        }
    }

    /// Queues a new sequence.
    pub fn add(&mut self, seq: Sequence) {
        match self.config.policy {
            Policy::Fcfs => self.waiting.push_back(seq),
            Policy::Priority => {
                // vLLM's convention: a lower value runs earlier. Stable: after every
                // waiting sequence with the same or a lower value.
                let at = self
                    .waiting
                    .iter()
                    .position(|w| w.priority > seq.priority)
                    .unwrap_or(self.waiting.len());
                self.waiting.insert(at, seq);
            }
        }
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// The running sequences, oldest admission first; a [`StepPlan`] indexes into them.
    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    /// The running sequences, to advance their tokens and computed counts after a step.
    pub fn running_mut(&mut self) -> &mut [Sequence] {
        &mut self.running
    }

    /// The waiting sequences, next to be admitted first.
    pub fn waiting(&self) -> &VecDeque<Sequence> {
        &self.waiting
    }

    /// The waiting sequences, to change their own state (their place stays the planner's).
    pub fn waiting_mut(&mut self) -> impl Iterator<Item = &mut Sequence> {
        self.waiting.iter_mut()
    }

    fn blocks_needed(&self, seq: &Sequence, num_tokens: usize) -> usize {
        let need = (seq.num_computed + num_tokens).div_ceil(self.config.block_size);
        need.saturating_sub(seq.block_table.len())
    }

    /// Index of the running sequence that should give way first.
    fn victim(&self) -> Option<usize> {
        let key = |s: &Sequence| match self.config.policy {
            Policy::Fcfs => (0, s.arrival_seq),
            // the highest value (least urgent) yields first, the newest among equals
            Policy::Priority => (s.priority as i64, s.arrival_seq),
        };
        (0..self.running.len()).max_by_key(|&i| key(&self.running[i]))
    }

    /// Frees a running sequence's blocks and sends it back to the front of the queue.
    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        self.pool.release(&seq.block_table);
        seq.block_table.clear();
        seq.num_computed = 0;
        seq.num_committed = 0;
        self.waiting.push_front(seq);
    }

    /// After speculation rolled `running[index]` back: frees the blocks past what its
    /// computed positions need (the rejected proposals' slots) and forgets block hashes
    /// past its tokens. The next step allocates again what the pending token needs.
    pub fn release_unneeded_blocks(&mut self, index: usize) {
        let bs = self.config.block_size;
        let seq = &mut self.running[index];
        let keep = seq.num_computed.div_ceil(bs).max(seq.num_committed);
        if seq.block_table.len() > keep {
            let freed = seq.block_table.split_off(keep);
            self.pool.release(&freed);
        }
        seq.block_hashes.truncate(seq.tokens.len() / bs);
    }

    /// Removes and returns a running sequence, freeing its blocks.
    pub fn finish_running(&mut self, index: usize) -> Sequence {
        let seq = self.running.remove(index);
        self.pool.release(&seq.block_table);
        seq
    }

    /// The after-step rule, the same in the engine and the simulator: first name the
    /// blocks this step filled ([`Self::commit_full_blocks`]), so a finishing sequence's
    /// last blocks are cached before it lets them go; then [`Self::retire`] the finished.
    pub fn end_step<T, K>(
        &mut self,
        finished: &mut Vec<(usize, T)>,
        keep: impl FnMut(&mut BlockPool, &Sequence, &T) -> K,
    ) -> Vec<(Sequence, T, K)> {
        self.commit_full_blocks();
        self.retire(finished, keep)
    }

    /// Removes the running sequences at the indices of `finished` (emptied), highest index
    /// first so the indices still to go stay valid, freeing their blocks. `keep` sees each
    /// one while its blocks are still held (the engine pins a prefill's prompt blocks
    /// there); each comes back with its tag and what `keep` returned, in that order.
    pub fn retire<T, K>(
        &mut self,
        finished: &mut Vec<(usize, T)>,
        mut keep: impl FnMut(&mut BlockPool, &Sequence, &T) -> K,
    ) -> Vec<(Sequence, T, K)> {
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        let mut out = Vec::with_capacity(finished.len());
        for (i, tag) in finished.drain(..) {
            let kept = keep(&mut self.pool, &self.running[i], &tag);
            out.push((self.finish_running(i), tag, kept));
        }
        out
    }

    /// Removes every sequence whose submitter went away (running ones first, freeing
    /// their blocks, then waiting ones), in queue order.
    pub fn take_abandoned(&mut self) -> Vec<Sequence> {
        let mut gone = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].is_abandoned() {
                gone.push(self.finish_running(i));
            } else {
                i += 1;
            }
        }
        if self.waiting.iter().any(Sequence::is_abandoned) {
            let (lost, kept): (VecDeque<Sequence>, VecDeque<Sequence>) =
                std::mem::take(&mut self.waiting)
                    .into_iter()
                    .partition(Sequence::is_abandoned);
            self.waiting = kept;
            gone.extend(lost);
        }
        gone
    }

    /// Empties the queue of waiting sequences (they hold no blocks).
    #[cfg(test)]
    pub(crate) fn clear_waiting(&mut self) {
        self.waiting.clear();
    }

    /// Whether a running sequence only continues its output this step (one pending token
    /// plus its unverified proposals), as opposed to computing a prompt, or recomputing
    /// one after preemption.
    fn is_decode(seq: &Sequence) -> bool {
        seq.num_computed >= seq.prompt_len && seq.num_pending() <= 1 + seq.num_draft
    }

    /// Tokens planned so far for running sequences of one kind.
    fn planned(&self, plan: &StepPlan, decodes: bool) -> usize {
        plan.work
            .iter()
            .filter(|w| Self::is_decode(&self.running[w.index]) == decodes)
            .map(|w| w.num_tokens)
            .sum()
    }

    /// Plans the running sequences of one kind (decodes, or prefills in progress), oldest
    /// first, within `limit` tokens for that kind, preempting when blocks run out.
    /// Returns the tokens planned for that kind.
    fn continue_running(&mut self, plan: &mut StepPlan, decodes: bool, limit: usize) -> usize {
        let mut used = self.planned(plan, decodes);
        let mut i = 0;
        while i < self.running.len() {
            if Self::is_decode(&self.running[i]) != decodes {
                i += 1;
                continue;
            }
            if used >= limit {
                break;
            }
            let num_tokens = self.running[i].num_pending().min(limit - used);
            let need = self.blocks_needed(&self.running[i], num_tokens);
            if need > self.pool.num_free() {
                let Some(v) = self.victim() else { break };
                // Drop any work already planned for sequences that move.
                plan.work.retain(|w| w.index != v);
                for w in plan.work.iter_mut() {
                    if w.index > v {
                        w.index -= 1;
                    }
                }
                self.preempt(v);
                plan.num_preempted += 1;
                // Give back the budget of the victim's planned work.
                used = self.planned(plan, decodes);
                if v < i {
                    i -= 1;
                }
                continue; // retry `i` (or whoever now sits there) with more free blocks
            }
            if self
                .pool
                .allocate_into(need, &mut self.running[i].block_table)
            {
                plan.work.push(Scheduled {
                    index: i,
                    num_tokens,
                });
                used += num_tokens;
            }
            i += 1;
        }
        used
    }

    /// Plans one step.
    pub fn schedule(&mut self) -> StepPlan {
        self.schedule_with(&mut |_, seq| seq.imported.clear())
    }

    /// [`Self::schedule`], calling `install` for each sequence about to be admitted that
    /// carries imported blocks (its hashes are up to date), right before its prefix-cache
    /// lookup: whatever `install` names in the pool is taken as prefix hits. `install`
    /// must leave every block it allocates free (released) or cached. The blocks are
    /// offered once: whatever is left in `seq.imported` afterwards is dropped.
    pub fn schedule_with(
        &mut self,
        install: &mut dyn FnMut(&mut BlockPool, &mut Sequence),
    ) -> StepPlan {
        // Room for every sequence the step can carry, so the list is not regrown step by
        // step as it fills.
        let mut plan = StepPlan {
            work: Vec::with_capacity(
                (self.running.len() + self.waiting.len()).min(self.config.max_num_seqs),
            ),
            ..StepPlan::default()
        };
        let cap = self.config.max_num_batched_tokens;

        // 1. Running decodes continue first, oldest first: no prefill delays them.
        let decode_tokens = self.continue_running(&mut plan, true, cap);

        // 2. Prefills in progress, then new admissions, share what is left of the token
        //    budget, and, beside decodes, of the step-time target.
        let limit = self
            .budget
            .prefill_tokens(decode_tokens, cap.saturating_sub(decode_tokens));
        let prefill_tokens = self.continue_running(&mut plan, false, limit);
        let mut budget = limit.saturating_sub(prefill_tokens);

        // 3. Admit waiting sequences while there is budget, a slot and blocks.
        //    Nothing is admitted in a step that had to preempt.
        // A sequence whose adapter would exceed `max_loras` is set aside (keeping its place)
        // and the ones behind it are still considered, as vLLM's scheduler does.
        let mut deferred: Vec<Sequence> = Vec::new();
        let mut loras = self.running_loras();
        while plan.num_preempted == 0 && budget > 0 && self.running.len() < self.config.max_num_seqs
        {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if let (Some(max), Some(a)) = (self.max_loras, &seq.lora) {
                if !loras.contains(&a.name) {
                    if loras.len() >= max {
                        deferred.push(seq);
                        continue;
                    }
                    loras.push(a.name.clone());
                }
            }
            // Take the cached prefix, always leaving at least one token to compute so the
            // step yields logits.
            let mut hits = 0;
            if let Some(hash) = &self.hash {
                let lora_hash = self.lora_hash.as_ref();
                Self::update_hashes(hash, lora_hash, self.config.block_size, &mut seq);
                if !seq.imported.is_empty() {
                    install(&mut self.pool, &mut seq);
                }
                let max_blocks =
                    ((seq.tokens.len() - 1) / self.config.block_size).min(seq.block_hashes.len());
                hits = self.pool.count_hits(&seq.block_hashes[..max_blocks]);
            }
            // Offered once: whatever was not installed (or without prefix caching, all of
            // it) is dropped rather than kept with the queued sequence.
            if !seq.imported.is_empty() {
                seq.imported = Vec::new();
            }
            let cached = self.pool.acquire_cached(&seq.block_hashes[..hits]);
            seq.block_table = cached;
            seq.num_computed = hits * self.config.block_size;
            let num_tokens = seq.num_pending().min(budget);
            let need = self.blocks_needed(&seq, num_tokens);
            if !self.pool.allocate_into(need, &mut seq.block_table) {
                self.pool.release(&seq.block_table);
                seq.block_table.clear();
                seq.num_computed = 0;
                self.waiting.push_front(seq);
                break;
            }
            seq.num_committed = hits;
            if !seq.admitted_once {
                seq.admitted_once = true;
                seq.cached_tokens = seq.num_computed;
                seq.imported_tokens =
                    seq.installed.iter().filter(|&&i| i < hits).count() * self.config.block_size;
                plan.prefix_queries += seq.prompt_len;
                plan.prefix_hits += seq.num_computed;
            }
            self.running.push(seq);
            plan.work.push(Scheduled {
                index: self.running.len() - 1,
                num_tokens,
            });
            budget -= num_tokens;
        }
        for seq in deferred.into_iter().rev() {
            self.waiting.push_front(seq);
        }
        plan
    }

    /// The distinct adapters of the running sequences, in order of first appearance.
    pub fn running_loras(&self) -> Vec<String> {
        distinct_loras(self.running.iter())
    }

    /// The distinct adapters of the waiting sequences.
    pub fn waiting_loras(&self) -> Vec<String> {
        distinct_loras(self.waiting.iter())
    }
}

fn distinct_loras<'a>(seqs: impl Iterator<Item = &'a Sequence>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in seqs {
        if let Some(a) = &s.lora {
            if !out.contains(&a.name) {
                out.push(a.name.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::step_budget::linear_cost;
    use super::*;
    use crate::sampler::{Sampler, SamplingConfig};
    use crate::sequence::GenerationRequest;
    use std::time::Duration;

    fn seq(id: u64, priority: i32, prompt_len: usize) -> Sequence {
        let (events, _rx) = tokio::sync::mpsc::unbounded_channel();
        let req = GenerationRequest {
            request_id: id.to_string(),
            prompt: vec![1; prompt_len],
            sampling: SamplingConfig::default(),
            max_tokens: 8,
            stop: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            priority,
            cache_salt: None,
            arrival: std::time::Instant::now(),
            events,
            grammar: None,
            speculative: true,
            lora: None,
            imported: Vec::new(),
            pin: None,
        };
        Sequence::new(req, Sampler::new(SamplingConfig::default(), 0), id)
    }

    fn config(policy: Policy, max_num_seqs: usize) -> SchedulerConfig {
        SchedulerConfig {
            block_size: 4,
            max_num_seqs,
            max_num_batched_tokens: 64,
            policy,
        }
    }

    #[test]
    fn max_loras_defers_other_adapters_in_place_and_keeps_their_blocks_apart() {
        use crate::lora::adapter::tests::{tiny_base, tmp, write_adapter};
        use std::sync::Arc;
        let dir = tmp("sched");
        write_adapter(&dir, 2, false);
        let load = |name: &str| {
            let mut a = crate::lora::LoraAdapter::load_peft(name, &dir, &tiny_base(), 8).unwrap();
            a.id = 1;
            Arc::new(a)
        };
        let (a, b) = (load("a"), load("b"));
        let with = |id: u64, lora: Option<&Arc<crate::lora::LoraAdapter>>| {
            let mut q = seq(id, 0, 8);
            q.lora = lora.cloned();
            q
        };
        // Hash = the first token plus a mark of the adapter, so equal prompts differ.
        let hash: BlockHashFn = Box::new(|_, t, _| {
            let mut h = [0u8; 32];
            h[0] = t[0] as u8;
            h
        });
        let mut s = StepPlanner::new(config(Policy::Fcfs, 8), 32, Some(hash));
        s.set_lora_hash(Box::new(|_, t, name, _| {
            let mut h = [0u8; 32];
            h[0] = t[0] as u8;
            h[1] = name.as_bytes()[0];
            h
        }));
        s.max_loras = Some(1);
        s.add(with(0, Some(&a)));
        s.add(with(1, Some(&b)));
        s.add(with(2, None));
        s.add(with(3, Some(&a)));
        s.schedule();
        // One adapter slot: `b` waits, keeping its place; the base and `a` run.
        let running: Vec<u64> = s.running.iter().map(|q| q.arrival_seq).collect();
        assert_eq!(running, vec![0, 2, 3]);
        let waiting: Vec<u64> = s.waiting.iter().map(|q| q.arrival_seq).collect();
        assert_eq!(waiting, vec![1]);
        assert_eq!(s.running_loras(), vec!["a".to_string()]);
        assert_eq!(s.waiting_loras(), vec!["b".to_string()]);
        // The same prompt under the base and under `a` hashes apart.
        assert_ne!(s.running[0].block_hashes[0], s.running[1].block_hashes[0]);
        assert_eq!(s.running[0].block_hashes[0], s.running[2].block_hashes[0]);
        // When `a`'s sequences finish, `b` gets the slot.
        s.finish_running(2);
        s.finish_running(0);
        s.schedule();
        assert_eq!(s.running_loras(), vec!["b".to_string()]);
        assert!(s.waiting.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A sequence whose submitter is still listening (the receiver is returned).
    fn live(
        id: u64,
        prompt_len: usize,
    ) -> (
        Sequence,
        tokio::sync::mpsc::UnboundedReceiver<crate::sequence::SeqEvent>,
    ) {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut q = seq(id, 0, prompt_len);
        q.events = events;
        (q, rx)
    }

    #[test]
    fn a_step_ends_by_naming_its_blocks_then_retiring_the_finished_highest_index_first() {
        // Blocks of 4 tokens, named by their first token and their parent's.
        let hash: BlockHashFn = Box::new(|parent, t, _| {
            let mut h = [0u8; 32];
            h[0] = t[0] as u8;
            h[1] = parent.map_or(0, |p| p[0]);
            h
        });
        let mut s = StepPlanner::new(config(Policy::Fcfs, 4), 8, Some(hash));
        for id in 0..3u32 {
            let mut q = seq(u64::from(id), 0, 8);
            q.tokens = (0..8).map(|t| id * 10 + t + 1).collect();
            s.add(q);
        }
        let plan = s.schedule();
        assert_eq!(plan.work.len(), 3);
        run(&mut s, &plan);
        assert_eq!(s.pool.num_free(), 2);
        // 0 and 2 finish. Each is seen with its blocks held and already named.
        let mut finished = vec![(0, 'a'), (2, 'c')];
        let retired = s.end_step(&mut finished, |pool, q, tag| {
            let held = q.block_table.iter().all(|&b| pool.ref_count(b) == 1);
            (*tag, held, pool.count_hits(&q.block_hashes))
        });
        assert!(finished.is_empty());
        let order: Vec<(u64, char)> = retired
            .iter()
            .map(|(q, t, _)| (q.arrival_seq, *t))
            .collect();
        assert_eq!(order, vec![(2, 'c'), (0, 'a')]);
        assert!(retired.iter().all(|(_, t, kept)| *kept == (*t, true, 2)));
        // Their blocks are free and stay cached; the survivor keeps its own.
        assert_eq!(s.running().len(), 1);
        assert_eq!(s.running()[0].arrival_seq, 1);
        assert_eq!(s.pool.num_free(), 6);
        for (q, _, _) in &retired {
            assert_eq!(s.pool.count_hits(&q.block_hashes), 2);
        }
    }

    #[test]
    fn abandoned_sequences_leave_both_queues_in_order_and_free_their_blocks() {
        let mut s = StepPlanner::new(config(Policy::Fcfs, 3), 16, None);
        let (b, _rx_b) = live(1, 4);
        let (e, _rx_e) = live(4, 4);
        s.add(seq(0, 0, 4));
        s.add(b);
        s.add(seq(2, 0, 4));
        s.add(seq(3, 0, 4));
        s.add(e);
        s.schedule();
        assert_eq!(s.running().len(), 3);
        assert_eq!(s.pool.num_free(), 13);
        let gone: Vec<u64> = s.take_abandoned().iter().map(|q| q.arrival_seq).collect();
        assert_eq!(gone, vec![0, 2, 3]);
        let running: Vec<u64> = s.running().iter().map(|q| q.arrival_seq).collect();
        assert_eq!(running, vec![1]);
        let waiting: Vec<u64> = s.waiting().iter().map(|q| q.arrival_seq).collect();
        assert_eq!(waiting, vec![4]);
        assert_eq!(s.pool.num_free(), 15);
        assert!(s.take_abandoned().is_empty());
    }

    #[test]
    fn rolled_back_proposals_give_their_blocks_back() {
        // Blocks of 4 tokens. A 6-token prompt, computed, with a sampled token pending and
        // 5 proposals: 12 tokens planned, 3 blocks.
        let mut s = StepPlanner::new(config(Policy::Fcfs, 4), 8, None);
        s.add(seq(0, 0, 6));
        s.schedule();
        let q = &mut s.running[0];
        q.num_computed = 6;
        q.tokens.push(7);
        q.tokens.extend([1, 2, 3, 4, 5]);
        q.num_draft = 5;
        let plan = s.schedule();
        assert_eq!(plan.work[0].num_tokens, 6);
        assert_eq!(s.running[0].block_table.len(), 3);
        // One proposal accepted: positions 0..8 hold valid keys and values.
        let q = &mut s.running[0];
        q.drop_drafts();
        q.num_computed = 8;
        q.tokens.extend([1, 9]);
        s.release_unneeded_blocks(0);
        assert_eq!(s.running[0].block_table.len(), 2);
        assert_eq!(s.pool.num_free(), 6);
        // Nothing to give back twice; finishing frees the rest.
        s.release_unneeded_blocks(0);
        assert_eq!(s.pool.num_free(), 6);
        s.finish_running(0);
        assert_eq!(s.pool.num_free(), 8);
    }

    #[test]
    fn priority_policy_admits_lower_values_first_and_fcfs_among_equals() {
        let mut s = StepPlanner::new(config(Policy::Priority, 2), 16, None);
        s.add(seq(0, 5, 4));
        s.add(seq(1, -1, 4));
        s.add(seq(2, 5, 4));
        s.add(seq(3, 0, 4));
        let plan = s.schedule();
        assert_eq!(plan.work.len(), 2);
        let admitted: Vec<u64> = s.running.iter().map(|q| q.arrival_seq).collect();
        assert_eq!(admitted, vec![1, 3]);
        let waiting: Vec<u64> = s.waiting.iter().map(|q| q.arrival_seq).collect();
        assert_eq!(waiting, vec![0, 2]);
    }

    #[test]
    fn preemption_picks_the_newest_under_fcfs_and_the_least_urgent_under_priority() {
        for (policy, victim) in [(Policy::Fcfs, 2), (Policy::Priority, 0)] {
            // 6 blocks of 4 tokens; three prompts of 8 tokens take all 6 blocks.
            let mut s = StepPlanner::new(config(policy, 8), 6, None);
            s.add(seq(0, 9, 8));
            s.add(seq(1, 0, 8));
            s.add(seq(2, 1, 8));
            let plan = s.schedule();
            assert_eq!(plan.work.len(), 3, "{policy:?}");
            for q in s.running.iter_mut() {
                q.num_computed = q.tokens.len();
                q.tokens.push(7); // a sampled token: each now needs a third block
            }
            let plan = s.schedule();
            assert!(plan.num_preempted >= 1, "{policy:?}");
            assert_eq!(
                s.waiting.front().map(|q| q.arrival_seq),
                Some(victim),
                "{policy:?}"
            );
            assert_eq!(
                s.pool.num_free() + s.running.iter().map(|q| q.block_table.len()).sum::<usize>(),
                6
            );
        }
    }

    /// Runs a plan as the engine would: computes the planned tokens and, for a sequence
    /// whose pending tokens are all computed, samples one more.
    fn run(s: &mut StepPlanner, plan: &StepPlan) {
        for w in &plan.work {
            let q = &mut s.running[w.index];
            q.num_computed += w.num_tokens;
            if q.num_computed == q.tokens.len() {
                q.tokens.push(7);
            }
        }
    }

    fn budget_config(max_num_batched_tokens: usize) -> SchedulerConfig {
        SchedulerConfig {
            block_size: 16,
            max_num_seqs: 16,
            max_num_batched_tokens,
            policy: Policy::Fcfs,
        }
    }

    #[test]
    fn decodes_are_planned_before_a_prefill_in_progress() {
        // The oldest running sequence is 32 tokens into a 200-token prompt; four younger
        // ones decode. A budget of 20 tokens: every decode runs, the prompt gets the rest
        // (planned oldest-first as before, the prompt would take all 20).
        let mut s = StepPlanner::new(budget_config(20), 64, None);
        let mut long = seq(0, 0, 200);
        long.num_computed = 32;
        long.block_table = s.pool.allocate(2).expect("free blocks");
        s.running.push(long);
        for id in 1..5 {
            let mut q = seq(id, 0, 2);
            q.num_computed = 2;
            q.tokens.push(7);
            q.block_table = s.pool.allocate(1).expect("free blocks");
            s.running.push(q);
        }
        let plan = s.schedule();
        assert_eq!(plan.work.len(), 5, "{plan:?}");
        assert!(plan.work[..4]
            .iter()
            .all(|w| w.index > 0 && w.num_tokens == 1));
        assert_eq!(
            plan.work[4],
            Scheduled {
                index: 0,
                num_tokens: 16
            }
        );
        // A decode with speculative proposals counts as a decode too.
        run(&mut s, &plan);
        let q = &mut s.running[1];
        q.tokens.extend([1, 2, 3]);
        q.num_draft = 3;
        let plan = s.schedule();
        assert_eq!(
            plan.work[0],
            Scheduled {
                index: 1,
                num_tokens: 4
            }
        );
        assert_eq!(
            plan.work.last(),
            Some(&Scheduled {
                index: 0,
                num_tokens: 13
            })
        );
    }

    #[test]
    fn a_step_time_target_bounds_the_prefill_beside_decodes() {
        let mut s = StepPlanner::new(budget_config(2048), 512, None).with_budget(StepBudget {
            target: Some(Duration::from_millis(100)),
            min_prefill_tokens: 8,
            cost: linear_cost(),
        });
        for id in 0..4 {
            s.add(seq(id, 0, 3));
        }
        let plan = s.schedule();
        run(&mut s, &plan);
        // Four decoding now; a 1,000-token prompt arrives.
        s.add(seq(9, 0, 1000));
        let plan = s.schedule();
        let total: usize = plan.work.iter().map(|w| w.num_tokens).sum();
        // 10 ms + 1 ms per token within 100 ms: 90 tokens, 4 of them decodes.
        assert_eq!(total, 90, "{plan:?}");
        assert_eq!(plan.work.iter().filter(|w| w.num_tokens == 1).count(), 4);
        // Without decodes the same prompt would take the whole token budget.
        let mut alone = StepPlanner::new(budget_config(2048), 512, None).with_budget(StepBudget {
            target: Some(Duration::from_millis(100)),
            min_prefill_tokens: 8,
            cost: linear_cost(),
        });
        alone.add(seq(9, 0, 1000));
        assert_eq!(alone.schedule().work[0].num_tokens, 1000);
    }

    #[test]
    fn a_long_prompt_progresses_every_step_under_full_decode_load() {
        // The decodes alone exceed the target (10 ms + 1 ms per token, target 12 ms, 16
        // decodes): the prompt still gets its minimum every step and finishes.
        let mut s = StepPlanner::new(budget_config(2048), 512, None).with_budget(StepBudget {
            target: Some(Duration::from_millis(12)),
            min_prefill_tokens: 32,
            cost: linear_cost(),
        });
        for id in 0..15 {
            s.add(seq(id, 0, 2));
        }
        let plan = s.schedule();
        run(&mut s, &plan);
        s.add(seq(99, 0, 300));
        let mut steps = 0;
        loop {
            let plan = s.schedule();
            steps += 1;
            let decodes = plan.work.iter().filter(|w| w.num_tokens == 1).count();
            assert_eq!(decodes, 15, "every decode runs every step");
            let before = s.running.last().map(|q| q.num_computed).unwrap_or(0);
            run(&mut s, &plan);
            let q = s.running.last().expect("the prompt is running");
            if q.num_computed >= q.prompt_len {
                break;
            }
            assert_eq!(q.num_computed - before, 32, "step {steps}");
            assert!(steps < 20);
        }
        // 300 tokens in chunks of 32: ten steps (the last one of 12 tokens).
        assert_eq!(steps, 10);
    }

    #[test]
    fn without_a_target_the_token_budget_alone_bounds_a_step() {
        let mut s = StepPlanner::new(budget_config(64), 512, None);
        s.add(seq(0, 0, 2));
        let plan = s.schedule();
        run(&mut s, &plan);
        s.observe_step(2, 1.0); // ignored without a target
        s.add(seq(1, 0, 500));
        let plan = s.schedule();
        assert_eq!(plan.work.iter().map(|w| w.num_tokens).sum::<usize>(), 64);
        // With a target but nothing measured yet: the token budget too.
        s.budget.target = Some(Duration::from_millis(1));
        s.budget.cost = StepCost::default();
        let plan = s.schedule();
        assert_eq!(plan.work.iter().map(|w| w.num_tokens).sum::<usize>(), 64);
    }
}
