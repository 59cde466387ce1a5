//! Command-line surfaces: `strata sim` and `strata plan`.
//!
//! Both take `strata bench`'s workload flags unchanged (flattened [`RunArgs`]), so a
//! simulated run is described exactly like a live one and its report compares with
//! `strata bench compare`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde::Deserialize;
use strata_bench::args::parse_duration;
use strata_bench::RunArgs;
use strata_controller::autoscale::AutoscaleConfig;
use strata_engine::options::EngineOptions;
use strata_engine::planner::Policy;
use strata_router::RouterConfig;

use crate::error::SimError;
use crate::plan::{parse_objectives, plan};
use crate::profile::{model_profile_for, HardwareProfile, ModelProfile, StepModel};
use crate::sim::{simulate, AutoscaleSetup, SimConfig};

/// `strata sim`: simulate a fleet in virtual time.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct SimArgs {
    #[command(subcommand)]
    pub command: Option<SimCommand>,
    /// Replicas (with --autoscale: at the start, within its bounds).
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub run: RunArgs,
}

/// Subcommands of `strata sim`.
#[derive(Debug, Clone, Subcommand)]
pub enum SimCommand {
    /// Fit a hardware profile ("this machine") from a live engine.
    Calibrate(crate::calibrate::CalibrateArgs),
}

/// The fleet, hardware, model and control-plane settings of a simulation.
#[derive(Debug, Clone, Args)]
pub struct FleetArgs {
    /// Router config (`strata router`'s YAML: scheduling profiles, scrape interval,
    /// staleness, prefix settings); default: the router's defaults.
    #[arg(long)]
    pub routing_config: Option<PathBuf>,
    /// Controller config (`strata controller`'s YAML; its `autoscale` section and
    /// `intervalSecs`): the autoscaler drives the replica count.
    #[arg(long)]
    pub autoscale: Option<PathBuf>,
    /// Seconds a new replica takes to become ready (default: the config's
    /// `coldStartSecs`, or 30 s when that is 0).
    #[arg(long, value_parser = parse_duration)]
    pub cold_start: Option<Duration>,
    /// Named hardware: h100, h200, a100, l4.
    #[arg(long, default_value = "h100", conflicts_with = "hardware_profile")]
    pub hardware: String,
    /// A profile written by `strata sim calibrate` (instead of --hardware).
    #[arg(long)]
    pub hardware_profile: Option<PathBuf>,
    /// Named model: smollm2-135m, llama-3.1-8b, llama-3.1-70b, qwen3-32b. Default: the
    /// model a `--hardware-profile` was calibrated on, else llama-3.1-8b.
    #[arg(long)]
    pub model_profile: Option<String>,
    /// Simulate another model than the one the `--hardware-profile` was calibrated on,
    /// scaling the fitted step times by the two models' shapes.
    #[arg(long)]
    pub scale_across_models: bool,
    /// Tensor-parallel chips per replica.
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// Tokens per KV block (default: the routing config's `precise.block_size`, 16).
    #[arg(long)]
    pub kv_block_size: Option<usize>,
    /// KV blocks per replica (default: what the memory holds after the weights).
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Sequences per step at most (the engine flag).
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Tokens per step at most (the engine flag).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Engine admission order: fcfs or priority.
    #[arg(long, default_value = "fcfs")]
    pub scheduling_policy: Policy,
    /// Turn the engines' prefix cache off.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// The engines' step-time target in milliseconds (the engine flag; 0: off).
    #[arg(long, default_value_t = strata_engine::planner::StepBudget::DEFAULT_TARGET_MS)]
    pub step_time_budget_ms: u64,
    /// How often the router reads replica metrics (default: the routing config's
    /// `scrape_interval_ms`).
    #[arg(long, value_parser = parse_duration)]
    pub scrape_interval: Option<Duration>,
    /// Metrics older than this are not trusted (default: the routing config's
    /// `stale_after_ms`).
    #[arg(long, value_parser = parse_duration)]
    pub stale_after: Option<Duration>,
    /// Delay from a replica's KV event to the router's precise index.
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    pub kv_event_delay: Duration,
    /// Drop per-token times (no ITL percentiles; saves memory at a million requests).
    #[arg(long)]
    pub no_token_times: bool,
    /// The router runs flow control (the routing config's `flow_control`): requests wait
    /// in its priority bands and per-tenant flows for room, instead of going straight to a
    /// replica's queue.
    #[arg(long)]
    pub flow_control: bool,
    /// Tenants sharing the workload by weight, e.g. `noisy=10,quiet=1`: each session's
    /// tenant is drawn by weight, each tenant is its own flow, and the report gives each
    /// tenant's TTFT.
    #[arg(long, value_parser = crate::tenants::parse_tenant_spec)]
    pub tenants: Option<crate::tenants::TenantSpec>,
}

/// `strata plan`: the cheapest fleet meeting latency objectives. `--slo` here is the
/// plan's objectives; the workload's goodput SLO (`strata bench --slo`) is `--goodput-slo`.
#[derive(Debug, Clone, Args)]
#[command(mut_arg("slo", |a| a.long("goodput-slo")))]
pub struct PlanArgs {
    /// Objectives, e.g. `ttft_p90=2s,itl_p99=50ms` (metrics ttft, tpot, itl, e2e; p50,
    /// p90, p99).
    #[arg(long = "slo", id = "objectives", value_parser = parse_objectives)]
    pub slo: std::vec::Vec<crate::plan::Objective>,
    /// Tensor-parallel sizes to try, comma-separated.
    #[arg(long, default_value = "1,2,4,8", value_delimiter = ',')]
    pub tp_options: Vec<u32>,
    /// Most replicas to try per size.
    #[arg(long, default_value_t = 64)]
    pub max_replicas: u32,
    /// Write the search (every fleet tried) as JSON here.
    #[arg(long)]
    pub plan_output: Option<PathBuf>,
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub run: RunArgs,
}

/// `controller.yaml`, the parts a simulation reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ControllerFile {
    #[serde(default = "two")]
    interval_secs: f64,
    #[serde(default)]
    autoscale: AutoscaleConfig,
}

fn two() -> f64 {
    2.0
}

fn read(path: &PathBuf) -> Result<String, SimError> {
    std::fs::read_to_string(path).map_err(|source| SimError::Io {
        path: path.clone(),
        source,
    })
}

/// Parses the autoscale part of a controller config.
pub fn autoscale_from_yaml(
    text: &str,
    cold_start: Option<Duration>,
) -> Result<AutoscaleSetup, SimError> {
    let file: ControllerFile = serde_yaml::from_str(text)
        .map_err(|e| SimError::config("controller config", e.to_string()))?;
    file.autoscale
        .validate()
        .map_err(|e| SimError::config("controller config", e.to_string()))?;
    if !(file.interval_secs.is_finite() && file.interval_secs > 0.0) {
        return Err(SimError::config(
            "controller config",
            "intervalSecs must be positive",
        ));
    }
    let cold = cold_start.unwrap_or_else(|| {
        let c = file.autoscale.cold_start_secs;
        if c > 0.0 {
            Duration::from_secs_f64(c)
        } else {
            Duration::from_secs(30)
        }
    });
    Ok(AutoscaleSetup {
        config: file.autoscale,
        interval: Duration::from_secs_f64(file.interval_secs),
        cold_start: cold,
    })
}

impl FleetArgs {
    /// The model to simulate on `hardware` ([`model_profile_for`]), saying on stderr when
    /// the choice rests on a guess: a profile file that does not name its model, or a fit
    /// scaled to another model.
    fn model_profile_for(&self, hardware: &HardwareProfile) -> Result<String, SimError> {
        let requested = self.model_profile.as_deref();
        let chosen = model_profile_for(hardware, requested, self.scale_across_models)?;
        match &hardware.calibrated_on {
            Some(on) if on.model_profile != chosen => eprintln!(
                "note: the hardware profile `{}` was calibrated on `{}`; its step times are \
                 scaled to `{chosen}` by the models' shapes",
                hardware.name, on.model_profile
            ),
            None if self.hardware_profile.is_some() => eprintln!(
                "note: the hardware profile `{}` does not name the model it was calibrated on \
                 (written by an older `strata sim calibrate`); simulating `{chosen}`",
                hardware.name
            ),
            _ => {}
        }
        Ok(chosen)
    }

    /// Builds the simulation's configuration from these flags and bench's.
    pub fn config(&self, run: &RunArgs, replicas: u32) -> Result<SimConfig, SimError> {
        if run.warmup > 0 {
            return Err(SimError::config(
                "--warmup",
                "is not simulated (a simulated fleet starts warm)",
            ));
        }
        let router = match &self.routing_config {
            Some(p) => RouterConfig::from_yaml(&read(p)?)?,
            None => RouterConfig::default(),
        };
        let hardware = match &self.hardware_profile {
            Some(p) => HardwareProfile::load(p)?,
            None => HardwareProfile::named(&self.hardware)?,
        };
        let model_profile = self.model_profile_for(&hardware)?;
        let model = ModelProfile::named(&model_profile)?;
        let calibrated_block_size = hardware.calibrated_on.as_ref().map(|c| c.kv_block_size);
        let step = StepModel::new(hardware, model, self.tp)?;
        let seed = run.seed.unwrap_or(1);
        let model_name = run.model.clone().unwrap_or_else(|| model_profile.clone());
        let mut load = run.load_config(model_name, seed)?;
        if run.label.is_none() {
            load.label = format!(
                "sim:{}@{}x{}",
                load.workload.name(),
                replicas,
                step.hardware.name
            );
        }
        let autoscale = match &self.autoscale {
            Some(p) => Some(autoscale_from_yaml(&read(p)?, self.cold_start)?),
            None => None,
        };
        let mut router = router;
        if let Some(s) = self.stale_after {
            router.stale_after_ms = s.as_millis() as u64;
        }
        let scrape_interval = self
            .scrape_interval
            .unwrap_or(Duration::from_millis(router.scrape_interval_ms));
        Ok(SimConfig {
            load,
            engine: EngineOptions {
                block_size: self
                    .kv_block_size
                    .or(calibrated_block_size)
                    .unwrap_or(router.precise.block_size),
                num_blocks: self.num_blocks,
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                policy: self.scheduling_policy,
                prefix_caching: !self.no_prefix_caching,
                step_time_budget: (self.step_time_budget_ms > 0)
                    .then(|| Duration::from_millis(self.step_time_budget_ms)),
                ..EngineOptions::default()
            },
            step,
            replicas,
            router,
            scrape_interval,
            kv_event_delay: self.kv_event_delay,
            autoscale,
            keep_token_times: !self.no_token_times,
            flow_control: self.flow_control,
            tenants: self.tenants.clone().map(|t| t.0).unwrap_or_default(),
        })
    }
}

/// Runs `strata sim`.
pub fn run_sim(args: SimArgs) -> Result<(), SimError> {
    if let Some(SimCommand::Calibrate(c)) = args.command {
        return crate::calibrate::run(c);
    }
    let cfg = args.fleet.config(&args.run, args.replicas)?;
    let out = simulate(&cfg)?;
    print!("{}", out.report.render_text());
    let s = &out.stats;
    println!(
        "simulated {:.1} s in {:.2} s wall: {} events ({:.0}/s), {} steps, {} preemptions, \
         {:.0} replica-seconds (max {} replicas)",
        s.virtual_s,
        s.wall_s,
        s.events,
        s.events_per_s,
        s.steps,
        s.preemptions,
        s.replica_seconds,
        s.max_replicas
    );
    for t in &s.tenants {
        let ms = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{:.0} ms", x * 1e3));
        println!(
            "  tenant {:<12} {:>7} requests ({} failed)  TTFT p50 {}  p90 {}  e2e p90 {}",
            t.tenant,
            t.requests,
            t.failed,
            ms(t.ttft_p50_s),
            ms(t.ttft_p90_s),
            ms(t.e2e_p90_s)
        );
    }
    for d in &s.decisions {
        println!(
            "  t={:>8.1}s  {} -> {} replicas ({} ready): {}",
            d.t_s, d.previous, d.desired, d.ready, d.reason
        );
    }
    if let Some(path) = &args.run.output {
        out.report.save(path)?;
    }
    if let Some(dir) = &args.run.plot {
        strata_bench::plot::plot_reports(std::slice::from_ref(&out.report), dir)?;
    }
    Ok(())
}

/// Runs `strata plan`.
pub fn run_plan(args: PlanArgs) -> Result<(), SimError> {
    if args.slo.is_empty() {
        return Err(SimError::config("--slo", "give at least one objective"));
    }
    if args.max_replicas == 0 {
        return Err(SimError::config("--max-replicas", "must be at least 1"));
    }
    let base = args.fleet.config(&args.run, 1)?;
    if base.autoscale.is_some() {
        return Err(SimError::config(
            "--autoscale",
            "plan searches fixed fleets; leave the autoscaler out",
        ));
    }
    let result = plan(&base, &args.tp_options, args.max_replicas, &args.slo)?;
    print!("{}", result.render_text());
    if let Some(path) = &args.plan_output {
        let text = serde_json::to_string_pretty(&result)
            .map_err(|e| SimError::config("plan output", e.to_string()))?;
        std::fs::write(path, text).map_err(|source| SimError::Io {
            path: path.clone(),
            source,
        })?;
    }
    Ok(())
}
