//! Running an HTTP front until shutdown, as both fronts do (the generation
//! [`server`](crate::server) and the encoder's [`embed::server`](crate::embed::server)):
//! the errors that stop one, and the graceful drain that ends one.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use strata_api::edge::EdgeLimits;
use strata_api::http::shutdown_signal;

use crate::embed::EmbedError;
use crate::gguf::ModelError;

/// Errors that stop the server from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Encoder(#[from] EmbedError),
    #[error("invalid engine option: {0}")]
    Option(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("server error: {0}")]
    Serve(std::io::Error),
}

/// How long connections may stay open once the drain is over (answers being written).
const SHUTDOWN_LINGER: Duration = Duration::from_millis(500);

/// Serves `app` on the edge server (within `limits`) until Ctrl-C or SIGTERM, then drains: `start_draining`, a wait of up to
/// `grace` while `in_flight()` is above zero, then at most [`SHUTDOWN_LINGER`] for open
/// connections to close. One whose stream is still running (past the grace) or whose client
/// stopped reading must not hold the process: what is left is aborted by dropping the
/// server, which drops every handler and so closes each sequence's channel; the engine
/// thread frees their blocks at its next step.
pub(crate) async fn serve_with_drain(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: EdgeLimits,
    grace: Duration,
    start_draining: impl FnOnce() + Send + 'static,
    in_flight: impl Fn() -> usize + Send + 'static,
) -> Result<(), ServerError> {
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown_signal().await;
        tracing::info!(
            grace_secs = grace.as_secs_f64(),
            "shutting down: draining in-flight requests"
        );
        start_draining();
        let deadline = Instant::now() + grace;
        while in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if in_flight() > 0 {
            tracing::warn!(left = in_flight(), "grace period over; aborting the rest");
        }
        let _ = drained_tx.send(());
    };
    let mut server = std::pin::pin!(strata_api::edge::serve(listener, app, limits, shutdown));
    tokio::select! {
        r = &mut server => r.map_err(ServerError::Serve)?,
        _ = drained_rx => {
            match tokio::time::timeout(SHUTDOWN_LINGER, &mut server).await {
                Ok(r) => r.map_err(ServerError::Serve)?,
                Err(_) => tracing::warn!("connections still open after the grace period; closing them"),
            }
        }
    }
    Ok(())
}
