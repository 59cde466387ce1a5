//! Canary rollouts on Kubernetes against a mock API server (an axum server on loopback):
//! the runner moves traffic with [`HttpRouteSplitter`] (an HTTPRoute's backend weights)
//! and judges each step with [`PodMetricsStats`] (the versions' pods, listed by label, and
//! their `/metrics` pages). Traffic here follows the route: a simulator sends each tick's
//! requests to the two versions by the weights the mock route carries, and each version's
//! pod counts them on its page. A good canary is promoted (the route ends at 0/100), a
//! canary with errors or a slow TTFT is rolled back (100/0), and nothing but the route is
//! ever written: no scale, no pod, no Deployment call. Pods come and go mid-step (hooks on
//! the number of times a version's pods were listed) without their pages' history
//! deciding the step, restarts are judged per pod, and the mock honours `resourceVersion`
//! so a lost update on the route shows.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use strata_controller::config::KubernetesRolloutConfig;
use strata_controller::driver::kubernetes_rollout::{HttpRouteSplitter, PodMetricsStats, Split};
use strata_controller::kubernetes_rollouts::{routes, RolloutParts};
use strata_controller::metrics::ControllerMetrics;
use strata_controller::rollout::{Phase, RolloutConfig};
use strata_controller::rollout_client::{ClientError, RolloutClient, StartRollout};
use strata_controller::rollout_runner::{RolloutRunner, StepStats, TrafficSplitter};

const NS: &str = "serving";
const ROUTE: &str = "llama";
const STABLE: &str = "llama-pool";
const CANARY: &str = "llama-next-pool";

/// What a version's pod has served, as its `/metrics` page shows it.
#[derive(Debug, Default, Clone)]
struct Served {
    ok: u64,
    aborted: u64,
    /// TTFT observations at most 0.1 s, and between 0.1 s and 2 s.
    fast: u64,
    slow: u64,
}

impl Served {
    fn page(&self) -> String {
        format!(
            "vllm:request_success_total{{finished_reason=\"stop\",model_name=\"m\"}} {}\n\
             vllm:request_success_total{{finished_reason=\"abort\",model_name=\"m\"}} {}\n\
             vllm:time_to_first_token_seconds_bucket{{le=\"0.1\",model_name=\"m\"}} {}\n\
             vllm:time_to_first_token_seconds_bucket{{le=\"2.0\",model_name=\"m\"}} {}\n\
             vllm:time_to_first_token_seconds_bucket{{le=\"+Inf\",model_name=\"m\"}} {}\n",
            self.ok,
            self.aborted,
            self.fast,
            self.fast + self.slow,
            self.fast + self.slow
        )
    }
}

/// A pod of the mock cluster; its engine's page is `served`.
#[derive(Clone)]
struct MockPod {
    name: String,
    ip: IpAddr,
    created: String,
    ready: bool,
    restarts: u32,
    served: Arc<Mutex<Served>>,
}

impl MockPod {
    fn new(name: &str, ip: IpAddr, served: Arc<Mutex<Served>>) -> MockPod {
        MockPod {
            name: name.to_string(),
            ip,
            created: "2026-01-01T00:00:00Z".to_string(),
            ready: true,
            restarts: 0,
            served,
        }
    }

    fn json(&self) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": self.name, "namespace": NS, "uid": format!("uid-{}", self.name),
                         "creationTimestamp": self.created},
            "status": {"phase": "Running", "podIP": self.ip.to_string(),
                       "conditions": [{"type": "Ready",
                                       "status": if self.ready { "True" } else { "False" }}],
                       "containerStatuses": [{"name": "engine", "ready": self.ready,
                                              "restartCount": self.restarts,
                                              "image": "i", "imageID": "", "started": true}]}
        })
    }
}

/// A change to a version's pods, made when its pods have been listed `after` times.
struct Hook {
    selector: String,
    after: usize,
    change: Change,
}

enum Change {
    Add(MockPod),
    Remove(String),
    Ready(String),
}

#[derive(Default)]
struct Cluster {
    route: Value,
    /// The canary's share after each route patch the API server took.
    shares: Vec<u8>,
    /// Every write that was not a route patch (there must be none).
    other_writes: Vec<String>,
    /// Pods by version selector (`app=stable`, `app=canary`).
    pods: BTreeMap<String, Vec<MockPod>>,
    /// How many times each selector's pods were listed.
    lists: BTreeMap<String, usize>,
    hooks: Vec<Hook>,
    /// Someone else edits the route just before the next patch lands.
    outside_edit: bool,
    /// Route patches answered 409 Conflict.
    conflicts: usize,
}

type Shared = Arc<Mutex<Cluster>>;

fn route() -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": ROUTE, "namespace": NS, "resourceVersion": "1"},
        "spec": {
            "parentRefs": [{"name": "gw"}],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io",
                                 "kind": "InferencePool", "name": STABLE}]
            }]
        }
    })
}

fn share_of(route: &Value) -> u8 {
    route["spec"]["rules"][0]["backendRefs"]
        .as_array()
        .and_then(|refs| refs.iter().find(|r| r["name"] == CANARY))
        .and_then(|r| r["weight"].as_u64())
        .unwrap_or(0) as u8
}

/// A JSON merge patch (RFC 7386) of `patch` into `target`.
fn merge(target: &mut Value, patch: &Value) {
    let Some(fields) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let obj = target.as_object_mut().unwrap();
    for (k, v) in fields {
        if v.is_null() {
            obj.remove(k);
        } else {
            merge(obj.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// Bumps the route's resourceVersion, as every write does.
fn bump(route: &mut Value) {
    let v: u64 = route["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    route["metadata"]["resourceVersion"] = json!((v + 1).to_string());
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                      "message": message, "reason": reason, "code": code.as_u16()});
    (code, axum::Json(body)).into_response()
}

async fn api_server(State(c): State<Shared>, method: Method, uri: Uri, body: Bytes) -> Response {
    let path = uri.path().to_string();
    let route_path =
        format!("/apis/gateway.networking.k8s.io/v1/namespaces/{NS}/httproutes/{ROUTE}");
    let mut c = c.lock().unwrap();
    if path == route_path && method == Method::GET {
        return axum::Json(c.route.clone()).into_response();
    }
    if path == route_path && method == Method::PATCH {
        let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if patch.pointer("/spec/rules").is_none() {
            return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "no rules");
        }
        if std::mem::take(&mut c.outside_edit) {
            // Someone adds a hostname and a filter to the rule between the read and the
            // write.
            c.route["spec"]["hostnames"] = json!(["llama.serving.internal"]);
            c.route["spec"]["rules"][0]["filters"] = json!([{
                "type": "RequestHeaderModifier",
                "requestHeaderModifier": {"set": [{"name": "x-tenant", "value": "a"}]}
            }]);
            bump(&mut c.route);
        }
        // A patch that names a resourceVersion applies to that version only.
        if let Some(v) = patch.pointer("/metadata/resourceVersion") {
            if *v != c.route["metadata"]["resourceVersion"] {
                c.conflicts += 1;
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version and try again",
                );
            }
        }
        merge(&mut c.route, &patch);
        bump(&mut c.route);
        let share = share_of(&c.route);
        c.shares.push(share);
        return axum::Json(c.route.clone()).into_response();
    }
    if path == format!("/api/v1/namespaces/{NS}/pods") && method == Method::GET {
        let selector = uri
            .query()
            .and_then(|q| url_param(q, "labelSelector"))
            .unwrap_or_default();
        let n = {
            let n = c.lists.entry(selector.clone()).or_default();
            *n += 1;
            *n
        };
        let due: Vec<Hook> = {
            let (due, keep) = std::mem::take(&mut c.hooks)
                .into_iter()
                .partition(|h| h.selector == selector && h.after < n);
            c.hooks = keep;
            due
        };
        for h in due {
            let pods = c.pods.entry(selector.clone()).or_default();
            match h.change {
                Change::Add(p) => pods.push(p),
                Change::Remove(name) => pods.retain(|p| p.name != name),
                Change::Ready(name) => pods
                    .iter_mut()
                    .filter(|p| p.name == name)
                    .for_each(|p| p.ready = true),
            }
        }
        let items: Vec<Value> = c
            .pods
            .get(&selector)
            .map(|pods| pods.iter().map(MockPod::json).collect())
            .unwrap_or_default();
        return axum::Json(json!({"apiVersion": "v1", "kind": "PodList",
                                 "metadata": {"resourceVersion": "1"}, "items": items}))
        .into_response();
    }
    if method != Method::GET {
        c.other_writes.push(format!("{method} {path}"));
    }
    (StatusCode::NOT_FOUND, "not here").into_response()
}

/// A query parameter, percent-decoded (enough for `app=stable`).
fn url_param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| v.replace("%3D", "=").replace("%3d", "="))
    })
}

/// How the canary behaves.
#[derive(Clone, Copy, PartialEq)]
enum Canary {
    Good,
    Errors,
    SlowTtft,
}

struct Fixture {
    cluster: Shared,
    api: String,
    port: u16,
    served: BTreeMap<&'static str, Arc<Mutex<Served>>>,
}

/// Binds `ip:port` (port 0: any) and serves `served`'s page at `/metrics`.
async fn pod_metrics(ip: IpAddr, port: u16, served: Arc<Mutex<Served>>) -> SocketAddr {
    let l = tokio::net::TcpListener::bind((ip, port)).await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let s = served.clone();
            async move { s.lock().unwrap().page() }
        }),
    );
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

async fn fixture(canary: Canary) -> Fixture {
    let cluster: Shared = Arc::new(Mutex::new(Cluster {
        route: route(),
        ..Cluster::default()
    }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api = format!("http://{}", l.local_addr().unwrap());
    let app = axum::Router::new()
        .fallback(api_server)
        .with_state(cluster.clone());
    tokio::spawn(async move { axum::serve(l, app).await });

    // One pod per version, on two loopback addresses and the same port.
    let stable_ip: IpAddr = "127.0.0.2".parse().unwrap();
    let canary_ip: IpAddr = "127.0.0.3".parse().unwrap();
    let stable = Arc::new(Mutex::new(Served::default()));
    let canary_served = Arc::new(Mutex::new(Served::default()));
    let port = pod_metrics(stable_ip, 0, stable.clone()).await.port();
    pod_metrics(canary_ip, port, canary_served.clone()).await;
    {
        let mut c = cluster.lock().unwrap();
        c.pods.insert(
            "app=stable".into(),
            vec![MockPod::new("stable", stable_ip, stable.clone())],
        );
        c.pods.insert(
            "app=canary".into(),
            vec![MockPod::new("canary", canary_ip, canary_served.clone())],
        );
    }

    // Traffic: 20 requests every 10 ms, split by the weights the route carries now, and
    // within a version in turn over its ready pods.
    let c = cluster.clone();
    tokio::spawn(async move {
        let mut sent = 0u64;
        let mut turns = [0usize; 2];
        loop {
            {
                let c = c.lock().unwrap();
                let share = u64::from(share_of(&c.route));
                for _ in 0..20 {
                    sent += 1;
                    let to_canary = (sent % 100) < share;
                    let (selector, bad, turn) = if to_canary {
                        ("app=canary", canary, &mut turns[1])
                    } else {
                        ("app=stable", Canary::Good, &mut turns[0])
                    };
                    let ready: Vec<&MockPod> =
                        c.pods[selector].iter().filter(|p| p.ready).collect();
                    if ready.is_empty() {
                        continue;
                    }
                    *turn += 1;
                    let mut t = ready[*turn % ready.len()].served.lock().unwrap();
                    match bad {
                        // One request in five fails.
                        Canary::Errors if sent.is_multiple_of(5) => t.aborted += 1,
                        _ => t.ok += 1,
                    }
                    if bad == Canary::SlowTtft {
                        t.slow += 1;
                    } else {
                        t.fast += 1;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    Fixture {
        cluster,
        api,
        port,
        served: BTreeMap::from([("stable", stable), ("canary", canary_served)]),
    }
}

fn client(f: &Fixture) -> kube::Client {
    kube::Client::try_from(kube::Config::new(f.api.parse().unwrap())).unwrap()
}

/// The step statistics of the fixture's two versions.
fn pod_stats(f: &Fixture) -> PodMetricsStats {
    PodMetricsStats::new(
        client(f),
        NS,
        BTreeMap::from([
            (STABLE.to_string(), "app=stable".to_string()),
            (CANARY.to_string(), "app=canary".to_string()),
        ]),
        f.port,
        false,
        reqwest::Client::new(),
        Duration::from_secs(2),
    )
}

/// Another pod at `ip`, its page serving on the fixture's port, showing `served`.
async fn extra_pod(f: &Fixture, name: &str, ip: &str, served: Served) -> MockPod {
    let ip: IpAddr = ip.parse().unwrap();
    let served = Arc::new(Mutex::new(served));
    pod_metrics(ip, f.port, served.clone()).await;
    MockPod::new(name, ip, served)
}

/// Runs a rollout of the canary to its end (at most 15 s); the final phase, the split the
/// route carries and the last decision's reason.
async fn run(f: &Fixture) -> (Phase, Option<Split>, String) {
    let splitter = Arc::new(HttpRouteSplitter::spawn(
        client(f),
        NS,
        ROUTE,
        Duration::from_secs(2),
    ));
    let stats = pod_stats(f);
    let cfg = RolloutConfig {
        steps: vec![10, 50, 100],
        step_min_secs: 0.3,
        min_requests: 20,
        inconclusive_after_secs: 10.0,
        ..RolloutConfig::default()
    };
    let mut runner = RolloutRunner::start(
        cfg,
        CANARY,
        STABLE,
        splitter.clone(),
        stats,
        Arc::new(ControllerMetrics::new()),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while runner.state().phase == Phase::Progressing {
        assert!(
            Instant::now() < deadline,
            "the rollout never ended: {:?}",
            runner.history
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        runner.tick().await;
    }
    // The last weight reaches the route.
    let want = if runner.state().phase == Phase::Promoted {
        100
    } else {
        0
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while splitter.applied().map(|s| s.canary_percent) != Some(want) {
        assert!(
            Instant::now() < deadline,
            "the final weight never reached the route"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reason = runner
        .history
        .last()
        .map(|d| d.reason.clone())
        .unwrap_or_default();
    (runner.state().phase, splitter.applied(), reason)
}

#[tokio::test]
async fn a_good_canary_is_promoted_by_route_weights_alone() {
    let f = fixture(Canary::Good).await;
    let (phase, applied, _) = run(&f).await;
    assert_eq!(phase, Phase::Promoted);
    let c = f.cluster.lock().unwrap();
    // Every step went through the route, rising, ending with all traffic on the canary.
    assert_eq!(c.shares.first(), Some(&10));
    assert!(c.shares.windows(2).all(|w| w[0] <= w[1]), "{:?}", c.shares);
    assert_eq!(c.shares.last(), Some(&100));
    assert!(c.shares.contains(&50), "{:?}", c.shares);
    let refs = c.route["spec"]["rules"][0]["backendRefs"]
        .as_array()
        .unwrap();
    assert_eq!(refs.len(), 2);
    assert_eq!(
        (&refs[0]["name"], &refs[0]["weight"]),
        (&json!(STABLE), &json!(0))
    );
    assert_eq!(refs[1]["kind"], "InferencePool");
    assert_eq!(applied.unwrap().canary, CANARY);
    assert!(c.other_writes.is_empty(), "{:?}", c.other_writes);
    // The canary served real traffic at each step.
    assert!(f.served["canary"].lock().unwrap().ok > 40);
}

#[tokio::test]
async fn a_canary_with_errors_is_rolled_back_by_route_weights_alone() {
    let f = fixture(Canary::Errors).await;
    let (phase, _, reason) = run(&f).await;
    assert_eq!(phase, Phase::RolledBack);
    assert!(reason.contains("error"), "{reason}");
    let c = f.cluster.lock().unwrap();
    assert_eq!(c.shares.first(), Some(&10));
    assert_eq!(c.shares.last(), Some(&0), "{:?}", c.shares);
    assert!(!c.shares.contains(&100), "{:?}", c.shares);
    assert!(c.other_writes.is_empty(), "{:?}", c.other_writes);
    assert!(f.served["canary"].lock().unwrap().aborted > 0);
}

#[tokio::test]
async fn a_canary_with_a_slow_first_token_is_rolled_back() {
    let f = fixture(Canary::SlowTtft).await;
    let (phase, _, reason) = run(&f).await;
    assert_eq!(phase, Phase::RolledBack);
    assert!(reason.to_lowercase().contains("ttft"), "{reason}");
    let c = f.cluster.lock().unwrap();
    assert_eq!(c.shares.last(), Some(&0), "{:?}", c.shares);
    assert!(c.other_writes.is_empty(), "{:?}", c.other_writes);
    // The stable version's pod kept serving throughout.
    assert!(f.served["stable"].lock().unwrap().ok > 0);
}

#[tokio::test]
async fn canary_pods_that_show_up_mid_step_with_old_aborts_do_not_roll_back_a_good_canary() {
    let f = fixture(Canary::Good).await;
    let old_aborts = Served {
        aborted: 1000,
        slow: 1000,
        ..Served::default()
    };
    // One pod is listed from the start but not ready (its page is not read at the mark),
    // another (created long ago) starts matching the selector mid-step; both pages are
    // full of aborts served before the rollout.
    let mut late = extra_pod(&f, "canary-late", "127.0.0.4", old_aborts.clone()).await;
    late.ready = false;
    let relabelled = extra_pod(&f, "canary-relabelled", "127.0.0.5", old_aborts).await;
    {
        let mut c = f.cluster.lock().unwrap();
        c.pods.get_mut("app=canary").unwrap().push(late);
        // The first tick lists the canary's pods twice (its stats mark the step, then its
        // health): both changes land before the second tick reads them.
        for change in [Change::Ready("canary-late".into()), Change::Add(relabelled)] {
            c.hooks.push(Hook {
                selector: "app=canary".into(),
                after: 2,
                change,
            });
        }
    }
    let (phase, _, reason) = run(&f).await;
    assert_eq!(phase, Phase::Promoted, "{reason}");
    let c = f.cluster.lock().unwrap();
    assert!(c.hooks.is_empty(), "the pods never changed");
    assert_eq!(c.pods["app=canary"].len(), 3);
    assert_eq!(c.shares.last(), Some(&100), "{:?}", c.shares);
    // Both served the canary's traffic once ready.
    for p in &c.pods["app=canary"] {
        assert!(p.served.lock().unwrap().ok > 0, "{} served nothing", p.name);
    }
}

#[tokio::test]
async fn a_canary_pod_that_goes_away_mid_step_does_not_hide_the_errors_of_the_other() {
    let f = fixture(Canary::Errors).await;
    // A second canary pod with a long history goes away after the step's mark: its counters
    // leave the sum, which must not cancel what the other pod serves.
    let busy = extra_pod(
        &f,
        "canary-busy",
        "127.0.0.4",
        Served {
            ok: 10_000,
            aborted: 10_000,
            fast: 20_000,
            slow: 0,
        },
    )
    .await;
    {
        let mut c = f.cluster.lock().unwrap();
        c.pods.get_mut("app=canary").unwrap().push(busy);
        c.hooks.push(Hook {
            selector: "app=canary".into(),
            after: 2,
            change: Change::Remove("canary-busy".into()),
        });
    }
    let started = Instant::now();
    let (phase, _, reason) = run(&f).await;
    assert_eq!(phase, Phase::RolledBack);
    // On the errors, not for want of requests.
    assert_eq!(reason, "canary regressed on error_rate");
    assert!(started.elapsed() < Duration::from_secs(5));
    let c = f.cluster.lock().unwrap();
    assert!(c.hooks.is_empty(), "the pod never went away");
    assert_eq!(c.pods["app=canary"].len(), 1);
    assert_eq!(c.shares.last(), Some(&0), "{:?}", c.shares);
}

#[tokio::test]
async fn a_pod_whose_restarts_rise_is_unhealthy_even_when_another_is_replaced() {
    let f = fixture(Canary::Good).await;
    let crashed = extra_pod(&f, "canary-crashed", "127.0.0.4", Served::default()).await;
    let fresh = extra_pod(&f, "canary-fresh", "127.0.0.5", Served::default()).await;
    let set = |pods: Vec<MockPod>| {
        f.cluster
            .lock()
            .unwrap()
            .pods
            .insert("app=canary".into(), pods);
    };
    let first = f.cluster.lock().unwrap().pods["app=canary"][0].clone();
    let mut crashed = crashed;
    crashed.restarts = 4;

    // A pod that had crashed before the rollout is replaced: healthy.
    let mut stats = pod_stats(&f);
    set(vec![first.clone(), crashed.clone()]);
    assert!(stats.healthy(CANARY).await);
    set(vec![first.clone(), fresh.clone()]);
    assert!(stats.healthy(CANARY).await, "a replacement is not a crash");

    // The same replacement while the other pod restarts as many times: the sum of the
    // restarts is what it was at the start, but a pod crashed.
    let mut stats = pod_stats(&f);
    set(vec![first.clone(), crashed]);
    assert!(stats.healthy(CANARY).await);
    let mut restarted = first;
    restarted.restarts = 4;
    set(vec![restarted, fresh.clone()]);
    assert!(!stats.healthy(CANARY).await);
    // It stays unhealthy.
    set(vec![fresh]);
    assert!(!stats.healthy(CANARY).await);
}

#[tokio::test]
async fn an_outside_edit_between_the_read_and_the_write_of_the_route_is_kept() {
    let f = fixture(Canary::Good).await;
    f.cluster.lock().unwrap().outside_edit = true;
    let splitter = HttpRouteSplitter::spawn(client(&f), NS, ROUTE, Duration::from_secs(2));
    splitter.set_split(STABLE, CANARY, 10).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while splitter.applied().map(|s| s.canary_percent) != Some(10) {
        assert!(
            Instant::now() < deadline,
            "the split never reached the route"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = f.cluster.lock().unwrap();
    // The first write was refused as stale, the second made on the edited route.
    assert_eq!(c.conflicts, 1);
    assert_eq!(c.shares, vec![10]);
    assert_eq!(c.route["metadata"]["resourceVersion"], "3");
    assert_eq!(
        c.route["spec"]["hostnames"],
        json!(["llama.serving.internal"])
    );
    let rule = &c.route["spec"]["rules"][0];
    assert_eq!(rule["filters"][0]["type"], "RequestHeaderModifier");
    assert_eq!(rule["matches"][0]["path"]["value"], "/");
    let refs = rule["backendRefs"].as_array().unwrap();
    let weights: Vec<(&str, u64)> = refs
        .iter()
        .map(|r| (r["name"].as_str().unwrap(), r["weight"].as_u64().unwrap()))
        .collect();
    assert_eq!(weights, vec![(STABLE, 90), (CANARY, 10)]);
    assert!(c.other_writes.is_empty(), "{:?}", c.other_writes);
}

/// The controller's rollout API over the fixture's cluster, as the controller serves it
/// with `kubernetesRollout:`; a `strata rollout` client of it.
async fn controller_api(f: &Fixture) -> RolloutClient {
    let client = kube::Client::try_from(kube::Config::new(f.api.parse().unwrap())).unwrap();
    let parts = RolloutParts {
        client,
        namespace: NS.to_string(),
        cfg: KubernetesRolloutConfig {
            route: ROUTE.to_string(),
            pools: BTreeMap::from([
                (STABLE.to_string(), "app=stable".to_string()),
                (CANARY.to_string(), "app=canary".to_string()),
            ]),
        },
        rollout: RolloutConfig {
            steps: vec![10, 50, 100],
            step_min_secs: 0.3,
            min_requests: 20,
            inconclusive_after_secs: 10.0,
            ..RolloutConfig::default()
        },
        port: f.port,
        https: false,
        http: reqwest::Client::new(),
        interval: Duration::from_millis(50),
        timeout: Duration::from_secs(2),
        metrics: Arc::new(ControllerMetrics::new()),
    };
    let app = axum::Router::new().nest("/controller/rollout", routes(parts));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    RolloutClient::new(&base)
}

fn start(model: &str, baseline: &str) -> StartRollout {
    StartRollout {
        model: model.to_string(),
        baseline: baseline.to_string(),
        steps: None,
        replicas: None,
        engine_args: Vec::new(),
    }
}

fn api_status(r: Result<impl std::fmt::Debug, ClientError>) -> u16 {
    match r {
        Err(ClientError::Api { status, .. }) => status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn strata_rollout_promotes_a_good_canary_through_the_controller_api() {
    let f = fixture(Canary::Good).await;
    let rc = controller_api(&f).await;
    // Bad requests change nothing.
    assert_eq!(api_status(rc.start(&start("nope-pool", STABLE)).await), 400);
    assert_eq!(api_status(rc.start(&start(STABLE, STABLE)).await), 400);
    let mut with_replicas = start(CANARY, STABLE);
    with_replicas.replicas = Some(2);
    assert_eq!(api_status(rc.start(&with_replicas).await), 400);
    assert_eq!(api_status(rc.promote().await), 409);
    assert!(rc.status().await.unwrap().rollout.is_none());
    assert!(f.cluster.lock().unwrap().shares.is_empty());

    let v = rc.start(&start(CANARY, STABLE)).await.unwrap();
    assert_eq!(v.phase(), Phase::Progressing);
    assert_eq!((v.canary.as_str(), v.baseline.as_str()), (CANARY, STABLE));
    // One rollout at a time.
    assert_eq!(api_status(rc.start(&start(CANARY, STABLE)).await), 409);

    let deadline = Instant::now() + Duration::from_secs(20);
    let view = loop {
        let v = rc.status().await.unwrap().rollout.unwrap();
        if v.phase() != Phase::Progressing {
            break v;
        }
        assert!(Instant::now() < deadline, "never ended: {:?}", v.decisions);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(view.phase(), Phase::Promoted, "{:?}", view.decisions);
    assert_eq!(view.split.get(CANARY), Some(&100.0));
    assert!(!view.decisions.is_empty());
    // The route ends with all traffic on the canary, by weights alone.
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.cluster.lock().unwrap().shares.last() != Some(&100) {
        assert!(Instant::now() < deadline, "the route never reached 100");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = f.cluster.lock().unwrap();
    assert!(
        c.shares.contains(&10) && c.shares.contains(&50),
        "{:?}",
        c.shares
    );
    assert!(c.other_writes.is_empty(), "{:?}", c.other_writes);
}

#[tokio::test]
async fn strata_rollout_rolls_back_by_hand_through_the_controller_api() {
    let f = fixture(Canary::Good).await;
    let rc = controller_api(&f).await;
    rc.start(&start(CANARY, STABLE)).await.unwrap();
    // Once the canary carries traffic, the operator rolls back.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f.cluster.lock().unwrap().shares.contains(&10) {
        assert!(
            Instant::now() < deadline,
            "the first step never reached the route"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let v = rc.rollback().await.unwrap();
    assert_eq!(v.phase(), Phase::RolledBack);
    assert_eq!(v.split.get(CANARY), Some(&0.0));
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.cluster.lock().unwrap().shares.last() != Some(&0) {
        assert!(Instant::now() < deadline, "the route never went back to 0");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing is left to promote, and the rollout stays rolled back.
    assert_eq!(api_status(rc.promote().await), 409);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = f.cluster.lock().unwrap();
    assert!(!c.shares.contains(&100), "{:?}", c.shares);
    assert_eq!(c.shares.last(), Some(&0));
    assert!(c.other_writes.is_empty(), "{:?}", c.other_writes);
}
