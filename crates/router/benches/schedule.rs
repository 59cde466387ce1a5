//! One scheduling decision at 64 endpoints with a 100k-block prefix index.
//!
//! `cargo bench -p strata-router --bench schedule`
//!
//! Besides criterion's mean, prints p50/p99 over 200k timed decisions per profile (the
//! target is p99 < 20 µs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{black_box, Criterion};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_api::kv_events::KvEvent;
use strata_router::endpoint::{EndpointId, EndpointSpec, EngineKind};
use strata_router::prefix::approx::{ApproxConfig, ApproxIndex};
use strata_router::prefix::precise::PreciseIndex;
use strata_router::scheduling::{Candidate, Context, EndpointMetrics, SchedRequest};
use strata_router::{EndpointPicker, EndpointPickerConfig};

const ENDPOINTS: u32 = 64;
const INDEX_BLOCKS: usize = 100_000;
const CHAIN: usize = 100;
const REQUEST_BLOCKS: usize = 64;

struct Fixture {
    cands: Vec<Candidate>,
    approx: ApproxIndex,
    precise: PreciseIndex,
    chains: Vec<Vec<u64>>,
}

fn fixture() -> Fixture {
    let mut rng = StdRng::seed_from_u64(1);
    let now = Duration::from_secs(100);
    let cands: Vec<Candidate> = (0..ENDPOINTS)
        .map(|i| {
            let mut c = Candidate::new(
                EndpointId(i),
                EndpointSpec::new(format!("http://10.0.0.{i}:8000"), EngineKind::Vllm),
            );
            c.metrics = Some(EndpointMetrics {
                waiting: f64::from(rng.random_range(0..20u32)),
                running: f64::from(rng.random_range(0..64u32)),
                kv_use: Some(rng.random()),
                block_size: Some(16),
                updated: now,
                ..Default::default()
            });
            c.spec = Arc::new((*c.spec).clone());
            c
        })
        .collect();
    let mut approx = ApproxIndex::new(ApproxConfig {
        capacity_per_endpoint: INDEX_BLOCKS,
        ..ApproxConfig::default()
    });
    let mut precise = PreciseIndex::new();
    let mut chains = Vec::new();
    for _ in 0..INDEX_BLOCKS / CHAIN {
        let chain: Vec<u64> = (0..CHAIN).map(|_| rng.random()).collect();
        // Each chain is cached on 1..4 endpoints.
        for _ in 0..rng.random_range(1..4) {
            let ep = EndpointId(rng.random_range(0..ENDPOINTS));
            approx.record(ep, &chain);
            precise.apply(
                ep,
                &KvEvent::BlockStored {
                    block_hashes: chain.clone(),
                    parent_block_hash: None,
                    token_ids: vec![],
                    block_size: 16,
                    lora_id: None,
                    medium: None,
                    lora_name: None,
                },
            );
        }
        chains.push(chain);
    }
    Fixture {
        cands,
        approx,
        precise,
        chains,
    }
}

fn request(f: &Fixture, i: usize) -> SchedRequest {
    let blocks: Vec<u64> = f.chains[i % f.chains.len()][..REQUEST_BLOCKS].to_vec();
    SchedRequest {
        model: "m".into(),
        approx_blocks: blocks.clone(),
        precise_blocks: Some(strata_router::scheduling::PreciseBlocks::single(16, blocks)),
        seq: i as u64,
        ..Default::default()
    }
}

fn percentiles(name: &str, s: &EndpointPicker, f: &Fixture, ctx: &Context) {
    let mut rng = StdRng::seed_from_u64(9);
    let reqs: Vec<SchedRequest> = (0..1000).map(|i| request(f, i * 7)).collect();
    let mut times = Vec::with_capacity(200_000);
    for i in 0..200_000 {
        let t = Instant::now();
        let d = s.schedule(ctx, &reqs[i % reqs.len()], &f.cands, None, &mut rng);
        times.push(t.elapsed());
        black_box(d.ok());
    }
    times.sort();
    let p = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    println!(
        "{name}: p50 {:.2} µs, p99 {:.2} µs, p99.9 {:.2} µs (64 endpoints, {} index blocks, {REQUEST_BLOCKS}-block request)",
        p(0.5).as_secs_f64() * 1e6,
        p(0.99).as_secs_f64() * 1e6,
        p(0.999).as_secs_f64() * 1e6,
        f.precise.len()
    );
}

fn main() {
    let f = fixture();
    let ctx = Context {
        now: Duration::from_secs(100),
        stale_after: Duration::from_millis(200),
        approx: Some(&f.approx),
        precise: Some(&f.precise),
    };
    let default = EndpointPicker::default_profile();
    let precise = EndpointPickerConfig::weighted(&[
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("precise-prefix-cache-scorer", 3.0),
    ])
    .build()
    .expect("config");
    let mut c = Criterion::default().configure_from_args();
    let mut rng = StdRng::seed_from_u64(3);
    let reqs: Vec<SchedRequest> = (0..1000).map(|i| request(&f, i * 7)).collect();
    let mut i = 0;
    c.bench_function("schedule/default_approx_prefix/64ep_100k", |b| {
        b.iter(|| {
            i += 1;
            black_box(
                default
                    .schedule(&ctx, &reqs[i % reqs.len()], &f.cands, None, &mut rng)
                    .ok(),
            )
        })
    });
    c.bench_function("schedule/precise_prefix/64ep_100k", |b| {
        b.iter(|| {
            i += 1;
            black_box(
                precise
                    .schedule(&ctx, &reqs[i % reqs.len()], &f.cands, None, &mut rng)
                    .ok(),
            )
        })
    });
    c.final_summary();
    percentiles(
        "default (queue 2, kv 2, approx prefix 3)",
        &default,
        &f,
        &ctx,
    );
    percentiles(
        "precise (queue 2, kv 2, precise prefix 3)",
        &precise,
        &f,
        &ctx,
    );
}
