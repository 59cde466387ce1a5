//! Flow control's settings: the bounds, the default time to live and the flows' weights.

use std::collections::BTreeMap;
use std::time::Duration;

/// A bound on queued requests and their bytes; `None` is unbounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_requests: Option<usize>,
    pub max_bytes: Option<u64>,
}

impl Limits {
    /// Whether one more request of `bytes` fits beside `requests` requests of `held` bytes.
    pub fn admits(&self, requests: usize, held: u64, bytes: u64) -> bool {
        self.max_requests.is_none_or(|m| requests < m)
            && self
                .max_bytes
                .is_none_or(|m| held.saturating_add(bytes) <= m)
    }
}

/// What the flow controller is configured with.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowConfig {
    /// Over every band together.
    pub total: Limits,
    /// For each band not named in `bands`.
    pub per_band: Limits,
    /// Per band (priority), overriding `per_band`.
    pub bands: BTreeMap<i32, Limits>,
    /// Time to live of a request that brings no deadline of its own.
    pub default_ttl: Duration,
    /// Requests a flow is served per round-robin turn (default 1; at least 1).
    pub weights: BTreeMap<String, u32>,
}

impl Default for FlowConfig {
    fn default() -> Self {
        FlowConfig {
            total: Limits {
                max_requests: Some(1024),
                max_bytes: Some(1 << 30),
            },
            per_band: Limits::default(),
            bands: BTreeMap::new(),
            default_ttl: Duration::from_secs(10),
            weights: BTreeMap::new(),
        }
    }
}

impl FlowConfig {
    /// The bounds of band `priority`.
    pub fn band_limits(&self, priority: i32) -> Limits {
        self.bands.get(&priority).copied().unwrap_or(self.per_band)
    }

    /// The weight of flow `flow` (at least 1).
    pub fn weight(&self, flow: &str) -> u32 {
        self.weights.get(flow).copied().unwrap_or(1).max(1)
    }
}
