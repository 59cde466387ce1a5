//! Shutdown, done once. Every task that serves requests (the front with the gateway in
//! front of it, the dashboard's collector) is spawned here, on one [`TaskTracker`], and
//! watches one [`CancellationToken`]. Ctrl-C cancels the token; each task finishes what it
//! accepted and returns; [`Shutdown::drain`] waits for all of them, at most the grace
//! period. The replicas stop after that (their control loops, [`super::control`]), so
//! every request still in flight keeps its engine until it is answered or the grace is
//! over.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The serving tasks, the token they watch and the bound on waiting for them.
pub(super) struct Shutdown {
    token: CancellationToken,
    tasks: TaskTracker,
    grace: Duration,
}

impl Shutdown {
    /// Waits at most `grace` for the serving tasks once the token is cancelled.
    pub fn new(grace: Duration) -> Shutdown {
        Shutdown {
            token: CancellationToken::new(),
            tasks: TaskTracker::new(),
            grace,
        }
    }

    /// Spawns a task that watches `token` and returns once it has finished its work
    /// after the cancellation (a server draining its connections).
    pub fn spawn<F, Fut>(&self, task: F)
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.tasks.spawn(task(self.token.clone()));
    }

    /// Spawns a task with nothing to finish: it is dropped when the token is cancelled.
    pub fn spawn_until_cancelled<Fut>(&self, task: Fut)
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        let token = self.token.clone();
        self.tasks.spawn(async move {
            token.run_until_cancelled_owned(task).await;
        });
    }

    /// Cancels the token and waits for every task, at most the grace period. Tasks still
    /// running then (connections still open) are left to end with the process. Returns
    /// whether every task finished in time.
    pub async fn drain(self) -> bool {
        self.token.cancel();
        self.tasks.close();
        tokio::time::timeout(self.grace, self.tasks.wait())
            .await
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn drain_waits_for_tasks_that_finish_and_gives_up_after_the_grace() {
        let shutdown = Shutdown::new(Duration::from_secs(5));
        let finished = Arc::new(AtomicBool::new(false));
        let done = finished.clone();
        shutdown.spawn(|token| async move {
            token.cancelled().await;
            // Work left after the cancellation, well within the grace.
            tokio::time::sleep(Duration::from_millis(50)).await;
            done.store(true, Ordering::SeqCst);
        });
        shutdown.spawn_until_cancelled(std::future::pending());
        assert!(shutdown.drain().await);
        assert!(finished.load(Ordering::SeqCst));

        // A task that never finishes costs the grace, not more.
        let grace = Duration::from_millis(300);
        let shutdown = Shutdown::new(grace);
        shutdown.spawn(|_| std::future::pending());
        let start = std::time::Instant::now();
        assert!(!shutdown.drain().await);
        let waited = start.elapsed();
        assert!(waited >= grace && waited < grace * 10, "{waited:?}");
    }
}
