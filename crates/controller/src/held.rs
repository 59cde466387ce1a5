//! Requests a picker holds for a pool with no ready endpoint, read from the picker's
//! `/metrics` (`strata_router_flow_held_requests{pool}`): the scale-from-zero signal where
//! the picker, not this process, holds them (Kubernetes). Inside `strata up` the front
//! counts its held requests itself and hands them over as the registrar.
//!
//! A background task polls the page; the last count read is the signal, and it falls back
//! to 0 once three polls in a row have failed, so a picker that went away does not keep a
//! pool awake.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_api::model_server::router::FLOW_HELD_REQUESTS;
use strata_api::prometheus::samples;

use crate::driver::{ReplicaInfo, ReplicaRegistrar};

/// `heldRequests:` in controller.yaml: where the picker's metrics are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HeldRequestsSource {
    /// The picker's metrics page, e.g. `http://strata-picker:9090/metrics` (operator config).
    pub metrics_url: String,
    /// Only this pool's series (the picker's `--pool-name`); every pool's when absent.
    #[serde(default)]
    pub pool: Option<String>,
    /// Milliseconds between reads.
    #[serde(default = "default_interval_ms")]
    pub interval_ms: u64,
}

fn default_interval_ms() -> u64 {
    1000
}

impl HeldRequestsSource {
    pub fn validate(&self) -> Result<(), String> {
        let url = self.metrics_url.as_str();
        if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() < 10 {
            return Err(format!(
                "heldRequests.metricsUrl must be an http:// or https:// URL, not {url:?}"
            ));
        }
        if self.interval_ms == 0 {
            return Err("heldRequests.intervalMs must be at least 1".into());
        }
        Ok(())
    }
}

/// The held count on one metrics page: the sum of the held series of `pool` (or of every
/// pool). `None` when the page has no such series (not a picker with flow control).
pub fn held_in(page: &str, pool: Option<&str>) -> Option<u32> {
    let (all, _) = samples(page);
    let mut found = false;
    let mut total = 0.0;
    for s in all.iter().filter(|s| s.name == FLOW_HELD_REQUESTS) {
        if pool.is_none_or(|p| s.label("pool") == Some(p)) {
            found = true;
            if s.value.is_finite() && s.value > 0.0 {
                total += s.value;
            }
        }
    }
    found.then(|| total.min(f64::from(u32::MAX)) as u32)
}

/// A registrar that registers nobody (the picker discovers pods itself) and reports the
/// picker's held requests.
#[derive(Debug, Default)]
pub struct PickerHeld {
    held: AtomicU32,
}

impl ReplicaRegistrar for PickerHeld {
    fn register(&self, _replica: &ReplicaInfo) {}
    fn deregister(&self, _id: &str) {}
    fn held_requests(&self) -> u32 {
        self.held.load(Ordering::Acquire)
    }
}

/// Polls `source` with `client` (one trusting the picker's CA for an `https://` page:
/// [`crate::tls_client::http_client`]) until the returned registrar is the last one alive.
pub fn spawn(source: HeldRequestsSource, client: reqwest::Client) -> Arc<PickerHeld> {
    let held = Arc::new(PickerHeld::default());
    let weak = Arc::downgrade(&held);
    let interval = Duration::from_millis(source.interval_ms);
    tokio::spawn(async move {
        let mut failures = 0u32;
        loop {
            let Some(held) = weak.upgrade() else { return };
            match read(&client, &source, interval).await {
                Ok(n) => {
                    failures = 0;
                    held.held.store(n, Ordering::Release);
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(url = %source.metrics_url, error = %e, "cannot read held requests");
                    if failures >= 3 {
                        held.held.store(0, Ordering::Release);
                    }
                }
            }
            drop(held);
            tokio::time::sleep(interval).await;
        }
    });
    held
}

async fn read(
    client: &reqwest::Client,
    source: &HeldRequestsSource,
    timeout: Duration,
) -> Result<u32, String> {
    let resp = client
        .get(&source.metrics_url)
        .timeout(timeout.max(Duration::from_millis(500)))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let page = resp.text().await.map_err(|e| e.to_string())?;
    held_in(&page, source.pool.as_deref())
        .ok_or_else(|| format!("no {FLOW_HELD_REQUESTS} series on the page"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP strata_router_flow_held_requests Requests held\n\
        # TYPE strata_router_flow_held_requests gauge\n\
        strata_router_flow_held_requests{pool=\"chat\"} 3\n\
        strata_router_flow_held_requests{pool=\"batch\"} 2\n\
        strata_router_requests_total 9\n";

    #[test]
    fn the_held_count_is_read_per_pool_or_summed() {
        assert_eq!(held_in(PAGE, Some("chat")), Some(3));
        assert_eq!(held_in(PAGE, Some("batch")), Some(2));
        assert_eq!(held_in(PAGE, None), Some(5));
        // A pool the picker does not serve has no series; neither has a page without flow
        // control.
        assert_eq!(held_in(PAGE, Some("other")), None);
        assert_eq!(held_in("strata_router_requests_total 9\n", None), None);
        // Nonsense values count as nothing held.
        assert_eq!(
            held_in("strata_router_flow_held_requests{pool=\"a\"} NaN\n", None),
            Some(0)
        );
    }

    #[test]
    fn a_source_needs_an_http_url_and_an_interval() {
        let ok = HeldRequestsSource {
            metrics_url: "http://picker:9090/metrics".into(),
            pool: None,
            interval_ms: 1000,
        };
        assert!(ok.validate().is_ok());
        for bad in ["picker:9090", "file:///etc/passwd", ""] {
            let s = HeldRequestsSource {
                metrics_url: bad.into(),
                ..ok.clone()
            };
            assert!(s.validate().is_err(), "{bad}");
        }
        let s = HeldRequestsSource {
            interval_ms: 0,
            ..ok
        };
        assert!(s.validate().is_err());
    }

    #[tokio::test]
    async fn the_registrar_reports_what_the_picker_holds_and_forgets_a_lost_picker() {
        use axum::routing::get;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route("/metrics", get(|| async { PAGE }));
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let held = spawn(
            HeldRequestsSource {
                metrics_url: format!("http://{addr}/metrics"),
                pool: Some("chat".into()),
                interval_ms: 20,
            },
            reqwest::Client::new(),
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while held.held_requests() != 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "never read the held count"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The picker goes away: after three failed reads the count falls back to 0.
        server.abort();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while held.held_requests() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "kept a lost picker's count"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
