//! How much prefill a step that carries decodes may take: a step-time target turned into
//! tokens by a cost model of recent steps ([`StepCost`], fixed + per-token seconds fitted by
//! least squares), with a progress guarantee so a long prompt always moves.

use std::time::Duration;

/// A step's time as a straight line in its token count, `secs ≈ fixed + per_token · tokens`,
/// fitted by least squares over the steps observed so far, older steps weighing less
/// (each new observation multiplies the weight of the earlier ones by [`StepCost::DECAY`]).
///
/// The fixed part is what every step pays whatever its size (streaming the weights once,
/// thread hand-offs, sampling); the slope is the marginal cost of one more row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepCost {
    /// Weighted sums: weight, tokens, seconds, tokens², tokens · seconds.
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

impl StepCost {
    /// Weight left to an observation per newer one (a memory of about 50 steps).
    pub const DECAY: f64 = 0.98;

    /// Records that a step of `tokens` tokens took `secs`. Non-finite or negative times
    /// are ignored.
    pub fn observe(&mut self, tokens: usize, secs: f64) {
        if tokens == 0 || !secs.is_finite() || secs < 0.0 {
            return;
        }
        let x = tokens as f64;
        let d = Self::DECAY;
        self.w = self.w * d + 1.0;
        self.sx = self.sx * d + x;
        self.sy = self.sy * d + secs;
        self.sxx = self.sxx * d + x * x;
        self.sxy = self.sxy * d + x * secs;
    }

    /// `(fixed, per_token)` seconds, or `None` before any observation. Both are kept
    /// non-negative; when the observed steps are too alike in size to separate the two
    /// (or the fit comes out with a negative slope, which noise can do), the whole time
    /// is charged per token, which overestimates a larger step and so errs on the side
    /// of shorter steps.
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.w <= 0.0 || self.sx <= 0.0 {
            return None;
        }
        let mx = self.sx / self.w;
        let my = self.sy / self.w;
        let var = self.sxx / self.w - mx * mx;
        let cov = self.sxy / self.w - mx * my;
        // Sizes must spread by at least ~10 % of their mean for the slope to mean much.
        if var > (0.1 * mx).powi(2) {
            let slope = cov / var;
            let fixed = my - slope * mx;
            if slope > 0.0 && fixed >= 0.0 {
                return Some((fixed, slope));
            }
            if slope > 0.0 {
                // A negative intercept: the line through the origin with the same mean.
                return Some((0.0, my / mx));
            }
        }
        Some((0.0, my / mx))
    }

    /// The most tokens a step can hold and still be predicted to take at most `target`;
    /// `None` before any observation.
    pub fn tokens_within(&self, target: Duration) -> Option<usize> {
        self.fit().map(|fit| tokens_within_fit(fit, target))
    }
}

/// [`StepCost::tokens_within`] for a fit already made (`(fixed, per_token)`).
fn tokens_within_fit((fixed, per_token): (f64, f64), target: Duration) -> usize {
    let left = target.as_secs_f64() - fixed;
    if left <= 0.0 {
        return 0;
    }
    if per_token <= 0.0 {
        return usize::MAX;
    }
    // A hair of slack so that a budget that fits exactly is not lost to rounding; float
    // to integer casts saturate, so a tiny slope gives usize::MAX, not garbage.
    (left / per_token + 1e-6).floor() as usize
}

/// How much prefill a step that carries decodes may take beside them.
#[derive(Debug, Clone, PartialEq)]
pub struct StepBudget {
    /// The time a step with decodes should stay within; `None` leaves only
    /// `max_num_batched_tokens` to bound it (every step then fills the whole token budget
    /// when prompts wait, and each of those steps stalls the decodes in it).
    pub target: Option<Duration>,
    /// Prefill tokens a step with decodes still takes when the decodes alone use up the
    /// target, so a waiting prompt always progresses. When they use only part of it, the
    /// guarantee shrinks in proportion ([`StepBudget::prefill_tokens`]).
    pub min_prefill_tokens: usize,
    /// The cost model of recent steps
    /// ([`StepPlanner::observe_step`](super::StepPlanner::observe_step) feeds it).
    pub cost: StepCost,
}

impl StepBudget {
    /// The default step-time target (the engine's `--step-time-budget-ms`). Measured
    /// beside vLLM CPU (`docs/BENCHMARKS.md`, issue 15): with 8-bit prompt rows, 50 ms keeps
    /// the output throughput of 100 ms at 16 and 64 streams and halves the shared-prefix
    /// ITL p99 (to vLLM's).
    pub const DEFAULT_TARGET: Duration = Duration::from_millis(50);
    /// [`StepBudget::DEFAULT_TARGET`] in milliseconds, as the flag takes it.
    pub const DEFAULT_TARGET_MS: u64 = Self::DEFAULT_TARGET.as_millis() as u64;
    /// The default progress guarantee of a prefill beside decodes. Measured: with 32, a
    /// burst of 16 prompts of 256 tokens on a loaded 2-core machine (where 16 decodes alone
    /// exceed a 100 ms step) prefilled 32 tokens per ~250 ms step and output throughput
    /// fell to a third; 256 keeps a burst to a handful of steps while still bounding what
    /// one step adds to the decodes' inter-token gap.
    pub const DEFAULT_MIN_PREFILL_TOKENS: usize = 256;

    /// A step-time target of `target` (none: token budget only).
    pub fn new(target: Option<Duration>) -> Self {
        Self {
            target,
            min_prefill_tokens: Self::DEFAULT_MIN_PREFILL_TOKENS,
            cost: StepCost::default(),
        }
    }

    /// Prefill tokens allowed in a step whose decodes take `decode_tokens`, out of
    /// `room` tokens left under `max_num_batched_tokens`: what fits in the target beside
    /// the decodes, but at least the progress guarantee scaled by the share of the target
    /// the decodes are predicted to take (all of it once they fill the target). A full
    /// guarantee beside a few light decodes would set their inter-token gap to the time of
    /// the whole chunk (measured under the shared-prefix load, 100 ms target, busy 2-core
    /// machine: ITL p99 920 ms with the full 256, 171 ms scaled, for a longer TTFT p90);
    /// under a decode load that fills the target, the guarantee is what moves prompts at
    /// all.
    pub fn prefill_tokens(&self, decode_tokens: usize, room: usize) -> usize {
        if decode_tokens == 0 {
            return room;
        }
        let Some(target) = self.target else {
            return room;
        };
        let Some((fixed, per_token)) = self.cost.fit() else {
            // Nothing measured yet: the token budget alone, until the first steps are in.
            return room;
        };
        let fits = tokens_within_fit((fixed, per_token), target);
        let secs = target.as_secs_f64();
        let share = if secs > 0.0 {
            ((fixed + per_token * decode_tokens as f64) / secs).clamp(0.0, 1.0)
        } else {
            1.0
        };
        // The cast saturates and the share is within [0, 1]: at most the guarantee.
        let floor = (self.min_prefill_tokens as f64 * share).ceil() as usize;
        fits.saturating_sub(decode_tokens)
            .max(floor.min(self.min_prefill_tokens))
            .min(room)
    }
}

impl Default for StepBudget {
    /// No step-time target: only `max_num_batched_tokens` bounds a step.
    fn default() -> Self {
        Self::new(None)
    }
}

/// A cost model that has seen steps of 10 ms + 1 ms per token (the planner's tests too).
#[cfg(test)]
pub(super) fn linear_cost() -> StepCost {
    let mut c = StepCost::default();
    for n in [4, 40, 100, 300, 8, 64] {
        c.observe(n, 0.010 + 0.001 * n as f64);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_progress_guarantee_scales_with_the_decodes_share_of_the_target() {
        // 10 ms + 1 ms per token; a 20 ms target; guarantee 256.
        let budget = StepBudget {
            target: Some(Duration::from_millis(20)),
            min_prefill_tokens: 256,
            cost: linear_cost(),
        };
        // Four decodes take 14 ms, 70 % of the target: 70 % of the guarantee (179.2 → 180),
        // far more than the 6 tokens the target alone leaves.
        assert_eq!(budget.prefill_tokens(4, 2048), 180);
        // Ten decodes fill the target: the whole guarantee.
        assert_eq!(budget.prefill_tokens(10, 2048), 256);
        assert_eq!(budget.prefill_tokens(40, 2048), 256);
        // Never above the token budget's room.
        assert_eq!(budget.prefill_tokens(4, 100), 100);
        // A roomy target: what fits rules (100 ms − 10 ms − 4 decodes = 86 tokens; the
        // scaled guarantee, 14 % of 256, is below it).
        let roomy = StepBudget {
            target: Some(Duration::from_millis(100)),
            ..budget.clone()
        };
        assert_eq!(roomy.prefill_tokens(4, 2048), 86);
        // A zero target: the decodes always fill it, so the whole guarantee.
        let zero = StepBudget {
            target: Some(Duration::ZERO),
            ..budget
        };
        assert_eq!(zero.prefill_tokens(1, 2048), 256);
    }

    #[test]
    fn the_step_cost_fit_recovers_a_line_and_stays_sane_on_odd_input() {
        let (fixed, per_token) = linear_cost().fit().expect("observed");
        assert!((fixed - 0.010).abs() < 1e-9 && (per_token - 0.001).abs() < 1e-9);
        assert_eq!(
            linear_cost().tokens_within(Duration::from_millis(50)),
            Some(40)
        );
        assert_eq!(
            linear_cost().tokens_within(Duration::from_millis(5)),
            Some(0)
        );
        // Nothing seen, and unusable observations, give no fit.
        let mut c = StepCost::default();
        assert_eq!(c.fit(), None);
        c.observe(0, 1.0);
        c.observe(5, f64::NAN);
        c.observe(5, -1.0);
        c.observe(5, f64::INFINITY);
        assert_eq!(c.fit(), None);
        // Steps all of one size: all of the time is charged per token.
        for _ in 0..5 {
            c.observe(16, 0.032);
        }
        let (fixed, per_token) = c.fit().expect("observed");
        assert_eq!(fixed, 0.0);
        assert!((per_token - 0.002).abs() < 1e-12);
        // A falling line (noise) is not believed either.
        let mut c = StepCost::default();
        c.observe(10, 0.05);
        c.observe(100, 0.01);
        let (fixed, per_token) = c.fit().expect("observed");
        assert_eq!(fixed, 0.0);
        assert!(per_token > 0.0);
        // Old steps fade: after a slowdown the model follows the new cost.
        let mut c = linear_cost();
        for n in (0..200).map(|i| 4 + (i % 7) * 30) {
            c.observe(n, 0.020 + 0.002 * n as f64);
        }
        let (fixed, per_token) = c.fit().expect("observed");
        assert!((per_token - 0.002).abs() < 1e-4, "{per_token}");
        assert!((fixed - 0.020).abs() < 2e-3, "{fixed}");
    }
}
