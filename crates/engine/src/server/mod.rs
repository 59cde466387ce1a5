//! The engine's HTTP server: the OpenAI-compatible API (PROTOCOLS §1) over one model.
//!
//! Handlers validate at the edge — body size, UTF-8, JSON shape, every field's range, the
//! model name, the chat template, the context length — so that only well-formed work
//! reaches the engine thread. Each choice of a request becomes one
//! [`GenerationRequest`](crate::sequence::GenerationRequest); its events come back on its
//! own channel. Dropping the receiving end (a client that disconnects) aborts the sequence
//! and frees its blocks.
//!
//! One idea per file:
//! - `load`: the GGUF read, the KV cache sized and the engine thread started.
//! - `state`: what handlers share, and the model and token-id checks on it.
//! - `chat`, `completions`: each route's request shaping and answer shapes, over
//!   `generate`, the core both share (name the job, prepare its KV, `submit` it, then
//!   collect every choice or `stream` them).
//! - `tokenize`, `admin`: the other routes; `http`: bodies, errors and ids; `spans`: the
//!   request's trace spans. Every route is behind `crate::auth`'s keys.
//! - `events`: the KV-event sink; `disagg` and `kv_state`: prefill/decode disaggregation
//!   and the shared tier.
//!
//! This module only assembles: the router, the HTTP metrics middleware, and [`run`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use strata_api::validate::parse_json;
use strata_api::ApiError;

use crate::auth;
use crate::kv::peers::KvPeers;
use crate::kv_events;
use crate::metrics::EngineMetrics;
use crate::serve::serve_with_drain;

mod admin;
mod chat;
mod chat_tools;
mod completions;
mod disagg;
mod events;
mod generate;
mod http;
mod kv_state;
mod load;
mod spans;
mod state;
mod stream;
mod submit;
mod tokenize;

pub use crate::options::{EngineOptions, KvRole, DEFAULT_HASH_SEED};
pub use crate::serve::ServerError;
pub use disagg::{start_kv_services, KvServices};
pub use events::to_kv_events;
pub use kv_state::KvState;
pub use load::{load, Loaded};
pub use state::AppState;

/// The HTTP routes, behind the API and admin keys (`auth.rs`; a refusal is still counted
/// in the HTTP metrics).
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(admin::models))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(admin::health))
        .route("/metrics", get(admin::metrics))
        .route("/version", get(admin::version))
        .route("/reset_prefix_cache", post(admin::reset_prefix_cache))
        .route("/v1/load_lora_adapter", post(admin::load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(admin::unload_lora_adapter))
        .fallback(strata_api::http::not_found)
        .method_not_allowed_fallback(strata_api::http::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.gate.clone(),
            auth::guard,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.metrics.clone(),
            track_http,
        ))
        .with_state(state)
}

/// Counts every exchange in `http_requests_total` and `http_request_duration_seconds`
/// under its route (`none` for paths no route serves), as vLLM's server does. The time is
/// to the start of the response (a stream's headers).
async fn track_http(
    State(metrics): State<Arc<EngineMetrics>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let handler = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "none".to_string(), |p| p.as_str().to_string());
    let method = req.method().as_str().to_string();
    let started = Instant::now();
    let resp = next.run(req).await;
    metrics.record_http(&handler, &method, resp.status().as_u16(), started.elapsed());
    resp
}

/// A generative model answers embeddings requests with a 400 that says so (after reading
/// the body as JSON, as the encoder's route would), not a 404.
async fn embeddings(State(state): State<Arc<AppState>>, req: Request) -> http::ApiResult {
    let (_, body) = http::read_body(&state, req).await?;
    let _: serde_json::Value = parse_json(&body)?;
    Err(ApiError::invalid(
        "model",
        format!(
            "The model `{}` is a generative model and does not support the Embeddings API.",
            state.model_name
        ),
    )
    .into())
}

/// Serves `opts.model_path` on `opts.addr` until Ctrl-C or SIGTERM, then drains in-flight
/// requests for at most `shutdown_grace` (`--shutdown-grace-secs`), aborts what is left,
/// and returns.
pub async fn run(mut opts: EngineOptions) -> Result<(), ServerError> {
    // An encoder directory (e.g. all-minilm-l6-v2) is served by the embeddings server.
    if crate::embed::is_encoder_model(&opts.model_path) {
        return crate::embed::server::run(opts).await;
    }
    if opts.kv_role == KvRole::Prefill && opts.kv_transfer_port == 0 {
        return Err(ServerError::Option(
            "--kv-role prefill needs --kv-transfer-port: decode engines pull the prompt's KV \
             blocks from that endpoint"
                .into(),
        ));
    }
    if opts.kv_events_topic.is_none() {
        opts.kv_events_topic = Some(kv_events::topic(&opts.addr.to_string(), &opts.model_name));
    }
    let load_opts = opts.clone();
    let loaded = tokio::task::spawn_blocking(move || load(&load_opts))
        .await
        .map_err(|e| ServerError::Option(format!("model loading panicked: {e}")))??;
    let listener = bind(opts.addr).await?;
    let local = listener.local_addr().map_err(ServerError::Serve)?;
    auth::warn_if_open(&opts.auth, local);
    if opts.kv_peers == KvPeers::Any {
        tracing::warn!("--kv-peers any: requests may name any host and port for KV transfer");
    }
    let transfer = match opts.kv_transfer_port {
        0 => None,
        port => Some(bind(SocketAddr::new(opts.addr.ip(), port)).await?),
    };
    let advertise = opts
        .kv_transfer_host
        .clone()
        .unwrap_or_else(|| advertised_host(opts.addr.ip()));
    let services =
        start_kv_services(&loaded.state, transfer, &advertise).map_err(ServerError::Serve)?;
    tracing::info!(addr = %local, model = %opts.model_name, kv_role = %opts.kv_role, "serving");
    let engine = loaded.state.clone();
    let draining = loaded.state.clone();
    let served = serve_with_drain(
        listener,
        router(loaded.state.clone()),
        opts.http.clone(),
        opts.shutdown_grace,
        move || draining.engine.start_draining(),
        move || engine.engine.in_flight(),
    )
    .await;
    services.shutdown().await;
    served?;
    drop(loaded.state);
    tracing::info!("stopped");
    Ok(())
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServerError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })
}

/// The host a transfer endpoint bound to `ip` advertises by default: the bind address, or
/// loopback for a wildcard bind (which names no one address peers could use).
fn advertised_host(ip: IpAddr) -> String {
    if ip.is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        ip.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_roles_parse_and_wildcard_binds_advertise_loopback() {
        for r in [KvRole::Prefill, KvRole::Decode, KvRole::Both] {
            assert_eq!(r.as_str().parse::<KvRole>(), Ok(r));
        }
        assert!("producer".parse::<KvRole>().is_err());
        assert_eq!(advertised_host("0.0.0.0".parse().unwrap()), "127.0.0.1");
        assert_eq!(advertised_host("::".parse().unwrap()), "127.0.0.1");
        assert_eq!(advertised_host("10.1.2.3".parse().unwrap()), "10.1.2.3");
    }
}
