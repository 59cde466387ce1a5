//! What flow control knows of a request, and of the pool.

use std::time::Duration;

/// One request waiting for room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowRequest {
    /// The caller's id for it (unique among those queued).
    pub id: u64,
    /// The fairness id (tenant, key; `""` for requests that name none: one shared flow).
    pub flow: String,
    /// Its band: higher is served first; below 0 is sheddable.
    pub priority: i32,
    /// Its size, counted against the byte bounds.
    pub bytes: u64,
    /// When it arrived.
    pub arrived: Duration,
    /// How long it may wait; `None`: the configured default.
    pub ttl: Option<Duration>,
}

/// The pool as flow control sees it at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolView {
    /// Some endpoint is ready (not draining): without one, requests are held.
    pub ready: bool,
    /// How many more requests the pool can take now
    /// ([`crate::scheduling::saturation::pool_room`]).
    pub room: u32,
}

impl PoolView {
    /// Endpoints are ready but none has room: sheddable requests are refused.
    pub fn saturated(&self) -> bool {
        self.ready && self.room == 0
    }
}
