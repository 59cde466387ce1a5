//! Command-line entry points of the engine's roles, which the `strata` binary dispatches
//! to: `strata engine` ([`EngineArgs`], [`run`]), `strata kv-tier` ([`KvTierArgs`],
//! [`run_kv_tier`]), and the model cache's `strata model pull|list|path` ([`model_pull`],
//! [`model_list`], [`model_path`]).

mod engine;
mod kv_tier;
mod model;

pub use engine::{run, EngineArgs};
pub use kv_tier::{run_kv_tier, KvTierArgs};
pub use model::{model_list, model_path, model_pull};
