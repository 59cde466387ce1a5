//! `prefix-cache-scorer`: approximate prefix affinity, from the router's own record of
//! what it sent where; and the scoring of prefix matches the precise scorer shares.

use std::sync::Arc;

use rand::RngCore;
use smallvec::SmallVec;

use crate::endpoint::EndpointId;
use crate::prefix::PrefixMatch;
use crate::scheduling::params::{parse, BadParameters, PrefixParams};
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// Per-candidate prefix matches; inline for up to 64 candidates.
pub(super) type Matches = SmallVec<[PrefixMatch; 64]>;

/// The candidates' slots, as an index lookup takes them.
pub(super) fn ids<'a>(cands: &'a [&Candidate]) -> impl Iterator<Item = EndpointId> + Clone + 'a {
    cands.iter().map(|c| c.id)
}

/// Matched blocks / `total` per candidate, blocks held only in a lower tier counted at
/// `lower_weight`; nothing scored when the request has no blocks.
pub(super) fn prefix_scores(
    matches: &[PrefixMatch],
    total: usize,
    lower_weight: f64,
    out: &mut [f64],
) {
    if total == 0 {
        return;
    }
    for (o, m) in out.iter_mut().zip(matches) {
        let upper = f64::from(m.blocks - m.lower_tier.min(m.blocks));
        *o = (upper + lower_weight * f64::from(m.lower_tier)) / total as f64;
    }
}

/// Approximate prefix affinity: matched chunks / request chunks, from the router's own
/// record of what it sent where.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefixCacheScorer;

impl Scorer for PrefixCacheScorer {
    fn score(
        &self,
        ctx: &Context,
        req: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        let Some(idx) = ctx.approx else { return };
        let mut m = Matches::from_elem(PrefixMatch::default(), cands.len());
        idx.match_prefix_into(&req.approx_blocks, ids(cands), &mut m);
        prefix_scores(&m, req.approx_blocks.len(), 1.0, out);
    }
}

/// The `prefix-cache-scorer` plugin: its parameters set the approximate index
/// ([`crate::scheduling::EndpointPickerConfig::approx_config`]); here they are only
/// checked.
pub(super) fn build(
    parameters: Option<&serde_json::Value>,
) -> Result<Arc<dyn Scorer>, BadParameters> {
    let _: PrefixParams = parse(parameters)?;
    Ok(Arc::new(PrefixCacheScorer))
}
