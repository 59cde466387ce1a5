//! The scorers' formulas, each checked on a small pool.

use super::super::testutil::*;
use super::super::PreciseBlocks;
use super::*;
use crate::endpoint::EndpointId;
use crate::prefix::approx::ApproxIndex;
use crate::prefix::precise::PreciseIndex;
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};
use rand::rngs::StdRng;
use rand::SeedableRng;
use strata_api::kv_events::KvEvent;

fn run(s: &dyn Scorer, ctx: &Context, req: &SchedRequest, cs: &[Candidate]) -> Vec<f64> {
    let refs: Vec<&Candidate> = cs.iter().collect();
    let mut out = vec![0.0; cs.len()];
    s.score(ctx, req, &refs, &mut out, &mut StdRng::seed_from_u64(0));
    out
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
