//! The live state for readers: each endpoint's status (`/debug/endpoints`), the debug
//! view, whether any endpoint is ready or all are saturated, an endpoint's last load
//! sample, and what the precise index says it holds.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use strata_api::model_server::LoadSample;

use super::pool::refresh_ready;
use super::Router;
use crate::circuit::Circuit;
use crate::endpoint::{EndpointId, EndpointSpec};
use crate::scheduling::saturation::pool_saturated;
use crate::scheduling::EndpointMetrics;

/// Live state of one endpoint, for `/debug/endpoints`.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointStatus {
    pub id: EndpointId,
    #[serde(flatten)]
    pub spec: EndpointSpec,
    pub ready: bool,
    pub health_ok: bool,
    pub draining: bool,
    pub stale: bool,
    pub saturated: bool,
    pub in_flight: u32,
    pub circuit: Circuit,
    pub metrics: Option<EndpointMetrics>,
    pub metrics_age_ms: Option<u64>,
    /// It has never served readable metrics: routed by in-flight requests (least-request).
    pub load_unknown: bool,
    /// The block size its prompts are hashed with for the precise index.
    pub block_size: u32,
    pub last_error: Option<String>,
}

impl Router {
    /// Whether any endpoint may take a request now.
    pub fn any_ready(&self) -> bool {
        let now = self.now();
        let mut pool = self.inner.lock_pool();
        refresh_ready(&mut pool, now);
        pool.cands.iter().any(|c| c.ready && !c.draining)
    }

    /// Whether every ready endpoint is saturated.
    pub fn saturated(&self) -> bool {
        let now = self.now();
        let mut pool = self.inner.lock_pool();
        refresh_ready(&mut pool, now);
        pool_saturated(&pool.cands, now, &self.inner.config.saturation_config())
    }

    /// The last readable `/metrics` page of the endpoint at `url`, and its age.
    pub fn load_sample(&self, url: &str) -> Option<(Arc<LoadSample>, Duration)> {
        let url = crate::endpoint::normalize_url(url).ok()?;
        let now = self.now();
        let pool = self.inner.lock_pool();
        let i = pool.index_of(&url)?;
        let age = now.saturating_sub(pool.cands[i].metrics.as_ref()?.updated);
        Some((pool.runtime[i].last_load.clone()?, age))
    }

    /// Whether the precise index (KV events) says the endpoint at `url` holds the block
    /// with wire hash `hash`. For tests and debugging.
    pub fn precise_holds(&self, url: &str, hash: u64) -> bool {
        let Ok(url) = crate::endpoint::normalize_url(url) else {
            return false;
        };
        let id = {
            let pool = self.inner.lock_pool();
            match pool.index_of(&url) {
                Some(i) => pool.cands[i].id,
                None => return false,
            }
        };
        self.inner
            .precise
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .holds(id, hash)
    }

    /// The live state of every endpoint.
    pub fn status(&self) -> Vec<EndpointStatus> {
        let now = self.now();
        let sat = self.inner.config.saturation_config();
        let mut pool = self.inner.lock_pool();
        refresh_ready(&mut pool, now);
        pool.cands
            .iter()
            .zip(&pool.runtime)
            .map(|(c, rt)| EndpointStatus {
                id: c.id,
                spec: (*c.spec).clone(),
                ready: c.ready,
                health_ok: rt.health_ok,
                draining: c.draining,
                stale: c.fresh_metrics(now, sat.stale_after).is_none(),
                saturated: crate::scheduling::saturation::endpoint_saturated(c, now, &sat),
                in_flight: c.in_flight,
                circuit: rt.circuit,
                metrics_age_ms: c
                    .metrics
                    .as_ref()
                    .map(|m| now.saturating_sub(m.updated).as_millis() as u64),
                metrics: c.metrics.clone(),
                load_unknown: c.load_unknown(),
                block_size: c.block_size(self.inner.default_block_size()),
                last_error: rt.last_error.clone(),
            })
            .collect()
    }

    /// Debug view: endpoints, split and index sizes.
    pub fn debug_json(&self) -> serde_json::Value {
        let endpoints = self.status();
        let (approx, split) = {
            let pool = self.inner.lock_pool();
            (pool.approx.len(), pool.split.clone())
        };
        let precise = self.inner.precise.read().map(|p| p.len()).unwrap_or(0);
        serde_json::json!({
            "endpoints": endpoints,
            "split": split,
            "approx_index_blocks": approx,
            "precise_index_blocks": precise,
            "queued": self.inner.flow.snapshot(self.now()).requests,
            "saturated": self.saturated(),
        })
    }
}
