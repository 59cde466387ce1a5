//! The command as the CLI runs it: flags, JSON report, plots, compare.

use clap::Parser;
use std::time::Duration;
use strata_bench::{BenchArgs, Report};
use strata_mock::{MockConfig, MockEngine};

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn args(argv: &[&str]) -> BenchArgs {
    let mut all = vec!["bench"];
    all.extend_from_slice(argv);
    Cli::try_parse_from(all).unwrap().bench
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_writes_report_and_plots_then_compare_draws_charts() {
    let m = MockEngine::spawn(MockConfig {
        model: "served".into(),
        output_tokens: 6,
        itl: Duration::from_millis(1),
        ..Default::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out_a = dir.path().join("a.json");
    let out_b = dir.path().join("b.json");
    let plots = dir.path().join("plots");
    let url = m.url();
    // No --model: discovered from /v1/models.
    strata_bench::run(args(&[
        "--url",
        &url,
        "--input-len",
        "20",
        "--output-len",
        "6",
        "--concurrency",
        "3",
        "--requests",
        "12",
        "--output",
        out_a.to_str().unwrap(),
        "--plot",
        plots.to_str().unwrap(),
        "--label",
        "first",
        "--slo",
        "ttft=5s,itl=5s",
        "--quiet",
        "--no-keepalive",
        "--seed",
        "3",
        "--warmup",
        "2",
    ]))
    .await
    .unwrap();
    let a = Report::load(&out_a).unwrap();
    assert_eq!(a.requests.completed, 12);
    // Warm-up requests reach the server but not the report.
    assert_eq!(m.requests(), 14);
    assert_eq!(a.label, "first");
    assert_eq!(a.config["client"]["model"], "served");
    assert_eq!(a.config["seed"], 3);
    assert_eq!(a.slo.unwrap().good, 12);
    for f in ["latency_cdf.svg", "throughput.svg"] {
        let svg = std::fs::read_to_string(plots.join(f)).unwrap();
        assert!(svg.contains("<svg") && svg.contains("first"), "{f}");
    }
    strata_bench::run(args(&[
        "--url",
        &url,
        "--model",
        "served",
        "--workload",
        "shared-prefix",
        "--groups",
        "2",
        "--prompts-per-group",
        "2",
        "--system-len",
        "30",
        "--question-len",
        "4",
        "--output-len",
        "3",
        "--rate",
        "100",
        "--requests",
        "8",
        "--output",
        out_b.to_str().unwrap(),
        "--label",
        "second",
        "--quiet",
    ]))
    .await
    .unwrap();
    let compare_dir = dir.path().join("cmp");
    strata_bench::run(args(&[
        "compare",
        out_a.to_str().unwrap(),
        out_b.to_str().unwrap(),
        "--plot",
        compare_dir.to_str().unwrap(),
    ]))
    .await
    .unwrap();
    let svg = std::fs::read_to_string(compare_dir.join("summary.svg")).unwrap();
    assert!(svg.contains("first") && svg.contains("second"));
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_still_reports() {
    let m = MockEngine::spawn(MockConfig::default()).await.unwrap();
    let url = m.url();
    m.shutdown().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.json");
    strata_bench::run(args(&[
        "--url",
        &url,
        "--model",
        "x",
        "--requests",
        "3",
        "--output",
        out.to_str().unwrap(),
        "--quiet",
    ]))
    .await
    .unwrap();
    let r = Report::load(&out).unwrap();
    assert_eq!(r.errors.get("connection_refused"), Some(&3));
    // Without --model, discovery fails with a clear message.
    let err = strata_bench::run(args(&["--url", &url, "--quiet"]))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--model") && err.contains("/v1/models"),
        "{err}"
    );
}

#[tokio::test]
async fn compare_rejects_files_that_are_not_reports() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"hello\": 1}").unwrap();
    let err = strata_bench::run(args(&["compare", bad.to_str().unwrap()]))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a strata bench report"), "{err}");
    let err = strata_bench::run(args(&["compare", "/nonexistent/r.json"]))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/r.json"), "{err}");
}
