//! The router's configuration in `strata up`: the `router_config` file, or the default;
//! in disaggregated mode, llm-d's profile pair at `pd_threshold` unless the file brings
//! its own scheduling.

use std::path::PathBuf;

use strata_router::config::RouterConfigError;
use strata_router::RouterConfig;

use super::config::StackConfig;

/// A `router_config` file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub(super) enum RouterFileError {
    #[error("reading {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("in {}", path.display())]
    Invalid {
        path: PathBuf,
        #[source]
        error: RouterConfigError,
    },
}

/// The router's configuration for this stack.
pub(super) fn router_config(cfg: &StackConfig) -> Result<RouterConfig, RouterFileError> {
    let from_file = match &cfg.router_config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|error| RouterFileError::Read {
                path: path.clone(),
                error,
            })?;
            RouterConfig::from_yaml(&text).map_err(|error| RouterFileError::Invalid {
                path: path.clone(),
                error,
            })?
        }
        None => RouterConfig::default(),
    };
    Ok(pd_router_config(cfg, from_file))
}

/// The router's config in disaggregated mode: llm-d's profile pair at `pd_threshold`
/// unless the router config file brings its own scheduling.
pub(super) fn pd_router_config(cfg: &StackConfig, mut rc: RouterConfig) -> RouterConfig {
    if !cfg.disaggregated() {
        return rc;
    }
    match &rc.scheduling {
        None => {
            rc.scheduling = Some(strata_router::EndpointPickerConfig::pd(cfg.pd_threshold));
        }
        Some(s) if !s.plugins.iter().any(|p| p.kind == "pd-profile-handler") => {
            tracing::warn!(
                "the router config's scheduling has no pd-profile-handler: requests are not \
                 disaggregated"
            );
        }
        Some(_) => {}
    }
    rc
}
