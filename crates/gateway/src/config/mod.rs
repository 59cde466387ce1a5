//! `gateway.yaml`: parsed with serde, then validated into a [`Config`] whose references all
//! resolve (every target names a declared upstream, every fallback a declared model).
//!
//! Invariant: a [`Config`] that exists has passed [`Config::validate`]. Reload builds a new
//! one and swaps it in only when validation succeeds ([`ConfigHandle::reload`]), so a bad
//! edit leaves the gateway serving with the previous file.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::guardrails::GuardrailsConfig;

mod embedded_router;
mod handle;
mod provider;
mod resolved;
mod server;

use embedded_router::validate_router_upstream;
pub use embedded_router::EmbeddedRouter;
pub use handle::ConfigHandle;
pub use resolved::{Resolved, ResolvedUpstream};
pub use server::ServerConfig;

/// Why a configuration file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("invalid config: {0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(msg.into())
}

/// The whole file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub upstreams: Vec<UpstreamConfig>,
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub cache: CacheConfig,
    #[serde(default)]
    pub guardrails: GuardrailsConfig,
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub store: StoreConfig,
    /// Who may call besides API keys ([`crate::auth::config`]).
    #[serde(default)]
    pub auth: crate::auth::config::AuthConfig,
    /// Who may read the tenant series of `/metrics`.
    #[serde(default)]
    pub metrics: MetricsConfig,
}

/// `metrics:`: the per-tenant series (tokens, cost, cache outcomes by tenant) are shown
/// only to a caller with the metrics key (`Authorization: Bearer`), or on a listener of
/// their own; without either, `/metrics` carries only series that name no tenant.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// The metrics key itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// An environment variable holding the metrics key (read at load); not with `key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_env: Option<String>,
    /// `host:port` of a second listener serving the whole `/metrics` (tenant series
    /// included) and nothing else, for a scraper on a private network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
}

/// Which store holds keys, tenants, budgets, the ledger and the audit log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreBackend {
    /// One SQLite file (`--db`): one gateway.
    #[default]
    Sqlite,
    /// A PostgreSQL database shared by every gateway replica.
    Postgres,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    #[serde(default)]
    pub backend: StoreBackend,
    /// `postgres://user:password@host:port/database` (backend `postgres`).
    #[serde(default)]
    pub url: Option<String>,
    /// When the shared store cannot hold a budget: `open` admits on this replica's own
    /// view of spend; `closed` refuses with 503.
    #[serde(default)]
    pub on_error: FailureMode,
    /// Longest wait for one store call before it counts as a failure.
    #[serde(default = "default_store_timeout_ms")]
    pub timeout_ms: u64,
    /// How long a budget hold outlives a request that never settles (a crashed replica).
    #[serde(default = "default_hold_ttl_secs")]
    pub hold_ttl_secs: u64,
    /// How long a Responses API response (`store: true`) is kept for `GET` and
    /// `previous_response_id` (default 30 days).
    #[serde(default = "default_responses_retention_secs")]
    pub responses_retention_secs: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            backend: StoreBackend::Sqlite,
            url: None,
            on_error: FailureMode::Open,
            timeout_ms: default_store_timeout_ms(),
            hold_ttl_secs: default_hold_ttl_secs(),
            responses_retention_secs: default_responses_retention_secs(),
        }
    }
}

fn default_responses_retention_secs() -> u64 {
    30 * 24 * 3600
}

fn default_store_timeout_ms() -> u64 {
    2000
}
fn default_hold_ttl_secs() -> u64 {
    600
}

/// Where requests can go.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub name: String,
    /// `openai` (any OpenAI-compatible server, including a Strata engine),
    /// `strata_router` (a Strata router URL; spoken to the same way), or `router` (an
    /// in-process router over `endpoints`: each try asks it which replica answers).
    #[serde(default)]
    pub kind: UpstreamKind,
    /// Base URL without the `/v1` suffix, e.g. `http://127.0.0.1:8000`. Required for
    /// `openai` and `strata_router`; not used by `router`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub base_url: String,
    /// Whose API the upstream speaks ([`crate::provider::kind::Provider`]: `openai`,
    /// `anthropic`, `openai-compatible`): its auth header, wire format and routes. Absent:
    /// a Strata engine, router or vLLM server (every route passed through as is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<crate::provider::kind::Provider>,
    /// Name of an environment variable holding the upstream's API key, sent the
    /// provider's way (`Authorization: Bearer`, or Anthropic's `x-api-key`). Read at load
    /// time; never written to logs.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// A file holding the upstream's API key (a mounted secret; surrounding whitespace
    /// dropped; relative paths from the gateway config's directory); not with
    /// `api_key_env`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<PathBuf>,
    /// `provider: anthropic`: the `anthropic-version` header sent (default
    /// [`crate::provider::kind::DEFAULT_ANTHROPIC_VERSION`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anthropic_version: Option<String>,
    /// How long a connect (TCP and the TLS handshake) may take, in ms (default 5000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout_ms: Option<u64>,
    /// Prices of the models this upstream serves, by the `model` sent to it (US dollars
    /// per 1M tokens): an answer from this upstream is charged at these, over the public
    /// model's `price`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub prices: std::collections::BTreeMap<String, Price>,
    /// `https://` upstreams: a PEM file of CAs trusted besides the system's roots
    /// (relative paths are read from the gateway config's directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// `router` only: the engine replicas, each a URL (`[kind=]http://host:port`) or the
    /// router's endpoint spec (`{url, kind, model, lora, group, labels, ...}`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointItem>,
    /// `router` only: a `router.yaml` (relative paths are read from the gateway config's
    /// directory). Its `endpoints` are used when `endpoints` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<PathBuf>,
    /// `router` only: router settings written inline (the `router.yaml` shape); not
    /// together with `config`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<serde_yaml::Value>,
    /// The generation APIs the upstream serves itself besides chat (`messages`,
    /// `responses`; vLLM 0.32 serves both): requests on those routes are passed through
    /// when every upstream of the model lists the API, else translated to chat
    /// ([`crate::passthrough`]). Default: none (a Strata engine).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub apis: Vec<crate::apis::Api>,
}

impl UpstreamConfig {
    /// `base_url`, or the provider's own when it is not given.
    pub fn base_url(&self) -> &str {
        match self.provider.and_then(|p| p.default_base_url()) {
            Some(default) if self.base_url.is_empty() => default,
            _ => &self.base_url,
        }
    }
}

/// One replica of a `router` upstream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EndpointItem {
    Url(String),
    Spec(strata_router::EndpointSpec),
}

impl EndpointItem {
    /// The normalised spec (`kind=` prefix honoured, URL checked).
    pub fn spec(
        &self,
        default_kind: strata_router::EngineKind,
    ) -> Result<strata_router::EndpointSpec, String> {
        let spec = match self {
            EndpointItem::Url(u) => match u.split_once('=') {
                Some((k, url)) => {
                    let kind = k.parse().map_err(|e| format!("{e}"))?;
                    strata_router::EndpointSpec::new(url, kind)
                }
                None => strata_router::EndpointSpec::new(u.as_str(), default_kind),
            },
            EndpointItem::Spec(s) => s.clone(),
        };
        spec.normalized().map_err(|e| e.to_string())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamKind {
    #[default]
    Openai,
    StrataRouter,
    /// An in-process [`strata_router::Router`] over engine URLs.
    Router,
}

/// A public model name and where it goes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients send in `model`.
    pub name: String,
    /// Weighted targets; one is picked per request, the others are tried next on failure.
    /// Empty for a cascade.
    #[serde(default)]
    pub targets: Vec<TargetConfig>,
    /// A cascade over other public models instead of targets ([`crate::cascade`]).
    #[serde(default)]
    pub cascade: Option<crate::cascade::CascadeConfig>,
    /// Public model names tried, in order, when every target of this one failed.
    #[serde(default)]
    pub fallbacks: Vec<String>,
    /// Other public names for this model.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Time allowed for one try to answer with response headers.
    #[serde(default = "default_try_timeout_ms")]
    pub try_timeout_ms: u64,
    /// Time allowed for the whole request across tries and fallbacks (until headers).
    #[serde(default = "default_total_timeout_ms")]
    pub timeout_ms: u64,
    /// Extra tries of the same target on a retryable failure.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Base of the exponential backoff between retries, in ms (jittered).
    #[serde(default = "default_backoff_ms")]
    pub backoff_ms: u64,
    #[serde(default)]
    pub price: Price,
    /// Context window in tokens; requests estimated larger skip to a fallback.
    #[serde(default)]
    pub context_length: Option<u64>,
}

fn default_try_timeout_ms() -> u64 {
    30_000
}
fn default_total_timeout_ms() -> u64 {
    60_000
}
fn default_retries() -> u32 {
    1
}
fn default_backoff_ms() -> u64 {
    50
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    pub upstream: String,
    /// Model name sent upstream; the public name when absent.
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    1
}

/// US dollars per one million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    #[serde(default)]
    pub input_per_1m: f64,
    #[serde(default)]
    pub output_per_1m: f64,
}

impl Price {
    /// Cost in micro-dollars (1e-6 USD): a price per 1M tokens is exactly micro-dollars per
    /// token.
    pub fn cost_micros(&self, input_tokens: u64, output_tokens: u64) -> i64 {
        let micros =
            input_tokens as f64 * self.input_per_1m + output_tokens as f64 * self.output_per_1m;
        micros.round() as i64
    }
}

/// Requests and tokens per minute; `None` means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimits {
    #[serde(default)]
    pub rpm: Option<u64>,
    #[serde(default)]
    pub tpm: Option<u64>,
}

impl RateLimits {
    /// Field-wise override: `other`'s set fields win.
    pub fn overlay(self, other: RateLimits) -> RateLimits {
        RateLimits {
            rpm: other.rpm.or(self.rpm),
            tpm: other.tpm.or(self.tpm),
        }
    }
}

/// Defaults for a tenant; the admin API may override limits and budget in the store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    #[serde(default)]
    pub limits: RateLimits,
    /// Spend ceiling in USD per `budget_period` (over the tenant's lifetime without one).
    #[serde(default)]
    pub budget_usd: Option<f64>,
    /// `daily | weekly | monthly` (UTC calendar periods); absent: a lifetime cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_period: Option<crate::budget::Period>,
    /// Each user's budget in this tenant (a JWT's user, or a key's `user`) unless the
    /// admin API stored one for that user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_budget_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_budget_period: Option<crate::budget::Period>,
    /// Public model names the tenant may use; empty means all.
    #[serde(default)]
    pub allowed_models: Vec<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    #[default]
    Memory,
    Redis,
}

/// What to do when the shared backend (Redis) cannot be reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Admit the request unlimited (and count it in `strata_gateway_backend_errors_total`).
    #[default]
    Open,
    /// Refuse it with 503.
    Closed,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    #[serde(default)]
    pub backend: Backend,
    #[serde(default)]
    pub redis_url: Option<String>,
    #[serde(default)]
    pub on_backend_error: FailureMode,
    /// Time allowed for one Redis call before it counts as a backend error.
    #[serde(default = "default_redis_timeout_ms")]
    pub redis_timeout_ms: u64,
    /// Limits of every key without its own.
    #[serde(default)]
    pub default_key: RateLimits,
    /// Limits of every tenant without its own.
    #[serde(default)]
    pub default_tenant: RateLimits,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            backend: Backend::Memory,
            redis_url: None,
            on_backend_error: FailureMode::Open,
            redis_timeout_ms: default_redis_timeout_ms(),
            default_key: RateLimits::default(),
            default_tenant: RateLimits::default(),
        }
    }
}

fn default_redis_timeout_ms() -> u64 {
    200
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default)]
    pub backend: Backend,
    #[serde(default)]
    pub redis_url: Option<String>,
    #[serde(default = "default_cache_ttl")]
    pub ttl_secs: u64,
    /// Entries held by the in-memory cache (least recently used evicted first).
    #[serde(default = "default_cache_entries")]
    pub max_entries: usize,
    /// Responses larger than this are not cached.
    #[serde(default = "default_cache_entry_bytes")]
    pub max_entry_bytes: usize,
    /// The semantic cache ([`crate::semantic`]), independent of `enabled` above.
    #[serde(default)]
    pub semantic: crate::semantic::SemanticConfig,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            enabled: false,
            backend: Backend::Memory,
            redis_url: None,
            ttl_secs: default_cache_ttl(),
            max_entries: default_cache_entries(),
            max_entry_bytes: default_cache_entry_bytes(),
            semantic: crate::semantic::SemanticConfig::default(),
        }
    }
}

fn default_cache_ttl() -> u64 {
    300
}
fn default_cache_entries() -> usize {
    10_000
}
fn default_cache_entry_bytes() -> usize {
    1 << 20
}

impl Config {
    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let config: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            serde_yaml::from_str(text)?
        };
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_yaml(&text)
    }

    /// Checks every cross-reference and range; the first fault found is the error.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let upstreams = self.validate_upstreams()?;
        let names = self.validate_model_names()?;
        for m in &self.models {
            match &m.cascade {
                Some(c) => self.validate_cascade(m, c)?,
                None => validate_model(m, &upstreams, &names)?,
            }
        }
        self.validate_tenants(&names)?;
        self.validate_backends()?;
        self.validate_caches(&names)?;
        for p in &self.guardrails.patterns {
            crate::guardrails::validate_rule(p).map_err(invalid)?;
        }
        for c in &self.guardrails.classifiers {
            c.validate(|m| names.contains(m)).map_err(invalid)?;
        }
        self.server.validate()?;
        if let Some(j) = &self.auth.jwt {
            j.validate().map_err(invalid)?;
        }
        self.validate_metrics()?;
        Ok(())
    }

    fn validate_metrics(&self) -> Result<(), ConfigError> {
        let m = &self.metrics;
        if m.key.is_some() && m.key_env.is_some() {
            return Err(invalid("metrics: give key or key_env, not both"));
        }
        if m.key.as_deref().is_some_and(|k| k.len() < 16) {
            return Err(invalid("metrics.key must be at least 16 characters"));
        }
        if let Some(addr) = &m.listen {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(invalid(format!(
                    "metrics.listen `{addr}` is not an address (host:port, e.g. 127.0.0.1:9464)"
                )));
            }
        }
        Ok(())
    }

    /// Upstream names are unique and each upstream is well formed: the names.
    fn validate_upstreams(&self) -> Result<HashSet<&str>, ConfigError> {
        let mut upstreams = HashSet::new();
        for u in &self.upstreams {
            if u.name.is_empty() {
                return Err(invalid("an upstream has an empty name"));
            }
            if !upstreams.insert(u.name.as_str()) {
                return Err(invalid(format!("upstream `{}` declared twice", u.name)));
            }
            if u.kind == UpstreamKind::Router {
                validate_router_upstream(u)?;
                continue;
            }
            if !u.endpoints.is_empty() || u.config.is_some() || u.router.is_some() {
                return Err(invalid(format!(
                    "upstream `{}`: `endpoints`, `config` and `router` need `kind: router`",
                    u.name
                )));
            }
            provider::validate_provider_upstream(u)?;
            let url = u.base_url().trim_end_matches('/');
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(invalid(format!(
                    "upstream `{}`: base_url must start with http:// or https://",
                    u.name
                )));
            }
            if u.ca_file.is_some() && !url.starts_with("https://") {
                return Err(invalid(format!(
                    "upstream `{}`: `ca_file` needs an https:// base_url",
                    u.name
                )));
            }
        }
        Ok(upstreams)
    }

    /// Model names and aliases are unique and not empty: all of them.
    fn validate_model_names(&self) -> Result<HashSet<&str>, ConfigError> {
        let mut names = HashSet::new();
        for m in &self.models {
            for name in std::iter::once(&m.name).chain(&m.aliases) {
                if name.is_empty() {
                    return Err(invalid("a model has an empty name or alias"));
                }
                if !names.insert(name.as_str()) {
                    return Err(invalid(format!("model name `{name}` declared twice")));
                }
            }
        }
        Ok(names)
    }

    /// A cascade model: no targets of its own, a valid policy, and members that are
    /// declared models and not cascades themselves.
    fn validate_cascade(
        &self,
        m: &ModelConfig,
        c: &crate::cascade::CascadeConfig,
    ) -> Result<(), ConfigError> {
        if !m.targets.is_empty() || !m.fallbacks.is_empty() {
            return Err(invalid(format!(
                "model `{}`: a cascade has no targets or fallbacks of its own",
                m.name
            )));
        }
        crate::cascade::CascadePolicy::new(c)
            .map_err(|e| invalid(format!("model `{}`: {e}", m.name)))?;
        for member in &c.models {
            let found = self
                .models
                .iter()
                .find(|o| &o.name == member || o.aliases.contains(member));
            match found {
                None => {
                    return Err(invalid(format!(
                        "model `{}`: unknown cascade model `{member}`",
                        m.name
                    )))
                }
                Some(o) if o.cascade.is_some() => {
                    return Err(invalid(format!(
                        "model `{}`: cascade model `{member}` is itself a cascade",
                        m.name
                    )))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    fn validate_tenants(&self, names: &HashSet<&str>) -> Result<(), ConfigError> {
        let mut tenants = HashSet::new();
        for t in &self.tenants {
            if t.name.is_empty() || !tenants.insert(t.name.as_str()) {
                return Err(invalid(format!(
                    "tenant `{}` empty or declared twice",
                    t.name
                )));
            }
            for b in [t.budget_usd, t.user_budget_usd].into_iter().flatten() {
                if !(b.is_finite() && b >= 0.0) {
                    return Err(invalid(format!("tenant `{}`: budget must be >= 0", t.name)));
                }
            }
            if t.budget_period.is_some() && t.budget_usd.is_none() {
                return Err(invalid(format!(
                    "tenant `{}`: budget_period without budget_usd",
                    t.name
                )));
            }
            if t.user_budget_period.is_some() && t.user_budget_usd.is_none() {
                return Err(invalid(format!(
                    "tenant `{}`: user_budget_period without user_budget_usd",
                    t.name
                )));
            }
            for m in &t.allowed_models {
                if !names.contains(m.as_str()) {
                    return Err(invalid(format!("tenant `{}`: unknown model `{m}`", t.name)));
                }
            }
        }
        Ok(())
    }

    /// A shared backend that is chosen has its address.
    fn validate_backends(&self) -> Result<(), ConfigError> {
        if self.limits.backend == Backend::Redis && self.limits.redis_url.is_none() {
            return Err(invalid(
                "limits.backend is redis but limits.redis_url is unset",
            ));
        }
        if self.cache.backend == Backend::Redis && self.cache.redis_url.is_none() {
            return Err(invalid(
                "cache.backend is redis but cache.redis_url is unset",
            ));
        }
        if self.store.backend == StoreBackend::Postgres
            && self.store.url.as_deref().is_none_or(str::is_empty)
        {
            return Err(invalid("store.backend is postgres but store.url is unset"));
        }
        if self.store.timeout_ms == 0 {
            return Err(invalid("store.timeout_ms must be > 0"));
        }
        Ok(())
    }

    fn validate_caches(&self, names: &HashSet<&str>) -> Result<(), ConfigError> {
        let sem = &self.cache.semantic;
        if sem.enabled {
            if !names.contains(sem.embedding_model.as_str()) {
                return Err(invalid(format!(
                    "cache.semantic.embedding_model `{}` is not a model",
                    sem.embedding_model
                )));
            }
            if !(sem.threshold > 0.0 && sem.threshold <= 1.0) {
                return Err(invalid("cache.semantic.threshold must be in (0, 1]"));
            }
            if sem.max_entries == 0 || sem.max_messages == 0 {
                return Err(invalid(
                    "cache.semantic.max_entries and max_messages must be > 0",
                ));
            }
            if sem.redis_url.as_deref() == Some("") || sem.redis_stream.is_empty() {
                return Err(invalid(
                    "cache.semantic.redis_url and redis_stream must not be empty",
                ));
            }
        }
        if self.cache.enabled && self.cache.max_entries == 0 {
            return Err(invalid("cache.max_entries must be > 0"));
        }
        Ok(())
    }
}

/// A model with targets: they name declared upstreams with some weight, its fallbacks
/// declared models, and its timeouts, prices and retries are in range.
fn validate_model(
    m: &ModelConfig,
    upstreams: &HashSet<&str>,
    names: &HashSet<&str>,
) -> Result<(), ConfigError> {
    if m.targets.is_empty() {
        return Err(invalid(format!("model `{}` has no targets", m.name)));
    }
    if m.targets.iter().all(|t| t.weight == 0) {
        return Err(invalid(format!(
            "model `{}`: at least one target needs a weight above 0",
            m.name
        )));
    }
    for t in &m.targets {
        if !upstreams.contains(t.upstream.as_str()) {
            return Err(invalid(format!(
                "model `{}`: unknown upstream `{}`",
                m.name, t.upstream
            )));
        }
    }
    for f in &m.fallbacks {
        if !names.contains(f.as_str()) {
            return Err(invalid(format!(
                "model `{}`: unknown fallback `{f}`",
                m.name
            )));
        }
    }
    if m.try_timeout_ms == 0 || m.timeout_ms == 0 {
        return Err(invalid(format!("model `{}`: timeouts must be > 0", m.name)));
    }
    let price_ok = |p: f64| p.is_finite() && p >= 0.0;
    if !(price_ok(m.price.input_per_1m) && price_ok(m.price.output_per_1m)) {
        return Err(invalid(format!(
            "model `{}`: prices must be finite and >= 0",
            m.name
        )));
    }
    if m.retries > 10 {
        return Err(invalid(format!("model `{}`: retries above 10", m.name)));
    }
    Ok(())
}

/// Paths of the forwarded routes, in [`crate::proxy::Route`] order.
pub const ROUTE_PATHS: [&str; 18] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/score",
    "/v1/score",
    "/pooling",
    "/classify",
    "/v1/chat/completions/batch",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
];

/// Per-try and total timeouts of a model.
pub fn timeouts(m: &ModelConfig) -> (Duration, Duration) {
    (
        Duration::from_millis(m.try_timeout_ms),
        Duration::from_millis(m.timeout_ms),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
upstreams:
  - name: local
    base_url: http://127.0.0.1:8000
models:
  - name: small
    aliases: [gpt-4o-mini]
    targets:
      - {upstream: local, model: smollm2, weight: 3}
    fallbacks: []
    price: {input_per_1m: 0.5, output_per_1m: 1.5}
    context_length: 8192
tenants:
  - name: team-a
    limits: {rpm: 60, tpm: 1000}
    budget_usd: 10
"#;

    #[test]
    fn parses_and_resolves_aliases() {
        let r = Resolved::new(Config::from_yaml(GOOD).unwrap()).unwrap();
        assert_eq!(r.model("gpt-4o-mini").unwrap().name, "small");
        assert_eq!(r.model_names(), vec!["gpt-4o-mini", "small"]);
        assert_eq!(r.tenants["team-a"].limits.rpm, Some(60));
    }

    #[test]
    fn empty_file_is_an_empty_config() {
        let c = Config::from_yaml("").unwrap();
        assert!(c.models.is_empty());
    }

    #[test]
    fn rejects_dangling_references_and_unknown_fields() {
        let bad_upstream = GOOD.replace("upstream: local", "upstream: nowhere");
        assert!(Config::from_yaml(&bad_upstream).is_err());
        let bad_fallback = GOOD.replace("fallbacks: []", "fallbacks: [nope]");
        assert!(Config::from_yaml(&bad_fallback).is_err());
        let typo = GOOD.replace("context_length", "context_lenght");
        assert!(Config::from_yaml(&typo).is_err());
        let dup = GOOD.replace("aliases: [gpt-4o-mini]", "aliases: [small]");
        assert!(Config::from_yaml(&dup).is_err());
        let neg = GOOD.replace("input_per_1m: 0.5", "input_per_1m: -1");
        assert!(Config::from_yaml(&neg).is_err());
    }

    #[test]
    fn cost_is_micro_dollars() {
        let p = Price {
            input_per_1m: 0.5,
            output_per_1m: 1.5,
        };
        assert_eq!(p.cost_micros(1_000_000, 0), 500_000);
        assert_eq!(p.cost_micros(10, 10), 20);
    }

    #[test]
    fn reload_keeps_old_config_when_new_is_invalid() {
        let dir = std::env::temp_dir().join(format!("strata-gw-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gateway.yaml");
        std::fs::write(&path, GOOD).unwrap();
        let handle = ConfigHandle::open(Some(&path)).unwrap();
        assert!(handle.get().model("small").is_some());
        std::fs::write(&path, "models: [ {name: x} ]").unwrap();
        assert!(handle.reload().is_err());
        assert!(handle.get().model("small").is_some(), "old config kept");
        std::fs::write(&path, GOOD.replace("name: small", "name: big")).unwrap();
        handle.reload().unwrap();
        assert!(handle.get().model("big").is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
