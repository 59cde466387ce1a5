//! `strata up`: the whole stack on one machine (engine replicas supervised as child
//! processes, the router in front of them), and the live dashboard served at `/ui`.

pub mod dashboard;
pub mod up;

pub use up::{run, StackConfig, UpArgs};
