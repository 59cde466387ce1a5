//! The decisions flow control hands back, each with the status the client gets.

use serde::Serialize;

/// What happens to a request on arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Room now and nothing of its band or above waiting: send it.
    Dispatch,
    /// It waits; a later [`super::FlowController::dispatch`] sends or evicts it.
    Queued,
    /// Refused at once.
    Refused(Refusal),
}

/// Why a request was refused on arrival (429 both: the client may retry later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// Sheddable (priority < 0) while the pool is saturated.
    Shed,
    /// A request or byte bound (its band's, or the total) is full.
    Capacity,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Shed => "shed",
            Refusal::Capacity => "capacity",
        }
    }
}

/// Why a queued request left without being sent (503: the service could not take it in
/// time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Eviction {
    /// Its time to live ran out while the pool had ready endpoints.
    Ttl,
    /// Its time to live ran out while no endpoint was ready (held for activation).
    HeldTtl,
}

impl Eviction {
    pub fn as_str(self) -> &'static str {
        match self {
            Eviction::Ttl => "ttl",
            Eviction::HeldTtl => "held_ttl",
        }
    }
}

/// One dispatch round: what to send now, in order, and what to evict.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// `(id, time it waited)`, in dispatch order.
    pub dispatched: Vec<(u64, std::time::Duration)>,
    pub evicted: Vec<(u64, Eviction)>,
}

impl Step {
    pub fn is_empty(&self) -> bool {
        self.dispatched.is_empty() && self.evicted.is_empty()
    }
}
