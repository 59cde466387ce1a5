//! Plugin parameters: reading a plugin's `parameters` into the shape its type takes, and
//! the shapes that more than one plugin type reads (llm-d's names, camelCase; unknown
//! fields are errors).

use serde::de::DeserializeOwned;
use serde::Deserialize;

/// Parameters that do not fit their plugin's shape: the message a
/// [`super::ConfigError::Parameters`] carries, with the plugin's name beside it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct BadParameters(pub String);

/// `parameters` read as `T`; none given is `T::default()`.
pub fn parse<T: DeserializeOwned + Default>(
    parameters: Option<&serde_json::Value>,
) -> Result<T, BadParameters> {
    match parameters {
        None => Ok(T::default()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| BadParameters(e.to_string())),
    }
}

/// The prefix scorers' parameters, which also set the approximate index.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct PrefixParams {
    pub(crate) block_size: Option<usize>,
    pub(crate) lru_capacity_per_server: Option<usize>,
    pub(crate) max_prefix_blocks_to_match: Option<usize>,
    pub(crate) lower_tier_weight: Option<f64>,
    /// Accepted for llm-d compatibility; the router's index needs no hash seed here.
    #[serde(default)]
    pub(crate) hash_seed: Option<String>,
}

/// A queue-length threshold (`load-aware-scorer`, `low-queue-filter`).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct ThresholdParams {
    pub(crate) threshold: Option<f64>,
    #[serde(alias = "queueDepthThreshold")]
    pub(crate) queue_threshold: Option<f64>,
}
