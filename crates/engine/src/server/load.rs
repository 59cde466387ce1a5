//! Model loading: the GGUF's weights, tokenizer, chat template and sampling defaults, the
//! KV cache sized from the options, the start-up LoRA adapters, and the engine thread
//! started over them.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc::{Receiver, Sender};

use super::events::kv_event_sink;
use super::http::unix_now;
use super::kv_state::{KvState, EVICTED_QUEUE};
use super::state::AppState;
use crate::auth::{Gate, ADMIN_ROUTES};
use crate::chat_template::ChatTemplate;
use crate::engine;
use crate::generation_config::GenerationDefaults;
use crate::gguf::{GgufFile, ModelError};
use crate::kv::cache::{KvCache, KvDtype};
use crate::kv::transfer::BlockData;
use crate::lora::{AllowedDirs, LoadLoraRequest, LoraOptions, LoraRegistry};
use crate::metrics::{EngineMetrics, MetricLimits};
use crate::model::Llama;
use crate::options::EngineOptions;
use crate::serve::ServerError;
use crate::structured::GrammarCompiler;
use crate::tokenizer::Tokenizer;

/// A loaded model and a running engine thread, ready to serve.
pub struct Loaded {
    pub state: Arc<AppState>,
    pub engine_thread: std::thread::JoinHandle<()>,
}

/// Loads the model, tokenizer and template from the GGUF at `opts.model_path` and starts
/// the engine thread, serving it as `opts.model_name`.
pub fn load(opts: &EngineOptions) -> Result<Loaded, ServerError> {
    let (model_path, model_name) = (opts.model_path.as_path(), opts.model_name.as_str());
    if opts.block_size == 0 || opts.max_num_seqs == 0 || opts.max_num_batched_tokens == 0 {
        return Err(ServerError::Option(
            "block size, max-num-seqs and max-num-batched-tokens must be positive".into(),
        ));
    }
    opts.auth.validate().map_err(ServerError::Option)?;
    let read = read_model(model_path, opts)?;
    let lora = match &opts.lora {
        None => None,
        Some(l) => Some(load_lora_modules(l, &read.model, model_name)?),
    };
    let cache = size_cache(&read.model, opts)?;
    log_loaded(model_path, opts, &read.model, &cache);
    let metrics = Arc::new(EngineMetrics::with_limits(
        model_name,
        MetricLimits {
            block_size: opts.block_size,
            num_blocks: cache.num_blocks,
            max_model_len: cache.max_model_len,
            max_num_batched_tokens: opts.max_num_batched_tokens,
            cache_dtype: cache.kv_dtype,
        },
    ));
    let kv_events = kv_event_sink(opts, model_name)?;
    let tokenizer = Arc::new(read.tokenizer);
    let grammar = match GrammarCompiler::new(tokenizer.clone()) {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            tracing::warn!(error = %e, "structured outputs disabled");
            None
        }
    };
    let (evicted_tx, evicted_rx) = evicted_channel(opts);
    let vocab_size = read.model.config.vocab_size;
    let (handle, engine_thread) = engine::start(
        Arc::new(read.model),
        tokenizer.clone(),
        opts,
        cache.num_blocks,
        metrics.clone(),
        kv_events,
        evicted_tx,
    );
    let state = Arc::new(AppState {
        model_name: model_name.to_string(),
        tokenizer,
        template: read.template,
        engine: handle,
        metrics,
        vocab_size,
        max_model_len: cache.max_model_len,
        max_body_bytes: opts.max_body_bytes,
        created: unix_now(),
        grammar,
        generation_defaults: read.generation_defaults,
        lora: lora.map(Mutex::new),
        kv: KvState::new(opts, evicted_rx),
        gate: Arc::new(Gate::new(&opts.auth, ADMIN_ROUTES)),
        tools: opts.tools.clone(),
    });
    Ok(Loaded {
        state,
        engine_thread,
    })
}

/// What the GGUF file gives: the model (with the exact-activation options applied), its
/// tokenizer and chat template, and the sampling defaults `--generation-config` names.
struct ReadModel {
    model: Llama,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    generation_defaults: GenerationDefaults,
}

fn read_model(model_path: &Path, opts: &EngineOptions) -> Result<ReadModel, ServerError> {
    let mut file = GgufFile::open(model_path)?;
    let tokenizer =
        Tokenizer::from_gguf(&file.content).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let template = ChatTemplate::from_gguf(&file.content)
        .map_err(|e| ModelError::Tokenizer(format!("chat template: {e}")))?;
    let template = match &opts.tools.chat_template {
        Some(given) => override_template(given, &template)?,
        None => template,
    };
    let generation_defaults =
        GenerationDefaults::resolve(&opts.generation_config, model_path, &file.content.metadata)
            .map_err(|e| ServerError::Option(e.to_string()))?;
    if !generation_defaults.is_empty() {
        tracing::info!(defaults = ?generation_defaults, "default sampling parameters");
    }
    let mut model = Llama::from_gguf(&mut file, opts.weights)?;
    model.q8_decode &= !opts.exact_decode;
    model.q8_prompt &= !opts.exact_prefill;
    Ok(ReadModel {
        model,
        tokenizer,
        template,
        generation_defaults,
    })
}

/// `--chat-template`: a file's template, or (as vLLM allows) the template text itself
/// when no such file exists; the model's special tokens stay.
fn override_template(given: &str, model: &ChatTemplate) -> Result<ChatTemplate, ServerError> {
    let source = match std::fs::read_to_string(given) {
        Ok(s) => s,
        Err(_) if given.contains("{{") || given.contains("{%") => given.to_string(),
        Err(e) => {
            return Err(ServerError::Option(format!(
                "--chat-template {given}: cannot read the file: {e}"
            )))
        }
    };
    ChatTemplate::new(source, model.bos_token(), model.eos_token())
        .map_err(|e| ServerError::Option(format!("--chat-template: {e}")))
}

/// The KV cache's shape, and the longest sequence it and the model allow.
struct CacheSize {
    kv_dtype: KvDtype,
    bytes_per_block: usize,
    num_blocks: usize,
    max_model_len: usize,
}

/// `--num-blocks`, or as many blocks as `--kv-cache-memory` holds; none is an error that
/// says which option to raise.
fn size_cache(model: &Llama, opts: &EngineOptions) -> Result<CacheSize, ServerError> {
    let cfg = &model.config;
    let kv_dtype = opts.kv_dtype(model);
    let bytes_per_block = KvCache::bytes_per_block(
        cfg.n_layer,
        opts.block_size,
        model.kv_slot_width(),
        cfg.n_kv_head,
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
    Ok(CacheSize {
        kv_dtype,
        bytes_per_block,
        num_blocks,
        max_model_len,
    })
}

fn log_loaded(model_path: &Path, opts: &EngineOptions, model: &Llama, cache: &CacheSize) {
    let cfg = &model.config;
    tracing::info!(
        model = %model_path.display(),
        architecture = model.architecture(),
        weights = %opts.weights,
        q8_decode = model.q8_decode,
        q8_prompt = model.q8_prompt && model.q8_decode,
        layers = cfg.n_layer,
        vocab = cfg.vocab_size,
        num_blocks = cache.num_blocks,
        block_size = opts.block_size,
        kv_cache_bytes = cache.num_blocks * cache.bytes_per_block,
        kv_cache_dtype = %cache.kv_dtype,
        max_model_len = cache.max_model_len,
        "model loaded"
    );
}

/// The tier gets copies of evicted blocks; the offloader that sends them starts with the
/// async services (`start_kv_services`).
fn evicted_channel(
    opts: &EngineOptions,
) -> (Option<Sender<BlockData>>, Option<Receiver<BlockData>>) {
    match opts.kv_tier {
        Some(_) if opts.prefix_caching => {
            let (tx, rx) = tokio::sync::mpsc::channel(EVICTED_QUEUE);
            (Some(tx), Some(rx))
        }
        Some(tier) => {
            tracing::warn!(%tier, "--kv-tier is ignored without prefix caching");
            (None, None)
        }
        None => (None, None),
    }
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
    )
    .with_allowed_dirs(AllowedDirs::new(&l.dirs).map_err(ServerError::Option)?);
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
