//! What a pick reports: the hit ratio of the prefix index the request used, the time the
//! decision took, the approximate index's size, the pick count per endpoint, the
//! prefill/decode decision, and the reason a pick failed. Counted after the pool's lock
//! is released, but the hit is measured under it (the index as the decision saw it).

use std::sync::Arc;
use std::time::Instant;

use crate::endpoint::EndpointId;
use crate::prefix::approx::ApproxIndex;
use crate::prefix::precise::PreciseIndex;
use crate::scheduling::{Candidate, PdChoice, SchedRequest, ScheduleError};
use crate::telemetry::RouterMetrics;

/// How much of the request's prompt the pick already held, in the index the request
/// was scored with.
#[derive(Debug, Clone, Copy)]
pub(super) struct PrefixHit {
    /// `precise` or `approx`.
    index: &'static str,
    /// Blocks looked up.
    requested: usize,
    /// Blocks the pick held.
    matched: usize,
}

/// Hit-ratio bookkeeping for whichever index the request used: the precise one when the
/// request carries block hashes and a precise scorer is configured, else the approximate
/// one.
#[inline]
pub(super) fn prefix_hit(
    uses_precise: bool,
    cands: &[Candidate],
    approx: &ApproxIndex,
    precise: &PreciseIndex,
    req: &SchedRequest,
    first: EndpointId,
) -> PrefixHit {
    match &req.precise_blocks {
        Some(b) if uses_precise => {
            let chain = cands
                .iter()
                .find(|c| c.id == first)
                .map_or(&[][..], |c| b.for_candidate(c));
            PrefixHit {
                index: "precise",
                requested: chain.len(),
                matched: precise
                    .match_prefix(chain, &[first])
                    .first()
                    .map_or(0, |m| m.blocks as usize),
            }
        }
        _ => PrefixHit {
            index: "approx",
            requested: req.approx_blocks.len(),
            matched: approx
                .match_prefix(&req.approx_blocks, &[first])
                .first()
                .map_or(0, |m| m.blocks as usize),
        },
    }
}

/// Counts one pick: its latency since `started`, its prefix hit, the approximate index's
/// size after it (`approx_len` blocks), the endpoint picked first (`first_url`) and the
/// prefill/decode decision when there is a pair.
#[inline]
pub(super) fn observe_pick(
    m: &RouterMetrics,
    started: Instant,
    hit: PrefixHit,
    approx_len: usize,
    first_url: Option<&Arc<str>>,
    pd: PdChoice,
) {
    m.schedule_seconds.observe(started.elapsed().as_secs_f64());
    m.prefix_lookup(hit.index, hit.requested as u64, hit.matched as u64);
    m.index_blocks
        .get_or_create(&RouterMetrics::index("approx"))
        .set(approx_len as i64);
    if let Some(url) = first_url {
        m.picks.get_or_create(&RouterMetrics::endpoint(url)).inc();
    }
    if pd != PdChoice::Single {
        m.pd_decision(pd);
    }
}

/// The `failed{reason}` label of a decision that found no endpoint.
#[inline]
pub(super) fn failure_reason(e: &ScheduleError) -> &'static str {
    match e {
        ScheduleError::NoReadyEndpoint => "no_ready_endpoint",
        ScheduleError::UnknownModel(_) => "unknown_model",
        _ => "filtered",
    }
}
