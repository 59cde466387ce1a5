//! The HTTP surface: OpenAI routes (proxied), `/v1/models`, `/health`, `/metrics`, and the
//! admin API under `/admin` (guarded by the admin key).
//!
//! Admin API (JSON):
//! * `POST /admin/keys` `{tenant, name?, allowed_models?, rpm?, tpm?, budget_usd?}` → 201
//!   with `key` (the only time the secret is shown) and the record.
//! * `GET /admin/keys` → `{data: [record...]}`; `DELETE /admin/keys/{id}` revokes;
//!   `PUT /admin/keys/{id}` `{rpm?, tpm?, budget_usd?, allowed_models?}` replaces limits.
//! * `GET /admin/tenants`; `PUT /admin/tenants/{name}` `{rpm?, tpm?, budget_usd?}`.
//! * `GET /admin/usage?tenant=&key_id=&since=` → rows per tenant, key and model.
//! * `GET /admin/audit?limit=`; `POST /admin/reload` re-reads `gateway.yaml`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use strata_api::{parse_json, ApiError};

use crate::config::RateLimits;
use crate::keys;
use crate::proxy::{self, error_response, Route};
use crate::state::{usd_to_micros, CreateKey, Gateway};
use crate::store::UsageFilter;

type Gw = State<Arc<Gateway>>;

/// The gateway's axum router.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/keys", post(admin_create_key).get(admin_list_keys))
        .route(
            "/admin/keys/{id}",
            put(admin_update_key).delete(admin_revoke_key),
        )
        .route("/admin/tenants", get(admin_list_tenants))
        .route("/admin/tenants/{name}", put(admin_put_tenant))
        .route("/admin/usage", get(admin_usage))
        .route("/admin/audit", get(admin_audit))
        .route("/admin/reload", post(admin_reload))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(gw)
}

async fn chat(State(gw): Gw, req: Request) -> Response {
    proxy::handle(gw, Route::Chat, req).await
}

async fn completions(State(gw): Gw, req: Request) -> Response {
    proxy::handle(gw, Route::Completions, req).await
}

async fn embeddings(State(gw): Gw, req: Request) -> Response {
    proxy::handle(gw, Route::Embeddings, req).await
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

async fn metrics(State(gw): Gw) -> Response {
    let mut resp = Response::new(Body::from(gw.metrics.render()));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

async fn models(State(gw): Gw, headers: HeaderMap) -> Response {
    let key = match proxy::authenticate(&gw, &headers) {
        Ok(k) => k,
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

/// Extractor: the request carries the admin key (else the OpenAI-shaped 401/403 is the
/// answer and the handler never runs).
struct Admin;

impl FromRequestParts<Arc<Gateway>> for Admin {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        gw: &Arc<Gateway>,
    ) -> Result<Self, Response> {
        admin(gw, &parts.headers)
            .map(|()| Admin)
            .map_err(|e| error_response(&e))
    }
}

/// Extractor: a JSON body parsed into `T`, refused with an OpenAI-shaped 400 (naming the
/// faulty field) or 413. Put it after [`Admin`] so the key is checked first.
struct AdminJson<T>(T);

impl<T: serde::de::DeserializeOwned> FromRequest<Arc<Gateway>> for AdminJson<T> {
    type Rejection = Response;

    async fn from_request(req: Request, gw: &Arc<Gateway>) -> Result<Self, Response> {
        let bytes = axum::body::Bytes::from_request(req, gw)
            .await
            .map_err(|e| {
                error_response(&ApiError::too_large(format!(
                    "The request body could not be read: {e}"
                )))
            })?;
        parse_json(&bytes)
            .map(AdminJson)
            .map_err(|e| error_response(&e))
    }
}

/// Checks the admin key; the admin API is off without one.
fn admin(gw: &Gateway, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(expected) = &gw.admin_key else {
        return Err(ApiError::forbidden(
            "The admin API is disabled: start the gateway with --admin-key or STRATA_ADMIN_KEY.",
        )
        .with_code("admin_disabled"));
    };
    match keys::from_headers(headers) {
        Some(k) if keys::admin_matches(k, expected) => Ok(()),
        _ => {
            gw.metrics.reject("admin_auth");
            Err(ApiError::unauthorized("Missing or wrong admin key.").with_code("invalid_api_key"))
        }
    }
}

fn store_error(e: impl std::fmt::Display) -> Response {
    tracing::error!(error = %e, "store failure");
    error_response(&ApiError::internal(
        "The gateway's store failed; see its log.",
    ))
}

fn check_budget(b: Option<f64>) -> Result<Option<i64>, ApiError> {
    match b {
        Some(v) if !(v.is_finite() && v >= 0.0) => Err(ApiError::invalid(
            "budget_usd",
            "`budget_usd` must be a number >= 0.",
        )),
        other => Ok(other.map(usd_to_micros)),
    }
}

fn check_models(gw: &Gateway, models: &[String]) -> Result<(), ApiError> {
    let resolved = gw.config.get();
    match models.iter().find(|m| resolved.model(m).is_none()) {
        Some(m) => Err(ApiError::model_not_found(m).with_param("allowed_models")),
        None => Ok(()),
    }
}

async fn admin_create_key(
    State(gw): Gw,
    _: Admin,
    AdminJson(req): AdminJson<CreateKey>,
) -> Response {
    if req.tenant.trim().is_empty() || req.tenant.len() > 128 {
        return error_response(&ApiError::invalid(
            "tenant",
            "`tenant` must be 1 to 128 characters.",
        ));
    }
    if let Err(r) =
        check_budget(req.budget_usd).and_then(|_| check_models(&gw, &req.allowed_models))
    {
        return error_response(&r);
    }
    let gw2 = gw.clone();
    let res = tokio::task::spawn_blocking(move || gw2.create_key(req)).await;
    match res {
        Ok(Ok((full, record))) => {
            let mut v = serde_json::to_value(&record).unwrap_or(Value::Null);
            v["key"] = Value::String(full);
            (StatusCode::CREATED, Json(v)).into_response()
        }
        Ok(Err(e)) => store_error(e),
        Err(e) => store_error(e),
    }
}

async fn admin_list_keys(State(gw): Gw, _: Admin) -> Response {
    let keys: Vec<Value> = {
        let map = gw.keys.read();
        let mut list: Vec<_> = map.values().cloned().collect();
        list.sort_by(|a, b| {
            (a.record.created_at, &a.record.id).cmp(&(b.record.created_at, &b.record.id))
        });
        list.iter()
            .map(|k| {
                let mut v = serde_json::to_value(&k.record).unwrap_or(Value::Null);
                v["spend_micros"] = json!(k.spend.load(Ordering::Relaxed));
                v
            })
            .collect()
    };
    Json(json!({"object": "list", "data": keys})).into_response()
}

async fn admin_revoke_key(State(gw): Gw, _: Admin, Path(id): Path<String>) -> Response {
    let gw2 = gw.clone();
    let id2 = id.clone();
    match tokio::task::spawn_blocking(move || gw2.revoke_key(&id2)).await {
        Ok(Ok(true)) => Json(json!({"id": id, "revoked": true})).into_response(),
        Ok(Ok(false)) => error_response(&ApiError::not_found(format!("No active key `{id}`."))),
        Ok(Err(e)) => store_error(e),
        Err(e) => store_error(e),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyUpdate {
    #[serde(default)]
    rpm: Option<u64>,
    #[serde(default)]
    tpm: Option<u64>,
    #[serde(default)]
    budget_usd: Option<f64>,
    #[serde(default)]
    allowed_models: Vec<String>,
}

async fn admin_update_key(
    State(gw): Gw,
    _: Admin,
    Path(id): Path<String>,
    AdminJson(req): AdminJson<KeyUpdate>,
) -> Response {
    let budget = match check_budget(req.budget_usd) {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    if let Err(e) = check_models(&gw, &req.allowed_models) {
        return error_response(&e);
    }
    let limits = RateLimits {
        rpm: req.rpm,
        tpm: req.tpm,
    };
    let gw2 = gw.clone();
    let id2 = id.clone();
    let res = tokio::task::spawn_blocking(move || {
        let ok = gw2
            .store
            .update_key(&id2, limits, budget, &req.allowed_models)?;
        if ok {
            gw2.audit(
                "update_key",
                &id2,
                &format!("{limits:?} budget_micros={budget:?}"),
            );
            gw2.refresh_from_store()?;
        }
        Ok::<_, crate::store::StoreError>(ok)
    })
    .await;
    match res {
        Ok(Ok(true)) => Json(json!({"id": id, "updated": true})).into_response(),
        Ok(Ok(false)) => error_response(&ApiError::not_found(format!("No key `{id}`."))),
        Ok(Err(e)) => store_error(e),
        Err(e) => store_error(e),
    }
}

async fn admin_list_tenants(State(gw): Gw, _: Admin) -> Response {
    let resolved = gw.config.get();
    let mut names: Vec<String> = gw.tenants.read().keys().cloned().collect();
    names.extend(resolved.tenants.keys().cloned());
    names.sort();
    names.dedup();
    let live = gw.tenants.read();
    let data: Vec<Value> = names
        .iter()
        .map(|n| {
            let stored = live.get(n);
            let cfg = resolved.tenants.get(n);
            let limits = cfg
                .map(|c| c.limits)
                .unwrap_or_default()
                .overlay(stored.map(|s| s.record.limits).unwrap_or_default());
            let budget = stored
                .and_then(|s| s.record.budget_micros)
                .or_else(|| cfg.and_then(|c| c.budget_usd).map(usd_to_micros));
            json!({
                "name": n,
                "limits": limits,
                "budget_micros": budget,
                "spend_micros": stored.map_or(0, |s| s.spend.load(Ordering::Relaxed)),
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantUpdate {
    #[serde(default)]
    rpm: Option<u64>,
    #[serde(default)]
    tpm: Option<u64>,
    #[serde(default)]
    budget_usd: Option<f64>,
}

async fn admin_put_tenant(
    State(gw): Gw,
    _: Admin,
    Path(name): Path<String>,
    AdminJson(req): AdminJson<TenantUpdate>,
) -> Response {
    let budget = match check_budget(req.budget_usd) {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let limits = RateLimits {
        rpm: req.rpm,
        tpm: req.tpm,
    };
    let gw2 = gw.clone();
    let name2 = name.clone();
    let res = tokio::task::spawn_blocking(move || {
        gw2.store.upsert_tenant(&name2, limits, budget)?;
        gw2.audit(
            "put_tenant",
            &name2,
            &format!("{limits:?} budget_micros={budget:?}"),
        );
        gw2.refresh_from_store()
    })
    .await;
    match res {
        Ok(Ok(())) => Json(json!({"name": name, "updated": true})).into_response(),
        Ok(Err(e)) => store_error(e),
        Err(e) => store_error(e),
    }
}

async fn admin_usage(State(gw): Gw, _: Admin, Query(filter): Query<UsageFilter>) -> Response {
    let gw2 = gw.clone();
    let res = tokio::task::spawn_blocking(move || {
        gw2.flush_usage();
        gw2.store.usage(&filter)
    })
    .await;
    match res {
        Ok(Ok(rows)) => {
            let total: i64 = rows.iter().map(|r| r.cost_micros).sum();
            let requests: u64 = rows.iter().map(|r| r.requests).sum();
            Json(json!({
                "object": "list",
                "data": rows,
                "total_requests": requests,
                "total_cost_micros": total,
                "total_cost_usd": total as f64 / 1e6,
            }))
            .into_response()
        }
        Ok(Err(e)) => store_error(e),
        Err(e) => store_error(e),
    }
}

#[derive(Debug, Deserialize)]
struct AuditQuery {
    #[serde(default = "default_audit_limit")]
    limit: u32,
}

fn default_audit_limit() -> u32 {
    100
}

async fn admin_audit(State(gw): Gw, _: Admin, Query(q): Query<AuditQuery>) -> Response {
    let gw2 = gw.clone();
    match tokio::task::spawn_blocking(move || gw2.store.list_audit(q.limit.min(10_000))).await {
        Ok(Ok(rows)) => Json(json!({"object": "list", "data": rows})).into_response(),
        Ok(Err(e)) => store_error(e),
        Err(e) => store_error(e),
    }
}

async fn admin_reload(State(gw): Gw, _: Admin) -> Response {
    match gw.config.reload() {
        Ok(()) => {
            gw.audit("reload", "config", "");
            Json(json!({"reloaded": true})).into_response()
        }
        Err(e) => error_response(
            &ApiError::invalid_no_param(format!("Config not reloaded: {e}"))
                .with_code("invalid_config"),
        ),
    }
}

/// A gateway serving on a bound address, with a handle to stop it.
pub struct RunningGateway {
    pub addr: SocketAddr,
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
    // The edge server bounds connections, heads and bodies, and sends answers as soon as
    // they are written (TCP_NODELAY: no delay between the chunks of a stream).
    let limits = strata_api::edge::EdgeLimits::default();
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
    });
    Ok(RunningGateway {
        addr,
        gateway: gw,
        shutdown: Some(tx),
        task,
    })
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
            gw.audit("reload", "config", why);
        }
        Err(e) => {
            tracing::error!(trigger = why, error = %e, "gateway config rejected; keeping the previous one")
        }
    }
}
