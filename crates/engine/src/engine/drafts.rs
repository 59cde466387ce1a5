//! Speculative proposals around one step: before planning, decoding sequences that may
//! speculate get n-gram proposals appended to their tokens, sized by what their rows cost
//! ([`Drafter::propose`]); after planning, proposals that will not run whole are dropped
//! ([`settle`]); after sampling, the accepted prefix is kept and the rest rolled back
//! ([`verify`]).

use crate::metrics::EngineMetrics;
use crate::planner::{SeqId, StepPlan, StepPlanner};
use crate::sequence::Sequence;
use crate::spec_decode::{linear_prices, propose, SpeculativeConfig, StepCosts, PRIOR_ROW_COST};

/// Prompt-lookup speculation as configured, with the measured cost of decode steps that
/// prices proposal rows (unless the configuration fixes the price).
pub(super) struct Drafter {
    config: SpeculativeConfig,
    /// Times of decode-only steps, which price speculative rows (unless configured).
    step_costs: StepCosts,
}

impl Drafter {
    pub(super) fn new(config: SpeculativeConfig) -> Self {
        Self {
            config,
            step_costs: StepCosts::default(),
        }
    }

    /// Records a decode-only step of `rows` rows that took `secs`, sampling included
    /// (which every extra row also pays for).
    pub(super) fn observe_step(&mut self, rows: usize, secs: f64) {
        self.step_costs.observe(rows, secs);
    }

    /// Appends n-gram proposals to every running sequence that decodes and may
    /// speculate, so the planner plans them with its pending token. `context_len`: the
    /// model's.
    pub(super) fn propose(&mut self, planner: &mut StepPlanner, context_len: usize) {
        let config = self.config;
        // Sequences decoding this step: extra rows cost more the more of them there are.
        let batch = planner.running().filter(|s| s.num_pending() == 1).count();
        let max = config.num_speculative_tokens;
        let prices = match config.row_cost {
            Some(c) => linear_prices(c, batch, max),
            None => {
                let fallback = self.step_costs.row_cost().unwrap_or(PRIOR_ROW_COST);
                self.step_costs.prices(batch, max, fallback)
            }
        };
        for seq in planner.running_mut() {
            if !seq.speculative
                || seq.grammar.is_some()
                || seq.num_pending() != 1
                || seq.num_output() == 0
            {
                continue;
            }
            let budget = seq.draft_state.budget(&config, batch, &prices);
            if budget == 0 {
                continue;
            }
            // Room for every proposal plus the token sampled after them, within both
            // max_tokens and the context.
            let by_length = seq.max_tokens.saturating_sub(seq.num_output() + 1);
            let by_context = context_len.saturating_sub(seq.tokens.len() + 1);
            let drafts = propose(&seq.tokens, &config, budget.min(by_length).min(by_context));
            seq.num_draft = drafts.len();
            seq.tokens.extend_from_slice(&drafts);
        }
    }
}

/// After planning: proposals of a preempted, unplanned or partly planned sequence are
/// dropped (a partly planned one runs just its pending token). Returns the running
/// sequences that carried proposals into planning (oldest admission first), so their
/// spare blocks can be released after the step.
pub(super) fn settle(planner: &mut StepPlanner, plan: &mut StepPlan) -> Vec<SeqId> {
    let bs = planner.block_size();
    for seq in planner.waiting_mut() {
        if seq.num_draft > 0 {
            seq.drop_drafts();
            seq.block_hashes.truncate(seq.tokens.len() / bs);
        }
    }
    let had: Vec<SeqId> = planner
        .running_ids()
        .filter(|&id| planner.seq(id).num_draft > 0)
        .collect();
    if had.is_empty() {
        return had;
    }
    let mut planned: Vec<Option<usize>> = vec![None; planner.id_bound()];
    for (k, w) in plan.work.iter().enumerate() {
        planned[w.id.index()] = Some(k);
    }
    for &id in &had {
        let seq = planner.seq_mut(id);
        match planned[id.index()] {
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

/// After sampling `sampled` tokens from `seq`'s rows (in order, until one disagreed with
/// its proposal): keeps the accepted proposals' keys and values, drops the proposals from
/// `tokens` and records how they fared. Returns how many were accepted.
pub(super) fn verify(seq: &mut Sequence, sampled: usize, metrics: &EngineMetrics) -> usize {
    let proposed = seq.num_draft;
    // All but the last sampled token confirmed a proposal.
    let accepted = sampled.saturating_sub(1).min(proposed);
    if proposed > 0 {
        metrics.spec_decode.record(proposed, accepted);
        seq.draft_state.record(proposed, accepted);
    }
    seq.drop_drafts();
    // Keys and values stay valid up to the last accepted proposal; the rejected ones'
    // slots are rewritten when those positions are computed again.
    seq.num_computed = seq.tokens.len() + accepted;
    accepted
}
