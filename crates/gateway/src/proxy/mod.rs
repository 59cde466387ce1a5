//! The request path for `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and
//! vLLM's other JSON routes ([`route::Route`]), as stages that each return a value, one file each:
//!
//! 1. [`admit`]: key → body size → JSON shape → model → permission → guardrails →
//!    budget → rate limits (on an estimate). Gives a [`values::Admitted`] request and
//!    its [`account::Settle`], or a [`refusal::Refusal`].
//! 2. [`lookup`]: caches; a hit skips to *respond*.
//! 3. [`plan`]: the ordered tries (targets, fallbacks, context-length skips); for a
//!    cascade model, [`cascade`] plans and tries each of its models in turn.
//! 4. [`attempt`] (*try*): runs the tries and *returns* the answer (a whole body, or a
//!    stream's head) instead of sending it.
//! 5. [`respond`]: output guardrails, cache store, headers naming who answered, relayed
//!    client errors or a 503.
//! 6. [`settle`]: usage, cost, token-limit reconcile and the ledger row, exactly once,
//!    also when the client goes away mid-try or mid-stream.
//!
//! What one stage hands the next ([`values::Admitted`], [`values::Lookup`],
//! [`values::Tried`], [`values::Reply`]) lives in [`values`], and the accounting handle
//! that travels with them ([`account::Settle`]) in [`account`]. A stage imports those and
//! the stages before it, never a later one; this file alone calls every stage.
//!
//! Refusals are one enum ([`refusal::Refusal`]) mapped once to an OpenAI-shaped error and
//! a metric label. Streamed answers are passed through chunk by chunk ([`stream`]); an SSE
//! decoder watches them for the `usage` chunk (requested with
//! `stream_options.include_usage`). One upstream call lives in [`send`], the bodies as
//! the gateway reads them in [`shape`], the header names in [`headers`] and the routes in
//! [`route`].

pub mod account;
pub(crate) mod admit;
pub(crate) mod attempt;
pub(crate) mod cascade;
pub(crate) mod classify_guard;
pub(crate) mod classify_stream;
pub(crate) mod form;
pub(crate) mod headers;
pub(crate) mod lookup;
pub(crate) mod placement;
pub(crate) mod plan;
pub mod refusal;
pub(crate) mod respond;
pub(crate) mod route;
pub(crate) mod send;
pub(crate) mod settle;
pub(crate) mod shape;
pub(crate) mod side_call;
pub(crate) mod stream;
pub(crate) mod values;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::Request;
use axum::http::HeaderMap;
use axum::response::Response;
use strata_api::{trace, ApiError};
use tracing::Instrument;

pub use admit::DEFAULT_OUTPUT_ESTIMATE;
pub use headers::{
    CACHE_HEADER, CASCADE_HEADER, MODEL_HEADER, REQUEST_ID_HEADER, SERVED_BY_HEADER,
    UPSTREAM_HEADER,
};
pub use refusal::error_response;
pub use route::Route;

use crate::auth::Caller;
use crate::state::Gateway;
use values::Lookup;

/// A caller already authenticated by the route that hands the request to [`handle`]
/// (the Messages and Responses routes authenticate before reading the body), carried in
/// the request's extensions so that admission does not authenticate it again. Only the
/// gateway's own code inserts it: nothing from the wire becomes an extension.
#[derive(Debug, Clone)]
pub(crate) struct Authenticated(pub Caller);

/// The authenticated caller of a request, or the 401 to send (counted as a rejection).
pub async fn authenticate(gw: &Gateway, headers: &HeaderMap) -> Result<Caller, ApiError> {
    admit::authenticate_caller(gw, headers).await.map_err(|r| {
        gw.metrics.reject(r.metric_label());
        r.to_api_error()
    })
}

/// Handles one proxied request end to end: the stages in order (see the module doc),
/// each in a trace span under the request's (`strata_api::trace`; the `traceparent` the
/// client sent is the parent, a malformed one starts a new trace).
pub async fn handle(gw: Arc<Gateway>, route: Route, req: Request) -> Response {
    let span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        "gateway.request",
        otel.kind = "server",
        http.route = route.path(),
        http.response.status_code = tracing::field::Empty,
    );
    trace::accept(
        &span,
        req.headers().get(trace::TRACEPARENT).map(|v| v.as_bytes()),
    );
    let resp = stages(gw, route, req).instrument(span.clone()).await;
    span.record("http.response.status_code", resp.status().as_u16());
    resp
}

/// A stage's span, a child of the request's (the current span).
macro_rules! stage {
    ($name:literal) => {
        tracing::info_span!(target: trace::SPAN_TARGET, $name)
    };
}

async fn stages(gw: Arc<Gateway>, route: Route, req: Request) -> Response {
    let started = Instant::now();
    let admitted = admit::admit(&gw, route, req)
        .instrument(stage!("gateway.admit"))
        .await;
    let (mut req, mut settle) = match admitted {
        Ok(admitted) => admitted,
        Err(refused) => return refused.into_response(&gw),
    };
    let looked_up = lookup::lookup(&gw, &mut req)
        .instrument(stage!("gateway.lookup"))
        .await;
    let store = match looked_up {
        Lookup::Hit(hit) => {
            let reply = stage!("gateway.respond")
                .in_scope(|| respond::cached(&gw, req, hit, "hit", &mut settle));
            return settle::settle(&gw, settle, reply)
                .instrument(stage!("gateway.settle"))
                .await;
        }
        Lookup::Semantic(hit) => {
            let reply = stage!("gateway.respond")
                .in_scope(|| respond::cached(&gw, req, hit, "semantic", &mut settle));
            return settle::settle(&gw, settle, reply)
                .instrument(stage!("gateway.settle"))
                .await;
        }
        Lookup::Miss(store) => store,
    };
    let deadline = attempt::deadline(started, req.model().timeout_ms);
    // Each upstream attempt has its own `gateway.try` span (in `attempt`).
    let cascade = req
        .route
        .cascades()
        .then(|| req.resolved.cascades.get(&req.model().name).cloned())
        .flatten();
    let tried = match cascade {
        Some(policy) => {
            stage!("gateway.plan").in_scope(|| plan::prepare_body(&mut req));
            cascade::try_cascade(&gw, &mut req, &policy, &mut settle, started, deadline)
                .instrument(stage!("gateway.cascade"))
                .await
        }
        None => match stage!("gateway.plan").in_scope(|| plan::plan(&gw, &mut req)) {
            Ok(tries) => Ok(attempt::try_plan(&gw, &mut req, &tries, started, deadline).await),
            Err(refused) => Err(refused),
        },
    };
    let tried = match tried {
        Ok(tried) => tried,
        Err(refused) => {
            settle
                .finish(None, refused.to_api_error().status, false)
                .instrument(stage!("gateway.settle"))
                .await;
            return refused.into_response(&gw);
        }
    };
    let reply = respond::respond(&gw, req, tried, store, &mut settle)
        .instrument(stage!("gateway.respond"))
        .await;
    settle::settle(&gw, settle, reply)
        .instrument(stage!("gateway.settle"))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::header;

    #[test]
    fn every_503_and_429_says_when_to_retry_like_the_engine_and_router() {
        for err in [
            ApiError::unavailable("no upstream could answer"),
            ApiError::rate_limited("slow down"),
        ] {
            let resp = error_response(&err);
            assert_eq!(resp.status().as_u16(), err.status);
            assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
            assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
        }
        let resp = error_response(&ApiError::invalid("model", "bad"));
        assert!(resp.headers().get(header::RETRY_AFTER).is_none());
    }

    /// A caller the route authenticated travels to admission in the request's extensions
    /// and is not authenticated again: with it, a request without credentials goes on to
    /// the model check (404); without it, the same request is a 401.
    #[tokio::test]
    async fn a_caller_handed_on_is_not_authenticated_again() {
        let store = std::sync::Arc::new(crate::store::sqlite::SqliteStore::in_memory().unwrap());
        let config = crate::Config::from_yaml("{}").unwrap();
        let gw = Gateway::new(
            Arc::new(crate::ConfigHandle::fixed(config).unwrap()),
            store,
            crate::GatewayOptions::default(),
        )
        .unwrap();
        let (secret, _) = gw
            .create_key(crate::CreateKey {
                tenant: "t".into(),
                ..Default::default()
            })
            .unwrap();
        let mut with_key = HeaderMap::new();
        with_key.insert(
            header::AUTHORIZATION,
            format!("Bearer {secret}").parse().unwrap(),
        );
        let caller = authenticate(&gw, &with_key).await.unwrap();
        let request = |caller: Option<Caller>| {
            let body = r#"{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}"#;
            let mut req = Request::new(axum::body::Body::from(body));
            *req.method_mut() = axum::http::Method::POST;
            req.headers_mut().insert(
                header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            );
            if let Some(c) = caller {
                req.extensions_mut().insert(Authenticated(c));
            }
            req
        };
        let handed_on = handle(gw.clone(), Route::Chat, request(Some(caller))).await;
        assert_eq!(handed_on.status().as_u16(), 404);
        let bare = handle(gw.clone(), Route::Chat, request(None)).await;
        assert_eq!(bare.status().as_u16(), 401);
    }
}
