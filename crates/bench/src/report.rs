//! The report: metrics computed from request records, as JSON and as a text table.
//!
//! Definitions (as in BENCHMARKS.md): TTFT is send to first chunk with content; ITL the
//! gap between consecutive chunks with content (one sample per gap, over all requests);
//! TPOT = (e2e - TTFT) / (output tokens - 1), per request with at least two tokens; e2e
//! is send to end of stream. Latency statistics cover completed requests only. Rates
//! divide by the run's wall time, from the first send to the last response. Goodput is
//! completed requests meeting every objective of `--slo`, per second; a request meets
//! `itl` when every one of its gaps does.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::BenchError;
use crate::record::{ms, RequestLine, RequestRecord};
use crate::stats::{quantiles, Summary};

/// Report format version, bumped on incompatible changes.
pub const REPORT_VERSION: u32 = 1;
/// Points saved per CDF (every percentile from 0 to 100).
pub const CDF_POINTS: usize = 101;

/// Service-level objectives; a request is good when it meets every one that is set.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Slo {
    /// Most time to first token, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Most gap between consecutive tokens, ms (every gap of the request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<f64>,
    /// Most time per output token, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// Most end-to-end latency, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
}

impl Slo {
    /// True when no objective is set.
    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none()
            && self.itl_ms.is_none()
            && self.tpot_ms.is_none()
            && self.e2e_ms.is_none()
    }

    /// Whether a completed request meets every objective.
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        if !r.ok() {
            return false;
        }
        let within = |limit: Option<f64>, value: Option<Duration>| match (limit, value) {
            (None, _) => true,
            (Some(l), Some(v)) => ms(v) <= l,
            (Some(_), None) => false,
        };
        within(self.ttft_ms, r.ttft)
            && within(self.e2e_ms, Some(r.e2e))
            && (self.tpot_ms.is_none() || r.output_tokens() < 2 || within(self.tpot_ms, r.tpot()))
            && self.itl_ms.is_none_or(|l| r.itls().all(|gap| ms(gap) <= l))
    }
}

/// Request counts.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Counts {
    /// Requests sent.
    pub sent: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Requests that failed (see `errors`).
    pub failed: u64,
}

/// Rates over the run's wall time.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Throughput {
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens of completed requests per second.
    pub output_tokens_per_s: f64,
    /// Input tokens of completed requests per second.
    pub input_tokens_per_s: f64,
    /// Input plus output tokens of completed requests per second.
    pub total_tokens_per_s: f64,
    /// Completed requests meeting the SLO per second (when an SLO was given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput_requests_per_s: Option<f64>,
}

/// Token totals over completed requests.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Tokens {
    /// Input tokens (server-reported when available).
    pub input_total: u64,
    /// Output tokens (server-reported when available).
    pub output_total: u64,
    /// Mean input tokens per completed request.
    pub input_mean: f64,
    /// Mean output tokens per completed request.
    pub output_mean: f64,
    /// Prompt tokens the server reported as served from its prefix cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_total: Option<u64>,
    /// `cached_total / input_total` (requests that did not report cached tokens count as
    /// zero hits once any request did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_cache_hit_rate: Option<f64>,
}

/// Latency summaries in milliseconds; absent when there were no samples.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Latency {
    /// Time to first token.
    pub ttft: Option<Summary>,
    /// Time per output token after the first.
    pub tpot: Option<Summary>,
    /// Inter-token latency (every gap).
    pub itl: Option<Summary>,
    /// End-to-end latency.
    pub e2e: Option<Summary>,
}

/// Each metric's distribution as [`CDF_POINTS`] evenly spaced percentiles, ms.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Cdf {
    /// TTFT percentiles p0..p100.
    pub ttft: Vec<f64>,
    /// TPOT percentiles p0..p100.
    pub tpot: Vec<f64>,
    /// ITL percentiles p0..p100.
    pub itl: Vec<f64>,
    /// e2e percentiles p0..p100.
    pub e2e: Vec<f64>,
}

/// One time bucket of the run.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TimelinePoint {
    /// Bucket start, seconds from the run's start.
    pub t_s: f64,
    /// Requests that completed in the bucket.
    pub completed: u64,
    /// Requests that failed in the bucket.
    pub failed: u64,
    /// Output tokens streamed in the bucket (chunks scaled to the reported token count).
    pub output_tokens: f64,
    /// Requests in flight at the bucket's start.
    pub in_flight: u64,
}

/// The SLO and how many requests met it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SloResult {
    /// The objectives.
    pub slo: Slo,
    /// Completed requests meeting all of them.
    pub good: u64,
    /// `good / sent`.
    pub fraction: f64,
}

/// A benchmark run's results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// [`REPORT_VERSION`].
    pub version: u32,
    /// Name for this run in plots and comparisons.
    pub label: String,
    /// Unix time of the start, seconds.
    pub started_at_unix_s: f64,
    /// The configuration as run (URL, model, workload, load shape, seed, ...).
    pub config: serde_json::Value,
    /// Wall time from the first send to the last response, seconds.
    pub duration_s: f64,
    /// Request counts.
    pub requests: Counts,
    /// Failures by kind (`connection_refused`, `http_503`, `stream_cut`, ...).
    pub errors: BTreeMap<String, u64>,
    /// The first message seen for each failure kind.
    pub error_examples: BTreeMap<String, String>,
    /// Requests per serving replica, when responses named one (router or mock header).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub served_by: BTreeMap<String, u64>,
    /// Rates.
    pub throughput: Throughput,
    /// Token totals.
    pub tokens: Tokens,
    /// Latency summaries, ms.
    pub latency_ms: Latency,
    /// Goodput detail when an SLO was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<SloResult>,
    /// Distributions for plotting, ms.
    pub cdf_ms: Cdf,
    /// Width of a timeline bucket, seconds.
    pub timeline_bucket_s: f64,
    /// Throughput over time.
    pub timeline: Vec<TimelinePoint>,
    /// One line per request, in send order.
    pub request_lines: Vec<RequestLine>,
}

impl Report {
    /// Computes a report from records alone (the configuration is stored as given).
    pub fn from_records(
        label: &str,
        config: serde_json::Value,
        records: &[RequestRecord],
        duration: Duration,
        slo: &Slo,
    ) -> Report {
        let secs = duration.as_secs_f64();
        let done: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
        let requests = Counts::of(records, &done);
        let (errors, error_examples) = errors(records);
        let tokens = Tokens::of(&done);
        let (latency_ms, cdf_ms) = latency(&done);
        let slo = SloResult::of(slo, &done, requests.sent);
        let (timeline_bucket_s, timeline) = timeline(records, duration);
        Report {
            version: REPORT_VERSION,
            label: label.to_string(),
            started_at_unix_s: 0.0,
            config,
            duration_s: secs,
            requests,
            errors,
            error_examples,
            served_by: served_by(records),
            throughput: Throughput::of(&requests, &tokens, slo.as_ref(), secs),
            tokens,
            latency_ms,
            slo,
            cdf_ms,
            timeline_bucket_s,
            timeline,
            request_lines: request_lines(records),
        }
    }

    /// Reads a saved report.
    pub fn load(path: &Path) -> Result<Report, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| BenchError::BadReport {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Writes the report as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<(), BenchError> {
        let io = |source| BenchError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let text = serde_json::to_string_pretty(self).map_err(|e| io(std::io::Error::other(e)))?;
        std::fs::write(path, text + "\n").map_err(io)
    }

    /// A human-readable summary table.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let c = &self.config;
        let _ = writeln!(out, "== strata bench: {} ==", self.label);
        let _ = writeln!(
            out,
            "url {}  model {}  workload {}",
            c["client"]["url"].as_str().unwrap_or("?"),
            c["client"]["model"].as_str().unwrap_or("?"),
            c["workload"]["kind"].as_str().unwrap_or("?"),
        );
        let _ = writeln!(
            out,
            "requests: {} sent, {} completed, {} failed in {:.2} s",
            self.requests.sent, self.requests.completed, self.requests.failed, self.duration_s
        );
        for (kind, n) in &self.errors {
            let example = self.error_examples.get(kind).map_or("", String::as_str);
            let _ = writeln!(out, "  error {kind}: {n}  ({})", truncate(example, 120));
        }
        let t = &self.throughput;
        let _ = writeln!(
            out,
            "throughput: {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s",
            t.requests_per_s, t.output_tokens_per_s, t.total_tokens_per_s
        );
        if let (Some(g), Some(s)) = (t.goodput_requests_per_s, &self.slo) {
            let _ = writeln!(
                out,
                "goodput: {:.2} req/s ({} of {} requests met the SLO, {:.1}%)",
                g,
                s.good,
                self.requests.sent,
                100.0 * s.fraction
            );
        }
        let _ = writeln!(
            out,
            "tokens: {} in ({:.1}/req), {} out ({:.1}/req)",
            self.tokens.input_total,
            self.tokens.input_mean,
            self.tokens.output_total,
            self.tokens.output_mean
        );
        if !self.served_by.is_empty() {
            let picks: Vec<String> = self
                .served_by
                .iter()
                .map(|(name, n)| format!("{name}: {n}"))
                .collect();
            let _ = writeln!(out, "served by: {}", picks.join(", "));
        }
        if let Some(rate) = self.tokens.prefix_cache_hit_rate {
            let _ = writeln!(out, "prefix cache hit rate: {:.1}%", 100.0 * rate);
        }
        let _ = writeln!(
            out,
            "{:<6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "ms", "mean", "p50", "p90", "p99", "max"
        );
        let l = &self.latency_ms;
        for (name, s) in [
            ("TTFT", &l.ttft),
            ("TPOT", &l.tpot),
            ("ITL", &l.itl),
            ("e2e", &l.e2e),
        ] {
            match s {
                Some(s) => {
                    let _ = writeln!(
                        out,
                        "{name:<6} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                        s.mean, s.p50, s.p90, s.p99, s.max
                    );
                }
                None => {
                    let _ = writeln!(out, "{name:<6} {:>10}", "-");
                }
            }
        }
        out
    }
}

impl Counts {
    /// Requests sent (every record) and completed (`done`).
    fn of(records: &[RequestRecord], done: &[&RequestRecord]) -> Counts {
        let sent = records.len() as u64;
        let completed = done.len() as u64;
        Counts {
            sent,
            completed,
            failed: sent - completed,
        }
    }
}

/// Failures counted by kind, with the first message seen for each kind.
fn errors(records: &[RequestRecord]) -> (BTreeMap<String, u64>, BTreeMap<String, String>) {
    let mut errors = BTreeMap::new();
    let mut error_examples = BTreeMap::new();
    for f in records.iter().filter_map(|r| r.failure.as_ref()) {
        let key = f.kind.key();
        *errors.entry(key.clone()).or_insert(0u64) += 1;
        error_examples
            .entry(key)
            .or_insert_with(|| f.message.clone());
    }
    (errors, error_examples)
}

/// Requests per replica that named itself in the response.
fn served_by(records: &[RequestRecord]) -> BTreeMap<String, u64> {
    let mut served_by = BTreeMap::new();
    for name in records.iter().filter_map(|r| r.served_by.as_ref()) {
        *served_by.entry(name.clone()).or_insert(0u64) += 1;
    }
    served_by
}

impl Tokens {
    /// Token totals and means over the completed requests, and the prefix-cache hit rate.
    fn of(done: &[&RequestRecord]) -> Tokens {
        let completed = done.len() as u64;
        let input_total: u64 = done.iter().map(|r| u64::from(r.input_tokens())).sum();
        let output_total: u64 = done.iter().map(|r| u64::from(r.output_tokens())).sum();
        // Servers omit `cached_tokens` when it is zero, so once any request reported it,
        // the others count as zero hits rather than being left out of the rate.
        let any_cached = done.iter().any(|r| r.cached_tokens.is_some());
        let (cached_total, prefix_cache_hit_rate) = if any_cached {
            let hit: u64 = done
                .iter()
                .filter_map(|r| r.cached_tokens)
                .map(u64::from)
                .sum();
            (
                Some(hit),
                (input_total > 0).then(|| hit as f64 / input_total as f64),
            )
        } else {
            (None, None)
        };
        let mean = |total: u64| {
            if completed > 0 {
                total as f64 / completed as f64
            } else {
                0.0
            }
        };
        Tokens {
            input_total,
            output_total,
            input_mean: mean(input_total),
            output_mean: mean(output_total),
            cached_total,
            prefix_cache_hit_rate,
        }
    }
}

/// Latency summaries and distributions over the completed requests, ms.
fn latency(done: &[&RequestRecord]) -> (Latency, Cdf) {
    let mut ttft: Vec<f64> = done.iter().filter_map(|r| r.ttft.map(ms)).collect();
    let mut tpot: Vec<f64> = done.iter().filter_map(|r| r.tpot().map(ms)).collect();
    let mut itl: Vec<f64> = done.iter().flat_map(|r| r.itls().map(ms)).collect();
    let mut e2e: Vec<f64> = done.iter().map(|r| ms(r.e2e)).collect();
    let latency = Latency {
        ttft: Summary::of(&mut ttft),
        tpot: Summary::of(&mut tpot),
        itl: Summary::of(&mut itl),
        e2e: Summary::of(&mut e2e),
    };
    // Summary::of sorted the samples.
    let cdf = Cdf {
        ttft: quantiles(&ttft, CDF_POINTS),
        tpot: quantiles(&tpot, CDF_POINTS),
        itl: quantiles(&itl, CDF_POINTS),
        e2e: quantiles(&e2e, CDF_POINTS),
    };
    (latency, cdf)
}

impl SloResult {
    /// How many completed requests met `slo`, out of `sent`; `None` when no objective is
    /// set.
    fn of(slo: &Slo, done: &[&RequestRecord], sent: u64) -> Option<SloResult> {
        (!slo.is_empty()).then(|| {
            let good = done.iter().filter(|r| slo.met_by(r)).count() as u64;
            SloResult {
                slo: *slo,
                good,
                fraction: if sent > 0 {
                    good as f64 / sent as f64
                } else {
                    0.0
                },
            }
        })
    }
}

impl Throughput {
    /// Completed requests, tokens and good requests per second of the run's `secs`.
    fn of(requests: &Counts, tokens: &Tokens, slo: Option<&SloResult>, secs: f64) -> Throughput {
        let per_s = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
        Throughput {
            requests_per_s: per_s(requests.completed as f64),
            output_tokens_per_s: per_s(tokens.output_total as f64),
            input_tokens_per_s: per_s(tokens.input_total as f64),
            total_tokens_per_s: per_s((tokens.input_total + tokens.output_total) as f64),
            goodput_requests_per_s: slo.map(|s| per_s(s.good as f64)),
        }
    }
}

/// One line per request, in send order.
fn request_lines(records: &[RequestRecord]) -> Vec<RequestLine> {
    let mut lines: Vec<RequestLine> = records.iter().map(RequestLine::from).collect();
    lines.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    lines
}

/// The smallest of a few round widths that splits `secs` into at most 120 buckets.
fn bucket_width(secs: f64) -> f64 {
    const WIDTHS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0];
    WIDTHS
        .into_iter()
        .find(|w| secs / w <= 120.0)
        .unwrap_or_else(|| (secs / 120.0).ceil())
}

/// Buckets the run into at most ~120 points: completions, failures and streamed tokens
/// per bucket, and requests in flight at each bucket's start.
fn timeline(records: &[RequestRecord], duration: Duration) -> (f64, Vec<TimelinePoint>) {
    let secs = duration.as_secs_f64();
    let bucket = bucket_width(secs);
    let n = ((secs / bucket).ceil() as usize).max(1);
    let mut points: Vec<TimelinePoint> = (0..n)
        .map(|i| TimelinePoint {
            t_s: i as f64 * bucket,
            ..Default::default()
        })
        .collect();
    let index = |t: f64| ((t / bucket) as usize).min(n - 1);
    for r in records {
        let start = r.start.as_secs_f64();
        let end = start + r.e2e.as_secs_f64();
        let p = &mut points[index(end)];
        if r.ok() {
            p.completed += 1;
        } else {
            p.failed += 1;
        }
        let chunks = r.token_times.len();
        if chunks > 0 {
            let per_chunk = if r.ok() {
                f64::from(r.output_tokens()) / chunks as f64
            } else {
                1.0
            };
            for t in &r.token_times {
                points[index(t.as_secs_f64())].output_tokens += per_chunk;
            }
        }
        for p in points.iter_mut() {
            if p.t_s >= start && p.t_s < end {
                p.in_flight += 1;
            }
        }
    }
    (bucket, points)
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Failure, FailureKind};

    fn at(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    fn ok(start: u64, ttft: u64, gaps: &[u64], tokens: u32) -> RequestRecord {
        let mut t = start + ttft;
        let mut times = vec![at(t)];
        for g in gaps {
            t += g;
            times.push(at(t));
        }
        RequestRecord {
            start: at(start),
            ttft: Some(at(ttft)),
            e2e: at(t - start),
            token_times: times,
            prompt_tokens: Some(10),
            completion_tokens: Some(tokens),
            ..Default::default()
        }
    }

    fn failed(kind: FailureKind) -> RequestRecord {
        RequestRecord {
            failure: Some(Failure {
                kind,
                message: "boom".into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn report_computes_rates_latencies_and_errors() {
        let records = vec![
            ok(0, 100, &[10, 10, 10], 4),
            ok(500, 200, &[20, 20, 20], 4),
            failed(FailureKind::HttpStatus(503)),
            failed(FailureKind::HttpStatus(503)),
            failed(FailureKind::ConnectionRefused),
        ];
        let slo = Slo {
            ttft_ms: Some(150.0),
            ..Default::default()
        };
        let r = Report::from_records(
            "t",
            serde_json::Value::Null,
            &records,
            Duration::from_secs(2),
            &slo,
        );
        assert_eq!(r.requests.sent, 5);
        assert_eq!(r.requests.completed, 2);
        assert_eq!(r.requests.failed, 3);
        assert_eq!(r.errors["http_503"], 2);
        assert_eq!(r.errors["connection_refused"], 1);
        assert!((r.throughput.requests_per_s - 1.0).abs() < 1e-9);
        assert!((r.throughput.output_tokens_per_s - 4.0).abs() < 1e-9);
        assert!((r.throughput.total_tokens_per_s - 14.0).abs() < 1e-9);
        let ttft = r.latency_ms.ttft.unwrap();
        assert!((ttft.mean - 150.0).abs() < 1e-9);
        assert_eq!(ttft.count, 2);
        let itl = r.latency_ms.itl.unwrap();
        assert_eq!(itl.count, 6);
        assert!((itl.p50 - 15.0).abs() < 1e-9);
        let tpot = r.latency_ms.tpot.unwrap();
        assert!((tpot.min - 10.0).abs() < 1e-9 && (tpot.max - 20.0).abs() < 1e-9);
        assert_eq!(r.slo.unwrap().good, 1);
        assert!((r.throughput.goodput_requests_per_s.unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(r.cdf_ms.ttft.len(), CDF_POINTS);
        assert_eq!(r.timeline_bucket_s, 0.1);
        assert_eq!(r.timeline.len(), 20);
        assert_eq!(r.timeline.iter().map(|p| p.completed).sum::<u64>(), 2);
        assert!((r.timeline.iter().map(|p| p.output_tokens).sum::<f64>() - 8.0).abs() < 1e-9);
        assert!(r.render_text().contains("http_503: 2"));
    }

    #[test]
    fn bucket_widths_are_round_and_bounded() {
        assert_eq!(bucket_width(3.0), 0.1);
        assert_eq!(bucket_width(60.0), 0.5);
        assert_eq!(bucket_width(600.0), 5.0);
        assert_eq!(bucket_width(100_000.0), 834.0);
    }

    #[test]
    fn hit_rate_counts_silent_requests_as_misses() {
        let mut hit = ok(0, 1, &[1], 2);
        hit.cached_tokens = Some(5);
        let records = vec![hit, ok(0, 1, &[1], 2)];
        let r = Report::from_records(
            "t",
            serde_json::Value::Null,
            &records,
            Duration::from_secs(1),
            &Slo::default(),
        );
        assert_eq!(r.tokens.cached_total, Some(5));
        assert_eq!(r.tokens.prefix_cache_hit_rate, Some(0.25));
        let r = Report::from_records(
            "t",
            serde_json::Value::Null,
            &records[1..],
            Duration::from_secs(1),
            &Slo::default(),
        );
        assert_eq!(r.tokens.prefix_cache_hit_rate, None);
    }

    #[test]
    fn itl_slo_applies_to_every_gap() {
        let slo = Slo {
            itl_ms: Some(15.0),
            ..Default::default()
        };
        assert!(slo.met_by(&ok(0, 1, &[10, 15], 3)));
        assert!(!slo.met_by(&ok(0, 1, &[10, 16], 3)));
        assert!(!slo.met_by(&failed(FailureKind::Timeout)));
    }

    #[test]
    fn empty_run_reports_zeroes() {
        let r = Report::from_records(
            "t",
            serde_json::Value::Null,
            &[],
            Duration::ZERO,
            &Slo::default(),
        );
        assert_eq!(r.requests.sent, 0);
        assert_eq!(r.throughput.requests_per_s, 0.0);
        assert!(r.latency_ms.ttft.is_none());
        assert!(r.slo.is_none());
    }

    #[test]
    fn report_round_trips_through_json() {
        let records = vec![ok(0, 100, &[10], 2)];
        let r = Report::from_records(
            "t",
            serde_json::json!({"a": 1}),
            &records,
            Duration::from_secs(1),
            &Slo::default(),
        );
        let text = serde_json::to_string(&r).unwrap();
        let back: Report = serde_json::from_str(&text).unwrap();
        assert_eq!(back.requests, r.requests);
        assert_eq!(back.label, "t");
        assert_eq!(back.cdf_ms.e2e.len(), CDF_POINTS);
        assert_eq!(back.request_lines.len(), 1);
    }
}
