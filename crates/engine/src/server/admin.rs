//! The routes that describe and manage the engine rather than generate: the model list,
//! LoRA adapters loaded and unloaded at run time (vLLM's routes), health, metrics, the
//! version, and the prefix-cache reset.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use strata_api::types::{ModelCard, ModelList};
use strata_api::validate::parse_json;
use strata_api::ApiError;

use super::http::{json_response, read_body, ApiResult, ErrorResponse};
use super::state::AppState;
use crate::lora::registry::read_adapter;
use crate::lora::{LoadLoraRequest, UnloadLoraRequest};

/// The base model, then each adapter with `parent` = the base and `root` = its path, as
/// vLLM lists them.
pub(super) async fn models(State(state): State<Arc<AppState>>) -> Response {
    let mut cards = vec![ModelCard {
        id: state.model_name.clone(),
        object: "model".into(),
        created: state.created,
        owned_by: "strata".into(),
        root: Some(state.model_name.clone()),
        parent: None,
        max_model_len: Some(state.max_model_len as u32),
    }];
    if let Ok(registry) = state.lora_registry() {
        for a in registry.adapters() {
            cards.push(ModelCard {
                id: a.name.clone(),
                object: "model".into(),
                created: state.created,
                owned_by: "strata".into(),
                root: Some(a.path.to_string_lossy().into_owned()),
                parent: Some(state.model_name.clone()),
                max_model_len: None,
            });
        }
    }
    json_response(&ModelList::new(cards))
}

/// `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (vLLM's): 200 with vLLM's
/// text on success; a missing field, a taken name, a full registry, a path outside every
/// `--lora-dir` or an adapter that cannot be used is a 400 naming the problem, a path
/// inside with nothing there a 404. The file
/// is read off the async threads, without holding the registry.
pub(super) async fn load_lora_adapter(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> ApiResult {
    let (_, body) = read_body(&state, req).await?;
    let parsed: LoadLoraRequest = parse_json(&body)?;
    let (name, path, base, max_rank) = {
        let registry = state.lora_registry()?;
        let (name, path) = registry.check_runtime_load(parsed)?;
        let (base, max_rank) = registry.limits();
        (name, path, base, max_rank)
    };
    let started = Instant::now();
    let (n, p) = (name.clone(), path.clone());
    let adapter = tokio::task::spawn_blocking(move || read_adapter(&n, &p, &base, max_rank))
        .await
        .map_err(|e| {
            // A panic's message stays in the log.
            tracing::error!(error = %e, "adapter loading task failed");
            ApiError::internal("Adapter loading failed (see the server log).")
        })??;
    let adapter = state.lora_registry()?.insert(adapter)?;
    tracing::info!(
        adapter = %name,
        path = %path,
        rank = adapter.rank,
        load_ms = started.elapsed().as_secs_f64() * 1e3,
        "LoRA adapter loaded"
    );
    Ok(format!("Success: LoRA adapter '{name}' added successfully.").into_response())
}

/// How long an unload waits for the requests that hold the adapter before refusing.
const UNLOAD_WAIT: Duration = Duration::from_secs(2);

/// `POST /v1/unload_lora_adapter {"lora_name"}` (vLLM's): an unknown name is a 404; an
/// adapter that requests still use is waited for (up to [`UNLOAD_WAIT`]: a request that
/// just finished may not have let go yet), then refused with a 400 that says so.
pub(super) async fn unload_lora_adapter(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> ApiResult {
    let (_, body) = read_body(&state, req).await?;
    let parsed: UnloadLoraRequest = parse_json(&body)?;
    let name = parsed.lora_name.clone().unwrap_or_default();
    let deadline = Instant::now() + UNLOAD_WAIT;
    loop {
        let result = {
            let mut registry = state.lora_registry()?;
            let busy = registry.holders(&name).is_some_and(|n| n > 0);
            if busy && Instant::now() < deadline {
                None
            } else {
                Some(registry.unload(parsed.clone()))
            }
        };
        match result {
            Some(r) => break r?,
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    tracing::info!(adapter = %name, "LoRA adapter unloaded");
    Ok(format!("Success: LoRA adapter '{name}' removed successfully.").into_response())
}

pub(super) async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.is_draining() {
        ErrorResponse(ApiError::unavailable("The server is shutting down.")).into_response()
    } else {
        StatusCode::OK.into_response()
    }
}

pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

pub(super) async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> ApiResult {
    if state.engine.reset_prefix_cache().await {
        Ok(StatusCode::OK.into_response())
    } else {
        Err(ApiError::unavailable(
            "The prefix cache cannot be reset while requests hold KV blocks; retry when idle.",
        )
        .into())
    }
}

pub(super) async fn version() -> Response {
    json_response(&serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}
