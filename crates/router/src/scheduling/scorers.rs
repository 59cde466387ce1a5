//! Scorers: each gives every candidate a score in 0..1 (PROTOCOLS §6 for the formulas).

use rand::{Rng, RngCore};
use smallvec::SmallVec;
use xxhash_rust::xxh64::xxh64;

use super::filters::has_free_slot;
use super::{Candidate, Context, SchedRequest, Scorer};
use crate::endpoint::EndpointId;
use crate::prefix::PrefixMatch;

/// `(max - x) / (max - min)` over the known values, 1 when all equal; unknown gets 0.
/// `value(i)` is the `i`-th value, read once: known values wait in `out` (a bit each
/// marks them; an unknown one waits as NaN, which `f64::min` and `f64::max` pass over,
/// as they pass over a known NaN) while the minimum and maximum are found, then become
/// scores in place, by the same operations as reading them twice. A pool of a thousand
/// endpoints is one pass over their records instead of two, and allocates nothing.
fn min_max_inverse(value: impl Fn(usize) -> Option<f64>, out: &mut [f64]) {
    let mut known: SmallVec<[u64; 16]> = SmallVec::from_elem(0, out.len().div_ceil(64));
    for ((w, chunk), word) in out.chunks_mut(64).enumerate().zip(known.iter_mut()) {
        let mut bits = 0u64;
        for (j, o) in chunk.iter_mut().enumerate() {
            *o = match value(w * 64 + j) {
                Some(v) => {
                    bits |= 1 << j;
                    v
                }
                None => f64::NAN,
            };
        }
        *word = bits;
    }
    let (min, max) = min_max(out);
    if max <= min {
        for (i, o) in out.iter_mut().enumerate() {
            *o = if (known[i / 64] >> (i % 64)) & 1 == 0 {
                0.0
            } else {
                1.0
            };
        }
        return;
    }
    // Every entry divided (a loop the compiler vectorizes), then the unknown ones, a
    // bit each, set to 0.
    let range = max - min;
    out.iter_mut().for_each(|o| *o = (max - *o) / range);
    for (w, &bits) in known.iter().enumerate() {
        let mut unknown = !bits;
        while unknown != 0 {
            let i = w * 64 + unknown.trailing_zeros() as usize;
            match out.get_mut(i) {
                Some(o) => *o = 0.0,
                None => break,
            }
            unknown &= unknown - 1;
        }
    }
}

/// The least and greatest of `values`, NaNs passed over (infinite when there is no
/// other). Four of each run side by side, which a pass in order cannot: the minimum of a
/// set is the same in any order, but for a zero's sign. That sign changes no score of a
/// set without negative values (queues and counts; `min_max_inverse_equals_two_passes_bit_for_bit`),
/// and otherwise only a zero score's sign, which a weighted total never shows (a sum
/// that starts at +0 is never -0).
fn min_max(values: &[f64]) -> (f64, f64) {
    let mut min = [f64::INFINITY; 4];
    let mut max = [f64::NEG_INFINITY; 4];
    let chunks = values.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..4 {
            min[k] = min[k].min(c[k]);
            max[k] = max[k].max(c[k]);
        }
    }
    for (k, &v) in rest.iter().enumerate() {
        min[k] = min[k].min(v);
        max[k] = max[k].max(v);
    }
    (
        min[0].min(min[1]).min(min[2].min(min[3])),
        max[0].max(max[1]).max(max[2].max(max[3])),
    )
}

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

/// Per-candidate prefix matches; inline for up to 64 candidates.
type Matches = SmallVec<[PrefixMatch; 64]>;

fn ids<'a>(cands: &'a [&Candidate]) -> impl Iterator<Item = EndpointId> + Clone + 'a {
    cands.iter().map(|c| c.id)
}

fn prefix_scores(matches: &[PrefixMatch], total: usize, lower_weight: f64, out: &mut [f64]) {
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

/// LoRA affinity: 1.0 adapter running, 0.8 free slot, 0.6 adapter waiting, else 0. A
/// request without an adapter scores every candidate 1.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoraAffinityScorer;

impl Scorer for LoraAffinityScorer {
    fn score(
        &self,
        _: &Context,
        req: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        let Some(adapter) = req.lora.as_deref() else {
            out.iter_mut().for_each(|o| *o = 1.0);
            return;
        };
        for (o, c) in out.iter_mut().zip(cands) {
            *o = match &c.metrics {
                None => 0.0,
                Some(m) if m.lora_running.iter().any(|a| a == adapter) => 1.0,
                Some(m) if has_free_slot(m) => 0.8,
                Some(m) if m.lora_waiting.iter().any(|a| a == adapter) => 0.6,
                Some(_) => 0.0,
            };
        }
    }
}

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

/// Load-aware (llm-d): 0.5 with an empty queue, falling linearly to 0 at `threshold`
/// waiting requests; stale metrics score 0.
#[derive(Debug, Clone, Copy)]
pub struct LoadAwareScorer {
    pub threshold: f64,
}

impl Default for LoadAwareScorer {
    fn default() -> Self {
        LoadAwareScorer { threshold: 128.0 }
    }
}

impl Scorer for LoadAwareScorer {
    fn score(
        &self,
        ctx: &Context,
        _: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        for (o, c) in out.iter_mut().zip(cands) {
            *o = match c.fresh_metrics(ctx.now, ctx.stale_after) {
                None => 0.0,
                Some(m) if m.waiting <= 0.0 => 0.5,
                Some(m) => 0.5 * (1.0 - (m.waiting / self.threshold.max(1.0)).min(1.0)),
            };
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::PreciseBlocks;
    use super::*;
    use crate::prefix::approx::ApproxIndex;
    use crate::prefix::precise::PreciseIndex;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use strata_api::kv_events::KvEvent;

    fn run(s: &dyn Scorer, ctx: &Context, req: &SchedRequest, cs: &[Candidate]) -> Vec<f64> {
        let refs: Vec<&Candidate> = cs.iter().collect();
        let mut out = vec![0.0; cs.len()];
        s.score(ctx, req, &refs, &mut out, &mut StdRng::seed_from_u64(0));
        out
    }

    /// The two-pass form `min_max_inverse` replaces.
    fn min_max_two_passes(values: &[Option<f64>]) -> Vec<f64> {
        let (min, max) = values
            .iter()
            .flatten()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        values
            .iter()
            .map(|v| match *v {
                None => 0.0,
                Some(_) if max <= min => 1.0,
                Some(v) => (max - v) / (max - min),
            })
            .collect()
    }

    proptest::proptest! {
        #[test]
        fn min_max_inverse_equals_two_passes_bit_for_bit(
            values in proptest::collection::vec(
                proptest::option::weighted(0.8, proptest::prop_oneof![
                    6 => 0.0f64..50.0,
                    1 => proptest::sample::select(vec![0.0, -0.0, f64::NAN, f64::INFINITY, 3.0]),
                ]),
                0..1100,
            ),
        ) {
            let mut out = vec![7.0; values.len()];
            min_max_inverse(|i| values[i], &mut out);
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits(&out), bits(&min_max_two_passes(&values)));
        }
    }

    #[test]
    fn queue_and_kv_formulas() {
        let mut cs = vec![
            cand(0, 2.0, 0.25),
            cand(1, 6.0, 1.0),
            cand(2, 4.0, 0.0),
            cand(3, 0.0, 0.5),
        ];
        cs[3].metrics.as_mut().unwrap().updated = std::time::Duration::ZERO; // stale
        let ctx = Context::at(now());
        let r = SchedRequest::default();
        assert_eq!(run(&QueueScorer, &ctx, &r, &cs), vec![1.0, 0.0, 0.5, 0.0]);
        assert_eq!(
            run(&KvCacheUtilizationScorer, &ctx, &r, &cs),
            vec![0.75, 0.0, 1.0, 0.0]
        );
        let eq = vec![cand(0, 3.0, 0.0), cand(1, 3.0, 0.0)];
        assert_eq!(run(&QueueScorer, &ctx, &r, &eq), vec![1.0, 1.0]);
        let mut nokv = vec![cand(0, 0.0, 0.0)];
        nokv[0].metrics.as_mut().unwrap().kv_use = None;
        assert_eq!(run(&KvCacheUtilizationScorer, &ctx, &r, &nokv), vec![0.5]);
    }

    #[test]
    fn precise_prefix_is_tier_aware_and_falls_back() {
        let cs = vec![cand(0, 0.0, 0.0), cand(1, 0.0, 0.0), cand(2, 0.0, 0.0)];
        let mut precise = PreciseIndex::new();
        let stored = |h: Vec<u64>, medium: &str| KvEvent::BlockStored {
            block_hashes: h,
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 16,
            lora_id: None,
            medium: Some(medium.into()),
            lora_name: None,
        };
        precise.apply(EndpointId(0), &stored(vec![1, 2], "GPU"));
        precise.apply(EndpointId(1), &stored(vec![1, 2, 3], "GPU"));
        precise.apply(EndpointId(2), &stored(vec![1, 2, 3, 4], "CPU"));
        let mut approx = ApproxIndex::new(Default::default());
        approx.record(EndpointId(2), &[9]);
        let ctx = Context {
            precise: Some(&precise),
            approx: Some(&approx),
            ..Context::at(now())
        };
        let s = PrecisePrefixCacheScorer {
            lower_tier_weight: 0.5,
        };
        let req = SchedRequest {
            precise_blocks: Some(PreciseBlocks::single(16, vec![1, 2, 3, 4])),
            approx_blocks: vec![9, 8],
            ..Default::default()
        };
        assert_eq!(run(&s, &ctx, &req, &cs), vec![0.5, 0.75, 0.5]);
        let req = SchedRequest {
            precise_blocks: None,
            ..req
        };
        assert_eq!(
            run(&s, &ctx, &req, &cs),
            vec![0.0, 0.0, 0.5],
            "approximate fallback"
        );
        assert_eq!(
            run(&PrefixCacheScorer, &ctx, &req, &cs),
            vec![0.0, 0.0, 0.5]
        );
    }

    #[test]
    fn lora_scores() {
        let mut cs = vec![
            cand(0, 0.0, 0.0),
            cand(1, 0.0, 0.0),
            cand(2, 0.0, 0.0),
            cand(3, 0.0, 0.0),
        ];
        cs[0].metrics.as_mut().unwrap().lora_running = vec!["a".into()];
        cs[0].metrics.as_mut().unwrap().max_lora = Some(1);
        cs[1].metrics.as_mut().unwrap().max_lora = Some(2);
        cs[2].metrics.as_mut().unwrap().lora_waiting = vec!["a".into()];
        cs[2].metrics.as_mut().unwrap().max_lora = Some(1);
        let req = SchedRequest {
            lora: Some("a".into()),
            ..Default::default()
        };
        assert_eq!(
            run(&LoraAffinityScorer, &Context::at(now()), &req, &cs),
            vec![1.0, 0.8, 0.6, 0.0]
        );
    }

    #[test]
    fn session_is_sticky_and_moves_only_when_its_endpoint_goes() {
        let cs: Vec<Candidate> = (0..5).map(|i| cand(i, 0.0, 0.0)).collect();
        let ctx = Context::at(now());
        let req = |s: &str| SchedRequest {
            session: Some(s.into()),
            ..Default::default()
        };
        let winner = |cs: &[Candidate], s: &str| {
            let out = run(&SessionAffinityScorer, &ctx, &req(s), cs);
            assert_eq!(out.iter().filter(|v| **v == 1.0).count(), 1);
            cs[out.iter().position(|v| *v == 1.0).unwrap()].id
        };
        let mut moved = 0;
        for i in 0..50 {
            let s = format!("user-{i}");
            let w = winner(&cs, &s);
            assert_eq!(w, winner(&cs, &s));
            let without_4: Vec<Candidate> = cs[..4].to_vec();
            let w2 = winner(&without_4, &s);
            if w.0 != 4 {
                assert_eq!(w, w2);
            } else {
                moved += 1;
            }
        }
        assert!(moved > 0 && moved < 50);
        assert_eq!(
            run(&SessionAffinityScorer, &ctx, &SchedRequest::default(), &cs),
            vec![0.0; 5]
        );
    }

    #[test]
    fn load_least_request_round_robin_random() {
        let mut cs = vec![cand(0, 0.0, 0.0), cand(1, 64.0, 0.0), cand(2, 500.0, 0.0)];
        let ctx = Context::at(now());
        let r = SchedRequest::default();
        assert_eq!(
            run(&LoadAwareScorer::default(), &ctx, &r, &cs),
            vec![0.5, 0.25, 0.0]
        );
        cs[0].in_flight = 4;
        cs[1].in_flight = 0;
        cs[2].in_flight = 2;
        assert_eq!(run(&LeastRequestScorer, &ctx, &r, &cs), vec![0.0, 1.0, 0.5]);
        for seq in 0..6u64 {
            let req = SchedRequest {
                seq,
                ..Default::default()
            };
            let out = run(&RoundRobinScorer, &ctx, &req, &cs);
            assert_eq!(out[(seq % 3) as usize], 1.0);
            assert_eq!(out.iter().sum::<f64>(), 1.0);
        }
        let out = run(&RandomScorer, &ctx, &r, &cs);
        assert!(out.iter().all(|v| (0.0..1.0).contains(v)));
    }
}
