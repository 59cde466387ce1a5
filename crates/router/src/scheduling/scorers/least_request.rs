//! `least-request-scorer`: the fewest requests in flight from this router scores higher.

use std::sync::Arc;

use rand::RngCore;

use super::min_max::min_max_inverse;
use crate::scheduling::params::BadParameters;
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// Fewest requests in flight from this router: `(max - r) / (max - min)`. Needs no
/// metrics, so it works on engines that export none.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeastRequestScorer;

impl Scorer for LeastRequestScorer {
    fn score(
        &self,
        _: &Context,
        _: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        min_max_inverse(|i| Some(f64::from(cands[i].in_flight)), out);
    }
}

/// The `least-request-scorer` plugin (no parameters read).
pub(super) fn build(_: Option<&serde_json::Value>) -> Result<Arc<dyn Scorer>, BadParameters> {
    Ok(Arc::new(LeastRequestScorer))
}
