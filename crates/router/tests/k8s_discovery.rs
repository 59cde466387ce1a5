//! InferencePool discovery against a mock API server (axum on 127.0.0.1:0, as the
//! controller's Kubernetes driver is tested): the pool `GET`, the pod list, and watches of
//! pods and of the pool that stream newline-delimited events from a history the test
//! appends to. The test can end every open watch (as an API server does at its timeout),
//! answer the next pod watch with `410 Gone`, fail or hang calls, and read back every
//! request the router made.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};
use strata_router::k8s::{Discovery, DiscoveryConfig};
use strata_router::Router;

const NS: &str = "serving";
const POOL: &str = "llm";

#[derive(Debug, Clone)]
struct Logged {
    method: Method,
    path: String,
    query: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Status500,
    Hang,
}

#[derive(Default)]
struct State {
    rv: u64,
    pool: Option<Value>,
    pods: BTreeMap<String, Value>,
    /// (resource version, "pod" | "pool", event type, object)
    history: Vec<(u64, &'static str, &'static str, Value)>,
    /// Open watches end when this changes.
    generation: u64,
    gone_next_pod_watch: bool,
    fault: Option<Fault>,
    /// `InferenceObjective`s in the namespace; `None`: the CRD is not installed (404).
    objectives: Option<Vec<Value>>,
    log: Vec<Logged>,
}

#[derive(Clone)]
struct Mock {
    state: Arc<Mutex<State>>,
    url: String,
}

fn pool_object(rv: u64, ports: &[u16]) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NS, "resourceVersion": rv.to_string()},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
        }
    })
}

#[derive(Clone)]
struct PodSpec {
    app: &'static str,
    ip: Option<&'static str>,
    ready: bool,
    terminating: bool,
    phase: &'static str,
    kind: Option<&'static str>,
    kv: Option<&'static str>,
}

impl Default for PodSpec {
    fn default() -> Self {
        PodSpec {
            app: "vllm",
            ip: None,
            ready: false,
            terminating: false,
            phase: "Running",
            kind: None,
            kv: None,
        }
    }
}

fn pod_object(name: &str, rv: u64, p: &PodSpec) -> Value {
    let mut labels = json!({"app": p.app});
    if let Some(k) = p.kind {
        labels["inference.networking.k8s.io/engine-type"] = json!(k);
    }
    let mut meta = json!({"name": name, "namespace": NS, "uid": format!("uid-{name}"),
                          "resourceVersion": rv.to_string(), "labels": labels});
    if p.terminating {
        meta["deletionTimestamp"] = json!("2026-12-01T00:00:00Z");
    }
    if let Some(kv) = p.kv {
        meta["annotations"] = json!({"strata.dev/kv-events": kv});
    }
    json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "status": {
            "phase": p.phase,
            "podIP": p.ip,
            "conditions": [{"type": "Ready", "status": if p.ready {"True"} else {"False"}}],
        }
    })
}

fn matches_selector(obj: &Value, selector: Option<&String>) -> bool {
    let Some(sel) = selector else { return true };
    sel.split(',').filter(|s| !s.is_empty()).all(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        obj["metadata"]["labels"][k].as_str() == Some(v)
    })
}

impl Mock {
    async fn spawn() -> Mock {
        let state = Arc::new(Mutex::new(State::default()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let mock = Mock { state, url };
        let app = axum::Router::new()
            .fallback(api_server)
            .with_state(mock.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        mock
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap())
    }

    fn set_pool(&self, ports: &[u16]) {
        self.with(|s| {
            s.rv += 1;
            let obj = pool_object(s.rv, ports);
            let ty = if s.pool.is_some() {
                "MODIFIED"
            } else {
                "ADDED"
            };
            s.pool = Some(obj.clone());
            s.history.push((s.rv, "pool", ty, obj));
        });
    }

    fn delete_pool(&self) {
        self.with(|s| {
            s.rv += 1;
            if let Some(mut obj) = s.pool.take() {
                obj["metadata"]["resourceVersion"] = json!(s.rv.to_string());
                s.history.push((s.rv, "pool", "DELETED", obj));
            }
        });
    }

    fn put_pod(&self, name: &str, p: PodSpec) {
        self.with(|s| {
            s.rv += 1;
            let obj = pod_object(name, s.rv, &p);
            let ty = if s.pods.contains_key(name) {
                "MODIFIED"
            } else {
                "ADDED"
            };
            s.pods.insert(name.into(), obj.clone());
            s.history.push((s.rv, "pod", ty, obj));
        });
    }

    fn delete_pod(&self, name: &str) {
        self.with(|s| {
            s.rv += 1;
            if let Some(mut obj) = s.pods.remove(name) {
                obj["metadata"]["resourceVersion"] = json!(s.rv.to_string());
                s.history.push((s.rv, "pod", "DELETED", obj));
            }
        });
    }

    fn end_watches(&self) {
        self.with(|s| s.generation += 1);
    }

    fn requests(&self, pred: impl Fn(&Logged) -> bool) -> Vec<Logged> {
        self.with(|s| s.log.iter().filter(|l| pred(l)).cloned().collect())
    }

    fn pod_lists(&self) -> usize {
        self.requests(|l| l.path.ends_with("/pods") && !l.query.contains_key("watch"))
            .len()
    }

    fn pod_watches(&self) -> Vec<Logged> {
        self.requests(|l| {
            l.path.ends_with("/pods") && l.query.get("watch").map(String::as_str) == Some("true")
        })
    }
}

fn status(code: u16, reason: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": reason, "reason": reason, "code": code});
    (
        StatusCode::from_u16(code).unwrap(),
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn api_server(
    axum::extract::State(mock): axum::extract::State<Mock>,
    method: Method,
    uri: Uri,
) -> Response {
    let query: BTreeMap<String, String> = uri
        .query()
        .map(|q| {
            url_pairs(q)
                .into_iter()
                .collect::<BTreeMap<String, String>>()
        })
        .unwrap_or_default();
    let path = uri.path().to_string();
    let fault = mock.with(|s| {
        s.log.push(Logged {
            method: method.clone(),
            path: path.clone(),
            query: query.clone(),
        });
        s.fault
    });
    match fault {
        Some(Fault::Status500) => return status(500, "InternalError"),
        Some(Fault::Hang) => return std::future::pending::<Response>().await,
        None => {}
    }
    let pools = format!("/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools");
    let pods = format!("/api/v1/namespaces/{NS}/pods");
    let objectives =
        format!("/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{NS}/inferenceobjectives");
    let watch = query.get("watch").map(String::as_str) == Some("true");
    if path == objectives && method == Method::GET {
        return match mock.with(|s| s.objectives.clone()) {
            Some(items) => axum::Json(json!({
                "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                "kind": "InferenceObjectiveList",
                "metadata": {"resourceVersion": "1"},
                "items": items,
            }))
            .into_response(),
            None => status(404, "NotFound"),
        };
    }
    if path == format!("{pools}/{POOL}") && method == Method::GET {
        return match mock.with(|s| s.pool.clone()) {
            Some(p) => axum::Json(p).into_response(),
            None => status(404, "NotFound"),
        };
    }
    if path == pools && watch {
        return watch_stream(mock, "pool", &query);
    }
    if path == pods && watch {
        return watch_stream(mock, "pod", &query);
    }
    if path == pods && method == Method::GET {
        let sel = query.get("labelSelector");
        let (items, rv) = mock.with(|s| {
            (
                s.pods
                    .values()
                    .filter(|p| matches_selector(p, sel))
                    .cloned()
                    .collect::<Vec<_>>(),
                s.rv,
            )
        });
        return axum::Json(json!({"apiVersion": "v1", "kind": "PodList",
                                 "metadata": {"resourceVersion": rv.to_string()}, "items": items}))
        .into_response();
    }
    status(404, "NotFound")
}

fn url_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let h = u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap();
            out.push(h);
            i += 3;
        } else if b[i] == b'+' {
            out.push(b' ');
            i += 1;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

fn watch_stream(mock: Mock, kind: &'static str, query: &BTreeMap<String, String>) -> Response {
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let sel = query.get("labelSelector").cloned();
    let gone = kind == "pod" && mock.with(|s| std::mem::replace(&mut s.gone_next_pod_watch, false));
    let generation = mock.with(|s| s.generation);
    let stream = futures_util::stream::unfold(
        (mock, from, gone, false),
        move |(mock, mut last, gone, done)| {
            let sel = sel.clone();
            async move {
                if done {
                    return None;
                }
                if gone {
                    let e = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                        "metadata": {}, "status": "Failure", "message": "too old resource version",
                        "reason": "Expired", "code": 410}});
                    return Some((
                        Ok::<_, std::convert::Infallible>(format!("{e}\n")),
                        (mock, last, false, true),
                    ));
                }
                loop {
                    let (events, ended) = mock.with(|s| {
                        let evs: Vec<(u64, String)> = s
                            .history
                            .iter()
                            .filter(|(rv, k, _, o)| {
                                *rv > last && *k == kind && matches_selector(o, sel.as_ref())
                            })
                            .map(|(rv, _, ty, o)| {
                                (*rv, format!("{}\n", json!({"type": ty, "object": o})))
                            })
                            .collect();
                        (evs, s.generation != generation)
                    });
                    if ended {
                        return None;
                    }
                    if let Some((rv, line)) = events.into_iter().next() {
                        last = rv;
                        return Some((Ok(line), (mock, last, false, false)));
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        },
    );
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}

struct Harness {
    mock: Mock,
    router: Router,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn start(fixed: Vec<EndpointSpec>) -> Harness {
    let mock = Mock::spawn().await;
    start_with(mock, fixed).await
}

async fn start_with(mock: Mock, fixed: Vec<EndpointSpec>) -> Harness {
    let router = Router::new(RouterConfig {
        endpoints: fixed.clone(),
        ..RouterConfig::default()
    })
    .unwrap();
    let client = kube::Client::try_from(kube::Config::new(mock.url.parse().unwrap())).unwrap();
    let mut cfg = DiscoveryConfig::new(POOL, NS);
    cfg.request_timeout = Duration::from_millis(300);
    cfg.watch_timeout_s = 30;
    cfg.max_backoff = Duration::from_millis(100);
    let task = tokio::spawn(Discovery::new(cfg, client, router.clone(), fixed).run());
    Harness { mock, router, task }
}

fn urls(r: &Router) -> Vec<String> {
    let mut u = r.endpoints();
    u.sort();
    u
}

async fn wait_urls(r: &Router, want: &[&str]) {
    let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while urls(r) != want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "endpoints {:?}, want {want:?}",
            urls(r)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn ready(ip: &'static str) -> PodSpec {
    PodSpec {
        ip: Some(ip),
        ready: true,
        ..Default::default()
    }
}

#[tokio::test]
async fn ready_pods_are_registered_and_followed_by_watch() {
    let mock = Mock::spawn().await;
    mock.set_pool(&[8000]);
    mock.put_pod("a", ready("127.0.0.11"));
    mock.put_pod(
        "b",
        PodSpec {
            ip: Some("127.0.0.12"),
            ..Default::default()
        },
    );
    mock.put_pod(
        "other",
        PodSpec {
            app: "web",
            ..ready("127.0.0.13")
        },
    );
    mock.put_pod(
        "no-ip",
        PodSpec {
            ip: None,
            ..ready("x")
        },
    );
    let h = start_with(mock, vec![]).await;
    wait_urls(&h.router, &["http://127.0.0.11:8000"]).await;
    // b becomes ready; a starts terminating; then b goes away; d arrives with a kind.
    h.mock.put_pod("b", ready("127.0.0.12"));
    wait_urls(
        &h.router,
        &["http://127.0.0.11:8000", "http://127.0.0.12:8000"],
    )
    .await;
    h.mock.put_pod(
        "a",
        PodSpec {
            terminating: true,
            ..ready("127.0.0.11")
        },
    );
    wait_urls(&h.router, &["http://127.0.0.12:8000"]).await;
    h.mock.put_pod(
        "d",
        PodSpec {
            kind: Some("sglang"),
            kv: Some("tcp://*:5557"),
            ..ready("127.0.0.14")
        },
    );
    h.mock.delete_pod("b");
    wait_urls(&h.router, &["http://127.0.0.14:8000"]).await;
    let st = h.router.status();
    assert_eq!(st[0].spec.kind, EngineKind::Sglang);
    assert_eq!(
        st[0].spec.kv_events.as_deref(),
        Some("tcp://127.0.0.14:5557")
    );
    // Not ready again, then evicted (Failed): gone both times.
    h.mock.put_pod(
        "d",
        PodSpec {
            ready: false,
            ..ready("127.0.0.14")
        },
    );
    wait_urls(&h.router, &[]).await;
    h.mock.put_pod("d", ready("127.0.0.14"));
    wait_urls(&h.router, &["http://127.0.0.14:8000"]).await;
    h.mock.put_pod(
        "d",
        PodSpec {
            phase: "Failed",
            ..ready("127.0.0.14")
        },
    );
    wait_urls(&h.router, &[]).await;
    // A watch, not a list per tick: one pool read and one pod list in all.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.mock.pod_lists(), 1);
    let pool_gets = h
        .mock
        .requests(|l| l.path.ends_with(&format!("/inferencepools/{POOL}")));
    assert_eq!(pool_gets.len(), 1);
    let w = h.mock.pod_watches();
    assert_eq!(w.len(), 1);
    assert_eq!(
        w[0].query.get("labelSelector").map(String::as_str),
        Some("app=vllm")
    );
    assert!(
        w[0].query.contains_key("timeoutSeconds"),
        "watches are bounded"
    );
    assert!(
        h.mock.requests(|l| l.method != Method::GET).is_empty(),
        "discovery only reads"
    );
}

#[tokio::test]
async fn a_lost_watch_resumes_from_its_resource_version_and_gone_relists() {
    let mock = Mock::spawn().await;
    mock.set_pool(&[8000]);
    mock.put_pod("a", ready("127.0.0.21"));
    let h = start_with(mock, vec![]).await;
    wait_urls(&h.router, &["http://127.0.0.21:8000"]).await;
    h.mock.put_pod("b", ready("127.0.0.22"));
    wait_urls(
        &h.router,
        &["http://127.0.0.21:8000", "http://127.0.0.22:8000"],
    )
    .await;
    let last_rv = h.mock.with(|s| s.rv);
    h.mock.end_watches();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while h.mock.pod_watches().len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the watch was not resumed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let resumed = h.mock.pod_watches()[1].clone();
    assert_eq!(
        resumed.query.get("resourceVersion").map(String::as_str),
        Some(last_rv.to_string().as_str()),
        "resumed from the last version seen"
    );
    assert_eq!(h.mock.pod_lists(), 1, "no relist for a resumable watch");
    // Events after the resume still apply.
    h.mock.delete_pod("a");
    wait_urls(&h.router, &["http://127.0.0.22:8000"]).await;
    // 410 Gone: the version is too old; list again.
    h.mock.with(|s| s.gone_next_pod_watch = true);
    h.mock.end_watches();
    h.mock.put_pod("c", ready("127.0.0.23"));
    wait_urls(
        &h.router,
        &["http://127.0.0.22:8000", "http://127.0.0.23:8000"],
    )
    .await;
    assert_eq!(h.mock.pod_lists(), 2, "gone relists once");
}

#[tokio::test]
async fn pool_changes_and_deletion_are_followed() {
    let mock = Mock::spawn().await;
    mock.set_pool(&[8000]);
    mock.put_pod("a", ready("127.0.0.31"));
    let fixed = EndpointSpec::new("http://127.0.0.99:7000", EngineKind::Vllm);
    let h = start_with(mock, vec![fixed]).await;
    wait_urls(
        &h.router,
        &["http://127.0.0.31:8000", "http://127.0.0.99:7000"],
    )
    .await;
    // New target ports: the endpoints move.
    h.mock.set_pool(&[9000, 9001]);
    wait_urls(
        &h.router,
        &[
            "http://127.0.0.31:9000",
            "http://127.0.0.31:9001",
            "http://127.0.0.99:7000",
        ],
    )
    .await;
    // The pool is deleted: its endpoints go, the command-line one stays.
    h.mock.delete_pool();
    wait_urls(&h.router, &["http://127.0.0.99:7000"]).await;
    // And it comes back.
    h.mock.set_pool(&[8000]);
    wait_urls(
        &h.router,
        &["http://127.0.0.31:8000", "http://127.0.0.99:7000"],
    )
    .await;
}

#[tokio::test]
async fn api_failures_are_bounded_retried_and_keep_the_endpoints() {
    let mock = Mock::spawn().await;
    mock.set_pool(&[8000]);
    mock.put_pod("a", ready("127.0.0.41"));
    // The API hangs at first: each call is cut at the request timeout and retried.
    mock.with(|s| s.fault = Some(Fault::Hang));
    let h = start_with(mock, vec![]).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let tries = h.mock.requests(|_| true).len();
    assert!(tries >= 2, "retried after timeouts ({tries} calls)");
    assert!(urls(&h.router).is_empty());
    h.mock.with(|s| s.fault = Some(Fault::Status500));
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.mock.with(|s| s.fault = None);
    wait_urls(&h.router, &["http://127.0.0.41:8000"]).await;
    // An outage after the sync leaves the endpoints as they are.
    h.mock.with(|s| s.fault = Some(Fault::Status500));
    h.mock.end_watches();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(urls(&h.router), vec!["http://127.0.0.41:8000".to_string()]);
    // Bounded: a failing API is not hammered (capped backoff, not a busy loop).
    let n0 = h.mock.requests(|_| true).len();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let n1 = h.mock.requests(|_| true).len();
    assert!(n1 - n0 <= 15, "{} calls in 500 ms", n1 - n0);
    h.mock.with(|s| s.fault = None);
    h.mock.put_pod("b", ready("127.0.0.42"));
    wait_urls(
        &h.router,
        &["http://127.0.0.41:8000", "http://127.0.0.42:8000"],
    )
    .await;
}

#[tokio::test]
async fn a_missing_pool_has_no_endpoints_until_it_appears() {
    let h = start(vec![]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(urls(&h.router).is_empty());
    h.mock.put_pod("a", ready("127.0.0.51"));
    h.mock.set_pool(&[8000]);
    wait_urls(&h.router, &["http://127.0.0.51:8000"]).await;
}

fn objective(name: &str, pool: &str, priority: i64) -> Value {
    json!({
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"poolRef": {"name": pool}, "priority": priority},
    })
}

#[tokio::test]
async fn the_pools_inference_objectives_set_request_priorities() {
    let mock = Mock::spawn().await;
    let router = Router::new(RouterConfig {
        admission: serde_yaml::from_str("{objectives: {chat: 1}}").unwrap(),
        ..RouterConfig::default()
    })
    .unwrap();
    let client = kube::Client::try_from(kube::Config::new(mock.url.parse().unwrap())).unwrap();
    let task = strata_router::k8s::objectives::spawn(
        client,
        NS,
        POOL.into(),
        router.clone(),
        Duration::from_millis(50),
    );
    // No CRD in the cluster: router.yaml's objectives hold.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(router.objective_priority("chat"), Some(1));
    assert_eq!(router.objective_priority("agents"), None);
    // The cluster's objectives for this pool win; another pool's are ignored.
    mock.with(|s| {
        s.objectives = Some(vec![
            objective("chat", POOL, 10),
            objective("agents", POOL, 5),
            objective("batch", "another-pool", -3),
        ])
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while router.objective_priority("chat") != Some(10) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "objectives never read"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(router.objective_priority("agents"), Some(5));
    assert_eq!(router.objective_priority("batch"), None);
    // A failing API server keeps the last read.
    mock.with(|s| s.fault = Some(Fault::Status500));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(router.objective_priority("agents"), Some(5));
    // An objective deleted in the cluster goes; router.yaml's value returns.
    mock.with(|s| {
        s.fault = None;
        s.objectives = Some(vec![objective("agents", POOL, 5)]);
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while router.objective_priority("chat") != Some(1) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a deleted objective stayed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    task.abort();
}
