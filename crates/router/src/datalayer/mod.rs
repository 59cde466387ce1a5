//! The data layer: what the router knows about each endpoint and how it learns it.
//!
//! - [`metrics`]: pure parsing of `/metrics` per engine kind into `EndpointMetrics`;
//! - [`scrape`]: the per-endpoint task reading `/metrics` and `/health`;
//! - [`kv_events`]: the per-endpoint ZMQ subscriber feeding the precise prefix index.
//!
//! The tasks write into the pool through [`PoolFeed`], which the router implements: the
//! data layer names what it feeds, not the router that holds it.
pub(crate) mod kv_events;
pub mod metrics;
pub(crate) mod scrape;

use std::sync::RwLock;
use std::time::Duration;

use strata_api::model_server::LoadSample;

use crate::client::HttpClient;
use crate::config::RouterConfig;
use crate::endpoint::EndpointId;
use crate::prefix::precise::PreciseIndex;
use crate::scheduling::EndpointMetrics;
use crate::telemetry::RouterMetrics;

/// The pool the data-layer tasks feed. Each task holds only a weak handle to it and ends
/// when the pool is gone or no longer has its endpoint (slot `id` reused for another URL).
pub(crate) trait PoolFeed: Send + Sync + 'static {
    fn config(&self) -> &RouterConfig;
    fn client(&self) -> &HttpClient;
    fn metrics(&self) -> &RouterMetrics;
    /// Time since the pool started: the clock scraped metrics are stamped with.
    fn now(&self) -> Duration;
    /// Whether slot `id` still belongs to `url`.
    fn has(&self, id: EndpointId, url: &str) -> bool;
    /// Stores a scrape result for slot `id` (if it is still `url`).
    fn update_metrics(
        &self,
        id: EndpointId,
        url: &str,
        result: Result<(EndpointMetrics, LoadSample), String>,
    );
    /// Stores a readiness result.
    fn update_health(&self, id: EndpointId, url: &str, ok: bool, error: Option<String>);
    /// Records the block size an endpoint's KV events carry.
    fn note_kv_block_size(&self, id: EndpointId, url: &str, block_size: u32);
    /// The precise prefix index the KV events write.
    fn precise(&self) -> &RwLock<PreciseIndex>;
}
