//! Side-by-side tables of saved reports.

use std::fmt::Write as _;

use crate::report::Report;
use crate::stats::Summary;

/// A table with one column per report: throughput, errors, and latency percentiles; the
/// last column gives each later report's ratio to the first when there are two.
pub fn render_table(reports: &[Report]) -> String {
    let mut out = String::new();
    let width = reports
        .iter()
        .map(|r| r.label.len())
        .max()
        .unwrap_or(0)
        .clamp(12, 40);
    let _ = write!(out, "{:<22}", "metric");
    for r in reports {
        let _ = write!(out, " {:>width$}", truncate(&r.label, width));
    }
    if reports.len() == 2 {
        let _ = write!(out, " {:>8}", "B/A");
    }
    out.push('\n');
    let mut row = |name: &str, values: Vec<Option<f64>>| {
        let _ = write!(out, "{name:<22}");
        for v in &values {
            match v {
                Some(v) => {
                    let _ = write!(out, " {v:>width$.2}");
                }
                None => {
                    let _ = write!(out, " {:>width$}", "-");
                }
            }
        }
        if let [Some(a), Some(b)] = values.as_slice() {
            if *a != 0.0 {
                let _ = write!(out, " {:>7.2}x", b / a);
            }
        }
        out.push('\n');
    };
    let each = |f: &dyn Fn(&Report) -> Option<f64>| reports.iter().map(f).collect::<Vec<_>>();
    row(
        "requests completed",
        each(&|r| Some(r.requests.completed as f64)),
    );
    row("requests failed", each(&|r| Some(r.requests.failed as f64)));
    row("duration s", each(&|r| Some(r.duration_s)));
    row("req/s", each(&|r| Some(r.throughput.requests_per_s)));
    row(
        "output tok/s",
        each(&|r| Some(r.throughput.output_tokens_per_s)),
    );
    row(
        "total tok/s",
        each(&|r| Some(r.throughput.total_tokens_per_s)),
    );
    row(
        "goodput req/s",
        each(&|r| r.throughput.goodput_requests_per_s),
    );
    row("prefix hit rate", each(&|r| r.tokens.prefix_cache_hit_rate));
    type Pick = fn(&Report) -> Option<Summary>;
    let metrics: [(&str, Pick); 4] = [
        ("TTFT", |r| r.latency_ms.ttft),
        ("TPOT", |r| r.latency_ms.tpot),
        ("ITL", |r| r.latency_ms.itl),
        ("e2e", |r| r.latency_ms.e2e),
    ];
    for (name, pick) in metrics {
        row(
            &format!("{name} mean ms"),
            each(&|r| pick(r).map(|s| s.mean)),
        );
        row(&format!("{name} p50 ms"), each(&|r| pick(r).map(|s| s.p50)));
        row(&format!("{name} p90 ms"), each(&|r| pick(r).map(|s| s.p90)));
        row(&format!("{name} p99 ms"), each(&|r| pick(r).map(|s| s.p99)));
    }
    out
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}
