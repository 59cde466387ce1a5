//! What is waiting, for `/debug/flows` and the metrics.

use serde::Serialize;

/// Every band, with its flows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FlowsSnapshot {
    pub requests: usize,
    pub bytes: u64,
    /// Requests waiting while no endpoint is ready (for activation).
    pub held: usize,
    /// Dispatched, not yet placed on an endpoint.
    pub in_transit: u32,
    /// Highest priority first.
    pub bands: Vec<BandSnapshot>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BandSnapshot {
    pub priority: i32,
    pub requests: usize,
    pub bytes: u64,
    pub flows: Vec<FlowSnapshot>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlowSnapshot {
    pub flow: String,
    pub requests: usize,
    pub bytes: u64,
    pub weight: u32,
    /// How long its oldest request has waited.
    pub oldest_wait_ms: u64,
}
