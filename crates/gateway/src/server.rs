//! The HTTP surface: OpenAI routes and vLLM's others ([`Route::ALL`], proxied), Anthropic's
//! Messages API ([`crate::anthropic`]) and OpenAI's Responses API ([`crate::responses`]), `/v1/models`, `/health`, `/metrics` (tenant
//! series only with the metrics key, or on `metrics.listen`), the admin API under `/admin`
//! ([`crate::admin`], by role), and serving: the edge bounds from `server:`, the metrics
//! listener, config watching and the JWKS refresh.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde_json::{json, Value};
use strata_api::ApiError;

use crate::admin;
use crate::anthropic;
use crate::keys;
use crate::proxy::{self, error_response, Route};
use crate::responses;
use crate::state::Gateway;

type Gw = State<Arc<Gateway>>;

/// The gateway's axum router.
pub fn router(gw: Arc<Gateway>) -> Router {
    let mut app = Router::new();
    for route in Route::ALL {
        app = app.route(route.path(), forwarded(route));
    }
    app.route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::get))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/keys", post(admin::create_key).get(admin::list_keys))
        .route(
            "/admin/keys/{id}",
            put(admin::update_key).delete(admin::revoke_key),
        )
        .route("/admin/tenants", get(admin::list_tenants))
        .route("/admin/tenants/{name}", put(admin::put_tenant))
        .route("/admin/tenants/{name}/users", get(admin::list_users))
        .route("/admin/tenants/{name}/users/{user}", put(admin::put_user))
        .route("/admin/usage", get(admin::usage))
        .route("/admin/audit", get(admin::audit))
        .route("/admin/reload", post(admin::reload))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(gw)
}

/// A `POST` route through the proxy's stages (auth, limits, budgets, usage).
fn forwarded(route: Route) -> axum::routing::MethodRouter<Arc<Gateway>> {
    post(move |State(gw): Gw, req: Request| proxy::handle(gw, route, req))
}

async fn not_found(req: Request) -> Response {
    error_response(&ApiError::not_found(format!(
        "No route {} {}.",
        req.method(),
        req.uri().path()
    )))
}

async fn method_not_allowed(req: Request) -> Response {
    let mut resp = error_response(&ApiError::invalid_no_param(format!(
        "Method {} is not allowed on {}.",
        req.method(),
        req.uri().path()
    )));
    *resp.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    resp
}

async fn health() -> &'static str {
    "ok"
}

/// `/metrics`: every series for a caller with the metrics key, else only the series
/// that name no tenant. A wrong key is a 401 (a scraper misconfigured should hear so).
async fn metrics(State(gw): Gw, headers: HeaderMap) -> Response {
    let resolved = gw.config.get();
    let full = match (&resolved.metrics_key, keys::from_headers(&headers)) {
        (Some(expected), Some(presented)) => {
            if !keys::admin_matches(presented, expected) {
                gw.metrics.reject("metrics_auth");
                return error_response(
                    &ApiError::unauthorized("Wrong metrics key.").with_code("invalid_api_key"),
                );
            }
            true
        }
        _ => false,
    };
    metrics_page(if full {
        gw.metrics.render()
    } else {
        gw.metrics.render_public()
    })
}

fn metrics_page(text: String) -> Response {
    let mut resp = Response::new(Body::from(text));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

/// The `metrics.listen` listener's app: the whole `/metrics`, nothing else.
fn metrics_router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(gw): Gw| async move { metrics_page(gw.metrics.render()) }),
        )
        .fallback(not_found)
        .with_state(gw)
}

async fn models(State(gw): Gw, headers: HeaderMap) -> Response {
    let key = match proxy::authenticate(&gw, &headers).await {
        Ok(c) => c.key,
        Err(e) => return error_response(&e),
    };
    let resolved = gw.config.get();
    let allowed = |name: &str| {
        let canonical = resolved.model(name).map_or(name, |m| m.name.as_str());
        let ok = |l: &[String]| l.is_empty() || l.iter().any(|m| m == name || m == canonical);
        ok(&key.record.allowed_models)
            && resolved
                .tenants
                .get(&key.record.tenant)
                .is_none_or(|t| ok(&t.allowed_models))
    };
    let data: Vec<Value> = resolved
        .model_names()
        .into_iter()
        .filter(|n| allowed(n))
        .map(|id| {
            let ctx = resolved.model(&id).and_then(|m| m.context_length);
            json!({"id": id, "object": "model", "created": 0, "owned_by": "strata", "max_model_len": ctx})
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// A gateway serving on a bound address, with a handle to stop it.
pub struct RunningGateway {
    pub addr: SocketAddr,
    /// The `metrics.listen` listener's bound address, when configured.
    pub metrics_addr: Option<SocketAddr>,
    pub gateway: Arc<Gateway>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningGateway {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, waits for the server task and flushes the ledger.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
        self.gateway.flush_usage();
    }
}

/// Binds `addr` and serves in a background task (also reloading the config on change).
pub async fn spawn(gw: Arc<Gateway>, addr: SocketAddr) -> std::io::Result<RunningGateway> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(gw.clone());
    // Registered here, before returning, so a SIGHUP sent once `spawn` has returned is
    // always handled (never the default action, which would end the process).
    let hangup = hangup_signal();
    let watcher = tokio::spawn(watch_config(gw.clone(), hangup));
    // Other replicas' semantic-cache entries, while serving (when shared through Redis).
    let follower = gw.semantic_share.is_some().then(|| {
        let gw = gw.clone();
        tokio::spawn(async move {
            if let (Some(share), Some(index)) = (&gw.semantic_share, &gw.semantic) {
                crate::semantic_share::follow(share, index, &gw.metrics).await;
            }
        })
    });
    // The edge server bounds connections, heads and bodies (`server:` in gateway.yaml),
    // and sends answers as soon as they are written (TCP_NODELAY: no delay between the
    // chunks of a stream).
    let limits = gw.config.get().config.server.edge_limits();
    let metrics_listener = match gw.config.get().config.metrics.listen.clone() {
        Some(a) => Some(tokio::net::TcpListener::bind(&a).await?),
        None => None,
    };
    let metrics_addr = metrics_listener
        .as_ref()
        .map(tokio::net::TcpListener::local_addr)
        .transpose()?;
    let (side_tx, side_rx) = tokio::sync::watch::channel(false);
    let side = spawn_side_tasks(&gw, metrics_listener, limits.clone(), side_rx);
    let task = tokio::spawn(async move {
        let serve = strata_api::edge::serve(listener, app, limits, async move {
            let _ = rx.await;
        });
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "gateway server failed");
        }
        watcher.abort();
        if let Some(f) = follower {
            f.abort();
        }
        let _ = side_tx.send(true);
        for t in side {
            let _ = t.await;
        }
    });
    Ok(RunningGateway {
        addr,
        metrics_addr,
        gateway: gw,
        shutdown: Some(tx),
        task,
    })
}

/// The tasks that live as long as the server: the `metrics.listen` listener and the JWKS
/// refresh; both stop when `stop` turns true.
fn spawn_side_tasks(
    gw: &Arc<Gateway>,
    metrics_listener: Option<tokio::net::TcpListener>,
    limits: strata_api::edge::EdgeLimits,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    if let Some(listener) = metrics_listener {
        let app = metrics_router(gw.clone());
        let mut stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let done = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            if let Err(e) = strata_api::edge::serve(listener, app, limits, done).await {
                tracing::error!(error = %e, "metrics listener failed");
            }
        }));
    }
    if let Some(every) = gw.jwt.as_ref().and_then(|j| j.refresh_every()) {
        let gw = gw.clone();
        let mut stop = stop;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                let stopped = tokio::select! {
                    _ = tick.tick() => false,
                    _ = stop.changed() => true,
                };
                if stopped || *stop.borrow() {
                    break;
                }
                if let Some(j) = &gw.jwt {
                    if let Err(e) = j.refresh().await {
                        tracing::warn!(error = %e, "JWKS refresh failed; keeping the keys held");
                    }
                }
            }
        }));
    }
    tasks
}

/// Reloads the config on SIGHUP and when the file's mtime changes; refreshes keys from the
/// store periodically (changes written by another process).
#[cfg(unix)]
type Hangup = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangup = ();

#[cfg(unix)]
fn hangup_signal() -> Hangup {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok()
}
#[cfg(not(unix))]
fn hangup_signal() -> Hangup {}

#[cfg(unix)]
async fn next_hangup(h: &mut Hangup) {
    match h.as_mut() {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}
#[cfg(not(unix))]
async fn next_hangup(_: &mut Hangup) {
    std::future::pending::<()>().await
}

async fn watch_config(gw: Arc<Gateway>, mut hup: Hangup) {
    let every =
        std::time::Duration::from_secs(gw.config.get().config.server.key_refresh_secs.max(1));
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut since_refresh = std::time::Duration::ZERO;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Some(res) = gw.config.reload_if_changed() {
                    log_reload(&gw, res, "file change");
                }
                since_refresh += std::time::Duration::from_secs(1);
                if since_refresh >= every {
                    since_refresh = std::time::Duration::ZERO;
                    let g = gw.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        if let Err(e) = g.refresh_from_store() {
                            tracing::warn!(error = %e, "key refresh failed");
                        }
                    }).await;
                }
            }
            _ = next_hangup(&mut hup) => {
                let res = gw.config.reload();
                log_reload(&gw, res, "SIGHUP");
            }
        }
    }
}

fn log_reload(gw: &Gateway, res: Result<(), crate::config::ConfigError>, why: &str) {
    match res {
        Ok(()) => {
            tracing::info!(trigger = why, "gateway config reloaded");
            gw.audit("system", "reload", "config", why);
        }
        Err(e) => {
            tracing::error!(trigger = why, error = %e, "gateway config rejected; keeping the previous one")
        }
    }
}
