//! A validated config with its lookup tables built: names to models, upstreams to clients.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::embedded_router::{plan_router, EmbeddedRouter};
use super::*;

/// A validated config with its lookup tables built.
#[derive(Debug)]
pub struct Resolved {
    pub config: Config,
    /// Public name or alias -> index into `config.models`.
    pub model_index: HashMap<String, usize>,
    pub upstreams: HashMap<String, ResolvedUpstream>,
    pub tenants: HashMap<String, TenantConfig>,
    pub guardrails: crate::guardrails::Guardrails,
    /// Compiled cascade policies by canonical model name.
    pub cascades: HashMap<String, std::sync::Arc<crate::cascade::CascadePolicy>>,
    /// The metrics key (`metrics.key`, or read from `metrics.key_env` at load).
    pub metrics_key: Option<String>,
}

/// An upstream with its key read from the environment (or its embedded router built).
#[derive(Debug, Clone)]
pub struct ResolvedUpstream {
    pub name: String,
    /// Empty for `kind: router`.
    pub base_url: String,
    /// Whose API it speaks (`None`: a Strata engine, router or vLLM server).
    pub provider: Option<crate::provider::kind::Provider>,
    /// `kind: router`: the in-process router that picks a replica for each try.
    pub router: Option<EmbeddedRouter>,
    /// The forwarded routes' URLs (each route's path, or its provider's), parsed once at
    /// load, in [`ROUTE_PATHS`] order; empty for `kind: router`.
    pub route_urls: Vec<axum::http::Uri>,
    /// The headers carrying the upstream's key the provider's way (`Authorization:
    /// Bearer`, or `x-api-key` and `anthropic-version`), built once at load; the values
    /// are marked sensitive (never printed).
    pub auth: Vec<(axum::http::HeaderName, axum::http::HeaderValue)>,
    /// Prices by the `model` sent to this upstream ([`UpstreamConfig::prices`]).
    pub prices: std::collections::BTreeMap<String, Price>,
    /// A client of its own trusting `ca_file` too; `None` uses the gateway's (system
    /// roots).
    pub client: Option<crate::upstream::UpstreamClient>,
}

impl Resolved {
    /// Resolves a config on its own (router upstreams read relative files from the
    /// current directory and start fresh routers).
    pub fn new(config: Config) -> Result<Resolved, ConfigError> {
        Resolved::build(config, None, None)
    }

    /// Resolves a config. `base_dir` is where relative router config paths are read
    /// from; `previous` is the config being replaced, whose embedded routers are kept
    /// (endpoint lists synced) when their settings did not change. Background tasks of
    /// new routers start on the current tokio runtime.
    pub fn build(
        config: Config,
        base_dir: Option<&Path>,
        previous: Option<&Resolved>,
    ) -> Result<Resolved, ConfigError> {
        config.validate()?;
        let mut model_index = HashMap::new();
        for (i, m) in config.models.iter().enumerate() {
            model_index.insert(m.name.clone(), i);
            for a in &m.aliases {
                model_index.insert(a.clone(), i);
            }
        }
        // Read and check every router's settings before touching any live router, so a
        // refused file leaves the running ones as they were.
        let mut plans = HashMap::new();
        for u in &config.upstreams {
            if u.kind == UpstreamKind::Router {
                plans.insert(u.name.clone(), plan_router(u, base_dir)?);
            }
        }
        let mut upstreams = HashMap::new();
        for u in &config.upstreams {
            if let Some(plan) = plans.remove(&u.name) {
                let kept = previous
                    .and_then(|p| p.upstreams.get(&u.name))
                    .and_then(|p| p.router.as_ref())
                    .filter(|r| r.source == plan.source);
                let embedded = match kept {
                    Some(r) => {
                        r.router.sync_endpoints(&plan.config.endpoints);
                        r.clone()
                    }
                    None => EmbeddedRouter {
                        router: strata_router::Router::new(plan.config)
                            .map_err(|e| invalid(format!("upstream `{}`: {e}", u.name)))?,
                        source: plan.source,
                    },
                };
                upstreams.insert(
                    u.name.clone(),
                    ResolvedUpstream {
                        name: u.name.clone(),
                        base_url: String::new(),
                        provider: None,
                        router: Some(embedded),
                        route_urls: Vec::new(),
                        auth: Vec::new(),
                        prices: Default::default(),
                        client: None,
                    },
                );
                continue;
            }
            upstreams.insert(u.name.clone(), resolve_fixed(u, base_dir)?);
        }
        let tenants = config
            .tenants
            .iter()
            .map(|t| (t.name.clone(), t.clone()))
            .collect();
        let guardrails = crate::guardrails::Guardrails::new(&config.guardrails).map_err(invalid)?;
        let mut cascades = HashMap::new();
        for m in &config.models {
            if let Some(c) = &m.cascade {
                let policy = crate::cascade::CascadePolicy::new(c)
                    .map_err(|e| invalid(format!("model `{}`: {e}", m.name)))?;
                cascades.insert(m.name.clone(), std::sync::Arc::new(policy));
            }
        }
        let metrics_key = match (&config.metrics.key, &config.metrics.key_env) {
            (Some(k), _) => Some(k.clone()),
            (None, Some(var)) => {
                let k = std::env::var(var).map_err(|_| {
                    invalid(format!(
                        "metrics.key_env: environment variable `{var}` is not set"
                    ))
                })?;
                if k.len() < 16 {
                    return Err(invalid(format!(
                        "metrics.key_env: the key in `{var}` is shorter than 16 characters"
                    )));
                }
                Some(k)
            }
            (None, None) => None,
        };
        Ok(Resolved {
            config,
            model_index,
            upstreams,
            tenants,
            guardrails,
            cascades,
            metrics_key,
        })
    }

    /// The model a public name or alias refers to.
    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.model_index.get(name).map(|&i| &self.config.models[i])
    }

    /// Public model names, sorted.
    pub fn model_names(&self) -> Vec<String> {
        let set: BTreeMap<&str, ()> = self.model_index.keys().map(|k| (k.as_str(), ())).collect();
        set.into_keys().map(str::to_string).collect()
    }
}

/// A fixed-URL upstream: its key read, its auth headers and route URLs built, and a
/// client of its own when it trusts a `ca_file` or connects with its own timeout.
fn resolve_fixed(
    u: &UpstreamConfig,
    base_dir: Option<&Path>,
) -> Result<ResolvedUpstream, ConfigError> {
    let name = &u.name;
    let key = crate::provider::key::read_key(
        u.api_key_env.as_deref(),
        u.api_key_file.as_deref(),
        base_dir,
    )
    .map_err(|e| invalid(format!("upstream `{name}`: {e}")))?;
    let version = u
        .anthropic_version
        .as_deref()
        .unwrap_or(crate::provider::kind::DEFAULT_ANTHROPIC_VERSION);
    let auth =
        crate::provider::key::auth_headers(u.provider, key.as_ref(), version).ok_or_else(|| {
            invalid(format!(
                "upstream `{name}`: the API key cannot be sent in a header"
            ))
        })?;
    let base_url = u.base_url().trim_end_matches('/').to_string();
    let route_urls = ROUTE_PATHS
        .iter()
        .map(|&route_path| {
            let path = u.provider.map_or(route_path, |p| p.path(route_path));
            format!("{base_url}{path}").parse::<axum::http::Uri>()
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("upstream `{name}`: bad base_url: {e}")))?;
    let ca = u.ca_file.as_ref().map(|ca| match base_dir {
        Some(dir) if ca.is_relative() => dir.join(ca),
        _ => ca.clone(),
    });
    let client = if ca.is_some() || u.connect_timeout_ms.is_some() {
        let connect = u.connect_timeout_ms.map_or(
            crate::upstream::CONNECT_TIMEOUT,
            std::time::Duration::from_millis,
        );
        Some(
            crate::upstream::UpstreamClient::new(connect, ca.as_deref())
                .map_err(|e| invalid(format!("upstream `{name}`: ca_file: {e}")))?,
        )
    } else {
        None
    };
    Ok(ResolvedUpstream {
        name: name.clone(),
        base_url,
        provider: u.provider,
        router: None,
        route_urls,
        auth,
        prices: u.prices.clone(),
        client,
    })
}
