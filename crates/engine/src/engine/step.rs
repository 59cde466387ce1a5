//! One step of the loop, as the stages it goes through:
//!
//! 1. [plan](EngineLoop::plan_step): proposals appended, the planner's plan (imported
//!    blocks installed on admission), evicted blocks copied out before the forward
//!    overwrites them, proposals that will not run whole dropped;
//! 2. [forward](EngineLoop::forward): one batched forward over every planned sequence;
//! 3. [sample](EngineLoop::sample): every planned sequence advanced by its tokens, and
//!    those whose logits came back sampled (in parallel);
//! 4. [take tokens](EngineLoop::take_tokens): proposals verified, sampled tokens streamed
//!    until one ends the sequence;
//! 5. [end](EngineLoop::end_step): rejected proposals' blocks given back, then the
//!    planner's after-step rule
//!    ([`commit_and_retire`](crate::planner::StepPlanner::commit_and_retire)), a finished
//!    prefill's prompt blocks pinned on its way out, and each end reported.
//!
//! Every stage names a sequence by the [`SeqId`] the plan gives it; per-sequence scratch
//! of a step (logit rows, samples) is indexed by [`SeqId::index`].
//!
//! A failed forward ends every sequence of the step with the error instead of 3-5.

use std::time::Instant;

use crate::gguf::ModelError;
use crate::model::SeqInput;
use crate::planner::{SeqId, StepPlan};
use crate::sequence::FinishReason;

use super::drafts;
use super::engine_loop::EngineLoop;
use super::output::Ending;
use super::sampling::{sample_all, SeqSample};

/// Logit rows: what the forward returns per planned sequence (in plan order), and what
/// sampling takes per id.
type Logits = Vec<Vec<Vec<f32>>>;

impl EngineLoop {
    pub(super) fn step(&mut self) {
        let (plan, had_drafts) = self.plan_step();
        if plan.work.is_empty() {
            return;
        }
        let step_tokens: usize = plan.work.iter().map(|w| w.num_tokens).sum();
        self.metrics.record_step(step_tokens);
        let started = Instant::now();
        let (result, decode_only) = self.forward(&plan);
        // The step's cost feeds the planner's step-time budget.
        self.planner
            .observe_step(step_tokens, started.elapsed().as_secs_f64());
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                self.fail_step(&plan, &e);
                return;
            }
        };
        let samples = self.sample(&plan, logits, started);
        if decode_only {
            if let Some(drafter) = self.drafter.as_mut() {
                drafter.observe_step(step_tokens, started.elapsed().as_secs_f64());
            }
        }
        let finished = self.take_tokens(&plan, samples);
        self.end_step(had_drafts, finished);
    }

    /// Plans the step. Returns the plan and the running sequences that carried proposals
    /// into planning.
    fn plan_step(&mut self) -> (StepPlan, Vec<SeqId>) {
        if let Some(drafter) = self.drafter.as_mut() {
            drafter.propose(&mut self.planner, self.model.config.context_len);
        }
        let (kv, cache) = (&mut self.kv, &mut self.cache);
        let mut plan = self
            .planner
            .plan_with(&mut |pool, seq| kv.install_imported(pool, cache, seq));
        // Admissions and growth may have evicted cached blocks: copy them out before this
        // step's forward writes into them.
        self.kv
            .copy_evicted(self.planner.drain_evicted(), &self.cache);
        let had_drafts = drafts::settle(&mut self.planner, &mut plan);
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
        (plan, had_drafts)
    }

    /// Runs the model over every planned sequence's tokens. Also says whether the step
    /// held decode rows only (each sequence's pending token and its proposals): those
    /// steps are timed to price proposal rows.
    fn forward(&mut self, plan: &StepPlan) -> (Result<Logits, ModelError>, bool) {
        let mut decode_only = true;
        let mut tails = Vec::with_capacity(plan.work.len());
        let mut loras = Vec::with_capacity(plan.work.len());
        let planner = &self.planner;
        let inputs: Vec<SeqInput<'_>> = plan
            .work
            .iter()
            .map(|w| {
                let seq = planner.seq(w.id);
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
        (result, decode_only)
    }

    /// A failed forward ends every sequence of the step with an error. The detail (a
    /// compute error can carry a backtrace) goes to the log only, never to a client.
    fn fail_step(&mut self, plan: &StepPlan, e: &ModelError) {
        tracing::error!(error = %e, "forward pass failed; aborting the step's sequences");
        let reason = || FinishReason::Error("the forward pass failed (see the server log)".into());
        let mut failed: Vec<(SeqId, Ending)> =
            plan.work.iter().map(|w| (w.id, (reason(), None))).collect();
        for (seq, ending, ()) in self.planner.retire(&mut failed, |_, _, _| ()) {
            self.output.finish(seq, ending, Vec::new());
        }
    }

    /// Advances every planned sequence by its tokens (`started`: when the step began, a
    /// first schedule's time) and samples those with logits.
    fn sample(
        &mut self,
        plan: &StepPlan,
        logits: Logits,
        started: Instant,
    ) -> Vec<Option<SeqSample>> {
        let mut row_logits: Logits = vec![Vec::new(); self.planner.id_bound()];
        for (w, logits) in plan.work.iter().zip(logits) {
            let seq = self.planner.seq_mut(w.id);
            if seq.times.first_scheduled.is_none() {
                seq.times.first_scheduled = Some(started);
            }
            seq.num_computed += w.num_tokens;
            row_logits[w.id.index()] = logits;
        }
        sample_all(self.planner.slots_mut(), row_logits, self.output.eos_ids())
    }

    /// Each sampled sequence's new tokens: its proposals verified, then its sampled tokens
    /// streamed in order until one ends it. Returns the sequences that end, and why.
    fn take_tokens(
        &mut self,
        plan: &StepPlan,
        mut samples: Vec<Option<SeqSample>>,
    ) -> Vec<(SeqId, Ending)> {
        let mut finished = Vec::new();
        for w in &plan.work {
            let Some(sample) = samples[w.id.index()].take() else {
                continue;
            };
            let seq = self.planner.seq_mut(w.id);
            drafts::verify(seq, sample.outs.len(), &self.metrics);
            if let Some(err) = sample.error {
                seq.num_computed = seq.num_computed.min(seq.tokens.len());
                finished.push((w.id, (FinishReason::Error(err), None)));
                continue;
            }
            let last = sample.outs.len().saturating_sub(1);
            for (j, out) in sample.outs.into_iter().enumerate() {
                let grammar_done = sample.grammar_done && j == last;
                if let Some(ending) = self.output.emit(seq, out, grammar_done) {
                    finished.push((w.id, ending));
                    break;
                }
            }
            seq.num_computed = seq.num_computed.min(seq.tokens.len().saturating_sub(1));
        }
        finished
    }

    /// Ends the step: the blocks of rejected proposals go back, then the planner's
    /// after-step rule names the blocks the step filled and retires the finished (a
    /// prefill's prompt blocks outlive it under its pin, unless it failed), and each end
    /// is reported.
    fn end_step(&mut self, had_drafts: Vec<SeqId>, mut finished: Vec<(SeqId, Ending)>) {
        for id in had_drafts {
            self.planner.release_unneeded_blocks(id);
        }
        let pins = &mut self.pins;
        let retired = self
            .planner
            .commit_and_retire(&mut finished, |pool, seq, (reason, _)| match reason {
                FinishReason::Stop | FinishReason::Length => pins.keep(pool, seq),
                _ => Vec::new(),
            });
        for (seq, ending, pinned) in retired {
            self.output.finish(seq, ending, pinned);
        }
    }
}
