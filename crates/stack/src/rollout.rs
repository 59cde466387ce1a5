//! Canary rollouts in `strata up`: the API under `/controller/rollout/` (wire types and
//! client in `strata_controller::rollout_client`) and the task that runs one.
//!
//! Starting a rollout starts canary replicas of the new version (a second local driver in
//! the [`Fleet`], serving the public model name, endpoint group = the version), and a
//! [`RolloutRunner`] that moves the router's split step by step ([`RouterSplitter`]) and
//! judges each step on what both versions served at the front ([`FrontStats`]). One
//! rollout at a time. Promotion ends with 100 % on the new version, and only then are the
//! old version's replicas drained and stopped; the controller scales the new version
//! from then on. Rollback is a split change to 0 % followed by stopping the canary; the
//! baseline never stopped serving. Every decision with its evidence is kept and served by
//! `GET /controller/rollout/status`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use strata_api::error::ApiError;
use strata_controller::driver::local::{LocalDriver, LocalDriverConfig};
use strata_controller::metrics::ControllerMetrics;
use strata_controller::rollout::{Action, Phase, RolloutConfig, VersionStats};
use strata_controller::rollout_client::{
    ReplicaSummary, RolloutStatusResponse, RolloutView, StartRollout,
};
use strata_controller::rollout_runner::{RolloutRunner, StepStats, TrafficSplitter};
use strata_router::{Router, TrafficSplit};
use tokio::sync::{mpsc, oneshot};

use crate::fleet::{Fleet, GroupMap, Member, RouterRegistrar};
use crate::front::VersionStatsBook;

/// Sets the router's split between two versions (endpoint groups).
pub struct RouterSplitter(pub Router);

impl TrafficSplitter for RouterSplitter {
    fn set_split(&self, baseline: &str, canary: &str, canary_percent: u8) -> Result<(), String> {
        let pct = f64::from(canary_percent.min(100));
        self.0.set_split(TrafficSplit(BTreeMap::from([
            (baseline.to_string(), 100.0 - pct),
            (canary.to_string(), pct),
        ])));
        Ok(())
    }
}

/// Step statistics from the front layer; health from the canary's driver.
pub struct FrontStats {
    book: Arc<VersionStatsBook>,
    fleet: Fleet,
}

impl StepStats for FrontStats {
    fn reset(&mut self) {
        self.book.reset();
    }

    async fn stats(&mut self, model: &str) -> VersionStats {
        self.book.stats(model)
    }

    /// Healthy while no canary replica has crashed or failed to become ready (one that is
    /// still starting counts as healthy: the split sends it nothing until it is ready).
    async fn healthy(&mut self, _model: &str) -> bool {
        self.fleet.canary_health().await.faults == 0
    }
}

/// What `strata up` passes to build canary replicas.
#[derive(Clone)]
pub struct CanaryTemplate {
    /// The stack's engine command line, with `{model}` for the version.
    pub args: Vec<String>,
    pub base: LocalDriverConfig,
    pub served_model: String,
    pub canary_replicas: u32,
    pub log_dir: Option<PathBuf>,
    /// Replicas are mock engines: no model to pull.
    pub mock: bool,
    /// The pool's LoRA adapters (the canary's command line loads them too).
    pub adapters: Vec<String>,
}

enum Op {
    Promote(oneshot::Sender<Result<(), String>>),
    Rollback(oneshot::Sender<Result<(), String>>),
}

struct Record {
    view: RolloutView,
    ops: Option<mpsc::Sender<Op>>,
}

struct Shared {
    fleet: Fleet,
    router: Router,
    book: Arc<VersionStatsBook>,
    groups: GroupMap,
    held: Arc<std::sync::atomic::AtomicU32>,
    metrics: Arc<ControllerMetrics>,
    cfg: RolloutConfig,
    template: CanaryTemplate,
    interval: Duration,
    current: Mutex<Option<Record>>,
    /// Serialises starts, so two at once cannot both pass the "none running" check.
    starting: tokio::sync::Mutex<()>,
}

/// The rollout service of one `strata up`.
#[derive(Clone)]
pub struct Rollouts {
    shared: Arc<Shared>,
}

fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        e.to_json_string(),
    )
        .into_response()
}

fn conflict(message: impl Into<String>, code: &str) -> ApiError {
    let mut e = ApiError::invalid_no_param(message).with_code(code);
    e.status = 409;
    e
}

/// What the rollout service works with: the stack's pieces it reads and changes.
pub struct RolloutParts {
    /// The replicas of the pool a rollout replaces the version of.
    pub fleet: Fleet,
    pub router: Router,
    /// Per-version statistics from the front.
    pub book: Arc<VersionStatsBook>,
    pub groups: GroupMap,
    /// The pool's held requests (canary replicas register against it too).
    pub held: Arc<std::sync::atomic::AtomicU32>,
    pub metrics: Arc<ControllerMetrics>,
    pub cfg: RolloutConfig,
    pub template: CanaryTemplate,
    /// Between two analyses of a step.
    pub interval: Duration,
}

impl Rollouts {
    pub fn new(parts: RolloutParts) -> Rollouts {
        let RolloutParts {
            fleet,
            router,
            book,
            groups,
            held,
            metrics,
            cfg,
            template,
            interval,
        } = parts;
        Rollouts {
            shared: Arc::new(Shared {
                fleet,
                router,
                book,
                groups,
                held,
                metrics,
                cfg,
                template,
                interval,
                current: Mutex::new(None),
                starting: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// `/start`, `/status`, `/promote`, `/rollback` (nest under `/controller/rollout`).
    pub fn routes(&self) -> axum::Router {
        axum::Router::new()
            .route("/start", post(start))
            .route("/status", get(status))
            .route("/promote", post(promote))
            .route("/rollback", post(rollback))
            .with_state(self.clone())
    }

    /// The current (or last) rollout.
    pub fn view(&self) -> Option<RolloutView> {
        self.shared
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|r| r.view.clone())
    }
}

fn refresh(view: &mut RolloutView, shared: &Shared) {
    view.split = shared.router.split().0;
    view.unattributed_errors = shared.book.unattributed_errors();
}

/// Checks a start request against the stack; the error says what is wrong.
async fn validate(shared: &Shared, req: &StartRollout) -> Result<RolloutConfig, ApiError> {
    if req.model.trim().is_empty() {
        return Err(ApiError::invalid(
            "model",
            "`model` must name the new version.",
        ));
    }
    let serving = shared.fleet.primary_version().await;
    if req.baseline != serving {
        return Err(ApiError::invalid(
            "baseline",
            format!(
                "Unknown baseline `{}`: this stack serves `{serving}`.",
                req.baseline
            ),
        )
        .with_code("unknown_baseline"));
    }
    if req.model == req.baseline {
        return Err(ApiError::invalid(
            "model",
            "The new version must differ from the baseline.",
        ));
    }
    let mut cfg = shared.cfg.clone();
    if let Some(steps) = &req.steps {
        cfg.steps = steps.clone();
    }
    cfg.validate()
        .map_err(|e| ApiError::invalid("steps", e.to_string()))?;
    if let Some(n) = req.replicas {
        if !(1..=16).contains(&n) {
            return Err(ApiError::invalid("replicas", "`replicas` must be 1..=16."));
        }
    }
    Ok(cfg)
}

async fn start(State(r): State<Rollouts>, body: axum::body::Bytes) -> Response {
    match begin(r.shared.clone(), &body).await {
        Ok(view) => Json(view).into_response(),
        Err(e) => error(e),
    }
}

/// Starts a rollout: the request checked, the new version pulled, its canary replicas
/// started, then the runner that moves the split, recorded as the current rollout and
/// driven by a task of its own. Starts are serialised from the "none running" check on.
async fn begin(shared: Arc<Shared>, body: &[u8]) -> Result<RolloutView, ApiError> {
    let req: StartRollout = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_no_param(format!("Bad request body: {e}")))?;
    let _one = shared.starting.lock().await;
    none_in_progress(&shared)?;
    let cfg = validate(&shared, &req).await?;
    pull_canary(&shared.template, &req.model).await?;
    let id = {
        let cur = shared.current.lock().unwrap_or_else(|e| e.into_inner());
        cur.as_ref().map_or(1, |c| c.view.id + 1)
    };
    let driver = canary_driver(&shared, &req, id)?;
    let replicas = req.replicas.unwrap_or(shared.template.canary_replicas);
    shared
        .fleet
        .start_canary(Member::new(req.model.clone(), driver), replicas)
        .await
        .map_err(|e| conflict(e, "rollout_in_progress"))?;
    let runner = start_runner(&shared, &cfg, &req).await?;
    tracing::info!(canary = %req.model, baseline = %req.baseline, steps = ?cfg.steps, replicas, "rollout started");
    let (view, ops) = record_started(&shared, id, &req, &cfg, &runner);
    tokio::spawn(drive(shared.clone(), runner, ops));
    Ok(view)
}

/// One rollout at a time: a conflict while another is progressing.
fn none_in_progress(shared: &Shared) -> Result<(), ApiError> {
    let in_progress = shared
        .current
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .filter(|c| c.view.state.phase == Phase::Progressing)
        .map(|c| (c.view.baseline.clone(), c.view.canary.clone()));
    match in_progress {
        Some((b, c)) => Err(conflict(
            format!("A rollout from `{b}` to `{c}` is in progress; promote or roll it back first."),
            "rollout_in_progress",
        )),
        None => Ok(()),
    }
}

/// The new version on this machine before any canary replica needs it (mock engines
/// load none); a model that cannot be had is the client's error.
async fn pull_canary(template: &CanaryTemplate, model: &str) -> Result<(), ApiError> {
    if template.mock {
        return Ok(());
    }
    let name = model.to_string();
    match tokio::task::spawn_blocking(move || crate::pull::pull_model(&name)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(
            ApiError::invalid("model", format!("Cannot get `{model}`: {e}"))
                .with_code("model_not_found"),
        ),
        Err(e) => Err(ApiError::internal(format!("model pull task: {e}"))),
    }
}

/// The canary's driver: the stack's engine command line for the new version (plus the
/// request's engine flags), logging apart under `rollout-<id>`, registering its replicas
/// with the router under the served name and the version's endpoint group.
fn canary_driver(shared: &Shared, req: &StartRollout, id: u64) -> Result<LocalDriver, ApiError> {
    let t = &shared.template;
    let mut dcfg = t.base.clone();
    dcfg.model = req.model.clone();
    dcfg.args = t.args.clone();
    dcfg.args.extend(req.engine_args.iter().cloned());
    if let Some(dir) = &t.log_dir {
        let dir = dir.join(format!("rollout-{id}"));
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("{}: {e}", dir.display())))?;
        dcfg.log_dir = Some(dir);
    }
    let registrar = Arc::new(
        RouterRegistrar::new(
            shared.router.clone(),
            t.served_model.clone(),
            req.model.clone(),
            shared.groups.clone(),
            shared.held.clone(),
        )
        .with_adapters(t.adapters.clone()),
    );
    LocalDriver::new(dcfg, registrar).map_err(|e| ApiError::internal(e.to_string()))
}

/// The runner that moves the router's split; when the router refuses the first split the
/// canary replicas just started are stopped again.
async fn start_runner(
    shared: &Shared,
    cfg: &RolloutConfig,
    req: &StartRollout,
) -> Result<RolloutRunner<FrontStats>, ApiError> {
    let stats = FrontStats {
        book: shared.book.clone(),
        fleet: shared.fleet.clone(),
    };
    let started = RolloutRunner::start(
        cfg.clone(),
        req.model.clone(),
        req.baseline.clone(),
        Arc::new(RouterSplitter(shared.router.clone())),
        stats,
        shared.metrics.clone(),
    );
    match started {
        Ok(r) => Ok(r),
        Err(e) => {
            shared.fleet.drop_canary().await;
            Err(ApiError::internal(format!(
                "the router refused the split: {e}"
            )))
        }
    }
}

/// The new rollout's view, recorded as the current rollout with the channel operators'
/// commands reach its task through; returns the view and that channel's receiving end.
fn record_started(
    shared: &Shared,
    id: u64,
    req: &StartRollout,
    cfg: &RolloutConfig,
    runner: &RolloutRunner<FrontStats>,
) -> (RolloutView, mpsc::Receiver<Op>) {
    let (tx, rx) = mpsc::channel(4);
    let mut view = RolloutView {
        id,
        canary: req.model.clone(),
        baseline: req.baseline.clone(),
        served_model: shared.template.served_model.clone(),
        steps: cfg.steps.clone(),
        state: runner.state().clone(),
        split: BTreeMap::new(),
        canary_replicas: Vec::new(),
        canary_faults: 0,
        unattributed_errors: 0,
        decisions: runner
            .history
            .iter()
            .filter_map(|d| serde_json::to_value(d).ok())
            .collect(),
    };
    refresh(&mut view, shared);
    *shared.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(Record {
        view: view.clone(),
        ops: Some(tx),
    });
    (view, rx)
}

/// Ticks the runner until the rollout ends, applying operators' commands in between.
async fn drive(
    shared: Arc<Shared>,
    mut runner: RolloutRunner<FrontStats>,
    mut ops: mpsc::Receiver<Op>,
) {
    let mut ticker = tokio::time::interval(shared.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        let outcome = tokio::select! {
            _ = ticker.tick() => {
                let d = runner.tick().await;
                Ok(d.action)
            }
            op = ops.recv() => match op {
                Some(Op::Promote(reply)) => {
                    let r = runner.promote();
                    let action = r.as_ref().map(|d| d.action).map_err(Clone::clone);
                    let _ = reply.send(r.map(|_| ()));
                    action
                }
                Some(Op::Rollback(reply)) => {
                    let r = runner.rollback();
                    let action = r.as_ref().map(|d| d.action).map_err(Clone::clone);
                    let _ = reply.send(r.map(|_| ()));
                    action
                }
                None => return,
            },
        };
        let action = match outcome {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "rollout command failed");
                Action::Wait
            }
        };
        // The canary's faults, read before a promotion or rollback takes it away.
        let before = shared.fleet.canary_health().await;
        match action {
            Action::Promote => {
                if let Err(e) = shared.fleet.promote().await {
                    tracing::warn!(error = %e, "promotion found no canary");
                }
            }
            Action::Rollback => shared.fleet.drop_canary().await,
            _ => {}
        }
        let after = shared.fleet.canary_health().await;
        let done = matches!(runner.state().phase, Phase::Promoted | Phase::RolledBack);
        {
            let mut cur = shared.current.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(rec) = cur.as_mut() {
                rec.view.state = runner.state().clone();
                rec.view.decisions = runner
                    .history
                    .iter()
                    .filter_map(|d| serde_json::to_value(d).ok())
                    .collect();
                rec.view.canary_faults = rec.view.canary_faults.max(before.faults);
                rec.view.canary_replicas =
                    after.replicas.iter().map(ReplicaSummary::from).collect();
                refresh(&mut rec.view, &shared);
                if done {
                    rec.ops = None;
                }
            }
        }
        if done {
            return;
        }
    }
}

async fn status(State(r): State<Rollouts>) -> Response {
    let mut view = r.view();
    if let Some(v) = view.as_mut() {
        refresh(v, &r.shared);
        if v.state.phase == Phase::Progressing {
            let h = r.shared.fleet.canary_health().await;
            v.canary_replicas = h.replicas.iter().map(ReplicaSummary::from).collect();
            v.canary_faults = v.canary_faults.max(h.faults);
        }
    }
    Json(RolloutStatusResponse { rollout: view }).into_response()
}

async fn command(r: Rollouts, promote: bool) -> Response {
    let ops = r
        .shared
        .current
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|c| c.ops.clone());
    let Some(ops) = ops else {
        return error(conflict("No rollout is in progress.", "no_rollout"));
    };
    if promote && r.shared.fleet.canary_health().await.ready == 0 {
        return error(conflict(
            "The canary has no ready replica yet; promoting now would leave nothing serving.",
            "canary_not_ready",
        ));
    }
    let (tx, rx) = oneshot::channel();
    let op = if promote {
        Op::Promote(tx)
    } else {
        Op::Rollback(tx)
    };
    if ops.send(op).await.is_err() {
        return error(conflict("No rollout is in progress.", "no_rollout"));
    }
    match rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return error(conflict(e, "rollout_refused")),
        Err(_) => return error(conflict("The rollout ended first.", "no_rollout")),
    }
    // The task updates the view right after it answers; wait for that.
    for _ in 0..100 {
        if let Some(v) = r.view() {
            if v.state.phase != Phase::Progressing {
                return Json(v).into_response();
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    match r.view() {
        Some(v) => Json(v).into_response(),
        None => error(ApiError::internal("The rollout vanished.")),
    }
}

async fn promote(State(r): State<Rollouts>) -> Response {
    command(r, true).await
}

async fn rollback(State(r): State<Rollouts>) -> Response {
    command(r, false).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use strata_controller::driver::NoRegistrar;
    use strata_router::RouterConfig;

    /// The API over a fleet whose replicas are never started (nothing reconciles it).
    async fn serve() -> String {
        let base = LocalDriverConfig {
            command: Some("sleep".into()),
            args: vec!["30".into()],
            ..LocalDriverConfig::default()
        };
        let primary = LocalDriver::new(base.clone(), Arc::new(NoRegistrar)).unwrap();
        let fleet = Fleet::new(Member::new("old".into(), primary));
        let router = Router::new(RouterConfig::default()).unwrap();
        let r = Rollouts::new(RolloutParts {
            fleet,
            router,
            book: Arc::default(),
            groups: GroupMap::default(),
            held: Arc::new(AtomicU32::new(0)),
            metrics: Arc::new(ControllerMetrics::new()),
            cfg: RolloutConfig::default(),
            template: CanaryTemplate {
                args: base.args.clone(),
                base,
                served_model: "m".into(),
                canary_replicas: 1,
                log_dir: None,
                mock: true,
                adapters: Vec::new(),
            },
            interval: Duration::from_millis(20),
        });
        let app = axum::Router::new().nest("/controller/rollout", r.routes());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        format!("http://{addr}/controller/rollout")
    }

    async fn call(
        c: &reqwest::Client,
        method: &str,
        url: String,
        body: &str,
    ) -> (u16, serde_json::Value) {
        let req = if method == "GET" {
            c.get(url)
        } else {
            c.post(url).body(body.to_string())
        };
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    #[tokio::test]
    async fn one_rollout_at_a_time_and_no_promotion_without_a_ready_canary() {
        let base = serve().await;
        let c = reqwest::Client::new();
        let (s, v) = call(&c, "GET", format!("{base}/status"), "").await;
        assert_eq!((s, v["rollout"].is_null()), (200, true));
        let (s, v) = call(&c, "POST", format!("{base}/rollback"), "").await;
        assert_eq!(s, 409, "{v}");
        assert_eq!(v["error"]["code"], "no_rollout");

        let start = r#"{"model":"new","baseline":"old","steps":[10,100]}"#;
        let (s, v) = call(&c, "POST", format!("{base}/start"), start).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["state"]["weight"], 10);
        assert_eq!(v["split"]["new"], 10.0);
        assert_eq!(v["split"]["old"], 90.0);
        let other = r#"{"model":"newer","baseline":"old"}"#;
        let (s, v) = call(&c, "POST", format!("{base}/start"), other).await;
        assert_eq!(s, 409, "{v}");
        assert_eq!(v["error"]["code"], "rollout_in_progress");

        // The canary never became ready: promoting would leave nothing serving.
        let (s, v) = call(&c, "POST", format!("{base}/promote"), "").await;
        assert_eq!(s, 409, "{v}");
        assert_eq!(v["error"]["code"], "canary_not_ready");

        let (s, v) = call(&c, "POST", format!("{base}/rollback"), "").await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["state"]["phase"], "rolled_back");
        assert_eq!(v["split"]["new"], 0.0);
        let (s, v) = call(&c, "GET", format!("{base}/status"), "").await;
        assert_eq!(s, 200);
        assert_eq!(v["rollout"]["state"]["phase"], "rolled_back");
        let actions: Vec<&str> = v["rollout"]["decisions"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|d| d["action"]["action"].as_str())
            .collect();
        assert_eq!(actions.first(), Some(&"advance"));
        assert_eq!(actions.last(), Some(&"rollback"));
        // Finished: a new rollout may start; promote has nothing to act on.
        let (s, v) = call(&c, "POST", format!("{base}/promote"), "").await;
        assert_eq!(s, 409, "{v}");
        let (s, v) = call(&c, "POST", format!("{base}/start"), other).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["id"], 2);
    }
}
