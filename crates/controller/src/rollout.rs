//! Canary rollout analysis: a pure function from (config, state, what was observed at the
//! current step, `now`) to the next action and the evidence for it.
//!
//! A rollout moves the new version's traffic share through `steps` (percent, e.g. 5, 25,
//! 50, 100). At each step the canary is compared with the baseline on the traffic both
//! served *since the step began*: TTFT p90, ITL p90 and error rate, each only once both
//! sides have `minRequests` requests. Every check passing for `stepMinSecs` (and the
//! optional evaluation command exiting 0) advances a step; reaching 100 promotes. Any
//! regression, a crashed canary or a failed evaluation rolls back. Rolling back is a
//! routing change only: the baseline keeps its replicas until the new version is promoted.
//!
//! The live runner and the simulator both call [`analyze`]; neither clock nor I/O is here.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Rollout settings (`rollout:` in `controller.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutConfig {
    /// Canary traffic shares in percent, rising, ending at 100.
    pub steps: Vec<u8>,
    /// Seconds each step must run, all checks passing, before the next.
    pub step_min_secs: f64,
    /// Requests each side must have served at a step before it is judged.
    pub min_requests: u64,
    /// Canary TTFT p90 may be at most this many times the baseline's (plus the slack).
    pub max_ttft_ratio: f64,
    /// Canary ITL p90 may be at most this many times the baseline's (plus the slack).
    pub max_itl_ratio: f64,
    /// Absolute latency slack in seconds, so that tiny baselines do not trip the ratios.
    pub latency_slack_secs: f64,
    /// Canary error rate may exceed the baseline's by at most this (0..1).
    pub max_error_rate_increase: f64,
    /// A step that has not gathered `minRequests` after this many seconds rolls back.
    pub inconclusive_after_secs: f64,
    /// Optional evaluation command; its exit code gates each step (0 = pass).
    pub evaluation: Option<EvaluationConfig>,
}

/// A command run once per step; exit code 0 lets the step pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct EvaluationConfig {
    /// Program and arguments (no shell). `{canary}` and `{baseline}` are replaced by the
    /// model names.
    pub command: Vec<String>,
    /// Seconds before the command is killed and counted as failed.
    pub timeout_secs: f64,
}

impl Default for EvaluationConfig {
    fn default() -> Self {
        EvaluationConfig {
            command: Vec::new(),
            timeout_secs: 300.0,
        }
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            steps: vec![5, 25, 50, 100],
            step_min_secs: 60.0,
            min_requests: 50,
            max_ttft_ratio: 1.25,
            max_itl_ratio: 1.25,
            latency_slack_secs: 0.05,
            max_error_rate_increase: 0.02,
            inconclusive_after_secs: 1800.0,
            evaluation: None,
        }
    }
}

/// A rollout setting that cannot work, named by its YAML key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("rollout.{key}: {message}")]
pub struct ConfigError {
    pub key: &'static str,
    pub message: String,
}

impl RolloutConfig {
    /// Checks that every value is usable.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key, message: &str| ConfigError {
            key,
            message: message.to_string(),
        };
        parse_steps_checked(&self.steps).map_err(|m| bad("steps", &m))?;
        for (key, v) in [
            ("stepMinSecs", self.step_min_secs),
            ("latencySlackSecs", self.latency_slack_secs),
            ("inconclusiveAfterSecs", self.inconclusive_after_secs),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(key, "must be zero or more"));
            }
        }
        for (key, v) in [
            ("maxTtftRatio", self.max_ttft_ratio),
            ("maxItlRatio", self.max_itl_ratio),
        ] {
            if !(v.is_finite() && v >= 1.0) {
                return Err(bad(key, "must be 1 or more"));
            }
        }
        if !(0.0..=1.0).contains(&self.max_error_rate_increase) {
            return Err(bad("maxErrorRateIncrease", "must be in [0, 1]"));
        }
        if self.min_requests == 0 {
            return Err(bad("minRequests", "must be at least 1"));
        }
        if let Some(e) = &self.evaluation {
            if e.command.is_empty() {
                return Err(bad("evaluation.command", "must name a program"));
            }
            if !(e.timeout_secs.is_finite() && e.timeout_secs > 0.0) {
                return Err(bad("evaluation.timeoutSecs", "must be positive"));
            }
        }
        Ok(())
    }
}

fn parse_steps_checked(steps: &[u8]) -> Result<(), String> {
    if steps.is_empty() {
        return Err("needs at least one step".into());
    }
    if steps.iter().any(|&s| s == 0 || s > 100) {
        return Err("each step is a percent in 1..=100".into());
    }
    if steps.windows(2).any(|w| w[1] <= w[0]) {
        return Err("steps must rise".into());
    }
    if steps.last() != Some(&100) {
        return Err("the last step must be 100".into());
    }
    Ok(())
}

/// Parses `5,25,50,100` (the CLI's `--steps`).
pub fn parse_steps(s: &str) -> Result<Vec<u8>, String> {
    let steps = s
        .split(',')
        .map(|p| {
            p.trim()
                .parse::<u8>()
                .map_err(|_| format!("`{}` is not a percent", p.trim()))
        })
        .collect::<Result<Vec<u8>, String>>()?;
    parse_steps_checked(&steps)?;
    Ok(steps)
}

/// What one version served at the current step.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct VersionStats {
    pub requests: u64,
    /// Requests that failed (5xx, aborted streams).
    pub errors: u64,
    pub ttft_p90_secs: Option<f64>,
    pub itl_p90_secs: Option<f64>,
}

impl VersionStats {
    /// Errors per request, 0 when nothing was served.
    pub fn error_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.errors as f64 / self.requests as f64
        }
    }
}

/// The evaluation command's result for the current step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Evaluation {
    Passed,
    Failed { detail: String },
}

/// What the runner saw at the current step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Observation {
    pub canary: VersionStats,
    pub baseline: VersionStats,
    /// False when the canary's replicas crashed or none is ready.
    pub canary_healthy: bool,
    /// The evaluation result for this step, once the command has run.
    pub evaluation: Option<Evaluation>,
}

/// Where a rollout is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Progressing,
    Promoted,
    RolledBack,
}

/// What the rollout remembers. Created by [`start`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutState {
    pub phase: Phase,
    /// Index into `steps` of the current step.
    pub step: usize,
    /// The canary's current share in percent.
    pub weight: u8,
    /// When the current step began (seconds on the caller's clock).
    pub step_started_secs: f64,
}

/// The next thing the runner does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "action")]
pub enum Action {
    /// Keep the current weight.
    Wait,
    /// Move the canary to a larger share (resets the step's counters).
    Advance { weight: u8 },
    /// Send all traffic to the new version; the baseline may now be retired.
    Promote,
    /// Send all traffic back to the baseline.
    Rollback,
}

/// One comparison and its outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub metric: &'static str,
    pub canary: f64,
    pub baseline: f64,
    /// The largest canary value that passes.
    pub limit: f64,
    pub passed: bool,
}

/// The decision with everything it was made from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolloutDecision {
    pub action: Action,
    /// The canary's share after the action, in percent.
    pub weight: u8,
    pub reason: String,
    pub checks: Vec<Check>,
    pub canary: VersionStats,
    pub baseline: VersionStats,
    pub step_elapsed_secs: f64,
}

impl fmt::Display for RolloutDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let action = match self.action {
            Action::Wait => "wait".to_string(),
            Action::Advance { weight } => format!("advance to {weight}%"),
            Action::Promote => "promote".to_string(),
            Action::Rollback => "roll back".to_string(),
        };
        write!(
            f,
            "{action}: {} (canary {} req / {} err, baseline {} req / {} err",
            self.reason,
            self.canary.requests,
            self.canary.errors,
            self.baseline.requests,
            self.baseline.errors
        )?;
        for c in &self.checks {
            write!(
                f,
                "; {} {:.4} vs {:.4} limit {:.4} {}",
                c.metric,
                c.canary,
                c.baseline,
                c.limit,
                if c.passed { "ok" } else { "FAIL" }
            )?;
        }
        f.write_str(")")
    }
}

/// Begins a rollout at the first step.
pub fn start(cfg: &RolloutConfig, now: Duration) -> (RolloutDecision, RolloutState) {
    let weight = cfg.steps.first().copied().unwrap_or(100);
    let state = RolloutState {
        phase: if weight >= 100 {
            Phase::Promoted
        } else {
            Phase::Progressing
        },
        step: 0,
        weight,
        step_started_secs: now.as_secs_f64(),
    };
    let action = if weight >= 100 {
        Action::Promote
    } else {
        Action::Advance { weight }
    };
    let d = RolloutDecision {
        action,
        weight,
        reason: "rollout started".into(),
        checks: Vec::new(),
        canary: VersionStats::default(),
        baseline: VersionStats::default(),
        step_elapsed_secs: 0.0,
    };
    (d, state)
}

fn decision(
    action: Action,
    weight: u8,
    reason: impl Into<String>,
    checks: Vec<Check>,
    obs: &Observation,
    elapsed: f64,
) -> RolloutDecision {
    RolloutDecision {
        action,
        weight,
        reason: reason.into(),
        checks,
        canary: obs.canary,
        baseline: obs.baseline,
        step_elapsed_secs: elapsed,
    }
}

/// Compares canary and baseline at the current step and decides what happens next.
///
/// A finished rollout stays put. Otherwise a rollback wins over everything (a crashed
/// canary, then a regression, a failed evaluation or a step that stays inconclusive), then
/// a reason to wait; with none, the rollout moves to its next step.
pub fn analyze(
    cfg: &RolloutConfig,
    state: &RolloutState,
    obs: &Observation,
    now: Duration,
) -> (RolloutDecision, RolloutState) {
    let elapsed = (now.as_secs_f64() - state.step_started_secs).max(0.0);
    if let Some(d) = finished(state.phase, obs, elapsed) {
        return (d, state.clone());
    }
    if !obs.canary_healthy {
        let reason = "canary unhealthy (crashed or not ready)".to_string();
        return roll_back(state, reason, vec![], obs, elapsed);
    }
    let enough =
        obs.canary.requests >= cfg.min_requests && obs.baseline.requests >= cfg.min_requests;
    let checks = compare(cfg, obs, enough);
    if let Some(reason) = rollback_reason(cfg, obs, &checks, enough, elapsed) {
        return roll_back(state, reason, checks, obs, elapsed);
    }
    if let Some(reason) = wait_reason(cfg, obs, enough, elapsed) {
        let d = decision(Action::Wait, state.weight, reason, checks, obs, elapsed);
        return (d, state.clone());
    }
    next_step(cfg, state, checks, obs, elapsed, now)
}

/// A promoted or rolled-back rollout only waits: there is nothing left to analyze.
fn finished(phase: Phase, obs: &Observation, elapsed: f64) -> Option<RolloutDecision> {
    match phase {
        Phase::Promoted => Some(decision(
            Action::Wait,
            100,
            "already promoted",
            vec![],
            obs,
            elapsed,
        )),
        Phase::RolledBack => Some(decision(
            Action::Wait,
            0,
            "already rolled back",
            vec![],
            obs,
            elapsed,
        )),
        Phase::Progressing => None,
    }
}

/// The canary against the baseline on what both served at this step. The error rate is
/// judged as soon as the canary alone has enough requests, since errors matter even when
/// the baseline is quiet; the latencies only once both sides have `enough`.
fn compare(cfg: &RolloutConfig, obs: &Observation, enough: bool) -> Vec<Check> {
    let mut checks = Vec::new();
    if obs.canary.requests >= cfg.min_requests {
        let limit = obs.baseline.error_rate() + cfg.max_error_rate_increase;
        checks.push(Check {
            metric: "error_rate",
            canary: obs.canary.error_rate(),
            baseline: obs.baseline.error_rate(),
            limit,
            passed: obs.canary.error_rate() <= limit + 1e-12,
        });
    }
    if enough {
        let latency = |metric, c: Option<f64>, b: Option<f64>, ratio: f64| {
            let (c, b) = (c?, b?);
            let limit = b * ratio + cfg.latency_slack_secs;
            Some(Check {
                metric,
                canary: c,
                baseline: b,
                limit,
                passed: c <= limit,
            })
        };
        checks.extend(latency(
            "ttft_p90_secs",
            obs.canary.ttft_p90_secs,
            obs.baseline.ttft_p90_secs,
            cfg.max_ttft_ratio,
        ));
        checks.extend(latency(
            "itl_p90_secs",
            obs.canary.itl_p90_secs,
            obs.baseline.itl_p90_secs,
            cfg.max_itl_ratio,
        ));
    }
    checks
}

/// Why the canary must go, if it must: a failed check, then a failed evaluation, then a
/// step that has not gathered enough requests by `inconclusiveAfterSecs` (a canary nobody
/// can judge is not promoted by default).
fn rollback_reason(
    cfg: &RolloutConfig,
    obs: &Observation,
    checks: &[Check],
    enough: bool,
    elapsed: f64,
) -> Option<String> {
    if let Some(failed) = checks.iter().find(|c| !c.passed) {
        return Some(format!("canary regressed on {}", failed.metric));
    }
    if let Some(Evaluation::Failed { detail }) = &obs.evaluation {
        return Some(format!("evaluation failed: {detail}"));
    }
    (!enough && elapsed >= cfg.inconclusive_after_secs).then(|| {
        format!(
            "inconclusive: fewer than {} requests per side after {:.0} s",
            cfg.min_requests, elapsed
        )
    })
}

/// Why a canary with nothing against it still waits: too few requests to judge, a step
/// younger than `stepMinSecs`, or an evaluation command not yet done.
fn wait_reason(
    cfg: &RolloutConfig,
    obs: &Observation,
    enough: bool,
    elapsed: f64,
) -> Option<String> {
    if !enough {
        Some(format!(
            "gathering samples (need {} per side)",
            cfg.min_requests
        ))
    } else if elapsed < cfg.step_min_secs {
        Some(format!(
            "checks pass; step runs {:.0} s of {:.0} s",
            elapsed, cfg.step_min_secs
        ))
    } else if cfg.evaluation.is_some() && obs.evaluation.is_none() {
        Some("checks pass; awaiting the evaluation command".into())
    } else {
        None
    }
}

/// Sends all traffic back to the baseline.
fn roll_back(
    state: &RolloutState,
    reason: String,
    checks: Vec<Check>,
    obs: &Observation,
    elapsed: f64,
) -> (RolloutDecision, RolloutState) {
    let st = RolloutState {
        phase: Phase::RolledBack,
        weight: 0,
        ..state.clone()
    };
    let d = decision(Action::Rollback, 0, reason, checks, obs, elapsed);
    (d, st)
}

/// The step passed: on to the next weight, or promotion once that reaches 100. The new
/// step's clock starts now.
fn next_step(
    cfg: &RolloutConfig,
    state: &RolloutState,
    checks: Vec<Check>,
    obs: &Observation,
    elapsed: f64,
    now: Duration,
) -> (RolloutDecision, RolloutState) {
    let next = state.step + 1;
    let weight = cfg.steps.get(next).copied().unwrap_or(100);
    let mut st = RolloutState {
        phase: state.phase,
        step: next,
        weight,
        step_started_secs: now.as_secs_f64(),
    };
    if weight >= 100 {
        st.phase = Phase::Promoted;
        st.weight = 100;
        let d = decision(
            Action::Promote,
            100,
            "all steps passed",
            checks,
            obs,
            elapsed,
        );
        (d, st)
    } else {
        let d = decision(
            Action::Advance { weight },
            weight,
            format!("step {} passed", state.step + 1),
            checks,
            obs,
            elapsed,
        );
        (d, st)
    }
}

/// An operator's `strata rollout promote`: all traffic to the new version now.
pub fn promote(state: &RolloutState, now: Duration) -> (RolloutDecision, RolloutState) {
    let mut st = state.clone();
    let elapsed = (now.as_secs_f64() - state.step_started_secs).max(0.0);
    let obs = Observation::default();
    if state.phase == Phase::RolledBack {
        let d = decision(
            Action::Wait,
            0,
            "rolled back; start a new rollout",
            vec![],
            &obs,
            elapsed,
        );
        return (d, st);
    }
    st.phase = Phase::Promoted;
    st.weight = 100;
    let d = decision(
        Action::Promote,
        100,
        "promoted by operator",
        vec![],
        &obs,
        elapsed,
    );
    (d, st)
}

/// An operator's `strata rollout rollback`: all traffic back to the baseline now.
pub fn rollback(state: &RolloutState, now: Duration) -> (RolloutDecision, RolloutState) {
    let mut st = state.clone();
    let elapsed = (now.as_secs_f64() - state.step_started_secs).max(0.0);
    let obs = Observation::default();
    if state.phase == Phase::Promoted {
        let d = decision(
            Action::Wait,
            100,
            "already promoted; roll out the old version to go back",
            vec![],
            &obs,
            elapsed,
        );
        return (d, st);
    }
    st.phase = Phase::RolledBack;
    st.weight = 0;
    let d = decision(
        Action::Rollback,
        0,
        "rolled back by operator",
        vec![],
        &obs,
        elapsed,
    );
    (d, st)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn stats(requests: u64, errors: u64, ttft: f64, itl: f64) -> VersionStats {
        VersionStats {
            requests,
            errors,
            ttft_p90_secs: Some(ttft),
            itl_p90_secs: Some(itl),
        }
    }

    fn healthy(canary: VersionStats, baseline: VersionStats) -> Observation {
        Observation {
            canary,
            baseline,
            canary_healthy: true,
            evaluation: None,
        }
    }

    #[test]
    fn steps_parse_and_validate() {
        assert_eq!(parse_steps("5,25,50,100").unwrap(), vec![5, 25, 50, 100]);
        assert_eq!(parse_steps(" 100 ").unwrap(), vec![100]);
        assert!(parse_steps("5,25,50").unwrap_err().contains("last step"));
        assert!(parse_steps("25,5,100").unwrap_err().contains("rise"));
        assert!(parse_steps("0,100").is_err());
        assert!(parse_steps("5,x,100").unwrap_err().contains("`x`"));
        assert!(parse_steps("5,300").is_err());
        RolloutConfig::default().validate().unwrap();
        let e = RolloutConfig {
            max_ttft_ratio: 0.5,
            ..RolloutConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key, "maxTtftRatio");
        let c: RolloutConfig = serde_yaml::from_str("steps: [10, 100]\nminRequests: 5\n").unwrap();
        assert_eq!(c.steps, vec![10, 100]);
        assert!(serde_yaml::from_str::<RolloutConfig>("step: [10]\n").is_err());
    }

    #[test]
    fn a_good_canary_is_promoted_step_by_step() {
        let cfg = RolloutConfig::default();
        let (d, mut st) = start(&cfg, secs(0.0));
        assert_eq!(d.action, Action::Advance { weight: 5 });
        let mut t = 0.0;
        let mut weights = vec![st.weight];
        loop {
            t += 10.0;
            let obs = healthy(stats(100, 0, 0.30, 0.05), stats(900, 1, 0.28, 0.05));
            let (d, s) = analyze(&cfg, &st, &obs, secs(t));
            st = s;
            match d.action {
                Action::Wait => assert!(d.reason.contains("step runs"), "{d}"),
                Action::Advance { weight } => weights.push(weight),
                Action::Promote => {
                    weights.push(100);
                    break;
                }
                Action::Rollback => panic!("{d}"),
            }
            assert!(t < 1000.0);
        }
        assert_eq!(weights, vec![5, 25, 50, 100]);
        assert_eq!(st.phase, Phase::Promoted);
        // Each step waited its minimum time: 3 steps x 60 s.
        assert!(t >= 180.0);
        // A promoted rollout stays promoted.
        let (d, _) = analyze(
            &cfg,
            &st,
            &healthy(stats(0, 0, 0.0, 0.0), stats(0, 0, 0.0, 0.0)),
            secs(t + 10.0),
        );
        assert_eq!(d.action, Action::Wait);
    }

    #[test]
    fn ttft_regression_rolls_back_with_evidence() {
        let cfg = RolloutConfig::default();
        let (_, st) = start(&cfg, secs(0.0));
        let obs = healthy(stats(60, 0, 0.9, 0.05), stats(900, 0, 0.3, 0.05));
        let (d, st) = analyze(&cfg, &st, &obs, secs(30.0));
        assert_eq!(d.action, Action::Rollback);
        assert_eq!(d.weight, 0);
        assert_eq!(st.phase, Phase::RolledBack);
        let c = d
            .checks
            .iter()
            .find(|c| c.metric == "ttft_p90_secs")
            .unwrap();
        assert!(!c.passed);
        assert!((c.limit - (0.3 * 1.25 + 0.05)).abs() < 1e-9);
        assert!(d.to_string().contains("FAIL"), "{d}");
        assert!(d.reason.contains("ttft"));
    }

    #[test]
    fn itl_regression_rolls_back() {
        let cfg = RolloutConfig::default();
        let (_, st) = start(&cfg, secs(0.0));
        let obs = healthy(stats(60, 0, 0.3, 0.5), stats(900, 0, 0.3, 0.05));
        let (d, _) = analyze(&cfg, &st, &obs, secs(30.0));
        assert_eq!(d.action, Action::Rollback);
        assert!(d.reason.contains("itl"));
    }

    #[test]
    fn error_rate_regression_rolls_back_even_when_baseline_is_thin() {
        let cfg = RolloutConfig::default();
        let (_, st) = start(&cfg, secs(0.0));
        let obs = healthy(stats(50, 10, 0.3, 0.05), stats(3, 0, 0.3, 0.05));
        let (d, _) = analyze(&cfg, &st, &obs, secs(5.0));
        assert_eq!(d.action, Action::Rollback);
        assert!(d.reason.contains("error_rate"));
    }

    #[test]
    fn small_differences_within_slack_pass() {
        let cfg = RolloutConfig::default();
        let (_, st) = start(&cfg, secs(0.0));
        // 20 ms vs 10 ms baseline: twice as slow, but within the 50 ms slack.
        let obs = healthy(stats(60, 1, 0.02, 0.01), stats(900, 10, 0.01, 0.01));
        let (d, _) = analyze(&cfg, &st, &obs, secs(61.0));
        assert_eq!(d.action, Action::Advance { weight: 25 }, "{d}");
    }

    #[test]
    fn too_few_samples_waits_then_rolls_back_as_inconclusive() {
        let cfg = RolloutConfig {
            inconclusive_after_secs: 600.0,
            ..RolloutConfig::default()
        };
        let (_, st) = start(&cfg, secs(0.0));
        // A terrible canary, but only 10 requests: not judged yet.
        let obs = healthy(stats(10, 0, 9.0, 9.0), stats(200, 0, 0.3, 0.05));
        let (d, st) = analyze(&cfg, &st, &obs, secs(100.0));
        assert_eq!(d.action, Action::Wait);
        assert!(d.reason.contains("gathering"));
        let (d, st) = analyze(&cfg, &st, &obs, secs(601.0));
        assert_eq!(d.action, Action::Rollback);
        assert!(d.reason.contains("inconclusive"));
        assert_eq!(st.phase, Phase::RolledBack);
    }

    #[test]
    fn crashed_canary_rolls_back_at_once() {
        let cfg = RolloutConfig::default();
        let (_, st) = start(&cfg, secs(0.0));
        let obs = Observation {
            canary_healthy: false,
            ..Observation::default()
        };
        let (d, st) = analyze(&cfg, &st, &obs, secs(1.0));
        assert_eq!(d.action, Action::Rollback);
        assert!(d.reason.contains("unhealthy"));
        // Later observations change nothing.
        let (d, _) = analyze(
            &cfg,
            &st,
            &healthy(stats(100, 0, 0.1, 0.01), stats(100, 0, 0.1, 0.01)),
            secs(100.0),
        );
        assert_eq!(d.action, Action::Wait);
        assert_eq!(d.weight, 0);
    }

    #[test]
    fn evaluation_gates_each_step() {
        let cfg = RolloutConfig {
            evaluation: Some(EvaluationConfig {
                command: vec!["true".into()],
                timeout_secs: 10.0,
            }),
            ..RolloutConfig::default()
        };
        cfg.validate().unwrap();
        let (_, st) = start(&cfg, secs(0.0));
        let mut obs = healthy(stats(100, 0, 0.3, 0.05), stats(900, 0, 0.3, 0.05));
        let (d, st) = analyze(&cfg, &st, &obs, secs(61.0));
        assert_eq!(d.action, Action::Wait);
        assert!(d.reason.contains("evaluation"));
        obs.evaluation = Some(Evaluation::Passed);
        let (d, st) = analyze(&cfg, &st, &obs, secs(62.0));
        assert_eq!(d.action, Action::Advance { weight: 25 });
        obs.evaluation = Some(Evaluation::Failed {
            detail: "exit code 3".into(),
        });
        let (d, _) = analyze(&cfg, &st, &obs, secs(70.0));
        assert_eq!(d.action, Action::Rollback);
        assert!(d.reason.contains("exit code 3"));
    }

    #[test]
    fn operator_promote_and_rollback() {
        let cfg = RolloutConfig::default();
        let (_, st) = start(&cfg, secs(0.0));
        let (d, promoted) = promote(&st, secs(5.0));
        assert_eq!(
            (d.action, d.weight, promoted.phase),
            (Action::Promote, 100, Phase::Promoted)
        );
        let (d, _) = rollback(&promoted, secs(6.0));
        assert_eq!(
            d.action,
            Action::Wait,
            "a promoted rollout is not rolled back"
        );
        let (d, back) = rollback(&st, secs(5.0));
        assert_eq!(
            (d.action, back.phase),
            (Action::Rollback, Phase::RolledBack)
        );
        let (d, _) = promote(&back, secs(6.0));
        assert_eq!(d.action, Action::Wait);
    }

    #[test]
    fn a_single_step_rollout_promotes_immediately() {
        let cfg = RolloutConfig {
            steps: vec![100],
            ..RolloutConfig::default()
        };
        let (d, st) = start(&cfg, secs(0.0));
        assert_eq!(d.action, Action::Promote);
        assert_eq!(st.phase, Phase::Promoted);
    }

    #[test]
    fn decisions_serialize_with_their_evidence() {
        let cfg = RolloutConfig::default();
        let (_, st) = start(&cfg, secs(0.0));
        let obs = healthy(stats(60, 0, 0.9, 0.05), stats(900, 0, 0.3, 0.05));
        let (d, _) = analyze(&cfg, &st, &obs, secs(30.0));
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["action"]["action"], "rollback");
        assert_eq!(v["canary"]["requests"], 60);
        assert_eq!(v["checks"][1]["metric"], "ttft_p90_secs");
    }
}
