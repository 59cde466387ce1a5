//! `router.yaml`: every knob, each with a default that serves on one machine.
//!
//! ```yaml
//! scrape_interval_ms: 50        # /metrics per endpoint
//! scrape_timeout_ms: 500
//! health_interval_ms: 500       # /health per endpoint (readiness gating)
//! stale_after_ms: 200           # older metrics are not trusted and count as saturated
//! max_retries: 2                # other endpoints tried before the first byte
//! connect_timeout_ms: 1000
//! max_body_bytes: 8388608
//! session_header: x-session-id
//! saturation: {queue_threshold: 5, kv_threshold: 0.8}
//! admission: {max_queue: 1024, queue_timeout_ms: 10000, objectives: {batch: -1, chat: 10}}
//! flow_control: {flow_headers: [x-gateway-inference-fairness-id], flows: {gold: {weight: 3}}}
//! circuit: {failures: 5, open_ms: 5000}
//! precise: {block_size: 16, hash_seed: vllm-none-hash, tokenize_timeout_ms: 200, tokenize_cache: 4096}
//! approx: {block_size_tokens: 16, capacity_per_endpoint: 65536, max_blocks: 512}
//! pd: {prefill_timeout_ms: 15000, trust_client_kv_transfer: false}   # P/D phase 1; see below
//! scheduling: { ...EndpointPickerConfig... }   # default: PROTOCOLS §6
//! endpoints: [ ...same as an endpoints file... ]
//! api_key: KEY                  # callers send `Authorization: Bearer KEY` (or --api-key)
//! engine_api_key: KEY           # sent to engines instead of the caller's header
//! upstream_tls: {ca: ca.pem, cert: router.pem, key: router.key}   # https:// endpoints
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::circuit::CircuitConfig;
use crate::endpoint::{EndpointError, EndpointSpec, EngineKind};
use crate::prefix::approx::ApproxConfig;
use crate::prefix::hashing::DEFAULT_HASH_SEED;
use crate::scheduling::saturation::SaturationConfig;
use crate::scheduling::EndpointPickerConfig;

/// The `pool` label of flow control's series when neither router.yaml nor `--pool-name`
/// names one.
pub const DEFAULT_FLOW_POOL: &str = "default";

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    pub scrape_interval_ms: u64,
    pub scrape_timeout_ms: u64,
    pub health_interval_ms: u64,
    pub stale_after_ms: u64,
    pub max_retries: usize,
    pub connect_timeout_ms: u64,
    pub max_body_bytes: usize,
    pub session_header: String,
    pub saturation: SaturationSection,
    pub admission: AdmissionSection,
    pub circuit: CircuitSection,
    pub precise: PreciseSection,
    pub approx: Option<ApproxSection>,
    pub pd: PdSection,
    pub scheduling: Option<EndpointPickerConfig>,
    /// Flow control: bands, flows, bounds and time to live of waiting requests.
    pub flow_control: FlowControlSection,
    pub endpoints: Vec<EndpointSpec>,
    /// Engine kind for endpoints given without one.
    pub default_kind: EngineKind,
    /// Key callers must send as `Authorization: Bearer <key>` on every route but
    /// `/health` and `/metrics`; `None` serves anyone.
    pub api_key: Option<String>,
    /// Key the router sends engines as `Authorization: Bearer <key>`, in place of the
    /// caller's header (`strata engine --api-key`).
    pub engine_api_key: Option<String>,
    /// How `https://` endpoints are verified, and the certificate shown to them.
    pub upstream_tls: crate::client::UpstreamTls,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SaturationSection {
    pub queue_threshold: f64,
    pub kv_threshold: f64,
    /// For an endpoint whose load is unknown (it has never served readable `/metrics`):
    /// requests in flight from this router at or above which it counts as saturated.
    pub unknown_load_max_in_flight: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionSection {
    /// Requests allowed to wait for capacity at once; more get 503.
    pub max_queue: usize,
    /// How long one waits before it is sent anyway.
    pub queue_timeout_ms: u64,
    /// `x-gateway-inference-objective` names → priority.
    pub objectives: BTreeMap<String, i32>,
    /// Model (or adapter) name → objective name, for requests that name no objective.
    pub model_objectives: BTreeMap<String, String>,
}

/// `flow_control`: how waiting requests are ordered, shared and bounded
/// ([`crate::scheduling::flow`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowControlSection {
    /// Request headers naming a request's flow (its fairness id), the first present
    /// wins; a request with none shares the flow `""`.
    pub flow_headers: Vec<String>,
    /// Header carrying the request's own deadline in milliseconds (Envoy's expected
    /// timeout); its time to live when shorter than the default.
    pub deadline_header: Option<String>,
    /// Time to live of a waiting request (default: `admission.queue_timeout_ms`).
    pub default_ttl_ms: Option<u64>,
    /// Requests waiting at once, over every band (default: `admission.max_queue`).
    pub max_requests: Option<usize>,
    /// Bytes of waiting request bodies at once, over every band.
    pub max_bytes: Option<u64>,
    /// Per band, unless `bands` names it.
    pub band_max_requests: Option<usize>,
    pub band_max_bytes: Option<u64>,
    /// Per-band bounds by priority.
    pub bands: BTreeMap<i32, FlowBoundsSection>,
    /// Per-flow settings by fairness id.
    pub flows: BTreeMap<String, FlowSection>,
    /// The pool's name on the held-requests gauge.
    pub pool: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowBoundsSection {
    pub max_requests: Option<usize>,
    pub max_bytes: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSection {
    /// Requests served per round-robin turn (at least 1).
    pub weight: u32,
}

impl Default for FlowControlSection {
    fn default() -> Self {
        FlowControlSection {
            flow_headers: vec![crate::headers::FAIRNESS_ID.to_string()],
            deadline_header: Some(crate::headers::ENVOY_TIMEOUT.to_string()),
            default_ttl_ms: None,
            max_requests: None,
            max_bytes: Some(1 << 30),
            band_max_requests: None,
            band_max_bytes: None,
            bands: BTreeMap::new(),
            flows: BTreeMap::new(),
            pool: DEFAULT_FLOW_POOL.into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CircuitSection {
    pub failures: u32,
    pub open_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreciseSection {
    pub block_size: usize,
    pub hash_seed: String,
    pub tokenize_timeout_ms: u64,
    pub tokenize_cache: usize,
    /// Bound on one KV-event replay (connect, ask, receive every batch); past it the
    /// gap counts as unfillable and the endpoint's precise entries are dropped.
    pub replay_timeout_ms: u64,
}

/// Prefill/decode disaggregation (the profile pair is in `scheduling`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PdSection {
    /// Bound on phase 1 (the prefill engine computing the prompt and answering); past it
    /// the decode pick computes the prompt itself.
    pub prefill_timeout_ms: u64,
    /// Pass a client's `kv_transfer_params` that name a peer (`remote_host` or
    /// `remote_port`) to the engine as sent. Off (the default), such a member is replaced
    /// by `null`, so no client can make an engine connect to a host it names; turn it on
    /// only when every caller is a trusted proxy running the P/D protocol itself.
    pub trust_client_kv_transfer: bool,
}

impl Default for PdSection {
    fn default() -> Self {
        PdSection {
            prefill_timeout_ms: 15_000,
            trust_client_kv_transfer: false,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApproxSection {
    pub block_size_tokens: Option<usize>,
    pub capacity_per_endpoint: Option<usize>,
    pub max_blocks: Option<usize>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            scrape_interval_ms: 50,
            scrape_timeout_ms: 500,
            health_interval_ms: 500,
            stale_after_ms: 200,
            max_retries: 2,
            connect_timeout_ms: 1000,
            max_body_bytes: 8 << 20,
            session_header: "x-session-id".into(),
            saturation: SaturationSection::default(),
            admission: AdmissionSection::default(),
            circuit: CircuitSection::default(),
            precise: PreciseSection::default(),
            approx: None,
            pd: PdSection::default(),
            scheduling: None,
            flow_control: FlowControlSection::default(),
            endpoints: Vec::new(),
            default_kind: EngineKind::Vllm,
            api_key: None,
            engine_api_key: None,
            upstream_tls: crate::client::UpstreamTls::default(),
        }
    }
}

impl Default for SaturationSection {
    fn default() -> Self {
        let d = SaturationConfig::default();
        SaturationSection {
            queue_threshold: d.queue_threshold,
            kv_threshold: d.kv_threshold,
            unknown_load_max_in_flight: d.unknown_load_max_in_flight,
        }
    }
}

impl Default for AdmissionSection {
    fn default() -> Self {
        AdmissionSection {
            max_queue: 1024,
            queue_timeout_ms: 10_000,
            objectives: BTreeMap::new(),
            model_objectives: BTreeMap::new(),
        }
    }
}

impl Default for CircuitSection {
    fn default() -> Self {
        let d = CircuitConfig::default();
        CircuitSection {
            failures: d.failures,
            open_ms: d.open_for.as_millis() as u64,
        }
    }
}

impl Default for PreciseSection {
    fn default() -> Self {
        PreciseSection {
            block_size: 16,
            hash_seed: DEFAULT_HASH_SEED.into(),
            tokenize_timeout_ms: 200,
            tokenize_cache: 4096,
            replay_timeout_ms: 1000,
        }
    }
}

/// Problems with `router.yaml`.
#[derive(Debug, thiserror::Error)]
pub enum RouterConfigError {
    #[error("router config does not parse: {0}")]
    Parse(String),
    #[error("router config: {0}")]
    Invalid(String),
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Scheduling(#[from] crate::scheduling::ConfigError),
    #[error(transparent)]
    Client(#[from] crate::client::ClientError),
}

impl RouterConfig {
    pub fn from_yaml(text: &str) -> Result<Self, RouterConfigError> {
        let mut cfg: RouterConfig =
            serde_yaml::from_str(text).map_err(|e| RouterConfigError::Parse(e.to_string()))?;
        cfg.endpoints = std::mem::take(&mut cfg.endpoints)
            .into_iter()
            .map(EndpointSpec::normalized)
            .collect::<Result<_, _>>()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges and that the scheduling config builds.
    pub fn validate(&self) -> Result<(), RouterConfigError> {
        if self.scrape_interval_ms == 0
            || self.health_interval_ms == 0
            || self.scrape_timeout_ms == 0
        {
            return Err(RouterConfigError::Invalid(
                "intervals and timeouts must be at least 1 ms".into(),
            ));
        }
        if self.precise.block_size == 0 {
            return Err(RouterConfigError::Invalid(
                "precise.block_size must be at least 1".into(),
            ));
        }
        if self.pd.prefill_timeout_ms == 0 {
            return Err(RouterConfigError::Invalid(
                "pd.prefill_timeout_ms must be at least 1".into(),
            ));
        }
        if self.circuit.failures == 0 {
            return Err(RouterConfigError::Invalid(
                "circuit.failures must be at least 1".into(),
            ));
        }
        self.validate_flow_control()?;
        self.picker_config().build()?;
        self.validate_keys()?;
        Ok(())
    }

    /// Keys are printable ASCII without spaces (they travel in a header), never empty;
    /// a client certificate comes with its key.
    fn validate_keys(&self) -> Result<(), RouterConfigError> {
        for (name, key) in [
            ("api_key", &self.api_key),
            ("engine_api_key", &self.engine_api_key),
        ] {
            if let Some(k) = key {
                if k.is_empty() || !k.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(RouterConfigError::Invalid(format!(
                        "{name} must be non-empty printable ASCII without spaces"
                    )));
                }
            }
        }
        self.upstream_tls.identity()?;
        Ok(())
    }

    fn validate_flow_control(&self) -> Result<(), RouterConfigError> {
        let f = &self.flow_control;
        let bad = |m: String| Err(RouterConfigError::Invalid(format!("flow_control: {m}")));
        // A pool whose room is never above 0 would dispatch nothing, ever.
        let q = self.saturation.queue_threshold;
        if q.is_nan() || q <= 0.0 || self.saturation.unknown_load_max_in_flight == 0 {
            return Err(RouterConfigError::Invalid(
                "saturation.queue_threshold and unknown_load_max_in_flight must be above 0: \
                 flow control dispatches only while an endpoint has room"
                    .into(),
            ));
        }
        if f.default_ttl_ms == Some(0) {
            return bad("default_ttl_ms must be at least 1".into());
        }
        if let Some((name, _)) = f.flows.iter().find(|(_, s)| s.weight == 0) {
            return bad(format!("flow `{name}` has weight 0; weights start at 1"));
        }
        let headers = f.flow_headers.iter().chain(&f.deadline_header);
        if let Some(h) = headers
            .into_iter()
            .find(|h| axum::http::HeaderName::from_bytes(h.as_bytes()).is_err())
        {
            return bad(format!("`{h}` is not a header name"));
        }
        for (model, objective) in &self.admission.model_objectives {
            if !self.admission.objectives.contains_key(objective)
                && objective.parse::<i32>().is_err()
            {
                return Err(RouterConfigError::Invalid(format!(
                    "admission.model_objectives: model `{model}` names objective `{objective}`, which admission.objectives does not define"
                )));
            }
        }
        Ok(())
    }

    /// The flow controller's settings: `flow_control` over `admission`'s queue bounds.
    pub fn flow_config(&self) -> crate::scheduling::flow::FlowConfig {
        use crate::scheduling::flow::{FlowConfig, Limits};
        let f = &self.flow_control;
        FlowConfig {
            total: Limits {
                max_requests: Some(f.max_requests.unwrap_or(self.admission.max_queue)),
                max_bytes: f.max_bytes,
            },
            per_band: Limits {
                max_requests: f.band_max_requests,
                max_bytes: f.band_max_bytes,
            },
            bands: f
                .bands
                .iter()
                .map(|(p, b)| {
                    let l = Limits {
                        max_requests: b.max_requests,
                        max_bytes: b.max_bytes,
                    };
                    (*p, l)
                })
                .collect(),
            default_ttl: Duration::from_millis(
                f.default_ttl_ms
                    .unwrap_or(self.admission.queue_timeout_ms)
                    .max(1),
            ),
            weights: f.flows.iter().map(|(k, s)| (k.clone(), s.weight)).collect(),
        }
    }

    pub fn picker_config(&self) -> EndpointPickerConfig {
        self.scheduling
            .clone()
            .unwrap_or_else(EndpointPickerConfig::default_config)
    }

    /// Bound on one KV-event replay.
    pub fn kv_replay_timeout(&self) -> Duration {
        Duration::from_millis(self.precise.replay_timeout_ms.max(1))
    }

    /// Bound on phase 1 of a disaggregated request.
    pub fn prefill_timeout(&self) -> Duration {
        Duration::from_millis(self.pd.prefill_timeout_ms.max(1))
    }

    pub fn stale_after(&self) -> Duration {
        Duration::from_millis(self.stale_after_ms)
    }

    pub fn saturation_config(&self) -> SaturationConfig {
        SaturationConfig {
            queue_threshold: self.saturation.queue_threshold,
            kv_threshold: self.saturation.kv_threshold,
            stale_after: self.stale_after(),
            unknown_load_max_in_flight: self.saturation.unknown_load_max_in_flight,
        }
    }

    pub fn circuit_config(&self) -> CircuitConfig {
        CircuitConfig {
            failures: self.circuit.failures,
            open_for: Duration::from_millis(self.circuit.open_ms),
        }
    }

    /// Approximate-index settings: this file's `approx` section over the scheduling
    /// config's prefix-plugin parameters.
    pub fn approx_config(&self) -> ApproxConfig {
        let mut c = self.picker_config().approx_config();
        if let Some(a) = &self.approx {
            c.block_size_tokens = a.block_size_tokens.unwrap_or(c.block_size_tokens).max(1);
            c.capacity_per_endpoint = a
                .capacity_per_endpoint
                .unwrap_or(c.capacity_per_endpoint)
                .max(1);
            c.max_blocks = a.max_blocks.unwrap_or(c.max_blocks);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let c = RouterConfig::from_yaml("{}").unwrap();
        assert_eq!(c.scrape_interval_ms, 50);
        assert_eq!(c.picker_config(), EndpointPickerConfig::default_config());
        let y = "scrape_interval_ms: 10\nadmission: {objectives: {batch: -1}}\nendpoints: [{url: 'a:1', kind: sglang}]\nscheduling:\n  plugins: [{type: random-scorer}]\n  schedulingProfiles: [{name: r, plugins: [{pluginRef: random-scorer}]}]\napprox: {max_blocks: 3}\n";
        let c = RouterConfig::from_yaml(y).unwrap();
        assert_eq!(c.scrape_interval_ms, 10);
        assert_eq!(c.admission.objectives["batch"], -1);
        assert_eq!(c.endpoints[0].url, "http://a:1");
        assert_eq!(c.approx_config().max_blocks, 3);
    }

    #[test]
    fn flow_control_section() {
        // Defaults: admission's bounds, the fairness header, Envoy's deadline.
        let c =
            RouterConfig::from_yaml("admission: {max_queue: 7, queue_timeout_ms: 900}").unwrap();
        let f = c.flow_config();
        assert_eq!(f.total.max_requests, Some(7));
        assert_eq!(f.default_ttl, Duration::from_millis(900));
        assert_eq!(
            c.flow_control.flow_headers,
            ["x-gateway-inference-fairness-id"]
        );
        let y = "admission: {objectives: {chat: 10}, model_objectives: {m: chat}}\nflow_control:\n  flow_headers: [x-tenant]\n  default_ttl_ms: 250\n  max_requests: 9\n  max_bytes: 4096\n  band_max_requests: 3\n  bands: {10: {max_bytes: 100}}\n  flows: {gold: {weight: 3}}\n  pool: chat-pool\n";
        let c = RouterConfig::from_yaml(y).unwrap();
        let f = c.flow_config();
        assert_eq!(f.total.max_requests, Some(9));
        assert_eq!(f.total.max_bytes, Some(4096));
        assert_eq!(f.default_ttl, Duration::from_millis(250));
        assert_eq!(f.band_limits(0).max_requests, Some(3));
        assert_eq!(f.band_limits(10).max_bytes, Some(100));
        assert_eq!(f.band_limits(10).max_requests, None);
        assert_eq!((f.weight("gold"), f.weight("other")), (3, 1));
        assert_eq!(c.flow_control.pool, "chat-pool");
        assert_eq!(c.admission.model_objectives["m"], "chat");
    }

    #[test]
    fn keys_and_upstream_tls() {
        let c = RouterConfig::from_yaml("{}").unwrap();
        assert_eq!((c.api_key, c.engine_api_key), (None, None));
        let y = "api_key: sk-router\nengine_api_key: sk-engine\nupstream_tls: {ca: /etc/ca.pem, cert: r.pem, key: r.key}\nendpoints: [{url: 'https://engine.internal:8443'}]\n";
        let c = RouterConfig::from_yaml(y).unwrap();
        assert_eq!(c.api_key.as_deref(), Some("sk-router"));
        assert_eq!(c.engine_api_key.as_deref(), Some("sk-engine"));
        assert_eq!(
            c.upstream_tls.ca.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        assert!(c.upstream_tls.identity().unwrap().is_some());
        assert_eq!(c.endpoints[0].url, "https://engine.internal:8443");
    }

    #[test]
    fn bad_files_are_errors() {
        for y in [
            "bogus: 1",
            "scrape_interval_ms: 0",
            "endpoints: [{url: 'ftp://x:1'}]",
            "scheduling: {plugins: [{type: nope}], schedulingProfiles: []}",
            "circuit: {failures: 0}",
            "pd: {prefill_timeout_ms: 0}",
            "pd: {timeout: 1}",
            "api_key: ''",
            "engine_api_key: 'two words'",
            "upstream_tls: {cert: a.pem}",
            "upstream_tls: {bogus: 1}",
            "flow_control: {flows: {a: {weight: 0}}}",
            "flow_control: {default_ttl_ms: 0}",
            "saturation: {queue_threshold: 0}",
            "saturation: {unknown_load_max_in_flight: 0}",
            "flow_control: {flow_headers: ['bad header']}",
            "flow_control: {bogus: 1}",
            "admission: {model_objectives: {m: nope}}",
            "- 1",
        ] {
            assert!(RouterConfig::from_yaml(y).is_err(), "{y}");
        }
    }
}
