//! A circuit breaker per endpoint: after `failures` consecutive failures the circuit
//! opens and the endpoint gets no traffic for `open_for`; then one probe request is let
//! through (half-open), whose success closes the circuit and whose failure reopens it.
//! Pure: the caller passes `now`.

use std::time::Duration;

use serde::Serialize;

/// Circuit-breaker settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitConfig {
    pub failures: u32,
    pub open_for: Duration,
}

impl Default for CircuitConfig {
    fn default() -> Self {
        CircuitConfig {
            failures: 5,
            open_for: Duration::from_secs(5),
        }
    }
}

/// The breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum Circuit {
    Closed { failures: u32 },
    Open { until_ms: u64 },
    HalfOpen { probing: bool },
}

impl Default for Circuit {
    fn default() -> Self {
        Circuit::Closed { failures: 0 }
    }
}

impl Circuit {
    /// Whether the scheduler may consider the endpoint at `now` (an open circuit whose
    /// time is up counts: it becomes half-open on the next [`Circuit::try_acquire`]).
    pub fn admits(&self, now: Duration) -> bool {
        match *self {
            Circuit::Closed { .. } => true,
            Circuit::Open { until_ms } => now.as_millis() as u64 >= until_ms,
            Circuit::HalfOpen { probing } => !probing,
        }
    }

    /// Takes permission to send one request at `now`.
    pub fn try_acquire(&mut self, now: Duration) -> bool {
        match *self {
            Circuit::Closed { .. } => true,
            Circuit::Open { until_ms } if now.as_millis() as u64 >= until_ms => {
                *self = Circuit::HalfOpen { probing: true };
                true
            }
            Circuit::Open { .. } => false,
            Circuit::HalfOpen { probing: false } => {
                *self = Circuit::HalfOpen { probing: true };
                true
            }
            Circuit::HalfOpen { probing: true } => false,
        }
    }

    pub fn on_success(&mut self) {
        *self = Circuit::Closed { failures: 0 };
    }

    pub fn on_failure(&mut self, now: Duration, cfg: &CircuitConfig) {
        let open = Circuit::Open {
            until_ms: (now + cfg.open_for).as_millis() as u64,
        };
        *self = match *self {
            Circuit::Closed { failures } if failures + 1 >= cfg.failures => open,
            Circuit::Closed { failures } => Circuit::Closed {
                failures: failures + 1,
            },
            Circuit::HalfOpen { .. } | Circuit::Open { .. } => open,
        };
    }

    pub fn is_open(&self) -> bool {
        matches!(self, Circuit::Open { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_then_probes() {
        let cfg = CircuitConfig {
            failures: 3,
            open_for: Duration::from_secs(1),
        };
        let t = |ms| Duration::from_millis(ms);
        let mut c = Circuit::default();
        c.on_failure(t(0), &cfg);
        c.on_failure(t(0), &cfg);
        c.on_success();
        c.on_failure(t(0), &cfg);
        c.on_failure(t(0), &cfg);
        assert!(c.try_acquire(t(0)), "success reset the count");
        c.on_failure(t(10), &cfg);
        assert!(c.is_open());
        assert!(!c.admits(t(500)) && !c.try_acquire(t(500)));
        assert!(c.admits(t(1010)));
        assert!(c.try_acquire(t(1010)), "one probe");
        assert!(!c.try_acquire(t(1011)), "only one");
        c.on_failure(t(1020), &cfg);
        assert!(!c.try_acquire(t(1500)), "failed probe reopens");
        assert!(c.try_acquire(t(2100)));
        c.on_success();
        assert_eq!(c, Circuit::Closed { failures: 0 });
    }
}
