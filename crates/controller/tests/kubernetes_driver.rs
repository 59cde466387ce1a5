//! The Kubernetes driver against a mock API server: an axum server on 127.0.0.1:0 that
//! answers the few endpoints the driver calls (the target's `/scale` subresource, the
//! Deployment for its selector, the pod list, pod deletion) from state held in the test.
//!
//! The mock plays the workload's controller too, crudely: after a scale change or a pod
//! deletion it creates pods (not ready, with a loopback IP) until the live ones match
//! `spec.replicas`, or marks the newest terminating. Tests flip pods ready, restart or
//! evict them, finish terminations, and inject faults (a 500, a hang, a garbage body).
//!
//! Scale from zero end to end: a real `strata router` as the picker holds a request for the
//! empty pool, the controller reads the held count from the picker's `/metrics`, scales the
//! Deployment from zero through the mock, and once the pod's engine is up and the pod
//! ready, the held request is answered.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use strata_controller::autoscale::{AutoscaleConfig, Load};
use strata_controller::config::{ControllerConfig, DriverConfig};
use strata_controller::controller::Controller;
use strata_controller::driver::kubernetes::{KubernetesDriver, KubernetesDriverConfig, TargetKind};
use strata_controller::driver::{
    Driver, DriverError, ReplicaEvent, ReplicaInfo, ReplicaPhase, ReplicaRegistrar,
};
use strata_controller::metrics::ControllerMetrics;
use strata_controller::signals::SignalSource;

const NS: &str = "serving";
const DEPLOYMENT_SELECTOR: &str = "app=engine,tier in (gpu)";

#[derive(Debug, Clone, Copy, PartialEq)]
enum FaultKind {
    Status(u16),
    Hang,
    Garbage,
}

#[derive(Debug, Clone)]
struct MockPod {
    name: String,
    uid: String,
    ip: Option<String>,
    ready: bool,
    restarts: i32,
    terminating: bool,
    failed: Option<String>,
}

#[derive(Debug, Clone)]
struct Request {
    method: Method,
    path: String,
    label_selector: Option<String>,
    content_type: String,
    body: String,
}

#[derive(Default)]
struct Cluster {
    /// The target's `spec.replicas`.
    replicas: i32,
    pods: Vec<MockPod>,
    next: u32,
    /// A fault for requests whose path contains the string (every request when empty).
    fault: Option<(String, FaultKind)>,
    requests: Vec<Request>,
}

impl Cluster {
    /// What the workload's controller would do: create or retire pods.
    fn sync(&mut self, prefix: &str) {
        let live = |c: &Cluster| {
            c.pods
                .iter()
                .filter(|p| !p.terminating && p.failed.is_none())
                .count() as i32
        };
        while live(self) < self.replicas {
            self.next += 1;
            let n = self.next;
            self.pods.push(MockPod {
                name: format!("{prefix}-{n}"),
                uid: format!("uid-{n}"),
                ip: Some(format!("127.0.0.{}", 10 + n)),
                ready: false,
                restarts: 0,
                terminating: false,
                failed: None,
            });
        }
        while live(self) > self.replicas {
            if let Some(p) = self
                .pods
                .iter_mut()
                .rev()
                .find(|p| !p.terminating && p.failed.is_none())
            {
                p.terminating = true;
            }
        }
    }
}

#[derive(Clone)]
struct Mock {
    cluster: Arc<Mutex<Cluster>>,
    kind: TargetKind,
    name: String,
    url: String,
}

impl Mock {
    async fn spawn(kind: TargetKind, name: &str) -> Mock {
        let mock = Mock {
            cluster: Arc::new(Mutex::new(Cluster::default())),
            kind,
            name: name.to_string(),
            url: String::new(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .fallback(api_server)
            .with_state(mock.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Mock { url, ..mock }
    }

    fn kube_config(&self) -> kube::Config {
        kube::Config::new(self.url.parse().unwrap())
    }

    fn with<T>(&self, f: impl FnOnce(&mut Cluster) -> T) -> T {
        f(&mut self.cluster.lock().unwrap())
    }

    fn set_ready(&self, name: &str, ready: bool) {
        self.with(|c| {
            let p = c.pods.iter_mut().find(|p| p.name == name).unwrap();
            p.ready = ready;
        });
    }

    fn restart(&self, name: &str) {
        self.with(|c| {
            let p = c.pods.iter_mut().find(|p| p.name == name).unwrap();
            p.ready = false;
            p.restarts += 1;
        });
    }

    fn evict(&self, name: &str) {
        let prefix = self.name.clone();
        self.with(|c| {
            let p = c.pods.iter_mut().find(|p| p.name == name).unwrap();
            p.ready = false;
            p.failed = Some("Evicted".into());
            c.sync(&prefix);
        });
    }

    /// Removes a pod at once, as if its termination finished before anyone listed it.
    fn vanish(&self, name: &str) {
        self.with(|c| c.pods.retain(|p| p.name != name));
    }

    fn finish_terminations(&self) {
        self.with(|c| c.pods.retain(|p| !p.terminating));
    }

    fn set_fault(&self, on: &str, kind: Option<FaultKind>) {
        self.with(|c| c.fault = kind.map(|k| (on.to_string(), k)));
    }

    fn requests(&self) -> Vec<Request> {
        self.with(|c| c.requests.clone())
    }

    fn patches(&self) -> Vec<Request> {
        self.requests()
            .into_iter()
            .filter(|r| r.method == Method::PATCH)
            .collect()
    }

    fn replicas(&self) -> i32 {
        self.with(|c| c.replicas)
    }

    fn scale_path(&self) -> String {
        match self.kind {
            TargetKind::Deployment => {
                format!(
                    "/apis/apps/v1/namespaces/{NS}/deployments/{}/scale",
                    self.name
                )
            }
            TargetKind::LeaderWorkerSet => format!(
                "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/{}/scale",
                self.name
            ),
        }
    }

    fn pod_selector(&self) -> String {
        match self.kind {
            TargetKind::Deployment => DEPLOYMENT_SELECTOR.to_string(),
            TargetKind::LeaderWorkerSet => format!(
                "leaderworkerset.sigs.k8s.io/name={},leaderworkerset.sigs.k8s.io/worker-index=0",
                self.name
            ),
        }
    }
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    });
    (StatusCode::from_u16(code).unwrap(), axum::Json(body)).into_response()
}

fn pod_json(p: &MockPod) -> Value {
    let mut meta =
        json!({"name": p.name, "namespace": NS, "uid": p.uid, "labels": {"app": "engine"}});
    if p.terminating {
        meta["deletionTimestamp"] = json!("2026-11-29T12:00:00Z");
    }
    let mut container = json!({
        "name": "engine", "image": "strata", "imageID": "", "ready": p.ready,
        "restartCount": p.restarts,
    });
    if p.restarts > 0 {
        container["lastState"] = json!({"terminated": {"exitCode": 137, "reason": "OOMKilled"}});
    }
    let mut status = json!({
        "phase": if p.failed.is_some() { "Failed" } else if p.ready { "Running" } else { "Pending" },
        "conditions": [{"type": "Ready", "status": if p.ready { "True" } else { "False" }}],
        "containerStatuses": [container],
    });
    if let Some(ip) = &p.ip {
        status["podIP"] = json!(ip);
    }
    if let Some(reason) = &p.failed {
        status["reason"] = json!(reason);
    }
    json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"containers": [{"name": "engine"}]}, "status": status,
    })
}

/// The mock API server: one handler, routing by path.
async fn api_server(
    State(mock): State<Mock>,
    method: Method,
    uri: Uri,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    let fault = mock.with(|c| {
        c.requests.push(Request {
            method: method.clone(),
            path: path.clone(),
            label_selector: query.get("labelSelector").cloned(),
            content_type: headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string(),
            body: String::from_utf8_lossy(&body).to_string(),
        });
        c.fault
            .clone()
            .filter(|(on, _)| path.contains(on.as_str()))
            .map(|(_, k)| k)
    });
    match fault {
        Some(FaultKind::Status(code)) => {
            return status(code, "InternalError", "etcdserver: request timed out")
        }
        Some(FaultKind::Hang) => std::future::pending::<()>().await,
        Some(FaultKind::Garbage) => return (StatusCode::OK, "<html>proxy</html>").into_response(),
        None => {}
    }

    let scale_path = mock.scale_path();
    let target_path = scale_path.trim_end_matches("/scale").to_string();
    let pods_path = format!("/api/v1/namespaces/{NS}/pods");
    let scale = |c: &Cluster| {
        let live = c.pods.iter().filter(|p| !p.terminating).count();
        json!({
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": mock.name, "namespace": NS},
            "spec": {"replicas": c.replicas},
            "status": {"replicas": live, "selector": mock.pod_selector()},
        })
    };
    if path == scale_path && method == Method::GET {
        return axum::Json(mock.with(|c| scale(c))).into_response();
    }
    if path == scale_path && method == Method::PATCH {
        let Ok(v) = serde_json::from_slice::<Value>(&body) else {
            return status(400, "BadRequest", "not JSON");
        };
        let Some(n) = v["spec"]["replicas"].as_i64() else {
            return status(422, "Invalid", "spec.replicas missing");
        };
        let prefix = mock.name.clone();
        return axum::Json(mock.with(|c| {
            c.replicas = n as i32;
            c.sync(&prefix);
            scale(c)
        }))
        .into_response();
    }
    if path == target_path && method == Method::GET && mock.kind == TargetKind::Deployment {
        return axum::Json(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": mock.name, "namespace": NS},
            "spec": {
                "replicas": mock.replicas(),
                "selector": {
                    "matchLabels": {"app": "engine"},
                    "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu"]}],
                },
                "template": {},
            },
        }))
        .into_response();
    }
    if path == pods_path && method == Method::GET {
        let items: Vec<Value> = if query.get("labelSelector") == Some(&mock.pod_selector()) {
            mock.with(|c| c.pods.iter().map(pod_json).collect())
        } else {
            Vec::new()
        };
        return axum::Json(json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"},
            "items": items,
        }))
        .into_response();
    }
    if let Some(name) = path.strip_prefix(&format!("{pods_path}/")) {
        if method == Method::DELETE {
            let prefix = mock.name.clone();
            let pod = mock.with(|c| {
                let p = c.pods.iter_mut().find(|p| p.name == name)?;
                p.terminating = true;
                let out = pod_json(p);
                c.sync(&prefix);
                Some(out)
            });
            return match pod {
                Some(p) => axum::Json(p).into_response(),
                None => status(404, "NotFound", &format!("pods \"{name}\" not found")),
            };
        }
    }
    status(
        404,
        "NotFound",
        &format!("{method} {path}: no such thing here"),
    )
}

/// Records what the driver told the router.
#[derive(Default)]
struct Recorder {
    log: Mutex<Vec<String>>,
    ready: Mutex<HashMap<String, String>>,
}

impl Recorder {
    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
    fn ready(&self) -> HashMap<String, String> {
        self.ready.lock().unwrap().clone()
    }
}

impl ReplicaRegistrar for Recorder {
    fn register(&self, r: &ReplicaInfo) {
        assert_eq!(r.phase, ReplicaPhase::Ready);
        self.log.lock().unwrap().push(format!("+{}", r.id));
        self.ready
            .lock()
            .unwrap()
            .insert(r.id.clone(), r.url.clone());
    }
    fn deregister(&self, id: &str) {
        self.log.lock().unwrap().push(format!("-{id}"));
        self.ready.lock().unwrap().remove(id);
    }
}

fn config(kind: TargetKind, name: &str) -> KubernetesDriverConfig {
    KubernetesDriverConfig {
        namespace: NS.to_string(),
        target_kind: kind,
        name: name.to_string(),
        port: 8000,
        request_timeout_secs: 2.0,
        ..KubernetesDriverConfig::default()
    }
}

async fn setup(
    kind: TargetKind,
    tweak: impl FnOnce(&mut KubernetesDriverConfig),
) -> (Mock, KubernetesDriver, Arc<Recorder>) {
    let name = match kind {
        TargetKind::Deployment => "engine",
        TargetKind::LeaderWorkerSet => "llama",
    };
    let mock = Mock::spawn(kind, name).await;
    let mut cfg = config(kind, name);
    tweak(&mut cfg);
    cfg.validate().unwrap();
    let rec = Arc::new(Recorder::default());
    let driver = KubernetesDriver::with_config(cfg, mock.kube_config(), rec.clone()).unwrap();
    (mock, driver, rec)
}

fn kinds(events: &[ReplicaEvent]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            let id = match e {
                ReplicaEvent::Started { id, .. }
                | ReplicaEvent::Ready { id, .. }
                | ReplicaEvent::NeverReady { id, .. }
                | ReplicaEvent::Exited { id, .. }
                | ReplicaEvent::Draining { id }
                | ReplicaEvent::Stopped { id, .. } => id,
            };
            format!("{} {id}", e.kind())
        })
        .collect()
}

fn phases(d: &KubernetesDriver) -> Vec<(String, ReplicaPhase)> {
    let mut v: Vec<_> = d.replicas().into_iter().map(|r| (r.id, r.phase)).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Brings the target to `n` ready pods through the driver; returns their names.
async fn ready_pods(mock: &Mock, d: &mut KubernetesDriver, n: u32) -> Vec<String> {
    d.reconcile(n).await.unwrap();
    let names: Vec<String> = mock.with(|c| {
        c.pods
            .iter()
            .filter(|p| !p.terminating)
            .map(|p| p.name.clone())
            .collect()
    });
    for name in &names {
        mock.set_ready(name, true);
    }
    d.reconcile(n).await.unwrap();
    assert_eq!(d.replicas().len(), n as usize);
    names
}

#[tokio::test]
async fn scale_out_patches_replicas_then_reports_started_and_ready_with_pod_urls() {
    let (mock, mut d, rec) = setup(TargetKind::Deployment, |_| {}).await;
    let events = d.reconcile(2).await.unwrap();
    assert_eq!(kinds(&events), ["started engine-1", "started engine-2"]);
    assert_eq!(mock.replicas(), 2);

    // One merge patch of spec.replicas on the scale subresource.
    let patches = mock.patches();
    assert_eq!(patches.len(), 1, "{patches:?}");
    assert_eq!(patches[0].path, mock.scale_path());
    assert_eq!(patches[0].content_type, "application/merge-patch+json");
    let body: Value = serde_json::from_str(&patches[0].body).unwrap();
    assert_eq!(body, json!({"spec": {"replicas": 2}}));
    // Pods were listed by the Deployment's selector, matchExpressions included.
    let lists: Vec<Request> = mock
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/pods"))
        .collect();
    assert_eq!(
        lists[0].label_selector.as_deref(),
        Some(DEPLOYMENT_SELECTOR)
    );

    // Not ready yet: not registered, shown as starting.
    assert!(rec.log().is_empty());
    assert_eq!(
        phases(&d),
        [
            ("engine-1".to_string(), ReplicaPhase::Starting),
            ("engine-2".to_string(), ReplicaPhase::Starting)
        ]
    );

    mock.set_ready("engine-1", true);
    let events = d.reconcile(2).await.unwrap();
    assert_eq!(
        events,
        match &events[..] {
            [ReplicaEvent::Ready { after_secs, .. }] => vec![ReplicaEvent::Ready {
                id: "engine-1".into(),
                url: "http://127.0.0.11:8000".into(),
                after_secs: *after_secs,
            }],
            other => panic!("{other:?}"),
        }
    );
    assert_eq!(rec.log(), ["+engine-1"]);
    assert_eq!(rec.ready()["engine-1"], "http://127.0.0.11:8000");

    mock.set_ready("engine-2", true);
    assert_eq!(kinds(&d.reconcile(2).await.unwrap()), ["ready engine-2"]);
    assert_eq!(rec.log(), ["+engine-1", "+engine-2"]);
    let replicas = d.replicas();
    assert!(replicas
        .iter()
        .all(|r| r.phase == ReplicaPhase::Ready && r.url.starts_with("http://127.0.0.")));

    // Nothing changed: no event, no patch, and the selector was read only once.
    assert!(d.reconcile(2).await.unwrap().is_empty());
    assert_eq!(mock.patches().len(), 1);
    let deployment_reads = mock
        .requests()
        .iter()
        .filter(|r| r.path == format!("/apis/apps/v1/namespaces/{NS}/deployments/engine"))
        .count();
    assert_eq!(deployment_reads, 1);
}

#[tokio::test]
async fn a_ready_pod_without_an_ip_is_not_registered_until_it_has_one() {
    let (mock, mut d, rec) = setup(TargetKind::Deployment, |_| {}).await;
    // Already at one pod, Ready, but with no IP reported yet.
    mock.with(|c| {
        c.replicas = 1;
        c.sync("engine");
        c.pods[0].ip = None;
        c.pods[0].ready = true;
    });
    let events = d.reconcile(1).await.unwrap();
    assert_eq!(
        events,
        [ReplicaEvent::Started {
            id: "engine-1".into(),
            url: String::new()
        }]
    );
    assert!(mock.patches().is_empty(), "already at the desired count");
    assert!(d.reconcile(1).await.unwrap().is_empty());
    assert!(rec.log().is_empty());
    assert_eq!(
        phases(&d),
        [("engine-1".to_string(), ReplicaPhase::Starting)]
    );
    mock.with(|c| c.pods[0].ip = Some("fd00::7".into()));
    let events = d.reconcile(1).await.unwrap();
    assert!(
        matches!(&events[..], [ReplicaEvent::Ready { url, .. }] if url == "http://[fd00::7]:8000"),
        "{events:?}"
    );
    assert_eq!(rec.log(), ["+engine-1"]);
}

#[tokio::test]
async fn scale_in_deregisters_terminating_pods_at_once_and_reports_them_stopped() {
    let (mock, mut d, rec) = setup(TargetKind::Deployment, |_| {}).await;
    ready_pods(&mock, &mut d, 3).await;
    assert_eq!(rec.ready().len(), 3);

    // Kubernetes picks the victims (the mock: the newest); the driver deregisters them in
    // the same reconcile that asked for fewer.
    let events = d.reconcile(1).await.unwrap();
    assert_eq!(kinds(&events), ["draining engine-2", "draining engine-3"]);
    let body: Value = serde_json::from_str(&mock.patches().last().unwrap().body).unwrap();
    assert_eq!(body, json!({"spec": {"replicas": 1}}));
    assert_eq!(
        rec.log(),
        [
            "+engine-1",
            "+engine-2",
            "+engine-3",
            "-engine-2",
            "-engine-3"
        ]
    );
    assert_eq!(
        phases(&d),
        [
            ("engine-1".to_string(), ReplicaPhase::Ready),
            ("engine-2".to_string(), ReplicaPhase::Draining),
            ("engine-3".to_string(), ReplicaPhase::Draining)
        ]
    );
    // Still terminating: nothing new.
    assert!(d.reconcile(1).await.unwrap().is_empty());

    mock.finish_terminations();
    let events = d.reconcile(1).await.unwrap();
    assert_eq!(kinds(&events), ["stopped engine-2", "stopped engine-3"]);
    assert!(events
        .iter()
        .all(|e| matches!(e, ReplicaEvent::Stopped { forced: false, .. })));
    assert_eq!(phases(&d), [("engine-1".to_string(), ReplicaPhase::Ready)]);
    assert_eq!(rec.ready().len(), 1);
    assert_eq!(mock.patches().len(), 2);

    // A pod deleted by someone else (kubectl delete) is deregistered the same way.
    mock.with(|c| c.pods[0].terminating = true);
    assert_eq!(kinds(&d.reconcile(1).await.unwrap()), ["draining engine-1"]);
    assert!(rec.ready().is_empty());
}

#[tokio::test]
async fn a_pod_that_never_becomes_ready_is_reported_and_deleted_so_it_is_replaced() {
    let (mock, mut d, rec) = setup(TargetKind::Deployment, |c| c.ready_timeout_secs = 0.2).await;
    assert_eq!(kinds(&d.reconcile(1).await.unwrap()), ["started engine-1"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|e: &ReplicaEvent| e.kind() == "never_ready")
    {
        assert!(Instant::now() < deadline, "{seen:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        seen.extend(d.reconcile(1).await.unwrap());
    }
    let never = seen.iter().find(|e| e.kind() == "never_ready").unwrap();
    assert!(
        matches!(never, ReplicaEvent::NeverReady { id, waited_secs } if id == "engine-1" && *waited_secs >= 0.2),
        "{never:?}"
    );
    let deletes: Vec<Request> = mock
        .requests()
        .into_iter()
        .filter(|r| r.method == Method::DELETE)
        .collect();
    assert_eq!(deletes.len(), 1);
    assert_eq!(
        deletes[0].path,
        format!("/api/v1/namespaces/{NS}/pods/engine-1")
    );
    // Gone from the driver's replicas at once; the replacement is reported next.
    assert!(d.replicas().iter().all(|r| r.id != "engine-1"));
    let events = d.reconcile(1).await.unwrap();
    assert_eq!(kinds(&events), ["started engine-2"]);
    mock.set_ready("engine-2", true);
    assert_eq!(kinds(&d.reconcile(1).await.unwrap()), ["ready engine-2"]);
    // The deleted pod's end is not reported twice; it was never registered.
    mock.finish_terminations();
    assert!(d.reconcile(1).await.unwrap().is_empty());
    assert_eq!(rec.log(), ["+engine-2"]);
    assert_eq!(mock.replicas(), 1);
}

#[tokio::test]
async fn a_crash_looping_pod_is_reported_each_restart_and_still_times_out() {
    let (mock, mut d, rec) = setup(TargetKind::Deployment, |c| c.ready_timeout_secs = 0.3).await;
    d.reconcile(1).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|e: &ReplicaEvent| e.kind() == "never_ready")
    {
        assert!(Instant::now() < deadline, "{seen:?}");
        // It restarts before every listing: the restarts do not reset its deadline.
        mock.restart("engine-1");
        tokio::time::sleep(Duration::from_millis(50)).await;
        seen.extend(d.reconcile(1).await.unwrap());
    }
    assert!(
        seen.iter().filter(|e| e.kind() == "exited").count() >= 2,
        "{seen:?}"
    );
    assert!(rec.log().is_empty());
}

#[tokio::test]
async fn restarts_evictions_and_vanished_pods_are_exits_deregistered_first() {
    let (mock, mut d, rec) = setup(TargetKind::Deployment, |_| {}).await;
    ready_pods(&mock, &mut d, 1).await;

    mock.restart("engine-1");
    let events = d.reconcile(1).await.unwrap();
    assert!(
        matches!(&events[..], [ReplicaEvent::Exited { id, status }]
            if id == "engine-1" && status.contains("OOMKilled")),
        "{events:?}"
    );
    assert_eq!(rec.log(), ["+engine-1", "-engine-1"]);
    assert_eq!(
        phases(&d),
        [("engine-1".to_string(), ReplicaPhase::Starting)]
    );
    // Back up: registered again.
    mock.set_ready("engine-1", true);
    assert_eq!(kinds(&d.reconcile(1).await.unwrap()), ["ready engine-1"]);

    // Evicted: the pod stays listed as Failed; the Deployment replaces it.
    mock.evict("engine-1");
    let events = d.reconcile(1).await.unwrap();
    assert_eq!(kinds(&events), ["exited engine-1", "started engine-2"]);
    assert!(
        matches!(&events[0], ReplicaEvent::Exited { status, .. } if status.contains("Evicted")),
        "{events:?}"
    );
    assert_eq!(
        rec.log(),
        ["+engine-1", "-engine-1", "+engine-1", "-engine-1"]
    );
    // A failed pod still listed is not reported again.
    assert!(d.reconcile(1).await.unwrap().is_empty());

    // A ready pod that vanishes between two listings.
    mock.set_ready("engine-2", true);
    d.reconcile(1).await.unwrap();
    mock.vanish("engine-2");
    let events = d.reconcile(1).await.unwrap();
    assert!(
        matches!(&events[..], [ReplicaEvent::Exited { id, status }]
            if id == "engine-2" && status == "pod deleted"),
        "{events:?}"
    );
    assert!(rec.ready().is_empty());
    assert!(d.replicas().is_empty());
}

#[tokio::test]
async fn api_errors_and_hangs_are_driver_errors_and_the_next_reconcile_recovers() {
    let (mock, mut d, _) = setup(TargetKind::Deployment, |c| c.request_timeout_secs = 1.0).await;

    mock.set_fault("", Some(FaultKind::Status(500)));
    let e = d.reconcile(2).await.unwrap_err();
    assert!(matches!(e, DriverError::Api(_)), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("500") && text.contains("etcdserver"),
        "{text}"
    );
    assert_eq!(mock.replicas(), 0);

    // A hang is bounded by the request timeout (the outer timeout only guards the test).
    mock.set_fault("", Some(FaultKind::Hang));
    let e = tokio::time::timeout(Duration::from_secs(20), d.reconcile(2))
        .await
        .expect("the driver's timeout bounds a hanging API server")
        .unwrap_err();
    assert!(e.to_string().contains("no answer within 1 s"), "{e}");

    mock.set_fault("", Some(FaultKind::Garbage));
    let e = d.reconcile(2).await.unwrap_err();
    assert!(matches!(e, DriverError::Api(_)), "{e:?}");

    // The scale goes through but listing fails: an error, and the next reconcile reports
    // the pods.
    mock.set_fault("/pods", Some(FaultKind::Status(503)));
    assert!(d.reconcile(2).await.is_err());
    assert_eq!(mock.replicas(), 2);
    assert!(d.replicas().is_empty());

    mock.set_fault("", None);
    let events = d.reconcile(2).await.unwrap();
    assert_eq!(kinds(&events), ["started engine-1", "started engine-2"]);
    assert_eq!(mock.patches().len(), 1, "already at 2: not patched again");

    // A failed deletion of a never-ready pod is retried and reported once it succeeds.
    drop(d);
    let (mock, mut d, rec) = setup(TargetKind::Deployment, |c| {
        c.ready_timeout_secs = 0.0;
        c.request_timeout_secs = 1.0;
    })
    .await;
    mock.set_fault("/pods/", Some(FaultKind::Status(500)));
    let e = d.reconcile(1).await.unwrap_err();
    assert!(e.to_string().contains("deleting pod"), "{e}");
    mock.set_fault("", None);
    let events = d.reconcile(1).await.unwrap();
    assert_eq!(kinds(&events), ["never_ready engine-1"]);
    assert!(rec.log().is_empty());
}

#[tokio::test]
async fn a_leaderworkerset_is_scaled_through_its_scale_subresource() {
    let (mock, mut d, rec) = setup(TargetKind::LeaderWorkerSet, |_| {}).await;
    let events = d.reconcile(2).await.unwrap();
    assert_eq!(kinds(&events), ["started llama-1", "started llama-2"]);
    let patches = mock.patches();
    assert_eq!(patches.len(), 1);
    assert_eq!(
        patches[0].path,
        format!("/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/llama/scale")
    );
    assert_eq!(patches[0].content_type, "application/merge-patch+json");
    let body: Value = serde_json::from_str(&patches[0].body).unwrap();
    assert_eq!(body, json!({"spec": {"replicas": 2}}));
    // Leaders listed by the selector the scale subresource reports; no Deployment read.
    let requests = mock.requests();
    assert!(requests.iter().all(|r| !r.path.contains("deployments")));
    let list = requests.iter().find(|r| r.path.ends_with("/pods")).unwrap();
    assert_eq!(list.label_selector, Some(mock.pod_selector()));

    mock.set_ready("llama-1", true);
    assert_eq!(kinds(&d.reconcile(2).await.unwrap()), ["ready llama-1"]);
    assert_eq!(rec.log(), ["+llama-1"]);
    assert_eq!(kinds(&d.reconcile(1).await.unwrap()), ["draining llama-2"]);
    assert_eq!(mock.replicas(), 1);
}

/// A load that never changes.
struct FixedLoad(f64);

impl SignalSource for FixedLoad {
    async fn collect(&mut self, _ready: &[ReplicaInfo]) -> Option<Load> {
        Some(Load {
            running: self.0,
            ..Load::default()
        })
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_control_loop_keeps_running_through_api_errors() {
    let (mock, d, rec) = setup(TargetKind::Deployment, |c| c.request_timeout_secs = 1.0).await;
    mock.set_fault("", Some(FaultKind::Status(500)));
    let metrics = Arc::new(ControllerMetrics::new());
    let cfg = AutoscaleConfig {
        min_replicas: 2,
        max_replicas: 4,
        ..AutoscaleConfig::default()
    };
    let c = Controller::new(
        cfg,
        Duration::from_millis(20),
        d,
        FixedLoad(0.0),
        rec.clone(),
        metrics.clone(),
    );
    let status = c.status();
    let (tx, rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(c.run(rx));

    until("three driver errors", || {
        let text = metrics.render();
        text.lines()
            .find(|l| l.starts_with("strata_controller_driver_errors_total "))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .is_some_and(|n| n >= 3.0)
    })
    .await;
    assert!(!run.is_finished(), "the loop goes on");
    // A hang too.
    mock.set_fault("/pods", Some(FaultKind::Hang));
    until("a timed-out tick", || {
        status
            .lock()
            .unwrap()
            .last
            .as_ref()
            .and_then(|l| l.driver_error.clone())
            .is_some_and(|e| e.contains("no answer"))
    })
    .await;

    mock.set_fault("", None);
    until("the pods", || mock.with(|c| c.pods.len()) == 2).await;
    mock.set_ready("engine-1", true);
    mock.set_ready("engine-2", true);
    until("two ready replicas", || rec.ready().len() == 2).await;
    until("the status", || {
        let s = status.lock().unwrap();
        s.replicas.len() == 2
            && s.replicas.iter().all(|r| r.phase == ReplicaPhase::Ready)
            && s.last.as_ref().is_some_and(|l| l.driver_error.is_none())
    })
    .await;

    tx.send(true).unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap()
        .unwrap();
    // Stopping the controller deregisters every pod and leaves the workload as it is.
    assert!(d.replicas().is_empty());
    assert!(rec.ready().is_empty());
    assert_eq!(mock.replicas(), 2);
}

#[tokio::test]
async fn serve_runs_the_kubernetes_driver_from_controller_yaml() {
    let mock = Mock::spawn(TargetKind::Deployment, "engine").await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: mock\n  cluster:\n    server: {}\n\
             users:\n- name: me\n  user: {{}}\ncontexts:\n- name: test\n  context:\n    cluster: mock\n    user: me\n\
             current-context: test\n",
            mock.url
        ),
    )
    .unwrap();
    let yaml = format!(
        "listen: 127.0.0.1:0\nintervalSecs: 0.05\nautoscale:\n  minReplicas: 2\n\
         driver:\n  kind: kubernetes\n  namespace: {NS}\n  name: engine\n  kubeconfig: {}\n",
        kubeconfig.display()
    );
    let cfg = ControllerConfig::parse(&yaml, "test").unwrap();
    assert!(matches!(cfg.driver, DriverConfig::Kubernetes(_)));
    let rec = Arc::new(Recorder::default());
    let (tx, rx) = tokio::sync::watch::channel(false);
    let serve = tokio::spawn(strata_controller::serve(cfg, rec.clone(), rx));
    until("the scale-out", || mock.replicas() == 2).await;
    mock.set_ready("engine-1", true);
    until("a registration", || rec.ready().contains_key("engine-1")).await;
    tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), serve)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(rec.ready().is_empty());

    // A kubeconfig that cannot be read is an error naming it, not a panic.
    let mut cfg = ControllerConfig::parse(&yaml, "test").unwrap();
    if let DriverConfig::Kubernetes(k) = &mut cfg.driver {
        k.kubeconfig = Some(dir.path().join("missing"));
    }
    let (_tx, rx) = tokio::sync::watch::channel(false);
    let e = strata_controller::serve(cfg, rec, rx).await.unwrap_err();
    assert!(format!("{e:#}").contains("missing"), "{e:#}");
}

/// The picker as the chart runs it, reduced to this test: `strata router` holding requests
/// for its pool while it has no endpoint, and learning ready pods from the driver (where on
/// Kubernetes it watches the pool's pods itself). The controller reads its held requests
/// from its `/metrics` page, as `heldRequests:` configures on Kubernetes.
struct PickerStandIn {
    router: strata_router::Router,
    held: Arc<strata_controller::held::PickerHeld>,
    /// Registered pods' URLs by replica id.
    urls: Mutex<HashMap<String, String>>,
}

impl ReplicaRegistrar for PickerStandIn {
    fn register(&self, r: &ReplicaInfo) {
        let spec = strata_router::EndpointSpec::new(&r.url, strata_router::EngineKind::Vllm);
        self.router.add_endpoint(spec).unwrap();
        self.urls
            .lock()
            .unwrap()
            .insert(r.id.clone(), r.url.clone());
    }
    fn deregister(&self, id: &str) {
        if let Some(url) = self.urls.lock().unwrap().remove(id) {
            let _ = self.router.remove_endpoint(&url);
        }
    }
    fn held_requests(&self) -> u32 {
        self.held.held_requests()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_an_empty_pool_is_held_the_pool_scales_from_zero_and_it_is_answered() {
    // The engine port every pod serves on, free on the first pod's address for now.
    let port = std::net::TcpListener::bind("127.0.0.11:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mock = Mock::spawn(TargetKind::Deployment, "engine").await;
    assert_eq!(mock.replicas(), 0, "the pool starts at zero");

    // The picker: a router with no endpoint, holding requests for its pool.
    let mut rc = strata_router::config::RouterConfig {
        scrape_interval_ms: 20,
        health_interval_ms: 20,
        ..strata_router::config::RouterConfig::default()
    };
    rc.flow_control.pool = "chat-pool".into();
    rc.flow_control.default_ttl_ms = Some(30_000);
    let router = strata_router::Router::new(rc).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let picker = listener.local_addr().unwrap();
    let app = strata_router::proxy::app(router.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let held = strata_controller::held::spawn(
        strata_controller::held::HeldRequestsSource {
            metrics_url: format!("http://{picker}/metrics"),
            pool: Some("chat-pool".into()),
            interval_ms: 50,
        },
        reqwest::Client::new(),
    );
    let registrar = Arc::new(PickerStandIn {
        router: router.clone(),
        held,
        urls: Mutex::default(),
    });
    let d = KubernetesDriver::with_config(
        KubernetesDriverConfig {
            port,
            ..config(TargetKind::Deployment, "engine")
        },
        mock.kube_config(),
        registrar.clone(),
    )
    .unwrap();

    // The controller: the Kubernetes driver, scale to zero allowed.
    // Idle means zero at once (a pool that has been quiet); scaling in again waits the
    // cooldown, past the end of the test.
    let cfg = AutoscaleConfig {
        min_replicas: 0,
        max_replicas: 2,
        scale_to_zero_after_secs: 0.0,
        ..AutoscaleConfig::default()
    };
    let metrics = Arc::new(ControllerMetrics::new());
    let c = Controller::new(
        cfg,
        Duration::from_millis(50),
        d,
        FixedLoad(0.0),
        registrar.clone(),
        metrics,
    );
    let (tx, rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(c.run(rx));
    // Without demand the pool stays at zero.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(mock.replicas(), 0);
    assert!(mock.patches().is_empty(), "{:?}", mock.patches());

    // A client's request reaches the empty pool: held, not refused.
    let client = reqwest::Client::new();
    let request = tokio::spawn(async move {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let resp = client
            .post(format!("http://{picker}/v1/chat/completions"))
            .json(&body)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json::<Value>().await.unwrap_or(Value::Null))
    });
    // Held (it stays held until a pod is ready, whatever the controller does meanwhile).
    until("the picker to hold the request", || {
        router.held_requests() == 1
    })
    .await;

    // The controller reads the held request and scales the Deployment from zero.
    until("a scale patch to 1", || mock.replicas() == 1).await;
    let patches = mock.patches();
    assert!(
        patches[0].path.ends_with("/deployments/engine/scale"),
        "{patches:?}"
    );
    assert!(patches[0].body.contains("\"replicas\":1"), "{patches:?}");
    until("the pod", || mock.with(|c| c.pods.len()) == 1).await;
    let (pod, ip) = mock.with(|c| (c.pods[0].name.clone(), c.pods[0].ip.clone().unwrap()));
    assert_eq!(ip, "127.0.0.11");

    // The pod's engine starts and the pod turns ready: the held request is answered.
    let listener = tokio::net::TcpListener::bind((ip.as_str(), port))
        .await
        .unwrap();
    let engine = strata_mock::MockEngine::serve(
        strata_mock::MockConfig {
            model: "m".into(),
            output_tokens: 2,
            ..Default::default()
        },
        listener,
    )
    .unwrap();
    mock.set_ready(&pod, true);
    let (status, answer) = tokio::time::timeout(Duration::from_secs(20), request)
        .await
        .expect("the held request is answered")
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{answer}"
    );
    assert_eq!(engine.requests(), 1);
    assert_eq!(router.held_requests(), 0);
    assert_eq!(mock.replicas(), 1);

    tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap()
        .unwrap();
}
