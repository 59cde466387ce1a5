//! `load-aware-scorer` (llm-d): a score that falls with the waiting queue to 0 at a
//! threshold.

use std::sync::Arc;

use rand::RngCore;

use crate::scheduling::params::{parse, BadParameters, ThresholdParams};
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// Load-aware (llm-d): 0.5 with an empty queue, falling linearly to 0 at `threshold`
/// waiting requests; stale metrics score 0.
#[derive(Debug, Clone, Copy)]
pub struct LoadAwareScorer {
    pub threshold: f64,
}

impl Default for LoadAwareScorer {
    fn default() -> Self {
        LoadAwareScorer { threshold: 128.0 }
    }
}

impl Scorer for LoadAwareScorer {
    fn score(
        &self,
        ctx: &Context,
        _: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = match c.fresh_metrics(ctx.now, ctx.stale_after) {
                None => 0.0,
                Some(m) if m.waiting <= 0.0 => 0.5,
                Some(m) => 0.5 * (1.0 - (m.waiting / self.threshold.max(1.0)).min(1.0)),
            };
        }
    }
}

/// The `load-aware-scorer` plugin: `threshold` (or `queueThreshold`,
/// `queueDepthThreshold`), default 128.
pub(super) fn build(
    parameters: Option<&serde_json::Value>,
) -> Result<Arc<dyn Scorer>, BadParameters> {
    let p: ThresholdParams = parse(parameters)?;
    let threshold = p.threshold.or(p.queue_threshold).unwrap_or(128.0);
    Ok(Arc::new(LoadAwareScorer { threshold }))
}
