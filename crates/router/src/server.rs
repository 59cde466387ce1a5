//! `strata router`: flags, the endpoints-file watcher, and serving with a graceful drain.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;

use crate::config::RouterConfig;
use crate::endpoint::{parse_endpoint_list, parse_endpoints_file, EndpointSpec, EngineKind};
use crate::router::Router;

/// Flags of `strata router`.
#[derive(Debug, Clone, clap::Args)]
pub struct RouterArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "STRATA_ROUTER_HOST")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8080, env = "STRATA_ROUTER_PORT")]
    pub port: u16,
    /// Replicas: comma-separated `[kind=]URL`, e.g.
    /// `http://127.0.0.1:8001,sglang=http://127.0.0.1:8002`.
    #[arg(long, value_name = "URL[,URL...]")]
    pub endpoints: Option<String>,
    /// A file of replicas (YAML `endpoints:` list, or one `[kind=]URL` per line). Watched:
    /// edits add and remove endpoints without dropping in-flight streams.
    #[arg(long, value_name = "FILE")]
    pub endpoints_file: Option<PathBuf>,
    /// Router configuration (YAML; see docs/ROUTER.md).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Engine kind of endpoints listed without one: strata, vllm, sglang, trtllm, llamacpp.
    #[arg(long, value_name = "KIND")]
    pub engine_kind: Option<String>,
    /// Prefill/decode disaggregation (PROTOCOLS §11): schedule with llm-d's profile pair
    /// (a `decode` profile over endpoints of role `decode`, `both` or none; a `prefill`
    /// profile over role `prefill`) and split a request when the decode pick's uncached
    /// prompt tokens reach N (`nonCachedTokens`; 0 splits every request). Replaces the
    /// config file's `scheduling`. Endpoints get their role from the `role` key of an
    /// endpoints file.
    #[arg(long, value_name = "N", num_args = 0..=1,
          default_missing_value = "256")]
    pub pd_threshold: Option<u32>,
    /// How often each endpoint's /metrics is read (overrides the config file).
    #[arg(long, value_name = "MS")]
    pub scrape_interval_ms: Option<u64>,
    /// How long in-flight requests may take to finish after Ctrl-C.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub shutdown_grace_s: u64,
    /// The HTTP front's bounds (connections, head timeout and size, body rate) and TLS
    /// (`--tls-cert`, `--tls-key`, `--tls-client-ca`; the picker's ext_proc port uses the
    /// same certificate).
    #[command(flatten)]
    pub http: strata_api::edge::EdgeArgs,
    /// Key callers must send as `Authorization: Bearer <key>`; every route but /health
    /// and /metrics answers 401 without it (overrides the config file's `api_key`).
    #[arg(
        long,
        value_name = "KEY",
        env = "STRATA_ROUTER_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Key sent to engines as `Authorization: Bearer <key>` in place of the caller's
    /// header (`strata engine --api-key`; overrides `engine_api_key`).
    #[arg(
        long,
        value_name = "KEY",
        env = "STRATA_ENGINE_API_KEY",
        hide_env_values = true
    )]
    pub engine_api_key: Option<String>,
    /// CA certificates (PEM) trusted for `https://` endpoints besides the system's roots.
    #[arg(long, value_name = "FILE")]
    pub upstream_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) the router presents to engines that require one (mutual
    /// TLS); with `--upstream-tls-key`.
    #[arg(long, value_name = "FILE", requires = "upstream_tls_key")]
    pub upstream_tls_cert: Option<PathBuf>,
    /// Private key of `--upstream-tls-cert` (PEM).
    #[arg(long, value_name = "FILE", requires = "upstream_tls_cert")]
    pub upstream_tls_key: Option<PathBuf>,
    /// Port of the OpenAI-compatible HTTP front (overrides `--port`); 0 turns it off, for
    /// a picker that only serves ext_proc.
    #[arg(long, value_name = "PORT", env = "STRATA_ROUTER_HTTP_PORT")]
    pub http_port: Option<u16>,
    /// Serve the Gateway API Inference Extension endpoint picker (Envoy ext_proc gRPC,
    /// conventionally 9002) on this port; see docs/KUBERNETES.md.
    #[arg(long, value_name = "PORT", env = "STRATA_EXT_PROC_PORT")]
    pub ext_proc_port: Option<u16>,
    /// gRPC health port of the picker (`grpc.health.v1`: liveness, readiness, the ext_proc
    /// service); 0 turns it off. Only with `--ext-proc-port`.
    #[arg(long, default_value_t = 9003, value_name = "PORT")]
    pub health_port: u16,
    /// Prometheus `/metrics` port of the picker; 0 turns it off. Only with
    /// `--ext-proc-port` (the HTTP front serves `/metrics` itself).
    #[arg(long, default_value_t = 9090, value_name = "PORT")]
    pub metrics_port: u16,
    /// Fallback endpoints the picker names after each pick, in rank order, in both the
    /// `x-gateway-destination-endpoint` header and the `envoy.lb` metadata (`ip:port,...`).
    /// Keep 0 for Envoy's `ORIGINAL_DST` cluster, which reads one address; a data plane
    /// that walks the list on retries (the `override_host` load-balancing policy) can take
    /// up to 7.
    #[arg(long, default_value_t = 0, value_name = "N",
          value_parser = clap::value_parser!(u8).range(0..=7))]
    pub ext_proc_fallbacks: u8,
    /// Discover endpoints from this InferencePool's Ready pods (Kubernetes API, in-cluster
    /// service account or kubeconfig).
    #[arg(long, value_name = "NAME", env = "STRATA_POOL_NAME")]
    pub pool_name: Option<String>,
    /// The pods of `--pool-name` serve `https://` (verified against the system roots and
    /// `--upstream-tls-ca`; their certificates must name the pod IP).
    #[arg(long)]
    pub pool_https: bool,
    /// Namespace of `--pool-name`.
    #[arg(
        long,
        value_name = "NS",
        default_value = "default",
        env = "STRATA_POOL_NAMESPACE"
    )]
    pub pool_namespace: String,
}

/// Builds the configuration from flags and files.
pub fn load_config(args: &RouterArgs) -> anyhow::Result<RouterConfig> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            RouterConfig::from_yaml(&text).with_context(|| format!("in {}", path.display()))?
        }
        None => RouterConfig::default(),
    };
    if let Some(kind) = &args.engine_kind {
        config.default_kind = kind.parse::<EngineKind>()?;
    }
    if let Some(ms) = args.scrape_interval_ms {
        config.scrape_interval_ms = ms;
    }
    if let Some(n) = args.pd_threshold {
        config.scheduling = Some(crate::scheduling::EndpointPickerConfig::pd(n));
    }
    if let Some(list) = &args.endpoints {
        let extra = parse_endpoint_list(list, config.default_kind)?;
        config.endpoints.extend(extra);
    }
    if let Some(path) = &args.endpoints_file {
        config
            .endpoints
            .extend(read_endpoints_file(path, config.default_kind)?);
    }
    // A picker's held requests are reported under its InferencePool's name (what the
    // controller's `heldRequests.pool` names), unless router.yaml names the pool itself.
    if let Some(pool) = &args.pool_name {
        if config.flow_control.pool == crate::config::DEFAULT_FLOW_POOL {
            config.flow_control.pool = pool.clone();
        }
    }
    apply_security_flags(args, &mut config);
    config.validate()?;
    Ok(config)
}

/// Keys and upstream TLS from flags, over the config file's.
fn apply_security_flags(args: &RouterArgs, config: &mut RouterConfig) {
    if let Some(key) = &args.api_key {
        config.api_key = Some(key.clone());
    }
    if let Some(key) = &args.engine_api_key {
        config.engine_api_key = Some(key.clone());
    }
    if let Some(ca) = &args.upstream_tls_ca {
        config.upstream_tls.ca = Some(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&args.upstream_tls_cert, &args.upstream_tls_key) {
        config.upstream_tls.cert = Some(cert.clone());
        config.upstream_tls.key = Some(key.clone());
    }
}

fn read_endpoints_file(path: &Path, kind: EngineKind) -> anyhow::Result<Vec<EndpointSpec>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_endpoints_file(&text, kind).with_context(|| format!("in {}", path.display()))
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Polls `path`'s modification time and applies the file's endpoint set when it changes
/// (the endpoints from flags and the config file stay). A file that fails to parse is
/// logged and ignored until it is fixed.
pub async fn watch_endpoints_file(
    router: Router,
    path: PathBuf,
    fixed: Vec<EndpointSpec>,
    every: Duration,
) {
    let kind = router.config().default_kind;
    let mut seen = mtime(&path);
    loop {
        tokio::time::sleep(every).await;
        let now = mtime(&path);
        if now == seen {
            continue;
        }
        seen = now;
        match read_endpoints_file(&path, kind) {
            Ok(specs) => {
                let mut all = fixed.clone();
                all.extend(
                    specs
                        .into_iter()
                        .filter(|s| !fixed.iter().any(|f| f.url == s.url)),
                );
                tracing::info!(file = %path.display(), endpoints = all.len(), "endpoints file changed");
                router.sync_endpoints(&all);
            }
            Err(e) => tracing::warn!(file = %path.display(), error = %e, "endpoints file ignored"),
        }
    }
}

/// Endpoints from an `InferencePool` and its pods, and the pool's objectives, watched
/// through the Kubernetes API.
#[cfg(feature = "kubernetes")]
async fn watch_pool(args: &RouterArgs, pool: &str, router: &Router) -> anyhow::Result<()> {
    /// How often a picker re-reads its pool's `InferenceObjective`s.
    const OBJECTIVES_INTERVAL: Duration = Duration::from_secs(10);
    let client = crate::k8s::Discovery::infer_client().await?;
    let mut cfg = crate::k8s::DiscoveryConfig::new(pool.to_string(), args.pool_namespace.clone());
    cfg.default_kind = router.config().default_kind;
    cfg.https = args.pool_https;
    let fixed = router.config().endpoints.clone();
    crate::k8s::spawn(crate::k8s::Discovery::new(
        cfg,
        client.clone(),
        router.clone(),
        fixed,
    ));
    crate::k8s::objectives::spawn(
        client,
        &args.pool_namespace,
        pool.to_string(),
        router.clone(),
        OBJECTIVES_INTERVAL,
    );
    tracing::info!(pool = %pool, namespace = %args.pool_namespace, "watching InferencePool");
    Ok(())
}

#[cfg(not(feature = "kubernetes"))]
async fn watch_pool(_: &RouterArgs, _: &str, _: &Router) -> anyhow::Result<()> {
    anyhow::bail!("--pool-name needs a build with Kubernetes support (cargo feature `kubernetes`)")
}

/// The Gateway API Inference Extension endpoint picker on Envoy's ext_proc, until `stop`.
#[cfg(feature = "ext-proc")]
async fn start_ext_proc(
    args: &RouterArgs,
    port: u16,
    router: &Router,
    mut stop_rx: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let on = |p: u16| (p != 0).then_some(p);
    let listeners = crate::extproc::serve::Listeners::bind(
        &args.host,
        port,
        on(args.health_port),
        on(args.metrics_port),
    )
    .await
    .context("binding the endpoint picker's ports")?;
    let bound = listeners.addrs()?;
    tracing::info!(ext_proc = %bound.ext_proc, health = ?bound.health, metrics = ?bound.metrics, "endpoint picker serving");
    let ext = crate::extproc::ExtProc::new(router.clone())
        .with_fallbacks(usize::from(args.ext_proc_fallbacks));
    let stop = async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    };
    let tls = args.http.tls_files();
    Ok(tokio::spawn(async move {
        crate::extproc::serve::serve_tls(ext, listeners, tls, stop)
            .await
            .map_err(anyhow::Error::from)
    }))
}

#[cfg(not(feature = "ext-proc"))]
async fn start_ext_proc(
    _: &RouterArgs,
    _: u16,
    _: &Router,
    _: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>> {
    anyhow::bail!(
        "--ext-proc-port needs a build with the Envoy endpoint picker (cargo feature `kubernetes` of `strata`, `ext-proc` of the router)"
    )
}

/// Serves until Ctrl-C or SIGTERM, then stops accepting and lets in-flight requests
/// finish (bounded by `--shutdown-grace-s`).
pub async fn run(args: RouterArgs) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    let http_port = args.http_port.unwrap_or(args.port);
    if http_port == 0 && args.ext_proc_port.is_none() {
        anyhow::bail!(
            "--http-port 0 turns the HTTP front off; give --ext-proc-port to serve anything"
        );
    }
    let addr: SocketAddr = format!("{}:{}", args.host, http_port)
        .parse()
        .with_context(|| format!("bad listen address {}:{}", args.host, http_port))?;
    let fixed: Vec<EndpointSpec> = {
        let mut c = config.clone();
        if let Some(path) = &args.endpoints_file {
            let from_file = read_endpoints_file(path, c.default_kind)?;
            c.endpoints
                .retain(|s| !from_file.iter().any(|f| f.url == s.url));
        }
        c.endpoints
    };
    let router = Router::new(config)?;
    if let Some(path) = args.endpoints_file.clone() {
        tokio::spawn(watch_endpoints_file(
            router.clone(),
            path,
            fixed,
            Duration::from_millis(500),
        ));
    }
    if let Some(pool) = &args.pool_name {
        watch_pool(&args, pool, &router).await?;
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let ext_proc = match args.ext_proc_port {
        Some(port) => Some(start_ext_proc(&args, port, &router, stop_rx.clone()).await?),
        None => None,
    };
    if http_port == 0 {
        // ext_proc only.
        let mut ext_proc = ext_proc.context("no transport to serve")?;
        tokio::select! {
            _ = shutdown_signal() => {
                tracing::info!("shutting down");
                let _ = stop_tx.send(true);
            }
            ended = &mut ext_proc => {
                ended??;
                return Ok(());
            }
        }
        let grace = Duration::from_secs(args.shutdown_grace_s);
        match tokio::time::timeout(grace, ext_proc).await {
            Ok(joined) => joined??,
            Err(_) => tracing::warn!("grace period over; closing remaining streams"),
        }
        tracing::info!("stopped");
        return Ok(());
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(
        addr = %listener.local_addr()?,
        endpoints = router.endpoints().len(),
        tls = args.http.tls_cert.is_some(),
        api_key = router.config().api_key.is_some(),
        "router serving"
    );
    let grace = Duration::from_secs(args.shutdown_grace_s);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = crate::proxy::app(router.clone());
    let server = strata_api::edge::serve(listener, app, args.http.limits(), async move {
        shutdown_signal().await;
        tracing::info!("shutting down: draining in-flight requests");
        let _ = tx.send(());
    });
    let server = tokio::spawn(server);
    // After the signal, give in-flight requests `grace` to finish, then stop regardless.
    let _ = rx.await;
    let _ = stop_tx.send(true);
    match tokio::time::timeout(grace, server).await {
        Ok(joined) => joined??,
        Err(_) => tracing::warn!("grace period over; closing remaining connections"),
    }
    if let Some(ext_proc) = ext_proc {
        if let Ok(joined) = tokio::time::timeout(grace, ext_proc).await {
            joined??;
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM (the one definition, in `strata-api`).
pub use strata_api::http::shutdown_signal;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: RouterArgs,
    }

    fn load(argv: &[&str]) -> RouterConfig {
        load_config(&args(argv)).unwrap()
    }

    fn args(argv: &[&str]) -> RouterArgs {
        Cli::try_parse_from(std::iter::once("router").chain(argv.iter().copied()))
            .unwrap()
            .args
    }

    /// The binary's default build (no `kubernetes` feature) refuses `--pool-name`, naming
    /// the feature, instead of serving without the pool's endpoints.
    #[cfg(not(feature = "kubernetes"))]
    #[tokio::test]
    async fn without_kubernetes_a_pool_name_is_refused_saying_why() {
        let a = args(&["--pool-name", "p", "--endpoints", "http://127.0.0.1:9"]);
        let err = run(a).await.unwrap_err().to_string();
        assert!(
            err.starts_with("--pool-name needs") && err.contains("cargo feature `kubernetes`"),
            "{err}"
        );
    }

    /// Without `ext-proc`, `--ext-proc-port` is refused, naming the feature, before any
    /// port is bound.
    #[cfg(not(feature = "ext-proc"))]
    #[tokio::test]
    async fn without_ext_proc_the_picker_port_is_refused_saying_why() {
        let a = args(&[
            "--http-port",
            "0",
            "--ext-proc-port",
            "0",
            "--endpoints",
            "http://127.0.0.1:9",
        ]);
        let err = run(a).await.unwrap_err().to_string();
        assert!(
            err.starts_with("--ext-proc-port needs") && err.contains("cargo feature `kubernetes`"),
            "{err}"
        );
    }

    #[test]
    fn pd_threshold_flag_runs_the_profile_pair() {
        let pair = |c: &RouterConfig| {
            c.picker_config()
                .build()
                .unwrap()
                .pd()
                .map(|p| p.decider.non_cached_tokens)
        };
        assert_eq!(pair(&load(&[])), None);
        assert_eq!(pair(&load(&["--pd-threshold", "0"])), Some(0));
        assert_eq!(pair(&load(&["--pd-threshold", "1000"])), Some(1000));
        assert_eq!(
            pair(&load(&["--pd-threshold"])),
            Some(crate::scheduling::pd::SUGGESTED_NON_CACHED_TOKENS)
        );
        assert!(Cli::try_parse_from(["router", "--pd-threshold", "-1"]).is_err());
    }

    #[test]
    fn a_pickers_held_requests_are_reported_under_its_pool_name() {
        assert_eq!(
            load(&[]).flow_control.pool,
            crate::config::DEFAULT_FLOW_POOL
        );
        let c = load(&["--pool-name", "chat-pool", "--ext-proc-port", "9002"]);
        assert_eq!(c.flow_control.pool, "chat-pool");
    }

    #[test]
    fn key_and_upstream_tls_flags_override_the_file() {
        let c = load(&[
            "--api-key",
            "sk-r",
            "--engine-api-key",
            "sk-e",
            "--upstream-tls-ca",
            "ca.pem",
            "--upstream-tls-cert",
            "r.pem",
            "--upstream-tls-key",
            "r.key",
            "--endpoints",
            "https://127.0.0.1:8443",
        ]);
        assert_eq!(c.api_key.as_deref(), Some("sk-r"));
        assert_eq!(c.engine_api_key.as_deref(), Some("sk-e"));
        assert_eq!(c.upstream_tls.ca, Some(PathBuf::from("ca.pem")));
        assert_eq!(c.upstream_tls.key, Some(PathBuf::from("r.key")));
        assert_eq!(c.endpoints[0].url, "https://127.0.0.1:8443");
        assert!(Cli::try_parse_from(["router", "--upstream-tls-cert", "r.pem"]).is_err());
        let cli = Cli::try_parse_from(["router", "--api-key", ""]).unwrap();
        assert!(load_config(&cli.args).is_err(), "an empty key is refused");
    }
}
