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

use crate::dashboard::{Dashboard, ReplicaView, StackView};
use crate::fleet::{Fleet, GroupMap, Member, RouterRegistrar};
use crate::front::{Front, VersionStatsBook};
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
    /// Where replica logs go (`<id>.log`); absent: this terminal.
    pub log_dir: Option<PathBuf>,
    /// Port of the gateway (API keys, limits, budgets) in front of the router; `0` picks a
    /// free port. `gateway: false` leaves it out.
    pub gateway: bool,
    pub gateway_port: u16,
    /// The gateway's SQLite file (`:memory:` for none); absent: `$STRATA_HOME/gateway.db`.
    pub gateway_db: Option<PathBuf>,
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
        if let Some(v) = args.replicas {
            c.replicas = v;
            c.autoscale = None;
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
        let p = std::path::Path::new(&self.model);
        if p.extension().is_some_and(|e| e == "gguf") {
            if let Some(stem) = p.file_stem() {
                return stem.to_string_lossy().into_owned();
            }
        }
        self.model.clone()
    }
}

/// What the dashboard shows: both versions' replicas joined with the router's view, and
/// the controller's desired vs ready count.
struct View {
    router: Router,
    fleet: Fleet,
    status: Arc<Mutex<Status>>,
    rollouts: Rollouts,
}

impl StackView for View {
    fn replicas(&self) -> Vec<ReplicaView> {
        let routed = self.router.status();
        let mut out: Vec<ReplicaView> = self
            .fleet
            .replicas()
            .into_iter()
            .map(|r| {
                let s = routed.iter().find(|s| s.spec.url == r.info.url);
                ReplicaView {
                    name: if r.canary {
                        format!("canary {}", r.info.id)
                    } else {
                        r.info.id.clone()
                    },
                    url: r.info.url.clone(),
                    state: serde_json::to_value(r.info.phase)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_string))
                        .unwrap_or_default(),
                    ready: s.is_some_and(|s| s.ready),
                    model: r.version.clone(),
                    adapters: s.map(|s| s.spec.lora.clone()).unwrap_or_default(),
                }
            })
            .collect();
        let backing_off = self
            .status
            .lock()
            .map(|s| s.backing_off)
            .unwrap_or_default();
        for i in 0..backing_off {
            out.push(ReplicaView {
                name: format!("(replacement {})", i + 1),
                url: String::new(),
                state: "restarting".to_string(),
                ready: false,
                model: String::new(),
                adapters: Vec::new(),
            });
        }
        out
    }

    fn router_metrics(&self) -> Option<String> {
        Some(self.router.metrics().encode())
    }

    fn load(&self, url: &str) -> Option<Arc<strata_api::model_server::LoadSample>> {
        // The dashboard ticks once a second; a page older than a few ticks is no reading.
        self.router
            .load_sample(url)
            .filter(|(_, age)| *age <= Duration::from_secs(3))
            .map(|(load, _)| load)
    }

    fn controller(&self) -> Option<serde_json::Value> {
        let s = self.status.lock().ok()?;
        let last = s.last.as_ref();
        let rollout = self.rollouts.view().map(|v| {
            serde_json::json!({
                "canary": v.canary,
                "baseline": v.baseline,
                "phase": v.state.phase,
                "weight": v.state.weight,
            })
        });
        Some(serde_json::json!({
            "desired": s.desired,
            "ready": s.ready,
            "reason": last.map(|l| l.decision.reason),
            "signal": last.map(|l| l.decision.signal),
            "rollout": rollout,
        }))
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

/// The engine command line every replica runs (`{model}` is the version).
fn engine_command(cfg: &StackConfig, served: &str) -> Vec<String> {
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
    args.push(served.to_string());
    args.push("--kv-cache-memory".into());
    args.push(cfg.kv_cache_memory.to_string());
    // A stopped replica finishes what it accepted within this grace (the driver's SIGKILL
    // comes only after it), unless the engine arguments say otherwise.
    if !cfg
        .engine_args
        .iter()
        .any(|a| a.starts_with("--shutdown-grace-secs"))
    {
        args.push("--shutdown-grace-secs".into());
        args.push(cfg.shutdown_grace_secs.to_string());
    }
    args.extend(cfg.engine_args.iter().cloned());
    args
}

/// Runs the stack until Ctrl-C or SIGTERM.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let cfg = StackConfig::load(&args)?;
    let model = cfg.served_model_name();
    let autoscale = cfg.autoscale();
    if autoscale.min_replicas == autoscale.max_replicas {
        eprintln!("strata up: {} x {}", autoscale.min_replicas, cfg.model);
    } else {
        eprintln!(
            "strata up: {}..{} x {} (autoscaling)",
            autoscale.min_replicas, autoscale.max_replicas, cfg.model
        );
    }
    if !cfg.mock_engines() {
        let pull = cfg.model.clone();
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
    let router = Router::new(router_config)?;
    let groups = GroupMap::default();
    let held = Arc::new(AtomicU32::new(0));
    let registrar = Arc::new(RouterRegistrar::new(
        router.clone(),
        model.clone(),
        cfg.model.clone(),
        groups.clone(),
        held.clone(),
    ));
    let engine_args = engine_command(&cfg, &model);
    let driver_cfg = LocalDriverConfig {
        args: engine_args.clone(),
        model: cfg.model.clone(),
        host: "127.0.0.1".to_string(),
        ready_timeout_secs: cfg.ready_timeout_secs,
        // The engine drains what it accepted for `shutdown_grace_secs` after SIGTERM: the
        // driver must not kill it sooner.
        stop_grace_secs: cfg.shutdown_grace_secs as f64 + 5.0,
        drain_timeout_secs: cfg.shutdown_grace_secs as f64,
        log_dir: cfg.log_dir.clone(),
        ..LocalDriverConfig::default()
    };
    if let Some(dir) = &cfg.log_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let driver = LocalDriver::new(driver_cfg.clone(), registrar.clone())?;
    let fleet = Fleet::new(Member::new(cfg.model.clone(), driver));

    // The controller: its loop over the fleet, the router as registrar.
    let interval = Duration::from_secs_f64(cfg.controller_interval_secs);
    let metrics = Arc::new(ControllerMetrics::new());
    let controller = Controller::new(
        autoscale.clone(),
        interval,
        fleet.driver(),
        // The router's scraper is the one reader of each replica's /metrics.
        RouterSignals::new(router.clone(), Duration::from_secs(1)),
        registrar,
        metrics.clone(),
    )
    .with_fault_backoff(Duration::from_secs(1), Duration::from_secs(30));
    let status = controller.status();

    let book = Arc::new(VersionStatsBook::default());
    let rollouts = Rollouts::new(
        fleet.clone(),
        router.clone(),
        book.clone(),
        groups.clone(),
        held.clone(),
        metrics.clone(),
        cfg.rollout.clone(),
        CanaryTemplate {
            args: engine_args,
            base: driver_cfg,
            served_model: model.clone(),
            canary_replicas: cfg.canary_replicas,
            log_dir: cfg.log_dir.clone(),
            mock: cfg.mock_engines(),
        },
        interval,
    );

    let dashboard = Dashboard::new(Arc::new(View {
        router: router.clone(),
        fleet: fleet.clone(),
        status: status.clone(),
        rollouts: rollouts.clone(),
    }));
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
        held,
        hold_timeout: Duration::from_secs_f64(
            cfg.hold_timeout_secs.unwrap_or(cfg.ready_timeout_secs),
        ),
        groups,
        book,
    };
    let controller_routes = strata_controller::http::router(metrics, status.clone())
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
        controller.run(stop_rx).await;
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
    let gateway = if cfg.gateway {
        let args = strata_gateway::GatewayArgs {
            config: None,
            host: cfg.host.clone(),
            port: cfg.gateway_port,
            db: cfg.gateway_db.clone(),
            admin_key: None,
            upstream: Some(format!("http://{front}")),
            models: vec![model.clone()],
            create_key_for: None,
        };
        let gw = strata_gateway::cli::build(&args)?;
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

    let want = autoscale.min_replicas;
    let gateway_line = gateway
        .as_ref()
        .map(|(g, key)| format!("  gateway:    {}/v1   (API key: {key})", g.url()));
    let announce = async {
        loop {
            let ready = fleet
                .replicas()
                .iter()
                .filter(|r| !r.canary && r.info.phase == ReplicaPhase::Ready)
                .count() as u32;
            if ready >= want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if autoscale.min_replicas == autoscale.max_replicas {
            println!("Strata is up: {want} replica(s) of {model}");
        } else {
            println!(
                "Strata is up: {want} replica(s) of {model}, autoscaling {}..{}",
                autoscale.min_replicas, autoscale.max_replicas
            );
        }
        println!("  OpenAI API: http://{front}/v1   (model \"{model}\")");
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
        let args = engine_command(&c, "m");
        let i = args
            .iter()
            .position(|a| a == "--shutdown-grace-secs")
            .unwrap();
        assert_eq!(args[i + 1], "42");
        c.engine_args = vec!["--shutdown-grace-secs=7".into()];
        let args = engine_command(&c, "m");
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

    #[test]
    fn replicas_pins_the_count_and_autoscale_keys_and_flags_set_bounds() {
        let dir = std::env::temp_dir().join(format!("strata-up-as-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        let with = |yaml: &str, args: UpArgs| {
            std::fs::write(&file, yaml).unwrap();
            StackConfig::load(&UpArgs {
                config: Some(file.clone()),
                ..args
            })
        };
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
    fn served_name_is_the_cache_name_or_the_file_stem() {
        let mut c = StackConfig::default();
        assert_eq!(c.served_model_name(), "smollm2-135m-instruct");
        c.model = "/models/tiny-llama.gguf".into();
        assert_eq!(c.served_model_name(), "tiny-llama");
    }
}
