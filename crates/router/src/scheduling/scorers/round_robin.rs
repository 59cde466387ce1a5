//! `round-robin-scorer`: candidates in turn, by the request's running number.

use std::sync::Arc;

use rand::RngCore;

use crate::scheduling::params::BadParameters;
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// Round-robin over the candidates (by slot order), driven by the request's running
/// number: candidate `seq mod n` scores 1.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundRobinScorer;

impl Scorer for RoundRobinScorer {
    fn score(
        &self,
        _: &Context,
        req: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        if cands.is_empty() {
            return;
        }
        let mut order: Vec<usize> = (0..cands.len()).collect();
        order.sort_by_key(|&i| cands[i].id);
        out[order[(req.seq % cands.len() as u64) as usize]] = 1.0;
    }
}

/// The `round-robin-scorer` plugin (no parameters read).
pub(super) fn build(_: Option<&serde_json::Value>) -> Result<Arc<dyn Scorer>, BadParameters> {
    Ok(Arc::new(RoundRobinScorer))
}
