//! One attempt on an endpoint: [`Router::lease`] takes it when the endpoint's circuit
//! lets it through, and the [`Lease`] counts it in flight until dropped and feeds the
//! circuit breaker what came of it.

use std::sync::Arc;

use super::{Inner, Router};
use crate::endpoint::EndpointId;
use crate::telemetry::RouterMetrics;

/// Permission to send one attempt to an endpoint; counts it in flight until dropped and
/// feeds the circuit breaker.
pub struct Lease {
    inner: Arc<Inner>,
    id: EndpointId,
    url: Arc<str>,
}

impl Lease {
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The endpoint answered (any status below 500).
    pub fn success(&mut self) {
        self.settle(true);
    }

    /// The endpoint failed (connect error, 5xx, broken body).
    pub fn failure(&mut self) {
        self.settle(false);
    }

    fn settle(&mut self, ok: bool) {
        let now = self.inner.now();
        let cfg = self.inner.config.circuit_config();
        let mut pool = self.inner.lock_pool();
        if let Some(i) = pool.index_of_id(self.id, &self.url) {
            let c = &mut pool.runtime[i].circuit;
            if ok {
                c.on_success();
            } else {
                c.on_failure(now, &cfg);
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut pool = self.inner.lock_pool();
        if let Some(i) = pool.index_of_id(self.id, &self.url) {
            let c = &mut pool.cands[i];
            c.in_flight = c.in_flight.saturating_sub(1);
            c.done_since_scrape = c.done_since_scrape.saturating_add(1);
            let n = c.in_flight;
            drop(pool);
            self.inner
                .metrics
                .ep_in_flight
                .get_or_create(&RouterMetrics::endpoint(&self.url))
                .set(i64::from(n));
        }
        // A finished request: room for a waiting one.
        self.inner.pump_flows();
    }
}

impl Router {
    /// Takes a lease for one attempt on `id`, or `None` when its circuit refuses or it
    /// has gone.
    pub fn lease(&self, id: EndpointId, url: &Arc<str>) -> Option<Lease> {
        let now = self.now();
        let mut pool = self.inner.lock_pool();
        let i = pool.index_of_id(id, url)?;
        if !pool.runtime[i].circuit.try_acquire(now) {
            return None;
        }
        pool.cands[i].in_flight += 1;
        let n = pool.cands[i].in_flight;
        drop(pool);
        self.inner
            .metrics
            .ep_in_flight
            .get_or_create(&RouterMetrics::endpoint(url))
            .set(i64::from(n));
        Some(Lease {
            inner: self.inner.clone(),
            id,
            url: url.clone(),
        })
    }
}
