//! `strata sim calibrate`: the fit recovers a known machine, and the whole path (HTTP
//! sweeps against an engine on loopback → profile file → simulation) reproduces what the
//! engine measured.

use std::time::Duration;

use strata_sim::calibrate::{calibrate_profile, fit, measure, CalibrateArgs, Sample};
use strata_sim::profile::{HardwareProfile, ModelProfile, StepModel, StepShape};

fn args(url: &str, output: std::path::PathBuf) -> CalibrateArgs {
    CalibrateArgs {
        url: url.to_string(),
        model: Some("mock".into()),
        model_profile: "smollm2-135m".into(),
        output,
        name: "this-machine".into(),
        prefill_sizes: vec![32, 128, 512],
        // The mock engine's first token takes a fixed time, whatever queues: a batched
        // prefill would not be one step there.
        prefill_batches: vec![],
        prefill_batch_len: 128,
        batch_sizes: vec![1, 4],
        decode_tokens: 12,
        decode_prompt: 16,
        repeats: 2,
        kv_cache_bytes: 1 << 28,
        kv_block_size: 16,
        kv_cache_dtype: "f16".into(),
        timeout: Duration::from_secs(20),
    }
}

#[test]
fn fit_recovers_a_known_roofline() {
    let model = ModelProfile::named("smollm2-135m").unwrap();
    let truth = HardwareProfile {
        name: "truth".into(),
        peak_flops: 2.0e11,
        mem_bandwidth: 3.0e10,
        memory_bytes: 1e9,
        flops_efficiency: 1.0,
        bandwidth_efficiency: 1.0,
        step_overhead_s: 0.002,
        allreduce_s: 0.0,
        memory_utilization: 1.0,
        kv_cache_bytes: None,
        prefill_row_exponent: 0.0,
        prefill_row_cap: 1.0,
        calibrated_on: None,
    };
    let sm = StepModel::new(truth.clone(), model.clone(), 1).unwrap();
    let mut samples = Vec::new();
    for n in [16u64, 64, 256, 1024, 2048] {
        let mut s = StepShape::default();
        s.add(0, n, true);
        samples.push(Sample {
            shape_tokens: n,
            batch: 1,
            seconds: sm.step_time(&s),
            shape: s,
        });
    }
    for b in [1u64, 2, 4, 8, 16] {
        let mut s = StepShape::default();
        for _ in 0..b {
            s.add(100, 1, true);
        }
        samples.push(Sample {
            shape_tokens: b,
            batch: b,
            seconds: sm.step_time(&s),
            shape: s,
        });
    }
    let got = fit(&truth, &model, &samples).unwrap();
    let fitted = StepModel::new(got.clone(), model, 1).unwrap();
    for s in &samples {
        let e = fitted.step_time(&s.shape) / s.seconds - 1.0;
        assert!(e.abs() < 0.02, "{e} at {} tokens", s.shape_tokens);
    }
    assert!(
        (got.peak_flops / truth.peak_flops - 1.0).abs() < 0.1,
        "{}",
        got.peak_flops
    );
    assert!(
        (got.mem_bandwidth / truth.mem_bandwidth - 1.0).abs() < 0.1,
        "{}",
        got.mem_bandwidth
    );
    assert!((got.step_overhead_s - truth.step_overhead_s).abs() < 3e-4);
    // Too few points to fit three parameters.
    assert!(fit(
        &truth,
        &ModelProfile::named("smollm2-135m").unwrap(),
        &samples[..2]
    )
    .is_err());
}

#[test]
fn fit_recovers_a_prefill_row_exponent_and_stays_neutral_without_wide_steps() {
    let model = ModelProfile::named("smollm2-135m").unwrap();
    let truth = HardwareProfile {
        name: "cpu".into(),
        peak_flops: 5.0e10,
        mem_bandwidth: 2.0e10,
        memory_bytes: 1e9,
        flops_efficiency: 1.0,
        bandwidth_efficiency: 1.0,
        step_overhead_s: 0.004,
        allreduce_s: 0.0,
        memory_utilization: 1.0,
        kv_cache_bytes: None,
        prefill_row_exponent: 0.6,
        prefill_row_cap: 8.0,
        calibrated_on: None,
    };
    let sm = StepModel::new(truth.clone(), model.clone(), 1).unwrap();
    let sample = |s: StepShape, batch: u64| Sample {
        shape_tokens: s.tokens,
        batch,
        seconds: sm.step_time(&s),
        shape: s,
    };
    let mut single = Vec::new();
    for n in [32u64, 128, 512, 1024] {
        let mut s = StepShape::default();
        s.add(0, n, true);
        single.push(sample(s, 1));
    }
    for b in [1u64, 2, 4, 8] {
        let mut s = StepShape::default();
        for _ in 0..b {
            s.add(80, 1, true);
        }
        single.push(sample(s, b));
    }
    let mut all = single.clone();
    for k in [2u64, 4, 8] {
        let mut s = StepShape::default();
        for _ in 0..k {
            s.add(0, 128, true);
        }
        all.push(sample(s, k));
    }
    let got = fit(&truth, &model, &all).unwrap();
    assert!(
        (got.prefill_row_exponent - 0.6).abs() < 0.051,
        "{}",
        got.prefill_row_exponent
    );
    assert_eq!(got.prefill_row_cap, 8.0);
    let fitted = StepModel::new(got, model.clone(), 1).unwrap();
    for s in &all {
        let e = fitted.step_time(&s.shape) / s.seconds - 1.0;
        assert!(e.abs() < 0.05, "{e} at {:?}", s.shape);
    }
    // Only single-sequence prefills: nothing identifies the exponent, so it stays 0.
    let plain = fit(&truth, &model, &single).unwrap();
    assert_eq!(plain.prefill_row_exponent, 0.0);
    assert_eq!(plain.prefill_row_cap, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calibrates_against_an_engine_on_loopback_and_the_sim_reproduces_it() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = strata_mock::MockEngine::serve(
        strata_mock::MockConfig {
            output_tokens: 64,
            ttft: Duration::from_millis(20),
            itl: Duration::from_millis(20),
            ..Default::default()
        },
        listener,
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("profile.json");
    let a = args(&engine.url(), path.clone());
    let samples = measure(&a).await.unwrap();
    assert_eq!(samples.len(), 5);
    for s in &samples {
        assert!((0.015..0.1).contains(&s.seconds), "{s:?}");
    }
    let model = ModelProfile::named("smollm2-135m").unwrap();
    let profile = calibrate_profile(&a, &model, &samples).unwrap();
    std::fs::write(&path, serde_json::to_string(&profile).unwrap()).unwrap();
    let loaded = HardwareProfile::load(&path).unwrap();
    assert_eq!(loaded.name, profile.name);
    assert_eq!(loaded.kv_cache_bytes, profile.kv_cache_bytes);
    assert!((loaded.step_overhead_s / profile.step_overhead_s - 1.0).abs() < 1e-9);
    let sm = StepModel::new(loaded, model, 1).unwrap();
    for s in &samples {
        let e = sm.step_time(&s.shape) / s.seconds - 1.0;
        assert!(
            e.abs() < 0.25,
            "model {} vs measured {}",
            sm.step_time(&s.shape),
            s.seconds
        );
    }
    // The KV budget given to the engine sets the simulated replica's blocks.
    let blocks = sm.num_blocks(16).unwrap();
    assert_eq!(
        blocks,
        ((1u64 << 28) as f64 / (sm.model.kv_bytes_per_token() * 16.0)) as usize
    );
}

#[tokio::test]
async fn an_unreachable_engine_is_a_typed_error() {
    // A port that was just free: nothing listens there.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dir = tempfile::tempdir().unwrap();
    let a = args(
        &format!("http://127.0.0.1:{port}"),
        dir.path().join("p.json"),
    );
    let err = measure(&a).await.unwrap_err();
    assert!(matches!(err, strata_sim::SimError::Calibration(_)), "{err}");
}

/// `strata sim`'s flags, parsed as the CLI parses them.
#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    sim: strata_sim::SimArgs,
}

fn sim_config(args: &[&str]) -> Result<strata_sim::SimConfig, strata_sim::SimError> {
    use clap::Parser;
    let cli = Cli::try_parse_from(std::iter::once("sim").chain(args.iter().copied()))
        .expect("flags parse");
    cli.sim.fleet.config(&cli.sim.run, cli.sim.replicas)
}

#[test]
fn a_calibrated_profile_names_its_model_and_the_sim_holds_to_it() {
    let model = ModelProfile::named("smollm2-135m").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("profile.json");
    let mut a = args("http://127.0.0.1:9", path.clone());
    a.kv_block_size = 32;
    // Three synthetic steps are enough for the fit; what matters here is what it records.
    let samples: Vec<Sample> = [(64u64, 0.004), (256, 0.009), (1024, 0.03)]
        .into_iter()
        .map(|(n, seconds)| {
            let mut shape = StepShape::default();
            shape.add(0, n, true);
            Sample {
                shape_tokens: n,
                batch: 1,
                seconds,
                shape,
            }
        })
        .collect();
    let profile = calibrate_profile(&a, &model, &samples).unwrap();
    let on = profile
        .calibrated_on
        .clone()
        .expect("the profile names its model");
    assert_eq!(on.model_profile, "smollm2-135m");
    assert_eq!(on.served_model.as_deref(), Some("mock"));
    assert_eq!((on.kv_block_size, on.kv_cache_dtype.as_str()), (32, "f16"));
    std::fs::write(&path, serde_json::to_string(&profile).unwrap()).unwrap();
    let file = path.to_str().unwrap();

    // Without --model-profile the sim simulates the calibrated model and its block size.
    let cfg = sim_config(&["--hardware-profile", file, "--requests", "10"]).unwrap();
    assert_eq!(cfg.step.model.name, "smollm2-135m");
    assert_eq!(cfg.engine.block_size, 32);
    // The same model named explicitly is fine.
    let cfg = sim_config(&[
        "--hardware-profile",
        file,
        "--model-profile",
        "smollm2-135m",
    ])
    .unwrap();
    assert_eq!(cfg.step.model.name, "smollm2-135m");
    // Another model is refused, naming both, unless scaling across models is asked for.
    let err = sim_config(&[
        "--hardware-profile",
        file,
        "--model-profile",
        "llama-3.1-8b",
    ])
    .expect_err("a different model is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("--model-profile")
            && msg.contains("`smollm2-135m`")
            && msg.contains("llama-3.1-8b")
            && msg.contains("--scale-across-models"),
        "{msg}"
    );
    let cfg = sim_config(&[
        "--hardware-profile",
        file,
        "--model-profile",
        "llama-3.1-8b",
        "--scale-across-models",
    ])
    .unwrap();
    assert_eq!(cfg.step.model.name, "llama-3.1-8b");

    // A profile written before calibrations named their model still loads; the named chips
    // keep their default model.
    let mut old: serde_json::Value = serde_json::to_value(&profile).unwrap();
    old.as_object_mut().unwrap().remove("calibrated_on");
    std::fs::write(&path, old.to_string()).unwrap();
    let cfg = sim_config(&["--hardware-profile", file]).unwrap();
    assert_eq!(cfg.step.model.name, "llama-3.1-8b");
    assert_eq!(cfg.engine.block_size, 16);
    let cfg = sim_config(&["--hardware", "h100"]).unwrap();
    assert_eq!(cfg.step.model.name, "llama-3.1-8b");
}
