//! `strata engine`: serve a model through the OpenAI-compatible API. The flags
//! ([`EngineArgs`]), checked and resolved into the one settings struct everything else
//! reads ([`EngineOptions`]); [`run`] resolves the model (pulling a known one), checks its
//! signature when asked, and serves it (or the mock engine, with `--mock`).

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;

use super::model::print_progress;
use crate::auth::AuthOptions;
use crate::kv::cache::KvDtype;
use crate::kv::peers::KvPeers;
use crate::kv::tls::{KvTls, KvTlsFiles};
use crate::lora::{LoraModule, LoraOptions};
use crate::model::WeightFormat;
use crate::model_cache::{ModelCache, DEFAULT_MODEL};
use crate::options::{EngineOptions, KvRole, DEFAULT_HASH_SEED};
use crate::planner::{Policy, StepBudget};
use crate::spec_decode::SpeculativeConfig;

/// `strata engine`'s flags (vLLM's names where vLLM has the option).
#[derive(clap::Args)]
pub struct EngineArgs {
    /// A cached model name or a path to a GGUF file (pulled when it is a known name).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Name clients send as `model` (default: the cache name, or the file's stem).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// How weights are held: gguf (as stored, Strata's kernels), f32 (dequantized),
    /// q8_0 (requantized, candle's kernels).
    #[arg(long, default_value = "gguf")]
    pub weights: WeightFormat,
    /// Keep decode activations (and so prompt activations too) in f32 with 4-bit gguf
    /// weights: exact to the stored weights, slower (by default every row's activations
    /// are quantized to 8 bits, as llama.cpp does).
    #[arg(long)]
    pub exact_decode: bool,
    /// Keep prompt activations in f32 with 4-bit gguf weights: prefill exact to the stored
    /// weights, prefill about 1.7x slower; decode rows stay 8-bit.
    #[arg(long)]
    pub exact_prefill: bool,
    /// KV-cache entry type: auto (f32 with --weights f32, f16 otherwise), f16, f32, or an
    /// 8-bit type with a scale per head and token: int8, or fp8 (E4M3; also fp8_e4m3).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: KvDtypeArg,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV-cache blocks (overrides --kv-cache-memory).
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Bytes of KV cache to allocate.
    #[arg(long, default_value_t = 1 << 30)]
    pub kv_cache_memory: u64,
    /// Sequences in the running batch at most.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Tokens per step at most (prefill chunks and decodes together).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Stall-free scheduling: a step that carries decodes is kept near this many
    /// milliseconds by sizing the prefill chunks beside them from the measured step cost
    /// (0: off, only --max-num-batched-tokens bounds a step).
    #[arg(long, default_value_t = StepBudget::DEFAULT_TARGET_MS)]
    pub step_time_budget_ms: u64,
    /// Waiting requests beyond this are answered 429.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting: usize,
    /// Admission order: fcfs or priority.
    #[arg(long, default_value = "fcfs")]
    pub scheduling_policy: Policy,
    /// Cap on prompt + output tokens (default: the model's context length).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Seed for requests that send none.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Seconds Ctrl-C waits for in-flight requests before aborting them.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    #[command(flatten)]
    pub http: strata_api::edge::EdgeArgs,
    /// Turn the prefix cache off (it is on by default).
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Seed of the prefix-cache block hashes; equal seeds give equal hashes across engines
    /// (a vLLM engine's counterpart is PYTHONHASHSEED).
    #[arg(long, default_value = DEFAULT_HASH_SEED)]
    pub prefix_caching_hash_seed: String,
    /// ZMQ endpoint for KV-cache events, e.g. `tcp://*:5557` (off when absent).
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// ZMQ ROUTER endpoint that replays missed KV events, e.g. `tcp://*:5558`.
    #[arg(long)]
    pub kv_events_replay_endpoint: Option<String>,
    /// KV-event topic (default `kv@<host:port>@<model>`).
    #[arg(long)]
    pub kv_events_topic: Option<String>,
    /// Disaggregated serving role (PROTOCOLS §11): `prefill` computes prompts and keeps
    /// their KV for a decode engine to pull (needs --kv-transfer-port), `decode` pulls a
    /// prompt's KV from the prefill engine a request names, `both` does either.
    #[arg(long, default_value = "both")]
    pub kv_role: KvRole,
    /// TCP port of this engine's KV block-transfer endpoint, from which other engines pull
    /// cached blocks by hash (0: off; required with --kv-role prefill).
    #[arg(long, default_value_t = 0)]
    pub kv_transfer_port: u16,
    /// Host this engine advertises as `remote_host` for its transfer endpoint (default:
    /// --host, or 127.0.0.1 when --host is a wildcard address).
    #[arg(long, value_name = "HOST")]
    pub kv_transfer_host: Option<String>,
    /// Seconds a prefill engine keeps a finished request's blocks for its decoder to pull.
    #[arg(long, default_value_t = 60)]
    pub kv_pin_timeout_secs: u64,
    /// Milliseconds a decode engine waits for a remote prefill's blocks (connect, the
    /// prefill call and the pull together) before it recomputes the prompt itself.
    #[arg(long, default_value_t = 5000)]
    pub kv_transfer_timeout_ms: u64,
    /// Address (`host:port`) of this machine's shared KV tier (`strata kv-tier`): evicted
    /// blocks are offloaded there and looked up before a prompt is recomputed.
    #[arg(long, value_name = "ADDR", value_parser = parse_socket_addr)]
    pub kv_tier: Option<SocketAddr>,
    /// The only KV-transfer peers (`host:port`, repeatable or comma-separated) this engine
    /// connects to: prefill engines' HTTP addresses (for `x-prefiller-host-port`) and their
    /// transfer endpoints (`remote_host`/`remote_port`); a request naming another is a 400
    /// and nothing is contacted. `any` allows every peer. Without it, peers a request names
    /// are allowed only when the engine requires --api-key.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT")]
    pub kv_peers: Vec<String>,
    /// KV transfer and the tier over mutual TLS: the transfer endpoint serves --tls-cert /
    /// --tls-key and requires callers to present a certificate --kv-tls-ca signed; pulls
    /// and tier connections verify the peer against --kv-tls-ca (by the host they were
    /// addressed by) and present --tls-cert.
    #[arg(long, requires_all = ["tls_cert", "kv_tls_ca"])]
    pub kv_tls: bool,
    /// The CA (PEM) KV peers' and the tier's certificates are verified against (with
    /// --kv-tls).
    #[arg(long, value_name = "FILE", requires = "kv_tls")]
    pub kv_tls_ca: Option<PathBuf>,
    /// Require `Authorization: Bearer <key>` on every route but /health, /version and
    /// /metrics (repeatable or comma-separated: any one of the keys; vLLM's --api-key).
    #[arg(
        long,
        env = "STRATA_API_KEY",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "KEY"
    )]
    pub api_key: Vec<String>,
    /// The key of the admin routes (/reset_prefix_cache, /v1/load_lora_adapter,
    /// /v1/unload_lora_adapter). With --api-key and no admin key they are disabled.
    #[arg(
        long,
        env = "STRATA_ADMIN_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub admin_key: Option<String>,
    /// Put /metrics behind the API key too.
    #[arg(long, requires = "api_key")]
    pub protect_metrics: bool,
    /// Prompt-lookup speculative decoding, as vLLM spells it: `{"method": "ngram",
    /// "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`.
    #[arg(long, value_name = "JSON", value_parser = parse_speculative_config)]
    pub speculative_config: Option<SpeculativeConfig>,
    /// Parse tool calls out of the model's text when a request's tool_choice is "auto"
    /// (or absent with tools); needs --tool-call-parser.
    #[arg(long, requires = "tool_call_parser")]
    pub enable_auto_tool_choice: bool,
    /// The tool calls' wire format: hermes, llama3_json, mistral or pythonic.
    #[arg(long, value_name = "NAME", value_parser = parse_tool_parser)]
    pub tool_call_parser: Option<crate::tools::ToolParser>,
    /// A chat template file (or the template itself) used instead of the model's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<String>,
    /// Split a reasoning model's <think>...</think> into reasoning_content: deepseek_r1
    /// or qwen3.
    #[arg(long, value_name = "NAME", value_parser = parse_reasoning_parser)]
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
    /// Default sampling parameters for fields a request leaves out: `auto` (the model's
    /// own: a generation_config.json beside it, or its GGUF sampling metadata), `vllm`
    /// (none), or a folder holding generation_config.json, or a JSON file.
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    /// Serve LoRA adapters on the base model: a request's `model` names one; loaded with
    /// --lora-modules at start-up and `POST /v1/load_lora_adapter` at run time.
    #[arg(long)]
    pub enable_lora: bool,
    /// Distinct adapters in one step; requests for another adapter wait for a slot.
    #[arg(long, default_value_t = 1, requires = "enable_lora")]
    pub max_loras: usize,
    /// Highest adapter rank accepted.
    #[arg(long, default_value_t = 16, requires = "enable_lora")]
    pub max_lora_rank: usize,
    /// Adapters held in memory at once (default: --max-loras or the number of
    /// --lora-modules, whichever is larger).
    #[arg(long, requires = "enable_lora")]
    pub max_cpu_loras: Option<usize>,
    /// Adapters to load at start-up: `name=path` (a PEFT directory) or vLLM's JSON
    /// `{"name": ..., "path": ...}`.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH", requires = "enable_lora")]
    pub lora_modules: Vec<LoraModule>,
    /// The only directories `POST /v1/load_lora_adapter` may read adapters from
    /// (repeatable or comma-separated); without one, adapters load only at start-up.
    #[arg(long, value_delimiter = ',', requires = "enable_lora")]
    pub lora_dir: Vec<PathBuf>,
    /// Refuse to load the model unless it verifies against its signed manifest with this
    /// public key (from `strata model keygen`; the manifest from `strata model sign`).
    #[arg(long, value_name = "FILE.pub")]
    pub verify_key: Option<PathBuf>,
    /// Serve fixed completions without a model (for proxy overhead benchmarks and tests).
    #[arg(long)]
    pub mock: bool,
    /// Mock mode: tokens per completion (capped by the request's max_tokens).
    #[arg(long, default_value_t = 16, requires = "mock")]
    pub mock_output_tokens: usize,
    /// Mock mode: milliseconds before the first token.
    #[arg(long, default_value_t = 0, requires = "mock")]
    pub mock_ttft_ms: u64,
    /// Mock mode: milliseconds between tokens.
    #[arg(long, default_value_t = 0, requires = "mock")]
    pub mock_itl_ms: u64,
    /// Mock mode: which engine's metric names /metrics uses (vllm, sglang, trtllm, llamacpp).
    #[arg(long, default_value = "strata", requires = "mock")]
    pub mock_kind: strata_mock::EngineKind,
}

/// `--kv-cache-dtype`: `auto` or an entry type.
#[derive(Debug, Clone, Copy)]
pub struct KvDtypeArg(pub Option<KvDtype>);

impl std::str::FromStr for KvDtypeArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "auto" {
            Ok(Self(None))
        } else {
            s.parse().map(|d| Self(Some(d)))
        }
    }
}

/// Serves until Ctrl-C or SIGTERM: the mock engine with `--mock`, otherwise the model
/// `--model` names, pulled first when it is a known name not yet cached.
pub async fn run(args: EngineArgs) -> anyhow::Result<()> {
    let addr = resolve_addr(&args.host, args.port)?;
    if args.mock {
        return mock_engine(args, addr).await;
    }
    // Flags that cannot work stop the start before any model is pulled.
    let kv_peers = KvPeers::parse(&args.kv_peers).map_err(anyhow::Error::msg)?;
    let kv_tls = kv_tls(&args)?;
    auth_options(&args).validate().map_err(anyhow::Error::msg)?;
    let model_path = model_file(&args).await?;
    let model_name = served_name(&args, &model_path);
    let opts = engine_options(args, model_path, model_name, addr, kv_peers, kv_tls);
    crate::server::run(opts).await?;
    Ok(())
}

/// `--host` and `--port` as one address: an IP literal, or a name resolved now.
fn resolve_addr(host: &str, port: u16) -> anyhow::Result<SocketAddr> {
    format!("{host}:{port}")
        .parse()
        .or_else(|_| {
            format!("{host}:{port}")
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or(())
        })
        .map_err(|_| anyhow::anyhow!("cannot resolve --host {host}"))
}

/// The model's path: resolved (or pulled) in the cache, and verified against its signed
/// manifest with `--verify-key`. Both read whole files, so they run off the async threads.
async fn model_file(args: &EngineArgs) -> anyhow::Result<PathBuf> {
    let model = args.model.clone();
    let verify_key = args.verify_key.clone();
    tokio::task::spawn_blocking(move || {
        let cache = ModelCache::from_env();
        let path: PathBuf = cache.resolve_or_pull(&model, &mut print_progress)?;
        if let Some(key) = &verify_key {
            let digest = strata_controller::registry::verify_model_with_key_file(&path, key)
                .with_context(|| format!("refusing to load {}", path.display()))?;
            tracing::info!(model = %path.display(), %digest, "model signature verified");
        }
        Ok::<_, anyhow::Error>(path)
    })
    .await
    .context("resolving the model")?
}

/// `--served-model-name`, else the cache name, else (for a path) the file's stem.
fn served_name(args: &EngineArgs, path: &std::path::Path) -> String {
    args.served_model_name.clone().unwrap_or_else(|| {
        if path.as_os_str() == args.model.as_str() {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| args.model.clone())
        } else {
            args.model.clone()
        }
    })
}

/// The flags as the engine's options, with what `run` resolved from them: the model and
/// address, the `--kv-peers` list, and the `--kv-tls` files (loaded before the model is
/// pulled).
fn engine_options(
    args: EngineArgs,
    model_path: PathBuf,
    model_name: String,
    addr: SocketAddr,
    kv_peers: KvPeers,
    kv_tls: Option<KvTls>,
) -> EngineOptions {
    let auth = auth_options(&args);
    EngineOptions {
        model_path,
        model_name,
        addr,
        weights: args.weights,
        exact_decode: args.exact_decode,
        exact_prefill: args.exact_prefill,
        kv_cache_dtype: args.kv_cache_dtype.0,
        block_size: args.block_size,
        num_blocks: args.num_blocks,
        kv_cache_memory: args.kv_cache_memory,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_waiting: args.max_waiting,
        policy: args.scheduling_policy,
        max_model_len: args.max_model_len,
        seed: args.seed,
        max_body_bytes: args.max_body_bytes,
        shutdown_grace: Duration::from_secs(args.shutdown_grace_secs),
        http: args.http.limits(),
        prefix_caching: !args.no_enable_prefix_caching,
        prefix_caching_hash_seed: args.prefix_caching_hash_seed,
        kv_events_endpoint: args.kv_events_endpoint,
        kv_events_replay_endpoint: args.kv_events_replay_endpoint,
        kv_events_topic: args.kv_events_topic,
        kv_role: args.kv_role,
        kv_transfer_port: args.kv_transfer_port,
        kv_transfer_host: args.kv_transfer_host,
        kv_pin_timeout: Duration::from_secs(args.kv_pin_timeout_secs),
        kv_transfer_timeout: Duration::from_millis(args.kv_transfer_timeout_ms),
        kv_tier: args.kv_tier,
        kv_peers,
        kv_tls,
        auth,
        speculative: args.speculative_config,
        generation_config: args.generation_config,
        tools: crate::options::ToolOptions {
            auto_tool_choice: args.enable_auto_tool_choice,
            parser: args.tool_call_parser,
            chat_template: args.chat_template,
            reasoning_parser: args.reasoning_parser,
        },
        lora: args.enable_lora.then_some(LoraOptions {
            max_loras: args.max_loras,
            max_lora_rank: args.max_lora_rank,
            max_cpu_loras: args.max_cpu_loras,
            modules: args.lora_modules,
            dirs: args.lora_dir,
        }),
        step_time_budget: (args.step_time_budget_ms > 0)
            .then(|| Duration::from_millis(args.step_time_budget_ms)),
    }
}

/// `--api-key`, `--admin-key` and `--protect-metrics`.
fn auth_options(args: &EngineArgs) -> AuthOptions {
    AuthOptions {
        api_keys: args.api_key.clone(),
        admin_key: args.admin_key.clone(),
        protect_metrics: args.protect_metrics,
    }
}

/// `--mock`: fixed completions without a model, until Ctrl-C.
async fn mock_engine(args: EngineArgs, addr: SocketAddr) -> anyhow::Result<()> {
    let config = strata_mock::MockConfig {
        model: args.served_model_name.unwrap_or_else(|| args.model.clone()),
        kind: args.mock_kind,
        output_tokens: args.mock_output_tokens,
        ttft: Duration::from_millis(args.mock_ttft_ms),
        itl: Duration::from_millis(args.mock_itl_ms),
        replica: None,
        block_size: args.block_size as u32,
        num_blocks: args.num_blocks.unwrap_or(1024) as u32,
        ..strata_mock::MockConfig::default()
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let mock = strata_mock::MockEngine::serve(config, listener)?;
    tracing::info!(url = %mock.url(), "mock engine serving");
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    mock.shutdown().await;
    Ok(())
}

/// `--kv-tls`: the engine's certificate and key (the edge's `--tls-cert`/`--tls-key`) and
/// `--kv-tls-ca`, loaded now so a file that does not load stops the start.
fn kv_tls(args: &EngineArgs) -> anyhow::Result<Option<KvTls>> {
    if !args.kv_tls {
        return Ok(None);
    }
    let (Some(cert), Some(key), Some(ca)) =
        (&args.http.tls_cert, &args.http.tls_key, &args.kv_tls_ca)
    else {
        anyhow::bail!("--kv-tls needs --tls-cert, --tls-key and --kv-tls-ca");
    };
    let files = KvTlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        ca: ca.clone(),
    };
    Ok(Some(KvTls::load(&files).context("--kv-tls")?))
}

/// A `host:port` (an IP or a name resolved now) as one socket address.
fn parse_socket_addr(s: &str) -> Result<SocketAddr, String> {
    s.to_socket_addrs()
        .map_err(|e| format!("cannot resolve `{s}`: {e}"))?
        .next()
        .ok_or_else(|| format!("`{s}` resolves to no address"))
}

fn parse_reasoning_parser(s: &str) -> Result<crate::reasoning::ReasoningParser, String> {
    crate::reasoning::ReasoningParser::from_name(s).ok_or_else(|| {
        format!(
            "unknown reasoning parser {s:?}; expected one of {}",
            crate::reasoning::ReasoningParser::NAMES.join(", ")
        )
    })
}

fn parse_tool_parser(s: &str) -> Result<crate::tools::ToolParser, String> {
    crate::tools::ToolParser::from_name(s).ok_or_else(|| {
        format!(
            "unknown tool-call parser {s:?}; expected one of {}",
            crate::tools::ToolParser::NAMES.join(", ")
        )
    })
}

fn parse_speculative_config(s: &str) -> Result<SpeculativeConfig, String> {
    SpeculativeConfig::parse(s).map_err(|e| e.to_string())
}
