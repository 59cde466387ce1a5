//! The per-endpoint scraper: reads `/metrics` every `scrape_interval_ms` and `/health`
//! every `health_interval_ms`, each with a timeout, and stores what it learns in the
//! router's pool.
//!
//! Failure handling, which keeps a bad replica from ever hurting the router:
//! - a `/metrics` that hangs, errors or returns garbage leaves the last good values in
//!   place; they age past `stale_after_ms` and the endpoint counts as saturated and scores
//!   low, but it stays routable while `/health` says it is ready;
//! - a refused connection (the replica is gone) marks it not ready at once, without
//!   waiting for the next health check;
//! - `/health` other than 200, or no answer in time, marks it not ready.
//!
//! The task holds only a weak handle to the router and ends when the router is dropped
//! or the endpoint removed.

use std::sync::Weak;
use std::time::Duration;

use hyper::{Method, StatusCode};

use crate::client::{fetch, FetchError};
use crate::datalayer::metrics::parse_metrics;
use crate::datalayer::PoolFeed;
use crate::endpoint::{EndpointId, EndpointSpec};

/// Largest `/metrics` body read.
const MAX_METRICS_BYTES: usize = 4 << 20;

pub(crate) async fn run<F: PoolFeed>(weak: Weak<F>, id: EndpointId, spec: EndpointSpec) {
    let (interval, timeout, health_every) = match weak.upgrade() {
        Some(inner) => (
            Duration::from_millis(inner.config().scrape_interval_ms),
            Duration::from_millis(inner.config().scrape_timeout_ms),
            Duration::from_millis(inner.config().health_interval_ms),
        ),
        None => return,
    };
    let metrics_url = format!("{}/metrics", spec.url);
    let health_url = format!("{}/health", spec.url);
    let mut next_health = tokio::time::Instant::now();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(inner) = weak.upgrade() else { return };
        if !inner.has(id, &spec.url) {
            return;
        }
        let client = inner.client().clone();
        drop(inner);
        if tokio::time::Instant::now() >= next_health {
            next_health = tokio::time::Instant::now() + health_every;
            let r = fetch(&client, Method::GET, &health_url, None, timeout, 64 << 10).await;
            let Some(inner) = weak.upgrade() else { return };
            match r {
                Ok((StatusCode::OK, _)) => inner.update_health(id, &spec.url, true, None),
                Ok((status, _)) => inner.update_health(
                    id,
                    &spec.url,
                    false,
                    Some(format!("/health answered {status}")),
                ),
                Err(e) => inner.update_health(id, &spec.url, false, Some(format!("/health: {e}"))),
            }
        }
        // The metrics read gets its own deadline so a hanging /metrics delays only this
        // endpoint's next scrape.
        let r = fetch(
            &client,
            Method::GET,
            &metrics_url,
            None,
            timeout,
            MAX_METRICS_BYTES,
        )
        .await;
        let Some(inner) = weak.upgrade() else { return };
        match r {
            Ok((status, body)) if status.is_success() => {
                let parsed = parse_metrics(spec.kind, &body, inner.now())
                    .map_err(|e| format!("/metrics: {e}"));
                inner.update_metrics(id, &spec.url, parsed);
            }
            Ok((status, _)) => {
                inner.update_metrics(id, &spec.url, Err(format!("/metrics answered {status}")))
            }
            Err(FetchError::Connect(e)) => {
                inner.update_metrics(id, &spec.url, Err(format!("/metrics: connect: {e}")));
                inner.update_health(id, &spec.url, false, None);
                // Check readiness again at the next tick rather than after a full health
                // interval, so a restarted replica comes back quickly.
                next_health = tokio::time::Instant::now();
            }
            Err(e) => inner.update_metrics(id, &spec.url, Err(format!("/metrics: {e}"))),
        }
    }
}
