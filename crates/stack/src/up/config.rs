//! `strata.yaml` and the flags over it, checked once at start into a [`StackConfig`]:
//! every later step trusts it. A problem names its key (or flag).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_controller::autoscale::{self, AutoscaleConfig};
use strata_controller::rollout::{self, RolloutConfig};

use super::args::UpArgs;
use crate::pools::{self, served_name_of, ModelEntry, PoolConfigError, PoolSpec};

/// A `strata.yaml` or flag that cannot run. A cause is part of the message (not a
/// `source`), so that it is printed once, as the CLI prints the whole chain.
#[derive(Debug, thiserror::Error)]
pub enum StackConfigError {
    #[error("reading {}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("in {}: {error}", path.display())]
    Parse {
        path: PathBuf,
        error: serde_yaml::Error,
    },
    /// A value out of range or a combination not allowed; the message names the key (or
    /// flag).
    #[error("{0}")]
    Invalid(String),
    #[error("autoscale.{0}")]
    Autoscale(autoscale::ConfigError),
    #[error(transparent)]
    Rollout(#[from] rollout::ConfigError),
    #[error(transparent)]
    Pools(#[from] PoolConfigError),
}

/// `Ok` when `ok`, else the `Invalid` error with `message`.
fn ensure(ok: bool, message: impl Into<String>) -> Result<(), StackConfigError> {
    if ok {
        Ok(())
    } else {
        Err(StackConfigError::Invalid(message.into()))
    }
}

/// `strata.yaml`: every key has a flag of the same name and a default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StackConfig {
    /// Engine replicas to run when `autoscale` is absent (a fixed count).
    pub replicas: u32,
    /// Autoscaling (the controller's `autoscale:` keys, camelCase: `minReplicas`,
    /// `maxReplicas`, `warmSpares`, `scaleToZeroAfterSecs` ...); absent: `replicas` fixed.
    pub autoscale: Option<AutoscaleConfig>,
    /// Seconds between control ticks (and rollout analyses).
    pub controller_interval_secs: f64,
    /// How long a request waits for a cold start while no replica is ready; absent:
    /// `ready_timeout_secs`.
    pub hold_timeout_secs: Option<f64>,
    /// Canary rollouts (the controller's `rollout:` keys: `steps`, `stepMinSecs`,
    /// `minRequests`, `maxTtftRatio` ...).
    pub rollout: RolloutConfig,
    /// Canary replicas a rollout starts.
    pub canary_replicas: u32,
    /// A model name from the cache (pulled when missing) or a GGUF path.
    pub model: String,
    /// Address of the front port (router + dashboard).
    pub host: String,
    pub port: u16,
    /// KV-cache bytes per replica.
    pub kv_cache_memory: u64,
    /// Extra `strata engine` flags for every replica.
    pub engine_args: Vec<String>,
    /// A router config file (`router.yaml`: scheduling profiles, saturation ...).
    pub router_config: Option<PathBuf>,
    /// Seconds Ctrl-C waits for in-flight requests.
    pub shutdown_grace_secs: u64,
    /// A replica not ready after this long is killed and replaced.
    pub ready_timeout_secs: f64,
    /// Where replica logs go (`<id>.log`; the second and later pools in a folder named
    /// after the pool); absent: this terminal.
    pub log_dir: Option<PathBuf>,
    /// Port of the gateway (API keys, limits, budgets) in front of the router; `0` picks a
    /// free port. `gateway: false` leaves it out.
    pub gateway: bool,
    pub gateway_port: u16,
    /// The gateway's SQLite file (`:memory:` for none); absent: `$STRATA_HOME/gateway.db`.
    pub gateway_db: Option<PathBuf>,
    /// One pool per model ([`crate::pools`]); empty: the one pool of `model`, `replicas`
    /// and `autoscale`.
    pub models: Vec<ModelEntry>,
    /// Disaggregated serving: prefill engines (with `decode_replicas`; instead of
    /// `replicas`).
    pub prefill_replicas: Option<u32>,
    /// Disaggregated serving: decode engines (with `prefill_replicas`).
    pub decode_replicas: Option<u32>,
    /// Disaggregated serving: a request goes through a prefill engine when its decode
    /// pick's uncached prompt tokens reach this (llm-d's `nonCachedTokens`; 0: always).
    pub pd_threshold: u32,
    /// Memory bytes of a shared KV tier (`strata kv-tier`) for every engine; absent: none.
    pub kv_tier_bytes: Option<u64>,
    /// Every service over TLS with certificates from a CA made at each start
    /// ([`super::tls`]).
    pub tls: bool,
}

impl Default for StackConfig {
    fn default() -> Self {
        StackConfig {
            replicas: 2,
            autoscale: None,
            controller_interval_secs: 1.0,
            hold_timeout_secs: None,
            rollout: RolloutConfig::default(),
            canary_replicas: 1,
            model: "smollm2-135m-instruct".to_string(),
            host: "127.0.0.1".to_string(),
            port: 8080,
            kv_cache_memory: 256 << 20,
            engine_args: Vec::new(),
            router_config: None,
            shutdown_grace_secs: 30,
            ready_timeout_secs: 300.0,
            log_dir: None,
            gateway: true,
            gateway_port: 4000,
            gateway_db: None,
            models: Vec::new(),
            prefill_replicas: None,
            decode_replicas: None,
            pd_threshold: strata_router::scheduling::pd::SUGGESTED_NON_CACHED_TOKENS,
            kv_tier_bytes: None,
            tls: false,
        }
    }
}

impl StackConfig {
    /// The file (if any) with the flags applied over it.
    pub fn load(args: &UpArgs) -> Result<StackConfig, StackConfigError> {
        let mut c = match &args.config {
            Some(path) => StackConfig::read(path)?,
            None => StackConfig::default(),
        };
        c.apply(args)?;
        c.validate()?;
        Ok(c)
    }

    /// A `strata.yaml` as written (checked only for unknown keys and types).
    fn read(path: &Path) -> Result<StackConfig, StackConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| StackConfigError::Read {
            path: path.to_path_buf(),
            error,
        })?;
        serde_yaml::from_str(&text).map_err(|error| StackConfigError::Parse {
            path: path.to_path_buf(),
            error,
        })
    }

    /// Each flag given replaces its key.
    fn apply(&mut self, args: &UpArgs) -> Result<(), StackConfigError> {
        if !self.models.is_empty() {
            // `--model` and the replica flags describe the single-model form; with
            // `models:` each entry says its own.
            ensure(
                args.model.is_none()
                    && args.replicas.is_none()
                    && args.min_replicas.is_none()
                    && args.max_replicas.is_none(),
                "--model, --replicas, --min-replicas and --max-replicas cannot be used with \
                 `models:` in the config: set `model`, `replicas` or `autoscale` per entry",
            )?;
        }
        if let Some(v) = args.replicas {
            self.replicas = v;
            self.autoscale = None;
            self.prefill_replicas = None;
            self.decode_replicas = None;
        }
        if let (Some(p), Some(d)) = (args.prefill_replicas, args.decode_replicas) {
            self.prefill_replicas = Some(p);
            self.decode_replicas = Some(d);
        }
        if let Some(v) = args.pd_threshold {
            self.pd_threshold = v;
        }
        if args.tls {
            self.tls = true;
        }
        if args.kv_tier_bytes.is_some() {
            self.kv_tier_bytes = args.kv_tier_bytes;
        }
        if args.min_replicas.is_some() || args.max_replicas.is_some() {
            let mut a = self.autoscale.take().unwrap_or_default();
            if let Some(v) = args.min_replicas {
                a.min_replicas = v;
            }
            if let Some(v) = args.max_replicas {
                a.max_replicas = v;
            }
            self.autoscale = Some(a);
        }
        if let Some(v) = &args.model {
            self.model = v.clone();
        }
        if let Some(v) = &args.host {
            self.host = v.clone();
        }
        if let Some(v) = args.port {
            self.port = v;
        }
        if let Some(v) = args.kv_cache_memory {
            self.kv_cache_memory = v;
        }
        if !args.engine_args.is_empty() {
            self.engine_args = args.engine_args.clone();
        }
        if args.router_config.is_some() {
            self.router_config = args.router_config.clone();
        }
        if let Some(v) = args.shutdown_grace_secs {
            self.shutdown_grace_secs = v;
        }
        if args.log_dir.is_some() {
            self.log_dir = args.log_dir.clone();
        }
        if args.no_gateway {
            self.gateway = false;
        }
        if let Some(v) = args.gateway_port {
            self.gateway_port = v;
        }
        if args.gateway_db.is_some() {
            self.gateway_db = args.gateway_db.clone();
        }
        Ok(())
    }

    /// Every key in range and every combination allowed; the error names the key.
    pub fn validate(&self) -> Result<(), StackConfigError> {
        self.validate_disaggregated()?;
        if let Some(b) = self.kv_tier_bytes {
            ensure(b >= 1 << 20, "kv_tier_bytes must be at least 1 MiB")?;
        }
        if !self.models.is_empty() {
            let single = StackConfig::default();
            ensure(
                self.model == single.model && self.autoscale.is_none(),
                "`model` and `autoscale` are per entry when `models:` is set",
            )?;
            self.pools()?;
        }
        ensure(
            (1..=64).contains(&self.replicas),
            format!("replicas must be 1..=64, not {}", self.replicas),
        )?;
        ensure(!self.model.is_empty(), "model must not be empty")?;
        ensure(
            self.kv_cache_memory >= 1 << 20,
            "kv_cache_memory must be at least 1 MiB",
        )?;
        ensure(
            self.ready_timeout_secs > 0.0,
            "ready_timeout_secs must be positive",
        )?;
        if let Some(a) = &self.autoscale {
            a.validate().map_err(StackConfigError::Autoscale)?;
            ensure(
                a.max_replicas <= 64,
                "autoscale.maxReplicas must be at most 64",
            )?;
        }
        ensure(
            self.controller_interval_secs.is_finite()
                && (0.05..=60.0).contains(&self.controller_interval_secs),
            "controller_interval_secs must be 0.05..=60",
        )?;
        if let Some(h) = self.hold_timeout_secs {
            ensure(
                h.is_finite() && h >= 0.0,
                "hold_timeout_secs must be zero or more",
            )?;
        }
        self.rollout.validate()?;
        ensure(
            (1..=16).contains(&self.canary_replicas),
            "canary_replicas must be 1..=16",
        )?;
        Ok(())
    }

    /// Disaggregated serving: both group sizes or neither, fixed counts of one model, and
    /// the per-group engine flags left to the stack.
    fn validate_disaggregated(&self) -> Result<(), StackConfigError> {
        match (self.prefill_replicas, self.decode_replicas) {
            (None, None) => {}
            (Some(p), Some(d)) => {
                ensure(
                    self.autoscale.is_none(),
                    "disaggregated serving (prefill_replicas/decode_replicas) runs fixed \
                     counts: it cannot be combined with autoscale, --min-replicas or \
                     --max-replicas",
                )?;
                ensure(
                    self.models.is_empty(),
                    "disaggregated serving (prefill_replicas/decode_replicas) serves one \
                     model: it cannot be combined with `models:`",
                )?;
                ensure(
                    (1..=64).contains(&p) && (1..=64).contains(&d),
                    format!("prefill_replicas and decode_replicas must be 1..=64, not {p} and {d}"),
                )?;
                for role in ["--kv-role", "--kv-transfer-port"] {
                    ensure(
                        !self
                            .engine_args
                            .iter()
                            .any(|a| a == role || a.starts_with(&format!("{role}="))),
                        format!(
                            "{role} is set per group in disaggregated serving; leave it out of \
                         engine_args"
                        ),
                    )?;
                }
            }
            _ => {
                return Err(StackConfigError::Invalid(
                    "prefill_replicas and decode_replicas go together".into(),
                ))
            }
        }
        Ok(())
    }

    /// The autoscaling settings in force: `autoscale`, or `replicas` pinned.
    pub fn autoscale(&self) -> AutoscaleConfig {
        match &self.autoscale {
            Some(a) => a.clone(),
            None => AutoscaleConfig {
                min_replicas: self.replicas,
                max_replicas: self.replicas,
                warm_spares: 0,
                ..AutoscaleConfig::default()
            },
        }
    }

    /// Whether the replicas are mock engines (`--engine-arg=--mock`): nothing to pull.
    pub fn mock_engines(&self) -> bool {
        self.engine_args.iter().any(|a| a == "--mock")
    }

    /// The name clients send as `model`: the cache name, or a GGUF file's stem.
    pub fn served_model_name(&self) -> String {
        served_name_of(&self.model)
    }

    /// Whether the engines are split into prefill and decode groups.
    pub fn disaggregated(&self) -> bool {
        self.prefill_replicas.is_some() && self.decode_replicas.is_some()
    }

    /// The pools to run: the `models:` entries, or the one pool of `model`; disaggregated,
    /// the model's decode group then its prefill group (fixed counts, each engine told its
    /// role; a prefill engine also gets a transfer port of its own).
    pub fn pools(&self) -> Result<Vec<PoolSpec>, PoolConfigError> {
        if let (Some(p), Some(d)) = (self.prefill_replicas, self.decode_replicas) {
            let group = |role: &str, n: u32, extra: &[&str]| {
                let mut engine_args = self.engine_args.clone();
                engine_args.push("--kv-role".into());
                engine_args.push(role.into());
                engine_args.extend(extra.iter().map(|a| a.to_string()));
                PoolSpec {
                    name: self.served_model_name(),
                    model: self.model.clone(),
                    autoscale: AutoscaleConfig {
                        min_replicas: n,
                        max_replicas: n,
                        warm_spares: 0,
                        ..AutoscaleConfig::default()
                    },
                    engine_args,
                    kv_cache_memory: self.kv_cache_memory,
                    adapters: Vec::new(),
                    role: Some(role.into()),
                }
            };
            return Ok(vec![
                group("decode", d, &[]),
                group("prefill", p, &["--kv-transfer-port", "{free_port}"]),
            ]);
        }
        if self.models.is_empty() {
            return Ok(vec![PoolSpec {
                name: self.served_model_name(),
                model: self.model.clone(),
                autoscale: self.autoscale(),
                engine_args: self.engine_args.clone(),
                kv_cache_memory: self.kv_cache_memory,
                adapters: Vec::new(),
                role: None,
            }]);
        }
        pools::resolve(&self.models, &self.engine_args, self.kv_cache_memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file_and_bad_values_are_refused() {
        let dir = std::env::temp_dir().join(format!("strata-up-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        std::fs::write(
            &file,
            "replicas: 3\nport: 9000\nengine_args: [\"--max-num-seqs\", \"8\"]\n",
        )
        .unwrap();
        let args = UpArgs {
            config: Some(file.clone()),
            port: Some(9100),
            ..UpArgs::default()
        };
        let c = StackConfig::load(&args).unwrap();
        assert_eq!(c.replicas, 3);
        assert_eq!(c.port, 9100);
        assert_eq!(c.engine_args, ["--max-num-seqs", "8"]);
        assert_eq!(c.model, "smollm2-135m-instruct");

        std::fs::write(&file, "replicas: 3\nportt: 9000\n").unwrap();
        let err = StackConfig::load(&args).unwrap_err();
        assert!(format!("{err:#}").contains("portt"), "{err:#}");

        let zero = UpArgs {
            replicas: Some(0),
            ..UpArgs::default()
        };
        assert!(StackConfig::load(&zero).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `args` over a `strata.yaml` at `file` holding `yaml`.
    fn load_yaml(
        file: &std::path::Path,
        yaml: &str,
        args: UpArgs,
    ) -> Result<StackConfig, StackConfigError> {
        std::fs::write(file, yaml).unwrap();
        StackConfig::load(&UpArgs {
            config: Some(file.to_path_buf()),
            ..args
        })
    }

    #[test]
    fn replicas_pins_the_count_and_autoscale_keys_and_flags_set_bounds() {
        let dir = std::env::temp_dir().join(format!("strata-up-as-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        let with = |yaml: &str, args: UpArgs| load_yaml(&file, yaml, args);
        // Today's behaviour: a fixed count.
        let c = with("replicas: 3\n", UpArgs::default()).unwrap();
        let a = c.autoscale();
        assert_eq!((a.min_replicas, a.max_replicas, a.warm_spares), (3, 3, 0));
        // The controller's keys, camelCase.
        let yaml = "autoscale:\n  minReplicas: 0\n  maxReplicas: 4\n  warmSpares: 1\n  \
                    scaleToZeroAfterSecs: 5\nrollout:\n  steps: [10, 100]\n  minRequests: 3\n";
        let c = with(yaml, UpArgs::default()).unwrap();
        let a = c.autoscale();
        assert_eq!((a.min_replicas, a.max_replicas, a.warm_spares), (0, 4, 1));
        assert_eq!(a.scale_to_zero_after_secs, 5.0);
        assert_eq!(c.rollout.steps, vec![10, 100]);
        // Flags: --max-replicas over the file; --replicas pins again.
        let c = with(
            yaml,
            UpArgs {
                max_replicas: Some(2),
                ..UpArgs::default()
            },
        )
        .unwrap();
        assert_eq!(c.autoscale().max_replicas, 2);
        assert_eq!(c.autoscale().min_replicas, 0);
        let c = with(
            yaml,
            UpArgs {
                replicas: Some(1),
                ..UpArgs::default()
            },
        )
        .unwrap();
        assert_eq!(
            (c.autoscale().min_replicas, c.autoscale().max_replicas),
            (1, 1)
        );
        let c = with(
            "replicas: 2\n",
            UpArgs {
                min_replicas: Some(1),
                max_replicas: Some(5),
                ..UpArgs::default()
            },
        )
        .unwrap();
        assert_eq!(
            (c.autoscale().min_replicas, c.autoscale().max_replicas),
            (1, 5)
        );
        // Bad values name their key.
        let e = with(
            "autoscale:\n  minReplicas: 5\n  maxReplicas: 2\n",
            UpArgs::default(),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("minReplicas"), "{e:#}");
        let e = with("autoscale:\n  maxReplica: 2\n", UpArgs::default()).unwrap_err();
        assert!(format!("{e:#}").contains("maxReplica"), "{e:#}");
        let e = with("rollout:\n  steps: [50, 10]\n", UpArgs::default()).unwrap_err();
        assert!(format!("{e:#}").contains("steps"), "{e:#}");
        let e = with("controller_interval_secs: 0\n", UpArgs::default()).unwrap_err();
        assert!(
            format!("{e:#}").contains("controller_interval_secs"),
            "{e:#}"
        );
        assert!(with("engine_args: [--mock]\n", UpArgs::default())
            .unwrap()
            .mock_engines());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn disaggregated_mode_refuses_autoscaling_models_and_its_own_flags() {
        let dir = std::env::temp_dir().join(format!("strata-up-pd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        let with = |yaml: &str, args: UpArgs| load_yaml(&file, yaml, args);
        let pd = || UpArgs {
            prefill_replicas: Some(1),
            decode_replicas: Some(1),
            ..UpArgs::default()
        };
        let e = with("autoscale: {minReplicas: 0, maxReplicas: 2}\n", pd()).unwrap_err();
        assert!(format!("{e:#}").contains("autoscale"), "{e:#}");
        let e = with("models: [{model: a}]\n", pd()).unwrap_err();
        assert!(format!("{e:#}").contains("models"), "{e:#}");
        let e = with("engine_args: [--kv-role, both]\n", pd()).unwrap_err();
        assert!(format!("{e:#}").contains("--kv-role"), "{e:#}");
        let e = with("prefill_replicas: 1\n", UpArgs::default()).unwrap_err();
        assert!(format!("{e:#}").contains("go together"), "{e:#}");
        let e = with(
            "prefill_replicas: 0\ndecode_replicas: 1\n",
            UpArgs::default(),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("1..=64"), "{e:#}");
        let e = with("kv_tier_bytes: 10\n", UpArgs::default()).unwrap_err();
        assert!(format!("{e:#}").contains("kv_tier_bytes"), "{e:#}");
        // The file's keys work as the flags do; --replicas goes back to colocated.
        let c = with(
            "prefill_replicas: 1\ndecode_replicas: 2\npd_threshold: 0\n",
            UpArgs::default(),
        )
        .unwrap();
        assert!(c.disaggregated());
        assert_eq!(c.pd_threshold, 0);
        let c = with(
            "prefill_replicas: 1\ndecode_replicas: 2\n",
            UpArgs {
                replicas: Some(2),
                ..UpArgs::default()
            },
        )
        .unwrap();
        assert!(!c.disaggregated());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn served_name_is_the_cache_name_or_the_file_stem() {
        let mut c = StackConfig::default();
        assert_eq!(c.served_model_name(), "smollm2-135m-instruct");
        c.model = "/models/tiny-llama.gguf".into();
        assert_eq!(c.served_model_name(), "tiny-llama");
    }
}
