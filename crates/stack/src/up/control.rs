//! The pools' control loops, one per pool, each scaling its own replicas. They start
//! together and stop together, last: a stopping loop drains and stops its replicas, so
//! it is told to only once the front has drained ([`super::shutdown`]).
//!
//! Stopping is bounded by the local driver: each replica gets the drain timeout, then
//! SIGTERM, then SIGKILL after the stop grace, all replicas at once.

use tokio::sync::watch;
use tokio::task::JoinSet;

use super::pool::PoolController;

/// The running control loops.
pub(super) struct ControlLoops {
    stop: watch::Sender<bool>,
    loops: JoinSet<()>,
}

impl ControlLoops {
    /// Starts one loop per pool: from here on, replicas start.
    pub fn start(controllers: Vec<PoolController>) -> ControlLoops {
        let (stop, stopped) = watch::channel(false);
        let mut loops = JoinSet::new();
        for controller in controllers {
            let stopped = stopped.clone();
            loops.spawn(async move {
                controller.run(stopped).await;
            });
        }
        ControlLoops { stop, loops }
    }

    /// Tells every loop to stop and waits until each has stopped its replicas.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        while let Some(r) = self.loops.join_next().await {
            if let Err(e) = r {
                tracing::warn!(error = %e, "a pool's control loop failed");
            }
        }
    }
}
