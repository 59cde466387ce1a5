//! Stage 1, admission: everything the gateway checks before any cache or model work, in
//! this order: key → body size → JSON shape → model → permission → a client's placement
//! fields removed ([`super::placement`]) → guardrails → budget → rate limits on the
//! estimate. The result is a typed [`Admitted`] request (parsed once)
//! and its [`Settle`], or the [`Refusal`] to send.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

use super::account::Settle;
use super::classify_guard;
use super::headers::{hv, REQUEST_ID_HEADER};
use super::placement::strip_client_placement;
use super::refusal::Refusal;
use super::route::Route;
use super::shape::{check_shape, prompt_chars};
use super::values::Admitted;
use crate::auth::{AuthError, Caller};
use crate::config::{FailureMode, Resolved};
use crate::ratelimit::{LimitCheck, LimitDecision, LimitKind};
use crate::state::{Gateway, KeyEntry};
use crate::store::{BudgetHold, HoldOutcome, Holder, StoreError};

/// Output tokens assumed when a request sets no `max_tokens` (reconciled afterwards).
pub const DEFAULT_OUTPUT_ESTIMATE: u64 = 256;

/// The authenticated caller of a request (an API key or a JWT).
pub(crate) async fn authenticate_caller(
    gw: &Gateway,
    headers: &HeaderMap,
) -> Result<Caller, Refusal> {
    crate::auth::authenticate(gw, headers)
        .await
        .map_err(|e| match e {
            AuthError::Missing => Refusal::MissingKey,
            AuthError::BadKey => Refusal::BadKey,
            AuthError::BadToken(why) => Refusal::BadToken(why),
        })
}

fn may_use(resolved: &Resolved, key: &KeyEntry, requested: &str, canonical: &str) -> bool {
    let allowed =
        |list: &[String]| list.is_empty() || list.iter().any(|m| m == requested || m == canonical);
    let tenant_ok = resolved
        .tenants
        .get(&key.record.tenant)
        .is_none_or(|t| allowed(&t.allowed_models));
    tenant_ok && allowed(&key.record.allowed_models)
}

/// Runs every admission check; see the module doc for the order.
pub(crate) async fn admit(
    gw: &Arc<Gateway>,
    route: Route,
    req: Request,
) -> Result<(Admitted, Settle), Refusal> {
    let (parts, body) = req.into_parts();
    let key = caller_key(gw, &parts).await?;
    let resolved = gw.config.get();
    let bytes = read_body(&parts.headers, body, body_limit(&resolved, route)).await?;
    let Ask {
        mut body,
        requested,
        max_tokens,
        n_choices,
        stream,
    } = read_ask(route, &bytes)?;
    let model_index = permitted_model(&resolved, &key, &requested)?;
    let model = &resolved.config.models[model_index];
    let chars = prompt_chars(&body);
    let stripped = strip_client_placement(&mut body);
    let rewritten = input_guardrails(&resolved, &mut body, chars)? || stripped;
    let tenant = &key.record.tenant;
    classify_guard::check_input(gw, &resolved, route, &body, &parts.headers, tenant).await?;

    // Budget: this replica's view first (no I/O); a shared store then holds the
    // estimated cost so that other replicas see it at once.
    if let Some(msg) = gw.budget_exhausted(&key) {
        return Err(Refusal::BudgetExceeded(msg));
    }
    let (prompt_estimate, output_estimate) = token_estimates(route, chars, max_tokens, n_choices);
    let estimate = prompt_estimate + output_estimate;
    let ledger_id = gw.next_request_id();
    // The dearest try the plan may make (a fallback provider may cost more).
    let hold_price = crate::routing::max_price(&resolved, model);
    let held = hold_budget(
        gw,
        &key,
        &ledger_id,
        hold_price.cost_micros(prompt_estimate, output_estimate),
    )
    .await?;

    let Limited {
        token_checks,
        extra,
        request_id,
    } = match rate_limit(gw, &key, estimate, &parts.headers).await {
        Ok(limited) => limited,
        Err(refused) => {
            release_hold(gw, held, &ledger_id);
            return Err(refused);
        }
    };

    let settle = Settle::new(
        gw.clone(),
        ledger_id,
        token_checks,
        estimate,
        prompt_estimate,
        key.record.id.clone(),
        key.record.tenant.clone(),
        key.record.user.clone().unwrap_or_default(),
        model.name.clone(),
        model.price,
    );
    body["model"] = Value::String(model.name.clone());
    Ok((
        Admitted {
            key,
            resolved: resolved.clone(),
            route,
            headers: parts.headers,
            bytes,
            body,
            rewritten,
            requested,
            model_index,
            stream,
            prompt_chars: chars,
            estimate,
            extra,
            request_id,
        },
        settle,
    ))
}

/// The caller's key: handed on by a route that authenticated the caller already
/// (`super::Authenticated`), or authenticated here.
async fn caller_key(gw: &Gateway, parts: &Parts) -> Result<Arc<KeyEntry>, Refusal> {
    Ok(match parts.extensions.get::<super::Authenticated>() {
        Some(done) => done.0.key.clone(),
        None => authenticate_caller(gw, &parts.headers).await?.key,
    })
}

/// The largest body the route takes (an audio upload's limit is its own).
fn body_limit(resolved: &Resolved, route: Route) -> usize {
    if route.multipart() {
        resolved.config.server.max_audio_bytes
    } else {
        resolved.config.server.max_body_bytes
    }
}

/// The tokens a request is estimated at before it runs, prompt and output: about four
/// characters a token for the prompt (none on a free route), and `max_tokens` (or
/// [`DEFAULT_OUTPUT_ESTIMATE`]) for each choice on a generating route.
fn token_estimates(
    route: Route,
    chars: usize,
    max_tokens: Option<u64>,
    n_choices: u64,
) -> (u64, u64) {
    let prompt = if route.free() {
        0
    } else {
        (chars as u64).div_ceil(4).max(1)
    };
    let output = if !route.generates() {
        0
    } else {
        max_tokens.unwrap_or(DEFAULT_OUTPUT_ESTIMATE) * n_choices
    };
    (prompt, output)
}

/// The body, refused by its `Content-Length` before reading when possible.
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, Refusal> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = Refusal::BodyTooLarge { limit };
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large);
    }
    axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| too_large)
}

/// What the body asks for, read from its one parse.
struct Ask {
    body: Value,
    /// The `model` as sent.
    requested: String,
    max_tokens: Option<u64>,
    /// Choices asked for (`n`, 1 to 128).
    n_choices: u64,
    stream: bool,
}

/// The body's shape: parsed once, the typed check running over that parse and naming
/// the faulty field. The forwarded body stays as sent unless the gateway must change it.
fn read_ask(route: Route, bytes: &Bytes) -> Result<Ask, Refusal> {
    let body = check_shape(route, bytes).map_err(Refusal::BadShape)?;
    let Some(requested) = body
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string)
    else {
        return Err(Refusal::MissingModel);
    };
    // Chat's two names, and the Responses API's (a passed-through Responses body).
    let max_tokens = ["max_completion_tokens", "max_tokens", "max_output_tokens"]
        .iter()
        .filter_map(|name| body.get(*name))
        .find(|v| !v.is_null());
    let max_tokens = match max_tokens.map(Value::as_i64) {
        None => None,
        Some(Some(n)) if n >= 1 => Some(n as u64),
        Some(_) => return Err(Refusal::BadMaxTokens),
    };
    let n_choices = body
        .get("n")
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .clamp(1, 128);
    // Only generating routes stream (vLLM's other routes answer whole).
    let stream = route.generates() && body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    Ok(Ask {
        body,
        requested,
        max_tokens,
        n_choices,
        stream,
    })
}

/// The index of the model `requested` names, when it exists and the key may use it.
fn permitted_model(resolved: &Resolved, key: &KeyEntry, requested: &str) -> Result<usize, Refusal> {
    let Some(&model_index) = resolved.model_index.get(requested) else {
        return Err(Refusal::UnknownModel(requested.to_string()));
    };
    let model = &resolved.config.models[model_index];
    if !may_use(resolved, key, requested, &model.name) {
        return Err(Refusal::ModelForbidden(requested.to_string()));
    }
    Ok(model_index)
}

/// The guardrails before the model, over a prompt of `chars` characters: true when they
/// rewrote the body.
fn input_guardrails(resolved: &Resolved, body: &mut Value, chars: usize) -> Result<bool, Refusal> {
    if let Some(max) = resolved.guardrails.max_prompt_chars {
        if chars > max {
            return Err(Refusal::PromptTooLarge { chars, max });
        }
    }
    resolved
        .guardrails
        .apply_request(body)
        .map_err(Refusal::GuardrailBlocked)
}

/// A request within its rate limits.
struct Limited {
    /// The token limits charged with the estimate (reconciled when settled).
    token_checks: Vec<LimitCheck>,
    /// The headers every answer carries: the request id and the `x-ratelimit-*` state.
    extra: HeaderMap,
    request_id: HeaderValue,
}

/// Rate limits on the estimate: every request and token limit of the key and its tenant
/// at once. A limiter that fails refuses only when its failure mode is closed.
async fn rate_limit(
    gw: &Gateway,
    key: &KeyEntry,
    estimate: u64,
    headers: &HeaderMap,
) -> Result<Limited, Refusal> {
    let (request_checks, token_checks) = gw.limit_checks(key, estimate);
    let all_checks: Vec<LimitCheck> = request_checks
        .iter()
        .chain(&token_checks)
        .cloned()
        .collect();
    // The failure mode comes from the live config, so `/admin/reload` applies it.
    let on_error = gw.config.get().config.limits.on_backend_error;
    let decision = match gw.limiter.check(&all_checks, on_error).await {
        Ok(d) => d,
        Err(e) => {
            gw.metrics.backend_error("ratelimit");
            return Err(Refusal::BackendUnavailable {
                what: "Rate limiting",
                error: e.to_string(),
            });
        }
    };
    if decision.degraded {
        gw.metrics.backend_error("ratelimit");
    }
    let mut extra = HeaderMap::new();
    let request_id = headers
        .get(REQUEST_ID_HEADER)
        .cloned()
        .unwrap_or_else(|| hv(gw.next_request_id()));
    extra.insert(REQUEST_ID_HEADER, request_id.clone());
    ratelimit_headers(&mut extra, &all_checks, &decision);
    if !decision.allowed {
        return Err(Refusal::RateLimited {
            key_id: key.record.id.clone(),
            retry_after: decision.retry_after,
            too_large: decision
                .too_large
                .map(|i| (all_checks[i].cost, all_checks[i].limit)),
            headers: Box::new(extra),
        });
    }
    Ok(Limited {
        token_checks,
        extra,
        request_id,
    })
}

/// Holds `amount` of the key's and tenant's budgets in a shared store (several gateway
/// replicas), so that replicas never admit together more than the budget left: true
/// when a hold was taken. Nothing to do without a budget or with a single-replica store.
/// A store that fails follows `store.on_error`: open admits on this replica's view of
/// spend (already checked), closed refuses.
async fn hold_budget(
    gw: &Arc<Gateway>,
    key: &KeyEntry,
    ledger_id: &str,
    amount: i64,
) -> Result<bool, Refusal> {
    if !gw.store.shares_budgets() {
        return Ok(false);
    }
    let (key_budget, tenant_budget) = gw.budgets(key);
    let user = key.record.user.clone().unwrap_or_default();
    let user_budget = key
        .record
        .user
        .as_deref()
        .and_then(|u| gw.user_budget(&key.record.tenant, u));
    if key_budget.is_none() && tenant_budget.is_none() && user_budget.is_none() {
        return Ok(false);
    }
    let resolved = gw.config.get();
    let store_cfg = &resolved.config.store;
    let now = gw.now();
    let hold = BudgetHold {
        id: ledger_id.to_string(),
        tenant: key.record.tenant.clone(),
        key_id: key.record.id.clone(),
        amount_micros: amount.max(0),
        tenant_budget_micros: tenant_budget.map(|b| b.limit_micros),
        key_budget_micros: key_budget.map(|b| b.limit_micros),
        tenant_period: tenant_budget.and_then(|b| b.period),
        key_period: key_budget.and_then(|b| b.period),
        user_budget_micros: user_budget.map(|b| b.limit_micros),
        user_period: user_budget.and_then(|b| b.period),
        user,
        now,
        expires_at: now.saturating_add(store_cfg.hold_ttl_secs as i64),
    };
    let store = gw.store.clone();
    let res = tokio::task::spawn_blocking(move || store.hold_budget(&hold))
        .await
        .unwrap_or_else(|e| Err(StoreError::Unavailable(e.to_string())));
    match res {
        Ok(HoldOutcome::Held) => Ok(true),
        Ok(HoldOutcome::Spent {
            holder,
            spent_micros,
            budget_micros,
        }) => {
            let whose = match holder {
                Holder::Tenant => format!("tenant `{}`", key.record.tenant),
                Holder::Key => format!("API key {}", key.record.id),
                Holder::User => format!(
                    "user `{}` of tenant `{}`",
                    key.record.user.as_deref().unwrap_or_default(),
                    key.record.tenant
                ),
            };
            Err(Refusal::BudgetExceeded(format!(
                "Budget exceeded for {whose}: spent ${:.6} of ${:.6}.",
                spent_micros as f64 / 1e6,
                budget_micros as f64 / 1e6
            )))
        }
        Err(e) => {
            gw.metrics.backend_error("store");
            match store_cfg.on_error {
                FailureMode::Open => {
                    tracing::warn!(error = %e, "budget store failed; admitting on this replica's view (fail open)");
                    Ok(false)
                }
                FailureMode::Closed => Err(Refusal::BackendUnavailable {
                    what: "The budget store",
                    error: e.to_string(),
                }),
            }
        }
    }
}

/// Gives back a hold taken for a request refused after it (in the background: the
/// refusal does not wait; a hold that cannot be dropped lapses at its expiry).
fn release_hold(gw: &Arc<Gateway>, held: bool, ledger_id: &str) {
    if !held {
        return;
    }
    let store = gw.store.clone();
    let id = ledger_id.to_string();
    tokio::task::spawn_blocking(move || {
        if let Err(e) = store.release_hold(&id) {
            tracing::warn!(error = %e, "could not release a budget hold; it lapses at expiry");
        }
    });
}

/// Formats a reset time as OpenAI does (`1s`, `6m0s`, `20ms`).
fn reset_text(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else {
        let s = d.as_secs();
        if s >= 60 {
            format!("{}m{}s", s / 60, s % 60)
        } else {
            let text = format!("{:.3}", d.as_secs_f64());
            format!("{}s", text.trim_end_matches('0').trim_end_matches('.'))
        }
    }
}

/// `x-ratelimit-*` headers: the tightest limit of each kind.
fn ratelimit_headers(headers: &mut HeaderMap, checks: &[LimitCheck], d: &LimitDecision) {
    for (kind, suffix) in [
        (LimitKind::Requests, "requests"),
        (LimitKind::Tokens, "tokens"),
    ] {
        let tightest = checks
            .iter()
            .zip(&d.states)
            .filter(|(c, _)| c.kind == kind)
            .min_by_key(|(_, (remaining, _))| *remaining);
        if let Some((c, (remaining, reset))) = tightest {
            let pairs = [
                (format!("x-ratelimit-limit-{suffix}"), c.limit.to_string()),
                (
                    format!("x-ratelimit-remaining-{suffix}"),
                    remaining.to_string(),
                ),
                (format!("x-ratelimit-reset-{suffix}"), reset_text(*reset)),
            ];
            for (name, value) in pairs {
                if let Ok(name) = HeaderName::from_bytes(name.as_bytes()) {
                    headers.insert(name, hv(value));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_output_estimate_reads_every_api_s_name_for_the_output_bound() {
        let ask = |route: Route, body: &str| read_ask(route, &Bytes::from(body.to_string()));
        let m = |r: Result<Ask, Refusal>| r.ok().and_then(|a| a.max_tokens);
        assert_eq!(
            m(ask(
                Route::Chat,
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":7,"max_tokens":9}"#
            )),
            Some(7)
        );
        assert_eq!(
            m(ask(
                Route::Messages,
                r#"{"model":"m","max_tokens":9,"messages":[{"role":"user","content":"x"}]}"#
            )),
            Some(9)
        );
        assert_eq!(
            m(ask(
                Route::Responses,
                r#"{"model":"m","input":"x","max_output_tokens":24}"#
            )),
            Some(24)
        );
        assert_eq!(
            m(ask(
                Route::Responses,
                r#"{"model":"m","input":"x","max_output_tokens":null}"#
            )),
            None
        );
        assert!(matches!(
            ask(
                Route::Responses,
                r#"{"model":"m","input":"x","max_output_tokens":0}"#
            ),
            Err(Refusal::BadMaxTokens)
        ));
    }

    #[test]
    fn reset_text_formats() {
        assert_eq!(reset_text(Duration::from_millis(20)), "20ms");
        assert_eq!(reset_text(Duration::from_millis(1500)), "1.5s");
        assert_eq!(reset_text(Duration::from_secs(360)), "6m0s");
    }
}
