//! Serving a built stack: starting its pieces, announcing it once every pool is ready,
//! and shutting it down once.
//!
//! Shutting down goes from the outside in: the gateway finishes its requests, then the
//! front finishes its own (both within one grace period, [`Shutdown`]), then the control
//! loops stop the replicas, and the KV tier goes last.

use std::future::Future;
use std::time::Duration;

use strata_gateway::RunningGateway;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::banner::Banner;
use super::build::Stack;
use super::control::ControlLoops;
use super::kv_tier::KvTier;
use super::shutdown::Shutdown;
use super::tls::StackTls;

/// The dashboard reads every replica once a second.
const COLLECT_INTERVAL: Duration = Duration::from_secs(1);

/// A stack that is serving.
pub(super) struct Running {
    shutdown: Shutdown,
    control: ControlLoops,
    banner: Banner,
    tier: Option<KvTier>,
    tls: Option<StackTls>,
}

impl Running {
    /// Starts a built stack: the gateway listens (the one step that can still fail, so it
    /// goes before any replica), the front serves, the dashboard collects, and the control
    /// loops start the replicas.
    pub async fn start(stack: Stack) -> anyhow::Result<Running> {
        let Stack {
            tier,
            tls,
            controllers,
            listener,
            front_tls,
            app,
            dashboard,
            gateway,
            banner,
            grace,
        } = stack;
        let (gateway, banner) = match gateway {
            Some(g) => {
                let key = g.key.clone();
                let running = g.spawn().await?;
                let scheme = if tls.is_some() { "https" } else { "http" };
                let url = format!("{scheme}://{}", running.addr);
                let banner = banner.with_gateway(url, key);
                (Some(running), banner)
            }
            None => (None, banner),
        };
        let shutdown = Shutdown::new(grace);
        shutdown.spawn(|token| serve_front(listener, app, front_tls, gateway, token));
        shutdown.spawn_until_cancelled(dashboard.collect(COLLECT_INTERVAL));
        let control = ControlLoops::start(controllers);
        Ok(Running {
            shutdown,
            control,
            banner,
            tier,
            tls,
        })
    }

    /// Serves until `signal` (Ctrl-C or SIGTERM), printing the banner once every pool has
    /// its minimum ready.
    pub async fn serve_until(&self, signal: impl Future<Output = ()>) {
        tokio::pin!(signal);
        tokio::select! {
            _ = self.banner.print_when_ready() => {}
            _ = signal.as_mut() => return,
        }
        signal.await;
    }

    /// Drains the requests in flight (at most the grace period), then stops the replicas.
    pub async fn shut_down(self) {
        let Running {
            shutdown,
            control,
            tier,
            tls,
            ..
        } = self;
        eprintln!("strata up: draining in-flight requests ...");
        if !shutdown.drain().await {
            tracing::warn!("grace period over; closing remaining connections");
        }
        eprintln!("strata up: stopping replicas ...");
        control.stop().await;
        // Last: the engines it served have stopped.
        drop(tier);
        drop(tls);
        eprintln!("strata up: stopped");
    }
}

/// The front port until `token` is cancelled; then the gateway in front of it finishes
/// its requests (which still need the front), and only then does the front stop
/// accepting and finish its own.
async fn serve_front(
    listener: TcpListener,
    app: axum::Router,
    tls: Option<strata_api::tls::TlsFiles>,
    gateway: Option<RunningGateway>,
    token: CancellationToken,
) {
    let gateway_drained = async move {
        token.cancelled().await;
        if let Some(g) = gateway {
            g.shutdown().await;
        }
    };
    let limits = strata_api::edge::EdgeLimits {
        tls,
        ..strata_api::edge::EdgeLimits::default()
    };
    if let Err(e) = strata_api::edge::serve(listener, app, limits, gateway_drained).await {
        tracing::warn!(error = %e, "front server");
    }
}
