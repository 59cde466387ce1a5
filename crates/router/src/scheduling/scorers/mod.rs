//! Scorers: each gives every candidate a score in 0..1 (PROTOCOLS §6 for the formulas).
//!
//! One scorer a file, each with the `build` that makes it from its plugin's parameters;
//! [`SCORERS`] names them by plugin type (llm-d's names). Adding a scorer is a new file
//! here and one line in that list.

mod kv_cache_utilization;
mod least_request;
mod load_aware;
mod lora_affinity;
mod min_max;
mod precise_prefix_cache;
mod prefix_cache;
mod queue;
mod random;
mod round_robin;
mod session_affinity;

use std::sync::Arc;

use super::params::BadParameters;
use super::Scorer;

pub use kv_cache_utilization::KvCacheUtilizationScorer;
pub use least_request::LeastRequestScorer;
pub use load_aware::LoadAwareScorer;
pub use lora_affinity::LoraAffinityScorer;
pub use precise_prefix_cache::PrecisePrefixCacheScorer;
pub use prefix_cache::PrefixCacheScorer;
pub use queue::QueueScorer;
pub use random::RandomScorer;
pub use round_robin::RoundRobinScorer;
pub use session_affinity::SessionAffinityScorer;

/// Makes a scorer from its plugin's `parameters` (`None`: none given).
pub type Build = fn(Option<&serde_json::Value>) -> Result<Arc<dyn Scorer>, BadParameters>;

/// Every scorer, by plugin type.
pub const SCORERS: &[(&str, Build)] = &[
    ("queue-scorer", queue::build),
    ("kv-cache-utilization-scorer", kv_cache_utilization::build),
    ("prefix-cache-scorer", prefix_cache::build),
    ("precise-prefix-cache-scorer", precise_prefix_cache::build),
    ("lora-affinity-scorer", lora_affinity::build),
    ("session-affinity-scorer", session_affinity::build),
    ("load-aware-scorer", load_aware::build),
    ("least-request-scorer", least_request::build),
    ("round-robin-scorer", round_robin::build),
    ("random-scorer", random::build),
];

/// The `build` of the scorer whose plugin type is `kind`, if one is.
pub fn find(kind: &str) -> Option<Build> {
    SCORERS.iter().find(|(k, _)| *k == kind).map(|(_, b)| *b)
}

#[cfg(test)]
mod tests;
