//! `kv-cache-utilization-scorer`: the emptier KV cache scores higher.

use std::sync::Arc;

use rand::RngCore;

use crate::scheduling::params::BadParameters;
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// `1 - kv_use`; stale metrics score 0; an engine that reports no KV use (or no metrics at
/// all) scores 0.5.
#[derive(Debug, Clone, Copy, Default)]
pub struct KvCacheUtilizationScorer;

impl Scorer for KvCacheUtilizationScorer {
    fn score(
        &self,
        ctx: &Context,
        _: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = match &c.metrics {
                // Load unknown.
                None => 0.5,
                Some(_) => match c.fresh_metrics(ctx.now, ctx.stale_after) {
                    Some(m) => m.kv_use.map_or(0.5, |kv| 1.0 - kv),
                    None => 0.0,
                },
            };
        }
    }
}

/// The `kv-cache-utilization-scorer` plugin (no parameters read).
pub(super) fn build(_: Option<&serde_json::Value>) -> Result<Arc<dyn Scorer>, BadParameters> {
    Ok(Arc::new(KvCacheUtilizationScorer))
}
