//! `session-affinity-scorer`: a session sticks to one endpoint (rendezvous hashing).

use std::sync::Arc;

use rand::RngCore;
use xxhash_rust::xxh64::xxh64;

use crate::scheduling::params::BadParameters;
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// Session affinity: the endpoint that wins rendezvous hashing of (session, URL) scores 1,
/// others 0. Stable while that endpoint stays, and only its sessions move when it goes.
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionAffinityScorer;

impl Scorer for SessionAffinityScorer {
    fn score(
        &self,
        _: &Context,
        req: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        let Some(session) = req.session.as_deref() else {
            return;
        };
        let seed = xxh64(session.as_bytes(), 0);
        let best = cands
            .iter()
            .enumerate()
            .max_by_key(|(_, c)| xxh64(c.spec.url.as_bytes(), seed))
            .map(|(i, _)| i);
        if let Some(i) = best {
            out[i] = 1.0;
        }
    }
}

/// The `session-affinity-scorer` plugin (no parameters read).
pub(super) fn build(_: Option<&serde_json::Value>) -> Result<Arc<dyn Scorer>, BadParameters> {
    Ok(Arc::new(SessionAffinityScorer))
}
