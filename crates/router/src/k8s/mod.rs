//! Endpoint discovery from Kubernetes: the router's endpoints are the Ready pods an
//! `InferencePool` (`inference.networking.k8s.io/v1`) selects, as the Gateway API Inference
//! Extension's endpoint picker finds them.
//!
//! How it runs ([`run`]), every API call bounded by `request_timeout`:
//!
//! 1. `GET` the pool: `spec.selector.matchLabels` and `spec.targetPorts[].number`;
//! 2. `LIST` the pods matching the selector, which gives a resource version;
//! 3. `WATCH` the pods from that version and the pool by name, at once. Each pod event
//!    updates the view and the router's endpoint set is re-synced from it: a pod counts
//!    when its `Ready` condition is true, it has a pod IP, it is not terminating
//!    (`deletionTimestamp`) and its phase is not `Failed`/`Succeeded`; it gets one
//!    endpoint `http://<podIP>:<port>` per target port;
//! 4. a watch that ends (the API server closes watches at its timeout) is resumed from the
//!    last resource version seen; one answered `410 Gone` (the version is too old) starts
//!    over at 1; a changed pool selector or port list starts over at 1 too; a deleted
//!    pool removes every endpoint until it comes back.
//!
//! Failures are retried with a capped backoff; the endpoint set is left as it was while
//! the API is unreachable, so a control-plane outage does not stop routing.
//!
//! Per-pod settings: the engine kind from the label
//! `inference.networking.k8s.io/engine-type` (default `vllm`); a KV-event publisher from the
//! annotation `strata.dev/kv-events` (and its replay socket from
//! `strata.dev/kv-events-replay`): a port (`5557`) or a ZMQ endpoint whose host may be `*`
//! (`tcp://*:5557`), both meaning that port on the pod's IP.

use std::collections::BTreeMap;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, WatchEvent, WatchParams};
use kube::core::GroupVersionKind;
use serde::Deserialize;

use crate::endpoint::{EndpointSpec, EngineKind};
use crate::router::Router;

pub mod objectives;

/// The InferencePool API group/version.
pub const POOL_API_VERSION: &str = "inference.networking.k8s.io/v1";
/// Pod label naming the engine software.
pub use strata_api::model_server::ENGINE_TYPE_LABEL;
/// Pod label naming a pod's disaggregation role (`prefill`, `decode`, `both`), as llm-d's
/// charts set it; the P/D profile pair reads it (the chart's `strata.roleLabel`).
pub const ROLE_LABEL: &str = "llm-d.ai/role";
/// Pod annotation naming the KV-event publisher.
pub const KV_EVENTS_ANNOTATION: &str = "strata.dev/kv-events";
/// Pod annotation naming the KV-event replay socket.
pub const KV_REPLAY_ANNOTATION: &str = "strata.dev/kv-events-replay";

/// Discovery errors (all retried by [`run`]).
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("Kubernetes API: {0}")]
    Api(String),
    #[error("Kubernetes API call timed out after {0:?}")]
    Timeout(Duration),
    #[error("InferencePool {0}: {1}")]
    Pool(String, String),
    #[error("Kubernetes client: {0}")]
    Config(String),
}

/// Which pool to follow.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    pub name: String,
    pub namespace: String,
    /// Bound on every API call except a watch's lifetime.
    pub request_timeout: Duration,
    /// Server-side watch timeout (the server ends the watch; it is resumed).
    pub watch_timeout_s: u32,
    /// Longest wait between retries.
    pub max_backoff: Duration,
    /// Kind of pods without the engine-type label.
    pub default_kind: EngineKind,
    /// Pods serve `https://` (verified as the router's `upstream_tls` says: their
    /// certificates must name the pod IP); default `http://`.
    pub https: bool,
}

impl DiscoveryConfig {
    pub fn new(name: impl Into<String>, namespace: impl Into<String>) -> DiscoveryConfig {
        DiscoveryConfig {
            name: name.into(),
            namespace: namespace.into(),
            request_timeout: Duration::from_secs(10),
            watch_timeout_s: 240,
            max_backoff: Duration::from_secs(5),
            default_kind: EngineKind::Vllm,
            https: false,
        }
    }
}

/// The parts of an InferencePool's spec the router reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolSpec {
    pub match_labels: BTreeMap<String, String>,
    pub target_ports: Vec<u16>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSelector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct RawPort {
    number: i64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPoolSpec {
    selector: RawSelector,
    #[serde(default)]
    target_ports: Vec<RawPort>,
}

impl PoolSpec {
    /// Reads `spec` of an InferencePool object.
    pub fn from_object(obj: &DynamicObject) -> Result<PoolSpec, String> {
        let spec = obj.data.get("spec").ok_or("no spec")?;
        let raw: RawPoolSpec =
            serde_json::from_value(spec.clone()).map_err(|e| format!("spec: {e}"))?;
        if raw.selector.match_labels.is_empty() {
            return Err("spec.selector.matchLabels is empty".into());
        }
        if raw.target_ports.is_empty() || raw.target_ports.len() > 8 {
            return Err("spec.targetPorts must hold 1 to 8 ports".into());
        }
        let mut target_ports = Vec::new();
        for p in raw.target_ports {
            let n = u16::try_from(p.number)
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("target port {} is out of range", p.number))?;
            target_ports.push(n);
        }
        Ok(PoolSpec {
            match_labels: raw.selector.match_labels,
            target_ports,
        })
    }

    /// `k=v,k=v` for a label-selected list or watch.
    pub fn label_selector(&self) -> String {
        self.match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// What the router needs of one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub ip: Option<String>,
    pub serving: bool,
    pub kind: Option<String>,
    /// [`ROLE_LABEL`]'s value.
    pub role: Option<String>,
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
}

impl PodView {
    pub fn from_pod(p: &Pod) -> PodView {
        let meta = &p.metadata;
        let status = p.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let finished = status
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|ph| ph == "Failed" || ph == "Succeeded");
        let ip = status
            .and_then(|s| s.pod_ip.clone())
            .filter(|ip| !ip.is_empty());
        let annotation = |k: &str| meta.annotations.as_ref().and_then(|a| a.get(k)).cloned();
        let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k)).cloned();
        PodView {
            serving: ready && !finished && meta.deletion_timestamp.is_none() && ip.is_some(),
            ip,
            kind: label(ENGINE_TYPE_LABEL),
            role: label(ROLE_LABEL).filter(|r| !r.is_empty()),
            kv_events: annotation(KV_EVENTS_ANNOTATION),
            kv_replay: annotation(KV_REPLAY_ANNOTATION),
        }
    }
}

/// A ZMQ endpoint on the pod's IP from an annotation value (`5557`, `tcp://*:5557`,
/// `tcp://:5557`, or a full `tcp://host:port`, kept as given).
pub fn zmq_endpoint(value: &str, ip: &str) -> Option<String> {
    let v = value.trim();
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    if let Ok(port) = v.parse::<u16>() {
        return Some(format!("tcp://{host}:{port}"));
    }
    let rest = v.strip_prefix("tcp://")?;
    let (h, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    if h.is_empty() || h == "*" || h == "0.0.0.0" {
        Some(format!("tcp://{host}:{port}"))
    } else {
        Some(v.to_string())
    }
}

/// The pool and its pods as last seen: pure, so the diffing is tested without a server.
#[derive(Debug, Clone, Default)]
pub struct PoolView {
    pub pool: Option<PoolSpec>,
    pub pods: BTreeMap<String, PodView>,
}

impl PoolView {
    /// Applies one pod event.
    pub fn apply(&mut self, event: &WatchEvent<Pod>) {
        match event {
            WatchEvent::Added(p) | WatchEvent::Modified(p) => {
                if let Some(name) = p.metadata.name.clone() {
                    self.pods.insert(name, PodView::from_pod(p));
                }
            }
            WatchEvent::Deleted(p) => {
                if let Some(name) = &p.metadata.name {
                    self.pods.remove(name);
                }
            }
            WatchEvent::Bookmark(_) | WatchEvent::Error(_) => {}
        }
    }

    /// [`PoolView::endpoints`], their URLs `https://` when `https`.
    pub fn endpoints_over(&self, default_kind: EngineKind, https: bool) -> Vec<EndpointSpec> {
        let mut out = self.endpoints(default_kind);
        if https {
            for s in &mut out {
                s.url = format!("https://{}", crate::endpoint::strip_scheme(&s.url));
            }
        }
        out
    }

    /// The endpoints of the serving pods, one per target port, sorted by URL.
    pub fn endpoints(&self, default_kind: EngineKind) -> Vec<EndpointSpec> {
        let Some(pool) = &self.pool else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (name, pod) in &self.pods {
            let (true, Some(ip)) = (pod.serving, pod.ip.as_deref()) else {
                continue;
            };
            let kind = match pod.kind.as_deref().map(str::parse::<EngineKind>) {
                Some(Ok(k)) => k,
                Some(Err(_)) => {
                    tracing::warn!(pod = %name, "unknown engine-type label; using the default kind");
                    default_kind
                }
                None => default_kind,
            };
            let host = if ip.contains(':') {
                format!("[{ip}]")
            } else {
                ip.to_string()
            };
            for port in &pool.target_ports {
                let mut spec = EndpointSpec::new(format!("http://{host}:{port}"), kind);
                spec.role = pod.role.clone();
                spec.kv_events = pod.kv_events.as_deref().and_then(|v| zmq_endpoint(v, ip));
                spec.kv_events_replay = pod.kv_replay.as_deref().and_then(|v| zmq_endpoint(v, ip));
                spec.labels.insert("pod".into(), name.clone());
                out.push(spec);
            }
        }
        out.sort_by(|a, b| a.url.cmp(&b.url));
        out
    }
}

fn pool_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"),
        "inferencepools",
    )
}

fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(r) if !r.message.is_empty() => format!("{} {}", r.code, r.message),
        kube::Error::Api(r) => format!("{} {}", r.code, r.reason),
        other => other.to_string(),
    }
}

/// One watch's events, as the API client streams them.
type Events<K> = Pin<Box<dyn Stream<Item = Result<WatchEvent<K>, kube::Error>> + Send>>;

/// [`Pace`]'s index of the pod watch.
const POD_WATCH: usize = 0;
/// [`Pace`]'s index of the pool watch.
const POOL_WATCH: usize = 1;

/// When each watch was (re)opened, and how many in a row ended at once: a server that
/// ends watches as soon as they open must not be re-asked in a busy loop.
struct Pace {
    opened: [tokio::time::Instant; 2],
    /// The last watch to end, and whether it ended within a second of opening; `None`
    /// once accounted for.
    ended: Option<bool>,
    quick_ends: u32,
}

impl Pace {
    fn new() -> Pace {
        Pace {
            opened: [tokio::time::Instant::now(); 2],
            ended: None,
            quick_ends: 0,
        }
    }

    /// Watch `which` is being (re)opened now.
    fn opened(&mut self, which: usize) {
        self.opened[which] = tokio::time::Instant::now();
    }

    /// Watch `which` ended (or went quiet, or broke).
    fn ended(&mut self, which: usize) {
        self.ended = Some(self.opened[which].elapsed() < Duration::from_secs(1));
    }

    /// Before reopening: after a watch that ended at once, waits longer each time in a
    /// row (up to `max_backoff`), and breaks for a relist after the sixth; a watch that
    /// lasted resets the count.
    async fn before_reopening(&mut self, max_backoff: Duration) -> ControlFlow<()> {
        match self.ended.take() {
            Some(true) => {
                self.quick_ends += 1;
                if self.quick_ends > 5 {
                    tracing::warn!("watches keep ending at once; relisting");
                    return ControlFlow::Break(());
                }
                let wait = Duration::from_millis(50 << self.quick_ends);
                tokio::time::sleep(wait.min(max_backoff)).await;
            }
            Some(false) => self.quick_ends = 0,
            None => {}
        }
        ControlFlow::Continue(())
    }
}

/// Follows one InferencePool and keeps the router's endpoints equal to its serving pods
/// (plus `fixed`, the endpoints given on the command line).
pub struct Discovery {
    cfg: DiscoveryConfig,
    pools: Api<DynamicObject>,
    pods: Api<Pod>,
    router: Router,
    fixed: Vec<EndpointSpec>,
    view: PoolView,
}

impl Discovery {
    pub fn new(
        cfg: DiscoveryConfig,
        client: kube::Client,
        router: Router,
        fixed: Vec<EndpointSpec>,
    ) -> Discovery {
        Discovery {
            pools: Api::namespaced_with(client.clone(), &cfg.namespace, &pool_resource()),
            pods: Api::namespaced(client, &cfg.namespace),
            cfg,
            router,
            fixed,
            view: PoolView::default(),
        }
    }

    /// A client from the in-cluster service account or the local kubeconfig.
    pub async fn infer_client() -> Result<kube::Client, DiscoveryError> {
        let config = kube::Config::infer()
            .await
            .map_err(|e| DiscoveryError::Config(e.to_string()))?;
        kube::Client::try_from(config).map_err(|e| DiscoveryError::Config(e.to_string()))
    }

    /// The current view.
    pub fn view(&self) -> &PoolView {
        &self.view
    }

    async fn call<T>(
        &self,
        fut: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, DiscoveryError> {
        match tokio::time::timeout(self.cfg.request_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(DiscoveryError::Api(describe(&e))),
            Err(_) => Err(DiscoveryError::Timeout(self.cfg.request_timeout)),
        }
    }

    fn sync(&self) {
        let mut all = self.fixed.clone();
        for s in self
            .view
            .endpoints_over(self.cfg.default_kind, self.cfg.https)
        {
            if !all.iter().any(|f| f.url == s.url) {
                all.push(s);
            }
        }
        self.router.sync_endpoints(&all);
    }

    /// Reads the pool and lists its pods; returns the resource versions to watch from
    /// (pool, pods).
    async fn relist(&mut self) -> Result<(String, String), DiscoveryError> {
        let name = self.cfg.name.clone();
        let obj = match self.call(self.pools.get(&name)).await {
            Ok(o) => o,
            Err(e) => {
                // A missing pool has no endpoints; anything else leaves them as they are.
                if matches!(&e, DiscoveryError::Api(m) if m.starts_with("404")) {
                    self.view = PoolView::default();
                    self.sync();
                }
                return Err(e);
            }
        };
        let spec = PoolSpec::from_object(&obj).map_err(|e| DiscoveryError::Pool(name, e))?;
        let pool_rv = obj.metadata.resource_version.clone().unwrap_or_default();
        let lp = ListParams::default().labels(&spec.label_selector());
        let list = self.call(self.pods.list(&lp)).await?;
        let mut view = PoolView {
            pool: Some(spec),
            pods: BTreeMap::new(),
        };
        for p in &list.items {
            view.apply(&WatchEvent::Added(p.clone()));
        }
        self.view = view;
        self.sync();
        Ok((pool_rv, list.metadata.resource_version.unwrap_or_default()))
    }

    /// Watches pods and the pool from the given versions until something calls for a
    /// relist (then returns); ended watches are resumed from the last version seen.
    async fn watch(&mut self, mut pool_rv: String, mut pods_rv: String) {
        let Some(spec) = self.view.pool.clone() else {
            return;
        };
        let pod_params = WatchParams::default()
            .labels(&spec.label_selector())
            .timeout(self.cfg.watch_timeout_s);
        let pool_params = WatchParams::default()
            .fields(&format!("metadata.name={}", self.cfg.name))
            .timeout(self.cfg.watch_timeout_s);
        // A watch the server holds open longer than its own timeout (plus slack) is dead.
        let idle = Duration::from_secs(u64::from(self.cfg.watch_timeout_s) + 30);
        let mut pods: Option<Events<Pod>> = None;
        let mut pools: Option<Events<DynamicObject>> = None;
        let mut pace = Pace::new();
        loop {
            if pace.before_reopening(self.cfg.max_backoff).await.is_break() {
                return;
            }
            if pods.is_none() {
                pace.opened(POD_WATCH);
                match self.call(self.pods.watch(&pod_params, &pods_rv)).await {
                    Ok(s) => pods = Some(Box::pin(s)),
                    Err(e) => {
                        tracing::warn!(error = %e, "pod watch failed");
                        return;
                    }
                }
            }
            if pools.is_none() {
                pace.opened(POOL_WATCH);
                match self.call(self.pools.watch(&pool_params, &pool_rv)).await {
                    Ok(s) => pools = Some(Box::pin(s)),
                    Err(e) => {
                        tracing::warn!(error = %e, "pool watch failed");
                        return;
                    }
                }
            }
            let (Some(pod_stream), Some(pool_stream)) = (pods.as_mut(), pools.as_mut()) else {
                return;
            };
            tokio::select! {
                ev = tokio::time::timeout(idle, pod_stream.next()) => match ev {
                    Ok(Some(Ok(ev))) => {
                        if self.on_pod_event(ev, &mut pods_rv).is_break() {
                            return;
                        }
                    }
                    // Ended (server timeout, connection closed) or went quiet: resume.
                    Ok(None) | Err(_) => {
                        pods = None;
                        pace.ended(POD_WATCH);
                    }
                    Ok(Some(Err(e))) => {
                        tracing::warn!(error = %describe(&e), "pod watch broke; resuming");
                        pods = None;
                        pace.ended(POD_WATCH);
                    }
                },
                ev = tokio::time::timeout(idle, pool_stream.next()) => match ev {
                    Ok(Some(Ok(ev))) => {
                        if self.on_pool_event(ev, &mut pool_rv, &spec).is_break() {
                            return;
                        }
                    }
                    Ok(None) | Err(_) => {
                        pools = None;
                        pace.ended(POOL_WATCH);
                    }
                    Ok(Some(Err(e))) => {
                        tracing::warn!(error = %describe(&e), "pool watch broke; resuming");
                        pools = None;
                        pace.ended(POOL_WATCH);
                    }
                },
            }
        }
    }

    /// One pod event: the view and the router's endpoints follow it, and `pods_rv` moves
    /// to its version. An error event breaks off the watch for a relist.
    fn on_pod_event(&mut self, ev: WatchEvent<Pod>, pods_rv: &mut String) -> ControlFlow<()> {
        match &ev {
            WatchEvent::Error(e) => {
                tracing::info!(code = e.code, message = %e.message, "pod watch error; relisting");
                return ControlFlow::Break(());
            }
            WatchEvent::Bookmark(b) => *pods_rv = b.metadata.resource_version.clone(),
            WatchEvent::Added(p) | WatchEvent::Modified(p) | WatchEvent::Deleted(p) => {
                if let Some(rv) = &p.metadata.resource_version {
                    *pods_rv = rv.clone();
                }
            }
        }
        self.view.apply(&ev);
        self.sync();
        ControlFlow::Continue(())
    }

    /// One event of the pool itself (`spec` as last listed): a deleted pool removes every
    /// endpoint, and a changed selector or port list breaks off the watch for a relist, as
    /// does an error event; an unreadable one keeps the last spec.
    fn on_pool_event(
        &mut self,
        ev: WatchEvent<DynamicObject>,
        pool_rv: &mut String,
        spec: &PoolSpec,
    ) -> ControlFlow<()> {
        match ev {
            WatchEvent::Error(e) => {
                tracing::info!(code = e.code, message = %e.message, "pool watch error; relisting");
                return ControlFlow::Break(());
            }
            WatchEvent::Bookmark(b) => *pool_rv = b.metadata.resource_version.clone(),
            WatchEvent::Deleted(_) => {
                tracing::info!(pool = %self.cfg.name, "InferencePool deleted");
                self.view = PoolView::default();
                self.sync();
                return ControlFlow::Break(());
            }
            WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                if let Some(rv) = &o.metadata.resource_version {
                    *pool_rv = rv.clone();
                }
                match PoolSpec::from_object(&o) {
                    Ok(s) if s == *spec => {}
                    Ok(_) => {
                        tracing::info!(pool = %self.cfg.name, "InferencePool changed; relisting");
                        return ControlFlow::Break(());
                    }
                    Err(e) => {
                        tracing::warn!(pool = %self.cfg.name, error = %e, "InferencePool unreadable; keeping the last one");
                    }
                }
            }
        }
        ControlFlow::Continue(())
    }

    /// Runs until the task is dropped.
    pub async fn run(mut self) {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.relist().await {
                Ok((pool_rv, pods_rv)) => {
                    backoff = Duration::from_millis(100);
                    tracing::info!(
                        pool = %self.cfg.name,
                        endpoints = self.view.endpoints(self.cfg.default_kind).len(),
                        "InferencePool listed"
                    );
                    self.watch(pool_rv, pods_rv).await;
                }
                Err(e) => {
                    tracing::warn!(pool = %self.cfg.name, error = %e, "InferencePool discovery failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.cfg.max_backoff);
                }
            }
        }
    }
}

/// Starts discovery on the current runtime.
pub fn spawn(discovery: Discovery) -> tokio::task::JoinHandle<()> {
    tokio::spawn(discovery.run())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, ip: Option<&str>, ready: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": "vllm"}},
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]
            }
        }))
        .unwrap()
    }

    fn pool_view() -> PoolView {
        PoolView {
            pool: Some(PoolSpec {
                match_labels: [("app".to_string(), "vllm".to_string())].into(),
                target_ports: vec![8000],
            }),
            pods: BTreeMap::new(),
        }
    }

    #[test]
    fn only_ready_pods_with_an_ip_count() {
        let mut v = pool_view();
        v.apply(&WatchEvent::Added(pod("a", Some("10.0.0.1"), true)));
        v.apply(&WatchEvent::Added(pod("b", Some("10.0.0.2"), false)));
        v.apply(&WatchEvent::Added(pod("c", None, true)));
        let urls: Vec<String> = v
            .endpoints(EngineKind::Vllm)
            .into_iter()
            .map(|s| s.url)
            .collect();
        assert_eq!(urls, vec!["http://10.0.0.1:8000"]);
        v.apply(&WatchEvent::Modified(pod("b", Some("10.0.0.2"), true)));
        assert_eq!(v.endpoints(EngineKind::Vllm).len(), 2);
        v.apply(&WatchEvent::Deleted(pod("a", Some("10.0.0.1"), true)));
        let urls: Vec<String> = v
            .endpoints(EngineKind::Vllm)
            .into_iter()
            .map(|s| s.url)
            .collect();
        assert_eq!(urls, vec!["http://10.0.0.2:8000"]);
        let over_tls = v.endpoints_over(EngineKind::Vllm, true);
        assert_eq!(over_tls[0].url, "https://10.0.0.2:8000");
        assert_eq!(over_tls[0].authority(), "10.0.0.2:8000");
    }

    #[test]
    fn a_pods_role_label_is_its_endpoints_role() {
        let mut v = pool_view();
        let with_role = |name: &str, ip: &str, role: &str| {
            let mut p = pod(name, Some(ip), true);
            if let Some(l) = p.metadata.labels.as_mut() {
                l.insert(ROLE_LABEL.into(), role.into());
            }
            p
        };
        v.apply(&WatchEvent::Added(with_role("p", "10.0.0.1", "prefill")));
        v.apply(&WatchEvent::Added(with_role("d", "10.0.0.2", "decode")));
        v.apply(&WatchEvent::Added(pod("x", Some("10.0.0.3"), true)));
        let roles: Vec<(String, Option<String>)> = v
            .endpoints(EngineKind::Vllm)
            .into_iter()
            .map(|s| (s.url, s.role))
            .collect();
        assert_eq!(
            roles,
            vec![
                ("http://10.0.0.1:8000".into(), Some("prefill".into())),
                ("http://10.0.0.2:8000".into(), Some("decode".into())),
                ("http://10.0.0.3:8000".into(), None),
            ]
        );
    }

    #[test]
    fn terminating_and_finished_pods_are_dropped() {
        let mut v = pool_view();
        let mut p = pod("a", Some("10.0.0.1"), true);
        p.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-12-01T00:00:00Z")).unwrap();
        v.apply(&WatchEvent::Modified(p));
        let mut q = pod("b", Some("10.0.0.2"), true);
        if let Some(s) = q.status.as_mut() {
            s.phase = Some("Failed".into());
        }
        v.apply(&WatchEvent::Modified(q));
        assert!(v.endpoints(EngineKind::Vllm).is_empty());
    }

    #[test]
    fn kinds_ports_and_kv_annotations() {
        let mut v = pool_view();
        v.pool.as_mut().unwrap().target_ports = vec![8000, 8001];
        let mut p = pod("a", Some("10.0.0.1"), true);
        p.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(ENGINE_TYPE_LABEL.into(), "sglang".into());
        p.metadata.annotations = Some(
            [
                (KV_EVENTS_ANNOTATION.to_string(), "tcp://*:5557".to_string()),
                (KV_REPLAY_ANNOTATION.to_string(), "5558".to_string()),
            ]
            .into(),
        );
        v.apply(&WatchEvent::Added(p));
        let e = v.endpoints(EngineKind::Vllm);
        assert_eq!(e.len(), 2);
        assert_eq!(e[1].url, "http://10.0.0.1:8001");
        assert_eq!(e[0].kind, EngineKind::Sglang);
        assert_eq!(e[0].kv_events.as_deref(), Some("tcp://10.0.0.1:5557"));
        assert_eq!(
            e[0].kv_events_replay.as_deref(),
            Some("tcp://10.0.0.1:5558")
        );
    }

    #[test]
    fn zmq_endpoints_from_annotations() {
        assert_eq!(
            zmq_endpoint("5557", "fd00::1").as_deref(),
            Some("tcp://[fd00::1]:5557")
        );
        assert_eq!(
            zmq_endpoint("tcp://:1", "1.2.3.4").as_deref(),
            Some("tcp://1.2.3.4:1")
        );
        assert_eq!(
            zmq_endpoint("tcp://9.9.9.9:1", "1.2.3.4").as_deref(),
            Some("tcp://9.9.9.9:1")
        );
        assert_eq!(zmq_endpoint("nonsense", "1.2.3.4"), None);
    }

    #[test]
    fn pool_spec_is_checked() {
        let obj = |spec: serde_json::Value| -> DynamicObject {
            serde_json::from_value(json!({
                "apiVersion": POOL_API_VERSION, "kind": "InferencePool",
                "metadata": {"name": "p"}, "spec": spec
            }))
            .unwrap()
        };
        let ok = PoolSpec::from_object(&obj(json!({
            "selector": {"matchLabels": {"app": "vllm", "tier": "a"}},
            "targetPorts": [{"number": 8000}]
        })))
        .unwrap();
        assert_eq!(ok.label_selector(), "app=vllm,tier=a");
        assert!(PoolSpec::from_object(&obj(
            json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]})
        ))
        .is_err());
        assert!(PoolSpec::from_object(&obj(
            json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []})
        ))
        .is_err());
        assert!(PoolSpec::from_object(&obj(
            json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]})
        ))
        .is_err());
    }
}
