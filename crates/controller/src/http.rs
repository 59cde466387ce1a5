//! The controller's HTTP endpoint: `/metrics` (Prometheus), `/status` (the last decision
//! with its evidence, and the replicas), `/health`. Anything else is an OpenAI-shaped
//! error.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use strata_api::error::ApiError;

use crate::controller::Status;
use crate::metrics::ControllerMetrics;

#[derive(Clone)]
struct AppState {
    metrics: Arc<ControllerMetrics>,
    status: Arc<Mutex<Status>>,
}

/// The routes.
pub fn router(metrics: Arc<ControllerMetrics>, status: Arc<Mutex<Status>>) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/status", get(render_status))
        .route("/health", get(|| async { StatusCode::OK }))
        .fallback(strata_api::http::not_found)
        .method_not_allowed_fallback(strata_api::http::method_not_allowed)
        .with_state(AppState { metrics, status })
}

async fn render_metrics(State(s): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

async fn render_status(State(s): State<AppState>) -> Response {
    match s.status.lock() {
        Ok(st) => Json(&*st).into_response(),
        Err(_) => ApiError::internal("Status unavailable.").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn serve() -> String {
        let app = router(
            Arc::new(ControllerMetrics::new()),
            Arc::new(Mutex::new(Status::default())),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn routes_and_openai_shaped_errors() {
        let base = serve().await;
        let c = reqwest::Client::new();
        let r = c.get(format!("{base}/metrics")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r
            .text()
            .await
            .unwrap()
            .contains("strata_controller_desired_replicas"));
        let r = c.get(format!("{base}/status")).send().await.unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["last"].is_null());
        assert_eq!(
            c.get(format!("{base}/health"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );

        let r = c.get(format!("{base}/nope")).send().await.unwrap();
        assert_eq!(r.status(), 404);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "not_found_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("/nope"));

        let r = c
            .post(format!("{base}/metrics"))
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 405);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "method_not_allowed");
    }
}
