//! Command-line surfaces the `strata` binary wires: `strata controller`,
//! `strata model keygen|sign|verify` (`strata rollout` is in [`crate::rollout_client`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

use crate::config::{ControllerConfig, DriverConfig};
use crate::controller::Controller;
#[cfg(feature = "kubernetes")]
use crate::driver::kubernetes::KubernetesDriver;
use crate::driver::local::LocalDriver;
use crate::driver::{Driver, NoRegistrar, ReplicaRegistrar};
use crate::metrics::ControllerMetrics;
use crate::registry;
use crate::signals::MetricsScraper;

/// `strata controller`: run the lifecycle controller alone.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ControllerArgs {
    /// Path to controller.yaml (default: every setting at its default).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override `listen` (address of /metrics and /status).
    #[arg(long)]
    pub listen: Option<String>,
    /// Override `autoscale.minReplicas`.
    #[arg(long)]
    pub min_replicas: Option<u32>,
    /// Override `autoscale.maxReplicas`.
    #[arg(long)]
    pub max_replicas: Option<u32>,
    /// Override the local driver's `model`.
    #[arg(long)]
    pub model: Option<String>,
}

impl ControllerArgs {
    /// The configuration these arguments describe, validated.
    pub fn load(&self) -> anyhow::Result<ControllerConfig> {
        let mut cfg = match &self.config {
            Some(p) => ControllerConfig::load(p)?,
            None => ControllerConfig::default(),
        };
        if let Some(l) = &self.listen {
            cfg.listen = l.clone();
        }
        if let Some(n) = self.min_replicas {
            cfg.autoscale.min_replicas = n;
        }
        if let Some(n) = self.max_replicas {
            cfg.autoscale.max_replicas = n;
        }
        if let (Some(m), DriverConfig::Local(l)) = (&self.model, &mut cfg.driver) {
            l.model = m.clone();
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Runs the controller until Ctrl-C, then drains and stops its replicas.
pub async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    let cfg = args.load()?;
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            let _ = tx.send(true);
        }
    });
    // On its own (Kubernetes) the picker holds requests for a pool at zero; its count, when
    // configured, is what wakes the pool.
    let registrar: Arc<dyn ReplicaRegistrar> = match cfg.held_requests.clone() {
        Some(source) => crate::held::spawn(
            source,
            crate::tls_client::http_client(cfg.tls.ca_file.as_deref()).context("tls.caFile")?,
        ),
        None => Arc::new(NoRegistrar),
    };
    serve(cfg, registrar, rx).await
}

/// Runs the controller with `registrar` (the router, in `strata up`) until `shutdown`
/// turns true: the HTTP endpoint on `cfg.listen` and the control loop over the configured
/// driver (`driver.kind`: `local` or `kubernetes`).
pub async fn serve(
    cfg: ControllerConfig,
    registrar: Arc<dyn ReplicaRegistrar>,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    cfg.validate()?;
    match cfg.driver.clone() {
        DriverConfig::Local(local) => {
            let driver = LocalDriver::new(local, registrar.clone())?;
            serve_with(cfg, driver, registrar, shutdown).await
        }
        #[cfg(feature = "kubernetes")]
        DriverConfig::Kubernetes(k) => {
            let driver = KubernetesDriver::new(k, registrar.clone()).await?;
            let metrics = Arc::new(ControllerMetrics::new());
            let rollouts = kubernetes_rollout_routes(&cfg, &driver, metrics.clone())?;
            serve_routes(cfg, driver, registrar, metrics, rollouts, shutdown).await
        }
        #[cfg(not(feature = "kubernetes"))]
        DriverConfig::Kubernetes(_) => {
            anyhow::bail!("this build has no Kubernetes driver (cargo feature `kubernetes`)")
        }
    }
}

/// The rollout API on Kubernetes (`kubernetesRollout:`), over the driver's API client;
/// `None` when not configured.
#[cfg(feature = "kubernetes")]
fn kubernetes_rollout_routes(
    cfg: &ControllerConfig,
    driver: &KubernetesDriver,
    metrics: Arc<ControllerMetrics>,
) -> anyhow::Result<Option<axum::Router>> {
    let Some(k) = cfg.kubernetes_rollout.clone() else {
        return Ok(None);
    };
    let http = crate::tls_client::http_client(cfg.tls.ca_file.as_deref()).context("tls.caFile")?;
    let parts = crate::kubernetes_rollouts::RolloutParts {
        client: driver.client(),
        namespace: driver.config().namespace.clone(),
        cfg: k,
        rollout: cfg.rollout.clone(),
        port: driver.config().port,
        https: driver.config().https,
        http,
        interval: Duration::from_secs_f64(cfg.interval_secs),
        timeout: driver.config().request_timeout(),
        metrics,
    };
    tracing::info!("rollout API: /controller/rollout/ (HTTPRoute weights)");
    Ok(Some(axum::Router::new().nest(
        "/controller/rollout",
        crate::kubernetes_rollouts::routes(parts),
    )))
}

/// [`serve`] over a driver the caller built (any [`Driver`]; `cfg.driver` is not read).
pub async fn serve_with<D: Driver>(
    cfg: ControllerConfig,
    driver: D,
    registrar: Arc<dyn ReplicaRegistrar>,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let metrics = Arc::new(ControllerMetrics::new());
    serve_routes(cfg, driver, registrar, metrics, None, shutdown).await
}

/// The KEDA external scaler (gRPC) on `addr`, answering from the controller's status
/// until `shutdown` turns true.
#[cfg(feature = "kubernetes")]
async fn start_keda(
    addr: &str,
    cfg: &ControllerConfig,
    status: KedaStatus,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<KedaTask> {
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(listen = %addr, "KEDA external scaler (gRPC)");
    let scaler = crate::keda::KedaScaler::new(status, Duration::from_secs_f64(cfg.interval_secs));
    Ok(tokio::spawn(async move {
        crate::keda::serve(scaler, l, async move {
            while shutdown.changed().await.is_ok() {
                if *shutdown.borrow() {
                    break;
                }
            }
        })
        .await
        .context("KEDA scaler")
    }))
}

#[cfg(not(feature = "kubernetes"))]
async fn start_keda(
    _: &str,
    _: &ControllerConfig,
    _: KedaStatus,
    _: watch::Receiver<bool>,
) -> anyhow::Result<KedaTask> {
    anyhow::bail!("kedaListen needs a build with the KEDA scaler (cargo feature `kubernetes`)")
}

type KedaStatus = Arc<std::sync::Mutex<crate::controller::Status>>;
type KedaTask = tokio::task::JoinHandle<anyhow::Result<()>>;

/// [`serve_with`] recording into `metrics`, the endpoint also serving `extra` routes.
async fn serve_routes<D: Driver>(
    cfg: ControllerConfig,
    driver: D,
    registrar: Arc<dyn ReplicaRegistrar>,
    metrics: Arc<ControllerMetrics>,
    extra: Option<axum::Router>,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let client =
        crate::tls_client::http_client(cfg.tls.ca_file.as_deref()).context("tls.caFile")?;
    let source = MetricsScraper::with_client(
        cfg.engine_kind,
        Duration::from_secs_f64(cfg.scrape_timeout_secs),
        client,
    );
    let controller = Controller::new(
        cfg.autoscale.clone(),
        Duration::from_secs_f64(cfg.interval_secs),
        driver,
        source,
        registrar,
        metrics.clone(),
    );
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    tracing::info!(listen = %cfg.listen, "controller endpoint: /metrics /status /health");
    let mut app = crate::http::router(metrics, controller.status());
    if let Some(extra) = extra {
        app = extra.merge(app);
    }
    let keda = match &cfg.keda_listen {
        Some(addr) => Some(start_keda(addr, &cfg, controller.status(), shutdown.clone()).await?),
        None => None,
    };
    let mut http_shutdown = shutdown.clone();
    // The edge server's default bounds (connections, head and body timeouts): the
    // endpoint serves scrapers and `strata rollout`, never bulk uploads.
    let limits = strata_api::edge::EdgeLimits {
        tls: cfg.tls.server_files(),
        ..strata_api::edge::EdgeLimits::default()
    };
    let server = tokio::spawn(async move {
        strata_api::edge::serve(listener, app, limits, async move {
            while http_shutdown.changed().await.is_ok() {
                if *http_shutdown.borrow() {
                    break;
                }
            }
        })
        .await
    });
    controller.run(shutdown).await;
    if let Some(k) = keda {
        match k.await {
            Ok(r) => r?,
            Err(e) => anyhow::bail!("KEDA scaler task: {e}"),
        }
    }
    match server.await {
        Ok(r) => r.context("controller endpoint")?,
        Err(e) => anyhow::bail!("controller endpoint task: {e}"),
    }
    Ok(())
}

/// `strata model keygen --out FILE`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelKeygenArgs {
    /// Private key file to write; the public key goes to FILE.pub.
    #[arg(long)]
    pub out: PathBuf,
}

/// `strata model sign PATH --key FILE`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelSignArgs {
    /// The model: a file or a directory.
    pub path: PathBuf,
    /// The private key (from `strata model keygen`).
    #[arg(long)]
    pub key: PathBuf,
}

/// `strata model verify PATH --key FILE.pub`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelVerifyArgs {
    /// The model: a file or a directory.
    pub path: PathBuf,
    /// The public key.
    #[arg(long)]
    pub key: PathBuf,
}

/// Writes a key pair; prints where.
pub fn run_keygen(args: &ModelKeygenArgs) -> anyhow::Result<()> {
    let vk = registry::keygen(&args.out)?;
    println!(
        "wrote {} and {} (key id {})",
        args.out.display(),
        registry::public_key_path(&args.out).display(),
        registry::key_id(&vk)
    );
    Ok(())
}

/// Signs a model; prints its digest and the signature's path.
pub fn run_sign(args: &ModelSignArgs) -> anyhow::Result<()> {
    let key = registry::read_signing_key(&args.key)?;
    let (digest, sig) = registry::sign(&args.path, &key)?;
    println!("{digest}\nsigned: {}", sig.display());
    Ok(())
}

/// Verifies a model; an error (non-zero exit) says what differs.
pub fn run_verify(args: &ModelVerifyArgs) -> anyhow::Result<()> {
    let digest = registry::verify_model_with_key_file(&args.path, &args.key)
        .with_context(|| format!("{} does not verify", args.path.display()))?;
    println!("{digest}\nverified: {}", args.path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Top {
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(clap::Subcommand)]
    enum Cmd {
        Controller(ControllerArgs),
        Keygen(ModelKeygenArgs),
        Sign(ModelSignArgs),
        Verify(ModelVerifyArgs),
    }

    /// The binary's default build (no `kubernetes` feature) refuses a KEDA listener,
    /// naming the feature, before binding anything.
    #[cfg(not(feature = "kubernetes"))]
    #[tokio::test]
    async fn without_kubernetes_a_keda_listener_is_refused_saying_why() {
        let status = Arc::new(std::sync::Mutex::new(crate::controller::Status::default()));
        let (_tx, rx) = watch::channel(false);
        let err = start_keda("127.0.0.1:0", &ControllerConfig::default(), status, rx)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("kedaListen needs") && err.contains("cargo feature `kubernetes`"),
            "{err}"
        );
    }

    #[test]
    fn args_parse() {
        let t = Top::try_parse_from([
            "s",
            "controller",
            "--config",
            "c.yaml",
            "--max-replicas",
            "4",
        ])
        .unwrap();
        let Cmd::Controller(a) = t.cmd else { panic!() };
        assert_eq!(a.config, Some(PathBuf::from("c.yaml")));
        assert_eq!(a.max_replicas, Some(4));
        assert!(Top::try_parse_from(["s", "sign", "m.gguf", "--key", "k"]).is_ok());
    }

    #[test]
    fn overrides_apply_and_are_validated() {
        let a = ControllerArgs {
            min_replicas: Some(2),
            max_replicas: Some(5),
            model: Some("m.gguf".into()),
            ..ControllerArgs::default()
        };
        let c = a.load().unwrap();
        assert_eq!((c.autoscale.min_replicas, c.autoscale.max_replicas), (2, 5));
        let DriverConfig::Local(l) = &c.driver else {
            panic!()
        };
        assert_eq!(l.model, "m.gguf");
        let bad = ControllerArgs {
            min_replicas: Some(9),
            ..ControllerArgs::default()
        };
        assert!(bad.load().unwrap_err().to_string().contains("minReplicas"));
        let missing = ControllerArgs {
            config: Some("/nonexistent/controller.yaml".into()),
            ..ControllerArgs::default()
        };
        assert!(missing
            .load()
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/controller.yaml"));
    }

    #[test]
    fn keygen_sign_verify_commands() {
        let d = tempfile::tempdir().unwrap();
        let key = d.path().join("k");
        run_keygen(&ModelKeygenArgs { out: key.clone() }).unwrap();
        let model = d.path().join("m.gguf");
        std::fs::write(&model, b"GGUF....").unwrap();
        run_sign(&ModelSignArgs {
            path: model.clone(),
            key: key.clone(),
        })
        .unwrap();
        let verify = ModelVerifyArgs {
            path: model.clone(),
            key: registry::public_key_path(&key),
        };
        run_verify(&verify).unwrap();
        std::fs::write(&model, b"GGUF...!").unwrap();
        let e = format!("{:#}", run_verify(&verify).unwrap_err());
        assert!(e.contains("m.gguf: changed"), "{e}");
    }
}
