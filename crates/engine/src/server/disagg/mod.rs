//! Prefill/decode disaggregation and the shared KV tier, as the engine server sees them
//! (PROTOCOLS §11, i21).
//!
//! A request's `kv_transfer_params` (or the `x-prefiller-host-port` header an endpoint
//! picker adds) is checked at the edge and turned into a [`KvPlan`]; `prepare` then does
//! the network part before the request reaches the engine thread: it pulls the prompt's
//! blocks from the prefill engine that holds them, or looks them up in the tier, and hands
//! them to the loop as `imported` blocks. Every network step is bounded, and any failure
//! only means the engine recomputes what it could not fetch: a peer can slow a request
//! down by at most the transfer timeout, never fail or hang it.
//!
//! - `params`: `kv_transfer_params` checked into a plan, and a prefill answer's params.
//! - `pull`: a plan's network part (phase 1, the pull, the tier lookup).
//! - `services`: the transfer endpoint and the tier offloader beside the HTTP server.

mod params;
mod pull;
mod services;

pub(super) use params::{plan, prefill_answer};
pub(super) use pull::{prepare, PromptRef};
pub use services::{start_kv_services, KvServices};
