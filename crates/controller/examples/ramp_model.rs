//! The autoscaling policy against a fixed deployment and a CPU-style threshold policy, on a
//! *modelled* replica in virtual time (not a measurement: the live comparison runs in
//! `strata up`). Load: 1 → 16 concurrent streams over 300 s, 120 s at 16, back to 1 over
//! 300 s, 120 s at 1; min 1 / max 3 replicas; a replica takes `COLD_START` s to load.
//!
//! Replica model: 4 batch slots; a request's prefill takes `0.3 × (1 + 0.1 × batch)` s;
//! streams beyond the slots queue, and wait `queue / throughput`; the router spreads streams
//! evenly over ready replicas.
//!
//! `cargo run -p strata-controller --example ramp_model [-- --csv out.csv]`

use std::time::Duration;

use strata_controller::autoscale::{
    decide, AutoscaleConfig, Load, PolicyKind, Signals, State, ThresholdConfig,
};

const DT: f64 = 0.5;
const COLD_START: f64 = 20.0;
const SLOTS: f64 = 4.0;
const OUTPUT_TOKENS: f64 = 64.0;

fn streams(t: f64) -> f64 {
    if t < 300.0 {
        1.0 + 15.0 * t / 300.0
    } else if t < 420.0 {
        16.0
    } else if t < 720.0 {
        16.0 - 15.0 * (t - 420.0) / 300.0
    } else {
        1.0
    }
}
const END: f64 = 840.0;

/// (ttft seconds, requests per second) for `n` streams on `ready` replicas.
fn replica_model(n: f64, ready: f64) -> (f64, f64, f64, f64) {
    let ready = ready.max(1e-9);
    let per = n / ready;
    let batch = per.min(SLOTS);
    let prefill = 0.3 * (1.0 + 0.1 * batch);
    let itl = 0.02 + 0.01 * batch;
    let service = prefill + OUTPUT_TOKENS * itl;
    let throughput = batch / service; // requests per second per replica
    let waiting = (per - SLOTS).max(0.0);
    let wait = if waiting > 0.0 {
        waiting / throughput
    } else {
        0.0
    };
    (
        wait + prefill,
        throughput * ready,
        waiting * ready,
        batch * ready,
    )
}

trait Policy {
    fn name(&self) -> &'static str;
    fn desired(&mut self, t: f64, ready: u32, waiting: f64, running: f64, ttft: f64) -> u32;
}

struct Fixed(u32);
impl Policy for Fixed {
    fn name(&self) -> &'static str {
        "fixed 3"
    }
    fn desired(&mut self, _: f64, _: u32, _: f64, _: f64, _: f64) -> u32 {
        self.0
    }
}

/// The HPA's CPU rule (`policy: threshold`): desired = ceil(ready × busy / 70 %), evaluated
/// every 15 s, scale-in only to the highest recommendation of the last 300 s.
fn threshold() -> Strata {
    let cfg = AutoscaleConfig {
        policy: PolicyKind::Threshold,
        threshold: ThresholdConfig {
            slots: SLOTS,
            ..ThresholdConfig::default()
        },
        ..AutoscaleConfig::default()
    };
    Strata {
        name: "threshold (HPA-style, 70% busy)",
        cfg,
        state: State::new(1),
    }
}

struct Strata {
    name: &'static str,
    cfg: AutoscaleConfig,
    state: State,
}
impl Policy for Strata {
    fn name(&self) -> &'static str {
        self.name
    }
    fn desired(&mut self, t: f64, ready: u32, waiting: f64, running: f64, ttft: f64) -> u32 {
        let signals = Signals {
            ready,
            load: Some(Load {
                waiting,
                running,
                kv_usage: Some(running / (f64::from(ready.max(1)) * SLOTS) * 0.9),
                ttft_p90_secs: Some(ttft),
                inflight_tokens: None,
            }),
            partial: None,
            held_requests: 0,
        };
        let (d, s) = decide(&self.cfg, &self.state, &signals, Duration::from_secs_f64(t));
        self.state = s;
        d.desired
    }
}

struct Run {
    name: &'static str,
    replica_seconds: f64,
    ttft_p90: f64,
    ttft_max: f64,
    rows: Vec<(f64, u32, f64, f64)>,
}

fn simulate(policy: &mut dyn Policy, start: u32) -> Run {
    let mut ready = start;
    let mut pending: Vec<f64> = Vec::new(); // ready times of starting replicas
    let mut t = 0.0;
    let mut replica_seconds = 0.0;
    let mut samples: Vec<(f64, f64)> = Vec::new(); // (ttft, weight = requests)
    let mut rows = Vec::new();
    let mut last = (0.0, 0.0, 0.0);
    while t <= END {
        pending.retain(|&at| {
            if at <= t {
                ready += 1;
                false
            } else {
                true
            }
        });
        let n = streams(t);
        let (ttft, rps, waiting, running) = replica_model(n, f64::from(ready));
        samples.push((ttft, rps * DT));
        let desired = policy.desired(t, ready, last.1, last.2, last.0);
        last = (ttft, waiting, running);
        let have = ready + pending.len() as u32;
        if desired > have {
            for _ in have..desired {
                pending.push(t + COLD_START);
            }
        } else if desired < have {
            let mut drop = have - desired;
            while drop > 0 && !pending.is_empty() {
                pending.pop();
                drop -= 1;
            }
            ready = ready.saturating_sub(drop);
        }
        replica_seconds += f64::from(ready + pending.len() as u32) * DT;
        rows.push((t, ready, waiting, ttft));
        t += DT;
    }
    samples.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: f64 = samples.iter().map(|s| s.1).sum();
    let mut acc = 0.0;
    let mut p90 = 0.0;
    for s in &samples {
        acc += s.1;
        if acc >= 0.9 * total {
            p90 = s.0;
            break;
        }
    }
    Run {
        name: policy.name(),
        replica_seconds,
        ttft_p90: p90,
        ttft_max: samples.last().map(|s| s.0).unwrap_or(0.0),
        rows,
    }
}

fn main() {
    let csv = std::env::args().skip_while(|a| a != "--csv").nth(1);
    let cfg = AutoscaleConfig {
        min_replicas: 1,
        max_replicas: 3,
        target_concurrency: SLOTS,
        target_queue_depth: 1.0,
        target_ttft_p90_secs: Some(2.0),
        cold_start_secs: COLD_START,
        ..AutoscaleConfig::default()
    };
    let runs = [
        simulate(&mut Fixed(3), 3),
        simulate(&mut threshold(), 1),
        simulate(
            &mut Strata {
                name: "strata autoscale",
                cfg,
                state: State::new(1),
            },
            1,
        ),
    ];
    println!("| policy | replica-seconds | vs fixed 3 | TTFT p90 (s) | TTFT max (s) |");
    println!("|---|---|---|---|---|");
    for r in &runs {
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {:.2} |",
            r.name,
            r.replica_seconds,
            r.replica_seconds / runs[0].replica_seconds,
            r.ttft_p90,
            r.ttft_max
        );
    }
    if let Some(path) = csv {
        let mut out = String::from("t,streams");
        for r in &runs {
            out.push_str(&format!(",{0} replicas,{0} waiting,{0} ttft", r.name));
        }
        out.push('\n');
        for i in 0..runs[0].rows.len() {
            let t = runs[0].rows[i].0;
            out.push_str(&format!("{t},{:.2}", streams(t)));
            for r in &runs {
                let (_, ready, waiting, ttft) = r.rows[i];
                out.push_str(&format!(",{ready},{waiting:.2},{ttft:.3}"));
            }
            out.push('\n');
        }
        if let Err(e) = std::fs::write(&path, out) {
            eprintln!("{path}: {e}");
            std::process::exit(1);
        }
    }
}
