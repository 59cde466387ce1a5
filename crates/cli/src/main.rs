//! `strata`: one binary, every role.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use strata_engine::model_cache::DEFAULT_MODEL;

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
    Engine(Box<strata_engine::cli::EngineArgs>),
    /// Route requests across engine replicas.
    Router(Box<strata_router::RouterArgs>),
    /// The API gateway: keys, limits, budgets, aliases, caches.
    Gateway(Box<strata_gateway::GatewayArgs>),
    /// The lifecycle controller: autoscaling and rollouts.
    Controller(Box<strata_controller::ControllerArgs>),
    /// Canary rollouts in a running `strata up`: start, status, promote, rollback.
    Rollout(Box<strata_controller::rollout_client::RolloutClientArgs>),
    /// Simulate a deployment in virtual time: the real router, engine step planner and
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
    KvTier(strata_engine::cli::KvTierArgs),
}

#[derive(Subcommand)]
enum ModelCmd {
    /// Download a known model into the cache (a no-op when it is already there), or copy
    /// a local GGUF file, or every GGUF file of a directory, into it.
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Sim(_) | Command::Plan(_)) {
        // Before anything else: it may restart the process (`strata_sim::heap`).
        strata_sim::heap::restart_with_huge_pages();
    }
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
        Command::Engine(args) => block_on(strata_engine::cli::run(*args)),
        Command::KvTier(args) => block_on(strata_engine::cli::run_kv_tier(args)),
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

fn model(cmd: ModelCmd) -> anyhow::Result<()> {
    match cmd {
        ModelCmd::Pull { name } => strata_engine::cli::model_pull(&name),
        ModelCmd::List => strata_engine::cli::model_list(),
        ModelCmd::Path { name } => strata_engine::cli::model_path(&name),
        ModelCmd::Keygen(args) => Ok(strata_controller::run_keygen(&args)?),
        ModelCmd::Sign(args) => Ok(strata_controller::run_sign(&args)?),
        ModelCmd::Verify(args) => Ok(strata_controller::run_verify(&args)?),
    }
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
