//! The engine's HTTP server: the OpenAI-compatible API (PROTOCOLS §1) over one model.
//!
//! Handlers validate at the edge — body size, UTF-8, JSON shape, every field's range, the
//! model name, the chat template, the context length — so that only well-formed work
//! reaches the engine thread. Each choice of a request becomes one
//! [`GenerationRequest`]; its events come back on its own channel. Dropping the receiving
//! end (a client that disconnects) aborts the sequence and frees its blocks.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use rand::Rng;
use strata_api::types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, CompletionChoice,
    CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, FinishReason as ApiFinish, ModelCard, ModelList, ResponseMessage, Role,
    StopReason, TokenizeRequest, TokenizeResponse, TopLogprob, TopLogprobMap, Usage,
};
use strata_api::validate::{
    check_context, parse_json, validate_chat, validate_completion, validate_tokenize,
    ChatMessage as ApiMessage, PromptInput, SamplingParams, StructuredOutput, TokenizeInput,
};
use strata_api::{sse, trace, ApiError};
use tokio::sync::mpsc::{self, UnboundedReceiver};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::engine::{self, EngineConfig, EngineHandle, SubmitError};
use crate::generation_config::GenerationDefaults;
use crate::gguf::{GgufFile, ModelError};
use crate::kv::block_pool::{HashKey, PoolEvent};
use crate::kv::cache::{KvCache, KvDtype};
use crate::kv::hashing::BlockHash;
use crate::kv::transfer::BlockData;
use crate::kv_events::{self, KvEvent, KvEventPublisher, KvEventsConfig};
use crate::lora::registry::read_adapter;
use crate::lora::{LoadLoraRequest, LoraAdapter, LoraOptions, LoraRegistry, UnloadLoraRequest};
use crate::metrics::{EngineMetrics, MetricLimits};
use crate::model::{Llama, WeightFormat};
use crate::sampler::SamplingConfig;
use crate::scheduler::Policy;
use crate::sequence::{FinishReason, GenerationRequest, SeqEvent, SeqTimes, TokenLogprob};
use crate::spec_decode::SpecConfig;
use crate::structured::{GrammarCompiler, GrammarState};
use crate::tokenizer::Tokenizer;

mod disagg;
pub use disagg::{start_kv_services, KvServices, KvState};

/// Engine tuning, with defaults that serve on one machine.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub weights: WeightFormat,
    /// Keep decode rows' activations in f32 (exact to the stored 4-bit weights, slower);
    /// see [`Llama::q8_decode`]. Prompt rows then stay in f32 too.
    pub exact_decode: bool,
    /// Keep prompt rows' activations in f32; see [`Llama::q8_prompt`].
    pub exact_prefill: bool,
    /// KV-cache entries: f16 or f32; `None` (auto) takes the model's default (f32 with f32
    /// weights, f16 otherwise).
    pub kv_cache_dtype: Option<KvDtype>,
    pub block_size: usize,
    /// Blocks in the KV cache; derived from `kv_cache_memory` when `None`.
    pub num_blocks: Option<usize>,
    pub kv_cache_memory: u64,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_waiting: usize,
    pub policy: Policy,
    /// Cap on prompt + output tokens; the model's context length when `None`.
    pub max_model_len: Option<usize>,
    pub seed: u64,
    pub max_body_bytes: usize,
    /// How long Ctrl-C waits for in-flight requests.
    pub shutdown_grace: Duration,
    /// Share KV blocks between requests with a common prefix.
    pub prefix_caching: bool,
    /// Seed of the prefix-cache block hashes (PROTOCOLS §3).
    pub prefix_caching_hash_seed: String,
    /// ZMQ endpoint to publish KV-cache events on (PROTOCOLS §4); off when `None`.
    pub kv_events_endpoint: Option<String>,
    /// Replay (ROUTER) endpoint for missed events.
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic; default `kv@<host:port>@<model>`.
    pub kv_events_topic: Option<String>,
    /// Prompt-lookup speculative decoding (`--speculative-config`); off when `None`.
    pub speculative: Option<SpecConfig>,
    /// Default sampling parameters (`--generation-config`): `auto` (the model's own),
    /// `vllm` (none), or a folder / JSON file.
    pub generation_config: String,
    /// Multi-LoRA (`--enable-lora` and its limits); off when `None`.
    pub lora: Option<LoraOptions>,
    /// Stall-free scheduling (`--step-time-budget-ms`): a step that carries decodes is
    /// kept near this time by sizing the prefill chunks beside them from the measured step
    /// cost (at least 256 prefill tokens a step, so prompts always progress). Zero turns it
    /// off: only `max_num_batched_tokens` bounds a step.
    pub step_time_budget_ms: u64,
    /// Disaggregated serving role (`--kv-role`, PROTOCOLS §11).
    pub kv_role: KvRole,
    /// Port of the KV block-transfer endpoint (`--kv-transfer-port`); 0 is off.
    pub kv_transfer_port: u16,
    /// Host advertised as `remote_host` (`--kv-transfer-host`); `None`: the bind host, or
    /// 127.0.0.1 for a wildcard bind.
    pub kv_transfer_host: Option<String>,
    /// How long a prefill engine keeps a finished request's blocks pinned for its decoder.
    pub kv_pin_timeout: Duration,
    /// How long a decode engine waits for a remote prefill's blocks before recomputing.
    pub kv_transfer_timeout: Duration,
    /// The machine's shared KV tier (`--kv-tier`); off when `None`.
    pub kv_tier: Option<SocketAddr>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            weights: WeightFormat::Gguf,
            exact_decode: false,
            exact_prefill: false,
            kv_cache_dtype: None,
            block_size: 16,
            num_blocks: None,
            kv_cache_memory: 1 << 30,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_waiting: 1024,
            policy: Policy::Fcfs,
            max_model_len: None,
            seed: 0,
            max_body_bytes: 8 << 20,
            shutdown_grace: Duration::from_secs(30),
            prefix_caching: true,
            prefix_caching_hash_seed: DEFAULT_HASH_SEED.to_string(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            kv_events_topic: None,
            speculative: None,
            generation_config: "auto".to_string(),
            lora: None,
            step_time_budget_ms: crate::scheduler::StepBudget::DEFAULT_TARGET_MS,
            kv_role: KvRole::Both,
            kv_transfer_port: 0,
            kv_transfer_host: None,
            kv_pin_timeout: Duration::from_secs(60),
            kv_transfer_timeout: Duration::from_millis(5000),
            kv_tier: None,
        }
    }
}

/// What part of a disaggregated deployment an engine plays (`--kv-role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvRole {
    /// Computes prompts and keeps their KV for a decode engine to pull.
    Prefill,
    /// Pulls a prompt's KV from the prefill engine a request names.
    Decode,
    /// Either, and colocated serving.
    #[default]
    Both,
}

impl KvRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        }
    }
}

impl std::fmt::Display for KvRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for KvRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            "both" => Ok(Self::Both),
            other => Err(format!(
                "unknown KV role `{other}`; expected prefill, decode or both"
            )),
        }
    }
}

/// The default block-hash seed:/// The default block-hash seed: vLLM's own default (when `PYTHONHASHSEED` is unset), so
/// a default Strata engine and a default vLLM engine in `sha256_cbor` mode name the same
/// blocks.
pub use crate::kv::hashing::DEFAULT_HASH_SEED;

/// Everything `strata engine` needs to serve.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub model_path: PathBuf,
    /// The name clients send as `model`.
    pub model_name: String,
    pub addr: SocketAddr,
    pub options: EngineOptions,
}

/// Errors that stop the server from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Encoder(#[from] crate::embed::EmbedError),
    #[error("invalid engine option: {0}")]
    Option(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("server error: {0}")]
    Serve(std::io::Error),
}

/// What the handlers share.
pub struct AppState {
    pub model_name: String,
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub engine: EngineHandle,
    pub metrics: Arc<EngineMetrics>,
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub max_body_bytes: usize,
    pub created: u64,
    /// Structured-output compiler for this model's tokenizer; `None` when the tokenizer
    /// cannot back one (such requests are then refused).
    pub grammar: Option<Arc<GrammarCompiler>>,
    /// Sampling defaults for fields a request leaves out.
    pub generation_defaults: GenerationDefaults,
    /// The loaded LoRA adapters; `None` when LoRA is off.
    pub lora: Option<std::sync::Mutex<LoraRegistry>>,
    /// Disaggregation role, transfer endpoint and tier.
    pub kv: KvState,
}

impl AppState {
    /// The adapter registry, or the 400 that says LoRA is off.
    fn lora_registry(&self) -> Result<std::sync::MutexGuard<'_, LoraRegistry>, ApiError> {
        let Some(r) = &self.lora else {
            return Err(ApiError::invalid(
                "lora_name",
                "LoRA is not enabled on this engine; start it with --enable-lora.",
            ));
        };
        Ok(r.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// What a request's `model` names: the base model (`None`, or its name) or a loaded
    /// adapter; anything else is a 404 like vLLM's.
    fn resolve_model(&self, model: Option<&str>) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
        match model {
            None => Ok(None),
            Some(m) if m == self.model_name => Ok(None),
            Some(m) => self
                .lora
                .as_ref()
                .and_then(|r| r.lock().unwrap_or_else(|e| e.into_inner()).get(m))
                .map(Some)
                .ok_or_else(|| ApiError::model_not_found(m)),
        }
    }
}

/// A loaded model and a running engine thread, ready to serve.
pub struct Loaded {
    pub state: Arc<AppState>,
    pub engine_thread: std::thread::JoinHandle<()>,
}

/// Loads the model, tokenizer and template from the GGUF and starts the engine thread.
pub fn load(
    model_path: &std::path::Path,
    model_name: &str,
    opts: &EngineOptions,
) -> Result<Loaded, ServerError> {
    if opts.block_size == 0 || opts.max_num_seqs == 0 || opts.max_num_batched_tokens == 0 {
        return Err(ServerError::Option(
            "block size, max-num-seqs and max-num-batched-tokens must be positive".into(),
        ));
    }
    let mut file = GgufFile::open(model_path)?;
    let tokenizer =
        Tokenizer::from_gguf(&file.content).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let template = ChatTemplate::from_gguf(&file.content)
        .map_err(|e| ModelError::Tokenizer(format!("chat template: {e}")))?;
    let generation_defaults =
        GenerationDefaults::resolve(&opts.generation_config, model_path, &file.content.metadata)
            .map_err(|e| ServerError::Option(e.to_string()))?;
    if !generation_defaults.is_empty() {
        tracing::info!(defaults = ?generation_defaults, "default sampling parameters");
    }
    let mut model = Llama::from_gguf(&mut file, opts.weights)?;
    model.q8_decode &= !opts.exact_decode;
    model.q8_prompt &= !opts.exact_prefill;
    let lora = match &opts.lora {
        None => None,
        Some(l) => Some(load_lora_modules(l, &model, model_name)?),
    };
    let cfg = &model.config;
    let kv_dtype = opts
        .kv_cache_dtype
        .unwrap_or_else(|| model.default_kv_dtype());
    let bytes_per_block = KvCache::bytes_per_block(
        cfg.n_layer,
        opts.block_size,
        model.kv_slot_width(),
        kv_dtype,
    );
    let num_blocks = opts
        .num_blocks
        .unwrap_or((opts.kv_cache_memory / bytes_per_block as u64) as usize);
    if num_blocks == 0 {
        return Err(ServerError::Option(format!(
            "the KV cache holds no block ({bytes_per_block} bytes each); raise --kv-cache-memory"
        )));
    }
    let max_model_len = opts
        .max_model_len
        .unwrap_or(cfg.context_len)
        .min(cfg.context_len)
        .min(num_blocks * opts.block_size);
    let vocab_size = cfg.vocab_size;
    tracing::info!(
        model = %model_path.display(),
        weights = %opts.weights,
        q8_decode = model.q8_decode,
        q8_prompt = model.q8_prompt && model.q8_decode,
        layers = cfg.n_layer,
        vocab = cfg.vocab_size,
        num_blocks,
        block_size = opts.block_size,
        kv_cache_bytes = num_blocks * bytes_per_block,
        kv_cache_dtype = %kv_dtype,
        max_model_len,
        "model loaded"
    );
    let metrics = Arc::new(EngineMetrics::with_limits(
        model_name,
        MetricLimits {
            block_size: opts.block_size,
            num_blocks,
            max_model_len,
            max_num_batched_tokens: opts.max_num_batched_tokens,
        },
    ));
    let kv_events = kv_event_sink(opts, model_name)?;
    let tokenizer = Arc::new(tokenizer);
    let grammar = match GrammarCompiler::new(tokenizer.clone()) {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            tracing::warn!(error = %e, "structured outputs disabled");
            None
        }
    };
    // The tier gets copies of evicted blocks; the offloader that sends them starts with
    // the async services (`start_kv_services`).
    let (evicted_tx, evicted_rx) = match opts.kv_tier {
        Some(_) if opts.prefix_caching => {
            let (tx, rx) = tokio::sync::mpsc::channel(disagg::EVICTED_QUEUE);
            (Some(tx), Some(rx))
        }
        Some(tier) => {
            tracing::warn!(%tier, "--kv-tier is ignored without prefix caching");
            (None, None)
        }
        None => (None, None),
    };
    let (handle, engine_thread) = engine::start(
        Arc::new(model),
        tokenizer.clone(),
        EngineConfig {
            block_size: opts.block_size,
            num_blocks,
            kv_dtype,
            max_num_seqs: opts.max_num_seqs,
            max_num_batched_tokens: opts.max_num_batched_tokens,
            max_waiting: opts.max_waiting,
            policy: opts.policy,
            seed: opts.seed,
            prefix_caching: opts.prefix_caching,
            hash_seed: opts.prefix_caching_hash_seed.clone(),
            speculative: opts.speculative,
            max_loras: opts.lora.as_ref().map(|l| l.max_loras),
            step_time_budget: (opts.step_time_budget_ms > 0)
                .then(|| Duration::from_millis(opts.step_time_budget_ms)),
            pin_timeout: opts.kv_pin_timeout,
            weights_path: Some(model_path.to_path_buf()),
        },
        metrics.clone(),
        kv_events,
        evicted_tx,
    );
    let state = Arc::new(AppState {
        model_name: model_name.to_string(),
        tokenizer,
        template,
        engine: handle,
        metrics,
        vocab_size,
        max_model_len,
        max_body_bytes: opts.max_body_bytes,
        created: unix_now(),
        grammar,
        generation_defaults,
        lora: lora.map(std::sync::Mutex::new),
        kv: KvState::new(opts, evicted_rx),
    });
    Ok(Loaded {
        state,
        engine_thread,
    })
}

/// The registry with the `--lora-modules` adapters loaded; an adapter that cannot be used
/// stops the start-up with what is wrong with it.
fn load_lora_modules(
    l: &LoraOptions,
    model: &Llama,
    model_name: &str,
) -> Result<LoraRegistry, ServerError> {
    l.validate().map_err(ServerError::Option)?;
    let mut registry = LoraRegistry::new(
        model.config.clone(),
        model_name,
        l.max_lora_rank,
        l.cpu_loras(),
    );
    for m in &l.modules {
        let started = Instant::now();
        let adapter = registry
            .load(LoadLoraRequest {
                lora_name: Some(m.name.clone()),
                lora_path: Some(m.path.clone()),
            })
            .map_err(|e| {
                ServerError::Option(format!("--lora-modules {}: {}", m.name, e.message))
            })?;
        tracing::info!(
            adapter = %adapter.name,
            path = %m.path,
            rank = adapter.rank,
            targets = adapter.targets().count(),
            load_ms = started.elapsed().as_secs_f64() * 1e3,
            "LoRA adapter loaded"
        );
    }
    Ok(registry)
}

/// The KV-event publisher, when an endpoint is configured.
fn kv_event_sink(
    opts: &EngineOptions,
    model_name: &str,
) -> Result<Option<engine::KvEventSink>, ServerError> {
    let Some(endpoint) = &opts.kv_events_endpoint else {
        return Ok(None);
    };
    let topic = opts
        .kv_events_topic
        .clone()
        .unwrap_or_else(|| kv_events::topic("localhost", model_name));
    let (publisher, addrs) = KvEventPublisher::start(KvEventsConfig {
        endpoint: endpoint.clone(),
        replay_endpoint: opts.kv_events_replay_endpoint.clone(),
        topic: topic.clone(),
        ..KvEventsConfig::default()
    })
    .map_err(|e| ServerError::Option(format!("KV events: {e}")))?;
    tracing::info!(publisher = %addrs.publisher, replay = ?addrs.replay, %topic, "publishing KV events");
    Ok(Some(Box::new(move |events, block_size| {
        publisher.publish(to_kv_events(events, block_size));
    })))
}

/// Pool changes as vLLM KV events: consecutive stores of a chain on one medium become one
/// BlockStored, consecutive removals from one medium one BlockRemoved. The engine's own
/// cache is `medium: "GPU"` (vLLM's name for the primary tier, on CPU too); blocks it
/// offloaded to the shared tier are `"CPU"`.
pub fn to_kv_events(events: Vec<PoolEvent>, block_size: usize) -> Vec<KvEvent> {
    let wire = |h: &HashKey| BlockHash(*h).to_u64();
    let mut out: Vec<KvEvent> = Vec::new();
    for ev in events {
        let (stored, medium) = match ev {
            PoolEvent::Stored {
                hash,
                parent,
                tokens,
                lora,
            } => ((hash, parent, tokens, lora), kv_events::MEDIUM_GPU),
            PoolEvent::TierStored {
                hash,
                parent,
                tokens,
                lora,
            } => ((hash, parent, tokens, lora), kv_events::MEDIUM_CPU),
            PoolEvent::Removed { hash } => {
                push_removed(&mut out, wire(&hash), kv_events::MEDIUM_GPU);
                continue;
            }
            PoolEvent::TierRemoved { hash } => {
                push_removed(&mut out, wire(&hash), kv_events::MEDIUM_CPU);
                continue;
            }
            PoolEvent::Cleared => {
                out.push(KvEvent::AllBlocksCleared);
                continue;
            }
        };
        let (hash, parent, tokens, lora) = stored;
        if let Some(KvEvent::BlockStored {
            block_hashes,
            token_ids,
            lora_name,
            medium: last_medium,
            ..
        }) = out.last_mut()
        {
            if parent.as_ref().map(wire) == block_hashes.last().copied()
                && lora_name.as_deref() == lora.as_ref().map(|l| l.name.as_str())
                && last_medium.as_deref() == Some(medium)
            {
                block_hashes.push(wire(&hash));
                token_ids.extend_from_slice(&tokens);
                continue;
            }
        }
        out.push(KvEvent::BlockStored {
            block_hashes: vec![wire(&hash)],
            parent_block_hash: parent.as_ref().map(wire),
            token_ids: tokens,
            block_size,
            lora_id: lora.as_ref().map(|l| l.id),
            medium: Some(medium.to_string()),
            lora_name: lora.map(|l| l.name),
        });
    }
    out
}

/// Appends a removal, joining the previous BlockRemoved of the same medium.
fn push_removed(out: &mut Vec<KvEvent>, hash: u64, medium: &str) {
    if let Some(KvEvent::BlockRemoved {
        block_hashes,
        medium: last,
    }) = out.last_mut()
    {
        if last.as_deref() == Some(medium) {
            block_hashes.push(hash);
            return;
        }
    }
    out.push(KvEvent::BlockRemoved {
        block_hashes: vec![hash],
        medium: Some(medium.to_string()),
    });
}

/// The HTTP routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/version", get(version))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .fallback(strata_api::http::not_found)
        .method_not_allowed_fallback(strata_api::http::method_not_allowed)
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

/// How long connections may stay open once the drain is over (answers being written).
const SHUTDOWN_LINGER: Duration = Duration::from_millis(500);

/// Serves until Ctrl-C or SIGTERM, then drains in-flight requests for at most
/// `shutdown_grace` (`--shutdown-grace-secs`), aborts what is left, and returns.
pub async fn run(config: ServerConfig) -> Result<(), ServerError> {
    // An encoder directory (e.g. all-minilm-l6-v2) is served by the embeddings server.
    if crate::embed::is_encoder_model(&config.model_path) {
        return crate::embed::server::run(config).await;
    }
    let mut opts = config.options.clone();
    if opts.kv_role == KvRole::Prefill && opts.kv_transfer_port == 0 {
        return Err(ServerError::Option(
            "--kv-role prefill needs --kv-transfer-port: decode engines pull the prompt's KV \
             blocks from that endpoint"
                .into(),
        ));
    }
    if opts.kv_events_topic.is_none() {
        opts.kv_events_topic = Some(kv_events::topic(
            &config.addr.to_string(),
            &config.model_name,
        ));
    }
    let path = config.model_path.clone();
    let name = config.model_name.clone();
    let loaded = tokio::task::spawn_blocking(move || load(&path, &name, &opts))
        .await
        .map_err(|e| ServerError::Option(format!("model loading panicked: {e}")))??;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: config.addr,
            source,
        })?;
    let local = listener.local_addr().map_err(ServerError::Serve)?;
    let transfer = match config.options.kv_transfer_port {
        0 => None,
        port => {
            let addr = SocketAddr::new(config.addr.ip(), port);
            Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServerError::Bind { addr, source })?,
            )
        }
    };
    let advertise = config
        .options
        .kv_transfer_host
        .clone()
        .unwrap_or_else(|| advertised_host(config.addr.ip()));
    let services =
        start_kv_services(&loaded.state, transfer, &advertise).map_err(ServerError::Serve)?;
    tracing::info!(addr = %local, model = %config.model_name, kv_role = %config.options.kv_role, "serving");
    let engine = loaded.state.clone();
    let draining = loaded.state.clone();
    let served = serve_with_drain(
        listener,
        router(loaded.state.clone()),
        config.options.shutdown_grace,
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

/// The host a transfer endpoint bound to `ip` advertises by default: the bind address, or
/// loopback for a wildcard bind (which names no one address peers could use).
fn advertised_host(ip: std::net::IpAddr) -> String {
    if ip.is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        ip.to_string()
    }
}

/// Serves `app` until Ctrl-C or SIGTERM, then drains: `start_draining`, a wait of up to
/// `grace` while `in_flight()` is above zero, then at most [`SHUTDOWN_LINGER`] for open
/// connections to close. One whose stream is still running (past the grace) or whose client
/// stopped reading must not hold the process: what is left is aborted by dropping the
/// server, which drops every handler and so closes each sequence's channel; the engine
/// thread frees their blocks at its next step.
pub(crate) async fn serve_with_drain(
    listener: tokio::net::TcpListener,
    app: Router,
    grace: Duration,
    start_draining: impl FnOnce() + Send + 'static,
    in_flight: impl Fn() -> usize + Send + 'static,
) -> Result<(), ServerError> {
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown_signal().await;
        tracing::info!(
            grace_secs = grace.as_secs_f64(),
            "shutting down: draining in-flight requests"
        );
        start_draining();
        let deadline = Instant::now() + grace;
        while in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if in_flight() > 0 {
            tracing::warn!(left = in_flight(), "grace period over; aborting the rest");
        }
        let _ = drained_tx.send(());
    };
    let mut server = std::pin::pin!(axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .into_future());
    tokio::select! {
        r = &mut server => r.map_err(ServerError::Serve)?,
        _ = drained_rx => {
            match tokio::time::timeout(SHUTDOWN_LINGER, &mut server).await {
                Ok(r) => r.map_err(ServerError::Serve)?,
                Err(_) => tracing::warn!("connections still open after the grace period; closing them"),
            }
        }
    }
    Ok(())
}

use strata_api::http::shutdown_signal;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn random_id(prefix: &str) -> String {
    let n: u128 = rand::rng().random();
    format!("{prefix}-{n:032x}")
}

/// An OpenAI-shaped error response.
struct ErrorResponse(ApiError);

impl From<ApiError> for ErrorResponse {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        strata_api::http::error_response(&self.0, None)
    }
}

type ApiResult = Result<Response, ErrorResponse>;

async fn read_body(state: &AppState, req: Request) -> Result<(HeaderMap, Bytes), ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, state.max_body_bytes)
        .await
        .map_err(|_| {
            ApiError::too_large(format!(
                "The request body exceeds the limit of {} bytes.",
                state.max_body_bytes
            ))
        })?;
    Ok((parts.headers, bytes))
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    state.resolve_model(model).map(|_| ())
}

fn check_token_ids(state: &AppState, ids: &[u32], param: &str) -> Result<(), ApiError> {
    match ids.iter().find(|&&t| t as usize >= state.vocab_size) {
        Some(bad) => Err(ApiError::invalid(
            param,
            format!(
                "Token id {bad} is out of vocabulary (size {}).",
                state.vocab_size
            ),
        )),
        None => Ok(()),
    }
}

fn request_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 256)
        .map(str::to_string)
}

fn sampling_config(p: &SamplingParams) -> SamplingConfig {
    SamplingConfig {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        logprobs: p.logprobs,
        ignore_eos: p.ignore_eos,
        min_tokens: p.min_tokens,
        stop_token_ids: p.stop_token_ids.clone(),
        logit_bias: p.logit_bias.clone(),
    }
}

/// A validated generation, ready to submit: one sequence per choice.
struct Job {
    id: String,
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingParams,
    /// The adapter `model` named; `None` for the base model.
    lora: Option<Arc<LoraAdapter>>,
    /// Prefill for a remote decoder: the pin its blocks are kept under.
    pin: Option<String>,
}

fn check_sampling_ids(state: &AppState, p: &SamplingParams) -> Result<(), ApiError> {
    check_token_ids(state, &p.stop_token_ids, "stop_token_ids")?;
    let bias_ids: Vec<u32> = p.logit_bias.iter().map(|(t, _)| *t).collect();
    check_token_ids(state, &bias_ids, "logit_bias")
}

/// Submits every choice; on failure nothing stays queued (dropping the receivers aborts
/// any that were accepted).
///
/// `imported` (blocks fetched from a peer or the tier) ride with the first choice: the
/// others find them cached once it is admitted.
fn submit(
    state: &AppState,
    job: &Job,
    mut imported: Vec<BlockData>,
) -> Result<Vec<UnboundedReceiver<SeqEvent>>, ApiError> {
    // Compile every choice's grammar before queueing anything, so a schema that cannot be
    // enforced is a 400 with nothing submitted.
    let mut grammars = Vec::new();
    if let Some(constraint) = &job.sampling.structured {
        for _ in 0..job.sampling.n {
            grammars.push(Box::new(compile_constraint(state, constraint)?));
        }
    }
    let mut grammars = grammars.into_iter();
    let mut receivers = Vec::with_capacity(job.sampling.n as usize);
    for i in 0..job.sampling.n {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut sampling = sampling_config(&job.sampling);
        // Each choice gets its own stream of randomness, reproducible under a seed.
        sampling.seed = job.sampling.seed.map(|s| s.wrapping_add(i as u64));
        let req = GenerationRequest {
            request_id: format!("{}-{i}", job.id),
            prompt: job.prompt.clone(),
            sampling,
            max_tokens: job.max_tokens,
            stop: job.sampling.stop.clone(),
            include_stop_str_in_output: job.sampling.include_stop_str_in_output,
            skip_special_tokens: job.sampling.skip_special_tokens,
            priority: job.sampling.priority,
            cache_salt: job.sampling.cache_salt.clone(),
            arrival: Instant::now(),
            events: tx,
            grammar: grammars.next(),
            speculative: job.sampling.speculative,
            lora: job.lora.clone(),
            imported: std::mem::take(&mut imported),
            pin: job.pin.clone(),
        };
        state.engine.submit(req).map_err(|e| match e {
            SubmitError::QueueFull(_) => ApiError::rate_limited(
                "The server is overloaded: too many requests are waiting. Retry later.",
            ),
            SubmitError::ShuttingDown => ApiError::unavailable("The server is shutting down."),
        })?;
        receivers.push(rx);
    }
    state
        .metrics
        .record_params(job.sampling.n as usize, job.max_tokens);
    Ok(receivers)
}

/// Checks the request's `kv_transfer_params` / `x-prefiller-host-port` (a 400 for what
/// this engine cannot honour), then fetches what it can of the prompt's KV: from the
/// prefill engine named, or from the tier. Sets the job's pin for a remote decoder.
async fn prepare_kv(
    state: &AppState,
    job: &mut Job,
    params: Option<&strata_api::types::KvTransferParams>,
    headers: &HeaderMap,
    stream: bool,
    path: &str,
    body: &Bytes,
) -> Result<Vec<BlockData>, ApiError> {
    let plan = disagg::plan(state, params, headers, stream, job.sampling.n, &job.id)?;
    let prompt = disagg::PromptRef {
        tokens: &job.prompt,
        salt: job.sampling.cache_salt.as_deref(),
        lora: job.lora.as_ref().map(|a| a.name.as_str()),
        path,
        body,
    };
    let prepared = disagg::prepare(state, &plan, prompt).await;
    job.pin = prepared.pin;
    Ok(prepared.imported)
}

/// The top-level `kv_transfer_params` of a request prefilled for a remote decoder.
fn prefill_answer(
    state: &AppState,
    job: &Job,
    collected: &[Collected],
) -> Option<strata_api::types::KvTransferParams> {
    let pin = job.pin.as_deref()?;
    let blocks = collected
        .first()
        .map(|c| c.pinned_blocks.as_slice())
        .unwrap_or_default();
    Some(disagg::prefill_answer(state, pin, blocks))
}

/// A request's structured-output constraint, compiled for this model; what cannot be
/// enforced is a 400 naming it.
fn compile_constraint(
    state: &AppState,
    constraint: &StructuredOutput,
) -> Result<GrammarState, ApiError> {
    let param = match constraint {
        StructuredOutput::JsonObject | StructuredOutput::JsonSchema { .. } => "response_format",
        StructuredOutput::Regex(_) => "guided_regex",
        StructuredOutput::Choice(_) => "guided_choice",
    };
    let Some(compiler) = &state.grammar else {
        return Err(ApiError::invalid(
            param,
            "Structured outputs are not available for this model's tokenizer.",
        ));
    };
    compiler
        .compile(constraint)
        .map_err(|e| ApiError::invalid(param, format!("This constraint cannot be enforced: {e}")))
}

/// One choice's collected output.
#[derive(Default)]
struct Collected {
    text: String,
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    stop: Option<String>,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
    times: Option<SeqTimes>,
    /// Blocks kept for a remote decoder (`do_remote_decode`).
    pinned_blocks: Vec<u32>,
}

/// The request's trace span, child of the caller's `traceparent` (a malformed one starts a
/// new trace). Exported only when the binary exports traces; otherwise disabled.
fn trace_span(headers: &HeaderMap, route: &'static str) -> tracing::Span {
    let span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        "engine.request",
        otel.kind = "server",
        http.route = route
    );
    trace::accept(&span, headers.get(trace::TRACEPARENT).map(|v| v.as_bytes()));
    span
}

/// One choice's queue, prefill and decode as child spans of the request's, from the
/// engine thread's timestamps (taken there, emitted here once the choice is over).
fn trace_phases(
    span: &tracing::Span,
    choice: usize,
    t: &SeqTimes,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
) {
    if !trace::exporting() {
        return;
    }
    let choice = ("choice", choice as i64);
    let end = t.first_scheduled.unwrap_or_else(Instant::now);
    trace::record_child(
        span,
        trace::ChildSpan {
            name: "engine.queue",
            start: t.arrival,
            end,
            attributes: &[choice],
        },
    );
    let (Some(scheduled), Some(first)) = (t.first_scheduled, t.first_token) else {
        return;
    };
    trace::record_child(
        span,
        trace::ChildSpan {
            name: "engine.prefill",
            start: scheduled,
            end: first,
            attributes: &[
                choice,
                ("prompt_tokens", prompt_tokens as i64),
                ("cached_tokens", cached_tokens as i64),
            ],
        },
    );
    trace::record_child(
        span,
        trace::ChildSpan {
            name: "engine.decode",
            start: first,
            end: t.last_token.unwrap_or(first),
            attributes: &[choice, ("completion_tokens", completion_tokens as i64)],
        },
    );
}

async fn collect(mut rx: UnboundedReceiver<SeqEvent>) -> Collected {
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token {
                token,
                text,
                logprob,
            } => {
                c.text.push_str(&text);
                c.tokens.push(token);
                if let Some(lp) = logprob {
                    c.logprobs.push(lp);
                }
            }
            SeqEvent::Finished {
                reason,
                stop,
                text,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                times,
                pinned_blocks,
            } => {
                c.pinned_blocks = pinned_blocks;
                c.text.push_str(&text);
                c.times = Some(times);
                c.finish = Some(reason);
                c.stop = stop;
                c.prompt_tokens = prompt_tokens;
                c.completion_tokens = completion_tokens;
                c.cached_tokens = cached_tokens;
                break;
            }
        }
    }
    if c.finish.is_none() {
        c.finish = Some(FinishReason::Error("the engine stopped".into()));
    }
    c
}

fn api_finish(r: &FinishReason) -> ApiFinish {
    match r {
        FinishReason::Stop => ApiFinish::Stop,
        FinishReason::Length => ApiFinish::Length,
        FinishReason::Abort => ApiFinish::Abort,
        FinishReason::Error(_) => ApiFinish::Error,
    }
}

fn stop_reason(stop: &Option<String>) -> Option<StopReason> {
    stop.as_ref().map(|s| StopReason::Text(s.clone()))
}

fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

fn chat_logprobs(tok: &Tokenizer, tokens: &[u32], lps: &[TokenLogprob]) -> ChatLogprobs {
    let content = tokens
        .iter()
        .zip(lps)
        .map(|(&id, lp)| ChatTokenLogprob {
            token: token_text(tok, id),
            logprob: strata_api::types::finite_logprob(lp.logprob),
            bytes: tok.token_bytes(id).ok(),
            top_logprobs: lp
                .top
                .iter()
                .map(|&(t, l)| TopLogprob {
                    token: token_text(tok, t),
                    logprob: strata_api::types::finite_logprob(l),
                    bytes: tok.token_bytes(t).ok(),
                })
                .collect(),
        })
        .collect();
    ChatLogprobs {
        content: Some(content),
    }
}

fn completion_logprobs(
    tok: &Tokenizer,
    tokens: &[u32],
    lps: &[TokenLogprob],
    offset: usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut at = offset;
    for (&id, lp) in tokens.iter().zip(lps) {
        let text = token_text(tok, id);
        out.text_offset.push(at as u32);
        at += text.len();
        out.tokens.push(text);
        out.token_logprobs
            .push(Some(strata_api::types::finite_logprob(lp.logprob)));
        out.top_logprobs.push(Some(TopLogprobMap(
            lp.top
                .iter()
                .map(|&(t, l)| (token_text(tok, t), strata_api::types::finite_logprob(l)))
                .collect(),
        )));
    }
    out
}

fn usage_of(collected: &[Collected]) -> Usage {
    let prompt = collected.first().map(|c| c.prompt_tokens).unwrap_or(0);
    let completion: usize = collected.iter().map(|c| c.completion_tokens).sum();
    let cached = collected.first().map(|c| c.cached_tokens).unwrap_or(0);
    let usage = Usage::new(prompt as u32, completion as u32);
    if cached > 0 {
        usage.with_cached_tokens(cached as u32)
    } else {
        usage
    }
}

fn json_response<T: serde::Serialize>(value: &T) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => ErrorResponse(ApiError::internal(format!("cannot encode response: {e}")))
            .into_response(),
    }
}

/// One SSE stream over every choice of a request.
///
/// `encode(Some((choice, event)))` turns an event into SSE lines; `encode(None)` gives the
/// lines that go before `[DONE]` (the usage chunk).
fn sse_response(
    receivers: Vec<UnboundedReceiver<SeqEvent>>,
    mut encode: impl FnMut(Option<(usize, SeqEvent)>) -> Vec<String> + Send + 'static,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut streams =
            futures_util::stream::select_all(receivers.into_iter().enumerate().map(|(i, rx)| {
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |ev| (i, ev))
            }));
        loop {
            tokio::select! {
                // The client went away: dropping the receivers aborts the sequences.
                _ = tx.closed() => return,
                next = streams.next() => {
                    let Some((i, ev)) = next else { break };
                    for line in encode(Some((i, ev))) {
                        if tx.send(Ok(Bytes::from(line))).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
        for line in encode(None) {
            if tx.send(Ok(Bytes::from(line))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(sse::DONE.as_bytes()))).await;
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn chat_completions(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let span = trace_span(req.headers(), "/v1/chat/completions");
    let (headers, body) = read_body(&state, req).await?;
    let mut parsed: ChatCompletionRequest = parse_json(&body)?;
    state.generation_defaults.apply_chat(&mut parsed);
    let kv_params = parsed.kv_transfer_params.take();
    let chat = validate_chat(parsed)?;
    let lora = state.resolve_model(chat.model.as_deref())?;
    check_sampling_ids(&state, &chat.sampling)?;
    let messages: Vec<ChatMessage> = chat.messages.iter().map(to_template_message).collect();
    let prompt_text = state
        .template
        .render(&messages, chat.add_generation_prompt)
        .map_err(|e| ApiError::invalid("messages", format!("Chat template error: {e}")))?;
    let prompt = state
        .tokenizer
        .encode(&prompt_text, chat.add_special_tokens, true)
        .map_err(|e| ApiError::invalid("messages", format!("Cannot tokenize: {e}")))?;
    let max_tokens = check_context(
        prompt.len(),
        chat.sampling.max_tokens,
        state.max_model_len,
        "messages",
    )?;
    let mut job = Job {
        id: request_id(&headers)
            .map(|r| format!("chatcmpl-{r}"))
            .unwrap_or_else(|| random_id("chatcmpl")),
        prompt,
        max_tokens: max_tokens as usize,
        sampling: chat.sampling.clone(),
        lora,
        pin: None,
    };
    let imported = prepare_kv(
        &state,
        &mut job,
        kv_params.as_ref(),
        &headers,
        chat.stream,
        "/v1/chat/completions",
        &body,
    )
    .await?;
    let receivers = submit(&state, &job, imported)?;
    let created = unix_now();
    // Answers name what was asked for: the adapter, or the base model.
    let model = served_name(&state, &job);
    let echo_prefix = match (chat.echo, chat.messages.last()) {
        (true, Some(m)) if m.role == Role::Assistant => m.content.clone(),
        _ => String::new(),
    };

    if !chat.stream {
        let mut collected = Vec::new();
        for rx in receivers {
            collected.push(collect(rx).await);
        }
        for (i, c) in collected.iter().enumerate() {
            if let Some(t) = &c.times {
                trace_phases(
                    &span,
                    i,
                    t,
                    c.prompt_tokens,
                    c.completion_tokens,
                    c.cached_tokens,
                );
            }
        }
        if let Some(FinishReason::Error(e)) = collected.iter().find_map(|c| match &c.finish {
            Some(FinishReason::Error(e)) => Some(FinishReason::Error(e.clone())),
            _ => None,
        }) {
            return Err(ApiError::internal(format!("generation failed: {e}")).into());
        }
        let usage = usage_of(&collected);
        let choices = collected
            .iter()
            .enumerate()
            .map(|(i, c)| ChatChoice {
                index: i as u32,
                message: ResponseMessage::assistant(format!("{echo_prefix}{}", c.text)),
                logprobs: job
                    .sampling
                    .logprobs
                    .map(|_| chat_logprobs(&state.tokenizer, &c.tokens, &c.logprobs)),
                finish_reason: c.finish.as_ref().map(api_finish),
                stop_reason: stop_reason(&c.stop),
            })
            .collect();
        let mut resp = ChatCompletionResponse::new(job.id.clone(), created, model, choices, usage);
        resp.kv_transfer_params = prefill_answer(&state, &job, &collected);
        return Ok(json_response(&resp));
    }

    let n = receivers.len();
    let tok = state.tokenizer.clone();
    let want_logprobs = job.sampling.logprobs.is_some();
    let include_usage = chat.include_usage;
    let id = job.id.clone();
    let mut started = vec![false; n];
    let mut prompt_tokens = 0usize;
    let mut completion_tokens = 0usize;
    let chunk = move |choices: Vec<ChatChunkChoice>| {
        sse::encode_json(&ChatCompletionChunk::new(
            id.clone(),
            created,
            model.clone(),
            choices,
        ))
        .unwrap_or_default()
    };
    let (usage_id, usage_model) = (job.id.clone(), served_name(&state, &job));
    let encode = move |event: Option<(usize, SeqEvent)>| -> Vec<String> {
        let Some((i, ev)) = event else {
            if !include_usage {
                return Vec::new();
            }
            return vec![sse::encode_json(&ChatCompletionChunk::usage_only(
                usage_id.clone(),
                created,
                usage_model.clone(),
                Usage::new(prompt_tokens as u32, completion_tokens as u32),
            ))
            .unwrap_or_default()];
        };
        let mut out = Vec::new();
        if !started[i] {
            started[i] = true;
            out.push(chunk(vec![ChatChunkChoice {
                index: i as u32,
                delta: ChatDelta {
                    role: Some(Role::Assistant),
                    content: Some(echo_prefix.clone()),
                    ..Default::default()
                },
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }]));
        }
        match ev {
            SeqEvent::Token {
                token,
                text,
                logprob,
            } => {
                let logprobs = match (want_logprobs, logprob) {
                    (true, Some(lp)) => Some(chat_logprobs(&tok, &[token], &[lp])),
                    _ => None,
                };
                if !text.is_empty() || logprobs.is_some() {
                    out.push(chunk(vec![ChatChunkChoice {
                        index: i as u32,
                        delta: ChatDelta {
                            content: Some(text),
                            ..Default::default()
                        },
                        logprobs,
                        finish_reason: None,
                        stop_reason: None,
                    }]));
                }
            }
            SeqEvent::Finished {
                reason,
                stop,
                text,
                prompt_tokens: p,
                completion_tokens: c,
                cached_tokens,
                times,
                ..
            } => {
                trace_phases(&span, i, &times, p, c, cached_tokens);
                prompt_tokens = p;
                completion_tokens += c;
                out.push(chunk(vec![ChatChunkChoice {
                    index: i as u32,
                    delta: ChatDelta {
                        content: (!text.is_empty()).then_some(text),
                        ..Default::default()
                    },
                    logprobs: None,
                    finish_reason: Some(api_finish(&reason)),
                    stop_reason: stop_reason(&stop),
                }]));
            }
        }
        out
    };
    Ok(sse_response(receivers, encode))
}

fn to_template_message(m: &ApiMessage) -> ChatMessage {
    ChatMessage {
        role: m.role.as_str().to_string(),
        content: m.content.clone(),
    }
}

async fn completions(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let span = trace_span(req.headers(), "/v1/completions");
    let (headers, body) = read_body(&state, req).await?;
    let mut parsed: CompletionRequest = parse_json(&body)?;
    state.generation_defaults.apply_completion(&mut parsed);
    let kv_params = parsed.kv_transfer_params.take();
    let c = validate_completion(parsed)?;
    let lora = state.resolve_model(c.model.as_deref())?;
    check_sampling_ids(&state, &c.sampling)?;
    let prompt = match &c.prompt {
        PromptInput::Text(t) => state
            .tokenizer
            .encode(t, c.add_special_tokens, false)
            .map_err(|e| ApiError::invalid("prompt", format!("Cannot tokenize: {e}")))?,
        PromptInput::Tokens(ids) => {
            check_token_ids(&state, ids, "prompt")?;
            ids.clone()
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "The prompt is empty after tokenization.").into());
    }
    let max_tokens = check_context(
        prompt.len(),
        c.sampling.max_tokens.or(Some(16)),
        state.max_model_len,
        "prompt",
    )?;
    let echo_text = if c.echo {
        match &c.prompt {
            PromptInput::Text(t) => t.clone(),
            PromptInput::Tokens(ids) => state.tokenizer.decode(ids, false).unwrap_or_default(),
        }
    } else {
        String::new()
    };
    let mut job = Job {
        id: request_id(&headers)
            .map(|r| format!("cmpl-{r}"))
            .unwrap_or_else(|| random_id("cmpl")),
        prompt,
        max_tokens: max_tokens as usize,
        sampling: c.sampling.clone(),
        lora,
        pin: None,
    };
    let imported = prepare_kv(
        &state,
        &mut job,
        kv_params.as_ref(),
        &headers,
        c.stream,
        "/v1/completions",
        &body,
    )
    .await?;
    let receivers = submit(&state, &job, imported)?;
    let created = unix_now();
    let model = served_name(&state, &job);

    if !c.stream {
        let mut collected = Vec::new();
        for rx in receivers {
            collected.push(collect(rx).await);
        }
        for (i, c) in collected.iter().enumerate() {
            if let Some(t) = &c.times {
                trace_phases(
                    &span,
                    i,
                    t,
                    c.prompt_tokens,
                    c.completion_tokens,
                    c.cached_tokens,
                );
            }
        }
        if let Some(e) = collected.iter().find_map(|c| match &c.finish {
            Some(FinishReason::Error(e)) => Some(e.clone()),
            _ => None,
        }) {
            return Err(ApiError::internal(format!("generation failed: {e}")).into());
        }
        let usage = usage_of(&collected);
        let choices = collected
            .iter()
            .enumerate()
            .map(|(i, col)| CompletionChoice {
                index: i as u32,
                text: format!("{echo_text}{}", col.text),
                logprobs: job.sampling.logprobs.map(|_| {
                    completion_logprobs(
                        &state.tokenizer,
                        &col.tokens,
                        &col.logprobs,
                        echo_text.len(),
                    )
                }),
                finish_reason: col.finish.as_ref().map(api_finish),
                stop_reason: stop_reason(&col.stop),
            })
            .collect();
        let mut resp = CompletionResponse::new(job.id.clone(), created, model, choices, usage);
        resp.kv_transfer_params = prefill_answer(&state, &job, &collected);
        return Ok(json_response(&resp));
    }

    let n = receivers.len();
    let tok = state.tokenizer.clone();
    let want_logprobs = job.sampling.logprobs.is_some();
    let include_usage = c.include_usage;
    let mut offsets = vec![echo_text.len(); n];
    let mut echoed = vec![echo_text.is_empty(); n];
    let mut prompt_tokens = 0usize;
    let mut completion_tokens = 0usize;
    let (id, m) = (job.id.clone(), model.clone());
    let chunk = move |choice: CompletionChoice| {
        sse::encode_json(&CompletionChunk::new(
            id.clone(),
            created,
            m.clone(),
            vec![choice],
        ))
        .unwrap_or_default()
    };
    let (usage_id, usage_model) = (job.id.clone(), model);
    let encode = move |event: Option<(usize, SeqEvent)>| -> Vec<String> {
        let Some((i, ev)) = event else {
            if !include_usage {
                return Vec::new();
            }
            return vec![sse::encode_json(&CompletionChunk::usage_only(
                usage_id.clone(),
                created,
                usage_model.clone(),
                Usage::new(prompt_tokens as u32, completion_tokens as u32),
            ))
            .unwrap_or_default()];
        };
        let mut out = Vec::new();
        if !echoed[i] {
            echoed[i] = true;
            out.push(chunk(CompletionChoice {
                index: i as u32,
                text: echo_text.clone(),
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }));
        }
        match ev {
            SeqEvent::Token {
                token,
                text,
                logprob,
            } => {
                let logprobs = match (want_logprobs, logprob) {
                    (true, Some(lp)) => {
                        Some(completion_logprobs(&tok, &[token], &[lp], offsets[i]))
                    }
                    _ => None,
                };
                offsets[i] += text.len();
                if !text.is_empty() || logprobs.is_some() {
                    out.push(chunk(CompletionChoice {
                        index: i as u32,
                        text,
                        logprobs,
                        finish_reason: None,
                        stop_reason: None,
                    }));
                }
            }
            SeqEvent::Finished {
                reason,
                stop,
                text,
                prompt_tokens: p,
                completion_tokens: ct,
                cached_tokens,
                times,
                ..
            } => {
                trace_phases(&span, i, &times, p, ct, cached_tokens);
                prompt_tokens = p;
                completion_tokens += ct;
                out.push(chunk(CompletionChoice {
                    index: i as u32,
                    text,
                    logprobs: None,
                    finish_reason: Some(api_finish(&reason)),
                    stop_reason: stop_reason(&stop),
                }));
            }
        }
        out
    };
    Ok(sse_response(receivers, encode))
}

fn served_name(state: &AppState, job: &Job) -> String {
    job.lora
        .as_ref()
        .map_or_else(|| state.model_name.clone(), |a| a.name.clone())
}

/// The base model, then each adapter with `parent` = the base and `root` = its path, as
/// vLLM lists them.
async fn models(State(state): State<Arc<AppState>>) -> Response {
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
/// text on success; a missing field, a taken name, a full registry or an adapter that
/// cannot be used is a 400 naming the problem, a path with nothing there a 404. The file
/// is read off the async threads, without holding the registry.
async fn load_lora_adapter(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let (_, body) = read_body(&state, req).await?;
    let parsed: LoadLoraRequest = parse_json(&body)?;
    let (name, path, base, max_rank) = {
        let registry = state.lora_registry()?;
        let (name, path) = registry.check_load(parsed)?;
        let (base, max_rank) = registry.limits();
        (name, path, base, max_rank)
    };
    let started = Instant::now();
    let (n, p) = (name.clone(), path.clone());
    let adapter = tokio::task::spawn_blocking(move || read_adapter(&n, &p, &base, max_rank))
        .await
        .map_err(|e| ApiError::internal(format!("adapter loading failed: {e}")))??;
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
async fn unload_lora_adapter(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
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

async fn embeddings(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let (_, body) = read_body(&state, req).await?;
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

async fn tokenize(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let (_, body) = read_body(&state, req).await?;
    let parsed: TokenizeRequest = parse_json(&body)?;
    let t = validate_tokenize(parsed)?;
    check_model(&state, t.model.as_deref())?;
    let (text, parse_special) = match &t.input {
        TokenizeInput::Prompt(p) => (p.clone(), false),
        TokenizeInput::Chat {
            messages,
            add_generation_prompt,
            ..
        } => {
            let msgs: Vec<ChatMessage> = messages.iter().map(to_template_message).collect();
            let rendered = state
                .template
                .render(&msgs, *add_generation_prompt)
                .map_err(|e| ApiError::invalid("messages", format!("Chat template error: {e}")))?;
            (rendered, true)
        }
    };
    let tokens = state
        .tokenizer
        .encode(&text, t.add_special_tokens, parse_special)
        .map_err(|e| ApiError::invalid("prompt", format!("Cannot tokenize: {e}")))?;
    let mut resp = TokenizeResponse::new(tokens, state.max_model_len);
    if t.return_token_strs {
        resp.token_strs = Some(
            resp.tokens
                .iter()
                .map(|&id| token_text(&state.tokenizer, id))
                .collect(),
        );
    }
    Ok(json_response(&resp))
}

async fn detokenize(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let (_, body) = read_body(&state, req).await?;
    let parsed: DetokenizeRequest = parse_json(&body)?;
    check_model(&state, parsed.model.as_deref())?;
    check_token_ids(&state, &parsed.tokens, "tokens")?;
    let prompt = state
        .tokenizer
        .decode(&parsed.tokens, false)
        .map_err(|e| ApiError::invalid("tokens", format!("Cannot detokenize: {e}")))?;
    Ok(json_response(&DetokenizeResponse { prompt }))
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.is_draining() {
        ErrorResponse(ApiError::unavailable("The server is shutting down.")).into_response()
    } else {
        StatusCode::OK.into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> ApiResult {
    if state.engine.reset_prefix_cache().await {
        Ok(StatusCode::OK.into_response())
    } else {
        Err(ApiError::unavailable(
            "The prefix cache cannot be reset while requests hold KV blocks; retry when idle.",
        )
        .into())
    }
}

async fn version() -> Response {
    json_response(&serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> HashKey {
        [n; 32]
    }

    #[test]
    fn tier_events_are_cpu_blocks_and_never_merge_with_gpu_ones() {
        let wire = |n| BlockHash(h(n)).to_u64();
        let stored = |n: u8, parent: Option<u8>| PoolEvent::Stored {
            hash: h(n),
            parent: parent.map(h),
            tokens: vec![n as u32; 2],
            lora: None,
        };
        let tier = |n: u8, parent: Option<u8>| PoolEvent::TierStored {
            hash: h(n),
            parent: parent.map(h),
            tokens: vec![n as u32; 2],
            lora: None,
        };
        let events = vec![
            stored(1, None),
            stored(2, Some(1)),
            // The same chain on the tier is a separate CPU event.
            tier(3, Some(2)),
            tier(4, Some(3)),
            PoolEvent::Removed { hash: h(1) },
            PoolEvent::TierRemoved { hash: h(3) },
            PoolEvent::TierRemoved { hash: h(4) },
            PoolEvent::Removed { hash: h(2) },
        ];
        let out = to_kv_events(events, 2);
        let gpu = Some("GPU".to_string());
        let cpu = Some("CPU".to_string());
        assert_eq!(
            out,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![wire(1), wire(2)],
                    parent_block_hash: None,
                    token_ids: vec![1, 1, 2, 2],
                    block_size: 2,
                    lora_id: None,
                    medium: gpu.clone(),
                    lora_name: None,
                },
                KvEvent::BlockStored {
                    block_hashes: vec![wire(3), wire(4)],
                    parent_block_hash: Some(wire(2)),
                    token_ids: vec![3, 3, 4, 4],
                    block_size: 2,
                    lora_id: None,
                    medium: cpu.clone(),
                    lora_name: None,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![wire(1)],
                    medium: gpu.clone(),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![wire(3), wire(4)],
                    medium: cpu,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![wire(2)],
                    medium: gpu,
                },
            ]
        );
    }

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
