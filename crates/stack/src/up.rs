//! `strata up`: pulls the model, supervises N engine replicas (the controller's local
//! driver), puts the router in front of them on one port with the dashboard at `/ui`, and
//! on Ctrl-C drains and stops everything.
//!
//! A replica is registered with the router only once it answers `/health`; a replica that
//! crashes is deregistered at once and replaced after an exponential backoff (1 s, 2 s, 4 s
//! ... up to 30 s; reset when a replacement becomes ready).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use strata_controller::driver::local::{LocalDriver, LocalDriverConfig};
use strata_controller::driver::{Driver, ReplicaEvent, ReplicaInfo, ReplicaRegistrar};
use strata_router::server::shutdown_signal;
use strata_router::{EndpointSpec, EngineKind, Router, RouterConfig};

use crate::dashboard::{Dashboard, ReplicaView, StackView};

/// `strata.yaml`: every key has a flag of the same name and a default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StackConfig {
    /// Engine replicas to run.
    pub replicas: u32,
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
    /// Engine replicas [default: 2].
    #[arg(long)]
    pub replicas: Option<u32>,
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
        Ok(())
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

/// Registers ready replicas with the in-process router.
struct RouterRegistrar {
    router: Router,
    model: String,
    urls: Mutex<HashMap<String, String>>,
}

impl ReplicaRegistrar for RouterRegistrar {
    fn register(&self, replica: &ReplicaInfo) {
        let mut spec = EndpointSpec::new(replica.url.clone(), EngineKind::Strata);
        spec.model = Some(self.model.clone());
        match self.router.add_endpoint(spec) {
            Ok(_) => {
                self.urls
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(replica.id.clone(), replica.url.clone());
            }
            Err(e) => tracing::warn!(replica = %replica.id, error = %e, "router refused a replica"),
        }
    }

    fn deregister(&self, id: &str) {
        let url = self
            .urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(url) = url {
            if let Err(e) = self.router.remove_endpoint(&url) {
                tracing::debug!(replica = %id, error = %e, "already gone from the router");
            }
        }
    }
}

/// What the dashboard shows: the driver's replicas joined with the router's view.
struct View {
    router: Router,
    model: String,
    replicas: Arc<Mutex<Vec<ReplicaInfo>>>,
    restarting: Arc<Mutex<u32>>,
}

impl StackView for View {
    fn replicas(&self) -> Vec<ReplicaView> {
        let status = self.router.status();
        let replicas = self
            .replicas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut out: Vec<ReplicaView> = replicas
            .iter()
            .map(|r| {
                let routed = status.iter().find(|s| s.spec.url == r.url);
                ReplicaView {
                    name: r.id.clone(),
                    url: r.url.clone(),
                    state: serde_json::to_value(r.phase)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_string))
                        .unwrap_or_default(),
                    ready: routed.is_some_and(|s| s.ready),
                    model: self.model.clone(),
                    adapters: routed.map(|s| s.spec.lora.clone()).unwrap_or_default(),
                }
            })
            .collect();
        let pending = *self.restarting.lock().unwrap_or_else(|e| e.into_inner());
        for i in 0..pending {
            out.push(ReplicaView {
                name: format!("(replacement {})", i + 1),
                url: String::new(),
                state: "restarting".to_string(),
                ready: false,
                model: self.model.clone(),
                adapters: Vec::new(),
            });
        }
        out
    }

    fn router_metrics(&self) -> Option<String> {
        Some(self.router.metrics().encode())
    }
}

/// Pulls `model` with `strata model pull` (progress on this terminal) unless it is a path.
fn pull_model(model: &str) -> anyhow::Result<()> {
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

/// The replica supervisor: keeps `desired` replicas, replacing crashed ones after a
/// backoff. Returns when `stop` fires, after draining and stopping every replica.
async fn supervise(
    mut driver: LocalDriver,
    desired: u32,
    replicas: Arc<Mutex<Vec<ReplicaInfo>>>,
    restarting: Arc<Mutex<u32>>,
    ready_tx: tokio::sync::watch::Sender<u32>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut failures = 0u32;
    let mut hold_until: Option<tokio::time::Instant> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        let live = driver.replicas().len() as u32;
        let now = tokio::time::Instant::now();
        let holding = hold_until.is_some_and(|t| now < t);
        // While backing off, keep what runs and start nothing new.
        let target = if holding { live.min(desired) } else { desired };
        *restarting.lock().unwrap_or_else(|e| e.into_inner()) = desired.saturating_sub(target);
        match driver.reconcile(target).await {
            Ok(events) => {
                for e in &events {
                    if e.is_fault() {
                        failures += 1;
                        let backoff = Duration::from_secs(1u64 << (failures - 1).min(5))
                            .min(Duration::from_secs(30));
                        hold_until = Some(tokio::time::Instant::now() + backoff);
                        tracing::warn!(event = %e, backoff_s = backoff.as_secs(), "replica fault");
                    } else {
                        if matches!(e, ReplicaEvent::Ready { .. }) {
                            failures = 0;
                        }
                        tracing::info!(event = %e, "replica");
                    }
                }
            }
            Err(e) => {
                failures += 1;
                let backoff =
                    Duration::from_secs(1u64 << (failures - 1).min(5)).min(Duration::from_secs(30));
                hold_until = Some(tokio::time::Instant::now() + backoff);
                tracing::warn!(error = %e, backoff_s = backoff.as_secs(), "driver error; retrying");
            }
        }
        let now_replicas = driver.replicas();
        let ready = now_replicas
            .iter()
            .filter(|r| r.phase == strata_controller::driver::ReplicaPhase::Ready)
            .count() as u32;
        *replicas.lock().unwrap_or_else(|e| e.into_inner()) = now_replicas;
        let _ = ready_tx.send(ready);
    }
    for e in driver.shutdown().await {
        tracing::info!(event = %e, "replica");
    }
    replicas.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// Runs the stack until Ctrl-C or SIGTERM.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let cfg = StackConfig::load(&args)?;
    let model = cfg.served_model_name();
    eprintln!("strata up: {} x {}", cfg.replicas, cfg.model);
    let pull = cfg.model.clone();
    tokio::task::spawn_blocking(move || pull_model(&pull))
        .await
        .context("model pull task")??;

    let router_config = match &cfg.router_config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            RouterConfig::from_yaml(&text).with_context(|| format!("in {}", path.display()))?
        }
        None => RouterConfig::default(),
    };
    let router = Router::new(router_config)?;
    let registrar = Arc::new(RouterRegistrar {
        router: router.clone(),
        model: model.clone(),
        urls: Mutex::default(),
    });
    let mut engine_args: Vec<String> = [
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
    engine_args.push(model.clone());
    engine_args.push("--kv-cache-memory".into());
    engine_args.push(cfg.kv_cache_memory.to_string());
    engine_args.extend(cfg.engine_args.iter().cloned());
    let driver_cfg = LocalDriverConfig {
        args: engine_args,
        model: cfg.model.clone(),
        host: "127.0.0.1".to_string(),
        ready_timeout_secs: cfg.ready_timeout_secs,
        stop_grace_secs: 10.0,
        drain_timeout_secs: cfg.shutdown_grace_secs as f64,
        log_dir: cfg.log_dir.clone(),
        ..LocalDriverConfig::default()
    };
    if let Some(dir) = &cfg.log_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let driver = LocalDriver::new(driver_cfg, registrar)?;

    let replicas: Arc<Mutex<Vec<ReplicaInfo>>> = Arc::default();
    let restarting: Arc<Mutex<u32>> = Arc::default();
    let dashboard = Dashboard::new(Arc::new(View {
        router: router.clone(),
        model: model.clone(),
        replicas: replicas.clone(),
        restarting: restarting.clone(),
    }));
    let collector = dashboard.spawn(Duration::from_secs(1));

    let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port)
        .parse()
        .with_context(|| format!("bad front address {}:{}", cfg.host, cfg.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let front = listener.local_addr()?;
    let app = strata_router::proxy::app(router.clone()).merge(dashboard.routes());

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (ready_tx, mut ready_rx) = tokio::sync::watch::channel(0u32);
    let supervisor = tokio::spawn(supervise(
        driver,
        cfg.replicas,
        replicas,
        restarting,
        ready_tx,
        stop_rx,
    ));
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

    let want = cfg.replicas;
    let gateway_line = gateway
        .as_ref()
        .map(|(g, key)| format!("  gateway:    {}/v1   (API key: {key})", g.url()));
    let announce = async {
        while *ready_rx.borrow() < want {
            if ready_rx.changed().await.is_err() {
                return;
            }
        }
        println!("Strata is up: {want} replica(s) of {model}");
        println!("  OpenAI API: http://{front}/v1   (model \"{model}\")");
        println!("  dashboard:  http://{front}/ui");
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
    fn served_name_is_the_cache_name_or_the_file_stem() {
        let mut c = StackConfig::default();
        assert_eq!(c.served_model_name(), "smollm2-135m-instruct");
        c.model = "/models/tiny-llama.gguf".into();
        assert_eq!(c.served_model_name(), "tiny-llama");
    }
}
