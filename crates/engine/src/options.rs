//! What `strata engine` is started with: the model, the address, and the engine's tuning,
//! in one struct ([`EngineOptions`]).
//!
//! The flags (`cli::EngineArgs`) are checked and resolved into it once; from there
//! everything reads it: both HTTP fronts (the generation [`server`](crate::server) and the
//! encoder's [`embed::server`](crate::embed::server)), the engine loop
//! ([`engine::start`](crate::engine::start)) and the step planner
//! ([`StepPlanner::new`](crate::planner::StepPlanner::new)). Tests, embedders and the
//! simulator fill it in code, from [`EngineOptions::default`] (the flags' defaults).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::auth::AuthOptions;
use crate::kv::cache::KvDtype;
use crate::kv::peers::KvPeers;
use crate::lora::LoraOptions;
use crate::model::WeightFormat;
use crate::planner::{Policy, StepBudget};
use crate::spec_decode::SpeculativeConfig;

/// The default block-hash seed: vLLM's own default (when `PYTHONHASHSEED` is unset), so
/// a default Strata engine and a default vLLM engine in `sha256_cbor` mode name the same
/// blocks.
pub use crate::kv::hashing::DEFAULT_HASH_SEED;

/// Everything `strata engine` needs to serve, with defaults that serve on one machine.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// The model file (or an encoder's directory), `--model` resolved in the cache.
    pub model_path: PathBuf,
    /// The name clients send as `model`.
    pub model_name: String,
    /// Where the API listens (`--host`, `--port`).
    pub addr: SocketAddr,
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
    /// The HTTP edge's bounds: connections, head size and timeout, body rate.
    pub http: strata_api::edge::EdgeLimits,
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
    pub speculative: Option<SpeculativeConfig>,
    /// Default sampling parameters (`--generation-config`): `auto` (the model's own),
    /// `vllm` (none), or a folder / JSON file.
    pub generation_config: String,
    /// Multi-LoRA (`--enable-lora` and its limits); off when `None`.
    pub lora: Option<LoraOptions>,
    /// Stall-free scheduling (`--step-time-budget-ms`): a step that carries decodes is
    /// kept near this time by sizing the prefill chunks beside them from the measured step
    /// cost (at least 256 prefill tokens a step, so prompts always progress). `None` (the
    /// flag's 0) turns it off: only `max_num_batched_tokens` bounds a step.
    pub step_time_budget: Option<Duration>,
    /// Disaggregated serving role (`--kv-role`, PROTOCOLS §11).
    pub kv_role: KvRole,
    /// Port of the KV block-transfer endpoint (`--kv-transfer-port`); 0 is off.
    pub kv_transfer_port: u16,
    /// Host advertised as `remote_host` (`--kv-transfer-host`); `None`: the bind host, or
    /// 127.0.0.1 for a wildcard bind.
    pub kv_transfer_host: Option<String>,
    /// How long a prefill engine keeps a finished request's pinned prompt blocks for its
    /// decoder to pull (`--kv-pin-timeout-secs`) before they are released.
    pub kv_pin_timeout: Duration,
    /// How long a decode engine waits for a remote prefill's blocks before recomputing.
    pub kv_transfer_timeout: Duration,
    /// The machine's shared KV tier (`--kv-tier`); off when `None`.
    pub kv_tier: Option<SocketAddr>,
    /// The peers this engine may connect to for KV transfer (`--kv-peers`).
    pub kv_peers: KvPeers,
    /// `--api-key`, `--admin-key` and `--protect-metrics`; no key is development mode.
    pub auth: AuthOptions,
    /// `--kv-tls`: the transfer endpoint, pulls from peers and the tier over mutual TLS
    /// (loaded certificate files); plain TCP when `None`.
    pub kv_tls: Option<crate::kv::tls::KvTls>,
    /// Tool calling and the chat template override.
    pub tools: ToolOptions,
}

/// Tool calling and the chat template, as vLLM's flags spell them.
#[derive(Debug, Clone, Default)]
pub struct ToolOptions {
    /// `--enable-auto-tool-choice`: `tool_choice: "auto"` (and no tool_choice with tools)
    /// parses calls out of the model's text.
    pub auto_tool_choice: bool,
    /// `--tool-call-parser`: the calls' wire format.
    pub parser: Option<crate::tools::ToolParser>,
    /// `--chat-template`: a template file (or the template itself) used instead of the
    /// model's.
    pub chat_template: Option<String>,
    /// `--reasoning-parser`: `<think>…</think>` into `reasoning_content`.
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            model_path: PathBuf::new(),
            model_name: String::new(),
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
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
            http: strata_api::edge::EdgeLimits::default(),
            prefix_caching: true,
            prefix_caching_hash_seed: DEFAULT_HASH_SEED.to_string(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            kv_events_topic: None,
            speculative: None,
            generation_config: "auto".to_string(),
            lora: None,
            step_time_budget: Some(StepBudget::DEFAULT_TARGET),
            kv_role: KvRole::Both,
            kv_transfer_port: 0,
            kv_transfer_host: None,
            kv_pin_timeout: crate::engine::DEFAULT_PIN_TIMEOUT,
            kv_transfer_timeout: Duration::from_millis(5000),
            kv_tier: None,
            kv_peers: KvPeers::Unset,
            auth: AuthOptions::default(),
            kv_tls: None,
            tools: ToolOptions::default(),
        }
    }
}

impl EngineOptions {
    /// The KV cache's entry type for `model`: `--kv-cache-dtype`, or with `auto` the
    /// model's default.
    pub fn kv_dtype(&self, model: &crate::model::Llama) -> KvDtype {
        self.kv_cache_dtype
            .unwrap_or_else(|| model.default_kv_dtype())
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
