//! `strata bench` as a command: flags in, progress bar while it runs, table, JSON and
//! plots out; and `strata bench compare`.

use std::io::IsTerminal;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::args::{BenchArgs, BenchCommand, CompareArgs, RunArgs};
use crate::client::Client;
use crate::load::{run_load, run_load_with, StopCondition, StopHandle};
use crate::plot::plot_reports;
use crate::record::RequestRecord;
use crate::report::Report;

/// Mixed into the seed of warm-up requests, so they never share prompts with the run.
const WARMUP_SEED: u64 = 0x7761_726d_7570;

/// Runs `strata bench` (or `strata bench compare`).
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        Some(BenchCommand::Compare(compare)) => run_compare(&compare),
        None => run_bench(&args.run).await,
    }
}

async fn run_bench(args: &RunArgs) -> anyhow::Result<()> {
    let model = match &args.model {
        Some(model) => model.clone(),
        None => Client::discover_model(&args.url, args.timeout).await?,
    };
    let seed = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let config = args.load_config(model, seed)?;

    if args.warmup > 0 {
        let mut warm = config.clone();
        warm.stop = StopCondition {
            max_requests: Some(args.warmup),
            duration: None,
        };
        warm.seed = config.seed ^ WARMUP_SEED;
        let report = run_load(&warm).await?;
        eprintln!(
            "warmup: {} requests, {} failed",
            report.requests.sent, report.requests.failed
        );
    }

    let bar = progress_bar(args, config.stop.max_requests);
    let stop = StopHandle::new();
    let on_ctrl_c = {
        let stop = stop.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!(
                    "\ninterrupted: no new requests; waiting for those in flight \
                     (Ctrl-C again to quit without a report)"
                );
                stop.stop();
            }
            // Our handler replaced the default one: a second Ctrl-C must still end us.
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        })
    };
    let ticker = {
        let bar = bar.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                bar.tick();
            }
        })
    };
    let failed = std::sync::atomic::AtomicU64::new(0);
    let observe = |r: &RequestRecord| {
        if !r.ok() {
            failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        bar.inc(1);
        bar.set_message(format!(
            "failed {}",
            failed.load(std::sync::atomic::Ordering::Relaxed)
        ));
    };
    let report = run_load_with(&config, &observe, &stop).await;
    on_ctrl_c.abort();
    ticker.abort();
    bar.finish_and_clear();
    let report = report?;

    print!("{}", report.render_text());
    if let Some(path) = &args.output {
        report.save(path)?;
        println!("report: {}", path.display());
    }
    if let Some(dir) = &args.plot {
        for path in plot_reports(std::slice::from_ref(&report), dir)? {
            println!("plot: {}", path.display());
        }
    }
    if report.requests.sent > 0 && report.requests.completed == 0 {
        let hint = if report.errors.contains_key("connection_refused") {
            format!(" (is a server listening at {}?)", args.url)
        } else {
            String::new()
        };
        eprintln!(
            "warning: all {} requests failed{hint}",
            report.requests.sent
        );
    }
    Ok(())
}

fn progress_bar(args: &RunArgs, total: Option<u64>) -> ProgressBar {
    let target = if args.quiet || !std::io::stdout().is_terminal() {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    };
    let (bar, template) = match total {
        Some(n) => (
            ProgressBar::with_draw_target(Some(n), target),
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests, {per_sec}, {msg}",
        ),
        None => (
            ProgressBar::with_draw_target(None, target),
            "{spinner} {elapsed_precise} {pos} requests, {per_sec}, {msg}",
        ),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn run_compare(args: &CompareArgs) -> anyhow::Result<()> {
    let mut reports = Vec::with_capacity(args.reports.len());
    for path in &args.reports {
        let mut report = Report::load(path)?;
        if report.label.is_empty() {
            report.label = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
        }
        reports.push(report);
    }
    dedupe_labels(&mut reports, &args.reports);
    print!("{}", crate::compare::render_table(&reports));
    let written = plot_reports(&reports, &args.plot)
        .with_context(|| format!("drawing into {}", args.plot.display()))?;
    for path in written {
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// Reports with the same label get their file name appended, so legends tell them apart.
fn dedupe_labels(reports: &mut [Report], paths: &[std::path::PathBuf]) {
    let labels: Vec<String> = reports.iter().map(|r| r.label.clone()).collect();
    for (i, report) in reports.iter_mut().enumerate() {
        if labels.iter().filter(|l| **l == labels[i]).count() > 1 {
            if let Some(stem) = paths.get(i).and_then(|p| p.file_stem()) {
                report.label = format!("{} ({})", labels[i], stem.to_string_lossy());
            }
        }
    }
}
