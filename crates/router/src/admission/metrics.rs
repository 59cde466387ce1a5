//! Flow control's metrics (prefix `strata_router_flow_`): queue sizes per band and flow,
//! held requests per pool, dispatches, refusals and evictions by reason, time in queue.

use std::collections::HashSet;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::scheduling::flow::FlowsSnapshot;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BandLabel {
    pub band: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FlowLabel {
    pub band: String,
    pub flow: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub reason: String,
}

/// Time-in-queue buckets, seconds (1 ms .. 60 s).
pub const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Dispatched on arrival (room, nothing of its band or above waiting).
pub const DISPATCH_IMMEDIATE: &str = "immediate";
/// Dispatched from the queue when room appeared.
pub const DISPATCH_QUEUED: &str = "queued";
/// A waiting request whose client went away.
pub const EVICT_CANCELLED: &str = "cancelled";

#[derive(Clone)]
pub struct FlowMetrics {
    pub band_requests: Family<BandLabel, Gauge>,
    pub band_bytes: Family<BandLabel, Gauge>,
    pub flow_requests: Family<FlowLabel, Gauge>,
    pub flow_bytes: Family<FlowLabel, Gauge>,
    pub held: Family<PoolLabel, Gauge>,
    pub dispatched: Family<OutcomeLabel, Counter>,
    pub refused: Family<OutcomeLabel, Counter>,
    pub evicted: Family<OutcomeLabel, Counter>,
    pub queue_seconds: Histogram,
}

impl Default for FlowMetrics {
    fn default() -> Self {
        FlowMetrics {
            band_requests: Family::default(),
            band_bytes: Family::default(),
            flow_requests: Family::default(),
            flow_bytes: Family::default(),
            held: Family::default(),
            dispatched: Family::default(),
            refused: Family::default(),
            evicted: Family::default(),
            queue_seconds: Histogram::new(QUEUE_BUCKETS.iter().copied()),
        }
    }
}

impl FlowMetrics {
    /// Registers every series under `registry` (already prefixed `strata_router`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("flow");
        r.register(
            "band_requests",
            "Requests waiting in each priority band",
            self.band_requests.clone(),
        );
        r.register(
            "band_bytes",
            "Body bytes waiting in each priority band",
            self.band_bytes.clone(),
        );
        r.register(
            "queued_requests",
            "Requests waiting per band and flow (fairness id)",
            self.flow_requests.clone(),
        );
        r.register(
            "queued_bytes",
            "Body bytes waiting per band and flow",
            self.flow_bytes.clone(),
        );
        r.register(
            "held_requests",
            "Requests held because the pool has no ready endpoint (activation signal)",
            self.held.clone(),
        );
        r.register(
            "dispatched",
            "Requests let through flow control: immediate or queued",
            self.dispatched.clone(),
        );
        r.register(
            "refused",
            "Requests refused on arrival (429): shed or capacity",
            self.refused.clone(),
        );
        r.register(
            "evicted",
            "Waiting requests that left unsent: ttl, held_ttl (503) or cancelled",
            self.evicted.clone(),
        );
        r.register(
            "queue_duration_seconds",
            "Time a dispatched request waited in flow control",
            self.queue_seconds.clone(),
        );
    }

    pub fn count(family: &Family<OutcomeLabel, Counter>, reason: &str) {
        family
            .get_or_create(&OutcomeLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// Sets the queue gauges from `snap`. Series of bands and flows that emptied since
    /// the last call (named in `shown`) are dropped: priorities and flow ids come from
    /// clients, so only those waiting now have series.
    pub fn show(&self, snap: &FlowsSnapshot, pool: &str, shown: &mut Shown) {
        let mut now = Shown::default();
        for b in &snap.bands {
            let band = b.priority.to_string();
            let bl = BandLabel { band: band.clone() };
            self.band_requests.get_or_create(&bl).set(b.requests as i64);
            self.band_bytes.get_or_create(&bl).set(b.bytes as i64);
            for f in &b.flows {
                let fl = FlowLabel {
                    band: band.clone(),
                    flow: f.flow.clone(),
                };
                self.flow_requests.get_or_create(&fl).set(f.requests as i64);
                self.flow_bytes.get_or_create(&fl).set(f.bytes as i64);
                now.flows.insert(fl);
            }
            now.bands.insert(bl);
        }
        for bl in shown.bands.difference(&now.bands) {
            self.band_requests.remove(bl);
            self.band_bytes.remove(bl);
        }
        for fl in shown.flows.difference(&now.flows) {
            self.flow_requests.remove(fl);
            self.flow_bytes.remove(fl);
        }
        *shown = now;
        self.held
            .get_or_create(&PoolLabel { pool: pool.into() })
            .set(snap.held as i64);
    }
}

/// The band and flow series the gauges show now.
#[derive(Debug, Default)]
pub struct Shown {
    bands: HashSet<BandLabel>,
    flows: HashSet<FlowLabel>,
}
