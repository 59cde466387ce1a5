//! `queue-scorer`: the shorter waiting queue scores higher.

use std::sync::Arc;

use rand::RngCore;

use super::min_max::min_max_inverse;
use crate::scheduling::params::BadParameters;
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// Shorter waiting queue scores higher: `(max - q) / (max - min)`; stale metrics score 0.
/// An endpoint whose load is unknown (no readable metrics ever) counts this router's own
/// requests in flight there instead, so a pool of such endpoints is least-request.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn score(
        &self,
        ctx: &Context,
        _: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        min_max_inverse(
            |i| {
                let c = cands[i];
                match &c.metrics {
                    // Load unknown: this router's own count.
                    None => Some(f64::from(c.in_flight)),
                    Some(_) => c.fresh_metrics(ctx.now, ctx.stale_after).map(|m| m.waiting),
                }
            },
            out,
        );
    }
}

/// The `queue-scorer` plugin (no parameters read).
pub(super) fn build(_: Option<&serde_json::Value>) -> Result<Arc<dyn Scorer>, BadParameters> {
    Ok(Arc::new(QueueScorer))
}
