//! `precise-prefix-cache-scorer`: prefix affinity from the endpoints' KV events, tier
//! aware.

use std::sync::Arc;

use rand::RngCore;

use super::prefix_cache::{ids, prefix_scores, Matches, PrefixCacheScorer};
use crate::prefix::PrefixMatch;
use crate::scheduling::params::{parse, BadParameters, PrefixParams};
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// Precise prefix affinity from KV events: matched blocks / request blocks, blocks found
/// only in a lower tier counted at `lower_tier_weight`. Without token-level block hashes
/// for the request it falls back to the approximate index.
#[derive(Debug, Clone, Copy)]
pub struct PrecisePrefixCacheScorer {
    pub lower_tier_weight: f64,
}

impl Default for PrecisePrefixCacheScorer {
    fn default() -> Self {
        PrecisePrefixCacheScorer {
            lower_tier_weight: 0.8,
        }
    }
}

impl Scorer for PrecisePrefixCacheScorer {
    fn score(
        &self,
        ctx: &Context,
        req: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        rng: &mut dyn RngCore,
    ) {
        match (ctx.precise, &req.precise_blocks) {
            (Some(idx), Some(blocks)) if blocks.chains.len() <= 1 => {
                let chain = blocks.chain(blocks.default_block_size);
                let mut m = Matches::from_elem(PrefixMatch::default(), cands.len());
                idx.match_prefix_into(chain, ids(cands), &mut m);
                prefix_scores(&m, chain.len(), self.lower_tier_weight, out);
            }
            (Some(idx), Some(blocks)) => {
                // Endpoints of different block sizes: each against the chain of its own.
                for (o, c) in out.iter_mut().zip(cands) {
                    let chain = blocks.for_candidate(c);
                    let mut m = [PrefixMatch::default()];
                    idx.match_prefix_into(chain, std::iter::once(c.id), &mut m);
                    let mut one = [0.0];
                    prefix_scores(&m, chain.len(), self.lower_tier_weight, &mut one);
                    *o = one[0];
                }
            }
            _ => PrefixCacheScorer.score(ctx, req, cands, out, rng),
        }
    }
}

/// The `precise-prefix-cache-scorer` plugin: `lowerTierWeight` in 0..1, default 0.8 (its
/// other parameters set the approximate index it falls back to).
pub(super) fn build(
    parameters: Option<&serde_json::Value>,
) -> Result<Arc<dyn Scorer>, BadParameters> {
    let p: PrefixParams = parse(parameters)?;
    let w = p.lower_tier_weight.unwrap_or(0.8);
    if !(0.0..=1.0).contains(&w) {
        return Err(BadParameters("lowerTierWeight must be in 0..1".into()));
    }
    Ok(Arc::new(PrecisePrefixCacheScorer {
        lower_tier_weight: w,
    }))
}
