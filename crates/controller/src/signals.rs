//! Signals from engines: the Prometheus text each replica serves at `/metrics`, read with
//! the metric names of each engine kind (PROTOCOLS §2), and summed into one [`Load`].
//!
//! A tick's sample is all-or-nothing: if any ready replica cannot be scraped, the tick has
//! no sample, so the autoscaler never sees a partial (too low) load and scales in blind.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use strata_api::model_server::parse_load;
pub use strata_api::model_server::{EngineKind, LoadSample};
use strata_api::prometheus::{histogram_delta, histogram_quantile, Buckets};

use crate::autoscale::Load;
use crate::driver::ReplicaInfo;

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("GET {url}: {detail}")]
    Http { url: String, detail: String },
    #[error("{url}: status {status}")]
    Status { url: String, status: u16 },
    #[error("{url}: {error}")]
    Metrics {
        url: String,
        error: strata_api::model_server::MetricsError,
    },
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

/// Sums per-replica samples into one [`Load`], and turns each replica's cumulative TTFT
/// histogram into what it observed since the previous tick. Pure: whoever read the samples
/// (over HTTP here, or the router's own scraper inside `strata up`) hands them in.
#[derive(Debug, Default)]
pub struct LoadAggregator {
    /// Each replica's TTFT histogram at the previous tick.
    previous_ttft: BTreeMap<String, Buckets>,
}

impl LoadAggregator {
    /// One tick: `(replica id, its sample or None when it could not be read)` for every
    /// ready replica. `Ok` when every replica answered; otherwise `Err` with the answering
    /// replicas' load when any did (a lower bound, never to be taken as the load).
    pub fn aggregate<'a>(
        &mut self,
        samples: impl IntoIterator<Item = (&'a str, Option<&'a LoadSample>)>,
    ) -> Result<Load, Option<Load>> {
        let mut load = Load::default();
        let mut kv = Vec::new();
        let mut tokens = Some(0.0);
        let mut ttft: Buckets = Vec::new();
        let mut previous = BTreeMap::new();
        let (mut failed, mut replicas) = (false, 0usize);
        for (id, sample) in samples {
            replicas += 1;
            let Some(m) = sample else {
                failed = true;
                continue;
            };
            load.waiting += m.waiting;
            load.running += m.running;
            if let Some(k) = m.kv_use {
                kv.push(k);
            }
            tokens = tokens.zip(m.kv_tokens()).map(|(t, k)| t + k);
            if !m.ttft.is_empty() {
                let delta = match self.previous_ttft.get(id) {
                    Some(before) => histogram_delta(&m.ttft, before),
                    // The first sample of a replica has no interval to speak of.
                    None => m.ttft.iter().map(|&(b, _)| (b, 0.0)).collect(),
                };
                if ttft.is_empty() {
                    ttft = delta;
                } else if ttft.len() == delta.len() {
                    for (a, d) in ttft.iter_mut().zip(&delta) {
                        a.1 += d.1;
                    }
                }
                previous.insert(id.to_string(), m.ttft.clone());
            }
        }
        self.previous_ttft = previous;
        if failed {
            let answered = load.waiting + load.running > 0.0 || !kv.is_empty();
            return Err(answered.then_some(load));
        }
        load.kv_usage = (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64);
        load.inflight_tokens = if replicas == 0 { None } else { tokens };
        load.ttft_p90_secs = histogram_quantile(&ttft, 0.9);
        Ok(load)
    }
}

/// Scrapes each ready replica's `/metrics` over HTTP (`strata controller` on its own; inside
/// `strata up` the router's scraper is the one reader).
pub struct MetricsScraper {
    client: reqwest::Client,
    kind: EngineKind,
    timeout: Duration,
    aggregator: LoadAggregator,
    /// Failed scrapes so far (exported as a metric).
    pub failures: u64,
    /// The answering replicas' load after the last incomplete collect.
    last_partial: Option<Load>,
}

impl MetricsScraper {
    pub fn new(kind: EngineKind, timeout: Duration) -> MetricsScraper {
        Self::with_client(kind, timeout, reqwest::Client::new())
    }

    /// A scraper over `client` (one that trusts the replicas' CA, for `https://` ones:
    /// [`crate::tls_client::http_client`]).
    pub fn with_client(kind: EngineKind, timeout: Duration, client: reqwest::Client) -> Self {
        MetricsScraper {
            client,
            kind,
            timeout,
            aggregator: LoadAggregator::default(),
            failures: 0,
            last_partial: None,
        }
    }

    /// Scrapes one replica.
    pub async fn scrape(&self, base_url: &str) -> Result<LoadSample, ScrapeError> {
        scrape(&self.client, self.kind, self.timeout, base_url).await
    }
}

async fn scrape(
    client: &reqwest::Client,
    kind: EngineKind,
    timeout: Duration,
    base_url: &str,
) -> Result<LoadSample, ScrapeError> {
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
        resp.bytes().await.map_err(http)
    };
    let body = tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| ScrapeError::Http {
            url: url.clone(),
            detail: format!("timed out after {timeout:?}"),
        })??;
    parse_load(kind, &body).map_err(|error| ScrapeError::Metrics { url, error })
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
        let mut samples = Vec::with_capacity(ready.len());
        for (r, res) in ready.iter().zip(results) {
            match res {
                Ok(m) => samples.push((r.id.as_str(), Some(m))),
                Err(e) => {
                    tracing::debug!(replica = %r.id, error = %e, "scrape failed");
                    self.failures += 1;
                    samples.push((r.id.as_str(), None));
                }
            }
        }
        let outcome = self
            .aggregator
            .aggregate(samples.iter().map(|(id, m)| (*id, m.as_ref())));
        match outcome {
            Ok(load) => {
                self.last_partial = None;
                Some(load)
            }
            Err(partial) => {
                self.last_partial = partial;
                None
            }
        }
    }

    fn partial(&self) -> Option<Load> {
        self.last_partial
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"vllm:num_requests_waiting{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="0"} 5
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="0"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 10
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 20
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 30
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 30
"#;

    fn sample(text: &str) -> LoadSample {
        parse_load(EngineKind::Vllm, text.as_bytes()).unwrap()
    }

    #[test]
    fn ticks_sum_replicas_and_take_ttft_since_the_last_tick() {
        let mut agg = LoadAggregator::default();
        let a = sample(VLLM);
        let load = agg.aggregate([("a", Some(&a)), ("b", Some(&a))]).unwrap();
        assert_eq!((load.waiting, load.running), (6.0, 10.0));
        assert_eq!(load.kv_usage, Some(0.5));
        assert_eq!(load.inflight_tokens, Some(2.0 * 0.5 * 100.0 * 16.0));
        // The first tick has no interval: no TTFT yet.
        assert_eq!(load.ttft_p90_secs, None);
        // 10 more observations on `a`, all in (0.5, 1.0].
        let later = sample(&VLLM.replace("} 30\n", "} 40\n"));
        let load = agg
            .aggregate([("a", Some(&later)), ("b", Some(&a))])
            .unwrap();
        let p90 = load.ttft_p90_secs.unwrap();
        assert!((p90 - 0.95).abs() < 1e-9, "{p90}");
    }

    #[test]
    fn a_missing_replica_makes_the_tick_partial() {
        let mut agg = LoadAggregator::default();
        let a = sample(VLLM);
        let partial = agg.aggregate([("a", Some(&a)), ("b", None)]).unwrap_err();
        assert_eq!(partial.map(|p| p.waiting), Some(3.0));
        assert_eq!(agg.aggregate([("b", None)]).unwrap_err(), None);
        let none = agg.aggregate(std::iter::empty()).unwrap();
        assert_eq!((none.concurrency(), none.inflight_tokens), (0.0, None));
    }
}
