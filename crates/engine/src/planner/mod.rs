//! The step planner: who runs this step. A token budget split between running decodes and
//! (chunked) prefills, block allocation, and preemption by recompute when blocks run out.
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
//!
//! # The contract
//!
//! The engine loop and the simulator drive the planner the same way, through the same
//! methods:
//! 1. [`StepPlanner::add`] queues a sequence;
//! 2. [`StepPlanner::plan`] (or [`StepPlanner::plan_with`]) returns a [`StepPlan`] that
//!    names each sequence by its [`SeqId`], stable from admission until the sequence leaves
//!    the running set, so nothing the planner does to other sequences (preempting,
//!    retiring) changes what a plan's ids name;
//! 3. the caller runs the plan, reaching each sequence through [`StepPlanner::seq_mut`]
//!    (or [`StepPlanner::slots_mut`] for work done on all of them at once) to advance its
//!    tokens and computed count, and feeds the step's cost back
//!    ([`StepPlanner::observe_step`]);
//! 4. [`StepPlanner::commit_and_retire`] names the blocks the step filled and retires the
//!    sequences that finished.
//!
//! Sequences leave only through [`StepPlanner::commit_and_retire`],
//! [`StepPlanner::retire`], [`StepPlanner::finish`] and [`StepPlanner::take_abandoned`],
//! each releasing the blocks it held exactly once. The block pool is the planner's own:
//! callers read and change the prefix cache through the named methods below (sizes, KV
//! events, evictions, export, reset), and it is lent out at two moments only, each with
//! its duty written at the method: admission's `install` hook ([`StepPlanner::plan_with`])
//! and retirement's `keep` hook ([`StepPlanner::retire`]).

mod step_budget;

use std::collections::VecDeque;

use crate::kv::block_pool::{BlockLora, BlockPool, EvictedBlock, HashKey, PoolEvent};
use crate::options::EngineOptions;
use crate::sequence::Sequence;

pub use step_budget::{StepBudget, StepCost};

/// Computes a full block's prefix-cache hash from its parent's hash, its tokens and the
/// sequence's cache salt (mixed into the first block only). Supplied by the engine so the
/// planner stays independent of the hash scheme.
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

/// A running sequence's name: given at admission, it names the same sequence until that
/// sequence leaves the running set (finished, preempted or abandoned); a later admission
/// may then get it. Ids are small (below [`StepPlanner::id_bound`]), so per-sequence
/// scratch of a step can be a plain vector indexed by [`SeqId::index`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId(u32);

impl SeqId {
    /// The id as an index into per-id scratch (and [`StepPlanner::slots_mut`]).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One entry of the table of running sequences ([`StepPlanner::slots_mut`]): the sequence
/// an id names, or, for an id not in use, a link of the list of free entries. Callers can
/// change the sequence, never which sequence the entry holds.
pub struct Slot(Entry);

enum Entry {
    Running(Sequence),
    /// Not in use; the next free entry's id ([`NO_ID`]: none).
    Free(u32),
}

/// The end of the free list.
const NO_ID: u32 = u32::MAX;

impl Slot {
    /// The sequence this entry's id names, if the id is in use.
    pub fn seq_mut(&mut self) -> Option<&mut Sequence> {
        match &mut self.0 {
            Entry::Running(seq) => Some(seq),
            Entry::Free(_) => None,
        }
    }

    fn seq(&self) -> Option<&Sequence> {
        match &self.0 {
            Entry::Running(seq) => Some(seq),
            Entry::Free(_) => None,
        }
    }
}

/// One sequence's work in a step: run `num_tokens` tokens from its `num_computed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqWork {
    pub id: SeqId,
    pub num_tokens: usize,
}

/// The result of planning one step.
#[derive(Debug, Default)]
pub struct StepPlan {
    /// Each planned sequence once: running decodes (oldest admission first), then prefills
    /// in progress, then this step's admissions.
    pub work: Vec<SeqWork>,
    pub num_preempted: usize,
    /// Prompt tokens looked up in the prefix cache at admission, and how many were found.
    pub prefix_queries: usize,
    pub prefix_hits: usize,
}

/// The planner owns who waits, who runs, and the blocks they hold (see the module doc for
/// the contract its callers keep).
pub struct StepPlanner {
    /// The settings it plans with (from [`EngineOptions`]).
    block_size: usize,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    policy: Policy,
    /// Distinct LoRA adapters among the running sequences at most (`--max-loras`); a
    /// waiting sequence with another adapter is passed over until a slot frees.
    max_loras: Option<usize>,
    /// What bounds a step with decodes beside the token budget (`--step-time-budget-ms`).
    budget: StepBudget,
    hash: Option<BlockHashFn>,
    /// Hashes blocks of sequences with a LoRA adapter; without it their blocks are never
    /// named (so never shared with the base model's or another adapter's).
    lora_hash: Option<LoraBlockHashFn>,
    /// Every block is held by the running sequences whose tables list it (one reference
    /// per listing) or by whoever took a reference through the `keep` hook and gives it
    /// back with [`StepPlanner::release_held`]; a block nobody holds is free.
    pool: BlockPool,
    /// Waiting sequences, next to be admitted first. A waiting sequence holds no block and
    /// has nothing computed (a preempted one gave both up).
    waiting: VecDeque<Sequence>,
    /// The running sequences by id: `slots[id]` holds the sequence `id` names. An id is in
    /// use exactly when its slot holds a sequence, and then it is in `order` once; every
    /// other slot is on the free list from `first_free` once. The free list lives in the
    /// free slots themselves, so giving an id and taking one back touch only the slot.
    slots: Vec<Slot>,
    /// The ids in use, oldest admission first: the order of every walk over the running
    /// sequences (what the budget goes to first, and the order retirement reverses). At
    /// most `max_num_seqs` long.
    order: Vec<SeqId>,
    /// The first free slot's id ([`NO_ID`]: none); the last one freed, given first.
    first_free: u32,
}

impl StepPlanner {
    /// A planner over a pool of `num_blocks` blocks, with `opts`'s block size, batch
    /// limits, admission policy, step-time target and LoRA limit. `hash`: the block hash
    /// function; `None` disables prefix caching.
    pub fn new(opts: &EngineOptions, num_blocks: usize, hash: Option<BlockHashFn>) -> Self {
        Self {
            block_size: opts.block_size,
            max_num_seqs: opts.max_num_seqs,
            max_num_batched_tokens: opts.max_num_batched_tokens,
            policy: opts.policy,
            max_loras: opts.lora.as_ref().map(|l| l.max_loras),
            budget: StepBudget::new(opts.step_time_budget),
            pool: BlockPool::new(num_blocks, hash.is_some()),
            hash,
            lora_hash: None,
            waiting: VecDeque::new(),
            slots: Vec::new(),
            order: Vec::new(),
            first_free: NO_ID,
        }
    }

    /// Sets how blocks of sequences with a LoRA adapter are hashed.
    pub fn set_lora_hash(&mut self, f: LoraBlockHashFn) {
        self.lora_hash = Some(f);
    }

    /// Replaces the step budget (builder style).
    #[cfg(test)]
    pub(crate) fn with_budget(mut self, budget: StepBudget) -> Self {
        self.budget = budget;
        self
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// `--max-loras`, when LoRA is on.
    pub fn max_loras(&self) -> Option<usize> {
        self.max_loras
    }

    // Sequences: the queues and the running set.

    /// Queues a new sequence.
    pub fn add(&mut self, seq: Sequence) {
        match self.policy {
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
        !self.waiting.is_empty() || !self.order.is_empty()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.order.len()
    }

    /// The running sequences, oldest admission first.
    pub fn running(&self) -> impl ExactSizeIterator<Item = &Sequence> + DoubleEndedIterator + '_ {
        self.order.iter().map(|&id| seq_in(&self.slots, id))
    }

    /// The ids of the running sequences, oldest admission first.
    pub fn running_ids(&self) -> impl ExactSizeIterator<Item = SeqId> + '_ {
        self.order.iter().copied()
    }

    /// The running sequences in no particular order, to change their own state (their
    /// tokens, what is computed); which sequences run stays the planner's.
    pub fn running_mut(&mut self) -> impl Iterator<Item = &mut Sequence> {
        self.slots.iter_mut().filter_map(Slot::seq_mut)
    }

    /// The waiting sequences, to change their own state (their place stays the planner's).
    pub fn waiting_mut(&mut self) -> impl Iterator<Item = &mut Sequence> {
        self.waiting.iter_mut()
    }

    /// The running sequence `id` names.
    ///
    /// # Panics
    /// When `id` names no running sequence (it left the running set since it was planned).
    pub fn seq(&self, id: SeqId) -> &Sequence {
        seq_in(&self.slots, id)
    }

    /// [`Self::seq`], to change the sequence's own state.
    ///
    /// # Panics
    /// As [`Self::seq`].
    pub fn seq_mut(&mut self, id: SeqId) -> &mut Sequence {
        match self.slots[id.index()].seq_mut() {
            Some(seq) => seq,
            None => not_running(id),
        }
    }

    /// Every id in use is below this: per-id scratch this long covers every running
    /// sequence.
    pub fn id_bound(&self) -> usize {
        self.slots.len()
    }

    /// The running sequences by id (entry [`SeqId::index`]), for work done on each of them
    /// at once, in parallel (sampling).
    pub fn slots_mut(&mut self) -> &mut [Slot] {
        &mut self.slots
    }

    /// The distinct adapters of the running sequences, in order of first appearance.
    pub fn running_loras(&self) -> Vec<String> {
        distinct_loras(self.running())
    }

    /// The distinct adapters of the waiting sequences.
    pub fn waiting_loras(&self) -> Vec<String> {
        distinct_loras(self.waiting.iter())
    }

    /// Places `seq` in the running set and gives it an id (the last one freed, or a new
    /// one).
    fn admit(&mut self, seq: Sequence) -> SeqId {
        let id = if self.first_free == NO_ID {
            // A new slot: at most `max_num_seqs` are ever made.
            self.slots.push(Slot(Entry::Running(seq)));
            SeqId((self.slots.len() - 1) as u32)
        } else {
            let id = SeqId(self.first_free);
            let slot = &mut self.slots[id.index()];
            let Entry::Free(next) = &slot.0 else {
                panic!("the free list holds {id:?}, which runs")
            };
            self.first_free = *next;
            slot.0 = Entry::Running(seq);
            id
        };
        self.order.push(id);
        id
    }

    /// Takes the running sequence at `order[at]` out of the running set, freeing its id
    /// (not its blocks).
    fn remove_at(&mut self, at: usize) -> Sequence {
        let id = self.order.remove(at);
        let entry = std::mem::replace(&mut self.slots[id.index()].0, Entry::Free(self.first_free));
        self.first_free = id.0;
        match entry {
            Entry::Running(seq) => seq,
            Entry::Free(_) => not_running(id),
        }
    }

    /// [`Self::remove_at`] by id.
    fn remove(&mut self, id: SeqId) -> Sequence {
        match self.order.iter().position(|&o| o == id) {
            Some(at) => self.remove_at(at),
            None => not_running(id),
        }
    }

    /// Removes and returns a running sequence, freeing its blocks.
    pub fn finish(&mut self, id: SeqId) -> Sequence {
        let seq = self.remove(id);
        self.pool.release(&seq.block_table);
        seq
    }

    /// Removes every sequence whose submitter went away (running ones first, freeing
    /// their blocks, then waiting ones), in queue order.
    pub fn take_abandoned(&mut self) -> Vec<Sequence> {
        let mut gone = Vec::new();
        let mut at = 0;
        while at < self.order.len() {
            if seq_in(&self.slots, self.order[at]).is_abandoned() {
                let seq = self.remove_at(at);
                self.pool.release(&seq.block_table);
                gone.push(seq);
            } else {
                at += 1;
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

    // A step: plan, then commit and retire.

    /// Plans one step.
    pub fn plan(&mut self) -> StepPlan {
        self.plan_with(&mut |_, seq| seq.imported.clear())
    }

    /// [`Self::plan`], calling `install` for each sequence about to be admitted that
    /// carries imported blocks (its hashes are up to date), right before its prefix-cache
    /// lookup: whatever `install` names in the pool is taken as prefix hits. `install`
    /// must leave every block it allocates free (released) or cached. The blocks are
    /// offered once: whatever is left in `seq.imported` afterwards is dropped.
    pub fn plan_with(
        &mut self,
        install: &mut dyn FnMut(&mut BlockPool, &mut Sequence),
    ) -> StepPlan {
        // Room for every sequence the step can carry, so the list is not regrown step by
        // step as it fills.
        let mut plan = StepPlan {
            work: Vec::with_capacity(
                (self.order.len() + self.waiting.len()).min(self.max_num_seqs),
            ),
            ..StepPlan::default()
        };
        let cap = self.max_num_batched_tokens;

        // 1. Running decodes continue first, oldest first: no prefill delays them.
        let decode_tokens = self.continue_running(&mut plan, true, cap);

        // 2. Prefills in progress, then new admissions, share what is left of the token
        //    budget, and, beside decodes, of the step-time target.
        let limit = self
            .budget
            .prefill_tokens(decode_tokens, cap.saturating_sub(decode_tokens));
        let prefill_tokens = self.continue_running(&mut plan, false, limit);

        // 3. Admit waiting sequences with what is left.
        self.admit_waiting(&mut plan, limit.saturating_sub(prefill_tokens), install);
        plan
    }

    /// Feeds the cost model: the last step ran `tokens` tokens in `secs` seconds.
    pub fn observe_step(&mut self, tokens: usize, secs: f64) {
        self.budget.cost.observe(tokens, secs);
    }

    /// After speculation rolled the sequence `id` back: frees the blocks past what its
    /// computed positions need (the rejected proposals' slots) and forgets block hashes
    /// past its tokens. The next step allocates again what the pending token needs.
    pub fn release_unneeded_blocks(&mut self, id: SeqId) {
        let bs = self.block_size;
        let Some(seq) = self.slots[id.index()].seq_mut() else {
            not_running(id)
        };
        let keep = seq.num_computed.div_ceil(bs).max(seq.num_committed);
        if seq.block_table.len() > keep {
            let freed = seq.block_table.split_off(keep);
            self.pool.release(&freed);
        }
        seq.block_hashes.truncate(seq.tokens.len() / bs);
    }

    /// The after-step rule, the same in the engine and the simulator: first name the
    /// blocks this step filled ([`Self::commit_full_blocks`]), so a finishing sequence's
    /// last blocks are cached before it lets them go; then [`Self::retire`] the finished.
    pub fn commit_and_retire<T, K>(
        &mut self,
        finished: &mut Vec<(SeqId, T)>,
        keep: impl FnMut(&mut BlockPool, &Sequence, &T) -> K,
    ) -> Vec<(Sequence, T, K)> {
        self.commit_full_blocks();
        self.retire(finished, keep)
    }

    /// Removes the running sequences `finished` names (emptying it), freeing their
    /// blocks. `keep` sees each one while its blocks are still held (the engine pins a
    /// prefill's prompt blocks there: references it takes in the pool are its own, given
    /// back with [`Self::release_held`]); each comes back with its tag and what `keep`
    /// returned.
    ///
    /// They go newest admission first, whatever order `finished` lists them in. Their ids
    /// stay valid whoever leaves first, so the order is not needed for correctness; it is
    /// a policy: it decides the order in which their blocks join the free queue, and so
    /// which are evicted first. The oldest sequence's blocks join last and stay cached
    /// longest.
    ///
    /// # Panics
    /// When `finished` names a sequence that is not running (or one twice).
    pub fn retire<T, K>(
        &mut self,
        finished: &mut Vec<(SeqId, T)>,
        mut keep: impl FnMut(&mut BlockPool, &Sequence, &T) -> K,
    ) -> Vec<(Sequence, T, K)> {
        let mut out = Vec::with_capacity(finished.len());
        // From the newest down: leaving at `at` moves none of the older ones still ahead.
        let mut at = self.order.len();
        while at > 0 && !finished.is_empty() {
            at -= 1;
            let id = self.order[at];
            let Some(f) = finished.iter().position(|f| f.0 == id) else {
                continue;
            };
            let (_, tag) = finished.swap_remove(f);
            let kept = keep(&mut self.pool, seq_in(&self.slots, id), &tag);
            let seq = self.remove_at(at);
            self.pool.release(&seq.block_table);
            out.push((seq, tag, kept));
        }
        if let Some(&(id, _)) = finished.first() {
            not_running(id)
        }
        out
    }

    /// Names the blocks that the last step filled, so later requests can share them.
    /// Call after advancing `num_computed`.
    pub(crate) fn commit_full_blocks(&mut self) {
        let Some(hash) = &self.hash else { return };
        let bs = self.block_size;
        // First hash what filled and start loading where each name goes: a prompt's
        // blocks are committed together, each a miss in the pool.
        for &id in &self.order {
            let Some(seq) = self.slots[id.index()].seq_mut() else {
                continue;
            };
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
        for &id in &self.order {
            let Some(seq) = self.slots[id.index()].seq_mut() else {
                continue;
            };
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

    fn blocks_needed(&self, seq: &Sequence, num_tokens: usize) -> usize {
        let need = (seq.num_computed + num_tokens).div_ceil(self.block_size);
        need.saturating_sub(seq.block_table.len())
    }

    /// The running sequence that should give way first.
    fn victim(&self) -> Option<SeqId> {
        let key = |s: &Sequence| match self.policy {
            Policy::Fcfs => (0, s.arrival_seq),
            // the highest value (least urgent) yields first, the newest among equals
            Policy::Priority => (s.priority as i64, s.arrival_seq),
        };
        self.order
            .iter()
            .copied()
            .max_by_key(|&id| key(seq_in(&self.slots, id)))
    }

    /// Frees a running sequence's blocks and sends it back to the front of the queue.
    fn preempt(&mut self, id: SeqId) {
        let mut seq = self.remove(id);
        self.pool.release(&seq.block_table);
        seq.block_table.clear();
        seq.num_computed = 0;
        seq.num_committed = 0;
        self.waiting.push_front(seq);
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
            .filter(|w| Self::is_decode(seq_in(&self.slots, w.id)) == decodes)
            .map(|w| w.num_tokens)
            .sum()
    }

    /// Plans the running sequences of one kind (decodes, or prefills in progress), oldest
    /// first, within `limit` tokens for that kind, preempting when blocks run out.
    /// Returns the tokens planned for that kind.
    fn continue_running(&mut self, plan: &mut StepPlan, decodes: bool, limit: usize) -> usize {
        let mut used = self.planned(plan, decodes);
        let mut k = 0;
        while k < self.order.len() {
            let id = self.order[k];
            let seq = seq_in(&self.slots, id);
            if Self::is_decode(seq) != decodes {
                k += 1;
                continue;
            }
            if used >= limit {
                break;
            }
            let num_tokens = seq.num_pending().min(limit - used);
            let need = self.blocks_needed(seq, num_tokens);
            if need > self.pool.num_free() {
                let Some(v) = self.victim() else { break };
                // Work already planned for the victim goes; every other id still names
                // the sequence it was planned for.
                plan.work.retain(|w| w.id != v);
                self.preempt(v);
                plan.num_preempted += 1;
                // Give back the budget of the victim's planned work.
                used = self.planned(plan, decodes);
                // Retry `id` with more free blocks, where it stands now; if it was the one
                // to yield, whoever took its place.
                if let Some(now) = self.order.iter().position(|&o| o == id) {
                    k = now;
                }
                continue;
            }
            let Some(seq) = self.slots[id.index()].seq_mut() else {
                not_running(id)
            };
            if self.pool.allocate_into(need, &mut seq.block_table) {
                plan.work.push(SeqWork { id, num_tokens });
                used += num_tokens;
            }
            k += 1;
        }
        used
    }

    /// Admits waiting sequences in order while there is `budget`, a slot and blocks, each
    /// first taking its longest cached prefix. Nothing is admitted in a step that had to
    /// preempt. A sequence whose adapter would exceed `max_loras` is set aside (keeping its
    /// place) and the ones behind it are still considered, as vLLM's scheduler does.
    fn admit_waiting(
        &mut self,
        plan: &mut StepPlan,
        mut budget: usize,
        install: &mut dyn FnMut(&mut BlockPool, &mut Sequence),
    ) {
        let bs = self.block_size;
        let mut deferred: Vec<Sequence> = Vec::new();
        let mut loras = self.running_loras();
        while plan.num_preempted == 0 && budget > 0 && self.order.len() < self.max_num_seqs {
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
                Self::update_hashes(hash, self.lora_hash.as_ref(), bs, &mut seq);
                if !seq.imported.is_empty() {
                    install(&mut self.pool, &mut seq);
                }
                let max_blocks = ((seq.tokens.len() - 1) / bs).min(seq.block_hashes.len());
                hits = self.pool.count_hits(&seq.block_hashes[..max_blocks]);
            }
            // Offered once: whatever was not installed (or without prefix caching, all of
            // it) is dropped rather than kept with the queued sequence.
            if !seq.imported.is_empty() {
                seq.imported = Vec::new();
            }
            let cached = self.pool.acquire_cached(&seq.block_hashes[..hits]);
            seq.block_table = cached;
            seq.num_computed = hits * bs;
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
                seq.imported_tokens = seq.installed.iter().filter(|&&i| i < hits).count() * bs;
                plan.prefix_queries += seq.prompt_len;
                plan.prefix_hits += seq.num_computed;
            }
            let id = self.admit(seq);
            plan.work.push(SeqWork { id, num_tokens });
            budget -= num_tokens;
        }
        for seq in deferred.into_iter().rev() {
            self.waiting.push_front(seq);
        }
    }

    // The prefix cache and its blocks.

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks nobody holds (cached or not).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Blocks named in the prefix cache (held or free).
    pub fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached()
    }

    /// Fraction of the blocks held, 0..=1 (cached free blocks count as free).
    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// The block holding `hash`, if cached.
    pub fn cached_block(&self, hash: &HashKey) -> Option<u32> {
        self.pool.cached_block(hash)
    }

    /// The hashes naming cached blocks right now, in block order.
    pub fn cached_hashes(&self) -> impl Iterator<Item = &HashKey> {
        self.pool.cached_blocks().map(|(h, _)| h)
    }

    /// Forgets every cached prefix. Refused (false) while any block is held.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset()
    }

    /// Gives back references taken in the `keep` hook of [`Self::retire`] (a pin's).
    pub fn release_held(&mut self, blocks: &[u32]) {
        self.pool.release(blocks);
    }

    /// Cache changes since the last call, oldest first.
    pub fn drain_kv_events(&mut self) -> std::vec::Drain<'_, PoolEvent> {
        self.pool.drain_events()
    }

    /// Records no cache changes when `false` (nobody listens); on by default.
    pub fn set_kv_events(&mut self, on: bool) {
        self.pool.set_events(on);
    }

    /// Leaves the tokens out of `Stored` events when `false` (a listener that reads only
    /// hashes); on by default.
    pub fn set_kv_event_tokens(&mut self, on: bool) {
        self.pool.set_event_tokens(on);
    }

    /// Records every cached block that allocation evicts, for [`Self::drain_evicted`]
    /// (off by default).
    pub fn set_track_evictions(&mut self, on: bool) {
        self.pool.set_track_evictions(on);
    }

    /// The cached blocks evicted since the last call, oldest first. Their slots are
    /// intact until the step that allocated them writes into them.
    pub fn drain_evicted(&mut self) -> std::vec::Drain<'_, EvictedBlock> {
        self.pool.drain_evicted()
    }

    /// Checks every invariant written at the planner's fields (blocks: with no references
    /// held outside the running sequences).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        // Ids: each slot in use is in `order` once; each other one on the free list once.
        let mut seen = vec![0u8; self.slots.len()];
        for &id in &self.order {
            assert!(self.slots[id.index()].seq().is_some(), "{id:?} runs");
            seen[id.index()] += 1;
        }
        let mut free = self.first_free;
        while free != NO_ID {
            let Entry::Free(next) = &self.slots[free as usize].0 else {
                panic!("free slot {free} runs");
            };
            let next = *next;
            seen[free as usize] += 1;
            assert!(seen[free as usize] == 1, "the free list loops at {free}");
            free = next;
        }
        assert!(seen.iter().all(|&n| n == 1), "each id once: {seen:?}");
        // The batch limit.
        assert!(self.order.len() <= self.max_num_seqs);
        // Waiting sequences hold nothing.
        for q in &self.waiting {
            assert!(q.block_table.is_empty() && q.num_computed == 0);
        }
        // Blocks: references are exactly the running tables' listings.
        let mut held = vec![0u32; self.pool.num_blocks()];
        for q in self.running() {
            for &b in &q.block_table {
                held[b as usize] += 1;
            }
        }
        for (b, &n) in held.iter().enumerate() {
            assert_eq!(self.pool.ref_count(b as u32), n, "block {b}");
        }
        assert_eq!(
            self.pool.num_free(),
            held.iter().filter(|&&n| n == 0).count(),
            "free means unreferenced"
        );
    }
}

/// The running sequence `id` names in `slots` (a field borrow, so the pool can be lent at
/// the same time).
fn seq_in(slots: &[Slot], id: SeqId) -> &Sequence {
    match slots[id.index()].seq() {
        Some(seq) => seq,
        None => not_running(id),
    }
}

/// A caller named a sequence that left the running set: a broken contract, not a state
/// to recover from.
#[cold]
fn not_running(id: SeqId) -> ! {
    panic!("{id:?} names no running sequence")
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

    fn config(policy: Policy, max_num_seqs: usize) -> EngineOptions {
        EngineOptions {
            block_size: 4,
            max_num_seqs,
            max_num_batched_tokens: 64,
            policy,
            step_time_budget: None,
            ..EngineOptions::default()
        }
    }

    /// The id of the running sequence `at` places from the oldest admission.
    fn id_at(s: &StepPlanner, at: usize) -> SeqId {
        s.order[at]
    }

    /// The running sequence `at` places from the oldest admission.
    fn at(s: &StepPlanner, at: usize) -> &Sequence {
        s.seq(id_at(s, at))
    }

    fn at_mut(s: &mut StepPlanner, at: usize) -> &mut Sequence {
        let id = id_at(s, at);
        s.seq_mut(id)
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
        let mut s = StepPlanner::new(&config(Policy::Fcfs, 8), 32, Some(hash));
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
        s.plan();
        // One adapter slot: `b` waits, keeping its place; the base and `a` run.
        let running: Vec<u64> = s.running().map(|q| q.arrival_seq).collect();
        assert_eq!(running, vec![0, 2, 3]);
        let waiting: Vec<u64> = s.waiting.iter().map(|q| q.arrival_seq).collect();
        assert_eq!(waiting, vec![1]);
        assert_eq!(s.running_loras(), vec!["a".to_string()]);
        assert_eq!(s.waiting_loras(), vec!["b".to_string()]);
        // The same prompt under the base and under `a` hashes apart.
        assert_ne!(at(&s, 0).block_hashes[0], at(&s, 1).block_hashes[0]);
        assert_eq!(at(&s, 0).block_hashes[0], at(&s, 2).block_hashes[0]);
        // When `a`'s sequences finish, `b` gets the slot.
        let (first, third) = (id_at(&s, 0), id_at(&s, 2));
        s.finish(third);
        s.finish(first);
        s.plan();
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
    fn a_step_ends_by_naming_its_blocks_then_retiring_the_finished_newest_first() {
        // Blocks of 4 tokens, named by their first token and their parent's.
        let hash: BlockHashFn = Box::new(|parent, t, _| {
            let mut h = [0u8; 32];
            h[0] = t[0] as u8;
            h[1] = parent.map_or(0, |p| p[0]);
            h
        });
        let mut s = StepPlanner::new(&config(Policy::Fcfs, 4), 8, Some(hash));
        for id in 0..3u32 {
            let mut q = seq(u64::from(id), 0, 8);
            q.tokens = (0..8).map(|t| id * 10 + t + 1).collect();
            s.add(q);
        }
        let plan = s.plan();
        assert_eq!(plan.work.len(), 3);
        run(&mut s, &plan);
        assert_eq!(s.pool.num_free(), 2);
        // 0 and 2 finish. Each is seen with its blocks held and already named.
        let mut finished = vec![(id_at(&s, 0), 'a'), (id_at(&s, 2), 'c')];
        let retired = s.commit_and_retire(&mut finished, |pool, q, tag| {
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
        assert_eq!(at(&s, 0).arrival_seq, 1);
        assert_eq!(s.pool.num_free(), 6);
        for (q, _, _) in &retired {
            assert_eq!(s.pool.count_hits(&q.block_hashes), 2);
        }
    }

    #[test]
    fn abandoned_sequences_leave_both_queues_in_order_and_free_their_blocks() {
        let mut s = StepPlanner::new(&config(Policy::Fcfs, 3), 16, None);
        let (b, _rx_b) = live(1, 4);
        let (e, _rx_e) = live(4, 4);
        s.add(seq(0, 0, 4));
        s.add(b);
        s.add(seq(2, 0, 4));
        s.add(seq(3, 0, 4));
        s.add(e);
        s.plan();
        assert_eq!(s.running().len(), 3);
        assert_eq!(s.pool.num_free(), 13);
        let gone: Vec<u64> = s.take_abandoned().iter().map(|q| q.arrival_seq).collect();
        assert_eq!(gone, vec![0, 2, 3]);
        let running: Vec<u64> = s.running().map(|q| q.arrival_seq).collect();
        assert_eq!(running, vec![1]);
        let waiting: Vec<u64> = s.waiting.iter().map(|q| q.arrival_seq).collect();
        assert_eq!(waiting, vec![4]);
        assert_eq!(s.pool.num_free(), 15);
        assert!(s.take_abandoned().is_empty());
    }

    #[test]
    fn rolled_back_proposals_give_their_blocks_back() {
        // Blocks of 4 tokens. A 6-token prompt, computed, with a sampled token pending and
        // 5 proposals: 12 tokens planned, 3 blocks.
        let mut s = StepPlanner::new(&config(Policy::Fcfs, 4), 8, None);
        s.add(seq(0, 0, 6));
        s.plan();
        let q = at_mut(&mut s, 0);
        q.num_computed = 6;
        q.tokens.push(7);
        q.tokens.extend([1, 2, 3, 4, 5]);
        q.num_draft = 5;
        let plan = s.plan();
        assert_eq!(plan.work[0].num_tokens, 6);
        assert_eq!(at(&s, 0).block_table.len(), 3);
        // One proposal accepted: positions 0..8 hold valid keys and values.
        let q = at_mut(&mut s, 0);
        q.drop_drafts();
        q.num_computed = 8;
        q.tokens.extend([1, 9]);
        s.release_unneeded_blocks(id_at(&s, 0));
        assert_eq!(at(&s, 0).block_table.len(), 2);
        assert_eq!(s.pool.num_free(), 6);
        // Nothing to give back twice; finishing frees the rest.
        s.release_unneeded_blocks(id_at(&s, 0));
        assert_eq!(s.pool.num_free(), 6);
        s.finish(id_at(&s, 0));
        assert_eq!(s.pool.num_free(), 8);
    }

    #[test]
    fn priority_policy_admits_lower_values_first_and_fcfs_among_equals() {
        let mut s = StepPlanner::new(&config(Policy::Priority, 2), 16, None);
        s.add(seq(0, 5, 4));
        s.add(seq(1, -1, 4));
        s.add(seq(2, 5, 4));
        s.add(seq(3, 0, 4));
        let plan = s.plan();
        assert_eq!(plan.work.len(), 2);
        let admitted: Vec<u64> = s.running().map(|q| q.arrival_seq).collect();
        assert_eq!(admitted, vec![1, 3]);
        let waiting: Vec<u64> = s.waiting.iter().map(|q| q.arrival_seq).collect();
        assert_eq!(waiting, vec![0, 2]);
    }

    #[test]
    fn preemption_picks_the_newest_under_fcfs_and_the_least_urgent_under_priority() {
        for (policy, victim) in [(Policy::Fcfs, 2), (Policy::Priority, 0)] {
            // 6 blocks of 4 tokens; three prompts of 8 tokens take all 6 blocks.
            let mut s = StepPlanner::new(&config(policy, 8), 6, None);
            s.add(seq(0, 9, 8));
            s.add(seq(1, 0, 8));
            s.add(seq(2, 1, 8));
            let plan = s.plan();
            assert_eq!(plan.work.len(), 3, "{policy:?}");
            for q in s.running_mut() {
                q.num_computed = q.tokens.len();
                q.tokens.push(7); // a sampled token: each now needs a third block
            }
            let plan = s.plan();
            assert!(plan.num_preempted >= 1, "{policy:?}");
            assert_eq!(
                s.waiting.front().map(|q| q.arrival_seq),
                Some(victim),
                "{policy:?}"
            );
            assert_eq!(
                s.pool.num_free() + s.running().map(|q| q.block_table.len()).sum::<usize>(),
                6
            );
        }
    }

    #[test]
    fn a_preemption_leaves_every_other_id_naming_its_sequence() {
        // As above under FCFS: the newest of three yields its blocks to the two older.
        let mut s = StepPlanner::new(&config(Policy::Fcfs, 8), 6, None);
        for id in 0..3 {
            s.add(seq(id, 0, 8));
        }
        s.plan();
        for q in s.running_mut() {
            q.num_computed = q.tokens.len();
            q.tokens.push(7);
        }
        let before: Vec<(SeqId, u64)> = s
            .running_ids()
            .map(|id| (id, s.seq(id).arrival_seq))
            .collect();
        let plan = s.plan();
        assert_eq!(plan.num_preempted, 1);
        // Each planned id names the sequence it named before planning; the victim is not
        // planned, and no id is planned twice.
        let planned: Vec<(SeqId, u64)> = plan
            .work
            .iter()
            .map(|w| (w.id, s.seq(w.id).arrival_seq))
            .collect();
        assert_eq!(planned, before[..2].to_vec());
        assert_eq!(s.waiting.front().map(|q| q.arrival_seq), Some(2));
        s.check_invariants();
    }

    /// Random admissions, steps, finishes (told in random order), abandonments and
    /// preemptions over a small pool: every invariant written at the planner's fields holds
    /// after each call, an id keeps naming its sequence while it runs, and the finished
    /// leave newest admission first.
    #[test]
    fn ids_queues_and_blocks_stay_consistent_under_random_traffic() {
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        use std::collections::{HashMap, HashSet};
        let hash: BlockHashFn = Box::new(|parent, t, _| {
            let mut h = [0u8; 32];
            h[0] = t[0] as u8;
            h[1] = parent.map_or(0, |p| p[0]);
            h
        });
        let mut s = StepPlanner::new(&config(Policy::Priority, 5), 12, Some(hash));
        let mut rng = StdRng::seed_from_u64(7);
        let mut listening = Vec::new();
        let (mut preempted, mut retired) = (0, 0);
        for round in 0..600u64 {
            if rng.random_bool(0.5) {
                let (mut q, rx) = live(round, rng.random_range(1..20));
                q.priority = rng.random_range(0..3);
                q.tokens = (0..q.tokens.len() as u32)
                    .map(|t| rng.random_range(0..3) * 10 + t)
                    .collect();
                q.max_tokens = rng.random_range(1..12);
                s.add(q);
                listening.push(rx);
            }
            if rng.random_bool(0.03) && !listening.is_empty() {
                let at = rng.random_range(0..listening.len());
                drop(listening.swap_remove(at));
                s.take_abandoned();
                s.check_invariants();
            }
            let names: HashMap<SeqId, u64> = s
                .running_ids()
                .map(|id| (id, s.seq(id).arrival_seq))
                .collect();
            let plan = s.plan();
            s.check_invariants();
            preempted += plan.num_preempted;
            let ids: HashSet<SeqId> = plan.work.iter().map(|w| w.id).collect();
            assert_eq!(ids.len(), plan.work.len(), "each id planned once");
            for id in s.running_ids() {
                if let Some(&arrival) = names.get(&id) {
                    assert_eq!(s.seq(id).arrival_seq, arrival, "{id:?} renamed");
                }
            }
            run(&mut s, &plan);
            // Each finished one tagged with its place in admission order.
            let mut finished: Vec<(SeqId, usize)> = s
                .running_ids()
                .enumerate()
                .filter(|&(_, id)| s.seq(id).num_output() >= s.seq(id).max_tokens)
                .map(|(rank, id)| (id, rank))
                .collect();
            finished.reverse();
            let k = finished.len();
            for i in 0..k {
                finished.swap(i, rng.random_range(i..k));
            }
            let gone = s.commit_and_retire(&mut finished, |_, _, &rank| rank);
            assert!(
                gone.windows(2).all(|w| w[0].2 > w[1].2),
                "newest admission first"
            );
            retired += gone.len();
            s.check_invariants();
        }
        assert!(preempted > 0 && retired > 0, "{preempted} {retired}");
    }

    /// Runs a plan as the engine would: computes the planned tokens and, for a sequence
    /// whose pending tokens are all computed, samples one more.
    fn run(s: &mut StepPlanner, plan: &StepPlan) {
        for w in &plan.work {
            let q = s.seq_mut(w.id);
            q.num_computed += w.num_tokens;
            if q.num_computed == q.tokens.len() {
                q.tokens.push(7);
            }
        }
    }

    fn budget_config(max_num_batched_tokens: usize) -> EngineOptions {
        EngineOptions {
            block_size: 16,
            max_num_seqs: 16,
            max_num_batched_tokens,
            policy: Policy::Fcfs,
            step_time_budget: None,
            ..EngineOptions::default()
        }
    }

    #[test]
    fn decodes_are_planned_before_a_prefill_in_progress() {
        // The oldest running sequence is 32 tokens into a 200-token prompt; four younger
        // ones decode. A budget of 20 tokens: every decode runs, the prompt gets the rest
        // (planned oldest-first as before, the prompt would take all 20).
        let mut s = StepPlanner::new(&budget_config(20), 64, None);
        let mut long = seq(0, 0, 200);
        long.num_computed = 32;
        long.block_table = s.pool.allocate(2).expect("free blocks");
        let long = s.admit(long);
        for id in 1..5 {
            let mut q = seq(id, 0, 2);
            q.num_computed = 2;
            q.tokens.push(7);
            q.block_table = s.pool.allocate(1).expect("free blocks");
            s.admit(q);
        }
        let plan = s.plan();
        assert_eq!(plan.work.len(), 5, "{plan:?}");
        assert!(plan.work[..4]
            .iter()
            .all(|w| w.id != long && w.num_tokens == 1));
        assert_eq!(
            plan.work[4],
            SeqWork {
                id: long,
                num_tokens: 16
            }
        );
        // A decode with speculative proposals counts as a decode too.
        run(&mut s, &plan);
        let q = at_mut(&mut s, 1);
        q.tokens.extend([1, 2, 3]);
        q.num_draft = 3;
        let plan = s.plan();
        assert_eq!(
            plan.work[0],
            SeqWork {
                id: id_at(&s, 1),
                num_tokens: 4
            }
        );
        assert_eq!(
            plan.work.last(),
            Some(&SeqWork {
                id: long,
                num_tokens: 13
            })
        );
    }

    #[test]
    fn a_step_time_target_bounds_the_prefill_beside_decodes() {
        let mut s = StepPlanner::new(&budget_config(2048), 512, None).with_budget(StepBudget {
            target: Some(Duration::from_millis(100)),
            min_prefill_tokens: 8,
            cost: linear_cost(),
        });
        for id in 0..4 {
            s.add(seq(id, 0, 3));
        }
        let plan = s.plan();
        run(&mut s, &plan);
        // Four decoding now; a 1,000-token prompt arrives.
        s.add(seq(9, 0, 1000));
        let plan = s.plan();
        let total: usize = plan.work.iter().map(|w| w.num_tokens).sum();
        // 10 ms + 1 ms per token within 100 ms: 90 tokens, 4 of them decodes.
        assert_eq!(total, 90, "{plan:?}");
        assert_eq!(plan.work.iter().filter(|w| w.num_tokens == 1).count(), 4);
        // Without decodes the same prompt would take the whole token budget.
        let mut alone = StepPlanner::new(&budget_config(2048), 512, None).with_budget(StepBudget {
            target: Some(Duration::from_millis(100)),
            min_prefill_tokens: 8,
            cost: linear_cost(),
        });
        alone.add(seq(9, 0, 1000));
        assert_eq!(alone.plan().work[0].num_tokens, 1000);
    }

    #[test]
    fn a_long_prompt_progresses_every_step_under_full_decode_load() {
        // The decodes alone exceed the target (10 ms + 1 ms per token, target 12 ms, 16
        // decodes): the prompt still gets its minimum every step and finishes.
        let mut s = StepPlanner::new(&budget_config(2048), 512, None).with_budget(StepBudget {
            target: Some(Duration::from_millis(12)),
            min_prefill_tokens: 32,
            cost: linear_cost(),
        });
        for id in 0..15 {
            s.add(seq(id, 0, 2));
        }
        let plan = s.plan();
        run(&mut s, &plan);
        s.add(seq(99, 0, 300));
        let mut steps = 0;
        loop {
            let plan = s.plan();
            steps += 1;
            let decodes = plan.work.iter().filter(|w| w.num_tokens == 1).count();
            assert_eq!(decodes, 15, "every decode runs every step");
            let before = s.running().last().map(|q| q.num_computed).unwrap_or(0);
            run(&mut s, &plan);
            let q = s.running().last().expect("the prompt is running");
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
        let mut s = StepPlanner::new(&budget_config(64), 512, None);
        s.add(seq(0, 0, 2));
        let plan = s.plan();
        run(&mut s, &plan);
        s.observe_step(2, 1.0); // ignored without a target
        s.add(seq(1, 0, 500));
        let plan = s.plan();
        assert_eq!(plan.work.iter().map(|w| w.num_tokens).sum::<usize>(), 64);
        // With a target but nothing measured yet: the token budget too.
        s.budget.target = Some(Duration::from_millis(1));
        s.budget.cost = StepCost::default();
        let plan = s.plan();
        assert_eq!(plan.work.iter().map(|w| w.num_tokens).sum::<usize>(), 64);
    }
}
