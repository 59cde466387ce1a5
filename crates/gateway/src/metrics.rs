//! The gateway's Prometheus metrics. Names are defined here once.
//!
//! Two registries: the series that name a tenant (tokens, cost, semantic cache and cache
//! outcomes per tenant) are shown only with the metrics key or on the metrics listener
//! ([`Metrics::render`]); every other series is public ([`Metrics::render_public`]).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

pub struct Metrics {
    registry: Registry,
    /// The series with a `tenant` label.
    tenant_registry: Registry,
    /// `strata_gateway_requests_total{model, status}`
    pub requests: Family<Labels, Counter>,
    /// `strata_gateway_tokens_total{tenant, model, kind=input|output}`
    pub tokens: Family<Labels, Counter>,
    /// `strata_gateway_cost_usd_total{tenant, model}`
    pub cost: Family<Labels, Counter<f64, AtomicU64>>,
    /// `strata_gateway_rejected_total{reason}`: auth, rate_limit, budget, guardrail, invalid
    pub rejected: Family<Labels, Counter>,
    /// `strata_gateway_cache_total{result=hit|semantic|miss}`
    pub cache: Family<Labels, Counter>,
    /// `strata_gateway_upstream_failures_total{upstream, kind}`
    pub upstream_failures: Family<Labels, Counter>,
    /// `strata_gateway_fallbacks_total`: requests answered by other than the first try.
    pub fallbacks: Counter,
    /// `strata_gateway_backend_errors_total{backend}`: failures of a shared backend
    /// (Redis, the store); `backend` is `ratelimit`, `cache`, `semantic_cache` or `store`.
    pub backend_errors: Family<Labels, Counter>,
    /// `strata_gateway_request_duration_seconds`: until response headers.
    pub duration: Histogram,
    /// `strata_gateway_ledger_backpressure_total`: usage rows that waited for room in the
    /// ledger queue (the SQLite writer fell behind).
    pub ledger_backpressure: Counter,
    /// `strata_gateway_ledger_dropped_total`: usage rows given up on after the store
    /// refused them past the retry bound (or at close).
    pub ledger_dropped: Counter,
    /// `strata_gateway_cascade_total{model, reason}`: cascade answers by the model that
    /// answered and why it was that one.
    pub cascade: Family<Labels, Counter>,
    /// `strata_gateway_semantic_cache_total{tenant, result=hit|miss}`: semantic lookups
    /// per tenant (the hit rate is hit / (hit + miss)).
    pub semantic: Family<Labels, Counter>,
    /// `strata_gateway_cache_outcomes_total{tenant, outcome=hit|semantic|miss}`: what each
    /// cacheable request's `x-strata-cache` said, by tenant (the hit rate per tenant is
    /// (hit + semantic) / all).
    pub cache_outcomes: Family<Labels, Counter>,
    /// `strata_gateway_cascade_escalations_total{from, reason}`: answers (or failures) of
    /// an earlier cascade model that sent the request on.
    pub cascade_escalations: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Counts one failure of `backend` in `strata_gateway_backend_errors_total`.
    pub fn backend_error(&self, backend: &'static str) {
        self.backend_errors
            .get_or_create(&vec![("backend", backend.into())])
            .inc();
    }

    pub fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::default(),
            tenant_registry: Registry::default(),
            requests: Family::default(),
            tokens: Family::default(),
            cost: Family::default(),
            rejected: Family::default(),
            cache: Family::default(),
            upstream_failures: Family::default(),
            fallbacks: Counter::default(),
            backend_errors: Family::default(),
            duration: Histogram::new(LATENCY_BUCKETS.iter().copied()),
            ledger_backpressure: Counter::default(),
            ledger_dropped: Counter::default(),
            cascade: Family::default(),
            semantic: Family::default(),
            cache_outcomes: Family::default(),
            cascade_escalations: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            "strata_gateway_requests",
            "Requests by public model and status",
            m.requests.clone(),
        );
        let t = &mut m.tenant_registry;
        t.register(
            "strata_gateway_tokens",
            "Tokens by tenant, model and kind",
            m.tokens.clone(),
        );
        t.register(
            "strata_gateway_cost_usd",
            "Spend in US dollars",
            m.cost.clone(),
        );
        t.register(
            "strata_gateway_semantic_cache",
            "Semantic cache lookups by tenant and result",
            m.semantic.clone(),
        );
        t.register(
            "strata_gateway_cache_outcomes",
            "Cacheable requests by tenant and x-strata-cache outcome",
            m.cache_outcomes.clone(),
        );
        let r = &mut m.registry;
        r.register(
            "strata_gateway_rejected",
            "Requests refused by the gateway",
            m.rejected.clone(),
        );
        r.register(
            "strata_gateway_cache",
            "Response cache lookups",
            m.cache.clone(),
        );
        r.register(
            "strata_gateway_upstream_failures",
            "Failed upstream tries",
            m.upstream_failures.clone(),
        );
        r.register(
            "strata_gateway_fallbacks",
            "Requests served after a failed try",
            m.fallbacks.clone(),
        );
        r.register(
            "strata_gateway_backend_errors",
            "Shared backend (Redis) failures",
            m.backend_errors.clone(),
        );
        r.register(
            "strata_gateway_ledger_backpressure",
            "Usage rows that waited for room in the ledger queue",
            m.ledger_backpressure.clone(),
        );
        r.register(
            "strata_gateway_ledger_dropped",
            "Usage rows given up on after the store refused them",
            m.ledger_dropped.clone(),
        );
        r.register(
            "strata_gateway_cascade",
            "Cascade answers by answering model and reason",
            m.cascade.clone(),
        );
        r.register(
            "strata_gateway_cascade_escalations",
            "Cascade escalations by model left and reason",
            m.cascade_escalations.clone(),
        );
        r.register(
            "strata_gateway_request_duration_seconds",
            "Time until response headers",
            m.duration.clone(),
        );
        m
    }

    pub fn reject(&self, reason: &str) {
        self.rejected
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    /// Every series, tenant series included (the metrics key's view, the metrics
    /// listener's and the `strata up` dashboard's).
    pub fn render(&self) -> String {
        let mut out = self.render_public();
        // One exposition: the public part's end marker goes, the tenant part's stays.
        if let Some(body) = out.strip_suffix("# EOF\n") {
            out.truncate(body.len());
        }
        if encode(&mut out, &self.tenant_registry).is_err() {
            return self.render_public();
        }
        out
    }

    /// The series that name no tenant (what `/metrics` shows without the metrics key).
    pub fn render_public(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
