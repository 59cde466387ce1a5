//! Signals from engines: the Prometheus text each replica serves at `/metrics`, read with
//! the metric names of each engine kind (PROTOCOLS §2), and summed into one [`Load`].
//!
//! A tick's sample is all-or-nothing: if any ready replica cannot be scraped, the tick has
//! no sample, so the autoscaler never sees a partial (too low) load and scales in blind.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::autoscale::Load;
use crate::driver::ReplicaInfo;

/// The engine's metric dialect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// vLLM names (a Strata engine exports these).
    #[default]
    Vllm,
    Sglang,
    Trtllm,
    Llamacpp,
}

/// Metric names of one engine kind (PROTOCOLS §2).
struct Names {
    waiting: &'static str,
    running: &'static str,
    kv: &'static [&'static str],
    cache_info: Option<(&'static str, &'static str)>,
    block_size_gauge: Option<&'static str>,
    ttft: Option<&'static str>,
}

impl EngineKind {
    fn names(self) -> Names {
        match self {
            EngineKind::Vllm => Names {
                waiting: "vllm:num_requests_waiting",
                running: "vllm:num_requests_running",
                // Older vLLM releases named it gpu_cache_usage_perc.
                kv: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
                cache_info: Some(("vllm:cache_config_info", "block_size")),
                block_size_gauge: None,
                ttft: Some("vllm:time_to_first_token_seconds"),
            },
            EngineKind::Sglang => Names {
                waiting: "sglang:num_queue_reqs",
                running: "sglang:num_running_reqs",
                kv: &["sglang:token_usage"],
                cache_info: Some(("sglang:cache_config_info", "page_size")),
                block_size_gauge: None,
                ttft: Some("sglang:time_to_first_token_seconds"),
            },
            EngineKind::Trtllm => Names {
                waiting: "trtllm_num_requests_waiting",
                running: "trtllm_num_requests_running",
                kv: &["trtllm_kv_cache_utilization"],
                cache_info: None,
                block_size_gauge: Some("trtllm_kv_cache_tokens_per_block"),
                ttft: None,
            },
            EngineKind::Llamacpp => Names {
                waiting: "llamacpp:requests_deferred",
                running: "llamacpp:requests_processing",
                kv: &[],
                cache_info: None,
                block_size_gauge: None,
                ttft: None,
            },
        }
    }
}

/// One sample line of the Prometheus text format.
#[derive(Debug, Clone, PartialEq)]
pub struct PromSample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl PromSample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses Prometheus text exposition (and the OpenMetrics subset engines emit). Comment
/// lines are skipped; a line that does not parse is skipped and counted in the second
/// value, so one odd line never hides the rest.
pub fn parse_prometheus(text: &str) -> (Vec<PromSample>, usize) {
    let mut out = Vec::new();
    let mut bad = 0;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_line(line) {
            Some(s) => out.push(s),
            None => bad += 1,
        }
    }
    (out, bad)
}

fn parse_line(line: &str) -> Option<PromSample> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        || name.starts_with(|c: char| c.is_ascii_digit())
    {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices().peekable();
        loop {
            // Skip separators.
            while let Some(&(_, c)) = chars.peek() {
                if c == ',' || c.is_whitespace() {
                    chars.next();
                } else {
                    break;
                }
            }
            let &(start, c) = chars.peek()?;
            if c == '}' {
                rest = &r[start + 1..];
                break;
            }
            let mut key_end = start;
            while let Some(&(i, c)) = chars.peek() {
                if c == '=' {
                    key_end = i;
                    break;
                }
                chars.next();
            }
            let key = r[start..key_end].trim().to_string();
            chars.next(); // '='
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                let (_, c) = chars.next()?;
                match c {
                    '"' => break,
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    other => value.push(other),
                }
            }
            if key.is_empty() {
                return None;
            }
            labels.push((key, value));
        }
    }
    let value_text = rest.split_whitespace().next()?;
    let value = match value_text {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse::<f64>().ok()?,
    };
    Some(PromSample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// What one replica reported.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineMetrics {
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: Option<f64>,
    pub block_size: Option<f64>,
    pub num_blocks: Option<f64>,
    /// Cumulative TTFT histogram: (upper bound, count), sorted by bound.
    pub ttft_buckets: Vec<(f64, f64)>,
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("GET {url}: {detail}")]
    Http { url: String, detail: String },
    #[error("{url}: status {status}")]
    Status { url: String, status: u16 },
    #[error("{url}: no `{metric}` in the metrics")]
    Missing { url: String, metric: &'static str },
}

/// Reads an engine's metrics from parsed samples. Values of the same name are summed
/// (an engine may report one series per model or rank).
pub fn extract(kind: EngineKind, samples: &[PromSample]) -> Option<EngineMetrics> {
    let n = kind.names();
    let sum = |name: &str| {
        let mut it = samples.iter().filter(|s| s.name == name).peekable();
        it.peek()?;
        Some(it.map(|s| s.value).sum::<f64>())
    };
    let mean = |name: &str| {
        let v: Vec<f64> = samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.value)
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let waiting = sum(n.waiting)?;
    let running = sum(n.running)?;
    let kv_usage = n.kv.iter().find_map(|k| mean(k));
    let mut block_size = n.block_size_gauge.and_then(mean);
    let mut num_blocks = None;
    if let Some((info, key)) = n.cache_info {
        if let Some(s) = samples.iter().find(|s| s.name == info) {
            block_size = s.label(key).and_then(|v| v.parse().ok());
            num_blocks = s.label("num_gpu_blocks").and_then(|v| v.parse().ok());
        }
    }
    let mut ttft_buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    if let Some(base) = n.ttft {
        let bucket_name = format!("{base}_bucket");
        for s in samples.iter().filter(|s| s.name == bucket_name) {
            let Some(le) = s.label("le").and_then(|v| match v {
                "+Inf" | "Inf" => Some(f64::INFINITY),
                v => v.parse::<f64>().ok(),
            }) else {
                continue;
            };
            let e = ttft_buckets.entry(le.to_bits()).or_insert((le, 0.0));
            e.1 += s.value;
        }
    }
    let mut ttft_buckets: Vec<(f64, f64)> = ttft_buckets.into_values().collect();
    ttft_buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    Some(EngineMetrics {
        waiting,
        running,
        kv_usage,
        block_size,
        num_blocks,
        ttft_buckets,
    })
}

/// The `q` quantile of a cumulative histogram, interpolating linearly inside the bucket
/// (as Prometheus' `histogram_quantile` does). `None` when it holds no observations.
pub fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let mut prev_bound = 0.0;
    let mut prev_count = 0.0;
    for &(bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                // Past the last finite bound: the best estimate is that bound.
                return Some(prev_bound);
            }
            let in_bucket = count - prev_count;
            if in_bucket <= 0.0 {
                return Some(bound);
            }
            return Some(prev_bound + (bound - prev_bound) * (rank - prev_count) / in_bucket);
        }
        prev_bound = bound;
        prev_count = count;
    }
    Some(prev_bound)
}

/// Bucket-wise `now - before` (counts since the last scrape). A counter that went down
/// (engine restarted) yields `now` itself.
pub fn histogram_delta(now: &[(f64, f64)], before: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let restarted =
        now.len() != before.len() || now.iter().zip(before).any(|(a, b)| a.0 != b.0 || a.1 < b.1);
    if restarted {
        return now.to_vec();
    }
    now.iter()
        .zip(before)
        .map(|(a, b)| (a.0, a.1 - b.1))
        .collect()
}

/// Something that turns the ready replicas into one load sample per tick.
pub trait SignalSource: Send {
    /// The load now, or `None` when it cannot be known (a scrape failed).
    fn collect(&mut self, ready: &[ReplicaInfo]) -> impl Future<Output = Option<Load>> + Send;

    /// After a `collect` that returned `None`: the load of the replicas that did answer,
    /// when any did (a lower bound).
    fn partial(&self) -> Option<Load> {
        None
    }
}

/// Scrapes each ready replica's `/metrics` over HTTP.
pub struct MetricsScraper {
    client: reqwest::Client,
    kind: EngineKind,
    timeout: Duration,
    /// Each replica's TTFT histogram at the previous scrape.
    previous_ttft: BTreeMap<String, Vec<(f64, f64)>>,
    /// Failed scrapes so far (exported as a metric).
    pub failures: u64,
    /// The answering replicas' load after the last incomplete collect.
    last_partial: Option<Load>,
}

impl MetricsScraper {
    pub fn new(kind: EngineKind, timeout: Duration) -> MetricsScraper {
        MetricsScraper {
            client: reqwest::Client::new(),
            kind,
            timeout,
            previous_ttft: BTreeMap::new(),
            failures: 0,
            last_partial: None,
        }
    }

    /// Scrapes one replica.
    pub async fn scrape(&self, base_url: &str) -> Result<EngineMetrics, ScrapeError> {
        scrape(&self.client, self.kind, self.timeout, base_url).await
    }
}

async fn scrape(
    client: &reqwest::Client,
    kind: EngineKind,
    timeout: Duration,
    base_url: &str,
) -> Result<EngineMetrics, ScrapeError> {
    let url = format!("{}/metrics", base_url.trim_end_matches('/'));
    let http = |e: reqwest::Error| ScrapeError::Http {
        url: url.clone(),
        detail: e.to_string(),
    };
    let fut = async {
        let resp = client.get(&url).send().await.map_err(http)?;
        if !resp.status().is_success() {
            return Err(ScrapeError::Status {
                url: url.clone(),
                status: resp.status().as_u16(),
            });
        }
        resp.text().await.map_err(http)
    };
    let text = tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| ScrapeError::Http {
            url: url.clone(),
            detail: format!("timed out after {timeout:?}"),
        })??;
    let (samples, _) = parse_prometheus(&text);
    extract(kind, &samples).ok_or(ScrapeError::Missing {
        url,
        metric: kind.names().waiting,
    })
}

impl SignalSource for MetricsScraper {
    async fn collect(&mut self, ready: &[ReplicaInfo]) -> Option<Load> {
        let futures = ready.iter().map(|r| {
            let client = self.client.clone();
            let (kind, timeout) = (self.kind, self.timeout);
            let url = r.url.clone();
            async move { scrape(&client, kind, timeout, &url).await }
        });
        let results = futures_util::future::join_all(futures).await;
        let mut load = Load::default();
        let mut kv = Vec::new();
        let mut tokens = Some(0.0);
        let mut ttft: Vec<(f64, f64)> = Vec::new();
        let mut previous = BTreeMap::new();
        let mut failed = false;
        for (r, res) in ready.iter().zip(results) {
            let m = match res {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(replica = %r.id, error = %e, "scrape failed");
                    self.failures += 1;
                    failed = true;
                    continue;
                }
            };
            load.waiting += m.waiting;
            load.running += m.running;
            if let Some(k) = m.kv_usage {
                kv.push(k);
            }
            tokens = match (tokens, m.kv_usage, m.num_blocks, m.block_size) {
                (Some(t), Some(k), Some(n), Some(b)) => Some(t + k * n * b),
                _ => None,
            };
            if !m.ttft_buckets.is_empty() {
                let delta = match self.previous_ttft.get(&r.id) {
                    Some(before) => histogram_delta(&m.ttft_buckets, before),
                    // The first scrape of a replica has no interval to speak of.
                    None => m.ttft_buckets.iter().map(|&(b, _)| (b, 0.0)).collect(),
                };
                if ttft.is_empty() {
                    ttft = delta;
                } else if ttft.len() == delta.len() {
                    for (a, d) in ttft.iter_mut().zip(&delta) {
                        a.1 += d.1;
                    }
                }
                previous.insert(r.id.clone(), m.ttft_buckets);
            }
        }
        self.previous_ttft = previous;
        self.last_partial = None;
        if failed {
            let answered = load.waiting + load.running > 0.0 || !kv.is_empty();
            self.last_partial = answered.then_some(load);
            return None;
        }
        load.kv_usage = (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64);
        load.inflight_tokens = if ready.is_empty() { None } else { tokens };
        load.ttft_p90_secs = histogram_quantile(&ttft, 0.9);
        Some(load)
    }

    fn partial(&self) -> Option<Load> {
        self.last_partial
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="0"} 5
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="0"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 10
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 20
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 30
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 30
vllm:time_to_first_token_seconds_count{model_name="m"} 30
weird_label{a="x\"y\\z\n",b=""} -2.5e-3 1700000000
"#;

    #[test]
    fn parses_vllm_metrics() {
        let (samples, bad) = parse_prometheus(VLLM);
        assert_eq!(bad, 0);
        let w = samples.iter().find(|s| s.name == "weird_label").unwrap();
        assert_eq!(w.label("a"), Some("x\"y\\z\n"));
        assert_eq!(w.label("b"), Some(""));
        assert_eq!(w.value, -2.5e-3);
        let m = extract(EngineKind::Vllm, &samples).unwrap();
        assert_eq!((m.waiting, m.running), (3.0, 5.0));
        assert_eq!(m.kv_usage, Some(0.5), "the older KV name is accepted");
        assert_eq!((m.block_size, m.num_blocks), (Some(16.0), Some(100.0)));
        assert_eq!(m.ttft_buckets.len(), 4);
        // p90 of 30: rank 27 lies in (0.5, 1.0] holding 10: 0.5 + 0.5 * 7/10.
        let p90 = histogram_quantile(&m.ttft_buckets, 0.9).unwrap();
        assert!((p90 - 0.85).abs() < 1e-9, "{p90}");
    }

    #[test]
    fn other_engine_kinds() {
        let sg = "sglang:num_queue_reqs{model_name=\"m\"} 2\nsglang:num_running_reqs 4\nsglang:token_usage 0.25\nsglang:cache_config_info{page_size=\"32\"} 1\n";
        let m = extract(EngineKind::Sglang, &parse_prometheus(sg).0).unwrap();
        assert_eq!(
            (m.waiting, m.running, m.kv_usage, m.block_size),
            (2.0, 4.0, Some(0.25), Some(32.0))
        );
        let lc = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 7\n";
        let m = extract(EngineKind::Llamacpp, &parse_prometheus(lc).0).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_usage), (7.0, 1.0, None));
        let tr = "trtllm_num_requests_waiting 1\ntrtllm_num_requests_running 2\ntrtllm_kv_cache_utilization 0.9\ntrtllm_kv_cache_tokens_per_block 64\n";
        let m = extract(EngineKind::Trtllm, &parse_prometheus(tr).0).unwrap();
        assert_eq!((m.kv_usage, m.block_size), (Some(0.9), Some(64.0)));
        // The wrong dialect has no waiting gauge: no metrics.
        assert!(extract(EngineKind::Sglang, &parse_prometheus(VLLM).0).is_none());
    }

    #[test]
    fn garbage_lines_are_counted_not_fatal() {
        let text = "\u{0}{{{ this is not # the prometheus format ]]]\nvllm:num_requests_waiting 1\nvllm:num_requests_running 2\nx{a=\"unterminated} 1\n1bad 2\nok_name notanumber\n";
        let (samples, bad) = parse_prometheus(text);
        assert_eq!(samples.len(), 2);
        assert_eq!(bad, 4);
        assert!(extract(EngineKind::Vllm, &parse_prometheus("\u{0}{{{ garbage\n").0).is_none());
    }

    #[test]
    fn histogram_delta_and_quantiles() {
        let before = vec![(0.1, 10.0), (1.0, 20.0), (f64::INFINITY, 20.0)];
        let now = vec![(0.1, 10.0), (1.0, 30.0), (f64::INFINITY, 40.0)];
        let d = histogram_delta(&now, &before);
        assert_eq!(d, vec![(0.1, 0.0), (1.0, 10.0), (f64::INFINITY, 20.0)]);
        // Half the new observations are above the last finite bound.
        assert_eq!(histogram_quantile(&d, 0.9), Some(1.0));
        assert_eq!(histogram_quantile(&d, 0.25).unwrap(), 0.1 + 0.9 * 0.5);
        // A restart (counts went down) uses the new histogram whole.
        assert_eq!(histogram_delta(&before, &now), before);
        assert_eq!(
            histogram_quantile(&[(1.0, 0.0), (f64::INFINITY, 0.0)], 0.9),
            None
        );
        assert_eq!(histogram_quantile(&[], 0.9), None);
    }

    proptest! {
        #[test]
        fn parser_never_panics(s in ".{0,200}") {
            let _ = parse_prometheus(&s);
        }

        #[test]
        fn parser_round_trips_simple_lines(
            name in "[a-z_:][a-z0-9_:]{0,20}",
            key in "[a-z_][a-z0-9_]{0,10}",
            value in "[ -~]{0,20}",
            v in -1e9f64..1e9,
        ) {
            let escaped = value.replace('\\', "\\\\").replace('"', "\\\"");
            let line = format!("{name}{{{key}=\"{escaped}\"}} {v}");
            let (samples, bad) = parse_prometheus(&line);
            prop_assert_eq!(bad, 0);
            prop_assert_eq!(samples.len(), 1);
            prop_assert_eq!(samples[0].label(&key), Some(value.as_str()));
            prop_assert_eq!(samples[0].value, v);
        }
    }
}
