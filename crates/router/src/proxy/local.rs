//! What the router answers itself: `GET /v1/models` (the union over the pool),
//! `GET /health`, `GET /metrics`, `GET /debug/endpoints`, `GET /debug/flows`.

use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use strata_api::ApiError;

use super::{error_response, request_id, REQUEST_ID};
use crate::router::Router;

/// `GET /v1/models`: the union of what the ready endpoints serve. One endpoint per distinct
/// `model` label is asked (the next one of the same label when it fails); entries are merged
/// by `id`, first seen first. Needs no `model` of its own, so it never goes through the
/// scheduler's model filter.
pub(super) async fn models(State(router): State<Router>, headers: HeaderMap) -> Response {
    let rid = request_id(&headers);
    let mut groups: Vec<(Option<String>, Vec<String>)> = Vec::new();
    for s in router.status() {
        if !s.ready || s.draining {
            continue;
        }
        match groups.iter_mut().find(|(m, _)| *m == s.spec.model) {
            Some((_, urls)) => urls.push(s.spec.url.clone()),
            None => groups.push((s.spec.model.clone(), vec![s.spec.url.clone()])),
        }
    }
    if groups.is_empty() {
        return error_response(&ApiError::unavailable("No replica is ready."), Some(&rid));
    }
    let mut data: Vec<serde_json::Value> = Vec::new();
    let mut answered = false;
    for (_, urls) in &groups {
        for url in urls {
            let r = crate::client::fetch(
                &router.inner.client,
                hyper::Method::GET,
                &format!("{url}/v1/models"),
                None,
                Duration::from_secs(5),
                16 << 20,
            )
            .await;
            let Ok((status, bytes)) = r else { continue };
            if !status.is_success() {
                continue;
            }
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
                continue;
            };
            answered = true;
            if let Some(list) = v.get("data").and_then(|d| d.as_array()) {
                for m in list {
                    let id = m.get("id");
                    if id.is_some() && !data.iter().any(|d| d.get("id") == id) {
                        data.push(m.clone());
                    }
                }
            }
            break;
        }
    }
    if !answered {
        return error_response(&ApiError::unavailable("No replica answered."), Some(&rid));
    }
    let body = serde_json::json!({"object": "list", "data": data});
    let mut out = Response::new(Body::from(body.to_string()));
    out.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    out.headers_mut().insert(REQUEST_ID, rid);
    out
}

pub(super) async fn health(State(router): State<Router>) -> Response {
    if router.any_ready() {
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"status":"ok"}"#,
        )
            .into_response()
    } else {
        error_response(&ApiError::unavailable("No replica is ready."), None)
    }
}

pub(super) async fn metrics(State(router): State<Router>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        router.metrics().encode(),
    )
        .into_response()
}

pub(super) async fn debug_endpoints(State(router): State<Router>) -> Response {
    axum::Json(router.debug_json()).into_response()
}

/// `GET /debug/flows`: flow control's queues, by band and flow.
pub(super) async fn debug_flows(State(router): State<Router>) -> Response {
    axum::Json(router.flows_json()).into_response()
}
