//! Who runs this step: a token budget split between running decodes and (chunked)
//! prefills, block allocation, and preemption by recompute when blocks run out.
//!
//! Each step, every running sequence first gets what it needs to continue (one token for
//! a decode, the next chunk for a prefill in progress); then waiting sequences are admitted
//! in order (FCFS, or lowest `priority` value first, as vLLM) while the step has token budget, a free
//! sequence slot and blocks. When a running sequence cannot get a block, the sequence that
//! should yield (newest under FCFS, the highest `priority` value under the priority policy) is
//! preempted: its blocks are freed and it returns to the front of the queue, to recompute
//! its KV from its tokens when it is admitted again.

use std::collections::VecDeque;

use crate::kv::block_pool::{BlockPool, HashKey};
use crate::sequence::Sequence;

/// Computes a full block's prefix-cache hash from its parent's hash, its tokens and the
/// sequence's cache salt (mixed into the first block only). Supplied by the engine so the
/// scheduler stays independent of the hash scheme.
pub type BlockHashFn = Box<dyn Fn(Option<&HashKey>, &[u32], Option<&str>) -> HashKey + Send>;

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
    /// Indices into `StepPlanner::running`.
    pub work: Vec<Scheduled>,
    pub num_preempted: usize,
    /// Prompt tokens looked up in the prefix cache at admission, and how many were found.
    pub prefix_queries: usize,
    pub prefix_hits: usize,
}

pub struct StepPlanner {
    pub config: SchedulerConfig,
    pub pool: BlockPool,
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    hash: Option<BlockHashFn>,
}

impl StepPlanner {
    /// `hash`: the block hash function; `None` disables prefix caching.
    pub fn new(config: SchedulerConfig, num_blocks: usize, hash: Option<BlockHashFn>) -> Self {
        Self {
            config,
            pool: BlockPool::new(num_blocks, hash.is_some()),
            waiting: VecDeque::new(),
            running: Vec::new(),
            hash,
        }
    }

    /// Extends `seq.block_hashes` to every full block of its tokens.
    fn update_hashes(hash: &BlockHashFn, block_size: usize, seq: &mut Sequence) {
        let full = seq.tokens.len() / block_size;
        while seq.block_hashes.len() < full {
            let i = seq.block_hashes.len();
            let parent = i.checked_sub(1).map(|p| seq.block_hashes[p]);
            let salt = if i == 0 {
                seq.cache_salt.as_deref()
            } else {
                None
            };
            let h = hash(
                parent.as_ref(),
                &seq.tokens[i * block_size..(i + 1) * block_size],
                salt,
            );
            seq.block_hashes.push(h);
        }
    }

    /// Names the blocks that the last step filled, so later requests can share them.
    /// Call after advancing `num_computed`.
    pub fn commit_full_blocks(&mut self) {
        let Some(hash) = &self.hash else { return };
        let bs = self.config.block_size;
        for seq in self.running.iter_mut() {
            let full = (seq.num_computed / bs).min(seq.block_table.len());
            if seq.num_committed >= full {
                continue;
            }
            Self::update_hashes(hash, bs, seq);
            for i in seq.num_committed..full {
                let parent = i.checked_sub(1).map(|p| seq.block_hashes[p]);
                self.pool.commit(
                    seq.block_table[i],
                    seq.block_hashes[i],
                    parent,
                    &seq.tokens[i * bs..(i + 1) * bs],
                );
            }
            seq.num_committed = full;
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

    /// Plans one step.
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_num_batched_tokens;

        // 1. Running sequences continue, oldest first, preempting when blocks run out.
        let mut i = 0;
        while i < self.running.len() {
            if budget == 0 {
                break;
            }
            let num_tokens = self.running[i].num_pending().min(budget);
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
                // Give back the budget of the victim's planned work.
                budget = self.config.max_num_batched_tokens
                    - plan.work.iter().map(|w| w.num_tokens).sum::<usize>();
                self.preempt(v);
                plan.num_preempted += 1;
                if v < i {
                    i -= 1;
                }
                continue; // retry `i` (or whoever now sits there) with more free blocks
            }
            if let Some(blocks) = self.pool.allocate(need) {
                self.running[i].block_table.extend(blocks);
                plan.work.push(Scheduled {
                    index: i,
                    num_tokens,
                });
                budget -= num_tokens;
            }
            i += 1;
        }

        // 2. Admit waiting sequences while there is budget, a slot and blocks.
        //    Nothing is admitted in a step that had to preempt.
        while plan.num_preempted == 0 && budget > 0 && self.running.len() < self.config.max_num_seqs
        {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            // Take the cached prefix, always leaving at least one token to compute so the
            // step yields logits.
            let mut hits = 0;
            if let Some(hash) = &self.hash {
                Self::update_hashes(hash, self.config.block_size, &mut seq);
                let max_blocks = (seq.tokens.len() - 1) / self.config.block_size;
                hits = self.pool.count_hits(&seq.block_hashes[..max_blocks]);
            }
            let cached = self.pool.acquire_cached(&seq.block_hashes[..hits]);
            seq.block_table = cached;
            seq.num_computed = hits * self.config.block_size;
            let num_tokens = seq.num_pending().min(budget);
            let need = self.blocks_needed(&seq, num_tokens);
            let Some(blocks) = self.pool.allocate(need) else {
                self.pool.release(&seq.block_table);
                seq.block_table.clear();
                seq.num_computed = 0;
                self.waiting.push_front(seq);
                break;
            };
            seq.block_table.extend(blocks);
            seq.num_committed = hits;
            if !seq.admitted_once {
                seq.admitted_once = true;
                seq.cached_tokens = seq.num_computed;
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
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{Sampler, SamplingConfig};
    use crate::sequence::GenerationRequest;

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
}
