//! Serving the picker: the ext_proc gRPC port, gRPC health on its own port (also on the
//! ext_proc port, so a gateway can health-check the connection it uses), and Prometheus
//! metrics over HTTP.
//!
//! Health services (`grpc.health.v1`): `liveness` is SERVING while the process runs;
//! `readiness`, `inference-extension`, the ext_proc service name and the empty name are
//! SERVING while at least one endpoint is ready, re-checked every 250 ms, so a gateway or
//! a kubelet can hold traffic back from a picker with nothing to pick.
//!
//! TLS ([`serve_tls`], the router's `--tls-cert`/`--tls-key`/`--tls-client-ca`): the
//! ext_proc port, and the health services on it, speak gRPC over TLS (ALPN `h2`), the
//! certificate reloaded when its file changes; with a client CA, Envoy must present a
//! certificate it signed. The separate health port stays plain (a kubelet's gRPC probe
//! speaks no TLS) and so does the metrics port (it serves only counters).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::response::IntoResponse;
use strata_api::tls::{ServerTls, TlsError, TlsFiles};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use super::{ExtProc, SERVICE_NAME};

/// Why serving stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// Health service names that follow readiness.
pub const READY_SERVICES: [&str; 4] = ["", "readiness", "inference-extension", SERVICE_NAME];

/// Bound listeners for the picker's ports; `health` and `metrics` are optional.
pub struct Listeners {
    pub ext_proc: TcpListener,
    pub health: Option<TcpListener>,
    pub metrics: Option<TcpListener>,
}

/// The addresses the listeners are bound to.
#[derive(Debug, Clone, Copy)]
pub struct BoundAddrs {
    pub ext_proc: SocketAddr,
    pub health: Option<SocketAddr>,
    pub metrics: Option<SocketAddr>,
}

impl Listeners {
    /// Binds `host` at each given port (0: any free port).
    pub async fn bind(
        host: &str,
        ext_proc: u16,
        health: Option<u16>,
        metrics: Option<u16>,
    ) -> std::io::Result<Listeners> {
        let bind = |p: u16| TcpListener::bind((host.to_string(), p));
        Ok(Listeners {
            ext_proc: bind(ext_proc).await?,
            health: match health {
                Some(p) => Some(bind(p).await?),
                None => None,
            },
            metrics: match metrics {
                Some(p) => Some(bind(p).await?),
                None => None,
            },
        })
    }

    pub fn addrs(&self) -> std::io::Result<BoundAddrs> {
        Ok(BoundAddrs {
            ext_proc: self.ext_proc.local_addr()?,
            health: self.health.as_ref().map(|l| l.local_addr()).transpose()?,
            metrics: self.metrics.as_ref().map(|l| l.local_addr()).transpose()?,
        })
    }
}

async fn set_ready(reporter: &HealthReporter, ready: bool) {
    let status = if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for s in READY_SERVICES {
        reporter.set_service_status(s, status).await;
    }
}

/// Serves until `shutdown` resolves. gRPC streams in flight are cut at shutdown: each is
/// one request, and Envoy's `failure_mode_allow` decides what its client sees.
pub async fn serve(
    ext: ExtProc,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_tls(ext, listeners, None, shutdown).await
}

/// [`serve`], with the ext_proc port over TLS when `tls` names certificate files (files
/// that do not load are an error before anything is served).
pub async fn serve_tls(
    ext: ExtProc,
    listeners: Listeners,
    tls: Option<TlsFiles>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let tls = match tls {
        Some(files) => Some(Arc::new(ServerTls::load(files, &[b"h2"])?)),
        None => None,
    };
    let (reporter, watcher) = report_health(&ext).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    spawn_ext_proc(
        &mut tasks,
        &ext,
        &reporter,
        listeners.ext_proc,
        tls,
        &stop_rx,
    );
    if let Some(l) = listeners.health {
        spawn_health(&mut tasks, &reporter, l, &stop_rx);
    }
    if let Some(l) = listeners.metrics {
        spawn_metrics(&mut tasks, &ext, l, &stop_rx);
    }
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let result = first_to_stop(tasks).await;
    watcher.abort();
    result
}

/// The servers, each returning why it stopped.
type Servers = tokio::task::JoinSet<Result<(), ServeError>>;

/// Resolves once `stop` says to stop: a server's graceful shutdown.
async fn stopped(mut stop: tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The health services: `liveness` SERVING from now on, the readiness names as the pool
/// is, then re-checked every 250 ms by the returned task.
async fn report_health(ext: &ExtProc) -> (HealthReporter, tokio::task::JoinHandle<()>) {
    let reporter = HealthReporter::new();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let router = ext.router().clone();
    set_ready(&reporter, router.any_ready()).await;
    let watcher = {
        let reporter = reporter.clone();
        tokio::spawn(async move {
            let mut last = router.any_ready();
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let now = router.any_ready();
                if now != last {
                    set_ready(&reporter, now).await;
                    last = now;
                }
            }
        })
    };
    (reporter, watcher)
}

fn health_service(reporter: &HealthReporter) -> HealthServer<HealthService> {
    HealthServer::new(HealthService::from_health_reporter(reporter.clone()))
}

/// The ext_proc port: the picker and the health services, over TLS when `tls` is set.
fn spawn_ext_proc(
    tasks: &mut Servers,
    ext: &ExtProc,
    reporter: &HealthReporter,
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    stop: &tokio::sync::watch::Receiver<bool>,
) {
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(ext.clone().into_service())
        .add_service(health_service(reporter));
    let stop = stopped(stop.clone());
    match tls {
        None => {
            let incoming = TcpListenerStream::new(listener);
            tasks.spawn(async move {
                router
                    .serve_with_incoming_shutdown(incoming, stop)
                    .await
                    .map_err(ServeError::from)
            });
        }
        Some(tls) => {
            let incoming = super::tls::incoming(listener, tls);
            tasks.spawn(async move {
                router
                    .serve_with_incoming_shutdown(incoming, stop)
                    .await
                    .map_err(ServeError::from)
            });
        }
    }
}

/// The separate health port, plain gRPC (a kubelet's probe speaks no TLS).
fn spawn_health(
    tasks: &mut Servers,
    reporter: &HealthReporter,
    listener: TcpListener,
    stop: &tokio::sync::watch::Receiver<bool>,
) {
    let health = health_service(reporter);
    let incoming = TcpListenerStream::new(listener);
    let stop = stopped(stop.clone());
    tasks.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming_shutdown(incoming, stop)
            .await
            .map_err(ServeError::from)
    });
}

/// The metrics port: `/metrics` and flow control's `/debug/flows`, over plain HTTP.
fn spawn_metrics(
    tasks: &mut Servers,
    ext: &ExtProc,
    listener: TcpListener,
    stop: &tokio::sync::watch::Receiver<bool>,
) {
    let ext = ext.clone();
    let flows = ext.router().clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let ext = ext.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        ext.encode_metrics(),
                    )
                        .into_response()
                }
            }),
        )
        // Flow control's queues, as the HTTP front serves them.
        .route(
            "/debug/flows",
            axum::routing::get(move || {
                let flows = flows.clone();
                async move { axum::Json(flows.flows_json()).into_response() }
            }),
        );
    let stop = stopped(stop.clone());
    tasks.spawn(async move {
        strata_api::edge::serve(listener, app, strata_api::edge::EdgeLimits::default(), stop)
            .await
            .map_err(ServeError::from)
    });
}

/// Waits for the servers: the first to stop (shutdown, or an error) stops the others.
/// The first error is the result.
async fn first_to_stop(mut tasks: Servers) -> Result<(), ServeError> {
    let mut result = Ok(());
    while let Some(joined) = tasks.join_next().await {
        if let Ok(Err(e)) = joined {
            if result.is_ok() {
                result = Err(e);
            }
        }
        tasks.abort_all();
    }
    result
}
