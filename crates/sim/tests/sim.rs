//! The simulator end to end: determinism, the step-time model in the loop, the router's
//! picks against the scheduling library's, the autoscaler's decisions against its own
//! tests' expectations, the planner, and bad input.

use std::time::Duration;

use clap::Parser;
use strata_controller::autoscale::{AutoscaleConfig, Reason};
use strata_sim::profile::{HardwareProfile, ModelProfile, StepModel, StepShape};
use strata_sim::{simulate, AutoscaleSetup, SimConfig, SimError};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    fleet: strata_sim::FleetArgs,
    #[command(flatten)]
    run: strata_bench::RunArgs,
}

/// A configuration from command-line flags, exactly as `strata sim` builds it.
fn config(flags: &str, replicas: u32) -> SimConfig {
    try_config(flags, replicas).unwrap()
}

fn try_config(flags: &str, replicas: u32) -> Result<SimConfig, SimError> {
    let argv = std::iter::once("sim").chain(flags.split_whitespace());
    let cli = Cli::try_parse_from(argv).map_err(|e| SimError::Config {
        what: "flags".into(),
        message: e.to_string(),
    })?;
    cli.fleet.config(&cli.run, replicas)
}

fn json(r: &strata_bench::Report) -> serde_json::Value {
    serde_json::to_value(r).unwrap()
}

#[test]
fn same_seed_same_report_and_another_seed_another() {
    let flags = "--hardware l4 --model-profile llama-3.1-8b --workload shared-prefix \
                 --groups 3 --prompts-per-group 4 --system-len 300 --question-len 20 \
                 --output-len 24 --rate 20 --requests 60 --seed 7";
    let a = simulate(&config(flags, 3)).unwrap();
    let b = simulate(&config(flags, 3)).unwrap();
    assert_eq!(a.report.requests.completed, 60);
    assert_eq!(json(&a.report), json(&b.report));
    assert_eq!(a.stats.events, b.stats.events);
    // The shared prefixes are found in the replicas' prefix caches.
    assert!(a.report.tokens.prefix_cache_hit_rate.unwrap() > 0.3);
    let c = simulate(&config(&flags.replace("--seed 7", "--seed 8"), 3)).unwrap();
    assert_ne!(
        json(&a.report)["request_lines"],
        json(&c.report)["request_lines"]
    );
}

#[test]
fn one_request_takes_exactly_the_modelled_steps() {
    // 100 prompt tokens, 5 output tokens, one replica: one prefill step yields the first
    // token, then four decode steps.
    let cfg = config(
        "--hardware h100 --model-profile llama-3.1-8b --input-len 100 --output-len 5 \
         --requests 1 --seed 1",
        1,
    );
    let out = simulate(&cfg).unwrap();
    let sm = StepModel::new(
        HardwareProfile::named("h100").unwrap(),
        ModelProfile::named("llama-3.1-8b").unwrap(),
        1,
    )
    .unwrap();
    let mut prefill = StepShape::default();
    prefill.add(0, 100, true);
    let ttft = out.report.latency_ms.ttft.as_ref().unwrap().p50 / 1e3;
    assert!((ttft - sm.step_time(&prefill)).abs() < 1e-6, "{ttft}");
    let e2e = out.report.latency_ms.e2e.as_ref().unwrap().p50 / 1e3;
    let mut want = sm.step_time(&prefill);
    for pos in 100..104 {
        let mut d = StepShape::default();
        d.add(pos, 1, true);
        want += sm.step_time(&d);
    }
    assert!((e2e - want).abs() < 1e-6, "{e2e} vs {want}");
    assert_eq!(out.report.tokens.output_total, 5);
    assert_eq!(out.stats.steps, 5);
}

#[test]
fn more_load_queues_and_more_replicas_relieve_it() {
    let flags = "--hardware l4 --model-profile llama-3.1-8b --input-len 512 --output-len 64 \
                 --rate 40 --requests 200 --seed 3";
    let one = simulate(&config(flags, 1)).unwrap();
    let four = simulate(&config(flags, 4)).unwrap();
    let p90 = |o: &strata_sim::SimOutcome| o.report.latency_ms.ttft.as_ref().unwrap().p90;
    assert!(
        p90(&four) < p90(&one) / 2.0,
        "{} vs {}",
        p90(&four),
        p90(&one)
    );
    assert_eq!(four.report.served_by.len(), 4);
}

#[test]
fn requests_beyond_the_context_fail_like_the_engine_refuses_them() {
    let cfg = config(
        "--hardware h100 --model-profile smollm2-135m --input-len 9000 --output-len 8 \
         --requests 3 --seed 1",
        1,
    );
    let out = simulate(&cfg).unwrap();
    assert_eq!(out.report.requests.failed, 3);
    assert_eq!(out.report.errors.get("http_400"), Some(&3));
}

#[test]
fn bad_flags_and_configs_are_typed_errors() {
    assert!(matches!(
        try_config("--hardware tpu", 1),
        Err(SimError::UnknownProfile { .. })
    ));
    assert!(matches!(
        try_config("--model-profile gpt-9", 1),
        Err(SimError::UnknownProfile { .. })
    ));
    assert!(try_config("--tp 3", 1).is_err());
    assert!(try_config("--warmup 5", 1).is_err());
    // 70B in BF16 on one L4 leaves no KV cache.
    let cfg = config("--hardware l4 --model-profile llama-3.1-70b", 1);
    assert!(simulate(&cfg).is_err());
    let mut cfg = config("", 1);
    cfg.scrape_interval = Duration::ZERO;
    assert!(simulate(&cfg).is_err());
    let mut cfg = config("", 0);
    cfg.replicas = 0;
    assert!(simulate(&cfg).is_err());
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("router.yaml");
    std::fs::write(&bad, "scheduling: [not, a, map]\n").unwrap();
    assert!(try_config(&format!("--routing-config {}", bad.display()), 1).is_err());
    let bad = dir.path().join("controller.yaml");
    std::fs::write(&bad, "autoscale:\n  minReplicas: 4\n  maxReplicas: 2\n").unwrap();
    assert!(try_config(&format!("--autoscale {}", bad.display()), 1).is_err());
    std::fs::write(&bad, "autoscale:\n  maxReplica: 2\n").unwrap();
    assert!(try_config(&format!("--autoscale {}", bad.display()), 1).is_err());
    assert!(try_config("--routing-config /nonexistent/router.yaml", 1).is_err());
    let bad = dir.path().join("hw.json");
    std::fs::write(
        &bad,
        r#"{"name":"x","peak_flops":-1,"mem_bandwidth":1,"memory_bytes":1,"step_overhead_s":0}"#,
    )
    .unwrap();
    assert!(try_config(&format!("--hardware-profile {}", bad.display()), 1).is_err());
}

fn autoscaled(
    flags: &str,
    policy: AutoscaleConfig,
    start: u32,
    cold: f64,
) -> strata_sim::SimOutcome {
    let mut sim = config(flags, start);
    sim.autoscale = Some(AutoscaleSetup {
        config: policy,
        interval: Duration::from_secs(2),
        cold_start: Duration::from_secs_f64(cold),
    });
    simulate(&sim).unwrap()
}

#[test]
fn autoscaler_settles_on_the_proportional_count_as_its_unit_test_expects() {
    // The policy's own test: 20 in flight at 8 per replica settles on 3, signal
    // concurrency, reason steady. Here 20 closed-loop users keep 20 in flight.
    let c = AutoscaleConfig {
        min_replicas: 1,
        max_replicas: 10,
        ..AutoscaleConfig::default()
    };
    let out = autoscaled(
        "--hardware h100 --model-profile llama-3.1-8b --input-len 128 --output-len 32 \
         --concurrency 20 --duration 150s --seed 2",
        c,
        1,
        5.0,
    );
    let last = out.stats.decisions.last().unwrap();
    assert_eq!(last.desired, 3, "{:?}", out.stats.decisions);
    assert_eq!(last.reason, format!("{:?}", Reason::Steady));
    assert_eq!(out.report.requests.failed, 0);
    assert_eq!(out.stats.max_replicas, 3);
    // Cold start counts: more replica-seconds than replicas ready for the whole run would
    // explain from t=0 alone is impossible; fewer than three replicas all along.
    assert!(out.stats.replica_seconds < 3.0 * out.stats.virtual_s);
    assert!(out.stats.replica_seconds > out.stats.virtual_s);
}

#[test]
fn autoscaler_activates_from_zero_and_held_requests_are_served() {
    // The policy's own test: at zero replicas a request held by the router activates one
    // replica at once (reason activation).
    let c = AutoscaleConfig {
        min_replicas: 0,
        max_replicas: 4,
        ..AutoscaleConfig::default()
    };
    let out = autoscaled(
        "--hardware h100 --model-profile llama-3.1-8b --input-len 64 --output-len 16 \
         --rate 2 --requests 10 --seed 4",
        c,
        0,
        3.0,
    );
    let first = &out.stats.decisions[0];
    assert_eq!(
        (first.previous, first.desired),
        (0, 1),
        "{:?}",
        out.stats.decisions
    );
    assert_eq!(first.reason, format!("{:?}", Reason::Activation));
    assert_eq!(out.report.requests.completed, 10);
    // The first request waited for the cold start (3 s) before its prefill.
    assert!(out.report.latency_ms.ttft.as_ref().unwrap().max >= 3000.0);
}

#[test]
fn plan_finds_the_smallest_fleet_meeting_the_objective() {
    let base = config(
        "--hardware l4 --model-profile llama-3.1-8b --input-len 256 --output-len 32 \
         --rate 30 --requests 150 --seed 5",
        1,
    );
    let goals = strata_sim::plan::parse_objectives("ttft_p90=400ms").unwrap();
    let p = strata_sim::plan::plan(&base, &[1], 16, &goals).unwrap();
    let best = p.best.clone().expect("some fleet meets it");
    assert!(best.replicas > 1, "{}", p.render_text());
    // One replica fewer fails (it was tried, or is below a failing count).
    let fewer = p
        .trials
        .iter()
        .filter(|t| t.replicas < best.replicas)
        .max_by_key(|t| t.replicas)
        .unwrap();
    assert!(!fewer.met);
    assert_eq!(fewer.replicas, best.replicas - 1, "{}", p.render_text());
}

#[test]
fn flow_control_same_seed_same_report_and_fair_shares_for_a_quiet_tenant() {
    // One replica of 8 sequences at most, a noisy tenant at 10x a quiet one's rate: the
    // replica is saturated and a queue builds.
    let flags = "--hardware l4 --model-profile llama-3.1-8b --workload random \
                 --input-len 256 --output-len 64 --rate 12 --requests 300 --seed 5 \
                 --max-num-seqs 8 --tenants noisy=10,quiet=1";
    let tenant = |o: &strata_sim::SimOutcome, name: &str| {
        o.stats
            .tenants
            .iter()
            .find(|t| t.tenant == name)
            .cloned()
            .unwrap()
    };
    // Requests wait as long as it takes (the default time to live would evict them).
    let dir = tempfile::tempdir().unwrap();
    let routing = dir.path().join("router.yaml");
    std::fs::write(&routing, "flow_control: {default_ttl_ms: 3600000}\n").unwrap();
    let flags = format!("{flags} --routing-config {}", routing.display());
    let fc = config(&format!("{flags} --flow-control"), 1);
    assert!(fc.flow_control);
    let a = simulate(&fc).unwrap();
    let b = simulate(&fc).unwrap();
    assert_eq!(json(&a.report), json(&b.report));
    assert_eq!(a.stats.events, b.stats.events);
    assert_eq!(a.report.requests.completed, 300);
    let (quiet, noisy) = (tenant(&a, "quiet"), tenant(&a, "noisy"));
    assert!(
        quiet.requests > 10 && noisy.requests > 200,
        "{quiet:?} {noisy:?}"
    );
    // The same load without flow control: every request in the replica's own FCFS queue.
    let plain = simulate(&config(&flags, 1)).unwrap();
    let fcfs_quiet = tenant(&plain, "quiet");
    let (q, f) = (quiet.ttft_p90_s.unwrap(), fcfs_quiet.ttft_p90_s.unwrap());
    assert!(
        q * 3.0 < f,
        "quiet TTFT p90: {q} s with flow control, {f} s without"
    );
    // The noisy tenant keeps the rest: nothing is lost, everything is served.
    assert_eq!(plain.report.requests.completed, 300);
    assert!(json(&a.report)["config"]["sim"]["tenants"].is_array());
}

#[test]
fn replicas_announce_kv_events_to_a_router_that_scores_with_them() {
    // Precise prefix affinity alone: the router knows where a prefix is cached only from
    // the replicas' KV events. Events that never arrive leave it picking blind.
    let dir = tempfile::tempdir().unwrap();
    let routing = dir.path().join("router.yaml");
    std::fs::write(
        &routing,
        "scheduling:\n  plugins:\n    - type: precise-prefix-cache-scorer\n    \
         - type: max-score-picker\n  schedulingProfiles:\n    - name: default\n      \
         plugins:\n        - pluginRef: precise-prefix-cache-scorer\n          weight: 1\n",
    )
    .unwrap();
    let flags = format!(
        "--hardware l4 --model-profile llama-3.1-8b --workload shared-prefix --groups 6 \
         --prompts-per-group 8 --system-len 600 --question-len 20 --output-len 8 --rate 4 \
         --requests 48 --seed 3 --routing-config {}",
        routing.display()
    );
    let hit_rate = |delay: &str| {
        let r = simulate(&config(&format!("{flags} --kv-event-delay {delay}"), 4)).unwrap();
        assert_eq!(r.report.requests.completed, 48);
        r.report.tokens.prefix_cache_hit_rate.unwrap()
    };
    let (informed, blind) = (hit_rate("1ms"), hit_rate("100000s"));
    assert!(informed > blind + 0.1, "informed {informed}, blind {blind}");
}
