//! One decision of the default profile (queue ×2, KV ×2, approximate prefix ×3,
//! max-score) over a pool of candidates, timed: what a router, or the simulator at a
//! thousand replicas, pays per request.
//!
//! `cargo run --release -p strata-router --example pick_bench -- [candidates] [picks]
//! [holders]` (default 1000, 200000 and 0): `holders` endpoints hold the prompt's first 8
//! chunks in the approximate index (0: a prompt nobody has seen, as every one of the
//! simulator's random load). Between picks one candidate's scrape and in-flight count
//! change, as they do between requests; the candidates stay in the cache, so this is
//! the decision's own cost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use strata_router::endpoint::{EndpointId, EndpointSpec, EngineKind};
use strata_router::prefix::approx::ApproxIndex;
use strata_router::scheduling::{Candidate, Context, EndpointMetrics, PickScratch, SchedRequest};
use strata_router::EndpointPicker;

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let (n, picks, holders) = (arg(1, 1000).max(1), arg(2, 200_000), arg(3, 0));
    let spec = Arc::new(EndpointSpec::new("bench://replica", EngineKind::Strata));
    let now = Duration::from_secs(10);
    let mut cands: Vec<Candidate> = (0..n as u32)
        .map(|i| {
            let mut c = Candidate::with_spec(EndpointId(i), spec.clone());
            c.metrics = Some(EndpointMetrics {
                waiting: f64::from(i % 7),
                running: 5.0,
                kv_use: Some(f64::from(i % 13) / 13.0),
                updated: now,
                ..Default::default()
            });
            c
        })
        .collect();
    let mut approx = ApproxIndex::new(Default::default());
    let blocks: Vec<u64> = (0..32).collect();
    for h in 0..holders.min(n) as u32 {
        approx.record(EndpointId(h), &blocks[..8]);
    }
    let picker = EndpointPicker::default_profile();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut scratch = PickScratch::default();
    let req = SchedRequest {
        approx_blocks: blocks,
        ..Default::default()
    };
    let mut checksum = 0u64;
    let started = Instant::now();
    for k in 0..picks {
        let ctx = Context {
            now,
            stale_after: Duration::from_millis(200),
            approx: Some(&approx),
            precise: None,
        };
        match picker.schedule_first(&ctx, &req, &cands, None, &mut rng, &mut scratch) {
            Ok(d) => checksum = checksum.wrapping_add(u64::from(d.pick().0)),
            Err(e) => {
                eprintln!("error: {e}");
                return;
            }
        }
        let c = &mut cands[(k * 7919) % n];
        c.in_flight += 1;
        if let Some(m) = c.metrics.as_mut() {
            m.waiting = (k % 9) as f64;
        }
    }
    let per_pick = started.elapsed().as_secs_f64() / picks.max(1) as f64;
    println!(
        "{n} candidates, {holders} holding the prompt's start: {:.2} us per pick ({:.1} ns per \
         candidate; picks checksum {checksum})",
        per_pick * 1e6,
        per_pick * 1e9 / n as f64
    );
}
