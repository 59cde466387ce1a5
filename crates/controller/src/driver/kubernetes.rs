//! The Kubernetes driver: replicas are the pods of a Deployment or a LeaderWorkerSet,
//! scaled through the API server.
//!
//! Every `reconcile(desired)` does, in order:
//!
//! 1. `GET .../NAME/scale`; when `spec.replicas` differs from `desired`, a merge patch
//!    `{"spec":{"replicas":desired}}` on the same `/scale` subresource. The workload's own
//!    controller creates or deletes the pods; on scale-in Kubernetes picks the victims.
//! 2. The pod selector: `driver.labelSelector` when set; else the Deployment's
//!    `spec.selector` (read once: it is immutable), or for a LeaderWorkerSet the scale's
//!    `status.selector` (the group leaders), falling back to the leader labels.
//! 3. `GET /api/v1/namespaces/NS/pods?labelSelector=...`, then the difference with the
//!    previous listing, one pod at a time:
//!    - gone (or `Failed`/`Succeeded`): deregistered first, then `Stopped` when it was
//!      terminating, `Exited` when it vanished unasked;
//!    - terminating (`metadata.deletionTimestamp`): deregistered at once, `Draining`;
//!    - a container's restart count grew: deregistered, `Exited`; it is registered again
//!      when its `Ready` condition comes back;
//!    - new: `Started`;
//!    - its `Ready` condition true and a pod IP: registered, `Ready` with
//!      `http://<podIP>:<port>` (`https://` with `https: true`);
//!    - not ready for `readyTimeoutSecs`: `NeverReady` and the pod is deleted, so the
//!      workload's controller replaces it.
//!
//! Only ready, non-terminating pods are ever registered with the router. Every API call is
//! bounded by `requestTimeoutSecs`; a failure is a [`DriverError::Api`] and leaves the
//! driver's view as it was, so the next reconcile simply tries again.
//!
//! `shutdown` deregisters every pod and leaves the workload at its current size: stopping
//! the controller (a restart, a rollout of the controller itself) must not take the
//! service down.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v1::Scale;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::{Deserialize, Serialize};

use super::{Driver, DriverError, ReplicaEvent, ReplicaInfo, ReplicaPhase, ReplicaRegistrar};

/// The API group and version of LeaderWorkerSets.
pub const LWS_API_VERSION: &str = "leaderworkerset.x-k8s.io/v1";
/// The label LeaderWorkerSet puts on its pods with the set's name.
pub const LWS_NAME_LABEL: &str = "leaderworkerset.sigs.k8s.io/name";
/// The label LeaderWorkerSet puts on its pods with the worker's index (0: the leader).
pub const LWS_WORKER_INDEX_LABEL: &str = "leaderworkerset.sigs.k8s.io/worker-index";

/// What the driver scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TargetKind {
    /// `apps/v1` Deployment: one pod per replica.
    #[serde(alias = "deployment")]
    Deployment,
    /// `leaderworkerset.x-k8s.io/v1` LeaderWorkerSet: one group per replica; its leader
    /// pod serves.
    #[serde(alias = "leaderworkerset", alias = "lws")]
    LeaderWorkerSet,
}

/// Settings of the Kubernetes driver (`driver: {kind: kubernetes, ...}` in
/// `controller.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct KubernetesDriverConfig {
    /// The namespace of the target and its pods.
    pub namespace: String,
    /// `Deployment` or `LeaderWorkerSet`.
    pub target_kind: TargetKind,
    /// The target's name (required).
    pub name: String,
    /// The port replicas serve the OpenAI API on (`http://<podIP>:<port>`).
    pub port: u16,
    /// Overrides the pod selector read from the target (`app=engine,tier=gpu`).
    pub label_selector: Option<String>,
    /// A pod not ready this many seconds after it appeared is deleted and reported.
    pub ready_timeout_secs: f64,
    /// The kubeconfig file; absent: `KUBECONFIG`, `~/.kube/config`, then in-cluster.
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context; absent: the file's current context.
    pub context: Option<String>,
    /// Longest wait for one API call.
    pub request_timeout_secs: f64,
    /// Replicas serve HTTPS: they are `https://<podIP>:<port>` (their certificates must
    /// name the pod IP, e.g. issued by cert-manager's CSI driver; `tls.caFile` verifies).
    pub https: bool,
}

impl Default for KubernetesDriverConfig {
    fn default() -> Self {
        KubernetesDriverConfig {
            namespace: "default".to_string(),
            target_kind: TargetKind::Deployment,
            name: String::new(),
            port: 8000,
            label_selector: None,
            ready_timeout_secs: 600.0,
            kubeconfig: None,
            context: None,
            request_timeout_secs: 10.0,
            https: false,
        }
    }
}

/// A Kubernetes-driver setting that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("driver.{key}: {message}")]
pub struct ConfigError {
    pub key: &'static str,
    pub message: String,
}

impl KubernetesDriverConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key, message: &str| ConfigError {
            key,
            message: message.to_string(),
        };
        if !is_dns_name(&self.name) {
            return Err(bad(
                "name",
                "the target's name is required: lowercase letters, digits, '-' and '.'",
            ));
        }
        if !is_dns_name(&self.namespace) || self.namespace.contains('.') {
            return Err(bad(
                "namespace",
                "must be a namespace name: lowercase letters, digits and '-'",
            ));
        }
        if self.port == 0 {
            return Err(bad("port", "must be 1 to 65535"));
        }
        if !(self.ready_timeout_secs.is_finite() && self.ready_timeout_secs >= 0.0) {
            return Err(bad("readyTimeoutSecs", "must be zero or more seconds"));
        }
        if !(self.request_timeout_secs.is_finite() && self.request_timeout_secs > 0.0) {
            return Err(bad(
                "requestTimeoutSecs",
                "must be a positive number of seconds",
            ));
        }
        if let Some(s) = &self.label_selector {
            if s.trim().is_empty() {
                return Err(bad(
                    "labelSelector",
                    "must not be empty (it would select every pod); leave it out instead",
                ));
            }
        }
        Ok(())
    }

    /// `requestTimeoutSecs` as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.request_timeout_secs)
    }
}

/// A DNS-1123 subdomain: what Kubernetes accepts as an object's name.
fn is_dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// Where a listed pod is, as the driver tracks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Track {
    /// Listed, not (or no longer) ready.
    Starting,
    /// Ready and registered with the router.
    Ready,
    /// Terminating: deregistered, waiting for it to go.
    Terminating,
    /// Deleted by this driver for never becoming ready; its end is not reported again.
    Deleted,
}

#[derive(Debug, Clone)]
struct TrackedPod {
    /// The pod's name: the replica id.
    name: String,
    /// `http://<podIP>:<port>`, empty until the pod has an IP.
    url: String,
    track: Track,
    /// Since when it has been waiting to be ready (first seen, or when it stopped being
    /// ready).
    waiting_since: Instant,
    /// Container restarts seen so far (summed over containers).
    restarts: i64,
}

/// What one listing says about one pod.
struct Observed {
    uid: String,
    name: String,
    ip: Option<String>,
    ready: bool,
    terminating: bool,
    /// `Failed` or `Succeeded`: it will not run again.
    finished: Option<String>,
    restarts: i64,
    last_exit: Option<String>,
}

impl Observed {
    fn from_pod(p: &Pod) -> Option<Observed> {
        let meta = &p.metadata;
        let name = meta.name.clone()?;
        let uid = meta.uid.clone().unwrap_or_else(|| name.clone());
        let status = p.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let ip = status
            .and_then(|s| s.pod_ip.clone())
            .filter(|ip| !ip.is_empty());
        let finished = status
            .and_then(|s| s.phase.as_deref())
            .filter(|ph| *ph == "Failed" || *ph == "Succeeded")
            .map(|ph| {
                let reason = status.and_then(|s| s.reason.as_deref()).unwrap_or("");
                if reason.is_empty() {
                    format!("pod {}", ph.to_lowercase())
                } else {
                    format!("pod {}: {reason}", ph.to_lowercase())
                }
            });
        let containers = status
            .and_then(|s| s.container_statuses.as_deref())
            .unwrap_or(&[]);
        let restarts = containers.iter().map(|c| i64::from(c.restart_count)).sum();
        let last_exit = containers
            .iter()
            .filter_map(|c| c.last_state.as_ref()?.terminated.as_ref())
            .map(|t| match &t.reason {
                Some(r) => format!("{r}, exit code {}", t.exit_code),
                None => format!("exit code {}", t.exit_code),
            })
            .next();
        Some(Observed {
            uid,
            name,
            ip,
            ready,
            terminating: meta.deletion_timestamp.is_some(),
            finished,
            restarts,
            last_exit,
        })
    }
}

/// Scales a Deployment or LeaderWorkerSet. See the module docs.
pub struct KubernetesDriver {
    cfg: KubernetesDriverConfig,
    client: kube::Client,
    registrar: Arc<dyn ReplicaRegistrar>,
    /// The pod selector, once known.
    selector: Option<String>,
    /// Listed pods by UID.
    pods: BTreeMap<String, TrackedPod>,
}

impl KubernetesDriver {
    /// A driver using the configured kubeconfig, or `kube::Config::infer` (the
    /// `KUBECONFIG` file, `~/.kube/config`, then the in-cluster service account).
    pub async fn new(
        cfg: KubernetesDriverConfig,
        registrar: Arc<dyn ReplicaRegistrar>,
    ) -> Result<KubernetesDriver, DriverError> {
        let options = KubeConfigOptions {
            context: cfg.context.clone(),
            ..KubeConfigOptions::default()
        };
        let config = match &cfg.kubeconfig {
            Some(path) => {
                let kc = Kubeconfig::read_from(path).map_err(|e| {
                    DriverError::Config(format!("kubeconfig {}: {e}", path.display()))
                })?;
                kube::Config::from_custom_kubeconfig(kc, &options)
                    .await
                    .map_err(|e| {
                        DriverError::Config(format!("kubeconfig {}: {e}", path.display()))
                    })?
            }
            None if cfg.context.is_some() => kube::Config::from_kubeconfig(&options)
                .await
                .map_err(|e| DriverError::Config(format!("kubeconfig: {e}")))?,
            None => kube::Config::infer().await.map_err(|e| {
                DriverError::Config(format!(
                    "no Kubernetes configuration (KUBECONFIG, ~/.kube/config, in-cluster): {e}"
                ))
            })?,
        };
        Self::with_config(cfg, config, registrar)
    }

    /// A driver talking to the API server `config` describes (tests point it at a mock).
    /// Every call is bounded by `requestTimeoutSecs` as a whole, whatever the client's own
    /// connect and read timeouts.
    pub fn with_config(
        cfg: KubernetesDriverConfig,
        config: kube::Config,
        registrar: Arc<dyn ReplicaRegistrar>,
    ) -> Result<KubernetesDriver, DriverError> {
        let client = kube::Client::try_from(config)
            .map_err(|e| DriverError::Config(format!("Kubernetes client: {e}")))?;
        Ok(KubernetesDriver {
            selector: cfg.label_selector.clone(),
            cfg,
            client,
            registrar,
            pods: BTreeMap::new(),
        })
    }

    /// The settings it runs with.
    pub fn config(&self) -> &KubernetesDriverConfig {
        &self.cfg
    }

    /// Its API server client (the rollout API shares it).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// Runs one API call, bounded by `requestTimeoutSecs`.
    async fn call<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, DriverError> {
        match tokio::time::timeout(self.cfg.request_timeout(), fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(DriverError::Api(format!("{what}: {}", describe(&e)))),
            Err(_) => Err(DriverError::Api(format!(
                "{what}: no answer within {} s",
                self.cfg.request_timeout_secs
            ))),
        }
    }

    fn target(&self) -> String {
        let kind = match self.cfg.target_kind {
            TargetKind::Deployment => "deployment",
            TargetKind::LeaderWorkerSet => "leaderworkerset",
        };
        format!("{kind} {}/{}", self.cfg.namespace, self.cfg.name)
    }

    fn lws_api(&self) -> Api<DynamicObject> {
        let resource = ApiResource {
            group: "leaderworkerset.x-k8s.io".to_string(),
            version: "v1".to_string(),
            api_version: LWS_API_VERSION.to_string(),
            kind: "LeaderWorkerSet".to_string(),
            plural: "leaderworkersets".to_string(),
        };
        Api::namespaced_with(self.client.clone(), &self.cfg.namespace, &resource)
    }

    fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), &self.cfg.namespace)
    }

    fn pods_api(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.cfg.namespace)
    }

    async fn get_scale(&self) -> Result<Scale, DriverError> {
        let what = format!("reading the scale of {}", self.target());
        let name = self.cfg.name.as_str();
        match self.cfg.target_kind {
            TargetKind::Deployment => {
                let api = self.deployments();
                self.call(&what, api.get_scale(name)).await
            }
            TargetKind::LeaderWorkerSet => {
                let api = self.lws_api();
                self.call(&what, api.get_scale(name)).await
            }
        }
    }

    async fn patch_scale(&self, replicas: i32) -> Result<Scale, DriverError> {
        let what = format!("scaling {} to {replicas}", self.target());
        let name = self.cfg.name.as_str();
        let params = PatchParams::default();
        let patch = Patch::Merge(serde_json::json!({ "spec": { "replicas": replicas } }));
        match self.cfg.target_kind {
            TargetKind::Deployment => {
                let api = self.deployments();
                self.call(&what, api.patch_scale(name, &params, &patch))
                    .await
            }
            TargetKind::LeaderWorkerSet => {
                let api = self.lws_api();
                self.call(&what, api.patch_scale(name, &params, &patch))
                    .await
            }
        }
    }

    /// The pod selector: configured, cached, or read from the target.
    async fn selector(&mut self, scale: &Scale) -> Result<String, DriverError> {
        if let Some(s) = &self.selector {
            return Ok(s.clone());
        }
        let selector = match self.cfg.target_kind {
            TargetKind::Deployment => {
                let api = self.deployments();
                let what = format!("reading {}", self.target());
                let d = self.call(&what, api.get(&self.cfg.name)).await?;
                let Some(spec) = d.spec else {
                    return Err(DriverError::Api(format!("{what}: it has no spec")));
                };
                let s = kube::core::Selector::try_from(spec.selector).map_err(|e| {
                    DriverError::Api(format!("{what}: its selector cannot be used: {e}"))
                })?;
                s.to_string()
            }
            TargetKind::LeaderWorkerSet => scale
                .status
                .as_ref()
                .and_then(|s| s.selector.clone())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| {
                    format!(
                        "{LWS_NAME_LABEL}={},{LWS_WORKER_INDEX_LABEL}=0",
                        self.cfg.name
                    )
                }),
        };
        if selector.trim().is_empty() {
            // An empty selector would list every pod in the namespace.
            return Err(DriverError::Api(format!(
                "{} has an empty pod selector; set driver.labelSelector",
                self.target()
            )));
        }
        // A Deployment's selector is immutable; an LWS's status may not be filled in yet,
        // so only its reported selector is kept.
        let keep = match self.cfg.target_kind {
            TargetKind::Deployment => true,
            TargetKind::LeaderWorkerSet => scale
                .status
                .as_ref()
                .and_then(|s| s.selector.as_deref())
                .is_some_and(|s| !s.is_empty()),
        };
        if keep {
            self.selector = Some(selector.clone());
        }
        Ok(selector)
    }

    async fn list_pods(&self, selector: &str) -> Result<Vec<Observed>, DriverError> {
        let api = self.pods_api();
        let params = ListParams::default().labels(selector);
        let what = format!("listing pods `{selector}` in {}", self.cfg.namespace);
        let list = self.call(&what, api.list(&params)).await?;
        Ok(list.items.iter().filter_map(Observed::from_pod).collect())
    }

    async fn delete_pod(&self, name: &str) -> Result<(), DriverError> {
        let api = self.pods_api();
        let what = format!("deleting pod {}/{name}", self.cfg.namespace);
        match tokio::time::timeout(
            self.cfg.request_timeout(),
            api.delete(name, &DeleteParams::default()),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            // Already gone: what was wanted.
            Ok(Err(kube::Error::Api(e))) if e.code == 404 => Ok(()),
            Ok(Err(e)) => Err(DriverError::Api(format!("{what}: {}", describe(&e)))),
            Err(_) => Err(DriverError::Api(format!(
                "{what}: no answer within {} s",
                self.cfg.request_timeout_secs
            ))),
        }
    }

    fn url(&self, ip: &str) -> String {
        let scheme = if self.cfg.https { "https" } else { "http" };
        if ip.contains(':') {
            format!("{scheme}://[{ip}]:{}", self.cfg.port)
        } else {
            format!("{scheme}://{ip}:{}", self.cfg.port)
        }
    }

    /// Folds one listing into the tracked pods; returns the events and the pods to delete
    /// for never becoming ready.
    fn observe(&mut self, listed: Vec<Observed>) -> (Vec<ReplicaEvent>, Vec<(String, String)>) {
        let mut events = Vec::new();
        let mut to_delete = Vec::new();
        let live: BTreeMap<String, Observed> = listed
            .into_iter()
            .filter(|o| {
                o.finished.is_none() || self.pods.contains_key(&o.uid) // report its end
            })
            .map(|o| (o.uid.clone(), o))
            .collect();

        // Gone first: the router stops sending to a pod before anything else happens.
        self.forget_gone(&live, &mut events);

        let ready_timeout = Duration::from_secs_f64(self.cfg.ready_timeout_secs);
        let now = Instant::now();
        for (uid, o) in live {
            if o.finished.is_some() {
                continue;
            }
            let url = o.ip.as_deref().map(|ip| self.url(ip)).unwrap_or_default();
            let p = self.pods.entry(uid).or_insert_with(|| {
                if !o.terminating {
                    events.push(ReplicaEvent::Started {
                        id: o.name.clone(),
                        url: url.clone(),
                    });
                }
                TrackedPod {
                    name: o.name.clone(),
                    url: url.clone(),
                    track: Track::Starting,
                    waiting_since: now,
                    restarts: o.restarts,
                }
            });
            if !url.is_empty() {
                p.url = url;
            }
            if p.follow(&*self.registrar, &o, now, ready_timeout, &mut events) {
                to_delete.push((p.name.clone(), o.uid.clone()));
            }
        }
        (events, to_delete)
    }

    /// Drops the tracked pods that left the listing or finished (`Failed`/`Succeeded`),
    /// deregistering a ready one first. Its end is `Stopped` when it was terminating (asked
    /// to go), `Exited` with the pod's status when it went unasked, and nothing for a pod
    /// this driver deleted (already reported as `NeverReady`).
    fn forget_gone(&mut self, live: &BTreeMap<String, Observed>, events: &mut Vec<ReplicaEvent>) {
        let gone: Vec<String> = self
            .pods
            .keys()
            .filter(|uid| live.get(*uid).is_none_or(|o| o.finished.is_some()))
            .cloned()
            .collect();
        for uid in gone {
            let Some(p) = self.pods.remove(&uid) else {
                continue;
            };
            if p.track == Track::Ready {
                self.registrar.deregister(&p.name);
            }
            match p.track {
                Track::Terminating => events.push(ReplicaEvent::Stopped {
                    id: p.name,
                    forced: false,
                }),
                Track::Deleted => {}
                Track::Starting | Track::Ready => {
                    let status = live
                        .get(&uid)
                        .and_then(|o| o.finished.clone())
                        .unwrap_or_else(|| "pod deleted".to_string());
                    events.push(ReplicaEvent::Exited { id: p.name, status });
                }
            }
        }
    }
}

impl TrackedPod {
    /// Applies one listing of a pod that is still there: terminating, restarted, then its
    /// readiness. Returns true when it has waited `ready_timeout` without becoming ready
    /// and is to be deleted. A pod already deleted or terminating only waits to go.
    fn follow(
        &mut self,
        registrar: &dyn ReplicaRegistrar,
        o: &Observed,
        now: Instant,
        ready_timeout: Duration,
        events: &mut Vec<ReplicaEvent>,
    ) -> bool {
        if self.track == Track::Deleted || self.track == Track::Terminating {
            return false;
        }
        if o.terminating {
            self.drain(registrar, events);
            return false;
        }
        if o.restarts > self.restarts {
            self.restarted(registrar, o, now, events);
        }
        self.follow_readiness(registrar, o.ready, now, ready_timeout, events)
    }

    /// The pod is terminating (`deletionTimestamp`): no more traffic, at once.
    fn drain(&mut self, registrar: &dyn ReplicaRegistrar, events: &mut Vec<ReplicaEvent>) {
        if self.track == Track::Ready {
            registrar.deregister(&self.name);
        }
        self.track = Track::Terminating;
        events.push(ReplicaEvent::Draining {
            id: self.name.clone(),
        });
    }

    /// A container restarted: the replica it served exited (with the container's last exit
    /// when known). It is deregistered and registered again once `Ready` comes back.
    fn restarted(
        &mut self,
        registrar: &dyn ReplicaRegistrar,
        o: &Observed,
        now: Instant,
        events: &mut Vec<ReplicaEvent>,
    ) {
        if self.track == Track::Ready {
            registrar.deregister(&self.name);
        }
        let status = match &o.last_exit {
            Some(exit) => format!("container restarted: {exit}"),
            None => "container restarted".to_string(),
        };
        events.push(ReplicaEvent::Exited {
            id: self.name.clone(),
            status,
        });
        self.restarts = o.restarts;
        if self.track == Track::Ready {
            // A crash-looping pod that never got ready keeps its first deadline.
            self.track = Track::Starting;
            self.waiting_since = now;
        }
    }

    /// Registers the pod once it is `Ready` with an IP and deregisters it when it stops
    /// being so. Returns true when it has been waiting for `ready_timeout`.
    fn follow_readiness(
        &mut self,
        registrar: &dyn ReplicaRegistrar,
        ready: bool,
        now: Instant,
        ready_timeout: Duration,
        events: &mut Vec<ReplicaEvent>,
    ) -> bool {
        let serving = ready && !self.url.is_empty();
        match (self.track, serving) {
            (Track::Starting, true) => {
                self.track = Track::Ready;
                let info = ReplicaInfo {
                    id: self.name.clone(),
                    url: self.url.clone(),
                    phase: ReplicaPhase::Ready,
                };
                registrar.register(&info);
                events.push(ReplicaEvent::Ready {
                    id: info.id,
                    url: info.url,
                    after_secs: now.duration_since(self.waiting_since).as_secs_f64(),
                });
                false
            }
            (Track::Ready, false) => {
                // Its readiness probe fails: no traffic until it passes again.
                registrar.deregister(&self.name);
                tracing::warn!(pod = %self.name, "pod no longer ready: deregistered");
                self.track = Track::Starting;
                self.waiting_since = now;
                false
            }
            (Track::Starting, false) => now.duration_since(self.waiting_since) >= ready_timeout,
            _ => false,
        }
    }
}

/// A short description of a client error (the API server's message when it sent one).
fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(r) if !r.message.is_empty() => {
            format!("{} {}: {}", r.code, r.reason, r.message)
        }
        kube::Error::Api(r) => format!("{} {}", r.code, r.reason),
        other => other.to_string(),
    }
}

impl Driver for KubernetesDriver {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    async fn reconcile(&mut self, desired: u32) -> Result<Vec<ReplicaEvent>, DriverError> {
        let want = i32::try_from(desired).unwrap_or(i32::MAX);
        let scale = self.get_scale().await?;
        let have = scale.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
        let scale = if have != want {
            tracing::info!(target = %self.target(), from = have, to = want, "scaling");
            self.patch_scale(want).await?
        } else {
            scale
        };
        let selector = self.selector(&scale).await?;
        let listed = self.list_pods(&selector).await?;
        let (mut events, to_delete) = self.observe(listed);
        for (name, uid) in to_delete {
            if let Err(e) = self.delete_pod(&name).await {
                // Reported when the deletion goes through, on a later reconcile.
                for e in &events {
                    super::local::log_event(e);
                }
                return Err(e);
            }
            if let Some(p) = self.pods.get_mut(&uid) {
                p.track = Track::Deleted;
                events.push(ReplicaEvent::NeverReady {
                    id: name,
                    waited_secs: p.waiting_since.elapsed().as_secs_f64(),
                });
            }
        }
        Ok(events)
    }

    fn replicas(&self) -> Vec<ReplicaInfo> {
        self.pods
            .values()
            .filter_map(|p| {
                let phase = match p.track {
                    Track::Starting => ReplicaPhase::Starting,
                    Track::Ready => ReplicaPhase::Ready,
                    Track::Terminating => ReplicaPhase::Draining,
                    Track::Deleted => return None,
                };
                Some(ReplicaInfo {
                    id: p.name.clone(),
                    url: p.url.clone(),
                    phase,
                })
            })
            .collect()
    }

    /// Deregisters every pod; the workload keeps its size (see the module docs).
    async fn shutdown(&mut self) -> Vec<ReplicaEvent> {
        for p in self.pods.values() {
            if p.track == Track::Ready {
                self.registrar.deregister(&p.name);
            }
        }
        tracing::info!(
            target = %self.target(),
            pods = self.pods.len(),
            "controller stopping: pods deregistered, the workload keeps its size"
        );
        self.pods.clear();
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        let ok = KubernetesDriverConfig {
            name: "engine".into(),
            ..KubernetesDriverConfig::default()
        };
        ok.validate().unwrap();
        let key = |c: KubernetesDriverConfig| c.validate().unwrap_err().key;
        assert_eq!(key(KubernetesDriverConfig::default()), "name");
        assert_eq!(
            key(KubernetesDriverConfig {
                name: "Engine".into(),
                ..ok.clone()
            }),
            "name"
        );
        assert_eq!(
            key(KubernetesDriverConfig {
                namespace: "a.b".into(),
                ..ok.clone()
            }),
            "namespace"
        );
        assert_eq!(
            key(KubernetesDriverConfig {
                port: 0,
                ..ok.clone()
            }),
            "port"
        );
        assert_eq!(
            key(KubernetesDriverConfig {
                request_timeout_secs: 0.0,
                ..ok.clone()
            }),
            "requestTimeoutSecs"
        );
        assert_eq!(
            key(KubernetesDriverConfig {
                ready_timeout_secs: f64::NAN,
                ..ok.clone()
            }),
            "readyTimeoutSecs"
        );
        assert_eq!(
            key(KubernetesDriverConfig {
                label_selector: Some(" ".into()),
                ..ok
            }),
            "labelSelector"
        );
    }

    #[test]
    fn target_kinds_parse_in_either_spelling() {
        for (text, kind) in [
            ("Deployment", TargetKind::Deployment),
            ("deployment", TargetKind::Deployment),
            ("LeaderWorkerSet", TargetKind::LeaderWorkerSet),
            ("lws", TargetKind::LeaderWorkerSet),
        ] {
            let k: TargetKind = serde_yaml::from_str(text).unwrap();
            assert_eq!(k, kind, "{text}");
        }
        assert!(serde_yaml::from_str::<TargetKind>("StatefulSet").is_err());
    }
}
