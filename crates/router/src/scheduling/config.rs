//! Scheduling configuration in the shape of llm-d's `EndpointPickerConfig`:
//!
//! ```yaml
//! apiVersion: inference.networking.x-k8s.io/v1alpha1
//! kind: EndpointPickerConfig
//! plugins:
//!   - type: queue-scorer
//!   - type: kv-cache-utilization-scorer
//!   - type: prefix-cache-scorer
//!     parameters: {blockSize: 16, lruCapacityPerServer: 65536}
//!   - type: max-score-picker
//! schedulingProfiles:
//!   - name: default
//!     plugins:
//!       - pluginRef: queue-scorer
//!         weight: 2
//!       - pluginRef: kv-cache-utilization-scorer
//!         weight: 2
//!       - pluginRef: prefix-cache-scorer
//!         weight: 3
//!       - pluginRef: max-score-picker
//! ```
//!
//! Prefill/decode disaggregation ([`super::pd`]) is llm-d's profile pair: a
//! `pd-profile-handler` (parameters `decodeProfile`, `prefillProfile`, default `decode` and
//! `prefill`; `deciderPluginName`, default `prefix-based-pd-decider`; llm-d's older inline
//! `threshold` too) over two profiles, and the decider's `nonCachedTokens` (0, llm-d's
//! default, splits every request). `decode-filter` keeps role `decode`, `both` or
//! unlabelled; `prefill-filter` only role `prefill`. [`EndpointPickerConfig::pd`] builds:
//!
//! ```yaml
//! plugins:
//!   - type: decode-filter
//!   - type: prefill-filter
//!   - type: queue-scorer
//!   - type: kv-cache-utilization-scorer
//!   - type: prefix-cache-scorer
//!   - type: max-score-picker
//!   - type: prefix-based-pd-decider
//!     parameters: {nonCachedTokens: 256}
//!   - type: pd-profile-handler
//! schedulingProfiles:
//!   - name: decode
//!     plugins: [{pluginRef: decode-filter}, {pluginRef: queue-scorer, weight: 2},
//!               {pluginRef: kv-cache-utilization-scorer, weight: 2},
//!               {pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: max-score-picker}]
//!   - name: prefill
//!     plugins: [{pluginRef: prefill-filter}, ...the same scorers...]
//! ```
//!
//! A plugin's `name` defaults to its `type`. In a profile, filters run in the order
//! listed, scorers are summed with their `weight` (default 1), and the last picker listed
//! picks (default `max-score-picker`). Unknown types, unknown references and bad
//! parameters are errors at load time, never at request time.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::filters::{LoraAffinityFilter, LowQueueFilter, RoleFilter, StrictRoleFilter};
use super::params::{parse, BadParameters, PrefixParams, ThresholdParams};
use super::pd::{PdDecider, PdHandler, PD_PROFILE_HANDLER, PREFIX_PD_DECIDER};
use super::pickers::{MaxScore, RandomPicker, WeightedRandom};
use super::scorers;
use super::{EndpointPicker, Filter, Picker, Profile, Scorer};
use crate::prefix::approx::ApproxConfig;

/// The YAML document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointPickerConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub plugins: Vec<PluginSpec>,
    pub scheduling_profiles: Vec<ProfileSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSpec {
    pub name: String,
    pub plugins: Vec<PluginRef>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PluginRef {
    pub plugin_ref: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// Problems in a scheduling configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("scheduling config does not parse: {0}")]
    Parse(String),
    #[error("unknown plugin type `{0}`")]
    UnknownType(String),
    #[error("plugin `{0}` is defined twice")]
    DuplicatePlugin(String),
    #[error("profile `{profile}` refers to unknown plugin `{name}`")]
    UnknownRef { profile: String, name: String },
    #[error("plugin `{name}`: bad parameters: {message}")]
    Parameters { name: String, message: String },
    #[error("profile `{0}`: weights must be finite and non-negative")]
    Weight(String),
    #[error("at least one scheduling profile is needed")]
    NoProfile,
    #[error("`{handler}` names profile `{name}`, which is not defined")]
    UnknownProfile { handler: String, name: String },
    #[error("plugin `{0}` is a profile handler or decider, not a filter, scorer or picker")]
    NotInProfile(String),
    #[error("only one profile handler may be configured")]
    TwoHandlers,
}

/// A built plugin.
#[derive(Debug, Clone)]
pub enum Plugin {
    Filter(Arc<dyn Filter>),
    Scorer(Arc<dyn Scorer>),
    Picker(Arc<dyn Picker>),
    /// Decides whether a request is disaggregated.
    Decider(PdDecider),
    /// Runs the prefill/decode profile pair.
    ProfileHandler(PdHandlerParams),
}

/// `pd-profile-handler`'s parameters (llm-d's names; `threshold` is its older handler's
/// inline decider threshold).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PdHandlerParams {
    #[serde(default = "default_decode")]
    pub decode_profile: String,
    #[serde(default = "default_prefill")]
    pub prefill_profile: String,
    /// The decider plugin (default `prefix-based-pd-decider`).
    #[serde(default)]
    pub decider_plugin_name: Option<String>,
    /// Non-cached prompt tokens that trigger disaggregation, when no decider plugin is
    /// configured.
    #[serde(default)]
    pub threshold: Option<u32>,
    /// Accepted for llm-d compatibility; the router hashes with each endpoint's own block
    /// size.
    #[serde(default)]
    pub hash_block_size: Option<u32>,
    /// Accepted for llm-d compatibility (data-parallel ranks); unused here.
    #[serde(default)]
    pub primary_port: Option<u16>,
    /// Accepted for llm-d compatibility: the prefix index the decider reads is the one the
    /// profiles score with.
    #[serde(default)]
    pub prefix_plugin_type: Option<String>,
    #[serde(default)]
    pub prefix_plugin_name: Option<String>,
}

impl Default for PdHandlerParams {
    fn default() -> Self {
        PdHandlerParams {
            decode_profile: default_decode(),
            prefill_profile: default_prefill(),
            decider_plugin_name: None,
            threshold: None,
            hash_block_size: None,
            primary_port: None,
            prefix_plugin_type: None,
            prefix_plugin_name: None,
        }
    }
}

fn default_decode() -> String {
    "decode".into()
}

fn default_prefill() -> String {
    "prefill".into()
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DeciderParams {
    non_cached_tokens: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RoleParams {
    role: String,
}

fn params<T: for<'de> Deserialize<'de> + Default>(
    spec: &PluginSpec,
    name: &str,
) -> Result<T, ConfigError> {
    parse(spec.parameters.as_ref()).map_err(|e| bad_parameters(name, e))
}

/// The plugin `name`'s parameters do not fit.
fn bad_parameters(name: &str, e: BadParameters) -> ConfigError {
    ConfigError::Parameters {
        name: name.to_string(),
        message: e.0,
    }
}

/// Builds one plugin from its spec: the registry of plugin types (the scorers' own is
/// [`scorers::SCORERS`]).
pub fn build_plugin(spec: &PluginSpec) -> Result<Plugin, ConfigError> {
    let name = spec.name.as_deref().unwrap_or(&spec.kind);
    if let Some(build) = scorers::find(&spec.kind) {
        return build(spec.parameters.as_ref())
            .map(Plugin::Scorer)
            .map_err(|e| bad_parameters(name, e));
    }
    Ok(match spec.kind.as_str() {
        "low-queue-filter" => {
            let p: ThresholdParams = params(spec, name)?;
            let threshold = p.threshold.or(p.queue_threshold).unwrap_or(128.0);
            Plugin::Filter(Arc::new(LowQueueFilter { threshold }))
        }
        "lora-affinity-filter" => Plugin::Filter(Arc::new(LoraAffinityFilter)),
        "role-filter" => {
            let p: RoleParams = match &spec.parameters {
                Some(v) => {
                    serde_json::from_value(v.clone()).map_err(|e| ConfigError::Parameters {
                        name: name.into(),
                        message: e.to_string(),
                    })?
                }
                None => {
                    return Err(ConfigError::Parameters {
                        name: name.into(),
                        message: "`role` is required".into(),
                    })
                }
            };
            Plugin::Filter(Arc::new(RoleFilter { role: p.role }))
        }
        // llm-d's role filters: a decoder may be `decode`, `both` or unlabelled; a prefill
        // engine must say `prefill` (an unlabelled replica keeps no blocks for others).
        "decode-filter" => Plugin::Filter(Arc::new(RoleFilter {
            role: "decode".into(),
        })),
        "prefill-filter" => Plugin::Filter(Arc::new(StrictRoleFilter {
            role: "prefill".into(),
        })),
        PREFIX_PD_DECIDER => {
            let p: DeciderParams = params(spec, name)?;
            let n = p.non_cached_tokens.unwrap_or(0);
            let n = u32::try_from(n).map_err(|_| ConfigError::Parameters {
                name: name.into(),
                message: "nonCachedTokens must be 0 or more".into(),
            })?;
            Plugin::Decider(PdDecider {
                non_cached_tokens: n,
            })
        }
        PD_PROFILE_HANDLER => Plugin::ProfileHandler(params(spec, name)?),
        "max-score-picker" => Plugin::Picker(Arc::new(MaxScore)),
        "weighted-random-picker" => Plugin::Picker(Arc::new(WeightedRandom)),
        "random-picker" => Plugin::Picker(Arc::new(RandomPicker)),
        other => return Err(ConfigError::UnknownType(other.to_string())),
    })
}

impl EndpointPickerConfig {
    /// Parses YAML (or JSON).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))
    }

    /// PROTOCOLS §6: queue ×2, KV use ×2, approximate prefix ×3, max-score picker.
    pub fn default_config() -> Self {
        Self::weighted(&[
            ("queue-scorer", 2.0),
            ("kv-cache-utilization-scorer", 2.0),
            ("prefix-cache-scorer", 3.0),
        ])
    }

    /// One profile named `default` of the given scorers and a max-score picker.
    pub fn weighted(scorers: &[(&str, f64)]) -> Self {
        let mut plugins: Vec<PluginSpec> = scorers
            .iter()
            .map(|(t, _)| PluginSpec {
                name: None,
                kind: (*t).to_string(),
                parameters: None,
            })
            .collect();
        plugins.push(PluginSpec {
            name: None,
            kind: "max-score-picker".into(),
            parameters: None,
        });
        let mut refs: Vec<PluginRef> = scorers
            .iter()
            .map(|(t, w)| PluginRef {
                plugin_ref: (*t).to_string(),
                weight: Some(*w),
            })
            .collect();
        refs.push(PluginRef {
            plugin_ref: "max-score-picker".into(),
            weight: None,
        });
        EndpointPickerConfig {
            api_version: Some("inference.networking.x-k8s.io/v1alpha1".into()),
            kind: Some("EndpointPickerConfig".into()),
            plugins,
            scheduling_profiles: vec![ProfileSpec {
                name: "default".into(),
                plugins: refs,
            }],
        }
    }

    /// The approximate-index settings from the first prefix plugin's parameters.
    pub fn approx_config(&self) -> ApproxConfig {
        let mut cfg = ApproxConfig::default();
        for p in &self.plugins {
            if p.kind == "prefix-cache-scorer" || p.kind == "precise-prefix-cache-scorer" {
                let name = p.name.as_deref().unwrap_or(&p.kind);
                if let Ok(pp) = params::<PrefixParams>(p, name) {
                    let _ = pp.hash_seed;
                    cfg.block_size_tokens = pp.block_size.unwrap_or(cfg.block_size_tokens).max(1);
                    cfg.capacity_per_endpoint = pp
                        .lru_capacity_per_server
                        .unwrap_or(cfg.capacity_per_endpoint)
                        .max(1);
                    cfg.max_blocks = pp.max_prefix_blocks_to_match.unwrap_or(cfg.max_blocks);
                }
                break;
            }
        }
        cfg
    }

    /// The prefill/decode profile pair: a `decode` profile (role `decode`, `both` or none)
    /// and a `prefill` profile (role `prefill`), each queue ×2, KV use ×2, approximate
    /// prefix ×3 and max-score, a `prefix-based-pd-decider` at `non_cached_tokens` and the
    /// `pd-profile-handler` over them.
    pub fn pd(non_cached_tokens: u32) -> Self {
        let plugin = |kind: &str, parameters: Option<serde_json::Value>| PluginSpec {
            name: None,
            kind: kind.into(),
            parameters,
        };
        let plugins = vec![
            plugin("decode-filter", None),
            plugin("prefill-filter", None),
            plugin("queue-scorer", None),
            plugin("kv-cache-utilization-scorer", None),
            plugin("prefix-cache-scorer", None),
            plugin("max-score-picker", None),
            plugin(
                PREFIX_PD_DECIDER,
                Some(serde_json::json!({ "nonCachedTokens": non_cached_tokens })),
            ),
            plugin(PD_PROFILE_HANDLER, None),
        ];
        let profile = |name: &str, filter: &str| ProfileSpec {
            name: name.into(),
            plugins: [
                (filter, None),
                ("queue-scorer", Some(2.0)),
                ("kv-cache-utilization-scorer", Some(2.0)),
                ("prefix-cache-scorer", Some(3.0)),
                ("max-score-picker", None),
            ]
            .into_iter()
            .map(|(r, weight)| PluginRef {
                plugin_ref: r.into(),
                weight,
            })
            .collect(),
        };
        EndpointPickerConfig {
            api_version: Some("inference.networking.x-k8s.io/v1alpha1".into()),
            kind: Some("EndpointPickerConfig".into()),
            plugins,
            scheduling_profiles: vec![
                profile("decode", "decode-filter"),
                profile("prefill", "prefill-filter"),
            ],
        }
    }

    /// Whether any plugin needs the precise (KV-event) index and token-level hashes.
    pub fn uses_precise(&self) -> bool {
        self.plugins
            .iter()
            .any(|p| p.kind == "precise-prefix-cache-scorer")
    }

    /// Builds the scheduler.
    pub fn build(&self) -> Result<EndpointPicker, ConfigError> {
        let mut built: HashMap<String, Plugin> = HashMap::new();
        for spec in &self.plugins {
            let name = spec.name.clone().unwrap_or_else(|| spec.kind.clone());
            let plugin = build_plugin(spec)?;
            if built.insert(name.clone(), plugin).is_some() {
                return Err(ConfigError::DuplicatePlugin(name));
            }
        }
        let mut profiles = Vec::new();
        for p in &self.scheduling_profiles {
            let mut profile = Profile {
                name: p.name.clone(),
                filters: Vec::new(),
                scorers: Vec::new(),
                picker: Arc::new(MaxScore),
            };
            for r in &p.plugins {
                let plugin = built
                    .get(&r.plugin_ref)
                    .ok_or_else(|| ConfigError::UnknownRef {
                        profile: p.name.clone(),
                        name: r.plugin_ref.clone(),
                    })?;
                match plugin {
                    Plugin::Filter(f) => profile.filters.push((r.plugin_ref.clone(), f.clone())),
                    Plugin::Scorer(s) => {
                        let w = r.weight.unwrap_or(1.0);
                        if !w.is_finite() || w < 0.0 {
                            return Err(ConfigError::Weight(p.name.clone()));
                        }
                        profile.scorers.push((r.plugin_ref.clone(), s.clone(), w));
                    }
                    Plugin::Picker(k) => profile.picker = k.clone(),
                    Plugin::Decider(_) | Plugin::ProfileHandler(_) => {
                        return Err(ConfigError::NotInProfile(r.plugin_ref.clone()))
                    }
                }
            }
            profiles.push(profile);
        }
        let picker = EndpointPicker::new(profiles)?;
        let mut handlers = built.iter().filter_map(|(name, p)| match p {
            Plugin::ProfileHandler(h) => Some((name, h)),
            _ => None,
        });
        let Some((handler_name, h)) = handlers.next() else {
            return Ok(picker);
        };
        if handlers.next().is_some() {
            return Err(ConfigError::TwoHandlers);
        }
        let decider = match (&h.decider_plugin_name, h.threshold) {
            (Some(name), _) => match built.get(name) {
                Some(Plugin::Decider(d)) => *d,
                _ => {
                    return Err(ConfigError::Parameters {
                        name: handler_name.clone(),
                        message: format!("deciderPluginName `{name}` is not a decider plugin"),
                    })
                }
            },
            (None, Some(t)) => PdDecider {
                non_cached_tokens: t,
            },
            (None, None) => match built.get(PREFIX_PD_DECIDER) {
                Some(Plugin::Decider(d)) => *d,
                _ => PdDecider::default(),
            },
        };
        picker.with_pd(PdHandler {
            decode_profile: h.decode_profile.clone(),
            prefill_profile: h.prefill_profile.clone(),
            decider,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = r#"
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: low-queue-filter
    parameters: {threshold: 64}
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - name: prefix
    type: prefix-cache-scorer
    parameters: {blockSize: 32, lruCapacityPerServer: 1000, maxPrefixBlocksToMatch: 64}
  - type: weighted-random-picker
  - type: round-robin-scorer
schedulingProfiles:
  - name: cache-aware
    plugins:
      - pluginRef: low-queue-filter
      - pluginRef: queue-scorer
        weight: 1
      - pluginRef: kv-cache-utilization-scorer
        weight: 1
      - pluginRef: prefix
        weight: 5
      - pluginRef: weighted-random-picker
  - name: rr
    plugins:
      - pluginRef: round-robin-scorer
"#;

    #[test]
    fn parses_llm_d_shape_and_builds_profiles() {
        let cfg = EndpointPickerConfig::from_yaml(YAML).unwrap();
        let s = cfg.build().unwrap();
        assert_eq!(s.profiles().len(), 2);
        let p = &s.profiles()[0];
        assert_eq!(p.name, "cache-aware");
        assert_eq!(p.filters.len(), 1);
        let weights: Vec<(&str, f64)> =
            p.scorers.iter().map(|(n, _, w)| (n.as_str(), *w)).collect();
        assert_eq!(
            weights,
            vec![
                ("queue-scorer", 1.0),
                ("kv-cache-utilization-scorer", 1.0),
                ("prefix", 5.0)
            ]
        );
        assert!(format!("{:?}", p.picker).contains("WeightedRandom"));
        assert!(
            format!("{:?}", s.profiles()[1].picker).contains("MaxScore"),
            "default picker"
        );
        let a = cfg.approx_config();
        assert_eq!(
            (a.block_size_tokens, a.capacity_per_endpoint, a.max_blocks),
            (32, 1000, 64)
        );
        assert!(!cfg.uses_precise());
    }

    #[test]
    fn default_is_protocols_6() {
        let s = EndpointPickerConfig::default_config().build().unwrap();
        let w: Vec<f64> = s.profiles()[0].scorers.iter().map(|(_, _, w)| *w).collect();
        assert_eq!(w, vec![2.0, 2.0, 3.0]);
    }

    const PD_YAML: &str = r#"
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: prefill-filter
  - type: decode-filter
  - type: queue-scorer
  - type: prefix-based-pd-decider
    parameters: {nonCachedTokens: 64}
  - type: pd-profile-handler
    parameters: {deciderPluginName: prefix-based-pd-decider, primaryPort: 8000}
schedulingProfiles:
  - name: prefill
    plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}]
  - name: decode
    plugins: [{pluginRef: decode-filter}, {pluginRef: queue-scorer}]
"#;

    #[test]
    fn pd_profile_handler_in_llm_d_shape() {
        let s = EndpointPickerConfig::from_yaml(PD_YAML)
            .unwrap()
            .build()
            .unwrap();
        let pd = s.pd().unwrap();
        assert_eq!(pd.decode_profile, "decode");
        assert_eq!(pd.prefill_profile, "prefill");
        assert_eq!(pd.decider.non_cached_tokens, 64);
        // The older handler's inline threshold, no decider plugin.
        let older = "plugins: [{type: queue-scorer}, {type: pd-profile-handler, parameters: {threshold: 9}}]\n\
                     schedulingProfiles: [{name: decode, plugins: []}, {name: prefill, plugins: []}]";
        let s = EndpointPickerConfig::from_yaml(older)
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(s.pd().unwrap().decider.non_cached_tokens, 9);
        // No handler: no pair.
        assert!(EndpointPickerConfig::default_config()
            .build()
            .unwrap()
            .pd()
            .is_none());
        // The one-flag default.
        let s = EndpointPickerConfig::pd(256).build().unwrap();
        assert_eq!(s.pd().unwrap().decider.non_cached_tokens, 256);
        let names: Vec<&str> = s.profiles().iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["decode", "prefill"]);
        let w: Vec<f64> = s.profiles()[0].scorers.iter().map(|(_, _, w)| *w).collect();
        assert_eq!(w, vec![2.0, 2.0, 3.0]);
    }

    #[test]
    fn pd_config_errors() {
        let bad = [
            ("plugins: [{type: pd-profile-handler}]\nschedulingProfiles: [{name: decode, plugins: []}]", "profile `prefill`"),
            ("plugins: [{type: pd-profile-handler, parameters: {decodeProfile: a, prefillProfile: a}}]\nschedulingProfiles: [{name: a, plugins: []}]", "must differ"),
            ("plugins: [{type: prefix-based-pd-decider, parameters: {nonCachedTokens: -1}}]\nschedulingProfiles: [{name: a, plugins: []}]", "0 or more"),
            ("plugins: [{type: pd-profile-handler, parameters: {deciderPluginName: x}}]\nschedulingProfiles: [{name: decode, plugins: []}, {name: prefill, plugins: []}]", "not a decider"),
            ("plugins: [{type: pd-profile-handler, parameters: {bogus: 1}}]\nschedulingProfiles: [{name: a, plugins: []}]", "bad parameters"),
            ("plugins: [{type: pd-profile-handler}]\nschedulingProfiles: [{name: decode, plugins: [{pluginRef: pd-profile-handler}]}]", "not a filter"),
            ("plugins: [{type: pd-profile-handler}, {name: h2, type: pd-profile-handler}]\nschedulingProfiles: [{name: decode, plugins: []}, {name: prefill, plugins: []}]", "only one"),
        ];
        for (yaml, want) in bad {
            let err = EndpointPickerConfig::from_yaml(yaml).and_then(|c| c.build().map(|_| ()));
            let msg = err.expect_err(yaml).to_string();
            assert!(msg.contains(want), "{yaml}: {msg}");
        }
    }

    #[test]
    fn errors_at_load_time() {
        let bad = [
            ("plugins: [{type: nope}]\nschedulingProfiles: [{name: a, plugins: []}]", "unknown plugin type"),
            ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: x}]}]", "unknown plugin `x`"),
            ("plugins: [{type: queue-scorer}, {type: queue-scorer}]\nschedulingProfiles: []", "defined twice"),
            ("plugins: []\nschedulingProfiles: []", "at least one"),
            ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer, weight: -1}]}]", "weights"),
            ("plugins: [{type: role-filter}]\nschedulingProfiles: [{name: a, plugins: []}]", "role"),
            ("plugins: [{type: low-queue-filter, parameters: {threshold: x}}]\nschedulingProfiles: [{name: a, plugins: []}]", "bad parameters"),
            ("plugins: 7", "parse"),
            ("plugins: []\nschedulingProfiles: []\nextra: 1", "parse"),
        ];
        for (yaml, want) in bad {
            let err = EndpointPickerConfig::from_yaml(yaml).and_then(|c| c.build().map(|_| ()));
            let msg = err.expect_err(yaml).to_string();
            assert!(msg.contains(want), "{yaml}: {msg}");
        }
    }
}
