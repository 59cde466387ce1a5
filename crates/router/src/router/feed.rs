//! The data layer's writes into the pool ([`PoolFeed`]): scrape results, readiness, and
//! the block size an endpoint's KV events carry. The scrapers and KV-event subscribers
//! hold a weak handle and write through these.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use strata_api::model_server::LoadSample;

use super::Inner;
use crate::client::HttpClient;
use crate::config::RouterConfig;
use crate::datalayer::PoolFeed;
use crate::endpoint::EndpointId;
use crate::prefix::precise::PreciseIndex;
use crate::scheduling::EndpointMetrics;
use crate::telemetry::RouterMetrics;

impl PoolFeed for Inner {
    fn config(&self) -> &RouterConfig {
        &self.config
    }

    fn client(&self) -> &HttpClient {
        &self.client
    }

    fn metrics(&self) -> &RouterMetrics {
        &self.metrics
    }

    fn now(&self) -> Duration {
        Inner::now(self)
    }

    fn precise(&self) -> &RwLock<PreciseIndex> {
        &self.precise
    }

    /// Whether slot `id` still belongs to `url`.
    fn has(&self, id: EndpointId, url: &str) -> bool {
        self.lock_pool().index_of_id(id, url).is_some()
    }

    /// Stores a scrape result for slot `id` (if it is still `url`).
    fn update_metrics(
        &self,
        id: EndpointId,
        url: &str,
        result: Result<(EndpointMetrics, LoadSample), String>,
    ) {
        let mut pool = self.lock_pool();
        let Some(i) = pool.index_of_id(id, url) else {
            return;
        };
        let label = RouterMetrics::endpoint(url);
        match result {
            Ok((m, load)) => {
                pool.runtime[i].last_load = Some(Arc::new(load));
                self.metrics.ep_waiting.get_or_create(&label).set(m.waiting);
                self.metrics.ep_running.get_or_create(&label).set(m.running);
                self.metrics
                    .ep_kv_usage
                    .get_or_create(&label)
                    .set(m.kv_use.unwrap_or(0.0));
                pool.cands[i].scraped(m);
                pool.runtime[i].last_error = None;
            }
            Err(e) => {
                self.metrics.scrape_errors.get_or_create(&label).inc();
                if pool.cands[i].load_unknown() && !pool.runtime[i].warned_unknown_load {
                    pool.runtime[i].warned_unknown_load = true;
                    tracing::warn!(
                        endpoint = %url,
                        error = %e,
                        "no readable /metrics: its load is unknown, so it is routed by this \
                         router's requests in flight (least-request) until metrics appear"
                    );
                }
                pool.runtime[i].last_error = Some(e);
            }
        }
        drop(pool);
        self.pump_flows();
    }

    /// Stores a readiness result.
    fn update_health(&self, id: EndpointId, url: &str, ok: bool, error: Option<String>) {
        let mut pool = self.lock_pool();
        let Some(i) = pool.index_of_id(id, url) else {
            return;
        };
        if pool.runtime[i].health_ok != ok {
            tracing::info!(endpoint = %url, ready = ok, "readiness changed");
        }
        pool.runtime[i].health_ok = ok;
        if let Some(e) = error {
            pool.runtime[i].last_error = Some(e);
        }
        drop(pool);
        self.metrics
            .ep_ready
            .get_or_create(&RouterMetrics::endpoint(url))
            .set(i64::from(ok));
        self.pump_flows();
    }

    /// Records the block size an endpoint's KV events carry (the size its block hashes
    /// were computed with); says once in the log when it differs from what its metrics
    /// say or, without those, from `precise.block_size`.
    fn note_kv_block_size(&self, id: EndpointId, url: &str, block_size: u32) {
        if block_size == 0 {
            return;
        }
        let mut pool = self.lock_pool();
        let Some(i) = pool.index_of_id(id, url) else {
            return;
        };
        if pool.cands[i].kv_block_size == Some(block_size) {
            return;
        }
        pool.cands[i].kv_block_size = Some(block_size);
        let from_metrics = pool.cands[i].metrics.as_ref().and_then(|m| m.block_size);
        let (expected, source) = match from_metrics {
            Some(b) => (b, "its metrics (cache_config_info)"),
            None => (self.default_block_size(), "precise.block_size"),
        };
        if expected != block_size && !pool.runtime[i].warned_block_size {
            pool.runtime[i].warned_block_size = true;
            tracing::warn!(
                endpoint = %url,
                events = block_size,
                expected,
                source,
                "KV events carry a different block size; hashing this endpoint's prompts \
                 with the events' block size"
            );
        }
    }
}
