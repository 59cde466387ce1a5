//! The router's configuration in `strata up`: the `router_config` file, or the default;
//! in disaggregated mode, llm-d's profile pair at `pd_threshold` unless the file brings
//! its own scheduling.

use anyhow::Context;
use strata_router::RouterConfig;

use super::config::StackConfig;

/// The router's configuration for this stack.
pub(super) fn router_config(cfg: &StackConfig) -> anyhow::Result<RouterConfig> {
    let from_file = match &cfg.router_config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            RouterConfig::from_yaml(&text).with_context(|| format!("in {}", path.display()))?
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
