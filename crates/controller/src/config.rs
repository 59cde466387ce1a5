//! `controller.yaml`: typed, every key defaulted, validated before anything starts.
//! Every key and its default is listed in `docs/CONTROLLER.md`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::autoscale::AutoscaleConfig;
#[cfg(feature = "kubernetes")]
use crate::driver::kubernetes::KubernetesDriverConfig;
use crate::driver::local::LocalDriverConfig;
use crate::held::HeldRequestsSource;
use crate::registry::ModelRegistry;
use crate::rollout::RolloutConfig;
use crate::signals::EngineKind;

/// The whole controller configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct ControllerConfig {
    /// Address of the controller's HTTP endpoint (`/metrics`, `/status`, `/health`).
    pub listen: String,
    /// Address of the KEDA external scaler (gRPC); off when absent.
    pub keda_listen: Option<String>,
    /// Seconds between control ticks.
    pub interval_secs: f64,
    /// Metric names the replicas export.
    pub engine_kind: EngineKind,
    /// Seconds a replica's `/metrics` may take before the tick counts as a gap.
    pub scrape_timeout_secs: f64,
    pub autoscale: AutoscaleConfig,
    pub driver: DriverConfig,
    pub rollout: RolloutConfig,
    /// Models by name, each pinned to a digest.
    pub models: ModelRegistry,
    /// The picker whose held requests wake a pool scaled to zero (Kubernetes); absent:
    /// only the registrar's count (the `strata up` front's).
    pub held_requests: Option<HeldRequestsSource>,
    /// The endpoint over HTTPS, and the CA `https://` replicas and pickers are verified
    /// against.
    pub tls: ControllerTls,
    /// Canary rollouts on Kubernetes (the rollout API under `/controller/rollout/`); needs
    /// the Kubernetes driver.
    pub kubernetes_rollout: Option<KubernetesRolloutConfig>,
}

/// `kubernetesRollout:` in controller.yaml: canaries already deployed as pools of their
/// own get traffic through an HTTPRoute's backend weights.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct KubernetesRolloutConfig {
    /// The HTTPRoute (in the driver's namespace) whose backend weights move.
    pub route: String,
    /// Every pool (InferencePool name) a rollout may name, with its pods' label selector.
    pub pools: std::collections::BTreeMap<String, String>,
}

impl KubernetesRolloutConfig {
    fn validate(&self) -> Result<(), String> {
        if self.route.is_empty() {
            return Err("kubernetesRollout.route is required".into());
        }
        if self.pools.len() < 2 {
            return Err("kubernetesRollout.pools needs the baseline's and the canary's".into());
        }
        if let Some((pool, _)) = self.pools.iter().find(|(_, s)| s.trim().is_empty()) {
            // An empty selector would list every pod in the namespace.
            return Err(format!(
                "kubernetesRollout.pools.{pool}: a label selector is required"
            ));
        }
        Ok(())
    }
}

/// `tls:` in controller.yaml (PEM files, as the other services' `--tls-*` flags).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct ControllerTls {
    /// The CA `https://` replicas' (`/metrics`) and the picker's (`heldRequests`)
    /// certificates are verified against, on top of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// Serve the HTTP endpoint (`/metrics`, `/status`, the rollout API) over HTTPS with
    /// this certificate chain (reloaded when it changes) ...
    pub cert_file: Option<PathBuf>,
    /// ... and its key.
    pub key_file: Option<PathBuf>,
    /// Mutual TLS on the endpoint: callers must present a certificate this CA signed.
    pub client_ca_file: Option<PathBuf>,
}

impl ControllerTls {
    /// The endpoint's certificate files, when it serves HTTPS.
    pub fn server_files(&self) -> Option<strata_api::tls::TlsFiles> {
        Some(strata_api::tls::TlsFiles {
            cert: self.cert_file.clone()?,
            key: self.key_file.clone()?,
            client_ca: self.client_ca_file.clone(),
        })
    }

    fn validate(&self) -> Result<(), String> {
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err("tls: certFile and keyFile go together".into());
        }
        if self.client_ca_file.is_some() && self.cert_file.is_none() {
            return Err("tls.clientCaFile needs certFile and keyFile".into());
        }
        Ok(())
    }
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            listen: "127.0.0.1:9400".to_string(),
            keda_listen: None,
            interval_secs: 2.0,
            engine_kind: EngineKind::Vllm,
            scrape_timeout_secs: 1.0,
            autoscale: AutoscaleConfig::default(),
            driver: DriverConfig::default(),
            rollout: RolloutConfig::default(),
            models: ModelRegistry::default(),
            held_requests: None,
            tls: ControllerTls::default(),
            kubernetes_rollout: None,
        }
    }
}

/// Which driver runs replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DriverConfig {
    /// `strata engine` processes on this machine.
    Local(LocalDriverConfig),
    /// Scaling a Deployment or LeaderWorkerSet through the Kubernetes API server.
    #[cfg(feature = "kubernetes")]
    Kubernetes(KubernetesDriverConfig),
    /// Built without the `kubernetes` feature: parsed, then refused by validation.
    #[cfg(not(feature = "kubernetes"))]
    Kubernetes(serde_yaml::Value),
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig::Local(LocalDriverConfig::default())
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

impl ControllerConfig {
    /// Reads and validates a YAML file.
    pub fn load(path: &Path) -> Result<ControllerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates YAML text (`origin` names it in errors).
    pub fn parse(text: &str, origin: &str) -> Result<ControllerConfig, ConfigError> {
        // An empty file is all defaults.
        let cfg: ControllerConfig = if text.trim().is_empty() {
            ControllerConfig::default()
        } else {
            serde_yaml::from_str(text).map_err(|source| ConfigError::Parse {
                path: origin.to_string(),
                source,
            })?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| ConfigError::Invalid(m);
        self.listen
            .parse::<std::net::SocketAddr>()
            .map_err(|_| invalid(format!("listen: `{}` is not host:port", self.listen)))?;
        if let Some(k) = &self.keda_listen {
            k.parse::<std::net::SocketAddr>()
                .map_err(|_| invalid(format!("kedaListen: `{k}` is not host:port")))?;
        }
        if !(self.interval_secs.is_finite() && self.interval_secs > 0.0) {
            return Err(invalid("intervalSecs: must be a positive number".into()));
        }
        if !(self.scrape_timeout_secs.is_finite() && self.scrape_timeout_secs > 0.0) {
            return Err(invalid(
                "scrapeTimeoutSecs: must be a positive number".into(),
            ));
        }
        self.autoscale
            .validate()
            .map_err(|e| invalid(e.to_string()))?;
        self.rollout
            .validate()
            .map_err(|e| invalid(e.to_string()))?;
        if let Some(h) = &self.held_requests {
            h.validate().map_err(invalid)?;
        }
        self.tls.validate().map_err(invalid)?;
        if let Some(k) = &self.kubernetes_rollout {
            k.validate().map_err(invalid)?;
            if matches!(self.driver, DriverConfig::Local(_)) {
                return Err(invalid(
                    "kubernetesRollout: needs driver.kind kubernetes (`strata up` serves rollouts itself)".into(),
                ));
            }
        }
        match &self.driver {
            DriverConfig::Local(l) => l.validate().map_err(|e| invalid(e.to_string()))?,
            #[cfg(feature = "kubernetes")]
            DriverConfig::Kubernetes(k) => k.validate().map_err(|e| invalid(e.to_string()))?,
            #[cfg(not(feature = "kubernetes"))]
            DriverConfig::Kubernetes(_) => {
                return Err(invalid(
                    "driver.kind: this build has no Kubernetes driver (cargo feature `kubernetes`); use local".into(),
                ))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_partial_files_take_defaults() {
        let c = ControllerConfig::parse("", "t").unwrap();
        assert_eq!(c, ControllerConfig::default());
        let c = ControllerConfig::parse(
            "autoscale:\n  maxReplicas: 5\ndriver:\n  kind: local\n  model: /m.gguf\n  readyTimeoutSecs: 60\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.autoscale.max_replicas, 5);
        assert_eq!(c.autoscale.min_replicas, 1);
        match &c.driver {
            DriverConfig::Local(l) => {
                assert_eq!(l.model, "/m.gguf");
                assert_eq!(l.ready_timeout_secs, 60.0);
                assert_eq!(l.health_path, "/health");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_files_name_the_problem() {
        let err = |y: &str| {
            ControllerConfig::parse(y, "c.yaml")
                .unwrap_err()
                .to_string()
        };
        assert!(err("autoscale:\n  maxReplicas: 0\n").contains("maxReplicas"));
        assert!(err("autoscal: {}\n").contains("autoscal"));
        assert!(err("driver:\n  kind: local\n  bogus: 1\n").contains("bogus"));
        #[cfg(feature = "kubernetes")]
        {
            assert!(err("driver:\n  kind: kubernetes\n").contains("driver.name"));
            assert!(
                err("driver:\n  kind: kubernetes\n  name: e\n  replicas: 3\n").contains("replicas")
            );
            assert!(
                err("driver:\n  kind: kubernetes\n  name: e\n  targetKind: StatefulSet\n")
                    .contains("StatefulSet")
            );
            assert!(
                err("driver:\n  kind: kubernetes\n  name: e\n  port: 0\n").contains("driver.port")
            );
        }
        #[cfg(not(feature = "kubernetes"))]
        assert!(err("driver:\n  kind: kubernetes\n").contains("feature `kubernetes`"));
        assert!(err("driver:\n  kind: nomad\n").contains("nomad"));
        assert!(err("listen: nowhere\n").contains("listen"));
        assert!(err("rollout:\n  steps: [50, 10]\n").contains("steps"));
        assert!(err("[1, 2").contains("c.yaml"));
        assert!(err("intervalSecs: -1\n").contains("intervalSecs"));
    }

    #[test]
    fn the_documented_example_parses() {
        let doc = include_str!("../../../docs/CONTROLLER.md");
        let start = doc.find("```yaml\n").unwrap() + "```yaml\n".len();
        let end = start + doc[start..].find("```").unwrap();
        let c = ControllerConfig::parse(&doc[start..end], "docs").unwrap();
        // The example spells out the defaults.
        assert_eq!(c.autoscale, AutoscaleConfig::default());
        assert_eq!(c.rollout, RolloutConfig::default());
        assert_eq!(c.listen, ControllerConfig::default().listen);
        assert_eq!(c.driver, DriverConfig::default());
    }

    #[cfg(feature = "kubernetes")]
    #[test]
    fn the_documented_kubernetes_example_parses() {
        use crate::driver::kubernetes::TargetKind;
        let doc = include_str!("../../../docs/CONTROLLER.md");
        let section = &doc[doc.find("## The Kubernetes driver").unwrap()..];
        let start = section.find("```yaml\n").unwrap() + "```yaml\n".len();
        let end = start + section[start..].find("```").unwrap();
        let c = ControllerConfig::parse(&section[start..end], "docs").unwrap();
        let DriverConfig::Kubernetes(k) = &c.driver else {
            panic!("{:?}", c.driver)
        };
        assert_eq!(k.target_kind, TargetKind::Deployment);
        assert!(!k.name.is_empty());
        // The example spells out the defaults of everything but the target.
        let defaults = KubernetesDriverConfig {
            name: k.name.clone(),
            namespace: k.namespace.clone(),
            ..KubernetesDriverConfig::default()
        };
        assert_eq!(k, &defaults);
    }

    #[cfg(feature = "kubernetes")]
    #[test]
    fn a_kubernetes_driver_parses() {
        use crate::driver::kubernetes::TargetKind;
        let c = ControllerConfig::parse(
            "driver:\n  kind: kubernetes\n  namespace: serving\n  targetKind: LeaderWorkerSet\n  name: llama\n  port: 8080\n  readyTimeoutSecs: 900\n  kubeconfig: /etc/kube.conf\n  requestTimeoutSecs: 5\n",
            "t",
        )
        .unwrap();
        let DriverConfig::Kubernetes(k) = &c.driver else {
            panic!("{:?}", c.driver)
        };
        assert_eq!(k.namespace, "serving");
        assert_eq!(k.target_kind, TargetKind::LeaderWorkerSet);
        assert_eq!((k.name.as_str(), k.port), ("llama", 8080));
        assert_eq!(k.ready_timeout_secs, 900.0);
        assert_eq!(k.request_timeout_secs, 5.0);
        assert_eq!(
            k.kubeconfig.as_deref(),
            Some(std::path::Path::new("/etc/kube.conf"))
        );
        assert_eq!(k.label_selector, None);
    }

    #[cfg(feature = "kubernetes")]
    #[test]
    fn a_kubernetes_rollout_parses_and_bad_ones_are_refused() {
        let k8s = "driver:\n  kind: kubernetes\n  name: llama-engine\n";
        let c = ControllerConfig::parse(
            &format!("{k8s}kubernetesRollout:\n  route: llama\n  pools:\n    llama-pool: app=llama\n    next-pool: app=next\n"),
            "t",
        )
        .unwrap();
        let k = c.kubernetes_rollout.unwrap();
        assert_eq!(k.route, "llama");
        assert_eq!(k.pools["next-pool"], "app=next");
        let err = |y: &str| ControllerConfig::parse(y, "t").unwrap_err().to_string();
        assert!(err(&format!(
            "{k8s}kubernetesRollout:\n  pools: {{a: x, b: y}}\n"
        ))
        .contains("route is required"));
        assert!(err(&format!(
            "{k8s}kubernetesRollout:\n  route: r\n  pools: {{a: x}}\n"
        ))
        .contains("baseline"));
        assert!(err(&format!(
            "{k8s}kubernetesRollout:\n  route: r\n  pools: {{a: x, b: ' '}}\n"
        ))
        .contains("pools.b"));
        assert!(
            err("kubernetesRollout:\n  route: r\n  pools: {a: x, b: y}\n")
                .contains("driver.kind kubernetes")
        );
        assert!(err(&format!(
            "{k8s}kubernetesRollout:\n  route: r\n  bogus: 1\n"
        ))
        .contains("bogus"));
    }
}
