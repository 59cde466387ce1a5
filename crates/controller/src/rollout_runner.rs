//! Runs a rollout live: applies the canary share through the router
//! ([`TrafficSplitter`]), reads what each version served at the current step
//! ([`StepStats`]), runs the optional evaluation command, and lets
//! [`rollout::analyze`](crate::rollout::analyze) decide. Every decision is logged with its
//! evidence, kept in the history and exported as metrics.

use std::future::Future;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::metrics::ControllerMetrics;
use crate::rollout::{
    self, Action, Evaluation, EvaluationConfig, Observation, Phase, RolloutConfig, RolloutDecision,
    RolloutState, VersionStats,
};

/// Moves traffic between two versions of a model (the router implements it).
pub trait TrafficSplitter: Send + Sync {
    /// Sends `canary_percent` of the traffic for `baseline` to `canary` instead.
    fn set_split(&self, baseline: &str, canary: &str, canary_percent: u8) -> Result<(), String>;
}

/// What each version served since the last [`StepStats::reset`] (the router keeps these).
pub trait StepStats: Send {
    /// Starts a new step: counts from zero.
    fn reset(&mut self);
    /// The stats so far for `model`.
    fn stats(&mut self, model: &str) -> impl Future<Output = VersionStats> + Send;
    /// Whether the canary has a ready replica that has not crashed.
    fn healthy(&mut self, model: &str) -> impl Future<Output = bool> + Send;
}

/// A rollout in progress.
pub struct RolloutRunner<S: StepStats> {
    cfg: RolloutConfig,
    canary: String,
    baseline: String,
    state: RolloutState,
    splitter: Arc<dyn TrafficSplitter>,
    stats: S,
    metrics: Arc<ControllerMetrics>,
    origin: Instant,
    /// The evaluation's result at the current step, once run.
    evaluation: Option<Evaluation>,
    /// Every decision so far, oldest first.
    pub history: Vec<RolloutDecision>,
}

impl<S: StepStats> RolloutRunner<S> {
    /// Starts: the canary gets the first step's share.
    pub fn start(
        cfg: RolloutConfig,
        canary: impl Into<String>,
        baseline: impl Into<String>,
        splitter: Arc<dyn TrafficSplitter>,
        mut stats: S,
        metrics: Arc<ControllerMetrics>,
    ) -> Result<RolloutRunner<S>, String> {
        let origin = Instant::now();
        let (d, state) = rollout::start(&cfg, Duration::ZERO);
        let canary = canary.into();
        let baseline = baseline.into();
        splitter.set_split(&baseline, &canary, d.weight)?;
        stats.reset();
        let mut r = RolloutRunner {
            cfg,
            canary,
            baseline,
            state,
            splitter,
            stats,
            metrics,
            origin,
            evaluation: None,
            history: Vec::new(),
        };
        r.record(d);
        Ok(r)
    }

    pub fn state(&self) -> &RolloutState {
        &self.state
    }

    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn record(&mut self, d: RolloutDecision) {
        let evidence = serde_json::to_string(&d.checks).unwrap_or_default();
        match d.action {
            Action::Wait => tracing::debug!(canary = %self.canary, "{d}"),
            Action::Rollback => {
                tracing::warn!(canary = %self.canary, baseline = %self.baseline, %evidence, "{d}")
            }
            _ => tracing::info!(canary = %self.canary, baseline = %self.baseline, %evidence, "{d}"),
        }
        self.metrics.record_rollout(&d);
        self.history.push(d);
    }

    /// Applies a decision's weight; a router that refuses is reported, and the rollout is
    /// held where it was.
    fn apply(&mut self, d: &RolloutDecision) -> Result<(), String> {
        match d.action {
            Action::Wait => Ok(()),
            Action::Advance { weight } => {
                self.splitter
                    .set_split(&self.baseline, &self.canary, weight)?;
                self.stats.reset();
                self.evaluation = None;
                Ok(())
            }
            Action::Promote => self.splitter.set_split(&self.baseline, &self.canary, 100),
            Action::Rollback => self.splitter.set_split(&self.baseline, &self.canary, 0),
        }
    }

    /// One round of analysis. Returns the decision.
    pub async fn tick(&mut self) -> RolloutDecision {
        let elapsed = self.now().as_secs_f64() - self.state.step_started_secs;
        let canary = self.stats.stats(&self.canary).await;
        let baseline = self.stats.stats(&self.baseline).await;
        let healthy = self.stats.healthy(&self.canary).await;
        // The evaluation runs once per step, when the step has run its minimum time.
        if self.state.phase == Phase::Progressing
            && self.evaluation.is_none()
            && elapsed >= self.cfg.step_min_secs
        {
            if let Some(e) = self.cfg.evaluation.clone() {
                self.evaluation = Some(run_evaluation(&e, &self.canary, &self.baseline).await);
            }
        }
        let obs = Observation {
            canary,
            baseline,
            canary_healthy: healthy,
            evaluation: self.evaluation.clone(),
        };
        let (d, state) = rollout::analyze(&self.cfg, &self.state, &obs, self.now());
        let previous = std::mem::replace(&mut self.state, state);
        if let Err(e) = self.apply(&d) {
            tracing::warn!(error = %e, "the router refused the traffic split; holding");
            self.state = previous;
            let mut held = d.clone();
            held.action = Action::Wait;
            held.weight = self.state.weight;
            held.reason = format!("router refused the split ({e}); holding");
            self.record(held.clone());
            return held;
        }
        self.record(d.clone());
        d
    }

    /// The operator's promote.
    pub fn promote(&mut self) -> Result<RolloutDecision, String> {
        let (d, state) = rollout::promote(&self.state, self.now());
        self.apply(&d)?;
        self.state = state;
        self.record(d.clone());
        Ok(d)
    }

    /// The operator's rollback.
    pub fn rollback(&mut self) -> Result<RolloutDecision, String> {
        let (d, state) = rollout::rollback(&self.state, self.now());
        self.apply(&d)?;
        self.state = state;
        self.record(d.clone());
        Ok(d)
    }
}

/// Runs the evaluation command; exit code 0 passes.
pub async fn run_evaluation(cfg: &EvaluationConfig, canary: &str, baseline: &str) -> Evaluation {
    let fill = |s: &String| {
        s.replace("{canary}", canary)
            .replace("{baseline}", baseline)
    };
    let Some((program, args)) = cfg.command.split_first() else {
        return Evaluation::Failed {
            detail: "no command".into(),
        };
    };
    let mut cmd = tokio::process::Command::new(fill(program));
    cmd.args(args.iter().map(fill))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return Evaluation::Failed {
                detail: format!("{program}: {e}"),
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs_f64(cfg.timeout_secs), child.wait()).await {
        Ok(Ok(s)) if s.success() => Evaluation::Passed,
        Ok(Ok(s)) => Evaluation::Failed {
            detail: match s.code() {
                Some(c) => format!("exit code {c}"),
                None => format!("{s}"),
            },
        },
        Ok(Err(e)) => Evaluation::Failed {
            detail: e.to_string(),
        },
        Err(_) => {
            let _ = child.kill().await;
            Evaluation::Failed {
                detail: format!("timed out after {} s", cfg.timeout_secs),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Router {
        splits: Mutex<Vec<u8>>,
        refuse: Mutex<bool>,
    }

    impl TrafficSplitter for Router {
        fn set_split(&self, baseline: &str, canary: &str, pct: u8) -> Result<(), String> {
            assert_eq!((baseline, canary), ("old", "new"));
            if *self.refuse.lock().unwrap() {
                return Err("no".into());
            }
            self.splits.lock().unwrap().push(pct);
            Ok(())
        }
    }

    struct Stats {
        canary: VersionStats,
        baseline: VersionStats,
        healthy: Arc<Mutex<bool>>,
        resets: Arc<Mutex<u32>>,
    }

    impl StepStats for Stats {
        fn reset(&mut self) {
            *self.resets.lock().unwrap() += 1;
        }
        async fn stats(&mut self, model: &str) -> VersionStats {
            if model == "new" {
                self.canary
            } else {
                self.baseline
            }
        }
        async fn healthy(&mut self, _model: &str) -> bool {
            *self.healthy.lock().unwrap()
        }
    }

    fn good(n: u64) -> VersionStats {
        VersionStats {
            requests: n,
            errors: 0,
            ttft_p90_secs: Some(0.2),
            itl_p90_secs: Some(0.05),
        }
    }

    #[allow(clippy::type_complexity)]
    fn runner(
        cfg: RolloutConfig,
    ) -> (
        RolloutRunner<Stats>,
        Arc<Router>,
        Arc<Mutex<bool>>,
        Arc<Mutex<u32>>,
        Arc<ControllerMetrics>,
    ) {
        let router = Arc::new(Router::default());
        let healthy = Arc::new(Mutex::new(true));
        let resets = Arc::new(Mutex::new(0));
        let metrics = Arc::new(ControllerMetrics::new());
        let stats = Stats {
            canary: good(100),
            baseline: good(1000),
            healthy: healthy.clone(),
            resets: resets.clone(),
        };
        let r = RolloutRunner::start(cfg, "new", "old", router.clone(), stats, metrics.clone())
            .unwrap();
        (r, router, healthy, resets, metrics)
    }

    fn fast() -> RolloutConfig {
        RolloutConfig {
            step_min_secs: 0.0,
            ..RolloutConfig::default()
        }
    }

    #[tokio::test]
    async fn a_healthy_canary_walks_the_steps_through_the_router() {
        let (mut r, router, _, resets, metrics) = runner(fast());
        for _ in 0..10 {
            if r.tick().await.action == Action::Promote {
                break;
            }
        }
        assert_eq!(r.state().phase, Phase::Promoted);
        assert_eq!(*router.splits.lock().unwrap(), vec![5, 25, 50, 100]);
        assert_eq!(*resets.lock().unwrap(), 3, "counters restart at each step");
        let text = metrics.render();
        assert!(
            text.contains("strata_rollout_canary_weight_percent 100"),
            "{text}"
        );
        assert!(
            text.contains("strata_rollout_decisions_total{action=\"promote\"} 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_crashing_canary_is_rolled_back_through_the_router() {
        let (mut r, router, healthy, _, _) = runner(fast());
        assert_eq!(r.tick().await.action, Action::Advance { weight: 25 });
        *healthy.lock().unwrap() = false;
        let d = r.tick().await;
        assert_eq!(d.action, Action::Rollback);
        assert_eq!(*router.splits.lock().unwrap(), vec![5, 25, 0]);
        assert_eq!(r.state().phase, Phase::RolledBack);
        assert_eq!(r.history.len(), 3);
    }

    #[tokio::test]
    async fn the_evaluation_command_gates_promotion() {
        let cfg = RolloutConfig {
            evaluation: Some(EvaluationConfig {
                command: vec![
                    "sh".into(),
                    "-c".into(),
                    "test {canary} = new && exit 3".into(),
                ],
                timeout_secs: 10.0,
            }),
            ..fast()
        };
        let (mut r, router, _, _, _) = runner(cfg);
        let d = r.tick().await;
        assert_eq!(d.action, Action::Rollback, "{d}");
        assert!(d.reason.contains("exit code 3"), "{d}");
        assert_eq!(*router.splits.lock().unwrap(), vec![5, 0]);

        let pass = EvaluationConfig {
            command: vec!["sh".into(), "-c".into(), "test {baseline} = old".into()],
            timeout_secs: 10.0,
        };
        assert_eq!(
            run_evaluation(&pass, "new", "old").await,
            Evaluation::Passed
        );
        let slow = EvaluationConfig {
            command: vec!["sleep".into(), "5".into()],
            timeout_secs: 0.2,
        };
        assert!(
            matches!(run_evaluation(&slow, "new", "old").await, Evaluation::Failed { detail } if detail.contains("timed out"))
        );
        let missing = EvaluationConfig {
            command: vec!["/nonexistent/eval".into()],
            timeout_secs: 1.0,
        };
        assert!(matches!(
            run_evaluation(&missing, "a", "b").await,
            Evaluation::Failed { .. }
        ));
    }

    #[tokio::test]
    async fn a_refused_split_holds_the_rollout() {
        let (mut r, router, _, _, _) = runner(fast());
        *router.refuse.lock().unwrap() = true;
        let d = r.tick().await;
        assert_eq!(d.action, Action::Wait);
        assert!(d.reason.contains("refused"));
        assert_eq!(r.state().weight, 5);
        *router.refuse.lock().unwrap() = false;
        assert_eq!(r.tick().await.action, Action::Advance { weight: 25 });
        // Operator commands.
        let d = r.rollback().unwrap();
        assert_eq!(d.action, Action::Rollback);
        assert_eq!(router.splits.lock().unwrap().last(), Some(&0));
    }
}
