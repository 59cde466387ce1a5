//! The HTTP server of an engine that serves an encoder: `/v1/embeddings` (PROTOCOLS §9),
//! `/score`, `/rerank` and `/classify` ([`super::scoring`]), `/v1/models`, `/tokenize`,
//! `/health`, `/metrics`, `/version`. What the handlers share is [`super::state`]; bodies,
//! errors and checked inputs are [`super::http`].
//!
//! Generation routes answer a 400 that says the model is an embedding model, so a client
//! pointed at the wrong engine learns why instead of seeing a 404. Every input is checked
//! here (empty, too long, out of vocabulary) before the worker sees it, so the worker only
//! runs forwards that can succeed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use strata_api::types::{
    EmbeddingData, EmbeddingResponse, EmbeddingVector, EncodingFormat, ModelCard, ModelList,
    TokenizeResponse,
};
use strata_api::validate::{parse_json, validate_embeddings};
use strata_api::ApiError;

use super::bert::BertModel;
use super::classifier::{ClassifierConfig, SequenceClassifier};
use super::encoder::Encoder;
use super::http::{check_model, error_response, json_response, read_body, token_inputs, unix_now};
use super::scoring;
pub use super::state::EmbedState;
use super::state::InFlight;
use super::tokenizer::EmbedTokenizer;
use super::worker::{self, EmbedFailure, WorkerConfig};
use super::{EmbedError, EncoderConfig};
use crate::auth::{self, Gate};
use crate::metrics::EngineMetrics;
use crate::options::EngineOptions;
use crate::serve::{serve_with_drain, ServerError};

/// A loaded encoder and its running worker.
pub struct LoadedEncoder {
    pub state: Arc<EmbedState>,
    pub worker_thread: std::thread::JoinHandle<()>,
}

/// Loads the encoder directory `opts.model_path` (served as `opts.model_name`) and starts
/// the worker.
///
/// `--max-model-len` lowers the input limit; `--max-num-batched-tokens` is the worker's
/// tokens per forward; `--max-waiting` bounds its queue.
pub fn load(opts: &EngineOptions) -> Result<LoadedEncoder, ServerError> {
    let (dir, model_name) = (opts.model_path.as_path(), opts.model_name.as_str());
    if opts.max_num_batched_tokens == 0 || opts.max_waiting == 0 {
        return Err(ServerError::Option(
            "max-num-batched-tokens and max-waiting must be positive".into(),
        ));
    }
    opts.auth.validate().map_err(ServerError::Option)?;
    let config = EncoderConfig::from_dir(dir)?;
    let tokenizer = EmbedTokenizer::from_file(&dir.join("tokenizer.json"))?;
    let max_len = opts
        .max_model_len
        .unwrap_or(config.max_len)
        .min(config.max_len);
    if max_len == 0 {
        return Err(ServerError::Option("max-model-len must be positive".into()));
    }
    let (hidden_size, vocab_size) = (config.hidden_size, config.vocab_size);
    let model = match ClassifierConfig::from_dir(dir)? {
        None => Encoder::Embedding(Box::new(BertModel::load(dir, config)?)),
        Some(head) => Encoder::Classifier(Box::new(SequenceClassifier::load(dir, config, head)?)),
    };
    let classifier = model.classifier().cloned();
    tracing::info!(
        model = %dir.display(),
        hidden = hidden_size,
        layers = model.bert().config.num_layers,
        vocab = vocab_size,
        max_len,
        pooling = ?model.bert().config.pooling,
        labels = ?classifier.as_ref().map(|c| &c.labels),
        "encoder loaded"
    );
    let (worker, worker_thread) = worker::start(
        Arc::new(model),
        WorkerConfig {
            // A forward always holds at least one whole input.
            max_batch_tokens: opts.max_num_batched_tokens.max(max_len),
            max_waiting: opts.max_waiting,
        },
    )
    .map_err(ServerError::Serve)?;
    let state = Arc::new(EmbedState {
        model_name: model_name.to_string(),
        tokenizer,
        worker,
        metrics: Arc::new(EngineMetrics::new(model_name, 1, 1)),
        max_len,
        hidden_size,
        vocab_size,
        max_body_bytes: opts.max_body_bytes,
        created: unix_now(),
        gate: Arc::new(Gate::new(&opts.auth, &[])),
        classifier,
        in_flight: AtomicUsize::new(0),
    });
    Ok(LoadedEncoder {
        state,
        worker_thread,
    })
}

/// The HTTP routes, behind the API key (`crate::auth`).
pub fn router(state: Arc<EmbedState>) -> Router {
    Router::new()
        .route("/v1/embeddings", post(embeddings))
        .route("/score", post(scoring::score))
        .route("/v1/score", post(scoring::score))
        .route("/rerank", post(scoring::rerank))
        .route("/v1/rerank", post(scoring::rerank))
        .route("/v2/rerank", post(scoring::rerank))
        .route("/classify", post(scoring::classify))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(not_generative))
        .route("/v1/completions", post(not_generative))
        .route("/tokenize", post(tokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/version", get(version))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.gate.clone(),
            auth::guard,
        ))
        .with_state(state)
}

/// Serves `opts.model_path` on `opts.addr` until Ctrl-C or SIGTERM, then lets in-flight
/// requests finish (bounded).
pub async fn run(opts: EngineOptions) -> Result<(), ServerError> {
    let load_opts = opts.clone();
    let loaded = tokio::task::spawn_blocking(move || load(&load_opts))
        .await
        .map_err(|e| ServerError::Option(format!("model loading panicked: {e}")))??;
    let listener = tokio::net::TcpListener::bind(opts.addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: opts.addr,
            source,
        })?;
    let local = listener.local_addr().map_err(ServerError::Serve)?;
    auth::warn_if_open(&opts.auth, local);
    tracing::info!(addr = %local, model = %opts.model_name, "serving embeddings");
    let state = loaded.state.clone();
    serve_with_drain(
        listener,
        router(loaded.state.clone()),
        opts.http.clone(),
        opts.shutdown_grace,
        || {},
        move || state.in_flight.load(Ordering::SeqCst),
    )
    .await?;
    tracing::info!("stopped");
    Ok(())
}

async fn embeddings(State(state): State<Arc<EmbedState>>, req: Request) -> Response {
    let started = Instant::now();
    let _guard = InFlight::new(&state);
    match embed_request(&state, req).await {
        Ok(resp) => {
            state
                .metrics
                .prompt_tokens
                .inc_by(resp.usage.prompt_tokens.into());
            state.metrics.record_finish("stop");
            state
                .metrics
                .e2e_request_latency
                .observe(started.elapsed().as_secs_f64());
            json_response(&resp)
        }
        Err(e) => error_response(e),
    }
}

async fn embed_request(state: &EmbedState, req: Request) -> Result<EmbeddingResponse, ApiError> {
    let body = read_body(state, req).await?;
    let v = validate_embeddings(parse_json(&body)?)?;
    check_model(state, v.model.as_deref())?;
    if state.classifier.is_some() {
        return Err(scoring::not_an_embedding_model(state, "/v1/embeddings"));
    }
    if let Some(d) = v.dimensions {
        if d != state.hidden_size {
            return Err(ApiError::invalid(
                "dimensions",
                format!(
                    "The model `{}` gives {}-dimensional vectors and cannot shorten them \
                     (it is not a Matryoshka model); omit dimensions or send {}.",
                    state.model_name, state.hidden_size, state.hidden_size
                ),
            ));
        }
    }
    let inputs = token_inputs(state, &v)?;
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let vectors = state.worker.embed(inputs).await.map_err(|e| match e {
        EmbedFailure::QueueFull(n) => ApiError::unavailable(format!(
            "The server is busy ({n} embedding requests waiting); retry shortly."
        )),
        EmbedFailure::Stopped => ApiError::unavailable("The embedding worker has stopped."),
        EmbedFailure::Model(err) => {
            tracing::error!(error = %err, "embedding failed");
            ApiError::internal("The embedding forward pass failed.")
        }
    })?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(i, vec)| {
            let embedding = match v.encoding_format {
                EncodingFormat::Float => EmbeddingVector::Float(vec),
                EncodingFormat::Base64 => EmbeddingVector::Base64(base64_f32(&vec)),
            };
            EmbeddingData::new(i as u32, embedding)
        })
        .collect();
    Ok(EmbeddingResponse::new(
        state.model_name.clone(),
        data,
        u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
    ))
}

/// The little-endian `f32` bytes, base64 (standard alphabet, padded): what the OpenAI SDK
/// decodes with `np.frombuffer(base64.b64decode(s), dtype="float32")`.
pub fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

async fn models(State(state): State<Arc<EmbedState>>) -> Response {
    json_response(&ModelList::new(vec![ModelCard {
        id: state.model_name.clone(),
        object: "model".into(),
        created: state.created,
        owned_by: "strata".into(),
        root: Some(state.model_name.clone()),
        parent: None,
        max_model_len: Some(state.max_len as u32),
    }]))
}

async fn not_generative(State(state): State<Arc<EmbedState>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    if state.classifier.is_some() {
        return error_response(scoring::not_an_embedding_model(&state, &path));
    }
    error_response(ApiError::invalid(
        "model",
        format!(
            "The model `{}` is an embedding model and does not support {path}; use \
             /v1/embeddings.",
            state.model_name
        ),
    ))
}

#[derive(serde::Deserialize)]
struct TokenizeBody {
    model: Option<String>,
    prompt: String,
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

async fn tokenize(State(state): State<Arc<EmbedState>>, req: Request) -> Response {
    let result = async {
        let body = read_body(&state, req).await?;
        let t: TokenizeBody = parse_json(&body)?;
        check_model(&state, t.model.as_deref())?;
        let tokens = state
            .tokenizer
            .encode(&t.prompt, t.add_special_tokens.unwrap_or(true), None)
            .map_err(|e: EmbedError| {
                ApiError::invalid("prompt", format!("Cannot tokenize: {e}"))
            })?;
        Ok::<_, ApiError>(TokenizeResponse::new(tokens, state.max_len))
    }
    .await;
    match result {
        Ok(r) => json_response(&r),
        Err(e) => error_response(e),
    }
}

async fn health() -> Response {
    StatusCode::OK.into_response()
}

async fn metrics(State(state): State<Arc<EmbedState>>) -> Response {
    state
        .metrics
        .num_requests_waiting
        .set(state.worker.waiting() as i64);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn version() -> Response {
    json_response(&serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

async fn not_found(req: Request) -> Response {
    error_response(ApiError::not_found(format!(
        "No route for {} {}.",
        req.method(),
        req.uri().path()
    )))
}

async fn method_not_allowed(req: Request) -> Response {
    let mut e = ApiError::invalid_no_param(format!(
        "Method {} is not allowed on {}.",
        req.method(),
        req.uri().path()
    ));
    e.status = 405;
    error_response(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_little_endian_f32() {
        // 1.0f32 = 0x3f800000 -> bytes 00 00 80 3f; 0.5 -> 00 00 00 3f.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[0.5, 1.0]), "AAAAPwAAgD8=");
        assert_eq!(base64_f32(&[]), "");
    }
}
