//! The control loop: every tick, read the signals, ask the autoscaling policy, tell the
//! driver. A driver error or a failed scrape is logged and counted, never fatal: the loop
//! runs until it is told to stop. With [`Controller::with_fault_backoff`] (as in
//! `strata up`) replacements of crashed replicas wait an exponential backoff.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::watch;

use crate::autoscale::{self, AutoscaleConfig, ScaleDecision, Signals, State};
use crate::driver::{
    local::log_event, Driver, ReplicaEvent, ReplicaInfo, ReplicaPhase, ReplicaRegistrar,
};
use crate::metrics::ControllerMetrics;
use crate::signals::SignalSource;

/// What one tick did.
#[derive(Debug, Clone, Serialize)]
pub struct TickReport {
    pub decision: ScaleDecision,
    pub events: Vec<ReplicaEvent>,
    /// The driver's error, when it failed this tick.
    pub driver_error: Option<String>,
}

/// What `/status` shows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Status {
    pub last: Option<TickReport>,
    pub replicas: Vec<ReplicaInfo>,
    /// The policy's last count.
    pub desired: u32,
    /// Replicas answering `/health` (registered with the router).
    pub ready: u32,
    /// Replacements held back by the crash backoff (see [`Controller::with_fault_backoff`]).
    pub backing_off: u32,
}

/// Crash-replacement backoff: after a replica fault (crashed, never ready) or a driver
/// error, no replacement starts for `initial x 2^(faults-1)`, at most `max`; a replica
/// becoming ready resets it.
#[derive(Debug, Clone, Copy)]
struct Backoff {
    initial: Duration,
    max: Duration,
    faults: u32,
    until: Option<Instant>,
}

impl Backoff {
    fn holding(&self, now: Instant) -> bool {
        self.until.is_some_and(|t| now < t)
    }

    fn fault(&mut self, now: Instant) -> Duration {
        self.faults = self.faults.saturating_add(1);
        let wait = self
            .initial
            .saturating_mul(1u32 << (self.faults - 1).min(16))
            .min(self.max);
        self.until = Some(now + wait);
        wait
    }
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
    backoff: Option<Backoff>,
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
            backoff: None,
        }
    }

    /// Holds back replacements after faults: the first waits `initial`, each further
    /// fault doubles it up to `max`; a replica becoming ready resets it. Scale-in and the
    /// replicas already running are never held. Off unless set.
    pub fn with_fault_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.backoff = Some(Backoff {
            initial,
            max: max.max(initial),
            faults: 0,
            until: None,
        });
        self
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

        // While backing off after a fault, keep what runs and start nothing new.
        let live = replicas
            .iter()
            .filter(|r| r.phase != ReplicaPhase::Draining)
            .count();
        let live = u32::try_from(live).unwrap_or(u32::MAX);
        let target = match &self.backoff {
            Some(b) if b.holding(Instant::now()) => live.min(decision.desired),
            _ => decision.desired,
        };
        let (events, driver_error) = match self.driver.reconcile(target).await {
            Ok(events) => (events, None),
            Err(e) => {
                tracing::warn!(driver = self.driver.name(), error = %e, "driver failed; retrying next tick");
                self.metrics.driver_errors.inc();
                if let Some(b) = &mut self.backoff {
                    let wait = b.fault(Instant::now());
                    tracing::warn!(backoff_s = wait.as_secs_f64(), "holding replacements");
                }
                (Vec::new(), Some(e.to_string()))
            }
        };
        for e in &events {
            log_event(e);
            self.metrics.record_event(e);
            if let Some(b) = &mut self.backoff {
                if e.is_fault() {
                    let wait = b.fault(Instant::now());
                    tracing::warn!(backoff_s = wait.as_secs_f64(), "holding replacements");
                } else if matches!(e, ReplicaEvent::Ready { .. }) {
                    b.faults = 0;
                }
            }
        }
        let replicas = self.driver.replicas();
        self.metrics.record_replicas(&replicas);
        let ready = replicas
            .iter()
            .filter(|r| r.phase == ReplicaPhase::Ready)
            .count();
        let desired = decision.desired;
        let report = TickReport {
            decision,
            events,
            driver_error,
        };
        if let Ok(mut s) = self.status.lock() {
            s.last = Some(report.clone());
            s.replicas = replicas;
            s.desired = desired;
            s.ready = u32::try_from(ready).unwrap_or(u32::MAX);
            s.backing_off = desired.saturating_sub(target);
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

    /// Loses one replica (reported as exited) on the given call.
    struct CrashingDriver {
        replicas: u32,
        calls: u32,
        asked: Vec<u32>,
        crash_on: u32,
    }

    impl Driver for CrashingDriver {
        fn name(&self) -> &'static str {
            "crashing"
        }
        async fn reconcile(&mut self, desired: u32) -> Result<Vec<ReplicaEvent>, DriverError> {
            self.calls += 1;
            self.asked.push(desired);
            let mut events = Vec::new();
            if self.calls == self.crash_on {
                self.replicas -= 1;
                events.push(ReplicaEvent::Exited {
                    id: "r0".into(),
                    status: "signal: 9".into(),
                });
                return Ok(events);
            }
            self.replicas = desired;
            Ok(events)
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
            Vec::new()
        }
    }

    #[tokio::test]
    async fn a_crash_holds_replacements_for_the_backoff() {
        let cfg = AutoscaleConfig {
            min_replicas: 2,
            max_replicas: 2,
            ..AutoscaleConfig::default()
        };
        let per = Arc::new(Mutex::new(Some(0.0)));
        let mut c = Controller::new(
            cfg,
            Duration::from_millis(10),
            CrashingDriver {
                replicas: 0,
                calls: 0,
                asked: Vec::new(),
                crash_on: 2,
            },
            FakeSource { per_replica: per },
            Arc::new(NoRegistrar),
            Arc::new(ControllerMetrics::new()),
        )
        .with_fault_backoff(Duration::from_secs(3600), Duration::from_secs(3600));
        for _ in 0..4 {
            c.tick().await;
        }
        // Call 1 starts two; call 2 loses one; calls 3 and 4 are held at the one left.
        assert_eq!(c.driver().asked, vec![2, 2, 1, 1]);
        let counts = {
            let status = c.status();
            let s = status.lock().unwrap();
            (s.desired, s.ready, s.backing_off)
        };
        assert_eq!(counts, (2, 1, 1));
        // Without the backoff the replacement starts at once.
        let mut c = Controller::new(
            AutoscaleConfig {
                min_replicas: 2,
                max_replicas: 2,
                ..AutoscaleConfig::default()
            },
            Duration::from_millis(10),
            CrashingDriver {
                replicas: 0,
                calls: 0,
                asked: Vec::new(),
                crash_on: 2,
            },
            FakeSource {
                per_replica: Arc::new(Mutex::new(Some(0.0))),
            },
            Arc::new(NoRegistrar),
            Arc::new(ControllerMetrics::new()),
        );
        for _ in 0..3 {
            c.tick().await;
        }
        assert_eq!(c.driver().asked, vec![2, 2, 2]);
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
