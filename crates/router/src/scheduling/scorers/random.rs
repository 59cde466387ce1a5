//! `random-scorer`: a uniform random score per candidate.

use std::sync::Arc;

use rand::{Rng, RngCore};

use crate::scheduling::params::BadParameters;
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// A uniform random score per candidate.
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomScorer;

impl Scorer for RandomScorer {
    fn score(
        &self,
        _: &Context,
        _: &SchedRequest,
        _: &[&Candidate],
        out: &mut [f64],
        rng: &mut dyn RngCore,
    ) {
        for o in out.iter_mut() {
            *o = rng.random::<f64>();
        }
    }
}

/// The `random-scorer` plugin (no parameters read).
pub(super) fn build(_: Option<&serde_json::Value>) -> Result<Arc<dyn Scorer>, BadParameters> {
    Ok(Arc::new(RandomScorer))
}
