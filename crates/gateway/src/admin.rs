//! The admin API under `/admin`, by role ([`crate::role::Role`]):
//!
//! | call | platform admin | tenant admin |
//! |---|---|---|
//! | `POST /admin/keys` | any tenant | own tenant, `member` or `tenant_admin` keys |
//! | `GET /admin/keys` | all | own tenant's |
//! | `PUT`/`DELETE /admin/keys/{id}` | any | own tenant's (403 for another's) |
//! | `GET /admin/tenants` | all | own |
//! | `PUT /admin/tenants/{name}` | yes | 403 |
//! | `GET`/`PUT /admin/tenants/{name}/users[/{user}]` | any | own tenant |
//! | `GET /admin/usage` | any filter | own tenant (403 for another) |
//! | `GET /admin/audit`, `POST /admin/reload` | yes | 403 |
//!
//! A member (an ordinary key or token) gets 403; no or a bad credential 401. Every change
//! is audited with the actor's name and role.

use std::sync::Arc;

use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use strata_api::{parse_json, ApiError};

use crate::auth::{AuthError, Role};
use crate::budget::{Period, Spend};
use crate::config::RateLimits;
use crate::keys;
use crate::proxy::error_response;
use crate::state::{usd_to_micros, CreateKey, Gateway};
use crate::store::UsageFilter;

type Gw = State<Arc<Gateway>>;

/// Extractor: an admin caller (else the OpenAI-shaped 401/403 is the answer and the
/// handler never runs).
pub(crate) struct Admin {
    role: Role,
    /// The tenant a tenant admin manages.
    tenant: String,
    /// The audit log's name for the caller.
    actor: String,
}

impl Admin {
    /// 403 unless a platform admin.
    fn platform_only(&self) -> Result<(), ApiError> {
        match self.role {
            Role::PlatformAdmin => Ok(()),
            _ => Err(
                ApiError::forbidden("This admin call needs the platform admin role.")
                    .with_code("forbidden"),
            ),
        }
    }

    /// 403 when a tenant admin names another tenant.
    fn may_manage(&self, tenant: &str) -> Result<(), ApiError> {
        if self.role == Role::PlatformAdmin || self.tenant == tenant {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "A tenant admin of `{}` may not manage tenant `{tenant}`.",
                self.tenant
            ))
            .with_code("forbidden"))
        }
    }
}

impl FromRequestParts<Arc<Gateway>> for Admin {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        gw: &Arc<Gateway>,
    ) -> Result<Self, Response> {
        admin(gw, &parts.headers).await.map_err(|e| {
            if e.status == 401 {
                gw.metrics.reject("admin_auth");
            }
            error_response(&e)
        })
    }
}

/// Who is calling the admin API: the admin key, or a key or token with an admin role.
async fn admin(gw: &Gateway, headers: &HeaderMap) -> Result<Admin, ApiError> {
    let disabled = gw.admin_key.is_none() && gw.jwt.is_none();
    let unauthorized = || {
        ApiError::unauthorized("Missing or wrong admin credential.").with_code("invalid_api_key")
    };
    let Some(presented) = keys::from_headers(headers) else {
        return Err(if disabled {
            disabled_error()
        } else {
            unauthorized()
        });
    };
    if let Some(expected) = &gw.admin_key {
        if keys::admin_matches(presented, expected) {
            return Ok(Admin {
                role: Role::PlatformAdmin,
                tenant: String::new(),
                actor: "admin-key (platform_admin)".into(),
            });
        }
    }
    match crate::auth::authenticate_token(gw, presented).await {
        Ok(c) if c.role == Role::Member => Err(ApiError::forbidden(
            "This credential has no admin role (platform_admin or tenant_admin).",
        )
        .with_code("forbidden")),
        Ok(c) => Ok(Admin {
            role: c.role,
            tenant: c.tenant().to_string(),
            actor: c.actor,
        }),
        Err(_) if disabled => Err(disabled_error()),
        Err(AuthError::BadToken(why)) => Err(ApiError::unauthorized(format!(
            "Invalid bearer token: {why}."
        ))
        .with_code("invalid_token")),
        Err(_) => Err(unauthorized()),
    }
}

fn disabled_error() -> ApiError {
    ApiError::forbidden(
        "The admin API is disabled: start the gateway with --admin-key or STRATA_ADMIN_KEY.",
    )
    .with_code("admin_disabled")
}

/// Extractor: a JSON body parsed into `T`, refused with an OpenAI-shaped 400 (naming the
/// faulty field) or 413. Put it after [`Admin`] so the credential is checked first.
pub(crate) struct AdminJson<T>(T);

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

/// A budget and its period: a period needs a budget.
fn check_budget_period(
    b: Option<f64>,
    period: Option<Period>,
) -> Result<(Option<i64>, Option<Period>), ApiError> {
    let micros = check_budget(b)?;
    if period.is_some() && micros.is_none() {
        return Err(ApiError::invalid(
            "budget_period",
            "`budget_period` needs `budget_usd`.",
        ));
    }
    Ok((micros, period))
}

fn check_models(gw: &Gateway, models: &[String]) -> Result<(), ApiError> {
    let resolved = gw.config.get();
    match models.iter().find(|m| resolved.model(m).is_none()) {
        Some(m) => Err(ApiError::model_not_found(m).with_param("allowed_models")),
        None => Ok(()),
    }
}

/// Runs a blocking store call and maps its failure to a 500.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, crate::store::StoreError> + Send + 'static,
) -> Result<T, Response> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(store_error(e)),
        Err(e) => Err(store_error(e)),
    }
}

/// A budget with its current period's spend, as the admin API shows it.
fn budget_view(budget: Option<crate::budget::Budget>, spend: &Spend, now: i64) -> Value {
    match budget {
        None => json!({"budget_micros": null, "budget_period": null}),
        Some(b) => json!({
            "budget_micros": b.limit_micros,
            "budget_period": b.period.map(Period::as_str),
            "period_start": b.period.map(|p| p.start(now)),
            "period_end": b.period.map(|p| p.end(now)),
            "period_spend_micros": spend.spent(b.period, now),
        }),
    }
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

pub(crate) async fn create_key(
    State(gw): Gw,
    who: Admin,
    AdminJson(req): AdminJson<CreateKey>,
) -> Response {
    if req.tenant.trim().is_empty() || req.tenant.len() > 128 {
        return error_response(&ApiError::invalid(
            "tenant",
            "`tenant` must be 1 to 128 characters.",
        ));
    }
    if req
        .user
        .as_deref()
        .is_some_and(|u| u.trim().is_empty() || u.len() > 256)
    {
        return error_response(&ApiError::invalid(
            "user",
            "`user` must be 1 to 256 characters.",
        ));
    }
    if req.role == Some(Role::PlatformAdmin) {
        return error_response(&ApiError::invalid(
            "role",
            "A key's role is `member` or `tenant_admin`; the platform admin is the admin key or a token.",
        ));
    }
    let checked = who
        .may_manage(&req.tenant)
        .and_then(|()| check_budget_period(req.budget_usd, req.budget_period))
        .and_then(|_| check_models(&gw, &req.allowed_models));
    if let Err(e) = checked {
        return error_response(&e);
    }
    let gw2 = gw.clone();
    match blocking(move || gw2.create_key_as(req, &who.actor)).await {
        Ok((full, record)) => {
            let mut v = serde_json::to_value(&record).unwrap_or(Value::Null);
            v["key"] = Value::String(full);
            (StatusCode::CREATED, Json(v)).into_response()
        }
        Err(resp) => resp,
    }
}

pub(crate) async fn list_keys(State(gw): Gw, who: Admin) -> Response {
    let now = gw.now();
    let keys: Vec<Value> = {
        let map = gw.keys.read();
        let mut list: Vec<_> = map
            .values()
            .filter(|k| who.may_manage(&k.record.tenant).is_ok())
            .cloned()
            .collect();
        list.sort_by(|a, b| {
            (a.record.created_at, &a.record.id).cmp(&(b.record.created_at, &b.record.id))
        });
        list.iter()
            .map(|k| {
                let spend = *k.spend.lock();
                let own = k.record.budget_micros.map(|b| crate::budget::Budget {
                    limit_micros: b,
                    period: k.record.budget_period,
                });
                let mut v = serde_json::to_value(&k.record).unwrap_or(Value::Null);
                v["spend_micros"] = json!(spend.lifetime);
                merge(v, budget_view(own, &spend, now))
            })
            .collect()
    };
    Json(json!({"object": "list", "data": keys})).into_response()
}

/// May `who` change key `id`? A tenant admin only their own tenant's keys (403 for
/// another's, 404 for a key this gateway does not know).
fn may_change_key(gw: &Gateway, who: &Admin, id: &str) -> Result<(), ApiError> {
    let tenant = gw.keys.read().get(id).map(|k| k.record.tenant.clone());
    match tenant {
        Some(t) => who.may_manage(&t),
        None if who.role == Role::PlatformAdmin => Ok(()),
        None => Err(ApiError::not_found(format!("No key `{id}`."))),
    }
}

pub(crate) async fn revoke_key(State(gw): Gw, who: Admin, Path(id): Path<String>) -> Response {
    if let Err(e) = may_change_key(&gw, &who, &id) {
        return error_response(&e);
    }
    let gw2 = gw.clone();
    let id2 = id.clone();
    match blocking(move || gw2.revoke_key(&id2, &who.actor)).await {
        Ok(true) => Json(json!({"id": id, "revoked": true})).into_response(),
        Ok(false) => error_response(&ApiError::not_found(format!("No active key `{id}`."))),
        Err(resp) => resp,
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct KeyUpdate {
    #[serde(default)]
    rpm: Option<u64>,
    #[serde(default)]
    tpm: Option<u64>,
    #[serde(default)]
    budget_usd: Option<f64>,
    #[serde(default)]
    budget_period: Option<Period>,
    #[serde(default)]
    allowed_models: Vec<String>,
}

pub(crate) async fn update_key(
    State(gw): Gw,
    who: Admin,
    Path(id): Path<String>,
    AdminJson(req): AdminJson<KeyUpdate>,
) -> Response {
    if let Err(e) = may_change_key(&gw, &who, &id) {
        return error_response(&e);
    }
    let budget = match check_budget_period(req.budget_usd, req.budget_period) {
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
    let res = blocking(move || {
        let ok = gw2
            .store
            .update_key(&id2, limits, budget, &req.allowed_models)?;
        if ok {
            gw2.audit(
                &who.actor,
                "update_key",
                &id2,
                &format!("{limits:?} budget={budget:?}"),
            );
            gw2.refresh_from_store()?;
        }
        Ok(ok)
    })
    .await;
    match res {
        Ok(true) => Json(json!({"id": id, "updated": true})).into_response(),
        Ok(false) => error_response(&ApiError::not_found(format!("No key `{id}`."))),
        Err(resp) => resp,
    }
}

pub(crate) async fn list_tenants(State(gw): Gw, who: Admin) -> Response {
    let resolved = gw.config.get();
    let now = gw.now();
    let mut names: Vec<String> = gw.tenants.read().keys().cloned().collect();
    names.extend(resolved.tenants.keys().cloned());
    names.retain(|n| who.may_manage(n).is_ok());
    names.sort();
    names.dedup();
    let data: Vec<Value> = names
        .iter()
        .map(|n| {
            let stored = gw.tenants.read().get(n).cloned();
            let cfg = resolved.tenants.get(n);
            let limits = cfg
                .map(|c| c.limits)
                .unwrap_or_default()
                .overlay(stored.map(|s| s.record.limits).unwrap_or_default());
            let spend = gw.tenant_spend(n);
            merge(
                json!({"name": n, "limits": limits, "spend_micros": spend.lifetime}),
                budget_view(gw.tenant_budget(n), &spend, now),
            )
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TenantUpdate {
    #[serde(default)]
    rpm: Option<u64>,
    #[serde(default)]
    tpm: Option<u64>,
    #[serde(default)]
    budget_usd: Option<f64>,
    #[serde(default)]
    budget_period: Option<Period>,
}

pub(crate) async fn put_tenant(
    State(gw): Gw,
    who: Admin,
    Path(name): Path<String>,
    AdminJson(req): AdminJson<TenantUpdate>,
) -> Response {
    let budget = match who
        .platform_only()
        .and_then(|()| check_budget_period(req.budget_usd, req.budget_period))
    {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let limits = RateLimits {
        rpm: req.rpm,
        tpm: req.tpm,
    };
    let gw2 = gw.clone();
    let name2 = name.clone();
    let res = blocking(move || {
        gw2.store.upsert_tenant(&name2, limits, budget)?;
        gw2.audit(
            &who.actor,
            "put_tenant",
            &name2,
            &format!("{limits:?} budget={budget:?}"),
        );
        gw2.refresh_from_store()
    })
    .await;
    match res {
        Ok(()) => Json(json!({"name": name, "updated": true})).into_response(),
        Err(resp) => resp,
    }
}

pub(crate) async fn list_users(State(gw): Gw, who: Admin, Path(tenant): Path<String>) -> Response {
    if let Err(e) = who.may_manage(&tenant) {
        return error_response(&e);
    }
    let now = gw.now();
    let mut users: Vec<String> = gw
        .users
        .read()
        .keys()
        .filter(|(t, _)| *t == tenant)
        .map(|(_, u)| u.clone())
        .collect();
    users.sort();
    let data: Vec<Value> = users
        .iter()
        .map(|u| {
            let spend = gw.user_spend(&tenant, u);
            merge(
                json!({"tenant": tenant, "name": u, "spend_micros": spend.lifetime}),
                budget_view(gw.user_budget(&tenant, u), &spend, now),
            )
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UserUpdate {
    #[serde(default)]
    budget_usd: Option<f64>,
    #[serde(default)]
    budget_period: Option<Period>,
}

pub(crate) async fn put_user(
    State(gw): Gw,
    who: Admin,
    Path((tenant, user)): Path<(String, String)>,
    AdminJson(req): AdminJson<UserUpdate>,
) -> Response {
    let budget = match who
        .may_manage(&tenant)
        .and_then(|()| check_budget_period(req.budget_usd, req.budget_period))
    {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    if user.trim().is_empty() || user.len() > 256 {
        return error_response(&ApiError::invalid(
            "user",
            "A user name is 1 to 256 characters.",
        ));
    }
    let gw2 = gw.clone();
    let (t2, u2) = (tenant.clone(), user.clone());
    let res = blocking(move || {
        gw2.store.upsert_user(&t2, &u2, budget)?;
        gw2.audit(
            &who.actor,
            "put_user",
            &format!("{t2}/{u2}"),
            &format!("budget={budget:?}"),
        );
        gw2.refresh_from_store()
    })
    .await;
    match res {
        Ok(()) => Json(json!({"tenant": tenant, "name": user, "updated": true})).into_response(),
        Err(resp) => resp,
    }
}

pub(crate) async fn usage(
    State(gw): Gw,
    who: Admin,
    Query(mut filter): Query<UsageFilter>,
) -> Response {
    if who.role != Role::PlatformAdmin {
        match &filter.tenant {
            Some(t) => {
                if let Err(e) = who.may_manage(t) {
                    return error_response(&e);
                }
            }
            None => filter.tenant = Some(who.tenant.clone()),
        }
    }
    let gw2 = gw.clone();
    let res = blocking(move || {
        gw2.flush_usage();
        gw2.store.usage(&filter)
    })
    .await;
    match res {
        Ok(rows) => {
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
        Err(resp) => resp,
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct AuditQuery {
    #[serde(default = "default_audit_limit")]
    limit: u32,
}

fn default_audit_limit() -> u32 {
    100
}

pub(crate) async fn audit(State(gw): Gw, who: Admin, Query(q): Query<AuditQuery>) -> Response {
    if let Err(e) = who.platform_only() {
        return error_response(&e);
    }
    let gw2 = gw.clone();
    match blocking(move || gw2.store.list_audit(q.limit.min(10_000))).await {
        Ok(rows) => Json(json!({"object": "list", "data": rows})).into_response(),
        Err(resp) => resp,
    }
}

pub(crate) async fn reload(State(gw): Gw, who: Admin) -> Response {
    if let Err(e) = who.platform_only() {
        return error_response(&e);
    }
    match gw.config.reload() {
        Ok(()) => {
            gw.audit(&who.actor, "reload", "config", "");
            Json(json!({"reloaded": true})).into_response()
        }
        Err(e) => error_response(
            &ApiError::invalid_no_param(format!("Config not reloaded: {e}"))
                .with_code("invalid_config"),
        ),
    }
}
