//! The control loop: every tick, read the signals, ask the autoscaling policy, tell the
//! driver. A driver error or a failed scrape is logged and counted, never fatal: the loop
//! runs until it is told to stop.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::watch;

use crate::autoscale::{self, AutoscaleConfig, Decision, Signals, State};
use crate::driver::{
    local::log_event, Driver, ReplicaEvent, ReplicaInfo, ReplicaPhase, ReplicaRegistrar,
};
use crate::metrics::ControllerMetrics;
use crate::signals::SignalSource;

/// What one tick did.
#[derive(Debug, Clone, Serialize)]
pub struct TickReport {
    pub decision: Decision,
    pub events: Vec<ReplicaEvent>,
    /// The driver's error, when it failed this tick.
    pub driver_error: Option<String>,
}

/// What `/status` shows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Status {
    pub last: Option<TickReport>,
    pub replicas: Vec<ReplicaInfo>,
}

/// The autoscaling control loop over one driver and one signal source.
pub struct Controller<D: Driver, S: SignalSource> {
    cfg: AutoscaleConfig,
    interval: Duration,
    driver: D,
    source: S,
    registrar: Arc<dyn ReplicaRegistrar>,
    state: State,
    origin: Instant,
    /// Added to the policy's clock (tests move time forward with it).
    skew: Duration,
    metrics: Arc<ControllerMetrics>,
    status: Arc<Mutex<Status>>,
}

impl<D: Driver, S: SignalSource> Controller<D, S> {
    /// A controller that starts from `cfg.minReplicas` replicas.
    pub fn new(
        cfg: AutoscaleConfig,
        interval: Duration,
        driver: D,
        source: S,
        registrar: Arc<dyn ReplicaRegistrar>,
        metrics: Arc<ControllerMetrics>,
    ) -> Self {
        let state = State::new(cfg.min_replicas);
        Controller {
            cfg,
            interval,
            driver,
            source,
            registrar,
            state,
            origin: Instant::now(),
            skew: Duration::ZERO,
            metrics,
            status: Arc::new(Mutex::new(Status::default())),
        }
    }

    /// The status shared with the HTTP endpoint.
    pub fn status(&self) -> Arc<Mutex<Status>> {
        self.status.clone()
    }

    /// The driver (for tests and shutdown).
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// One round: signals → decision → driver.
    pub async fn tick(&mut self) -> TickReport {
        let replicas = self.driver.replicas();
        let ready: Vec<ReplicaInfo> = replicas
            .iter()
            .filter(|r| r.phase == ReplicaPhase::Ready)
            .cloned()
            .collect();
        let load = self.source.collect(&ready).await;
        if load.is_none() {
            self.metrics.metrics_gaps.inc();
        }
        let signals = Signals {
            ready: u32::try_from(ready.len()).unwrap_or(u32::MAX),
            load,
            partial: if load.is_none() {
                self.source.partial()
            } else {
                None
            },
            held_requests: self.registrar.held_requests(),
        };
        let now = self.origin.elapsed() + self.skew;
        let previous_reason = self
            .status
            .lock()
            .ok()
            .and_then(|s| s.last.as_ref().map(|l| l.decision.reason));
        let (decision, state) = autoscale::decide(&self.cfg, &self.state, &signals, now);
        self.state = state;
        if decision.desired != decision.previous || previous_reason != Some(decision.reason) {
            tracing::info!(
                desired = decision.desired,
                previous = decision.previous,
                reason = ?decision.reason,
                signal = ?decision.signal,
                evidence = %serde_json::to_string(&decision.evidence).unwrap_or_default(),
                "{decision}"
            );
        } else {
            tracing::debug!("{decision}");
        }
        self.metrics.record_decision(&decision);

        let (events, driver_error) = match self.driver.reconcile(decision.desired).await {
            Ok(events) => (events, None),
            Err(e) => {
                tracing::warn!(driver = self.driver.name(), error = %e, "driver failed; retrying next tick");
                self.metrics.driver_errors.inc();
                (Vec::new(), Some(e.to_string()))
            }
        };
        for e in &events {
            log_event(e);
            self.metrics.record_event(e);
        }
        let replicas = self.driver.replicas();
        self.metrics.record_replicas(&replicas);
        let report = TickReport {
            decision,
            events,
            driver_error,
        };
        if let Ok(mut s) = self.status.lock() {
            s.last = Some(report.clone());
            s.replicas = replicas;
        }
        report
    }

    /// Ticks every interval until `shutdown` turns true, then drains and stops every
    /// replica.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> D {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    self.tick().await;
                }
                changed = shutdown.changed() => {
                    if changed.is_err() || *shutdown.borrow() {
                        break;
                    }
                }
            }
        }
        tracing::info!("controller stopping: draining replicas");
        for e in self.driver.shutdown().await {
            log_event(&e);
            self.metrics.record_event(&e);
        }
        self.driver
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscale::{Load, Reason};
    use crate::driver::{DriverError, NoRegistrar};

    /// A driver whose replicas are ready the moment they are asked for, and that fails
    /// whenever `fail` says so.
    struct FakeDriver {
        replicas: u32,
        calls: u32,
        fail: fn(u32) -> bool,
    }

    impl Driver for FakeDriver {
        fn name(&self) -> &'static str {
            "fake"
        }
        async fn reconcile(&mut self, desired: u32) -> Result<Vec<ReplicaEvent>, DriverError> {
            self.calls += 1;
            if (self.fail)(self.calls) {
                return Err(DriverError::Other("the API server said no".into()));
            }
            self.replicas = desired;
            Ok(Vec::new())
        }
        fn replicas(&self) -> Vec<ReplicaInfo> {
            (0..self.replicas)
                .map(|i| ReplicaInfo {
                    id: format!("r{i}"),
                    url: format!("http://127.0.0.1:{}", 1000 + i),
                    phase: ReplicaPhase::Ready,
                })
                .collect()
        }
        async fn shutdown(&mut self) -> Vec<ReplicaEvent> {
            self.replicas = 0;
            Vec::new()
        }
    }

    /// Reports `load` per ready replica while `up`, nothing otherwise.
    struct FakeSource {
        per_replica: Arc<Mutex<Option<f64>>>,
    }

    impl SignalSource for FakeSource {
        async fn collect(&mut self, ready: &[ReplicaInfo]) -> Option<Load> {
            let per = (*self.per_replica.lock().unwrap())?;
            Some(Load {
                running: per * ready.len() as f64,
                ..Load::default()
            })
        }
    }

    #[allow(clippy::type_complexity)]
    fn controller(
        fail: fn(u32) -> bool,
    ) -> (
        Controller<FakeDriver, FakeSource>,
        Arc<Mutex<Option<f64>>>,
        Arc<ControllerMetrics>,
    ) {
        let per = Arc::new(Mutex::new(Some(0.0)));
        let metrics = Arc::new(ControllerMetrics::new());
        let cfg = AutoscaleConfig {
            min_replicas: 1,
            max_replicas: 4,
            ..AutoscaleConfig::default()
        };
        let c = Controller::new(
            cfg,
            Duration::from_millis(10),
            FakeDriver {
                replicas: 0,
                calls: 0,
                fail,
            },
            FakeSource {
                per_replica: per.clone(),
            },
            Arc::new(NoRegistrar),
            metrics.clone(),
        );
        (c, per, metrics)
    }

    #[tokio::test]
    async fn driver_errors_do_not_stop_the_loop() {
        // Every other call fails.
        let (mut c, per, metrics) = controller(|n| n % 2 == 0);
        *per.lock().unwrap() = Some(30.0);
        let mut errors = 0;
        for _ in 0..10 {
            let r = c.tick().await;
            errors += usize::from(r.driver_error.is_some());
        }
        assert_eq!(errors, 5);
        assert_eq!(c.driver().replicas, 4, "scaled out despite the failures");
        assert!(metrics
            .render()
            .contains("strata_controller_driver_errors_total 5"));
        let status = c.status();
        let s = status.lock().unwrap();
        assert!(s.last.is_some());
        assert_eq!(s.replicas.len(), 4);
    }

    #[tokio::test]
    async fn metrics_that_stop_arriving_freeze_scale_in() {
        let (mut c, per, metrics) = controller(|_| false);
        *per.lock().unwrap() = Some(30.0);
        for _ in 0..3 {
            c.tick().await;
        }
        assert_eq!(c.driver().replicas, 4);
        // Metrics stop. Push the policy's clock past the stable window and the max age.
        *per.lock().unwrap() = None;
        c.skew = Duration::from_secs(600);
        for _ in 0..5 {
            let r = c.tick().await;
            assert_eq!(r.decision.desired, 4);
            assert_eq!(r.decision.reason, Reason::HoldMetricsStale);
        }
        assert_eq!(c.driver().replicas, 4);
        assert!(metrics
            .render()
            .contains("strata_controller_metrics_gaps_total 5"));
    }

    #[tokio::test]
    async fn run_stops_on_shutdown_and_stops_replicas() {
        let (c, per, _) = controller(|_| false);
        *per.lock().unwrap() = Some(1.0);
        let (tx, rx) = watch::channel(false);
        let h = tokio::spawn(c.run(rx));
        tokio::time::sleep(Duration::from_millis(50)).await;
        tx.send(true).unwrap();
        let d = tokio::time::timeout(Duration::from_secs(5), h)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(d.replicas, 0);
        assert!(d.calls >= 1);
    }
}
