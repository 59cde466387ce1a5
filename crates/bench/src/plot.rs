//! SVG charts of one or more reports: latency CDFs, throughput over time and a summary
//! comparison. SVG needs no fonts at render time (text stays text), so the crate carries
//! no font files and no system font dependency.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::error::BenchError;
use crate::report::Report;
use crate::stats::Summary;

/// Series colours, one per report.
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// Picks one metric's saved CDF from a report.
type PickCdf = fn(&Report) -> &Vec<f64>;
/// Picks one metric's summary from a report.
type PickSummary = fn(&Report) -> Option<Summary>;

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// The files [`plot_reports`] writes.
pub const LATENCY_CDF: &str = "latency_cdf.svg";
/// Throughput over time.
pub const THROUGHPUT: &str = "throughput.svg";
/// Percentile and throughput bars (only for two or more reports).
pub const SUMMARY: &str = "summary.svg";

/// Draws the charts of `reports` into `dir` and returns the files written: latency CDFs
/// and throughput over time, plus a summary bar chart when there are several reports.
pub fn plot_reports(reports: &[Report], dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
    std::fs::create_dir_all(dir).map_err(|source| BenchError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Vec::new();
    let path = dir.join(LATENCY_CDF);
    latency_cdfs(reports, &path)?;
    written.push(path);
    let path = dir.join(THROUGHPUT);
    throughput(reports, &path)?;
    written.push(path);
    if reports.len() > 1 {
        let path = dir.join(SUMMARY);
        summary(reports, &path)?;
        written.push(path);
    }
    Ok(written)
}

fn err(path: &Path) -> impl Fn(String) -> BenchError + '_ {
    move |message| BenchError::Plot {
        path: path.to_path_buf(),
        message,
    }
}

/// A 2x2 grid of CDFs (TTFT, TPOT, ITL, e2e), one line per report.
pub fn latency_cdfs(reports: &[Report], path: &Path) -> Result<(), BenchError> {
    let fail = err(path);
    let root = SVGBackend::new(path, (1200, 860)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let panels = root.split_evenly((2, 2));
    let metrics: [(&str, PickCdf); 4] = [
        ("TTFT (ms)", |r| &r.cdf_ms.ttft),
        ("TPOT (ms)", |r| &r.cdf_ms.tpot),
        ("ITL (ms)", |r| &r.cdf_ms.itl),
        ("e2e latency (ms)", |r| &r.cdf_ms.e2e),
    ];
    for (panel, (name, pick)) in panels.iter().zip(metrics) {
        let xmax = reports
            .iter()
            .filter_map(|r| pick(r).last().copied())
            .fold(0.0f64, f64::max)
            .max(1e-3)
            * 1.05;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{name}: CDF"), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d(0.0..xmax, 0.0..1.0)
            .map_err(|e| fail(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc(name)
            .y_desc("fraction of samples")
            .draw()
            .map_err(|e| fail(e.to_string()))?;
        for (i, report) in reports.iter().enumerate() {
            let q = pick(report);
            if q.len() < 2 {
                continue;
            }
            let n = (q.len() - 1) as f64;
            let c = color(i);
            chart
                .draw_series(LineSeries::new(
                    q.iter().enumerate().map(|(k, &x)| (x, k as f64 / n)),
                    c.stroke_width(2),
                ))
                .map_err(|e| fail(e.to_string()))?
                .label(report.label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| fail(e.to_string()))?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}

/// Output tokens per second over the run, one line per report.
pub fn throughput(reports: &[Report], path: &Path) -> Result<(), BenchError> {
    let fail = err(path);
    let root = SVGBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let series: Vec<Vec<(f64, f64)>> = reports
        .iter()
        .map(|r| {
            // The last bucket may be cut short by the end of the run: divide by what it
            // covered and plot each rate at its bucket's middle.
            let bucket = r.timeline_bucket_s.max(1e-9);
            r.timeline
                .iter()
                .map(|p| {
                    let width = (r.duration_s - p.t_s).clamp(1e-3, bucket);
                    (p.t_s + width / 2.0, p.output_tokens / width)
                })
                .collect()
        })
        .collect();
    let xmax = series
        .iter()
        .flatten()
        .map(|p| p.0)
        .fold(0.0f64, f64::max)
        .max(1.0);
    let ymax = series
        .iter()
        .flatten()
        .map(|p| p.1)
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("Output tokens/s over time", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)
        .map_err(|e| fail(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("seconds since start")
        .y_desc("output tokens/s")
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    for (i, (report, points)) in reports.iter().zip(series).enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))
            .map_err(|e| fail(e.to_string()))?
            .label(report.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    root.present().map_err(|e| fail(e.to_string()))
}

/// Grouped bars: TTFT, ITL and e2e at p50/p90/p99, and output tokens/s, per report.
pub fn summary(reports: &[Report], path: &Path) -> Result<(), BenchError> {
    let fail = err(path);
    let root = SVGBackend::new(path, (1200, 860)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let panels = root.split_evenly((2, 2));
    let latency: [(&str, PickSummary); 3] = [
        ("TTFT (ms)", |r| r.latency_ms.ttft),
        ("ITL (ms)", |r| r.latency_ms.itl),
        ("e2e latency (ms)", |r| r.latency_ms.e2e),
    ];
    for (panel, (name, pick)) in panels.iter().zip(latency) {
        let groups = ["p50", "p90", "p99"];
        let values: Vec<Vec<f64>> = reports
            .iter()
            .map(|r| match pick(r) {
                Some(s) => vec![s.p50, s.p90, s.p99],
                None => vec![0.0; 3],
            })
            .collect();
        bars(panel, name, &groups, &values, reports).map_err(&fail)?;
    }
    if let Some(panel) = panels.get(3) {
        let values: Vec<Vec<f64>> = reports
            .iter()
            .map(|r| vec![r.throughput.output_tokens_per_s])
            .collect();
        bars(
            panel,
            "Output tokens/s",
            &["output tok/s"],
            &values,
            reports,
        )
        .map_err(&fail)?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// One panel of grouped bars: `values[report][group]`.
fn bars(
    area: &Area<'_>,
    title: &str,
    groups: &[&str],
    values: &[Vec<f64>],
    reports: &[Report],
) -> Result<(), String> {
    let ymax = values
        .iter()
        .flatten()
        .copied()
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.15;
    let n = groups.len() as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..ymax)
        .map_err(|e| e.to_string())?;
    let names: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
    let label = move |x: &f64| {
        let k = x.round();
        if (x - k).abs() < 1e-6 && k >= 0.0 && (k as usize) < names.len() {
            names[k as usize].clone()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len() * 2 + 1)
        .x_label_formatter(&label)
        .draw()
        .map_err(|e| e.to_string())?;
    let width = 0.8 / reports.len().max(1) as f64;
    for (i, (report, row)) in reports.iter().zip(values).enumerate() {
        let c = color(i);
        let x0 = |g: usize| g as f64 - 0.4 + i as f64 * width;
        chart
            .draw_series(row.iter().enumerate().map(|(g, &v)| {
                Rectangle::new([(x0(g), 0.0), (x0(g) + width * 0.92, v)], c.filled())
            }))
            .map_err(|e| e.to_string())?
            .label(report.label.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}
