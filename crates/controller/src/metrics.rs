//! The controller's own Prometheus metrics: every decision and replica event is counted,
//! and the evidence of the last decision is exported as gauges.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::autoscale::ScaleDecision;
use crate::driver::{ReplicaEvent, ReplicaInfo, ReplicaPhase};
use crate::rollout::{Action, RolloutDecision};

type Labels = Vec<(String, String)>;

/// Every metric the controller exports.
pub struct ControllerMetrics {
    registry: Registry,
    pub desired: Gauge,
    pub demand: Gauge,
    pub panic: Gauge,
    pub stable_concurrency: Gauge<f64, AtomicU64>,
    pub panic_concurrency: Gauge<f64, AtomicU64>,
    pub replicas: Family<Labels, Gauge>,
    pub decisions: Family<Labels, Counter>,
    pub replica_events: Family<Labels, Counter>,
    pub driver_errors: Counter,
    pub metrics_gaps: Counter,
    pub canary_weight: Gauge,
    pub rollout_decisions: Family<Labels, Counter>,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

fn label(k: &str, v: &str) -> Labels {
    vec![(k.to_string(), v.to_string())]
}

impl ControllerMetrics {
    pub fn new() -> ControllerMetrics {
        let mut registry = Registry::default();
        let m = ControllerMetrics {
            registry: Registry::default(),
            desired: Gauge::default(),
            demand: Gauge::default(),
            panic: Gauge::default(),
            stable_concurrency: Gauge::default(),
            panic_concurrency: Gauge::default(),
            replicas: Family::default(),
            decisions: Family::default(),
            replica_events: Family::default(),
            driver_errors: Counter::default(),
            metrics_gaps: Counter::default(),
            canary_weight: Gauge::default(),
            rollout_decisions: Family::default(),
        };
        registry.register(
            "strata_controller_desired_replicas",
            "Replicas the autoscaler asks for",
            m.desired.clone(),
        );
        registry.register(
            "strata_controller_demand_replicas",
            "Replicas the load asks for, before spares, bounds and gating",
            m.demand.clone(),
        );
        registry.register(
            "strata_controller_panic_mode",
            "1 while the autoscaler is in panic mode",
            m.panic.clone(),
        );
        registry.register(
            "strata_controller_stable_concurrency",
            "Requests in flight, averaged over the stable window",
            m.stable_concurrency.clone(),
        );
        registry.register(
            "strata_controller_panic_concurrency",
            "Requests in flight, averaged over the panic window",
            m.panic_concurrency.clone(),
        );
        registry.register(
            "strata_controller_replicas",
            "Replicas by phase",
            m.replicas.clone(),
        );
        registry.register(
            "strata_controller_decisions",
            "Autoscaling decisions by reason",
            m.decisions.clone(),
        );
        registry.register(
            "strata_controller_replica_events",
            "Replica events by kind",
            m.replica_events.clone(),
        );
        registry.register(
            "strata_controller_driver_errors",
            "Driver calls that failed",
            m.driver_errors.clone(),
        );
        registry.register(
            "strata_controller_metrics_gaps",
            "Ticks without a complete metrics sample",
            m.metrics_gaps.clone(),
        );
        registry.register(
            "strata_rollout_canary_weight_percent",
            "The canary's traffic share",
            m.canary_weight.clone(),
        );
        registry.register(
            "strata_rollout_decisions",
            "Rollout decisions by action",
            m.rollout_decisions.clone(),
        );
        ControllerMetrics { registry, ..m }
    }

    pub fn record_decision(&self, d: &ScaleDecision) {
        self.desired.set(i64::from(d.desired));
        self.demand.set(i64::from(d.evidence.demand));
        self.panic.set(i64::from(d.panic));
        self.stable_concurrency.set(d.evidence.stable_concurrency);
        self.panic_concurrency.set(d.evidence.panic_concurrency);
        let reason = serde_json::to_value(d.reason)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default();
        self.decisions
            .get_or_create(&label("reason", &reason))
            .inc();
    }

    pub fn record_event(&self, e: &ReplicaEvent) {
        self.replica_events
            .get_or_create(&label("event", e.kind()))
            .inc();
    }

    pub fn record_replicas(&self, replicas: &[ReplicaInfo]) {
        for (phase, name) in [
            (ReplicaPhase::Starting, "starting"),
            (ReplicaPhase::Ready, "ready"),
            (ReplicaPhase::Draining, "draining"),
        ] {
            let n = replicas.iter().filter(|r| r.phase == phase).count();
            self.replicas
                .get_or_create(&label("phase", name))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    pub fn record_rollout(&self, d: &RolloutDecision) {
        self.canary_weight.set(i64::from(d.weight));
        let action = match d.action {
            Action::Wait => "wait",
            Action::Advance { .. } => "advance",
            Action::Promote => "promote",
            Action::Rollback => "rollback",
        };
        self.rollout_decisions
            .get_or_create(&label("action", action))
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscale::{decide, AutoscaleConfig, Load, Signals, State};
    use std::time::Duration;

    #[test]
    fn decisions_and_events_are_exported() {
        let m = ControllerMetrics::new();
        let (d, _) = decide(
            &AutoscaleConfig::default(),
            &State::new(1),
            &Signals {
                ready: 1,
                load: Some(Load {
                    running: 20.0,
                    ..Load::default()
                }),
                partial: None,
                held_requests: 0,
            },
            Duration::ZERO,
        );
        m.record_decision(&d);
        m.record_event(&ReplicaEvent::NeverReady {
            id: "x".into(),
            waited_secs: 1.0,
        });
        m.driver_errors.inc();
        let text = m.render();
        assert!(
            text.contains("strata_controller_desired_replicas 3"),
            "{text}"
        );
        assert!(
            text.contains("strata_controller_decisions_total{reason=\"scale_out\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("strata_controller_replica_events_total{event=\"never_ready\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("strata_controller_driver_errors_total 1"),
            "{text}"
        );
        // The engines' own parser reads it back.
        let (samples, bad) = strata_api::prometheus::samples(&text);
        assert_eq!(bad, 0);
        assert!(samples
            .iter()
            .any(|s| s.name == "strata_controller_panic_mode"));
    }
}
