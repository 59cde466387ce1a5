//! The rollout API on Kubernetes (`strata rollout --url http://<controller>:9400 ...`): the
//! same routes and wire types `strata up` serves ([`crate::rollout_client`]), over a
//! canary that is already deployed as a pool of its own. Starting a rollout moves traffic
//! from the baseline pool to the canary pool through the HTTPRoute's weights
//! ([`HttpRouteSplitter`]), step by step as the analysis of each version's pods
//! ([`PodMetricsStats`]) allows; promotion and rollback are weight changes too.
//!
//! `kubernetesRollout:` in controller.yaml names the route and, for every pool a rollout
//! may name, its pods' label selector; `start`'s `model` is the canary pool, `baseline`
//! the pool serving now.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use strata_api::error::ApiError;

use crate::config::KubernetesRolloutConfig;
use crate::driver::kubernetes_rollout::{HttpRouteSplitter, PodMetricsStats};
use crate::metrics::ControllerMetrics;
use crate::rollout::{Phase, RolloutConfig};
use crate::rollout_client::{RolloutStatusResponse, RolloutView, StartRollout};
use crate::rollout_runner::{RolloutRunner, TrafficSplitter};

/// What the API needs to run rollouts.
pub struct RolloutParts {
    pub client: kube::Client,
    pub namespace: String,
    pub cfg: KubernetesRolloutConfig,
    pub rollout: RolloutConfig,
    /// Port and scheme of the pods' `/metrics`, and the client that reads them.
    pub port: u16,
    pub https: bool,
    pub http: reqwest::Client,
    pub interval: Duration,
    pub timeout: Duration,
    pub metrics: Arc<ControllerMetrics>,
}

struct Current {
    id: u64,
    canary: String,
    baseline: String,
    steps: Vec<u8>,
    runner: RolloutRunner<PodMetricsStats>,
}

#[derive(Clone)]
struct Api {
    parts: Arc<RolloutParts>,
    current: Arc<tokio::sync::Mutex<Option<Current>>>,
    last_id: Arc<Mutex<u64>>,
}

/// The routes, to nest at `/controller/rollout`.
pub fn routes(parts: RolloutParts) -> axum::Router {
    let api = Api {
        parts: Arc::new(parts),
        current: Arc::new(tokio::sync::Mutex::new(None)),
        last_id: Arc::new(Mutex::new(0)),
    };
    axum::Router::new()
        .route("/start", post(start))
        .route("/status", get(status))
        .route("/promote", post(promote))
        .route("/rollback", post(rollback))
        .with_state(api)
}

/// An OpenAI-shaped error with `status` and `code`.
fn error(status: StatusCode, code: &str, message: String) -> Response {
    let mut e = ApiError::invalid_no_param(message).with_code(code);
    e.status = status.as_u16();
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        e.to_json_string(),
    )
        .into_response()
}

fn view(c: &Current) -> RolloutView {
    let state = c.runner.state().clone();
    let w = f64::from(state.weight);
    RolloutView {
        id: c.id,
        split: BTreeMap::from([(c.baseline.clone(), 100.0 - w), (c.canary.clone(), w)]),
        served_model: c.baseline.clone(),
        steps: c.steps.clone(),
        state,
        canary: c.canary.clone(),
        baseline: c.baseline.clone(),
        canary_replicas: Vec::new(),
        canary_faults: 0,
        unattributed_errors: 0,
        decisions: c
            .runner
            .history
            .iter()
            .filter_map(|d| serde_json::to_value(d).ok())
            .collect(),
    }
}

async fn start(State(api): State<Api>, body: axum::body::Bytes) -> Response {
    let req: StartRollout = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()),
    };
    let p = &api.parts;
    if req.replicas.is_some() || !req.engine_args.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "unsupported_field",
            "replicas and engine_args: on Kubernetes the canary is a deployed pool of its own; scale and configure its workload".into(),
        );
    }
    if req.model == req.baseline {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "model and baseline name the same pool".into(),
        );
    }
    for (field, pool) in [("model", &req.model), ("baseline", &req.baseline)] {
        if !p.cfg.pools.contains_key(pool) {
            return error(
                StatusCode::BAD_REQUEST,
                "unknown_pool",
                format!("{field}: `{pool}` is not in kubernetesRollout.pools"),
            );
        }
    }
    let mut rollout = p.rollout.clone();
    if let Some(steps) = req.steps.clone() {
        rollout.steps = steps;
    }
    if let Err(e) = rollout.validate() {
        return error(StatusCode::BAD_REQUEST, "invalid_steps", e.to_string());
    }
    let mut current = api.current.lock().await;
    if current
        .as_ref()
        .is_some_and(|c| c.runner.state().phase == Phase::Progressing)
    {
        return error(
            StatusCode::CONFLICT,
            "rollout_in_progress",
            "a rollout is in progress".into(),
        );
    }
    let splitter: Arc<dyn TrafficSplitter> = Arc::new(HttpRouteSplitter::spawn(
        p.client.clone(),
        &p.namespace,
        &p.cfg.route,
        p.timeout,
    ));
    let stats = PodMetricsStats::new(
        p.client.clone(),
        &p.namespace,
        p.cfg.pools.clone(),
        p.port,
        p.https,
        p.http.clone(),
        p.timeout,
    );
    let steps = rollout.steps.clone();
    let runner = match RolloutRunner::start(
        rollout,
        req.model.clone(),
        req.baseline.clone(),
        splitter,
        stats,
        p.metrics.clone(),
    ) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request", e),
    };
    let id = {
        let mut last = api.last_id.lock().unwrap_or_else(|e| e.into_inner());
        *last += 1;
        *last
    };
    let c = Current {
        id,
        canary: req.model.clone(),
        baseline: req.baseline.clone(),
        steps,
        runner,
    };
    let v = view(&c);
    *current = Some(c);
    drop(current);
    tokio::spawn(drive(api.clone(), id));
    Json(v).into_response()
}

/// Ticks rollout `id` every interval until it ends or another replaces it.
async fn drive(api: Api, id: u64) {
    loop {
        tokio::time::sleep(api.parts.interval).await;
        let mut current = api.current.lock().await;
        let Some(c) = current.as_mut().filter(|c| c.id == id) else {
            return;
        };
        if c.runner.state().phase != Phase::Progressing {
            return;
        }
        c.runner.tick().await;
    }
}

async fn status(State(api): State<Api>) -> Response {
    let current = api.current.lock().await;
    Json(RolloutStatusResponse {
        rollout: current.as_ref().map(view),
    })
    .into_response()
}

async fn operator(api: Api, promote: bool) -> Response {
    let mut current = api.current.lock().await;
    let Some(c) = current
        .as_mut()
        .filter(|c| c.runner.state().phase == Phase::Progressing)
    else {
        return error(
            StatusCode::CONFLICT,
            "no_rollout",
            "no rollout is in progress".into(),
        );
    };
    let done = if promote {
        c.runner.promote()
    } else {
        c.runner.rollback()
    };
    match done {
        Ok(_) => Json(view(c)).into_response(),
        Err(e) => error(StatusCode::BAD_GATEWAY, "route_refused", e),
    }
}

async fn promote(State(api): State<Api>) -> Response {
    operator(api, true).await
}

async fn rollback(State(api): State<Api>) -> Response {
    operator(api, false).await
}
