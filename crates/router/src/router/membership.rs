//! Changing the pool at run time: endpoints added (their scraper and KV-event subscriber
//! started), removed (their tasks stopped, the indexes told), drained, re-synced to a
//! list, and the traffic split between endpoint groups.

use std::sync::Arc;

use super::pool::Runtime;
use super::{PoolError, Router};
use crate::circuit::Circuit;
use crate::datalayer::{kv_events, scrape};
use crate::endpoint::{EndpointId, EndpointSpec};
use crate::scheduling::{Candidate, TrafficSplit};

impl Router {
    /// Registers an endpoint and starts its scraper (and KV-event subscriber). It gets
    /// traffic once its first readiness check passes.
    pub fn add_endpoint(&self, spec: EndpointSpec) -> Result<EndpointId, PoolError> {
        let spec = spec
            .normalized()
            .map_err(|e| PoolError::Unknown(e.to_string()))?;
        let mut pool = self.inner.lock_pool();
        if pool.index_of(&spec.url).is_some() {
            return Err(PoolError::Exists(spec.url));
        }
        let id = match pool.free_slots.pop() {
            Some(s) => EndpointId(s),
            None => {
                pool.next_slot += 1;
                EndpointId(pool.next_slot - 1)
            }
        };
        let mut cand = Candidate::new(id, spec.clone());
        cand.ready = false;
        let weak = Arc::downgrade(&self.inner);
        let mut tasks = Vec::new();
        if tokio::runtime::Handle::try_current().is_ok() {
            tasks.push(tokio::spawn(scrape::run(weak.clone(), id, spec.clone())));
            if let Some(addr) = spec.kv_events.clone() {
                tasks.push(tokio::spawn(kv_events::run(
                    weak,
                    id,
                    spec.url.clone(),
                    addr,
                    spec.kv_events_replay.clone(),
                )));
            }
        }
        pool.cands.push(cand);
        pool.runtime.push(Runtime {
            circuit: Circuit::default(),
            health_ok: false,
            last_error: None,
            tasks,
            last_load: None,
            warned_unknown_load: false,
            warned_block_size: false,
        });
        drop(pool);
        tracing::info!(endpoint = %spec.url, kind = spec.kind.as_str(), "endpoint added");
        Ok(id)
    }

    /// Unregisters an endpoint: it gets nothing new, its background tasks stop and the
    /// indexes forget it. Requests already streaming from it continue.
    pub fn remove_endpoint(&self, url: &str) -> Result<(), PoolError> {
        let url =
            crate::endpoint::normalize_url(url).map_err(|e| PoolError::Unknown(e.to_string()))?;
        let mut pool = self.inner.lock_pool();
        let i = pool
            .index_of(&url)
            .ok_or_else(|| PoolError::Unknown(url.clone()))?;
        let cand = pool.cands.remove(i);
        let rt = pool.runtime.remove(i);
        for t in rt.tasks {
            t.abort();
        }
        pool.approx.remove_endpoint(cand.id);
        {
            // Same order as everywhere else: pool, then precise.
            let mut precise = self
                .inner
                .precise
                .write()
                .unwrap_or_else(|e| e.into_inner());
            precise.remove_endpoint(cand.id);
        }
        pool.free_slots.push(cand.id.0);
        drop(pool);
        self.inner.metrics.remove_endpoint(&url);
        tracing::info!(endpoint = %url, "endpoint removed");
        Ok(())
    }

    /// Marks an endpoint as draining (no new requests) or back in service.
    pub fn set_draining(&self, url: &str, draining: bool) -> Result<(), PoolError> {
        let url =
            crate::endpoint::normalize_url(url).map_err(|e| PoolError::Unknown(e.to_string()))?;
        let mut pool = self.inner.lock_pool();
        let i = pool
            .index_of(&url)
            .ok_or_else(|| PoolError::Unknown(url.clone()))?;
        pool.cands[i].draining = draining;
        Ok(())
    }

    /// Replaces the traffic split between endpoint groups (empty: no split).
    pub fn set_split(&self, split: TrafficSplit) {
        self.inner.lock_pool().split = split;
    }

    pub fn split(&self) -> TrafficSplit {
        self.inner.lock_pool().split.clone()
    }

    /// Replaces the endpoint set with `specs`: adds the new, removes the missing and
    /// re-adds those whose spec changed. In-flight requests are not touched.
    pub fn sync_endpoints(&self, specs: &[EndpointSpec]) {
        let current: Vec<EndpointSpec> = {
            let pool = self.inner.lock_pool();
            pool.cands.iter().map(|c| (*c.spec).clone()).collect()
        };
        for old in &current {
            match specs.iter().find(|s| s.url == old.url) {
                Some(new) if new == old => {}
                _ => {
                    let _ = self.remove_endpoint(&old.url);
                }
            }
        }
        for new in specs {
            if !current.iter().any(|o| o == new) {
                if let Err(e) = self.add_endpoint(new.clone()) {
                    tracing::warn!(error = %e, "endpoint not added");
                }
            }
        }
    }

    /// URLs of the registered endpoints.
    pub fn endpoints(&self) -> Vec<String> {
        self.inner
            .lock_pool()
            .cands
            .iter()
            .map(|c| c.spec.url.clone())
            .collect()
    }
}
