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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;
use tokio::task::JoinHandle;

use crate::admission::gate::{FlowGate, Ticket};
use crate::circuit::Circuit;
use crate::client::{upstream_client, HttpClient};
use crate::config::{RouterConfig, RouterConfigError};
use crate::datalayer::{kv_events, scrape, PoolFeed};
use crate::endpoint::{EndpointId, EndpointSpec};
use crate::prefix::approx::ApproxIndex;
use crate::prefix::hashing::BlockHasher;
use crate::prefix::precise::PreciseIndex;
use crate::response_homes::ResponseHomes;
use crate::scheduling::flow::{Eviction, PoolView, Refusal};
use crate::scheduling::saturation::{pool_room, pool_saturated};
use crate::scheduling::{
    Candidate, Context, EndpointMetrics, EndpointPicker, PdChoice, PickDecision, PreciseBlocks,
    SchedRequest, ScheduleError, TrafficSplit,
};
use crate::telemetry::RouterMetrics;
use strata_api::model_server::LoadSample;
use strata_api::ApiError;

/// Why a request could not be placed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error("the pool is saturated and the request is sheddable")]
    Shed,
    #[error("too many requests are waiting for capacity")]
    QueueFull,
    /// Flow control refused it on arrival.
    #[error("flow control refused the request: {}", .0.as_str())]
    Refused(Refusal),
    /// Flow control evicted it from its queue.
    #[error("the request waited past its time to live ({})", .0.as_str())]
    Evicted(Eviction),
}

impl RouteError {
    /// The OpenAI error both transports answer a routing failure with.
    pub fn to_api_error(&self) -> ApiError {
        match self {
            RouteError::Shed => ApiError::rate_limited(
                "The service is saturated; this request is sheddable. Retry later.",
            ),
            RouteError::QueueFull | RouteError::Refused(Refusal::Capacity) => {
                ApiError::rate_limited("Too many requests are waiting for capacity. Retry later.")
            }
            RouteError::Refused(Refusal::Shed) => ApiError::rate_limited(
                "The service is saturated; this request is sheddable. Retry later.",
            ),
            RouteError::Evicted(Eviction::Ttl) => {
                ApiError::unavailable("The request waited for capacity past its time to live.")
            }
            RouteError::Evicted(Eviction::HeldTtl) => {
                ApiError::unavailable("No replica became ready within the request's time to live.")
            }
            RouteError::Schedule(ScheduleError::UnknownModel(m)) => ApiError::model_not_found(m),
            RouteError::Schedule(ScheduleError::UnknownProfile(p)) => ApiError::invalid(
                crate::headers::PROFILE,
                format!("Unknown scheduling profile `{p}`."),
            ),
            RouteError::Schedule(ScheduleError::NoReadyEndpoint) => {
                ApiError::unavailable("No replica is ready.")
            }
            RouteError::Schedule(ScheduleError::Filtered(_)) => {
                ApiError::unavailable("No replica can take this request.")
            }
        }
    }
}

/// Errors from run-time pool changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("endpoint `{0}` is already registered")]
    Exists(String),
    #[error("no endpoint `{0}`")]
    Unknown(String),
}

/// Per-endpoint state that the scheduler does not read directly.
#[derive(Debug)]
struct Runtime {
    circuit: Circuit,
    health_ok: bool,
    last_error: Option<String>,
    tasks: Vec<JoinHandle<()>>,
    /// The whole of the last readable `/metrics` page (counters and histograms too), for
    /// readers besides the scheduler: inside `strata up` this router's scrape is the only
    /// one, and the controller and dashboard read it here.
    last_load: Option<Arc<LoadSample>>,
    /// Said once in the log that this endpoint's load is unknown.
    warned_unknown_load: bool,
    /// Said once that its KV events' block size disagrees with its metrics or the config.
    warned_block_size: bool,
}

struct Pool {
    cands: Vec<Candidate>,
    runtime: Vec<Runtime>,
    free_slots: Vec<u32>,
    next_slot: u32,
    approx: ApproxIndex,
    split: TrafficSplit,
    rng: StdRng,
}

impl Pool {
    fn index_of(&self, url: &str) -> Option<usize> {
        self.cands.iter().position(|c| c.spec.url == url)
    }
    fn index_of_id(&self, id: EndpointId, url: &str) -> Option<usize> {
        self.cands
            .iter()
            .position(|c| c.id == id && c.spec.url == url)
    }
}

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

/// One endpoint chosen for a request: try `ranked` in order.
#[derive(Debug, Clone)]
pub struct Picked {
    pub decision: PickDecision,
    /// `(slot, base URL)` best first.
    pub ranked: Vec<(EndpointId, Arc<str>)>,
    /// When the request is disaggregated: the prefill engines, best first (never the
    /// decode pick). The proxy runs phase 1 there, then sends the request to `ranked`.
    pub prefill: Option<Vec<(EndpointId, Arc<str>)>>,
    /// What the prefill/decode pair decided ([`PdChoice::Single`] without one).
    pub pd: PdChoice,
}

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

    /// Admission of a request known only by its priority (the embedding gateway's):
    /// flow control with the shared flow and the default time to live
    /// ([`Router::admit_flow`]).
    pub async fn admit(&self, priority: i32) -> Result<(), RouteError> {
        self.admit_flow(&Ticket::priority_only(priority))
            .await
            .map(drop)
    }

    /// Whether scheduling uses token-level block hashes (a precise-prefix scorer is
    /// configured).
    pub fn uses_precise(&self) -> bool {
        self.inner.uses_precise
    }

    /// The LoRA adapter a request for `model` asks for: `model` itself when some
    /// endpoint advertises an adapter of that name (spec `lora` label, or its metrics'
    /// running/waiting adapters) and does not serve it as its base model. Such a
    /// request's blocks are hashed with the adapter name as the extra key (PROTOCOLS §3),
    /// as the engine hashes them.
    pub fn lora_adapter(&self, model: &str) -> Option<String> {
        names_adapter(&self.inner.lock_pool().cands, model).then(|| model.to_string())
    }

    /// Bytes of prompt text the approximate index hashes at most: a request's text past
    /// this never changes its keys.
    pub fn prefix_window(&self) -> usize {
        let c = &self.inner.approx_config;
        c.block_size_tokens.max(1) * 4 * c.max_blocks
    }

    /// The approximate-index chunk hashes of a prompt.
    pub fn approx_blocks(&self, model: &str, text: &str) -> Vec<u64> {
        let c = &self.inner.approx_config;
        crate::prefix::approx::hash_text(model, text, c.block_size_tokens.max(1) * 4, c.max_blocks)
    }

    /// The precise-index block hashes of token ids: one chain per block size the registered
    /// endpoints hash with (each endpoint's own, from its KV events or metrics; the
    /// configured `precise.block_size` for those that have said nothing yet).
    pub fn precise_blocks(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> PreciseBlocks {
        let default = self.inner.default_block_size();
        let mut sizes: Vec<u32> = vec![default];
        for c in &self.inner.lock_pool().cands {
            let b = c.block_size(default);
            if !sizes.contains(&b) {
                sizes.push(b);
            }
        }
        let chains = sizes
            .into_iter()
            .map(|b| {
                let hashes = if b == default {
                    self.inner.hasher.hash_tokens(tokens, lora, salt)
                } else {
                    BlockHasher::new(&self.inner.config.precise.hash_seed, b as usize)
                        .hash_tokens(tokens, lora, salt)
                };
                (b, hashes)
            })
            .collect();
        PreciseBlocks {
            default_block_size: default,
            chains,
        }
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

    /// One scheduling decision. Counts the pick, records the request's prefix on the
    /// chosen endpoint in the approximate index, and returns the ranked endpoints.
    pub fn pick(&self, req: &mut SchedRequest) -> Result<Picked, RouteError> {
        self.pick_within(req, None)
    }

    /// [`Router::pick`] among only the endpoints whose base URL `allowed` accepts (the
    /// ext_proc transport's subset hint and selection header); the others count as not
    /// ready for this one decision.
    pub fn pick_within(
        &self,
        req: &mut SchedRequest,
        allowed: Option<&dyn Fn(&str) -> bool>,
    ) -> Result<Picked, RouteError> {
        req.seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let now = self.now();
        let started = Instant::now();
        let mut pool = self.inner.lock_pool();
        refresh_ready(&mut pool, now);
        if let Some(allowed) = allowed {
            // `refresh_ready` recomputes readiness before every other read, so this
            // lasts for this decision only.
            for c in pool.cands.iter_mut() {
                c.ready = c.ready && allowed(&c.spec.url);
            }
        }
        let precise = self.inner.precise.read().unwrap_or_else(|e| e.into_inner());
        if req.lora.is_none() && names_adapter(&pool.cands, &req.model) {
            req.lora = Some(req.model.clone());
        }
        let Pool {
            cands,
            split,
            rng,
            approx,
            ..
        } = &mut *pool;
        let ctx = Context {
            now,
            stale_after: self.inner.config.stale_after(),
            approx: Some(&*approx),
            precise: Some(&precise),
        };
        let split = (!split.is_empty()).then_some(&*split);
        let decision = self
            .inner
            .scheduler
            .schedule_pd(&ctx, req, cands, split, rng);
        let (decision, prefill_decision, pd) = match decision {
            Ok(d) => (d.decode, d.prefill, d.choice),
            Err(e) => {
                self.inner.metrics.fail(match e {
                    ScheduleError::NoReadyEndpoint => "no_ready_endpoint",
                    ScheduleError::UnknownModel(_) => "unknown_model",
                    _ => "filtered",
                });
                return Err(e.into());
            }
        };
        let first = decision.pick();
        if let Some(c) = cands.iter_mut().find(|c| c.id == first) {
            // Until its next scrape shows it, the request counts against the room.
            c.sent_since_scrape = c.sent_since_scrape.saturating_add(1);
        }
        // Hit-ratio bookkeeping for whichever index the request used.
        let (index, requested, matched) = match &req.precise_blocks {
            Some(b) if self.inner.uses_precise => {
                let chain = cands
                    .iter()
                    .find(|c| c.id == first)
                    .map_or(&[][..], |c| b.for_candidate(c));
                (
                    "precise",
                    chain.len(),
                    precise
                        .match_prefix(chain, &[first])
                        .first()
                        .map_or(0, |m| m.blocks as usize),
                )
            }
            _ => (
                "approx",
                req.approx_blocks.len(),
                pool.approx
                    .match_prefix(&req.approx_blocks, &[first])
                    .first()
                    .map_or(0, |m| m.blocks as usize),
            ),
        };
        drop(precise);
        pool.approx.record(first, &req.approx_blocks);
        let urls = |pool: &Pool, d: &PickDecision| -> Vec<(EndpointId, Arc<str>)> {
            d.ranked
                .iter()
                .filter_map(|s| {
                    pool.cands
                        .iter()
                        .find(|c| c.id == s.id)
                        .map(|c| (c.id, Arc::<str>::from(c.spec.url.as_str())))
                })
                .collect()
        };
        let ranked = urls(&pool, &decision);
        let prefill = prefill_decision.map(|p| {
            // The prefill engine computes (and then caches) the same blocks.
            pool.approx.record(p.pick(), &req.approx_blocks);
            urls(&pool, &p)
        });
        let approx_len = pool.approx.len();
        drop(pool);
        let m = &self.inner.metrics;
        m.schedule_seconds.observe(started.elapsed().as_secs_f64());
        m.prefix_lookup(index, requested as u64, matched as u64);
        m.index_blocks
            .get_or_create(&RouterMetrics::index("approx"))
            .set(approx_len as i64);
        if let Some((_, url)) = ranked.first() {
            m.picks.get_or_create(&RouterMetrics::endpoint(url)).inc();
        }
        if pd != PdChoice::Single {
            m.pd_decision(pd);
        }
        Ok(Picked {
            decision,
            ranked,
            prefill,
            pd,
        })
    }

    /// Remembers that the endpoint at `url` holds the stored response `id`.
    pub fn remember_response(&self, id: &str, url: &str) {
        self.inner
            .homes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), Arc::from(url));
    }

    /// The pick for a request that needs the stored response `id`: the endpoint that
    /// made it, alone, when it is still registered and ready (draining or not: only it
    /// can answer). `None` when the router does not know the response or its endpoint is
    /// gone: the request is then scheduled as any other (and that replica answers).
    pub fn pick_home(&self, id: &str) -> Option<Picked> {
        let url = self
            .inner
            .homes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()?;
        let now = self.now();
        let mut pool = self.inner.lock_pool();
        refresh_ready(&mut pool, now);
        let c = pool
            .cands
            .iter_mut()
            .find(|c| *c.spec.url == *url && c.ready)?;
        c.sent_since_scrape = c.sent_since_scrape.saturating_add(1);
        let id = c.id;
        drop(pool);
        self.inner
            .metrics
            .picks
            .get_or_create(&RouterMetrics::endpoint(&url))
            .inc();
        Some(Picked {
            decision: PickDecision {
                profile: "response-home".into(),
                ranked: vec![crate::scheduling::Scored { id, score: 1.0 }],
            },
            ranked: vec![(id, url)],
            prefill: None,
            pd: PdChoice::Single,
        })
    }

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

    /// Token ids of a prompt from the engine's `/tokenize` (cached by `key`), or `None`
    /// when no endpoint answers in time.
    pub async fn tokenize(&self, key: u64, body: bytes::Bytes) -> Option<Arc<Vec<u32>>> {
        if let Some(t) = self.inner.lock_tokens().get(&key) {
            return Some(t.clone());
        }
        let url = {
            let now = self.now();
            let mut pool = self.inner.lock_pool();
            refresh_ready(&mut pool, now);
            pool.cands
                .iter()
                .find(|c| c.ready)
                .map(|c| c.spec.url.clone())?
        };
        let timeout = Duration::from_millis(self.inner.config.precise.tokenize_timeout_ms);
        let (status, bytes) = crate::client::fetch(
            &self.inner.client,
            hyper::Method::POST,
            &format!("{url}/tokenize"),
            Some(body),
            timeout,
            64 << 20,
        )
        .await
        .ok()?;
        if !status.is_success() {
            return None;
        }
        let resp: strata_api::TokenizeResponse = serde_json::from_slice(&bytes).ok()?;
        let tokens = Arc::new(resp.tokens);
        let mut cache = self.inner.lock_tokens();
        if cache.len() >= self.inner.config.precise.tokenize_cache {
            cache.clear();
        }
        cache.insert(key, tokens.clone());
        Some(tokens)
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

/// Whether `model` names a LoRA adapter some endpoint advertises (rather than a base
/// model it serves).
fn names_adapter(cands: &[Candidate], model: &str) -> bool {
    !model.is_empty()
        && cands.iter().any(|c| {
            c.spec.model.as_deref() != Some(model)
                && (c.spec.lora.iter().any(|a| a == model)
                    || c.metrics.as_ref().is_some_and(|x| {
                        x.lora_running
                            .iter()
                            .chain(&x.lora_waiting)
                            .any(|a| a == model)
                    }))
        })
}

fn refresh_ready(pool: &mut Pool, now: Duration) {
    let Pool { cands, runtime, .. } = pool;
    for (c, rt) in cands.iter_mut().zip(runtime.iter()) {
        c.ready = rt.health_ok && rt.circuit.admits(now);
    }
}

impl Inner {
    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// The pool as flow control sees it at `now`: whether an endpoint is ready, and the
    /// room ([`pool_room`]).
    pub(crate) fn pool_view(&self, now: Duration) -> PoolView {
        let mut pool = self.lock_pool();
        refresh_ready(&mut pool, now);
        PoolView {
            ready: pool.cands.iter().any(|c| c.ready && !c.draining),
            room: pool_room(&pool.cands, now, &self.config.saturation_config()),
        }
    }

    /// Re-runs flow control (evictions, then dispatches while there is room): on every
    /// scrape, readiness change and finished request, and at a waiter's deadline.
    pub(crate) fn pump_flows(&self) {
        if !self.flow.has_queued() {
            return;
        }
        let now = self.now();
        let view = self.pool_view(now);
        self.flow.pump(now, &view);
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
