//! `strata up`: pulls the model, runs engine replicas under the lifecycle controller (its
//! control loop over the local driver, autoscaling between `autoscale.minReplicas` and
//! `maxReplicas`; `--replicas N` pins N), puts the router in front of them on one port with
//! the dashboard at `/ui` and the controller at `/controller/...`, and on Ctrl-C drains and
//! stops everything.
//!
//! A replica is registered with the router only once it answers `/health`; a replica that
//! crashes is deregistered at once and replaced after an exponential backoff (1 s, 2 s, 4 s
//! ... up to 30 s; reset when a replacement becomes ready). With `minReplicas: 0` the front
//! holds requests while no replica is ready ([`crate::front`]) and the controller starts
//! one for them. Canary rollouts: [`crate::rollout`].
//!
//! Disaggregated serving (`--prefill-replicas N --decode-replicas M`, PROTOCOLS §11): two
//! fixed-size groups of the one model, `strata engine --kv-role prefill --kv-transfer-port
//! <free port>` and `--kv-role decode`, registered with the router under the same served
//! name and their `role` label; the router runs llm-d's profile pair (decode pick first, a
//! prefill pick when its uncached prompt tokens reach `--pd-threshold`) and the two-phase
//! proxy. `--kv-tier-bytes B` also starts `strata kv-tier` on a free loopback port and
//! passes `--kv-tier` to every engine. Fixed counts only: autoscaling and `models:` are
//! refused in this mode.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use strata_api::http::shutdown_signal;
use strata_controller::autoscale::AutoscaleConfig;
use strata_controller::controller::{Controller, Status};
use strata_controller::driver::local::{LocalDriver, LocalDriverConfig};
use strata_controller::driver::ReplicaPhase;
use strata_controller::metrics::ControllerMetrics;
use strata_controller::rollout::RolloutConfig;
use strata_router::{Router, RouterConfig};

use crate::dashboard::{Dashboard, PoolView, ReplicaView, StackView};
use crate::fleet::{Fleet, GroupMap, Member, RouterRegistrar};
use crate::front::{Front, VersionStatsBook};
use crate::pools::{served_name_of, ModelEntry, PoolConfigError, PoolRoute, PoolSet, PoolSpec};
use crate::rollout::{CanaryTemplate, Rollouts};
use crate::signals::RouterSignals;

/// `strata.yaml`: every key has a flag of the same name and a default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StackConfig {
    /// Engine replicas to run when `autoscale` is absent (a fixed count).
    pub replicas: u32,
    /// Autoscaling (the controller's `autoscale:` keys, camelCase: `minReplicas`,
    /// `maxReplicas`, `warmSpares`, `scaleToZeroAfterSecs` ...); absent: `replicas` fixed.
    pub autoscale: Option<AutoscaleConfig>,
    /// Seconds between control ticks (and rollout analyses).
    pub controller_interval_secs: f64,
    /// How long a request waits for a cold start while no replica is ready; absent:
    /// `ready_timeout_secs`.
    pub hold_timeout_secs: Option<f64>,
    /// Canary rollouts (the controller's `rollout:` keys: `steps`, `stepMinSecs`,
    /// `minRequests`, `maxTtftRatio` ...).
    pub rollout: RolloutConfig,
    /// Canary replicas a rollout starts.
    pub canary_replicas: u32,
    /// A model name from the cache (pulled when missing) or a GGUF path.
    pub model: String,
    /// Address of the front port (router + dashboard).
    pub host: String,
    pub port: u16,
    /// KV-cache bytes per replica.
    pub kv_cache_memory: u64,
    /// Extra `strata engine` flags for every replica.
    pub engine_args: Vec<String>,
    /// A router config file (`router.yaml`: scheduling profiles, saturation ...).
    pub router_config: Option<PathBuf>,
    /// Seconds Ctrl-C waits for in-flight requests.
    pub shutdown_grace_secs: u64,
    /// A replica not ready after this long is killed and replaced.
    pub ready_timeout_secs: f64,
    /// Where replica logs go (`<id>.log`; the second and later pools in a folder named
    /// after the pool); absent: this terminal.
    pub log_dir: Option<PathBuf>,
    /// Port of the gateway (API keys, limits, budgets) in front of the router; `0` picks a
    /// free port. `gateway: false` leaves it out.
    pub gateway: bool,
    pub gateway_port: u16,
    /// The gateway's SQLite file (`:memory:` for none); absent: `$STRATA_HOME/gateway.db`.
    pub gateway_db: Option<PathBuf>,
    /// One pool per model ([`crate::pools`]); empty: the one pool of `model`, `replicas`
    /// and `autoscale`.
    pub models: Vec<ModelEntry>,
    /// Disaggregated serving: prefill engines (with `decode_replicas`; instead of
    /// `replicas`).
    pub prefill_replicas: Option<u32>,
    /// Disaggregated serving: decode engines (with `prefill_replicas`).
    pub decode_replicas: Option<u32>,
    /// Disaggregated serving: a request goes through a prefill engine when its decode
    /// pick's uncached prompt tokens reach this (llm-d's `nonCachedTokens`; 0: always).
    pub pd_threshold: u32,
    /// Memory bytes of a shared KV tier (`strata kv-tier`) for every engine; absent: none.
    pub kv_tier_bytes: Option<u64>,
}

impl Default for StackConfig {
    fn default() -> Self {
        StackConfig {
            replicas: 2,
            autoscale: None,
            controller_interval_secs: 1.0,
            hold_timeout_secs: None,
            rollout: RolloutConfig::default(),
            canary_replicas: 1,
            model: "smollm2-135m-instruct".to_string(),
            host: "127.0.0.1".to_string(),
            port: 8080,
            kv_cache_memory: 256 << 20,
            engine_args: Vec::new(),
            router_config: None,
            shutdown_grace_secs: 30,
            ready_timeout_secs: 300.0,
            log_dir: None,
            gateway: true,
            gateway_port: 4000,
            gateway_db: None,
            models: Vec::new(),
            prefill_replicas: None,
            decode_replicas: None,
            pd_threshold: strata_router::scheduling::pd::SUGGESTED_NON_CACHED_TOKENS,
            kv_tier_bytes: None,
        }
    }
}

/// `strata up` flags; each overrides the same key of `--config`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct UpArgs {
    /// `strata.yaml` (keys listed in the README); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A fixed number of engine replicas (no autoscaling) [default: 2].
    #[arg(long, conflicts_with_all = ["min_replicas", "max_replicas"])]
    pub replicas: Option<u32>,
    /// Autoscale from this many replicas (0: scale to zero when idle).
    #[arg(long)]
    pub min_replicas: Option<u32>,
    /// Autoscale up to this many replicas.
    #[arg(long)]
    pub max_replicas: Option<u32>,
    /// Model name or GGUF path [default: smollm2-135m-instruct].
    #[arg(long)]
    pub model: Option<String>,
    /// Front address [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Front port [default: 8080].
    #[arg(long)]
    pub port: Option<u16>,
    /// KV-cache bytes per replica [default: 268435456].
    #[arg(long)]
    pub kv_cache_memory: Option<u64>,
    /// An extra `strata engine` flag for every replica (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Router config file.
    #[arg(long)]
    pub router_config: Option<PathBuf>,
    /// Seconds Ctrl-C waits for in-flight requests [default: 30].
    #[arg(long)]
    pub shutdown_grace_secs: Option<u64>,
    /// Directory for replica logs [default: this terminal].
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Leave the gateway out.
    #[arg(long)]
    pub no_gateway: bool,
    /// Gateway port [default: 4000; 0 picks a free one].
    #[arg(long)]
    pub gateway_port: Option<u16>,
    /// Gateway database [default: $STRATA_HOME/gateway.db; `:memory:` for none].
    #[arg(long)]
    pub gateway_db: Option<PathBuf>,
    /// Disaggregated serving: this many prefill engines (`--kv-role prefill`), with
    /// `--decode-replicas`; fixed counts, no autoscaling.
    #[arg(long, requires = "decode_replicas",
          conflicts_with_all = ["replicas", "min_replicas", "max_replicas"])]
    pub prefill_replicas: Option<u32>,
    /// Disaggregated serving: this many decode engines (`--kv-role decode`), with
    /// `--prefill-replicas`.
    #[arg(long, requires = "prefill_replicas",
          conflicts_with_all = ["replicas", "min_replicas", "max_replicas"])]
    pub decode_replicas: Option<u32>,
    /// Disaggregated serving: uncached prompt tokens at which a request goes through a
    /// prefill engine (0: every request) [default: 256].
    #[arg(long)]
    pub pd_threshold: Option<u32>,
    /// Start a shared KV tier (`strata kv-tier`) of this many memory bytes for every
    /// engine (`--kv-tier`).
    #[arg(long)]
    pub kv_tier_bytes: Option<u64>,
}

impl StackConfig {
    /// The file (if any) with the flags applied over it.
    pub fn load(args: &UpArgs) -> anyhow::Result<StackConfig> {
        let mut c = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                serde_yaml::from_str(&text).with_context(|| format!("in {}", path.display()))?
            }
            None => StackConfig::default(),
        };
        if !c.models.is_empty() {
            // `--model` and the replica flags describe the single-model form; with
            // `models:` each entry says its own.
            anyhow::ensure!(
                args.model.is_none()
                    && args.replicas.is_none()
                    && args.min_replicas.is_none()
                    && args.max_replicas.is_none(),
                "--model, --replicas, --min-replicas and --max-replicas cannot be used with \
                 `models:` in the config: set `model`, `replicas` or `autoscale` per entry"
            );
        }
        if let Some(v) = args.replicas {
            c.replicas = v;
            c.autoscale = None;
            c.prefill_replicas = None;
            c.decode_replicas = None;
        }
        if let (Some(p), Some(d)) = (args.prefill_replicas, args.decode_replicas) {
            c.prefill_replicas = Some(p);
            c.decode_replicas = Some(d);
        }
        if let Some(v) = args.pd_threshold {
            c.pd_threshold = v;
        }
        if args.kv_tier_bytes.is_some() {
            c.kv_tier_bytes = args.kv_tier_bytes;
        }
        if args.min_replicas.is_some() || args.max_replicas.is_some() {
            let mut a = c.autoscale.take().unwrap_or_default();
            if let Some(v) = args.min_replicas {
                a.min_replicas = v;
            }
            if let Some(v) = args.max_replicas {
                a.max_replicas = v;
            }
            c.autoscale = Some(a);
        }
        if let Some(v) = &args.model {
            c.model = v.clone();
        }
        if let Some(v) = &args.host {
            c.host = v.clone();
        }
        if let Some(v) = args.port {
            c.port = v;
        }
        if let Some(v) = args.kv_cache_memory {
            c.kv_cache_memory = v;
        }
        if !args.engine_args.is_empty() {
            c.engine_args = args.engine_args.clone();
        }
        if args.router_config.is_some() {
            c.router_config = args.router_config.clone();
        }
        if let Some(v) = args.shutdown_grace_secs {
            c.shutdown_grace_secs = v;
        }
        if args.log_dir.is_some() {
            c.log_dir = args.log_dir.clone();
        }
        if args.no_gateway {
            c.gateway = false;
        }
        if let Some(v) = args.gateway_port {
            c.gateway_port = v;
        }
        if args.gateway_db.is_some() {
            c.gateway_db = args.gateway_db.clone();
        }
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        match (self.prefill_replicas, self.decode_replicas) {
            (None, None) => {}
            (Some(p), Some(d)) => {
                anyhow::ensure!(
                    self.autoscale.is_none(),
                    "disaggregated serving (prefill_replicas/decode_replicas) runs fixed \
                     counts: it cannot be combined with autoscale, --min-replicas or \
                     --max-replicas"
                );
                anyhow::ensure!(
                    self.models.is_empty(),
                    "disaggregated serving (prefill_replicas/decode_replicas) serves one \
                     model: it cannot be combined with `models:`"
                );
                anyhow::ensure!(
                    (1..=64).contains(&p) && (1..=64).contains(&d),
                    "prefill_replicas and decode_replicas must be 1..=64, not {p} and {d}"
                );
                for role in ["--kv-role", "--kv-transfer-port"] {
                    anyhow::ensure!(
                        !self
                            .engine_args
                            .iter()
                            .any(|a| a == role || a.starts_with(&format!("{role}="))),
                        "{role} is set per group in disaggregated serving; leave it out of \
                         engine_args"
                    );
                }
            }
            _ => anyhow::bail!("prefill_replicas and decode_replicas go together"),
        }
        if let Some(b) = self.kv_tier_bytes {
            anyhow::ensure!(b >= 1 << 20, "kv_tier_bytes must be at least 1 MiB");
        }
        if !self.models.is_empty() {
            let single = StackConfig::default();
            anyhow::ensure!(
                self.model == single.model && self.autoscale.is_none(),
                "`model` and `autoscale` are per entry when `models:` is set"
            );
            self.pools()?;
        }
        anyhow::ensure!(
            (1..=64).contains(&self.replicas),
            "replicas must be 1..=64, not {}",
            self.replicas
        );
        anyhow::ensure!(!self.model.is_empty(), "model must not be empty");
        anyhow::ensure!(
            self.kv_cache_memory >= 1 << 20,
            "kv_cache_memory must be at least 1 MiB"
        );
        anyhow::ensure!(
            self.ready_timeout_secs > 0.0,
            "ready_timeout_secs must be positive"
        );
        if let Some(a) = &self.autoscale {
            a.validate().map_err(|e| anyhow::anyhow!("autoscale.{e}"))?;
            anyhow::ensure!(
                a.max_replicas <= 64,
                "autoscale.maxReplicas must be at most 64"
            );
        }
        anyhow::ensure!(
            self.controller_interval_secs.is_finite()
                && (0.05..=60.0).contains(&self.controller_interval_secs),
            "controller_interval_secs must be 0.05..=60"
        );
        if let Some(h) = self.hold_timeout_secs {
            anyhow::ensure!(
                h.is_finite() && h >= 0.0,
                "hold_timeout_secs must be zero or more"
            );
        }
        self.rollout.validate()?;
        anyhow::ensure!(
            (1..=16).contains(&self.canary_replicas),
            "canary_replicas must be 1..=16"
        );
        Ok(())
    }

    /// The autoscaling settings in force: `autoscale`, or `replicas` pinned.
    pub fn autoscale(&self) -> AutoscaleConfig {
        match &self.autoscale {
            Some(a) => a.clone(),
            None => AutoscaleConfig {
                min_replicas: self.replicas,
                max_replicas: self.replicas,
                warm_spares: 0,
                ..AutoscaleConfig::default()
            },
        }
    }

    /// Whether the replicas are mock engines (`--engine-arg=--mock`): nothing to pull.
    pub fn mock_engines(&self) -> bool {
        self.engine_args.iter().any(|a| a == "--mock")
    }

    /// The name clients send as `model`: the cache name, or a GGUF file's stem.
    pub fn served_model_name(&self) -> String {
        served_name_of(&self.model)
    }

    /// Whether the engines are split into prefill and decode groups.
    pub fn disaggregated(&self) -> bool {
        self.prefill_replicas.is_some() && self.decode_replicas.is_some()
    }

    /// The pools to run: the `models:` entries, or the one pool of `model`; disaggregated,
    /// the model's decode group then its prefill group (fixed counts, each engine told its
    /// role; a prefill engine also gets a transfer port of its own).
    pub fn pools(&self) -> Result<Vec<PoolSpec>, PoolConfigError> {
        if let (Some(p), Some(d)) = (self.prefill_replicas, self.decode_replicas) {
            let group = |role: &str, n: u32, extra: &[&str]| {
                let mut engine_args = self.engine_args.clone();
                engine_args.push("--kv-role".into());
                engine_args.push(role.into());
                engine_args.extend(extra.iter().map(|a| a.to_string()));
                PoolSpec {
                    name: self.served_model_name(),
                    model: self.model.clone(),
                    autoscale: AutoscaleConfig {
                        min_replicas: n,
                        max_replicas: n,
                        warm_spares: 0,
                        ..AutoscaleConfig::default()
                    },
                    engine_args,
                    kv_cache_memory: self.kv_cache_memory,
                    adapters: Vec::new(),
                    role: Some(role.into()),
                }
            };
            return Ok(vec![
                group("decode", d, &[]),
                group("prefill", p, &["--kv-transfer-port", "{free_port}"]),
            ]);
        }
        if self.models.is_empty() {
            return Ok(vec![PoolSpec {
                name: self.served_model_name(),
                model: self.model.clone(),
                autoscale: self.autoscale(),
                engine_args: self.engine_args.clone(),
                kv_cache_memory: self.kv_cache_memory,
                adapters: Vec::new(),
                role: None,
            }]);
        }
        crate::pools::resolve(&self.models, &self.engine_args, self.kv_cache_memory)
    }
}

/// One pool as the dashboard and `/controller/pools` see it.
struct PoolHandle {
    spec: PoolSpec,
    fleet: Fleet,
    status: Arc<Mutex<Status>>,
}

/// What the dashboard shows: every pool's replicas (both versions of the first pool during
/// a rollout) joined with the router's view, and the controllers' desired vs ready counts.
struct View {
    router: Router,
    pools: Vec<PoolHandle>,
    rollouts: Rollouts,
    /// The gateway, once started (it starts after the dashboard).
    gateway: std::sync::OnceLock<Arc<strata_gateway::Gateway>>,
}

impl View {
    fn pool_views(&self) -> Vec<PoolView> {
        self.pools
            .iter()
            .map(|p| {
                let s = p.status.lock().unwrap_or_else(|e| e.into_inner());
                PoolView {
                    name: match &p.spec.role {
                        Some(role) => format!("{} ({role})", p.spec.name),
                        None => p.spec.name.clone(),
                    },
                    model: p.spec.model.clone(),
                    adapters: p.spec.adapter_names(),
                    min_replicas: p.spec.autoscale.min_replicas,
                    max_replicas: p.spec.autoscale.max_replicas,
                    desired: s.desired,
                    ready: s.ready,
                    reason: s.last.as_ref().and_then(|l| {
                        serde_json::to_value(l.decision.reason)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_string))
                    }),
                }
            })
            .collect()
    }
}

impl StackView for View {
    fn replicas(&self) -> Vec<ReplicaView> {
        let routed = self.router.status();
        let several = self.pools.len() > 1;
        let mut out: Vec<ReplicaView> = Vec::new();
        for pool in &self.pools {
            // Replica ids restart at 1 in every pool: the pool's name tells them apart.
            let label = |id: &str| match &pool.spec.role {
                Some(role) => format!("{role} {id}"),
                None if several => format!("{} {id}", pool.spec.name),
                None => id.to_string(),
            };
            out.extend(pool.fleet.replicas().into_iter().map(|r| {
                let s = routed.iter().find(|s| s.spec.url == r.info.url);
                ReplicaView {
                    name: if r.canary {
                        format!("canary {}", label(&r.info.id))
                    } else {
                        label(&r.info.id)
                    },
                    url: r.info.url.clone(),
                    state: serde_json::to_value(r.info.phase)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_string))
                        .unwrap_or_default(),
                    ready: s.is_some_and(|s| s.ready),
                    model: r.version.clone(),
                    adapters: s.map(|s| s.spec.lora.clone()).unwrap_or_default(),
                    pool: pool.spec.name.clone(),
                }
            }));
            let backing_off = pool
                .status
                .lock()
                .map(|s| s.backing_off)
                .unwrap_or_default();
            for i in 0..backing_off {
                out.push(ReplicaView {
                    name: label(&format!("(replacement {})", i + 1)),
                    url: String::new(),
                    state: "restarting".to_string(),
                    ready: false,
                    model: String::new(),
                    adapters: Vec::new(),
                    pool: pool.spec.name.clone(),
                });
            }
        }
        out
    }

    fn router_metrics(&self) -> Option<String> {
        Some(self.router.metrics().encode())
    }

    fn gateway_metrics(&self) -> Option<String> {
        self.gateway.get().map(|g| g.metrics.render())
    }

    fn load(&self, url: &str) -> Option<Arc<strata_api::model_server::LoadSample>> {
        // The dashboard ticks once a second; a page older than a few ticks is no reading.
        self.router
            .load_sample(url)
            .filter(|(_, age)| *age <= Duration::from_secs(3))
            .map(|(load, _)| load)
    }

    /// The pools' desired and ready counts summed; the reason and signal are the first
    /// pool's (each pool's own are in [`StackView::pools`]).
    fn controller(&self) -> Option<serde_json::Value> {
        let (mut desired, mut ready) = (0u32, 0u32);
        let mut first = None;
        for (i, p) in self.pools.iter().enumerate() {
            let s = p.status.lock().ok()?;
            desired = desired.saturating_add(s.desired);
            ready = ready.saturating_add(s.ready);
            if i == 0 {
                first = s
                    .last
                    .as_ref()
                    .map(|l| (l.decision.reason, l.decision.signal));
            }
        }
        let rollout = self.rollouts.view().map(|v| {
            serde_json::json!({
                "canary": v.canary,
                "baseline": v.baseline,
                "phase": v.state.phase,
                "weight": v.state.weight,
            })
        });
        Some(serde_json::json!({
            "desired": desired,
            "ready": ready,
            "reason": first.map(|f| f.0),
            "signal": first.map(|f| f.1),
            "rollout": rollout,
        }))
    }

    fn pools(&self) -> Vec<PoolView> {
        self.pool_views()
    }
}

/// Pulls `model` with `strata model pull` (progress on this terminal) unless it is a path.
pub(crate) fn pull_model(model: &str) -> anyhow::Result<()> {
    if std::path::Path::new(model).is_file() {
        return Ok(());
    }
    let exe = std::env::current_exe().context("finding the strata executable")?;
    let status = std::process::Command::new(exe)
        .args(["model", "pull", model])
        .stdout(std::process::Stdio::null())
        .status()
        .context("running strata model pull")?;
    anyhow::ensure!(status.success(), "pulling {model} failed ({status})");
    Ok(())
}

/// The engine command line every replica of `pool` runs (`{model}` is the version).
fn engine_command(pool: &PoolSpec, shutdown_grace_secs: u64) -> Vec<String> {
    let mut args: Vec<String> = [
        "engine",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--model",
        "{model}",
        "--served-model-name",
    ]
    .map(String::from)
    .to_vec();
    args.push(pool.name.clone());
    args.push("--kv-cache-memory".into());
    args.push(pool.kv_cache_memory.to_string());
    let has = |flag: &str| {
        pool.engine_args
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    // A stopped replica finishes what it accepted within this grace (the driver's SIGKILL
    // comes only after it), unless the engine arguments say otherwise.
    if !has("--shutdown-grace-secs") {
        args.push("--shutdown-grace-secs".into());
        args.push(shutdown_grace_secs.to_string());
    }
    if !pool.adapters.is_empty() {
        if !has("--enable-lora") {
            args.push("--enable-lora".into());
        }
        // Room for every configured adapter at once, unless the pool says otherwise.
        if !has("--max-loras") {
            args.push("--max-loras".into());
            args.push(pool.adapters.len().to_string());
        }
        for a in &pool.adapters {
            args.push("--lora-modules".into());
            args.push(format!("{}={}", a.name, a.path.display()));
        }
    }
    args.extend(pool.engine_args.iter().cloned());
    args
}

/// What `run` keeps of each pool after building it.
struct Built {
    spec: PoolSpec,
    fleet: Fleet,
    held: Arc<AtomicU32>,
    status: Arc<Mutex<Status>>,
    engine_args: Vec<String>,
    driver_cfg: LocalDriverConfig,
    log_dir: Option<PathBuf>,
}

/// `N replica(s)`, and the bounds when it autoscales: the banner's words for a pool.
fn bounds(a: &AutoscaleConfig) -> (String, String) {
    let count = format!("{} replica(s)", a.min_replicas);
    if a.min_replicas == a.max_replicas {
        (count, String::new())
    } else {
        (
            count,
            format!(", autoscaling {}..{}", a.min_replicas, a.max_replicas),
        )
    }
}

/// Runs the stack until Ctrl-C or SIGTERM.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let cfg = StackConfig::load(&args)?;
    let mut specs = cfg.pools()?;
    // The shared KV tier first: every engine is told where it is.
    let _tier = match cfg.kv_tier_bytes {
        Some(bytes) => {
            let (child, addr) = start_kv_tier(bytes, cfg.log_dir.as_deref()).await?;
            eprintln!("strata up: KV tier at {addr} ({bytes} bytes)");
            for p in &mut specs {
                p.engine_args.push("--kv-tier".into());
                p.engine_args.push(addr.to_string());
            }
            Some(child)
        }
        None => None,
    };
    for p in &specs {
        let a = &p.autoscale;
        if let Some(role) = &p.role {
            eprintln!("strata up: {} x {} ({role})", a.min_replicas, p.model);
        } else if a.min_replicas == a.max_replicas {
            eprintln!("strata up: {} x {}", a.min_replicas, p.model);
        } else {
            eprintln!(
                "strata up: {}..{} x {} (autoscaling)",
                a.min_replicas, a.max_replicas, p.model
            );
        }
    }
    // Each model once, before any replica starts (replicas would race to pull it).
    let mut pulls: Vec<String> = Vec::new();
    for p in specs.iter().filter(|p| !p.mock()) {
        if !pulls.contains(&p.model) {
            pulls.push(p.model.clone());
        }
    }
    for pull in pulls {
        tokio::task::spawn_blocking(move || pull_model(&pull))
            .await
            .context("model pull task")??;
    }

    let router_config = match &cfg.router_config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            RouterConfig::from_yaml(&text).with_context(|| format!("in {}", path.display()))?
        }
        None => RouterConfig::default(),
    };
    let router_config = pd_router_config(&cfg, router_config);
    let router = Router::new(router_config)?;
    let groups = GroupMap::default();
    if let Some(dir) = &cfg.log_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }

    // One controller loop per pool, each over its own replicas and signals; the first
    // pool's metrics are the controller's `/metrics`.
    let interval = Duration::from_secs_f64(cfg.controller_interval_secs);
    let metrics = Arc::new(ControllerMetrics::new());
    let mut built = Vec::with_capacity(specs.len());
    let mut controllers = Vec::with_capacity(specs.len());
    for (i, spec) in specs.into_iter().enumerate() {
        let held = Arc::new(AtomicU32::new(0));
        let registrar = Arc::new(
            RouterRegistrar::new(
                router.clone(),
                spec.name.clone(),
                spec.model.clone(),
                groups.clone(),
                held.clone(),
            )
            .with_adapters(spec.adapter_names())
            .with_role(spec.role.clone()),
        );
        let engine_args = engine_command(&spec, cfg.shutdown_grace_secs);
        // Replica ids restart in every pool: the second and later pools log apart.
        let log_dir = cfg.log_dir.as_ref().map(|d| {
            if i == 0 {
                d.clone()
            } else {
                match &spec.role {
                    Some(role) => d.join(role),
                    None => d.join(format!("pool-{}", spec.slug())),
                }
            }
        });
        if let Some(dir) = &log_dir {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let driver_cfg = LocalDriverConfig {
            args: engine_args.clone(),
            model: spec.model.clone(),
            host: "127.0.0.1".to_string(),
            ready_timeout_secs: cfg.ready_timeout_secs,
            // The engine drains what it accepted for `shutdown_grace_secs` after SIGTERM: the
            // driver must not kill it sooner.
            stop_grace_secs: cfg.shutdown_grace_secs as f64 + 5.0,
            drain_timeout_secs: cfg.shutdown_grace_secs as f64,
            log_dir: log_dir.clone(),
            ..LocalDriverConfig::default()
        };
        let driver = LocalDriver::new(driver_cfg.clone(), registrar.clone())?;
        let fleet = Fleet::new(Member::new(spec.model.clone(), driver));
        let pool_metrics = if i == 0 {
            metrics.clone()
        } else {
            Arc::new(ControllerMetrics::new())
        };
        let controller = Controller::new(
            spec.autoscale.clone(),
            interval,
            fleet.driver(),
            // The router's scraper is the one reader of each replica's /metrics.
            RouterSignals::new(router.clone(), Duration::from_secs(1)),
            registrar,
            pool_metrics,
        )
        .with_fault_backoff(Duration::from_secs(1), Duration::from_secs(30));
        let status = controller.status();
        controllers.push(controller);
        built.push(Built {
            spec,
            fleet,
            held,
            status,
            engine_args,
            driver_cfg,
            log_dir,
        });
    }
    let Some(first) = built.first() else {
        anyhow::bail!("no model to serve");
    };

    // Canary rollouts replace the first pool's version.
    let book = Arc::new(VersionStatsBook::default());
    let rollouts = Rollouts::new(
        first.fleet.clone(),
        router.clone(),
        book.clone(),
        groups.clone(),
        first.held.clone(),
        metrics.clone(),
        cfg.rollout.clone(),
        CanaryTemplate {
            args: first.engine_args.clone(),
            base: first.driver_cfg.clone(),
            served_model: first.spec.name.clone(),
            canary_replicas: cfg.canary_replicas,
            log_dir: first.log_dir.clone(),
            mock: first.spec.mock(),
            adapters: first.spec.adapter_names(),
        },
        interval,
    );

    // The front holds and names requests by pool; a prefill group is no pool of its own
    // to clients (its model is the decode group's).
    let pool_set = Arc::new(PoolSet(
        built
            .iter()
            .filter(|b| b.spec.role.as_deref() != Some("prefill"))
            .map(|b| PoolRoute {
                name: b.spec.name.clone(),
                model: b.spec.model.clone(),
                adapters: b.spec.adapters.clone(),
                held: b.held.clone(),
                retry_after_secs: retry_after(&b.spec.autoscale),
            })
            .collect(),
    ));
    let view = Arc::new(View {
        router: router.clone(),
        pools: built
            .iter()
            .map(|b| PoolHandle {
                spec: b.spec.clone(),
                fleet: b.fleet.clone(),
                status: b.status.clone(),
            })
            .collect(),
        rollouts: rollouts.clone(),
        gateway: std::sync::OnceLock::new(),
    });
    let dashboard = Dashboard::new(view.clone());
    let collector = dashboard.spawn(Duration::from_secs(1));

    let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port)
        .parse()
        .with_context(|| format!("bad front address {}:{}", cfg.host, cfg.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let front = listener.local_addr()?;
    let front_layer = Front {
        router: router.clone(),
        pools: pool_set.clone(),
        hold_timeout: Duration::from_secs_f64(
            cfg.hold_timeout_secs.unwrap_or(cfg.ready_timeout_secs),
        ),
        groups,
        book,
    };
    let pools_view = view.clone();
    let controller_routes = strata_controller::http::router(metrics, first.status.clone())
        .route(
            "/pools",
            axum::routing::get(move || {
                let v = pools_view.clone();
                async move { axum::Json(v.pool_views()) }
            }),
        )
        .nest("/rollout", rollouts.routes());
    let app = strata_router::proxy::app(router.clone())
        .layer(axum::middleware::from_fn_with_state(
            front_layer,
            crate::front::layer,
        ))
        .merge(dashboard.routes())
        .nest("/controller", controller_routes);

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let supervisor = tokio::spawn(async move {
        let mut loops = tokio::task::JoinSet::new();
        for controller in controllers {
            let stop = stop_rx.clone();
            loops.spawn(async move {
                controller.run(stop).await;
            });
        }
        while let Some(r) = loops.join_next().await {
            if let Err(e) = r {
                tracing::warn!(error = %e, "a pool's control loop failed");
            }
        }
    });
    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = drain_rx.await;
            })
            .await
    });

    // The gateway in front of the router, with a key generated for this run.
    let names = pool_set.names();
    let gateway = if cfg.gateway {
        let args = strata_gateway::GatewayArgs {
            config: None,
            host: cfg.host.clone(),
            port: cfg.gateway_port,
            db: cfg.gateway_db.clone(),
            admin_key: None,
            upstream: Some(format!("http://{front}")),
            models: names.clone(),
            create_key_for: None,
        };
        let gw = strata_gateway::cli::build(&args)?;
        let _ = view.gateway.set(gw.clone());
        let (key, _) = gw.create_key(strata_gateway::CreateKey {
            tenant: "default".into(),
            name: Some("generated by strata up".into()),
            ..Default::default()
        })?;
        let gaddr: SocketAddr = format!("{}:{}", cfg.host, cfg.gateway_port)
            .parse()
            .with_context(|| format!("bad gateway address {}:{}", cfg.host, cfg.gateway_port))?;
        let running = strata_gateway::spawn(gw, gaddr)
            .await
            .with_context(|| format!("binding the gateway to {gaddr}"))?;
        Some((running, key))
    } else {
        None
    };

    let gateway_line = gateway
        .as_ref()
        .map(|(g, key)| format!("  gateway:    {}/v1   (API key: {key})", g.url()));
    let waits: Vec<(Fleet, u32)> = built
        .iter()
        .map(|b| (b.fleet.clone(), b.spec.autoscale.min_replicas))
        .collect();
    let disaggregated = cfg.disaggregated();
    let summary: Vec<(String, (String, String), Vec<String>)> = built
        .iter()
        .map(|b| {
            (
                b.spec.name.clone(),
                bounds(&b.spec.autoscale),
                b.spec.adapter_names(),
            )
        })
        .collect();
    let announce = async {
        // Up once every pool has its minimum ready.
        loop {
            let short = waits.iter().any(|(fleet, want)| {
                let ready = fleet
                    .replicas()
                    .iter()
                    .filter(|r| !r.canary && r.info.phase == ReplicaPhase::Ready)
                    .count();
                (ready as u32) < *want
            });
            if !short {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let with = |adapters: &[String]| {
            if adapters.is_empty() {
                String::new()
            } else {
                format!(" (adapters: {})", adapters.join(", "))
            }
        };
        match (disaggregated, summary.as_slice()) {
            (true, [(name, (decode, _), _), (_, (prefill, _), _)]) => {
                let n = |s: &str| s.trim_end_matches(" replica(s)").to_string();
                println!(
                    "Strata is up: {} prefill + {} decode replica(s) of {name} (disaggregated)",
                    n(prefill),
                    n(decode)
                );
                println!("  OpenAI API: http://{front}/v1   (model \"{name}\")");
            }
            (_, [(name, (count, scaling), adapters)]) => {
                println!("Strata is up: {count} of {name}{scaling}{}", with(adapters));
                println!("  OpenAI API: http://{front}/v1   (model \"{name}\")");
            }
            _ => {
                println!("Strata is up: {} models", summary.len());
                for (name, (count, scaling), adapters) in &summary {
                    println!("  model {name}: {count}{scaling}{}", with(adapters));
                }
                println!(
                    "  OpenAI API: http://{front}/v1   (models: {})",
                    names.join(", ")
                );
            }
        }
        println!("  dashboard:  http://{front}/ui");
        println!("  controller: http://{front}/controller/status   (rollouts: strata rollout --url http://{front})");
        if let Some(line) = &gateway_line {
            println!("{line}");
        }
    };
    let gateway = gateway.map(|(g, _)| g);
    tokio::select! {
        _ = announce => {}
        _ = shutdown_signal() => {
            return stop(gateway, stop_tx, drain_tx, server, supervisor, collector, cfg.shutdown_grace_secs).await;
        }
    }
    shutdown_signal().await;
    stop(
        gateway,
        stop_tx,
        drain_tx,
        server,
        supervisor,
        collector,
        cfg.shutdown_grace_secs,
    )
    .await
}

/// The router's config in disaggregated mode: llm-d's profile pair at `pd_threshold`
/// unless the router config file brings its own scheduling.
fn pd_router_config(cfg: &StackConfig, mut rc: RouterConfig) -> RouterConfig {
    if !cfg.disaggregated() {
        return rc;
    }
    match &rc.scheduling {
        None => {
            rc.scheduling = Some(strata_router::EndpointPickerConfig::pd(cfg.pd_threshold));
        }
        Some(s) if !s.plugins.iter().any(|p| p.kind == "pd-profile-handler") => {
            tracing::warn!(
                "the router config's scheduling has no pd-profile-handler: requests are not \
                 disaggregated"
            );
        }
        Some(_) => {}
    }
    rc
}

/// Starts `strata kv-tier` on a free loopback port with `bytes` of memory; returns the
/// child (stopped when dropped) once it accepts connections.
async fn start_kv_tier(
    bytes: u64,
    log_dir: Option<&std::path::Path>,
) -> anyhow::Result<(tokio::process::Child, SocketAddr)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("finding a free port for the KV tier")?
        .port();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let exe = std::env::current_exe().context("finding the strata executable")?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args([
        "kv-tier",
        "--listen",
        &addr.to_string(),
        "--memory-bytes",
        &bytes.to_string(),
    ])
    .stdin(std::process::Stdio::null())
    .kill_on_drop(true);
    if let Some(dir) = log_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("kv-tier.log");
        let out =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        cmd.stdout(out.try_clone()?).stderr(out);
    }
    let mut child = cmd.spawn().context("starting strata kv-tier")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok((child, addr));
        }
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("strata kv-tier exited at start ({status})");
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "strata kv-tier did not listen on {addr} within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `Retry-After` for a request that found its pool still cold: about one cold start.
fn retry_after(a: &AutoscaleConfig) -> u64 {
    if a.cold_start_secs.is_finite() && a.cold_start_secs >= 1.0 {
        a.cold_start_secs.ceil().min(300.0) as u64
    } else {
        5
    }
}

async fn stop(
    gateway: Option<strata_gateway::RunningGateway>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    drain_tx: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    supervisor: tokio::task::JoinHandle<()>,
    collector: tokio::task::JoinHandle<()>,
    grace_secs: u64,
) -> anyhow::Result<()> {
    eprintln!("strata up: draining in-flight requests ...");
    if let Some(g) = gateway {
        let grace = Duration::from_secs(grace_secs);
        if tokio::time::timeout(grace, g.shutdown()).await.is_err() {
            tracing::warn!("gateway grace period over");
        }
    }
    let _ = drain_tx.send(());
    match tokio::time::timeout(Duration::from_secs(grace_secs), server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "front server"),
        Ok(Err(e)) => tracing::warn!(error = %e, "front server task"),
        Err(_) => tracing::warn!("grace period over; closing remaining connections"),
    }
    collector.abort();
    eprintln!("strata up: stopping replicas ...");
    let _ = stop_tx.send(true);
    supervisor.await.context("replica supervisor")?;
    eprintln!("strata up: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_get_the_stop_grace_unless_their_args_set_one() {
        let mut c = StackConfig {
            shutdown_grace_secs: 42,
            ..StackConfig::default()
        };
        let pool = |c: &StackConfig| c.pools().unwrap().remove(0);
        let args = engine_command(&pool(&c), c.shutdown_grace_secs);
        let i = args
            .iter()
            .position(|a| a == "--shutdown-grace-secs")
            .unwrap();
        assert_eq!(args[i + 1], "42");
        c.engine_args = vec!["--shutdown-grace-secs=7".into()];
        let args = engine_command(&pool(&c), c.shutdown_grace_secs);
        assert!(!args.iter().any(|a| a == "--shutdown-grace-secs"));
        assert_eq!(args.last().unwrap(), "--shutdown-grace-secs=7");
    }

    #[test]
    fn flags_override_the_file_and_bad_values_are_refused() {
        let dir = std::env::temp_dir().join(format!("strata-up-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        std::fs::write(
            &file,
            "replicas: 3\nport: 9000\nengine_args: [\"--max-num-seqs\", \"8\"]\n",
        )
        .unwrap();
        let args = UpArgs {
            config: Some(file.clone()),
            port: Some(9100),
            ..UpArgs::default()
        };
        let c = StackConfig::load(&args).unwrap();
        assert_eq!(c.replicas, 3);
        assert_eq!(c.port, 9100);
        assert_eq!(c.engine_args, ["--max-num-seqs", "8"]);
        assert_eq!(c.model, "smollm2-135m-instruct");

        std::fs::write(&file, "replicas: 3\nportt: 9000\n").unwrap();
        let err = StackConfig::load(&args).unwrap_err();
        assert!(format!("{err:#}").contains("portt"), "{err:#}");

        let zero = UpArgs {
            replicas: Some(0),
            ..UpArgs::default()
        };
        assert!(StackConfig::load(&zero).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `args` over a `strata.yaml` at `file` holding `yaml`.
    fn load_yaml(file: &std::path::Path, yaml: &str, args: UpArgs) -> anyhow::Result<StackConfig> {
        std::fs::write(file, yaml).unwrap();
        StackConfig::load(&UpArgs {
            config: Some(file.to_path_buf()),
            ..args
        })
    }

    #[test]
    fn replicas_pins_the_count_and_autoscale_keys_and_flags_set_bounds() {
        let dir = std::env::temp_dir().join(format!("strata-up-as-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        let with = |yaml: &str, args: UpArgs| load_yaml(&file, yaml, args);
        // Today's behaviour: a fixed count.
        let c = with("replicas: 3\n", UpArgs::default()).unwrap();
        let a = c.autoscale();
        assert_eq!((a.min_replicas, a.max_replicas, a.warm_spares), (3, 3, 0));
        // The controller's keys, camelCase.
        let yaml = "autoscale:\n  minReplicas: 0\n  maxReplicas: 4\n  warmSpares: 1\n  \
                    scaleToZeroAfterSecs: 5\nrollout:\n  steps: [10, 100]\n  minRequests: 3\n";
        let c = with(yaml, UpArgs::default()).unwrap();
        let a = c.autoscale();
        assert_eq!((a.min_replicas, a.max_replicas, a.warm_spares), (0, 4, 1));
        assert_eq!(a.scale_to_zero_after_secs, 5.0);
        assert_eq!(c.rollout.steps, vec![10, 100]);
        // Flags: --max-replicas over the file; --replicas pins again.
        let c = with(
            yaml,
            UpArgs {
                max_replicas: Some(2),
                ..UpArgs::default()
            },
        )
        .unwrap();
        assert_eq!(c.autoscale().max_replicas, 2);
        assert_eq!(c.autoscale().min_replicas, 0);
        let c = with(
            yaml,
            UpArgs {
                replicas: Some(1),
                ..UpArgs::default()
            },
        )
        .unwrap();
        assert_eq!(
            (c.autoscale().min_replicas, c.autoscale().max_replicas),
            (1, 1)
        );
        let c = with(
            "replicas: 2\n",
            UpArgs {
                min_replicas: Some(1),
                max_replicas: Some(5),
                ..UpArgs::default()
            },
        )
        .unwrap();
        assert_eq!(
            (c.autoscale().min_replicas, c.autoscale().max_replicas),
            (1, 5)
        );
        // Bad values name their key.
        let e = with(
            "autoscale:\n  minReplicas: 5\n  maxReplicas: 2\n",
            UpArgs::default(),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("minReplicas"), "{e:#}");
        let e = with("autoscale:\n  maxReplica: 2\n", UpArgs::default()).unwrap_err();
        assert!(format!("{e:#}").contains("maxReplica"), "{e:#}");
        let e = with("rollout:\n  steps: [50, 10]\n", UpArgs::default()).unwrap_err();
        assert!(format!("{e:#}").contains("steps"), "{e:#}");
        let e = with("controller_interval_secs: 0\n", UpArgs::default()).unwrap_err();
        assert!(
            format!("{e:#}").contains("controller_interval_secs"),
            "{e:#}"
        );
        assert!(with("engine_args: [--mock]\n", UpArgs::default())
            .unwrap()
            .mock_engines());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn models_make_one_pool_each_and_adapters_reach_the_engine_command() {
        let dir = std::env::temp_dir().join(format!("strata-up-models-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        std::fs::write(
            &file,
            "engine_args: [--max-num-seqs, '4']\nmodels:\n\
             - model: chat\n  replicas: 2\n  adapters: [{name: a, path: /ad/a}, {name: b, path: /ad/b}]\n\
             - model: /m/enc.gguf\n  autoscale: {minReplicas: 0, maxReplicas: 2}\n",
        )
        .unwrap();
        let args = UpArgs {
            config: Some(file.clone()),
            ..UpArgs::default()
        };
        let c = StackConfig::load(&args).unwrap();
        let pools = c.pools().unwrap();
        assert_eq!(pools.len(), 2);
        assert_eq!(pools[1].name, "enc");
        let cmd = engine_command(&pools[0], 30);
        let at = |flag: &str| cmd.iter().position(|a| a == flag).unwrap();
        assert_eq!(cmd[at("--served-model-name") + 1], "chat");
        assert_eq!(cmd[at("--max-loras") + 1], "2");
        assert!(cmd.contains(&"--enable-lora".to_string()));
        let modules: Vec<&String> = cmd
            .iter()
            .enumerate()
            .filter(|(i, _)| *i > 0 && cmd[i - 1] == "--lora-modules")
            .map(|(_, a)| a)
            .collect();
        assert_eq!(modules, ["a=/ad/a", "b=/ad/b"]);
        assert_eq!(cmd[cmd.len() - 2..], ["--max-num-seqs", "4"]);
        // No adapters: no LoRA flags.
        let cmd = engine_command(&pools[1], 30);
        assert!(!cmd.iter().any(|a| a.contains("lora")), "{cmd:?}");
        // The single-model flags conflict with `models:`.
        for bad in [
            UpArgs {
                model: Some("x".into()),
                ..args.clone()
            },
            UpArgs {
                replicas: Some(1),
                ..args.clone()
            },
        ] {
            let e = StackConfig::load(&bad).unwrap_err();
            assert!(format!("{e:#}").contains("per entry"), "{e:#}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn disaggregated_layout_two_fixed_groups_with_roles() {
        let args = UpArgs {
            prefill_replicas: Some(2),
            decode_replicas: Some(3),
            pd_threshold: Some(32),
            engine_args: vec!["--mock".into()],
            ..UpArgs::default()
        };
        let c = StackConfig::load(&args).unwrap();
        assert!(c.disaggregated());
        let pools = c.pools().unwrap();
        assert_eq!(pools.len(), 2);
        let (decode, prefill) = (&pools[0], &pools[1]);
        assert_eq!(decode.role.as_deref(), Some("decode"));
        assert_eq!(prefill.role.as_deref(), Some("prefill"));
        assert_eq!(decode.name, prefill.name, "one served model");
        for (p, n) in [(decode, 3), (prefill, 2)] {
            let a = &p.autoscale;
            assert_eq!((a.min_replicas, a.max_replicas, a.warm_spares), (n, n, 0));
        }
        let cmd = engine_command(prefill, 30);
        let at = |cmd: &[String], flag: &str| cmd.iter().position(|a| a == flag).unwrap();
        assert_eq!(cmd[at(&cmd, "--kv-role") + 1], "prefill");
        assert_eq!(cmd[at(&cmd, "--kv-transfer-port") + 1], "{free_port}");
        assert!(cmd.contains(&"--mock".to_string()));
        let cmd = engine_command(decode, 30);
        assert_eq!(cmd[at(&cmd, "--kv-role") + 1], "decode");
        assert!(!cmd.iter().any(|a| a == "--kv-transfer-port"));
        // The router runs the profile pair at the threshold, unless its file says otherwise.
        let rc = pd_router_config(&c, RouterConfig::default());
        let picker = rc.picker_config().build().unwrap();
        assert_eq!(picker.pd().unwrap().decider.non_cached_tokens, 32);
        let custom = RouterConfig {
            scheduling: Some(strata_router::EndpointPickerConfig::default_config()),
            ..RouterConfig::default()
        };
        assert!(pd_router_config(&c, custom)
            .picker_config()
            .build()
            .unwrap()
            .pd()
            .is_none());
        // Colocated: one pool, no role, no pair.
        let plain = StackConfig::default();
        assert_eq!(plain.pools().unwrap()[0].role, None);
        assert!(pd_router_config(&plain, RouterConfig::default())
            .scheduling
            .is_none());
    }

    #[test]
    fn disaggregated_mode_refuses_autoscaling_models_and_its_own_flags() {
        let dir = std::env::temp_dir().join(format!("strata-up-pd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        let with = |yaml: &str, args: UpArgs| load_yaml(&file, yaml, args);
        let pd = || UpArgs {
            prefill_replicas: Some(1),
            decode_replicas: Some(1),
            ..UpArgs::default()
        };
        let e = with("autoscale: {minReplicas: 0, maxReplicas: 2}\n", pd()).unwrap_err();
        assert!(format!("{e:#}").contains("autoscale"), "{e:#}");
        let e = with("models: [{model: a}]\n", pd()).unwrap_err();
        assert!(format!("{e:#}").contains("models"), "{e:#}");
        let e = with("engine_args: [--kv-role, both]\n", pd()).unwrap_err();
        assert!(format!("{e:#}").contains("--kv-role"), "{e:#}");
        let e = with("prefill_replicas: 1\n", UpArgs::default()).unwrap_err();
        assert!(format!("{e:#}").contains("go together"), "{e:#}");
        let e = with(
            "prefill_replicas: 0\ndecode_replicas: 1\n",
            UpArgs::default(),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("1..=64"), "{e:#}");
        let e = with("kv_tier_bytes: 10\n", UpArgs::default()).unwrap_err();
        assert!(format!("{e:#}").contains("kv_tier_bytes"), "{e:#}");
        // The file's keys work as the flags do; --replicas goes back to colocated.
        let c = with(
            "prefill_replicas: 1\ndecode_replicas: 2\npd_threshold: 0\n",
            UpArgs::default(),
        )
        .unwrap();
        assert!(c.disaggregated());
        assert_eq!(c.pd_threshold, 0);
        let c = with(
            "prefill_replicas: 1\ndecode_replicas: 2\n",
            UpArgs {
                replicas: Some(2),
                ..UpArgs::default()
            },
        )
        .unwrap();
        assert!(!c.disaggregated());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn served_name_is_the_cache_name_or_the_file_stem() {
        let mut c = StackConfig::default();
        assert_eq!(c.served_model_name(), "smollm2-135m-instruct");
        c.model = "/models/tiny-llama.gguf".into();
        assert_eq!(c.served_model_name(), "tiny-llama");
    }
}
