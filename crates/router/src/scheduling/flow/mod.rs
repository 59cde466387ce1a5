//! Flow control: the layer between admission and scheduling that orders, bounds and
//! shares the requests waiting for room in the pool (the shape of the Gateway API
//! Inference Extension's flow control).
//!
//! Pure like the rest of [`crate::scheduling`]: [`FlowController`] is state; a request,
//! the pool's room ([`PoolView`]) and `now` go in, a decision comes out. It reads no clock
//! and wakes nobody, so the live router (both transports) and `strata sim` run the same
//! code; the caller delivers the decisions.
//!
//! - **Bands.** A request's priority is its band; bands are served in strict order,
//!   highest first. Sheddable requests (priority < 0) are refused while the pool has
//!   endpoints and no room, as the saturation detector always did.
//! - **Flows.** Within a band, one FCFS queue per flow (the fairness id: a tenant or key),
//!   served round-robin across the flows that have requests, `weight` requests per turn
//!   (default 1) for a flow the config weights ([`band`]).
//! - **Bounds.** Requests and bytes per band and in total; a request past one is refused
//!   ([`Refusal::Capacity`], 429).
//! - **TTL.** Each request waits at most its time to live (its deadline, or the default);
//!   past it, it is evicted ([`Eviction::Ttl`], 503).
//! - **Room.** Dispatch happens while the pool's room
//!   ([`crate::scheduling::saturation::pool_room`]) exceeds the requests dispatched and
//!   not yet placed; the caller re-runs [`FlowController::dispatch`] on every metrics
//!   refresh, readiness change and completion.
//! - **Empty pool.** With no ready endpoint a request is *held* (queued, up to its TTL),
//!   never failed at once, and [`FlowController::held`] counts them, for activation.

pub mod band;
pub mod config;
pub mod controller;
pub mod outcome;
pub mod request;
pub mod snapshot;

#[cfg(test)]
mod tests;

pub use config::{FlowConfig, Limits};
pub use controller::FlowController;
pub use outcome::{Admit, Eviction, Refusal, Step};
pub use request::{FlowRequest, PoolView};
pub use snapshot::{BandSnapshot, FlowSnapshot, FlowsSnapshot};
