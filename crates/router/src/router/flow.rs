//! The router's side of flow control: the pool as the gate sees it (ready, room), the
//! pump that re-runs the gate when that changes, and admission for a caller that knows
//! only a priority.

use std::time::Duration;

use super::pool::refresh_ready;
use super::{Inner, RouteError, Router};
use crate::admission::gate::Ticket;
use crate::scheduling::flow::PoolView;
use crate::scheduling::saturation::pool_room;

impl Router {
    /// Admission of a request known only by its priority (the embedding gateway's):
    /// flow control with the shared flow and the default time to live
    /// ([`Router::admit_flow`]).
    pub async fn admit(&self, priority: i32) -> Result<(), RouteError> {
        self.admit_flow(&Ticket::priority_only(priority))
            .await
            .map(drop)
    }
}

impl Inner {
    /// The pool as flow control sees it at `now`: whether an endpoint is ready, and the
    /// room ([`pool_room`]).
    pub(crate) fn pool_view(&self, now: Duration) -> PoolView {
        let mut pool = self.lock_pool();
        refresh_ready(&mut pool, now);
        PoolView {
            ready: pool.cands.iter().any(|c| c.ready && !c.draining),
            room: pool_room(&pool.cands, now, &self.config.saturation_config()),
        }
    }

    /// Re-runs flow control (evictions, then dispatches while there is room): on every
    /// scrape, readiness change and finished request, and at a waiter's deadline.
    pub(crate) fn pump_flows(&self) {
        if !self.flow.has_queued() {
            return;
        }
        let now = self.now();
        let view = self.pool_view(now);
        self.flow.pump(now, &view);
    }
}
