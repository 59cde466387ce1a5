//! [`Router`]: the live handle around the pure scheduler. It owns the endpoint pool
//! (specs, scraped metrics, readiness, circuit breakers, in-flight counts), the prefix
//! indexes, the traffic split and the background tasks that keep them current, and it
//! answers "where should this request go" ([`Router::pick`]).
//!
//! The gateway embeds it (in-process routing over engine URLs); the controller drives it
//! at run time ([`Router::add_endpoint`], [`Router::remove_endpoint`],
//! [`Router::set_draining`], [`Router::set_split`]); the HTTP front (`proxy`) and the
//! ext_proc picker (`extproc`) serve it.
//!
//! Locking: one mutex over the pool (candidates, runtime state, approximate index, split,
//! RNG) held only for a decision or an update, never across an `.await`; the precise
//! index has its own read-write lock because KV events write it at their own pace.
//!
//! By role:
//! - `pool`: the candidate set and each endpoint's runtime state;
//! - `membership`: endpoints added, removed, drained and split at run time;
//! - `feed`: the data layer's writes (scrapes, readiness, KV-event block sizes);
//! - `prompt`: what a request's prompt hashes to for the prefix indexes;
//! - `pick`: the pick itself, as named stages, and `observe`, what it reports;
//! - `homes`: picks by the replica that holds a stored response;
//! - `lease`: one attempt on an endpoint, counted in flight;
//! - `flow`: flow control's view of the pool;
//! - `status`: the live state for readers and `/debug`;
//! - `errors`: why a request could not be placed, or a pool change failed.

mod errors;
mod feed;
mod flow;
mod homes;
mod lease;
mod membership;
mod observe;
mod pick;
mod pool;
mod prompt;
mod status;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::admission::gate::FlowGate;
use crate::client::{upstream_client, HttpClient};
use crate::config::{RouterConfig, RouterConfigError};
use crate::prefix::approx::ApproxIndex;
use crate::prefix::hashing::BlockHasher;
use crate::prefix::precise::PreciseIndex;
use crate::response_homes::ResponseHomes;
use crate::scheduling::{EndpointPicker, TrafficSplit};
use crate::telemetry::RouterMetrics;
use pool::Pool;

pub use errors::{PoolError, RouteError};
pub use lease::Lease;
pub use pick::Picked;
pub use status::EndpointStatus;

pub(crate) struct Inner {
    pub(crate) config: RouterConfig,
    scheduler: EndpointPicker,
    uses_precise: bool,
    hasher: BlockHasher,
    approx_config: crate::prefix::approx::ApproxConfig,
    epoch: Instant,
    pool: Mutex<Pool>,
    pub(crate) precise: RwLock<PreciseIndex>,
    seq: AtomicU64,
    pub(crate) metrics: RouterMetrics,
    pub(crate) client: HttpClient,
    /// Flow control: the requests waiting for room.
    pub(crate) flow: Arc<FlowGate>,
    tokens: Mutex<HashMap<u64, Arc<Vec<u32>>>>,
    homes: Mutex<ResponseHomes>,
    /// `InferenceObjective` priorities read from the cluster.
    objectives: crate::objectives::ClusterObjectives,
}

/// A cheap, cloneable handle to one router.
#[derive(Clone)]
pub struct Router {
    pub(crate) inner: Arc<Inner>,
}

impl Router {
    /// A router with the endpoints of `config.endpoints`. Background tasks (scrapers, KV
    /// subscribers) start on the current tokio runtime.
    pub fn new(config: RouterConfig) -> Result<Router, RouterConfigError> {
        config.validate()?;
        let picker = config.picker_config();
        let scheduler = picker.build()?;
        let metrics = RouterMetrics::new();
        let flow = FlowGate::new(
            config.flow_config(),
            config.flow_control.pool.clone(),
            metrics.flow.clone(),
        );
        let inner = Arc::new(Inner {
            uses_precise: picker.uses_precise(),
            hasher: BlockHasher::new(&config.precise.hash_seed, config.precise.block_size),
            scheduler,
            approx_config: config.approx_config(),
            epoch: Instant::now(),
            pool: Mutex::new(Pool {
                cands: Vec::new(),
                runtime: Vec::new(),
                free_slots: Vec::new(),
                next_slot: 0,
                approx: ApproxIndex::new(config.approx_config()),
                split: TrafficSplit::default(),
                rng: StdRng::from_os_rng(),
            }),
            precise: RwLock::new(PreciseIndex::new()),
            seq: AtomicU64::new(0),
            metrics,
            client: upstream_client(
                Duration::from_millis(config.connect_timeout_ms),
                &config.upstream_tls,
                config.engine_api_key.as_deref(),
            )?,
            flow,
            tokens: Mutex::new(HashMap::new()),
            homes: Mutex::new(ResponseHomes::default()),
            objectives: crate::objectives::ClusterObjectives::default(),
            config,
        });
        let router = Router { inner };
        for spec in router.inner.config.endpoints.clone() {
            router
                .add_endpoint(spec)
                .map_err(|e| RouterConfigError::Invalid(e.to_string()))?;
        }
        Ok(router)
    }

    pub fn config(&self) -> &RouterConfig {
        &self.inner.config
    }

    /// The priority of the `InferenceObjective` called `name`: the cluster's (for this
    /// router's pool), else router.yaml's `admission.objectives`, else `name` read as an
    /// integer.
    pub fn objective_priority(&self, name: &str) -> Option<i32> {
        self.inner
            .objectives
            .priority(name, &self.inner.config.admission.objectives)
    }

    /// Replaces the objectives the cluster holds for this router's pool.
    pub fn set_cluster_objectives(&self, objectives: std::collections::BTreeMap<String, i32>) {
        self.inner.objectives.replace(objectives);
    }

    pub fn metrics(&self) -> &RouterMetrics {
        &self.inner.metrics
    }

    /// Time since this router started: the `now` its pure policies see.
    pub fn now(&self) -> Duration {
        self.inner.now()
    }

    /// Whether scheduling uses token-level block hashes (a precise-prefix scorer is
    /// configured).
    pub fn uses_precise(&self) -> bool {
        self.inner.uses_precise
    }
}

impl Inner {
    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn lock_pool(&self) -> MutexGuard<'_, Pool> {
        // A panic while holding the lock cannot leave the pool inconsistent in a way that
        // matters more than stopping routing would; keep going.
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_tokens(&self) -> MutexGuard<'_, HashMap<u64, Arc<Vec<u32>>>> {
        self.tokens.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The configured block size for endpoints that have not said their own.
    pub(crate) fn default_block_size(&self) -> u32 {
        u32::try_from(self.config.precise.block_size).unwrap_or(u32::MAX)
    }
}
