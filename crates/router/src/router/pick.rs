//! The pick: one scheduling decision for a request, the hottest path of the router (and,
//! through the same scheduler, of the simulator). [`Router::pick_within`] reads as its
//! stages; all but the last run under one hold of the pool's lock (and the precise
//! index's read lock, released as soon as the hit is measured).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::observe::{failure_reason, observe_pick, prefix_hit};
use super::pool::{names_adapter, refresh_ready, Pool};
use super::{Inner, RouteError, Router};
use crate::endpoint::EndpointId;
use crate::prefix::precise::PreciseIndex;
use crate::scheduling::{Candidate, Context, PdChoice, PdDecision, PickDecision, SchedRequest};

/// One endpoint chosen for a request: try `ranked` in order.
#[derive(Debug, Clone)]
pub struct Picked {
    pub decision: PickDecision,
    /// `(slot, base URL)` best first.
    pub ranked: Vec<(EndpointId, Arc<str>)>,
    /// When the request is disaggregated: the prefill engines, best first (never the
    /// decode pick). The proxy runs phase 1 there, then sends the request to `ranked`.
    pub prefill: Option<Vec<(EndpointId, Arc<str>)>>,
    /// What the prefill/decode pair decided ([`PdChoice::Single`] without one).
    pub pd: PdChoice,
}

impl Router {
    /// One scheduling decision. Counts the pick, records the request's prefix on the
    /// chosen endpoint in the approximate index, and returns the ranked endpoints.
    pub fn pick(&self, req: &mut SchedRequest) -> Result<Picked, RouteError> {
        self.pick_within(req, None)
    }

    /// [`Router::pick`] among only the endpoints whose base URL `allowed` accepts (the
    /// ext_proc transport's subset hint and selection header); the others count as not
    /// ready for this one decision.
    pub fn pick_within(
        &self,
        req: &mut SchedRequest,
        allowed: Option<&dyn Fn(&str) -> bool>,
    ) -> Result<Picked, RouteError> {
        req.seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let now = self.now();
        let started = Instant::now();
        let mut pool = self.inner.lock_pool();
        ready_within(&mut pool, now, allowed);
        let precise = self.inner.precise.read().unwrap_or_else(|e| e.into_inner());
        name_adapter(&pool.cands, req);
        let decision = self.inner.schedule(&mut pool, &precise, req, now)?;
        let first = decision.decode.pick();
        count_sent(&mut pool.cands, first);
        let hit = prefix_hit(
            self.inner.uses_precise,
            &pool.cands,
            &pool.approx,
            &precise,
            req,
            first,
        );
        drop(precise);
        let picked = record_and_rank(&mut pool, req, decision);
        let approx_len = pool.approx.len();
        drop(pool);
        observe_pick(
            &self.inner.metrics,
            started,
            hit,
            approx_len,
            picked.ranked.first().map(|(_, url)| url),
            picked.pd,
        );
        Ok(picked)
    }
}

impl Inner {
    /// The decision itself: the scheduler (with the prefill/decode pair, when configured)
    /// over the pool's candidates, split and RNG, both prefix indexes in its context. A
    /// failure is counted by its reason here.
    #[inline]
    fn schedule(
        &self,
        pool: &mut Pool,
        precise: &PreciseIndex,
        req: &SchedRequest,
        now: Duration,
    ) -> Result<PdDecision, RouteError> {
        let Pool {
            cands,
            split,
            rng,
            approx,
            ..
        } = pool;
        let ctx = Context {
            now,
            stale_after: self.config.stale_after(),
            approx: Some(&*approx),
            precise: Some(precise),
        };
        let split = (!split.is_empty()).then_some(&*split);
        self.scheduler
            .schedule_pd(&ctx, req, cands, split, rng)
            .map_err(|e| {
                self.metrics.fail(failure_reason(&e));
                e.into()
            })
    }
}

/// Readiness for this decision: each candidate's own (health and circuit at `now`), and
/// only where `allowed` accepts its URL. `refresh_ready` recomputes readiness before
/// every other read, so the restriction lasts for this decision only.
#[inline]
fn ready_within(pool: &mut Pool, now: Duration, allowed: Option<&dyn Fn(&str) -> bool>) {
    refresh_ready(pool, now);
    if let Some(allowed) = allowed {
        for c in pool.cands.iter_mut() {
            c.ready = c.ready && allowed(&c.spec.url);
        }
    }
}

/// A request for a model that some endpoint advertises as a LoRA adapter asks for that
/// adapter (the scheduler's LoRA affinity reads it).
#[inline]
fn name_adapter(cands: &[Candidate], req: &mut SchedRequest) {
    if req.lora.is_none() && names_adapter(cands, &req.model) {
        req.lora = Some(req.model.clone());
    }
}

/// Until its next scrape shows it, the request counts against the pick's room.
#[inline]
fn count_sent(cands: &mut [Candidate], first: EndpointId) {
    if let Some(c) = cands.iter_mut().find(|c| c.id == first) {
        c.sent_since_scrape = c.sent_since_scrape.saturating_add(1);
    }
}

/// Records the request's prefix on the pick (and on the prefill pick, which computes and
/// then caches the same blocks) in the approximate index, and turns the decisions' slots
/// into `(slot, base URL)` rankings.
#[inline]
fn record_and_rank(pool: &mut Pool, req: &SchedRequest, d: PdDecision) -> Picked {
    pool.approx.record(d.decode.pick(), &req.approx_blocks);
    let ranked = ranked_urls(pool, &d.decode);
    let prefill = d.prefill.map(|p| {
        pool.approx.record(p.pick(), &req.approx_blocks);
        ranked_urls(pool, &p)
    });
    Picked {
        decision: d.decode,
        ranked,
        prefill,
        pd: d.choice,
    }
}

/// The base URLs of a decision's ranking, best first (slots no longer in the pool left
/// out).
#[inline]
fn ranked_urls(pool: &Pool, d: &PickDecision) -> Vec<(EndpointId, Arc<str>)> {
    d.ranked
        .iter()
        .filter_map(|s| {
            pool.cands
                .iter()
                .find(|c| c.id == s.id)
                .map(|c| (c.id, Arc::<str>::from(c.spec.url.as_str())))
        })
        .collect()
}
