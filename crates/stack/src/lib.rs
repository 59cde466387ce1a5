//! `strata up`: the whole stack on one machine (engine replicas run by the lifecycle
//! controller as child processes, the router in front of them), the live dashboard served
//! at `/ui`, and canary rollouts.
//!
//! - [`up`]: `strata.yaml` / flags and the process that wires everything: config, build,
//!   serve, shutdown done once.
//! - [`fleet`]: both versions' local drivers behind the controller's `Driver` trait, and the
//!   router registrar (endpoint group = version).
//! - [`pools`]: `models:`, one pool per model, and what the front needs to tell them apart.
//! - [`front`]: holding a request while its pool has no ready replica; `/v1/models` over
//!   every pool; per-version step statistics.
//! - [`rollout`]: the rollout API under `/controller/rollout/` and the task running one.
//! - [`dashboard`]: the live page at `/ui`; [`gateway_cache`]: its gateway cache panel.
//! - [`pull`]: models pulled before a replica (or a canary) needs them.

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
pub mod dashboard;
pub mod fleet;
pub mod front;
pub mod gateway_cache;
pub mod pools;
pub mod pull;
pub mod rollout;
pub mod signals;
pub mod up;

pub use up::{run, StackConfig, StackConfigError, UpArgs};
