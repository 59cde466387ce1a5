//! Simulator: the real engine step planner and block pool, the real router scheduling
//! library and the real autoscaling policy, in virtual time, with the forward pass
//! replaced by a roofline step-time model (`docs/SIM.md`).
//!
//! - [`profile`]: hardware and model profiles and the step-time model;
//! - [`replica`]: one engine replica around `strata_engine::planner::StepPlanner`;
//! - [`routing`]: the router around `strata_router::EndpointPicker` and both prefix indexes;
//! - [`sim`]: the discrete-event loop, workloads (`strata bench`'s), the autoscaler
//!   (`strata_controller::autoscale::decide`) and the report (`strata bench`'s);
//! - [`plan`]: `strata plan`, the cheapest fleet meeting an SLO;
//! - [`calibrate`]: `strata sim calibrate`, fitting "this machine" from a live engine;
//! - [`heap`]: huge pages for the fleet's arrays (a restart with glibc's tunables).

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
pub mod calibrate;
pub mod cli;
pub mod error;
pub mod heap;
pub mod plan;
pub mod profile;
pub mod replica;
pub mod routing;
pub mod sim;
pub mod tenants;

pub use cli::{run_plan, run_sim, FleetArgs, PlanArgs, SimArgs};
pub use error::SimError;
pub use sim::{simulate, AutoscaleSetup, SimConfig, SimOutcome, SimStats};
