//! The router's own Prometheus metrics. Names are defined once, here.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    pub endpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IndexLabel {
    pub index: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabel {
    pub decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabel {
    pub path: String,
}

/// How a request went through the prefill/decode pair (`pd_requests{path}`): phase 1 on a
/// prefill engine, then the decode pick with its `kv_transfer_params`.
pub const PD_PATH_DISAGGREGATED: &str = "disaggregated";
/// Straight to the decode pick (the decider kept it there, or no prefill engine could
/// take it).
pub const PD_PATH_DECODE_ONLY: &str = "decode_only";
/// Phase 1 failed (error, timeout, no `kv_transfer_params` in the answer): the decode pick
/// computed the prompt itself.
pub const PD_PATH_FALLBACK: &str = "fallback";

/// Phase-1 (remote prefill) latency buckets, seconds.
pub const PREFILL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Scheduling-latency buckets, seconds (1 µs .. 100 ms).
pub const SCHEDULE_BUCKETS: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2, 1e-1,
];

/// Every metric the router exports (prefix `strata_router_`).
pub struct RouterMetrics {
    registry: Registry,
    pub picks: Family<EndpointLabel, Counter>,
    pub schedule_seconds: Histogram,
    pub index_blocks: Family<IndexLabel, Gauge>,
    pub prefix_blocks_requested: Family<IndexLabel, Counter>,
    pub prefix_blocks_matched: Family<IndexLabel, Counter>,
    pub prefix_hit_ratio: Family<IndexLabel, Gauge<f64, AtomicU64>>,
    pub shed: Counter,
    pub queued: Counter,
    pub retried: Counter,
    pub failed: Family<ReasonLabel, Counter>,
    pub requests: Counter,
    pub scrape_errors: Family<EndpointLabel, Counter>,
    pub kv_events: Family<EndpointLabel, Counter>,
    pub kv_replays: Family<EndpointLabel, Counter>,
    pub kv_replay_failures: Family<EndpointLabel, Counter>,
    pub ep_waiting: Family<EndpointLabel, Gauge<f64, AtomicU64>>,
    pub ep_running: Family<EndpointLabel, Gauge<f64, AtomicU64>>,
    pub ep_kv_usage: Family<EndpointLabel, Gauge<f64, AtomicU64>>,
    pub ep_ready: Family<EndpointLabel, Gauge>,
    pub ep_in_flight: Family<EndpointLabel, Gauge>,
    /// Decisions of the prefill/decode profile pair.
    pub pd_decisions: Family<DecisionLabel, Counter>,
    /// Requests by the path they took through the pair ([`PD_PATH_DISAGGREGATED`] ...).
    pub pd_requests: Family<PathLabel, Counter>,
    /// Phase 1 (the remote prefill) as the HTTP proxy timed it.
    pub pd_prefill_seconds: Histogram,
    /// Prompt tokens served, from the `usage` of the answers the HTTP front relayed.
    pub prompt_tokens: Family<EndpointLabel, Counter>,
    /// Completion tokens served, likewise.
    pub completion_tokens: Family<EndpointLabel, Counter>,
    /// Flow control's series (`strata_router_flow_*`).
    pub flow: crate::admission::metrics::FlowMetrics,
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RouterMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("strata_router");
        let m = RouterMetrics {
            picks: Family::default(),
            schedule_seconds: Histogram::new(SCHEDULE_BUCKETS.iter().copied()),
            index_blocks: Family::default(),
            prefix_blocks_requested: Family::default(),
            prefix_blocks_matched: Family::default(),
            prefix_hit_ratio: Family::default(),
            shed: Counter::default(),
            queued: Counter::default(),
            retried: Counter::default(),
            failed: Family::default(),
            requests: Counter::default(),
            scrape_errors: Family::default(),
            kv_events: Family::default(),
            kv_replays: Family::default(),
            kv_replay_failures: Family::default(),
            ep_waiting: Family::default(),
            ep_running: Family::default(),
            ep_kv_usage: Family::default(),
            ep_ready: Family::default(),
            ep_in_flight: Family::default(),
            pd_decisions: Family::default(),
            pd_requests: Family::default(),
            pd_prefill_seconds: Histogram::new(PREFILL_BUCKETS.iter().copied()),
            prompt_tokens: Family::default(),
            completion_tokens: Family::default(),
            flow: crate::admission::metrics::FlowMetrics::default(),
            registry: Registry::default(),
        };
        // Registration order is the order of the exposition text.
        m.flow.register(&mut registry);
        m.register_decisions(&mut registry);
        m.register_requests(&mut registry);
        m.register_data_layer(&mut registry);
        m.register_endpoints(&mut registry);
        m.register_pd(&mut registry);
        m.register_usage(&mut registry);
        RouterMetrics { registry, ..m }
    }

    /// Registers the scheduling decisions and the prefix indexes they read.
    fn register_decisions(&self, registry: &mut Registry) {
        registry.register(
            "picks",
            "Requests sent to each endpoint (first pick)",
            self.picks.clone(),
        );
        registry.register(
            "schedule_duration_seconds",
            "Time to make one scheduling decision",
            self.schedule_seconds.clone(),
        );
        registry.register(
            "prefix_index_blocks",
            "Distinct block hashes in a prefix index",
            self.index_blocks.clone(),
        );
        registry.register(
            "prefix_blocks_requested",
            "Prompt blocks looked up in a prefix index",
            self.prefix_blocks_requested.clone(),
        );
        registry.register(
            "prefix_blocks_matched",
            "Prompt blocks the picked endpoint already held",
            self.prefix_blocks_matched.clone(),
        );
        registry.register(
            "prefix_hit_ratio",
            "prefix_blocks_matched / prefix_blocks_requested since start",
            self.prefix_hit_ratio.clone(),
        );
    }

    /// Registers what came of the requests: shed, queued, retried, failed, received.
    fn register_requests(&self, registry: &mut Registry) {
        registry.register(
            "shed",
            "Requests refused with 429 while saturated",
            self.shed.clone(),
        );
        registry.register(
            "queued",
            "Requests that waited for capacity",
            self.queued.clone(),
        );
        registry.register(
            "retried",
            "Attempts retried on another endpoint",
            self.retried.clone(),
        );
        registry.register(
            "failed",
            "Requests that failed, by reason",
            self.failed.clone(),
        );
        registry.register(
            "requests",
            "Requests received on proxied routes",
            self.requests.clone(),
        );
    }

    /// Registers the data layer: scrape failures and KV events.
    fn register_data_layer(&self, registry: &mut Registry) {
        registry.register(
            "scrape_errors",
            "Failed /metrics or /health reads",
            self.scrape_errors.clone(),
        );
        registry.register(
            "kv_events",
            "KV events applied to the precise index",
            self.kv_events.clone(),
        );
        registry.register(
            "kv_replays",
            "KV-event replays asked for (sequence gaps and fresh mirrors)",
            self.kv_replays.clone(),
        );
        registry.register(
            "kv_replay_failures",
            "KV-event gaps a replay could not fill (the endpoint's entries were dropped)",
            self.kv_replay_failures.clone(),
        );
    }

    /// Registers each endpoint's scraped load, readiness and requests in flight.
    fn register_endpoints(&self, registry: &mut Registry) {
        registry.register(
            "endpoint_waiting",
            "Scraped waiting requests",
            self.ep_waiting.clone(),
        );
        registry.register(
            "endpoint_running",
            "Scraped running requests",
            self.ep_running.clone(),
        );
        registry.register(
            "endpoint_kv_usage",
            "Scraped KV-cache use 0..1",
            self.ep_kv_usage.clone(),
        );
        registry.register(
            "endpoint_ready",
            "1 when the endpoint may get traffic",
            self.ep_ready.clone(),
        );
        registry.register(
            "endpoint_in_flight",
            "Requests in flight from this router",
            self.ep_in_flight.clone(),
        );
    }

    /// Registers the prefill/decode pair.
    fn register_pd(&self, registry: &mut Registry) {
        registry.register(
            "pd_decisions",
            "Prefill/decode pair decisions: prefill_decode, decode_only, no_prefill",
            self.pd_decisions.clone(),
        );
        registry.register(
            "pd_requests",
            "Requests by path through the prefill/decode pair: disaggregated, decode_only, fallback",
            self.pd_requests.clone(),
        );
        registry.register(
            "pd_prefill_duration_seconds",
            "Phase 1 of a disaggregated request (the remote prefill), as the proxy saw it",
            self.pd_prefill_seconds.clone(),
        );
    }

    /// Registers tokens served, from the answers' usage.
    fn register_usage(&self, registry: &mut Registry) {
        registry.register(
            "prompt_tokens",
            "Prompt tokens served, from the relayed answers' usage",
            self.prompt_tokens.clone(),
        );
        registry.register(
            "completion_tokens",
            "Completion tokens served, from the relayed answers' usage",
            self.completion_tokens.clone(),
        );
    }

    /// Counts one answer's usage for the endpoint at `url`.
    pub fn usage(&self, url: &str, prompt: u64, completion: u64) {
        let l = Self::endpoint(url);
        self.prompt_tokens.get_or_create(&l).inc_by(prompt);
        self.completion_tokens.get_or_create(&l).inc_by(completion);
    }

    /// Counts one decision of the prefill/decode pair.
    pub fn pd_decision(&self, choice: crate::scheduling::PdChoice) {
        self.pd_decisions
            .get_or_create(&DecisionLabel {
                decision: choice.as_str().into(),
            })
            .inc();
    }

    /// Counts one request's path through the pair.
    pub fn pd_path(&self, path: &str) {
        self.pd_requests
            .get_or_create(&PathLabel { path: path.into() })
            .inc();
    }

    pub fn endpoint(url: &str) -> EndpointLabel {
        EndpointLabel {
            endpoint: url.trim_start_matches("http://").to_string(),
        }
    }

    pub fn index(name: &str) -> IndexLabel {
        IndexLabel { index: name.into() }
    }

    pub fn fail(&self, reason: &str) {
        self.failed
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// Records one lookup's result and refreshes the running hit ratio.
    pub fn prefix_lookup(&self, index: &str, requested: u64, matched: u64) {
        let l = Self::index(index);
        let r = self.prefix_blocks_requested.get_or_create(&l);
        r.inc_by(requested);
        let m = self.prefix_blocks_matched.get_or_create(&l);
        m.inc_by(matched);
        let (r, m) = (r.get(), m.get());
        if r > 0 {
            self.prefix_hit_ratio
                .get_or_create(&l)
                .set(m as f64 / r as f64);
        }
    }

    /// Forgets an endpoint's per-endpoint series (it was removed).
    pub fn remove_endpoint(&self, url: &str) {
        let l = Self::endpoint(url);
        self.ep_waiting.remove(&l);
        self.ep_running.remove(&l);
        self.ep_kv_usage.remove(&l);
        self.ep_ready.remove(&l);
        self.ep_in_flight.remove(&l);
        self.kv_replays.remove(&l);
        self.kv_replay_failures.remove(&l);
    }

    /// Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}
