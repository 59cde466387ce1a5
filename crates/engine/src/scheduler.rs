//! Who runs this step: a token budget split between running decodes and (chunked)
//! prefills, block allocation, and preemption by recompute when blocks run out.
//!
//! Each step, every running sequence first gets what it needs to continue (one token for
//! a decode, the next chunk for a prefill in progress); then waiting sequences are admitted
//! in order (FCFS, or highest `priority` first) while the step has token budget, a free
//! sequence slot and blocks. When a running sequence cannot get a block, the sequence that
//! should yield (newest under FCFS, lowest priority under the priority policy) is
//! preempted: its blocks are freed and it returns to the front of the queue, to recompute
//! its KV from its tokens when it is admitted again.

use std::collections::VecDeque;

use crate::kv::block_pool::BlockPool;
use crate::sequence::Sequence;

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
    /// Indices into `Scheduler::running`.
    pub work: Vec<Scheduled>,
    pub num_preempted: usize,
}

pub struct Scheduler {
    pub config: SchedulerConfig,
    pub pool: BlockPool,
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, num_blocks: usize) -> Self {
        Self {
            config,
            pool: BlockPool::new(num_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    /// Queues a new sequence.
    pub fn add(&mut self, seq: Sequence) {
        match self.config.policy {
            Policy::Fcfs => self.waiting.push_back(seq),
            Policy::Priority => {
                // stable: after every waiting sequence of the same or higher priority
                let at = self
                    .waiting
                    .iter()
                    .position(|w| w.priority < seq.priority)
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
            Policy::Priority => (-(s.priority as i64), s.arrival_seq),
        };
        (0..self.running.len()).max_by_key(|&i| key(&self.running[i]))
    }

    /// Frees a running sequence's blocks and sends it back to the front of the queue.
    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        self.pool.release(&seq.block_table);
        seq.block_table.clear();
        seq.num_computed = 0;
        self.waiting.push_front(seq);
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
            let Some(front) = self.waiting.front() else {
                break;
            };
            let num_tokens = front.num_pending().min(budget);
            let need = self.blocks_needed(front, num_tokens);
            let Some(blocks) = self.pool.allocate(need) else {
                break;
            };
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            seq.block_table.extend(blocks);
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
