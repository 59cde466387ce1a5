//! The autoscaling policy: a pure function from (config, previous state, observed signals,
//! `now`) to a desired replica count and the reason for it.
//!
//! No clock, randomness or I/O lives here: the control loop feeds it real time, the
//! simulator feeds it virtual time, and both get the same decisions.
//!
//! The shape follows the Knative pod autoscaler: load is averaged over a *stable* window
//! (60 s) and a short *panic* window (6 s); when the panic window asks for at least
//! `panicThreshold` times the ready replicas, the policy panics: it scales out on the short
//! window and never scales in until the load has stayed calm for a whole stable window.
//! On top of that:
//!
//! - **Pressure floors.** Queue depth per replica, KV-cache use and TTFT p90 above their
//!   targets each set a lower bound on the replica count; the most pressing signal wins
//!   and is named in the decision.
//! - **Cold-start lead.** A replica that takes `coldStartSecs` to load is asked for that
//!   much earlier: the recent load trend is projected `coldStartSecs` ahead.
//! - **Scale out fast, in slowly.** Scale-out is immediate; scale-in waits for
//!   `scaleInCooldownSecs` after the last change and removes at most `maxScaleInStep`
//!   replicas per decision.
//! - **Never scale in blind.** With no fresh metrics (older than `metricsMaxAgeSecs`) the
//!   count is held: it may still grow for activation or `minReplicas`, never shrink.
//! - **Warm spares** are kept ready beyond demand.
//! - **Scale to zero** (when `minReplicas` is 0) after `scaleToZeroAfterSecs` without load;
//!   the first request held by the router activates one replica at once.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Tolerance when rounding replica demand up, so that 16 / 8 = 2.0000000001 is 2.
const CEIL_EPSILON: f64 = 1e-9;

/// Autoscaling settings (`autoscale:` in `controller.yaml`). Every field has a default that
/// serves one machine; see `docs/CONTROLLER.md`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct AutoscaleConfig {
    /// Which rule turns load into a replica count: `strata` (this module's policy, the
    /// default) or `threshold` (a plain HPA-style utilization rule, for comparison).
    pub policy: PolicyKind,
    /// Settings of the `threshold` policy.
    pub threshold: ThresholdConfig,
    /// Fewest replicas; 0 enables scale to zero.
    pub min_replicas: u32,
    /// Most replicas.
    pub max_replicas: u32,
    /// Replicas kept ready beyond demand (not while scaled to zero).
    pub warm_spares: u32,
    /// Requests in flight (running + waiting) one replica should carry.
    pub target_concurrency: f64,
    /// Waiting requests per ready replica above which the queue forces a scale-out.
    pub target_queue_depth: f64,
    /// Mean KV-cache use (0..1) above which the KV cache forces a scale-out.
    pub target_kv_usage: f64,
    /// TTFT p90 target in seconds; above it the latency forces a scale-out (off when absent).
    pub target_ttft_p90_secs: Option<f64>,
    /// Tokens held in KV caches that one replica should carry (off when absent).
    pub target_inflight_tokens: Option<f64>,
    /// Long averaging window (seconds).
    pub stable_window_secs: f64,
    /// Short averaging window (seconds).
    pub panic_window_secs: f64,
    /// Panic when the panic window asks for this many times the ready replicas.
    pub panic_threshold: f64,
    /// Seconds after the last change before any scale-in.
    pub scale_in_cooldown_secs: f64,
    /// Replicas removed per decision at most.
    pub max_scale_in_step: u32,
    /// Seconds without load before scaling to zero (only with `minReplicas: 0`).
    pub scale_to_zero_after_secs: f64,
    /// Seconds a new replica takes to become ready; the load trend is projected this far.
    pub cold_start_secs: f64,
    /// Metrics older than this (seconds) count as missing: scale-in freezes.
    pub metrics_max_age_secs: f64,
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        AutoscaleConfig {
            policy: PolicyKind::Strata,
            threshold: ThresholdConfig::default(),
            min_replicas: 1,
            max_replicas: 3,
            warm_spares: 0,
            target_concurrency: 8.0,
            target_queue_depth: 4.0,
            target_kv_usage: 0.8,
            target_ttft_p90_secs: None,
            target_inflight_tokens: None,
            stable_window_secs: 60.0,
            panic_window_secs: 6.0,
            panic_threshold: 2.0,
            scale_in_cooldown_secs: 30.0,
            max_scale_in_step: 1,
            scale_to_zero_after_secs: 300.0,
            cold_start_secs: 0.0,
            metrics_max_age_secs: 10.0,
        }
    }
}

/// Which rule decides the replica count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Concurrency, queue, KV and TTFT signals on stable and panic windows ([`decide`]).
    #[default]
    Strata,
    /// The Kubernetes HPA's CPU rule applied to batch slots: `desired = ceil(ready ×
    /// busy / utilization)`, where busy is the running requests over the ready replicas'
    /// slots, evaluated every `periodSecs`, with HPA's tolerance and scale-down
    /// stabilization. It sees neither the queue nor the KV cache nor latency; it is here to
    /// be compared against.
    Threshold,
}

/// The `threshold` policy's settings (`autoscale.threshold:`), HPA defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct ThresholdConfig {
    /// Busy fraction aimed at (HPA `averageUtilization`), 0..1.
    pub utilization: f64,
    /// Requests one replica runs at once (the engine's `--max-num-seqs`): busy = running /
    /// (ready × slots).
    pub slots: f64,
    /// Seconds between evaluations (HPA: 15).
    pub period_secs: f64,
    /// A ratio within this of 1 changes nothing (HPA: 0.1).
    pub tolerance: f64,
    /// Scale-in goes only to the highest recommendation of this many seconds (HPA: 300).
    pub scale_in_stabilization_secs: f64,
}

impl Default for ThresholdConfig {
    fn default() -> Self {
        ThresholdConfig {
            utilization: 0.7,
            slots: 8.0,
            period_secs: 15.0,
            tolerance: 0.1,
            scale_in_stabilization_secs: 300.0,
        }
    }
}

/// A setting that cannot work, named by its YAML key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("autoscale.{key}: {message}")]
pub struct ConfigError {
    pub key: &'static str,
    pub message: String,
}

fn bad(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key,
        message: message.into(),
    }
}

impl AutoscaleConfig {
    /// Checks that every value is usable; the first problem is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_replicas == 0 {
            return Err(bad("maxReplicas", "must be at least 1"));
        }
        if self.min_replicas > self.max_replicas {
            return Err(bad(
                "minReplicas",
                format!(
                    "{} is above maxReplicas {}",
                    self.min_replicas, self.max_replicas
                ),
            ));
        }
        let positive: [(&'static str, f64); 5] = [
            ("targetConcurrency", self.target_concurrency),
            ("targetQueueDepth", self.target_queue_depth),
            ("stableWindowSecs", self.stable_window_secs),
            ("panicWindowSecs", self.panic_window_secs),
            ("metricsMaxAgeSecs", self.metrics_max_age_secs),
        ];
        for (key, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(key, format!("must be a positive number, got {v}")));
            }
        }
        let non_negative: [(&'static str, f64); 3] = [
            ("scaleInCooldownSecs", self.scale_in_cooldown_secs),
            ("scaleToZeroAfterSecs", self.scale_to_zero_after_secs),
            ("coldStartSecs", self.cold_start_secs),
        ];
        for (key, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(key, format!("must be zero or more, got {v}")));
            }
        }
        if !(self.target_kv_usage > 0.0 && self.target_kv_usage <= 1.0) {
            return Err(bad("targetKvUsage", "must be in (0, 1]"));
        }
        if let Some(t) = self.target_ttft_p90_secs {
            if !(t.is_finite() && t > 0.0) {
                return Err(bad("targetTtftP90Secs", "must be a positive number"));
            }
        }
        if let Some(t) = self.target_inflight_tokens {
            if !(t.is_finite() && t > 0.0) {
                return Err(bad("targetInflightTokens", "must be a positive number"));
            }
        }
        if self.panic_window_secs > self.stable_window_secs {
            return Err(bad("panicWindowSecs", "must not exceed stableWindowSecs"));
        }
        if !(self.panic_threshold.is_finite() && self.panic_threshold > 1.0) {
            return Err(bad("panicThreshold", "must be above 1"));
        }
        if self.max_scale_in_step == 0 {
            return Err(bad("maxScaleInStep", "must be at least 1"));
        }
        let t = &self.threshold;
        if !(t.utilization > 0.0 && t.utilization <= 1.0) {
            return Err(bad("threshold.utilization", "must be in (0, 1]"));
        }
        let threshold_positive: [(&'static str, f64); 2] = [
            ("threshold.slots", t.slots),
            ("threshold.periodSecs", t.period_secs),
        ];
        for (key, v) in threshold_positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(key, format!("must be a positive number, got {v}")));
            }
        }
        if !(t.tolerance.is_finite() && (0.0..1.0).contains(&t.tolerance)) {
            return Err(bad("threshold.tolerance", "must be in [0, 1)"));
        }
        if !(t.scale_in_stabilization_secs.is_finite() && t.scale_in_stabilization_secs >= 0.0) {
            return Err(bad(
                "threshold.scaleInStabilizationSecs",
                "must be zero or more",
            ));
        }
        Ok(())
    }

    fn secs(v: f64) -> Duration {
        Duration::from_secs_f64(v.max(0.0))
    }
}

/// Load observed across the ready replicas at one moment (one scrape).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Load {
    /// Requests queued, summed over replicas.
    pub waiting: f64,
    /// Requests in the running batches, summed over replicas.
    pub running: f64,
    /// Mean KV-cache use, 0..1, when reported.
    pub kv_usage: Option<f64>,
    /// TTFT p90 in seconds over the last scrape interval, when any request finished prefill.
    pub ttft_p90_secs: Option<f64>,
    /// Tokens held in KV caches, summed over replicas, when known.
    pub inflight_tokens: Option<f64>,
}

impl Load {
    /// The sample with impossible values removed: `None` when the counts are not finite,
    /// non-negative numbers; optional fields that are not drop to `None`.
    pub fn sanitized(self) -> Option<Load> {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !ok(self.waiting) || !ok(self.running) {
            return None;
        }
        Some(Load {
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv_usage.filter(|&x| ok(x)),
            ttft_p90_secs: self.ttft_p90_secs.filter(|&x| ok(x)),
            inflight_tokens: self.inflight_tokens.filter(|&x| ok(x)),
        })
    }

    /// Requests in flight: running plus waiting.
    pub fn concurrency(&self) -> f64 {
        self.waiting + self.running
    }
}

/// What the policy sees at one tick.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Signals {
    /// Replicas ready and serving.
    pub ready: u32,
    /// A fresh sample of load, or `None` when metrics did not arrive this tick.
    pub load: Option<Load>,
    /// With `load` missing because only some replicas answered: the load of those that
    /// did, a lower bound. It may raise the count (never lower it) once metrics are stale.
    pub partial: Option<Load>,
    /// Requests the router is holding because no replica is ready (activation).
    pub held_requests: u32,
}

/// One recorded sample.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    at: Duration,
    load: Load,
}

/// What the policy remembers between ticks. Start with [`State::new`].
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// The last desired count decided.
    pub desired: u32,
    /// Samples within the stable window, oldest first.
    samples: VecDeque<Sample>,
    last_sample_at: Option<Duration>,
    last_change_at: Option<Duration>,
    /// While panicking: the last moment the panic condition held.
    panic_since: Option<Duration>,
    last_active_at: Option<Duration>,
    /// `threshold` policy: when it last evaluated, and its recommendations since
    /// (scale-down stabilization), oldest first.
    threshold_evaluated_at: Option<Duration>,
    threshold_recs: VecDeque<(Duration, u32)>,
}

impl State {
    /// The state before the first decision, with `current` replicas already asked for.
    pub fn new(current: u32) -> State {
        State {
            desired: current,
            samples: VecDeque::new(),
            last_sample_at: None,
            last_change_at: None,
            panic_since: None,
            last_active_at: None,
            threshold_evaluated_at: None,
            threshold_recs: VecDeque::new(),
        }
    }

    /// Whether the policy is in panic mode.
    pub fn panicking(&self) -> bool {
        self.panic_since.is_some()
    }
}

/// Which signal set the demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    /// No load signal asked for more than the floor.
    None,
    Concurrency,
    QueueDepth,
    KvUsage,
    TtftP90,
    InflightTokens,
    /// The load trend projected over the cold-start time.
    Trend,
    /// Requests held by the router while at zero replicas.
    HeldRequests,
    /// The `threshold` policy's busy fraction.
    Utilization,
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Signal::None => "none",
            Signal::Concurrency => "concurrency",
            Signal::QueueDepth => "queue depth",
            Signal::KvUsage => "KV-cache use",
            Signal::TtftP90 => "TTFT p90",
            Signal::InflightTokens => "in-flight tokens",
            Signal::Trend => "load trend over the cold start",
            Signal::HeldRequests => "held requests",
            Signal::Utilization => "busy fraction",
        })
    }
}

/// The kind of decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Demand matches the current count.
    Steady,
    ScaleOut,
    ScaleIn,
    /// From zero to one because the router holds requests.
    Activation,
    /// No load for `scaleToZeroAfterSecs`.
    ScaleToZero,
    /// Demand is lower but panic mode forbids scale-in.
    HoldPanic,
    /// Demand is lower but the last change is too recent.
    HoldCooldown,
    /// Metrics are missing or stale: the count is held (never scale in blind).
    HoldMetricsStale,
}

/// The numbers a decision was made from.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Evidence {
    pub ready: u32,
    pub stable_concurrency: f64,
    pub panic_concurrency: f64,
    pub waiting_per_replica: f64,
    pub kv_usage: Option<f64>,
    pub ttft_p90_secs: Option<f64>,
    pub inflight_tokens: Option<f64>,
    /// Concurrency projected `coldStartSecs` ahead, when the trend rises.
    pub projected_concurrency: Option<f64>,
    /// Replicas the load asks for before spares, bounds and gating.
    pub demand: u32,
    /// Seconds since the last sample, when there is one.
    pub metrics_age_secs: Option<f64>,
    pub held_requests: u32,
}

/// The policy's answer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScaleDecision {
    /// Replicas to run.
    pub desired: u32,
    /// The count before this decision.
    pub previous: u32,
    pub reason: Reason,
    /// The signal that set the demand.
    pub signal: Signal,
    pub panic: bool,
    pub evidence: Evidence,
}

impl fmt::Display for ScaleDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = &self.evidence;
        let what = match self.reason {
            Reason::Steady => "steady",
            Reason::ScaleOut => "scale out",
            Reason::ScaleIn => "scale in",
            Reason::Activation => "activation",
            Reason::ScaleToZero => "scale to zero",
            Reason::HoldPanic => "hold (panic mode)",
            Reason::HoldCooldown => "hold (scale-in cooldown)",
            Reason::HoldMetricsStale => "hold (metrics missing)",
        };
        write!(
            f,
            "{what}: {} -> {} replicas; demand {} by {}; concurrency stable {:.2} panic {:.2}; \
             waiting/replica {:.2}; ready {}",
            self.previous,
            self.desired,
            e.demand,
            self.signal,
            e.stable_concurrency,
            e.panic_concurrency,
            e.waiting_per_replica,
            e.ready
        )?;
        if let Some(kv) = e.kv_usage {
            write!(f, "; kv {kv:.2}")?;
        }
        if let Some(t) = e.ttft_p90_secs {
            write!(f, "; ttft p90 {t:.3}s")?;
        }
        if let Some(p) = e.projected_concurrency {
            write!(f, "; projected {p:.2}")?;
        }
        if self.panic {
            f.write_str("; panic")?;
        }
        Ok(())
    }
}

fn ceil_replicas(x: f64) -> u32 {
    if !x.is_finite() || x <= 0.0 {
        return 0;
    }
    let c = (x - CEIL_EPSILON).ceil();
    if c >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        c.max(0.0) as u32
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Least-squares slope (units per second) of concurrency over the samples.
fn slope(samples: &[&Sample]) -> Option<f64> {
    if samples.len() < 3 {
        return None;
    }
    let t0 = samples[0].at.as_secs_f64();
    let n = samples.len() as f64;
    let mt = samples.iter().map(|s| s.at.as_secs_f64() - t0).sum::<f64>() / n;
    let my = samples.iter().map(|s| s.load.concurrency()).sum::<f64>() / n;
    let mut num = 0.0;
    let mut den = 0.0;
    for s in samples {
        let dt = s.at.as_secs_f64() - t0 - mt;
        num += dt * (s.load.concurrency() - my);
        den += dt * dt;
    }
    (den > 0.0).then(|| num / den)
}

/// Decides how many replicas to run.
///
/// `now` is any monotonic time (the same origin on every call); the returned state is
/// passed back on the next call.
///
/// The rules below apply in this order. The first two settle the count on their own:
/// activation, then never scaling in blind. Otherwise the count is built up: proportional
/// demand on both windows, the pressure floors, panic mode and the window it makes lead,
/// the cold-start lead, then spares, bounds and scale to zero, and last the pace of
/// scale-in. Where two signals ask for as many replicas, the one applied first names it.
pub fn decide(
    cfg: &AutoscaleConfig,
    prev: &State,
    signals: &Signals,
    now: Duration,
) -> (ScaleDecision, State) {
    if cfg.policy == PolicyKind::Threshold {
        return decide_threshold(cfg, prev, signals, now);
    }
    let mut st = prev.clone();
    let current = prev.desired;
    let ready = signals.ready;
    record(&mut st, cfg, signals, now);
    let metrics_age = st.last_sample_at.map(|t| now.saturating_sub(t));
    let avg = Averages::of(&st.samples, cfg, now);
    let mut evidence = avg.evidence(signals, metrics_age);

    if let Some(verdict) = activation(cfg, current, signals) {
        let d = conclude(&mut st, current, verdict, evidence, now);
        return (d, st);
    }
    if metrics_age.is_none_or(|a| a > AutoscaleConfig::secs(cfg.metrics_max_age_secs)) {
        let partial = signals.partial.and_then(Load::sanitized);
        if let Some(p) = partial {
            evidence.panic_concurrency = p.concurrency();
        }
        let verdict = never_scale_in_blind(cfg, current, partial);
        let d = conclude(&mut st, current, verdict, evidence, now);
        return (d, st);
    }

    let stable = proportional_demand(cfg, avg.stable_concurrency, avg.stable_tokens);
    let short = proportional_demand(cfg, avg.panic_concurrency, avg.panic_tokens);
    let floor = [
        queue_floor(cfg, avg.waiting, ready),
        kv_floor(cfg, avg.kv_usage, ready),
        ttft_floor(cfg, avg.ttft_p90_secs, ready),
    ]
    .into_iter()
    .flatten()
    .fold(Demand::NONE, Demand::or_more);
    st.panic_since = panic_mode(
        cfg,
        st.panic_since,
        short.replicas.max(floor.replicas),
        ready,
        now,
    );
    let panicking = st.panic_since.is_some();
    let mut demand = leading_window(panicking, current, stable, short).or_more(floor);
    if let Some((projected, ahead)) = cold_start_lead(cfg, &st.samples, avg.panic_concurrency, now)
    {
        evidence.projected_concurrency = Some(projected);
        demand = demand.or_more(ahead);
    }
    let idle_for = st
        .last_active_at
        .map(|t| now.saturating_sub(t))
        .unwrap_or_default();
    let target = spares_bounds_and_zero(cfg, demand.replicas, signals, idle_for, panicking);
    let (desired, reason) =
        scale_in_slowly(cfg, prev.last_change_at, current, target, panicking, now);
    let verdict = Verdict {
        desired,
        reason,
        signal: demand.signal,
        demand: demand.replicas,
    };
    let d = conclude(&mut st, current, verdict, evidence, now);
    (d, st)
}

/// A replica count and the signal that asked for it.
#[derive(Debug, Clone, Copy)]
struct Demand {
    replicas: u32,
    signal: Signal,
}

impl Demand {
    /// Nothing asked for: any signal asking for a replica replaces it.
    const NONE: Demand = Demand {
        replicas: 0,
        signal: Signal::None,
    };

    /// `other` when it asks for strictly more; on a tie the signal already named keeps it,
    /// so the order the rules apply in is their precedence.
    #[inline]
    fn or_more(self, other: Demand) -> Demand {
        if other.replicas > self.replicas {
            other
        } else {
            self
        }
    }
}

/// What a decision settled: the count, why, the signal behind it and the demand it read.
#[derive(Debug, Clone, Copy)]
struct Verdict {
    desired: u32,
    reason: Reason,
    signal: Signal,
    demand: u32,
}

/// The load averaged over the stable and panic windows, as the rules read it.
#[derive(Debug, Clone, Copy)]
struct Averages {
    stable_concurrency: f64,
    panic_concurrency: f64,
    /// Requests queued, summed over replicas, on the panic window.
    waiting: f64,
    kv_usage: Option<f64>,
    ttft_p90_secs: Option<f64>,
    /// In-flight tokens on the panic window.
    panic_tokens: Option<f64>,
    stable_tokens: Option<f64>,
}

impl Averages {
    /// Averages the recorded samples. Concurrency and in-flight tokens are read on both
    /// windows; the pressure signals (queue, KV cache, TTFT) only on the panic window, since
    /// they are there to react fast. With nothing in the panic window its concurrency is
    /// the stable one's.
    fn of(samples: &VecDeque<Sample>, cfg: &AutoscaleConfig, now: Duration) -> Averages {
        let panic_window = AutoscaleConfig::secs(cfg.panic_window_secs);
        let in_panic_window: Vec<&Sample> = samples
            .iter()
            .filter(|s| now.saturating_sub(s.at) <= panic_window)
            .collect();
        let stable_concurrency = mean(samples.iter().map(|s| s.load.concurrency())).unwrap_or(0.0);
        Averages {
            stable_concurrency,
            panic_concurrency: mean(in_panic_window.iter().map(|s| s.load.concurrency()))
                .unwrap_or(stable_concurrency),
            waiting: mean(in_panic_window.iter().map(|s| s.load.waiting)).unwrap_or(0.0),
            kv_usage: mean(in_panic_window.iter().filter_map(|s| s.load.kv_usage)),
            ttft_p90_secs: mean(in_panic_window.iter().filter_map(|s| s.load.ttft_p90_secs)),
            panic_tokens: mean(
                in_panic_window
                    .iter()
                    .filter_map(|s| s.load.inflight_tokens),
            ),
            stable_tokens: mean(samples.iter().filter_map(|s| s.load.inflight_tokens)),
        }
    }

    /// The evidence these averages give, before any rule has set the demand.
    fn evidence(&self, signals: &Signals, metrics_age: Option<Duration>) -> Evidence {
        Evidence {
            ready: signals.ready,
            stable_concurrency: self.stable_concurrency,
            panic_concurrency: self.panic_concurrency,
            waiting_per_replica: self.waiting / f64::from(signals.ready.max(1)),
            kv_usage: self.kv_usage,
            ttft_p90_secs: self.ttft_p90_secs,
            inflight_tokens: self.panic_tokens,
            projected_concurrency: None,
            demand: 0,
            metrics_age_secs: metrics_age.map(|a| a.as_secs_f64()),
            held_requests: signals.held_requests,
        }
    }
}

impl AutoscaleConfig {
    /// `replicas` within `minReplicas..=maxReplicas`.
    #[inline]
    fn bounded(&self, replicas: u32) -> u32 {
        replicas.clamp(self.min_replicas, self.max_replicas)
    }
}

/// Records what arrived this tick and forgets the samples that left the stable window.
/// Load or held requests count as activity (the scale-to-zero clock); so does the first
/// decision, so that idle time counts from it.
fn record(st: &mut State, cfg: &AutoscaleConfig, signals: &Signals, now: Duration) {
    if let Some(load) = signals.load.and_then(Load::sanitized) {
        st.samples.push_back(Sample { at: now, load });
        st.last_sample_at = Some(now);
        if load.concurrency() > 0.0 {
            st.last_active_at = Some(now);
        }
    }
    if signals.held_requests > 0 || st.last_active_at.is_none() {
        st.last_active_at = Some(now);
    }
    let stable_window = AutoscaleConfig::secs(cfg.stable_window_secs);
    while st
        .samples
        .front()
        .is_some_and(|s| now.saturating_sub(s.at) > stable_window)
    {
        st.samples.pop_front();
    }
}

/// Stores the settled count in the state (a change also restarts the scale-in cooldown)
/// and explains it.
fn conclude(
    st: &mut State,
    current: u32,
    verdict: Verdict,
    mut evidence: Evidence,
    now: Duration,
) -> ScaleDecision {
    if verdict.desired != current {
        st.last_change_at = Some(now);
    }
    st.desired = verdict.desired;
    evidence.demand = verdict.demand;
    ScaleDecision {
        desired: verdict.desired,
        previous: current,
        reason: verdict.reason,
        signal: verdict.signal,
        panic: st.panic_since.is_some(),
        evidence,
    }
}

/// **Activation.** Requests are held at the router with no replica ready and none asked
/// for: one replica (and the warm spares) at once, whatever the metrics say, since every
/// moment here is a held request's wait.
fn activation(cfg: &AutoscaleConfig, current: u32, signals: &Signals) -> Option<Verdict> {
    (signals.held_requests > 0 && signals.ready == 0 && current == 0).then(|| Verdict {
        desired: cfg.bounded(cfg.warm_spares.saturating_add(1)).max(1),
        reason: Reason::Activation,
        signal: Signal::HeldRequests,
        demand: 1,
    })
}

/// **Never scale in blind.** With metrics missing or stale the count is held: a gap must
/// not read as idleness. Only the bounds, or the replicas that did answer (`partial`, a
/// lower bound on the load), may raise it.
fn never_scale_in_blind(cfg: &AutoscaleConfig, current: u32, partial: Option<Load>) -> Verdict {
    let mut verdict = Verdict {
        desired: cfg.bounded(current),
        reason: Reason::HoldMetricsStale,
        signal: Signal::None,
        demand: current,
    };
    if let Some(p) = partial {
        let lower = ceil_replicas(p.concurrency() / cfg.target_concurrency);
        verdict.demand = lower;
        let want = cfg.bounded(lower.saturating_add(cfg.warm_spares));
        if want > verdict.desired {
            verdict.desired = want;
            verdict.signal = Signal::Concurrency;
        }
    }
    if verdict.desired > current {
        verdict.reason = Reason::ScaleOut;
    }
    verdict
}

/// **Proportional demand** on one window: the concurrency over `targetConcurrency`, or the
/// in-flight tokens over `targetInflightTokens` when that is set and asks for more (long
/// prompts fill the KV cache before they fill the batch).
#[inline]
fn proportional_demand(cfg: &AutoscaleConfig, concurrency: f64, tokens: Option<f64>) -> Demand {
    let by_concurrency = Demand {
        replicas: ceil_replicas(concurrency / cfg.target_concurrency),
        signal: Signal::Concurrency,
    };
    match cfg.target_inflight_tokens {
        Some(target) => by_concurrency.or_more(Demand {
            replicas: ceil_replicas(tokens.unwrap_or(0.0) / target),
            signal: Signal::InflightTokens,
        }),
        None => by_concurrency,
    }
}

/// **Queue-depth floor.** More than `targetQueueDepth` waiting per ready replica: the
/// queue beyond the target spreads over new replicas at the target concurrency (at least
/// one more), since a queue is load the running batches cannot take.
#[inline]
fn queue_floor(cfg: &AutoscaleConfig, waiting: f64, ready: u32) -> Option<Demand> {
    let ready_f = f64::from(ready.max(1));
    (waiting / ready_f > cfg.target_queue_depth).then(|| {
        let excess = waiting - cfg.target_queue_depth * ready_f;
        Demand {
            replicas: ready.saturating_add(ceil_replicas(excess / cfg.target_concurrency).max(1)),
            signal: Signal::QueueDepth,
        }
    })
}

/// **KV-cache floor.** Mean KV-cache use above `targetKvUsage`: the ready replicas grown
/// in proportion (at least one more), since a full cache preempts and recomputes.
#[inline]
fn kv_floor(cfg: &AutoscaleConfig, kv_usage: Option<f64>, ready: u32) -> Option<Demand> {
    let kv = kv_usage.filter(|&kv| kv > cfg.target_kv_usage)?;
    Some(Demand {
        replicas: ceil_replicas(f64::from(ready.max(1)) * kv / cfg.target_kv_usage)
            .max(ready.saturating_add(1)),
        signal: Signal::KvUsage,
    })
}

/// **TTFT floor.** TTFT p90 above `targetTtftP90Secs`: the ready replicas grown by the
/// overshoot (at least one more), the ratio capped at `panicThreshold` since latency is
/// not linear in replicas.
#[inline]
fn ttft_floor(cfg: &AutoscaleConfig, ttft_p90_secs: Option<f64>, ready: u32) -> Option<Demand> {
    let target = cfg.target_ttft_p90_secs?;
    let t = ttft_p90_secs.filter(|&t| t > target)?;
    let ratio = (t / target).min(cfg.panic_threshold);
    Some(Demand {
        replicas: ceil_replicas(f64::from(ready.max(1)) * ratio).max(ready.saturating_add(1)),
        signal: Signal::TtftP90,
    })
}

/// **Panic mode**, as the Knative autoscaler's: entered (or renewed) when the short
/// window's demand, floors included, is at least `panicThreshold` times the ready
/// replicas; left once that has not held for a whole stable window, so that a burst is
/// not answered by scaling in as soon as it pauses. Returns when it last held.
#[inline]
fn panic_mode(
    cfg: &AutoscaleConfig,
    since: Option<Duration>,
    short_demand: u32,
    ready: u32,
    now: Duration,
) -> Option<Duration> {
    let stable_window = AutoscaleConfig::secs(cfg.stable_window_secs);
    if f64::from(short_demand) >= cfg.panic_threshold * f64::from(ready.max(1))
        && short_demand > ready
    {
        Some(now)
    } else if since.is_some_and(|t| now.saturating_sub(t) >= stable_window) {
        None
    } else {
        since
    }
}

/// **The leading window.** In panic the short window leads. Otherwise the stable window
/// leads, but the count never drops below what the short window still needs: scale in
/// only when both windows agree.
#[inline]
fn leading_window(panicking: bool, current: u32, stable: Demand, short: Demand) -> Demand {
    if panicking {
        short
    } else if stable.replicas < current && short.replicas > stable.replicas {
        Demand {
            replicas: short.replicas.min(current),
            signal: short.signal,
        }
    } else {
        stable
    }
}

/// **Cold-start lead.** A replica that takes `coldStartSecs` to load is asked for that
/// much earlier: a rising trend of recent concurrency is projected over the cold start.
/// Returns the projected concurrency and the replicas it asks for.
fn cold_start_lead(
    cfg: &AutoscaleConfig,
    samples: &VecDeque<Sample>,
    panic_concurrency: f64,
    now: Duration,
) -> Option<(f64, Demand)> {
    let cold_start = Some(cfg.cold_start_secs).filter(|&s| s > 0.0)?;
    let horizon = AutoscaleConfig::secs(cold_start.max(cfg.panic_window_secs));
    let recent: Vec<&Sample> = samples
        .iter()
        .filter(|s| now.saturating_sub(s.at) <= horizon)
        .collect();
    let k = slope(&recent).filter(|&k| k > 0.0)?;
    let projected = panic_concurrency + k * cold_start;
    let ahead = Demand {
        replicas: ceil_replicas(projected / cfg.target_concurrency),
        signal: Signal::Trend,
    };
    Some((projected, ahead))
}

/// **Spares, bounds and scale to zero.** With `minReplicas: 0`, no demand, nothing held
/// and no load for `scaleToZeroAfterSecs` (and not in panic) the count is zero; otherwise
/// at least one, plus the warm spares, within the bounds.
#[inline]
fn spares_bounds_and_zero(
    cfg: &AutoscaleConfig,
    demand: u32,
    signals: &Signals,
    idle_for: Duration,
    panicking: bool,
) -> u32 {
    let quiet = demand == 0
        && signals.held_requests == 0
        && idle_for >= AutoscaleConfig::secs(cfg.scale_to_zero_after_secs);
    let desired = if cfg.min_replicas == 0 && quiet && !panicking {
        0
    } else {
        cfg.bounded(demand.max(1).saturating_add(cfg.warm_spares))
    };
    desired.min(cfg.max_replicas).max(cfg.min_replicas)
}

/// **Scale out fast, in slowly.** More is granted at once. Less is held while panicking
/// or within `scaleInCooldownSecs` of the last change, and otherwise removes at most
/// `maxScaleInStep` replicas, since a replica removed too early costs a cold start.
#[inline]
fn scale_in_slowly(
    cfg: &AutoscaleConfig,
    last_change_at: Option<Duration>,
    current: u32,
    target: u32,
    panicking: bool,
    now: Duration,
) -> (u32, Reason) {
    let cooldown = AutoscaleConfig::secs(cfg.scale_in_cooldown_secs);
    if target > current {
        (target, Reason::ScaleOut)
    } else if target == current {
        (target, Reason::Steady)
    } else if panicking {
        (current, Reason::HoldPanic)
    } else if last_change_at.is_some_and(|t| now.saturating_sub(t) < cooldown) {
        (current, Reason::HoldCooldown)
    } else {
        let desired = target.max(current.saturating_sub(cfg.max_scale_in_step));
        let reason = if desired == 0 {
            Reason::ScaleToZero
        } else {
            Reason::ScaleIn
        };
        (desired, reason)
    }
}

/// The `threshold` policy (see [`PolicyKind::Threshold`]).
fn decide_threshold(
    cfg: &AutoscaleConfig,
    prev: &State,
    signals: &Signals,
    now: Duration,
) -> (ScaleDecision, State) {
    let t = &cfg.threshold;
    let mut st = prev.clone();
    let current = prev.desired;
    let ready = signals.ready;
    let load = signals.load.and_then(Load::sanitized);
    if let Some(l) = load {
        st.last_sample_at = Some(now);
        if l.concurrency() > 0.0 {
            st.last_active_at = Some(now);
        }
    }
    let capacity = f64::from(ready.max(1)) * t.slots;
    let busy = load.map(|l| (l.running / capacity).min(1.0));
    let mut evidence = Evidence {
        ready,
        stable_concurrency: load.map_or(0.0, |l| l.concurrency()),
        panic_concurrency: load.map_or(0.0, |l| l.concurrency()),
        waiting_per_replica: load.map_or(0.0, |l| l.waiting / f64::from(ready.max(1))),
        kv_usage: load.and_then(|l| l.kv_usage),
        ttft_p90_secs: load.and_then(|l| l.ttft_p90_secs),
        inflight_tokens: load.and_then(|l| l.inflight_tokens),
        projected_concurrency: None,
        demand: current,
        metrics_age_secs: st
            .last_sample_at
            .map(|a| now.saturating_sub(a).as_secs_f64()),
        held_requests: signals.held_requests,
    };
    let clamp = |d: u32| d.clamp(cfg.min_replicas.max(1), cfg.max_replicas);
    let due = st
        .threshold_evaluated_at
        .is_none_or(|at| now.saturating_sub(at) >= AutoscaleConfig::secs(t.period_secs));
    let (desired, reason, signal) = match busy {
        // Like the HPA without metrics: nothing changes.
        None => (clamp(current), Reason::HoldMetricsStale, Signal::None),
        Some(_) if !due => (clamp(current), Reason::Steady, Signal::Utilization),
        Some(busy) => {
            st.threshold_evaluated_at = Some(now);
            let ratio = busy / t.utilization;
            let base = ready.max(1);
            let rec = if (ratio - 1.0).abs() <= t.tolerance {
                base
            } else {
                clamp(ceil_replicas(f64::from(base) * ratio).max(1))
            };
            evidence.demand = rec;
            let window = AutoscaleConfig::secs(t.scale_in_stabilization_secs);
            st.threshold_recs.push_back((now, rec));
            while st
                .threshold_recs
                .front()
                .is_some_and(|(at, _)| now.saturating_sub(*at) > window)
            {
                st.threshold_recs.pop_front();
            }
            if rec >= current {
                let reason = if rec > current {
                    Reason::ScaleOut
                } else {
                    Reason::Steady
                };
                (clamp(rec), reason, Signal::Utilization)
            } else {
                let highest = st.threshold_recs.iter().map(|r| r.1).max().unwrap_or(rec);
                let d = clamp(highest.min(current));
                let reason = if d < current {
                    Reason::ScaleIn
                } else {
                    Reason::HoldCooldown
                };
                (d, reason, Signal::Utilization)
            }
        }
    };
    if desired != current {
        st.last_change_at = Some(now);
    }
    st.desired = desired;
    let d = ScaleDecision {
        desired,
        previous: current,
        reason,
        signal,
        panic: false,
        evidence,
    };
    (d, st)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn load(concurrency: f64) -> Load {
        Load {
            waiting: 0.0,
            running: concurrency,
            ..Load::default()
        }
    }

    /// Drives the policy every `step` seconds from `from` to `to` with load `f(t)`; replicas
    /// become ready as soon as they are asked for. Returns the decisions.
    struct Sim {
        cfg: AutoscaleConfig,
        state: State,
        ready: u32,
        /// Seconds a replica takes to become ready.
        ready_after: f64,
        pending: Vec<(f64, u32)>,
        log: Vec<(f64, ScaleDecision)>,
    }

    impl Sim {
        fn new(cfg: AutoscaleConfig, start: u32) -> Sim {
            cfg.validate().unwrap();
            Sim {
                cfg,
                state: State::new(start),
                ready: start,
                ready_after: 0.0,
                pending: Vec::new(),
                log: Vec::new(),
            }
        }

        fn tick(&mut self, t: f64, load: Option<Load>, held: u32) -> ScaleDecision {
            // Replicas asked for earlier become ready after `ready_after`.
            self.pending.retain(|&(at, n)| {
                if at <= t {
                    self.ready += n;
                    false
                } else {
                    true
                }
            });
            let signals = Signals {
                ready: self.ready,
                load,
                partial: None,
                held_requests: held,
            };
            let (d, s) = decide(&self.cfg, &self.state, &signals, secs(t));
            self.state = s;
            let in_flight: u32 = self.pending.iter().map(|p| p.1).sum();
            let have = self.ready + in_flight;
            if d.desired > have {
                self.pending.push((t + self.ready_after, d.desired - have));
                if self.ready_after == 0.0 {
                    self.ready = d.desired;
                    self.pending.clear();
                }
            } else if d.desired < self.ready {
                self.ready = d.desired;
            }
            self.log.push((t, d));
            d
        }

        fn run(&mut self, from: f64, to: f64, step: f64, f: impl Fn(f64) -> f64) {
            let mut t = from;
            while t <= to + 1e-9 {
                self.tick(t, Some(load(f(t))), 0);
                t += step;
            }
        }

        fn changes(&self) -> usize {
            self.log
                .windows(2)
                .filter(|w| w[0].1.desired != w[1].1.desired)
                .count()
        }

        fn last(&self) -> ScaleDecision {
            self.log.last().unwrap().1
        }
    }

    fn cfg() -> AutoscaleConfig {
        AutoscaleConfig {
            min_replicas: 1,
            max_replicas: 10,
            ..AutoscaleConfig::default()
        }
    }

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        AutoscaleConfig::default().validate().unwrap();
        let e = AutoscaleConfig {
            min_replicas: 4,
            max_replicas: 2,
            ..cfg()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key, "minReplicas");
        let e = AutoscaleConfig {
            target_concurrency: 0.0,
            ..cfg()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key, "targetConcurrency");
        let e = AutoscaleConfig {
            panic_window_secs: 120.0,
            ..cfg()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key, "panicWindowSecs");
        let e = AutoscaleConfig {
            target_kv_usage: 1.5,
            ..cfg()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key, "targetKvUsage");
        let e = AutoscaleConfig {
            panic_threshold: 1.0,
            ..cfg()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key, "panicThreshold");
    }

    #[test]
    fn yaml_keys_are_camel_case_and_unknown_keys_fail() {
        let c: AutoscaleConfig =
            serde_yaml::from_str("minReplicas: 0\nmaxReplicas: 5\nwarmSpares: 1\n").unwrap();
        assert_eq!((c.min_replicas, c.max_replicas, c.warm_spares), (0, 5, 1));
        assert_eq!(c.stable_window_secs, 60.0);
        assert!(serde_yaml::from_str::<AutoscaleConfig>("maxReplica: 5\n").is_err());
    }

    #[test]
    fn steady_load_settles_on_the_proportional_count() {
        let mut sim = Sim::new(cfg(), 1);
        sim.run(0.0, 120.0, 2.0, |_| 20.0);
        // 20 in flight at 8 per replica: 3 replicas.
        assert_eq!(sim.last().desired, 3);
        assert_eq!(sim.last().signal, Signal::Concurrency);
        assert_eq!(sim.last().reason, Reason::Steady);
    }

    #[test]
    fn ramp_up_scales_out_and_ramp_down_scales_in_slowly() {
        let mut sim = Sim::new(cfg(), 1);
        // Up from 1 to 40 over 100 s, hold, then down to 1 over 100 s, then quiet.
        sim.run(0.0, 400.0, 2.0, |t| {
            if t < 100.0 {
                1.0 + 39.0 * t / 100.0
            } else if t < 200.0 {
                40.0
            } else if t < 300.0 {
                40.0 - 39.0 * (t - 200.0) / 100.0
            } else {
                1.0
            }
        });
        let at = |t: f64| {
            sim.log
                .iter()
                .find(|(x, _)| (*x - t).abs() < 1e-6)
                .unwrap()
                .1
                .desired
        };
        assert_eq!(at(198.0), 5, "40 in flight at 8 per replica");
        // Monotone up during the ramp-up.
        let up: Vec<u32> = sim
            .log
            .iter()
            .filter(|(t, _)| *t < 200.0)
            .map(|(_, d)| d.desired)
            .collect();
        assert!(up.windows(2).all(|w| w[1] >= w[0]), "{up:?}");
        // Scale-in never removes more than one replica per decision and honours the
        // cooldown between changes.
        let mut last_change = f64::NEG_INFINITY;
        for w in sim.log.windows(2) {
            let (t, d) = (w[1].0, w[1].1);
            if d.desired < w[0].1.desired {
                assert_eq!(w[0].1.desired - d.desired, 1);
                assert!(
                    t - last_change >= 30.0,
                    "scale-in at {t} too soon after {last_change}"
                );
            }
            if d.desired != w[0].1.desired {
                last_change = t;
            }
        }
        assert_eq!(sim.last().desired, 1);
    }

    #[test]
    fn spike_enters_panic_and_scales_out_on_the_short_window() {
        let mut sim = Sim::new(cfg(), 1);
        sim.run(0.0, 60.0, 2.0, |_| 4.0);
        assert_eq!(sim.last().desired, 1);
        // A spike to 40: the stable window still averages low, the panic window does not.
        let d = sim.tick(62.0, Some(load(40.0)), 0);
        assert!(d.panic, "{d}");
        assert_eq!(d.reason, Reason::ScaleOut);
        assert!(d.desired >= 2, "{d}");
        sim.run(64.0, 70.0, 2.0, |_| 40.0);
        assert_eq!(sim.last().desired, 5);
        // The spike ends: while panicking, no scale-in.
        let d = sim.tick(72.0, Some(load(2.0)), 0);
        assert!(d.panic);
        assert_eq!(d.desired, 5);
        sim.run(74.0, 120.0, 2.0, |_| 2.0);
        assert!(sim
            .log
            .iter()
            .filter(|(t, _)| *t >= 72.0 && *t < 120.0)
            .all(|(_, d)| d.desired == 5));
        // A whole stable window later panic ends and scale-in begins.
        sim.run(122.0, 400.0, 2.0, |_| 2.0);
        assert!(!sim.last().panic);
        assert_eq!(sim.last().desired, 1);
    }

    #[test]
    fn oscillating_load_does_not_flap() {
        let mut sim = Sim::new(cfg(), 1);
        // Square wave between 4 and 20 in flight, period 20 s, for 10 minutes.
        sim.run(0.0, 600.0, 2.0, |t| {
            if ((t / 10.0) as u64) & 1 == 0 {
                4.0
            } else {
                20.0
            }
        });
        // Scale-out to cover the peaks happens early; then the count holds.
        assert!(sim.changes() <= 3, "changed {} times", sim.changes());
        assert!(sim.last().desired >= 2);
        let late: Vec<u32> = sim
            .log
            .iter()
            .filter(|(t, _)| *t > 200.0)
            .map(|(_, d)| d.desired)
            .collect();
        assert!(late.windows(2).all(|w| w[0] == w[1]), "{late:?}");
    }

    #[test]
    fn no_scale_in_while_the_short_window_still_needs_the_replicas() {
        let c = cfg();
        let mut state = State::new(3);
        let tick = |state: &mut State, t: f64, x: f64| {
            let signals = Signals {
                ready: 3,
                load: Some(load(x)),
                partial: None,
                held_requests: 0,
            };
            let (d, s) = decide(&c, state, &signals, secs(t));
            *state = s;
            d
        };
        // A quiet minute on 3 replicas (held there, as if just scaled out)...
        for i in 0..=30 {
            tick(&mut state, f64::from(i) * 2.0, 8.0);
            state.desired = 3;
        }
        state.last_change_at = None;
        // ...then the load rises again, not enough to panic (4 < 2 x 3 ready). The stable
        // average (about 10) asks for 2, the short window for 4: keep 3.
        for t in [62.0, 64.0] {
            tick(&mut state, t, 30.0);
            state.desired = 3;
        }
        let mut d = tick(&mut state, 65.0, 30.0);
        for t in [66.0, 68.0, 70.0] {
            d = tick(&mut state, t, 30.0);
            assert!(!d.panic, "{d}");
            assert_eq!(d.desired, 3, "{d}");
        }
        assert!(d.evidence.panic_concurrency > 24.0);
    }

    #[test]
    fn metric_gaps_freeze_scale_in_but_not_bounds() {
        let mut sim = Sim::new(cfg(), 1);
        sim.run(0.0, 60.0, 2.0, |_| 30.0);
        assert_eq!(sim.last().desired, 4);
        // Metrics stop arriving while the load is gone: never scale in blind.
        for i in 0..200 {
            let d = sim.tick(62.0 + 2.0 * f64::from(i), None, 0);
            assert_eq!(d.desired, 4, "{d}");
            if i >= 5 {
                assert_eq!(d.reason, Reason::HoldMetricsStale);
            }
        }
        // Metrics come back low: scale-in resumes.
        sim.run(462.0, 800.0, 2.0, |_| 1.0);
        assert_eq!(sim.last().desired, 1);
    }

    #[test]
    fn partial_metrics_may_raise_but_never_lower_the_count() {
        let mut sim = Sim::new(cfg(), 1);
        sim.run(0.0, 60.0, 2.0, |_| 20.0);
        assert_eq!(sim.last().desired, 3);
        let mut state = sim.state.clone();
        // Metrics stale; the replicas that answer report little (a lower bound): hold.
        let low = Signals {
            ready: 3,
            load: None,
            partial: Some(load(1.0)),
            held_requests: 0,
        };
        let (d, s) = decide(&sim.cfg, &state, &low, secs(100.0));
        assert_eq!((d.desired, d.reason), (3, Reason::HoldMetricsStale));
        state = s;
        // They report a lot: scale out on what is known.
        let high = Signals {
            partial: Some(load(40.0)),
            ..low
        };
        let (d, _) = decide(&sim.cfg, &state, &high, secs(102.0));
        assert_eq!((d.desired, d.reason), (5, Reason::ScaleOut));
    }

    #[test]
    fn a_short_gap_within_the_max_age_still_decides() {
        let mut sim = Sim::new(cfg(), 1);
        sim.run(0.0, 20.0, 2.0, |_| 20.0);
        let d = sim.tick(22.0, None, 0);
        assert_ne!(d.reason, Reason::HoldMetricsStale);
        assert_eq!(d.desired, 3);
    }

    #[test]
    fn no_metrics_ever_holds_the_initial_count() {
        let mut sim = Sim::new(cfg(), 2);
        for i in 0..10 {
            let d = sim.tick(f64::from(i) * 2.0, None, 0);
            assert_eq!(d.desired, 2);
            assert_eq!(d.reason, Reason::HoldMetricsStale);
        }
    }

    #[test]
    fn warm_spares_are_added_beyond_demand_within_max() {
        let c = AutoscaleConfig {
            warm_spares: 2,
            max_replicas: 4,
            ..cfg()
        };
        let mut sim = Sim::new(c, 1);
        sim.run(0.0, 60.0, 2.0, |_| 4.0);
        assert_eq!(sim.last().desired, 3, "1 for demand + 2 spares");
        sim.run(62.0, 200.0, 2.0, |_| 30.0);
        assert_eq!(sim.last().desired, 4, "capped at max");
    }

    #[test]
    fn queue_depth_forces_scale_out() {
        let mut sim = Sim::new(cfg(), 2);
        // Concurrency alone (16 over 2 replicas at 8) asks for 2; a deep queue asks more.
        let l = Load {
            running: 2.0,
            waiting: 20.0,
            ..Load::default()
        };
        let d = sim.tick(0.0, Some(l), 0);
        assert_eq!(d.signal, Signal::QueueDepth);
        // Concurrency asks for 3; the queue beyond 4 per ready replica (20 - 8 = 12) spreads
        // over new replicas at 8 each: 2 + 2.
        assert_eq!(d.desired, 4);
        assert_eq!(d.reason, Reason::ScaleOut);
    }

    #[test]
    fn kv_pressure_forces_scale_out() {
        let mut sim = Sim::new(cfg(), 2);
        let l = Load {
            running: 4.0,
            waiting: 0.0,
            kv_usage: Some(0.96),
            ..Load::default()
        };
        let d = sim.tick(0.0, Some(l), 0);
        assert_eq!(d.signal, Signal::KvUsage);
        assert_eq!(d.desired, 3, "2 x 0.96 / 0.8 = 2.4 -> 3");
    }

    #[test]
    fn ttft_over_target_forces_scale_out_and_under_target_does_not() {
        let c = AutoscaleConfig {
            target_ttft_p90_secs: Some(1.0),
            ..cfg()
        };
        let mut sim = Sim::new(c, 2);
        let slow = Load {
            running: 4.0,
            ttft_p90_secs: Some(1.5),
            ..Load::default()
        };
        let d = sim.tick(0.0, Some(slow), 0);
        assert_eq!(d.signal, Signal::TtftP90);
        assert_eq!(d.desired, 3);
        let fast = Load {
            running: 4.0,
            ttft_p90_secs: Some(0.2),
            ..Load::default()
        };
        let mut sim = Sim::new(sim.cfg.clone(), 2);
        let d = sim.tick(0.0, Some(fast), 0);
        assert_ne!(d.signal, Signal::TtftP90);
    }

    #[test]
    fn inflight_tokens_drive_demand_when_configured() {
        let c = AutoscaleConfig {
            target_inflight_tokens: Some(1000.0),
            ..cfg()
        };
        let mut sim = Sim::new(c, 1);
        let l = Load {
            running: 2.0,
            inflight_tokens: Some(3500.0),
            ..Load::default()
        };
        let d = sim.tick(0.0, Some(l), 0);
        assert_eq!(d.signal, Signal::InflightTokens);
        assert_eq!(d.desired, 4);
    }

    #[test]
    fn scale_to_zero_after_idle_and_activation_on_first_request() {
        let c = AutoscaleConfig {
            min_replicas: 0,
            scale_to_zero_after_secs: 60.0,
            warm_spares: 1,
            ..cfg()
        };
        let mut sim = Sim::new(c, 1);
        sim.run(0.0, 30.0, 2.0, |_| 3.0);
        assert_eq!(sim.last().desired, 2, "1 + a spare");
        // Idle: stays up until 60 s without load, then goes to zero (spares too).
        sim.run(32.0, 200.0, 2.0, |_| 0.0);
        let first_zero = sim.log.iter().find(|(_, d)| d.desired == 0).unwrap();
        assert!(first_zero.0 >= 30.0 + 60.0, "zero at {}", first_zero.0);
        assert_eq!(first_zero.1.reason, Reason::ScaleToZero);
        assert_eq!(sim.last().desired, 0);
        // The router holds a request: activate at once, whatever the windows say.
        let d = sim.tick(202.0, Some(load(0.0)), 1);
        assert_eq!(d.reason, Reason::Activation);
        assert_eq!(d.desired, 2, "one + the spare");
        // And it is not immediately scaled back to zero.
        let d = sim.tick(204.0, Some(load(1.0)), 0);
        assert!(d.desired >= 1);
    }

    #[test]
    fn activation_works_even_without_metrics() {
        let c = AutoscaleConfig {
            min_replicas: 0,
            ..cfg()
        };
        let mut sim = Sim::new(c, 0);
        let d = sim.tick(0.0, None, 3);
        assert_eq!((d.desired, d.reason), (1, Reason::Activation));
    }

    #[test]
    fn min_zero_keeps_one_while_recently_active() {
        let c = AutoscaleConfig {
            min_replicas: 0,
            scale_to_zero_after_secs: 300.0,
            ..cfg()
        };
        let mut sim = Sim::new(c, 1);
        sim.run(0.0, 100.0, 2.0, |t| if t < 10.0 { 1.0 } else { 0.0 });
        assert_eq!(sim.last().desired, 1);
    }

    #[test]
    fn cold_start_lead_asks_earlier_on_a_rising_trend() {
        let ramp = |t: f64| 1.0 + 0.5 * t; // +0.5 in flight per second
        let base = AutoscaleConfig {
            max_replicas: 20,
            ..cfg()
        };
        let mut plain = Sim::new(base.clone(), 1);
        plain.run(0.0, 60.0, 2.0, ramp);
        let mut lead = Sim::new(
            AutoscaleConfig {
                cold_start_secs: 30.0,
                ..base
            },
            1,
        );
        lead.run(0.0, 60.0, 2.0, ramp);
        let first_at = |s: &Sim, n: u32| {
            s.log
                .iter()
                .find(|(_, d)| d.desired >= n)
                .map(|(t, _)| *t)
                .unwrap()
        };
        // Without the lead, 3 replicas are asked for when 17 are in flight (t = 32);
        // with it, about 30 s earlier (0.5/s x 30 s = 15 more projected).
        let t_plain = first_at(&plain, 3);
        let t_lead = first_at(&lead, 3);
        assert!(t_lead + 20.0 <= t_plain, "lead {t_lead} plain {t_plain}");
        assert!(lead.log.iter().any(|(_, d)| d.signal == Signal::Trend));
        // A flat load projects nothing.
        let mut flat = Sim::new(lead.cfg.clone(), 1);
        flat.run(0.0, 60.0, 2.0, |_| 4.0);
        assert_eq!(flat.last().desired, 1);
        assert!(flat.log.iter().all(|(_, d)| d.signal != Signal::Trend));
    }

    #[test]
    fn slow_replicas_do_not_cause_repeated_scale_out() {
        // Replicas take 20 s to become ready; demand stays 3 the whole time.
        let mut sim = Sim::new(cfg(), 1);
        sim.ready_after = 20.0;
        sim.run(0.0, 120.0, 2.0, |_| 20.0);
        let max = sim.log.iter().map(|(_, d)| d.desired).max().unwrap();
        assert!(max <= 5, "asked for {max}");
        assert_eq!(sim.last().desired, 3);
    }

    #[test]
    fn bounds_are_respected() {
        let c = AutoscaleConfig {
            min_replicas: 2,
            max_replicas: 3,
            ..cfg()
        };
        let mut sim = Sim::new(c, 2);
        sim.run(0.0, 100.0, 2.0, |_| 1000.0);
        assert_eq!(sim.last().desired, 3);
        sim.run(102.0, 600.0, 2.0, |_| 0.0);
        assert_eq!(sim.last().desired, 2);
        assert!(sim.log.iter().all(|(_, d)| (2..=3).contains(&d.desired)));
    }

    #[test]
    fn decision_explains_itself() {
        let mut sim = Sim::new(cfg(), 1);
        let d = sim.tick(0.0, Some(load(20.0)), 0);
        let s = d.to_string();
        assert!(s.contains("scale out: 1 -> 3"), "{s}");
        assert!(s.contains("concurrency"), "{s}");
        let json = serde_json::to_value(d).unwrap();
        assert_eq!(json["reason"], "scale_out");
        assert_eq!(json["evidence"]["demand"], 3);
    }

    proptest::proptest! {
        /// Whatever arrives, in whatever order: bounds hold, scale-in is one step at a
        /// time after the cooldown, and nothing shrinks while metrics are missing or the
        /// policy panics.
        #[test]
        fn invariants_hold_for_any_signal_sequence(
            min in 0u32..3,
            extra in 0u32..6,
            spares in 0u32..3,
            steps in proptest::collection::vec(
                (proptest::option::of((0.0f64..80.0, 0.0f64..40.0, proptest::option::of(0.0f64..1.0))),
                 0u32..8, 0u32..3, 1u32..6),
                1..120),
        ) {
            let cfg = AutoscaleConfig {
                min_replicas: min,
                max_replicas: min.max(1) + extra,
                warm_spares: spares,
                cold_start_secs: 10.0,
                target_ttft_p90_secs: Some(1.0),
                scale_to_zero_after_secs: 20.0,
                ..AutoscaleConfig::default()
            };
            cfg.validate().unwrap();
            let mut state = State::new(min);
            let mut now = 0.0;
            let mut last_change: Option<f64> = None;
            for (load, ready, held, dt) in steps {
                now += f64::from(dt);
                let signals = Signals {
                    ready,
                    load: load.map(|(r, w, kv)| Load {
                        running: r,
                        waiting: w,
                        kv_usage: kv,
                        ttft_p90_secs: kv.map(|k| k * 2.0),
                        inflight_tokens: None,
                    }),
                    partial: None,
                    held_requests: held,
                };
                let (d, next) = decide(&cfg, &state, &signals, secs(now));
                proptest::prop_assert!(d.desired >= cfg.min_replicas && d.desired <= cfg.max_replicas, "{}", d);
                proptest::prop_assert_eq!(d.previous, state.desired);
                if d.desired < d.previous {
                    proptest::prop_assert!(d.previous - d.desired <= cfg.max_scale_in_step);
                    proptest::prop_assert!(d.reason != Reason::HoldMetricsStale);
                    proptest::prop_assert!(!next.panicking(), "{}", d);
                    if let Some(t) = last_change {
                        proptest::prop_assert!(now - t >= cfg.scale_in_cooldown_secs, "{}", d);
                    }
                }
                if d.reason == Reason::HoldMetricsStale {
                    proptest::prop_assert!(d.desired >= d.previous);
                }
                if d.desired != d.previous {
                    last_change = Some(now);
                }
                state = next;
            }
        }
    }

    #[test]
    fn garbage_numbers_do_not_panic() {
        let mut sim = Sim::new(cfg(), 1);
        for (i, x) in [f64::NAN, f64::INFINITY, -5.0, 1e300]
            .into_iter()
            .enumerate()
        {
            let l = Load {
                waiting: x,
                running: x,
                kv_usage: Some(x),
                ttft_p90_secs: Some(x),
                inflight_tokens: Some(x),
            };
            let d = sim.tick(i as f64, Some(l), 0);
            assert!((1..=10).contains(&d.desired));
        }
    }

    fn threshold_cfg() -> AutoscaleConfig {
        AutoscaleConfig {
            policy: PolicyKind::Threshold,
            min_replicas: 1,
            max_replicas: 10,
            threshold: ThresholdConfig {
                utilization: 0.5,
                slots: 4.0,
                period_secs: 15.0,
                tolerance: 0.1,
                scale_in_stabilization_secs: 300.0,
            },
            ..AutoscaleConfig::default()
        }
    }

    #[test]
    fn threshold_scales_on_busy_slots_every_period() {
        let mut sim = Sim::new(threshold_cfg(), 1);
        // 4 of 4 slots busy at 50 % target: ratio 2, so 2 replicas at the first evaluation.
        let d = sim.tick(0.0, Some(load(4.0)), 0);
        assert_eq!(
            (d.desired, d.reason, d.signal),
            (2, Reason::ScaleOut, Signal::Utilization)
        );
        assert_eq!(d.evidence.demand, 2);
        // Within the period nothing is evaluated, however busy.
        let d = sim.tick(5.0, Some(load(8.0)), 0);
        assert_eq!((d.desired, d.reason), (2, Reason::Steady));
        // Next period: 8 running on 2 × 4 slots, busy capped at 1: ratio 2 again → 4.
        let d = sim.tick(15.0, Some(load(8.0)), 0);
        assert_eq!(d.desired, 4);
        // The queue is invisible to it: waiting requests alone change nothing.
        let d = sim.tick(
            30.0,
            Some(Load {
                waiting: 100.0,
                running: 8.0,
                ..Load::default()
            }),
            0,
        );
        assert_eq!(d.desired, 4, "{d}");
    }

    #[test]
    fn threshold_tolerance_and_scale_in_stabilization() {
        let mut sim = Sim::new(threshold_cfg(), 2);
        // 4.2 running on 8 slots: busy 0.525, ratio 1.05 within the tolerance: hold.
        let d = sim.tick(0.0, Some(load(4.2)), 0);
        assert_eq!((d.desired, d.reason), (2, Reason::Steady));
        // Load drops to nothing: the recommendation is 1, but the last 300 s held a 2.
        let d = sim.tick(15.0, Some(load(0.0)), 0);
        assert_eq!((d.desired, d.reason), (2, Reason::HoldCooldown), "{d}");
        let mut t = 30.0;
        while t < 300.0 {
            assert_eq!(sim.tick(t, Some(load(0.0)), 0).desired, 2, "at {t}");
            t += 15.0;
        }
        // Once the 2 has left the window, scale in.
        let d = sim.tick(315.0, Some(load(0.0)), 0);
        assert_eq!((d.desired, d.reason), (1, Reason::ScaleIn), "{d}");
    }

    #[test]
    fn threshold_holds_without_metrics_and_respects_bounds() {
        let mut cfg = threshold_cfg();
        cfg.max_replicas = 3;
        let mut sim = Sim::new(cfg, 2);
        let d = sim.tick(0.0, None, 0);
        assert_eq!((d.desired, d.reason), (2, Reason::HoldMetricsStale));
        let d = sim.tick(15.0, Some(load(1000.0)), 0);
        assert_eq!(d.desired, 3);
        let bad = Load {
            waiting: f64::NAN,
            running: -1.0,
            ..Load::default()
        };
        let d = sim.tick(30.0, Some(bad), 0);
        assert_eq!((d.desired, d.reason), (3, Reason::HoldMetricsStale));
    }

    #[test]
    fn threshold_settings_are_validated_by_key() {
        let mut c = threshold_cfg();
        c.threshold.utilization = 0.0;
        assert_eq!(c.validate().unwrap_err().key, "threshold.utilization");
        let mut c = threshold_cfg();
        c.threshold.slots = f64::INFINITY;
        assert_eq!(c.validate().unwrap_err().key, "threshold.slots");
        let mut c = threshold_cfg();
        c.threshold.tolerance = 1.0;
        assert_eq!(c.validate().unwrap_err().key, "threshold.tolerance");
        let y = "policy: threshold\nthreshold:\n  utilization: 0.7\n  slots: 8\n";
        let c: AutoscaleConfig = serde_yaml::from_str(y).unwrap();
        assert_eq!(c.policy, PolicyKind::Threshold);
        assert_eq!(c.threshold.slots, 8.0);
        assert!(serde_yaml::from_str::<AutoscaleConfig>("policy: cpu\n").is_err());
    }
}
