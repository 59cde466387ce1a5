//! What can go wrong before or around a simulation (a simulation itself cannot fail: a
//! request that cannot be served is counted in the report, as `strata bench` counts it).

use std::path::PathBuf;

/// Errors of `strata sim`, `strata plan` and `strata sim calibrate`.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("unknown {kind} profile `{name}` (known: {known})")]
    UnknownProfile {
        kind: &'static str,
        name: String,
        known: &'static str,
    },
    #[error("{what}: {message}")]
    Config { what: String, message: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Bench(#[from] strata_bench::BenchError),
    #[error(transparent)]
    Router(#[from] strata_router::config::RouterConfigError),
    #[error("calibration: {0}")]
    Calibration(String),
}

impl SimError {
    pub(crate) fn config(what: impl Into<String>, message: impl Into<String>) -> SimError {
        SimError::Config {
            what: what.into(),
            message: message.into(),
        }
    }
}
