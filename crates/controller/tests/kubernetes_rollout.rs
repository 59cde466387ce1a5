//! Canary rollouts on Kubernetes against a mock API server (an axum server on loopback):
//! the runner moves traffic with [`HttpRouteSplitter`] (an HTTPRoute's backend weights)
//! and judges each step with [`PodMetricsStats`] (the versions' pods, listed by label, and
//! their `/metrics` pages). Traffic here follows the route: a simulator sends each tick's
//! requests to the two versions by the weights the mock route carries, and each version's
//! pod counts them on its page. A good canary is promoted (the route ends at 0/100), a
//! canary with errors or a slow TTFT is rolled back (100/0), and nothing but the route is
//! ever written: no scale, no pod, no Deployment call.

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
use strata_controller::rollout_runner::RolloutRunner;

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

#[derive(Default)]
struct Cluster {
    route: Value,
    /// The canary's share after each route patch.
    shares: Vec<u8>,
    /// Every write that was not a route patch (there must be none).
    other_writes: Vec<String>,
    /// Pod IPs by version selector (`app=stable`, `app=canary`).
    pods: BTreeMap<String, IpAddr>,
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

fn pod(name: &str, ip: IpAddr) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
        "status": {"phase": "Running", "podIP": ip.to_string(),
                   "conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"name": "engine", "ready": true, "restartCount": 0,
                                          "image": "i", "imageID": "", "started": true}]}
    })
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
        let Some(rules) = patch.pointer("/spec/rules").cloned() else {
            return (StatusCode::UNPROCESSABLE_ENTITY, "no rules").into_response();
        };
        c.route["spec"]["rules"] = rules;
        let share = share_of(&c.route);
        c.shares.push(share);
        return axum::Json(c.route.clone()).into_response();
    }
    if path == format!("/api/v1/namespaces/{NS}/pods") && method == Method::GET {
        let selector = uri
            .query()
            .and_then(|q| url_param(q, "labelSelector"))
            .unwrap_or_default();
        let items: Vec<Value> = c
            .pods
            .get(&selector)
            .map(|ip| vec![pod(&selector.replace("app=", ""), *ip)])
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
        c.pods.insert("app=stable".into(), stable_ip);
        c.pods.insert("app=canary".into(), canary_ip);
    }

    // Traffic: 20 requests every 10 ms, split by the weights the route carries now.
    let (c, s, k) = (cluster.clone(), stable.clone(), canary_served.clone());
    tokio::spawn(async move {
        let mut sent = 0u64;
        loop {
            let share = u64::from(share_of(&c.lock().unwrap().route));
            for _ in 0..20 {
                sent += 1;
                let to_canary = (sent % 100) < share;
                let (target, bad) = if to_canary {
                    (&k, canary)
                } else {
                    (&s, Canary::Good)
                };
                let mut t = target.lock().unwrap();
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

/// Runs a rollout of the canary to its end (at most 15 s); the final phase, the split the
/// route carries and the last decision's reason.
async fn run(f: &Fixture) -> (Phase, Option<Split>, String) {
    let client = kube::Client::try_from(kube::Config::new(f.api.parse().unwrap())).unwrap();
    let timeout = Duration::from_secs(2);
    let splitter = Arc::new(HttpRouteSplitter::spawn(client.clone(), NS, ROUTE, timeout));
    let stats = PodMetricsStats::new(
        client,
        NS,
        BTreeMap::from([
            (STABLE.to_string(), "app=stable".to_string()),
            (CANARY.to_string(), "app=canary".to_string()),
        ]),
        f.port,
        false,
        reqwest::Client::new(),
        timeout,
    );
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
