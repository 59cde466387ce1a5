//! `kind: router` upstreams: a router run in-process, its config inline or from a file.

use std::collections::HashSet;
use std::path::Path;

use super::{invalid, ConfigError, UpstreamConfig};

/// Checks a `kind: router` upstream without reading files or starting anything.
pub(super) fn validate_router_upstream(u: &UpstreamConfig) -> Result<(), ConfigError> {
    let name = &u.name;
    if !u.base_url.is_empty() {
        return Err(invalid(format!(
            "upstream `{name}`: `kind: router` takes `endpoints`, not `base_url`"
        )));
    }
    if u.api_key_env.is_some() || u.api_key_file.is_some() {
        return Err(invalid(format!(
            "upstream `{name}`: `api_key_env` and `api_key_file` are not used by `kind: router`"
        )));
    }
    if u.provider.is_some() || u.connect_timeout_ms.is_some() || !u.prices.is_empty() {
        return Err(invalid(format!(
            "upstream `{name}`: `provider`, `connect_timeout_ms` and `prices` are for \
             fixed-URL upstreams, not `kind: router`"
        )));
    }
    if u.ca_file.is_some() {
        return Err(invalid(format!(
            "upstream `{name}`: `kind: router` takes its CA in `router: {{upstream_tls: {{ca}}}}`, not `ca_file`"
        )));
    }
    if u.config.is_some() && u.router.is_some() {
        return Err(invalid(format!(
            "upstream `{name}`: give router settings either in `config` (a file) or inline \
             in `router`, not both"
        )));
    }
    let default_kind = match &u.router {
        Some(v) => inline_router_config(name, v)?.default_kind,
        None => strata_router::EngineKind::default(),
    };
    if u.endpoints.is_empty() && u.config.is_none() {
        return Err(invalid(format!(
            "upstream `{name}`: `kind: router` needs `endpoints` (or a `config` file listing them)"
        )));
    }
    let mut seen = HashSet::new();
    for e in &u.endpoints {
        let spec = e
            .spec(default_kind)
            .map_err(|why| invalid(format!("upstream `{name}`: {why}")))?;
        if !seen.insert(spec.url.clone()) {
            return Err(invalid(format!(
                "upstream `{name}`: endpoint `{}` listed twice",
                spec.url
            )));
        }
    }
    Ok(())
}

pub(super) fn inline_router_config(
    name: &str,
    v: &serde_yaml::Value,
) -> Result<strata_router::RouterConfig, ConfigError> {
    let text = serde_yaml::to_string(v)?;
    strata_router::RouterConfig::from_yaml(&text)
        .map_err(|e| invalid(format!("upstream `{name}`: {e}")))
}

/// A `kind: router` upstream's live router and what it was built from (so a reload with
/// the same settings keeps it, with its circuit breakers, prefix index and in-flight
/// counts, and only syncs the endpoint list).
#[derive(Clone)]
pub struct EmbeddedRouter {
    pub router: strata_router::Router,
    /// The router settings text it was built from (file contents or inline YAML).
    pub(super) source: String,
}

impl std::fmt::Debug for EmbeddedRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedRouter")
            .field("endpoints", &self.router.endpoints())
            .finish_non_exhaustive()
    }
}

/// Router settings and endpoints of a `kind: router` upstream, read and checked.
pub(super) struct RouterPlan {
    pub(super) config: strata_router::RouterConfig,
    pub(super) source: String,
}

pub(super) fn plan_router(
    u: &UpstreamConfig,
    base_dir: Option<&Path>,
) -> Result<RouterPlan, ConfigError> {
    let name = &u.name;
    let source = match (&u.config, &u.router) {
        (Some(path), _) => {
            let full = match base_dir {
                Some(dir) if path.is_relative() => dir.join(path),
                _ => path.clone(),
            };
            std::fs::read_to_string(&full).map_err(|source| ConfigError::Read {
                path: full.clone(),
                source,
            })?
        }
        (None, Some(v)) => serde_yaml::to_string(v)?,
        (None, None) => String::new(),
    };
    let text = if source.trim().is_empty() {
        "{}"
    } else {
        &source
    };
    let mut config = strata_router::RouterConfig::from_yaml(text)
        .map_err(|e| invalid(format!("upstream `{name}`: {e}")))?;
    if !u.endpoints.is_empty() {
        let mut specs = Vec::with_capacity(u.endpoints.len());
        for e in &u.endpoints {
            let spec = e
                .spec(config.default_kind)
                .map_err(|why| invalid(format!("upstream `{name}`: {why}")))?;
            if specs
                .iter()
                .any(|s: &strata_router::EndpointSpec| s.url == spec.url)
            {
                return Err(invalid(format!(
                    "upstream `{name}`: endpoint `{}` listed twice",
                    spec.url
                )));
            }
            specs.push(spec);
        }
        config.endpoints = specs;
    }
    if config.endpoints.is_empty() {
        return Err(invalid(format!(
            "upstream `{name}`: the router has no endpoints"
        )));
    }
    Ok(RouterPlan { config, source })
}
