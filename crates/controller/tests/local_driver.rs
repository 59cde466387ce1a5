//! The local driver against real child processes: this test binary re-runs itself as a
//! fake engine (the ignored `fake_engine` test), so no model is loaded. The engine is
//! `strata-mock` (the one fake engine); what is a process's own (its port, exiting, the
//! answer to SIGTERM) is set up here.
//!
//! The fake engine listens on `FAKE_PORT`, answers `/health` with 503 while
//! `FAKE_NEVER_READY` is set or for `FAKE_READY_AFTER_MS`, serves vLLM gauges at `/metrics`
//! read from the JSON file `FAKE_STATE` on every request, exits with status 3 after
//! `FAKE_EXIT_AFTER_MS`, and on SIGTERM writes `<FAKE_MARK_DIR>/<port>.term` and exits 0.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_controller::autoscale::AutoscaleConfig;
use strata_controller::controller::Controller;
use strata_controller::driver::local::{LocalDriver, LocalDriverConfig};
use strata_controller::driver::{
    Driver, ReplicaEvent, ReplicaInfo, ReplicaPhase, ReplicaRegistrar,
};
use strata_controller::metrics::ControllerMetrics;
use strata_controller::signals::{EngineKind, MetricsScraper};
use strata_mock::{Fault, MockConfig, MockEngine};

#[test]
#[ignore = "helper process for the local-driver tests, started by them"]
fn fake_engine() {
    let Ok(port) = std::env::var("FAKE_PORT") else {
        return;
    };
    let port: u16 = port.parse().unwrap();
    let never_ready = std::env::var("FAKE_NEVER_READY").is_ok();
    let ready_after = Duration::from_millis(
        std::env::var("FAKE_READY_AFTER_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    let exit_after: Option<u64> = std::env::var("FAKE_EXIT_AFTER_MS")
        .ok()
        .and_then(|v| v.parse().ok());
    // Exits (status 0) once this file exists: the test decides when the process ends.
    let exit_on_file = std::env::var("FAKE_EXIT_ON_FILE").ok().map(PathBuf::from);
    let config = MockConfig {
        gauges_file: std::env::var("FAKE_STATE").ok().map(PathBuf::from),
        ..MockConfig::default()
    };
    let mark_dir = std::env::var("FAKE_MARK_DIR").ok().map(PathBuf::from);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let engine = Arc::new(MockEngine::serve(config, listener).unwrap());
        if never_ready || !ready_after.is_zero() {
            engine.set_fault(Fault::NotReady);
        }
        if !never_ready && !ready_after.is_zero() {
            let engine = engine.clone();
            tokio::spawn(async move {
                tokio::time::sleep(ready_after).await;
                engine.set_fault(Fault::None);
            });
        }
        let exit = async {
            match exit_after {
                Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                None => std::future::pending().await,
            }
        };
        let exit_on_file = async {
            match exit_on_file {
                Some(path) => {
                    while !path.exists() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
        tokio::select! {
            _ = exit => std::process::exit(3),
            _ = exit_on_file => std::process::exit(0),
            _ = term.recv() => {
                if let Some(d) = mark_dir {
                    std::fs::write(d.join(format!("{port}.term")), b"").unwrap();
                }
            }
        }
    });
}

/// Records what the driver told the router.
#[derive(Default)]
struct Recorder {
    log: Mutex<Vec<String>>,
    ready: Mutex<BTreeMap<String, String>>,
}

impl ReplicaRegistrar for Recorder {
    fn register(&self, r: &ReplicaInfo) {
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

struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        Env {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state.json")
    }

    fn set_load(&self, waiting: f64, running: f64) {
        let tmp = self.dir.path().join("state.tmp");
        std::fs::write(
            &tmp,
            serde_json::json!({"waiting": waiting, "running": running, "kv_usage": 0.1})
                .to_string(),
        )
        .unwrap();
        std::fs::rename(tmp, self.state()).unwrap();
    }

    fn config(&self, extra_env: &[(&str, &str)]) -> LocalDriverConfig {
        let mut env = BTreeMap::new();
        env.insert("FAKE_PORT".to_string(), "{port}".to_string());
        env.insert("FAKE_STATE".to_string(), self.state().display().to_string());
        env.insert(
            "FAKE_MARK_DIR".to_string(),
            self.dir.path().display().to_string(),
        );
        for (k, v) in extra_env {
            env.insert(k.to_string(), v.to_string());
        }
        LocalDriverConfig {
            command: Some(std::env::current_exe().unwrap()),
            args: [
                "fake_engine",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ]
            .map(String::from)
            .to_vec(),
            env,
            ready_timeout_secs: 20.0,
            health_poll_ms: 50,
            drain_timeout_secs: 20.0,
            stop_grace_secs: 5.0,
            log_dir: Some(self.dir.path().to_path_buf()),
            ..LocalDriverConfig::default()
        }
    }

    fn terminated(&self, url: &str) -> bool {
        let port = url.rsplit(':').next().unwrap();
        self.dir.path().join(format!("{port}.term")).exists()
    }
}

/// Calls `reconcile(desired)` until `done` holds for the events seen so far (20 s at most).
async fn reconcile_until(
    driver: &mut LocalDriver,
    desired: u32,
    seen: &mut Vec<ReplicaEvent>,
    done: impl Fn(&[ReplicaEvent], &[ReplicaInfo]) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        seen.extend(driver.reconcile(desired).await.unwrap());
        if done(seen, &driver.replicas()) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "gave up; events so far: {seen:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn count(events: &[ReplicaEvent], kind: &str) -> usize {
    events.iter().filter(|e| e.kind() == kind).count()
}

fn ready(replicas: &[ReplicaInfo]) -> usize {
    replicas
        .iter()
        .filter(|r| r.phase == ReplicaPhase::Ready)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_register_when_ready_and_drain_before_stopping() {
    let env = Env::new();
    env.set_load(0.0, 0.0);
    let rec = Arc::new(Recorder::default());
    let mut driver =
        LocalDriver::new(env.config(&[("FAKE_READY_AFTER_MS", "300")]), rec.clone()).unwrap();
    let mut seen = Vec::new();
    reconcile_until(&mut driver, 2, &mut seen, |_, r| ready(r) == 2).await;
    assert_eq!(count(&seen, "started"), 2);
    assert_eq!(rec.ready.lock().unwrap().len(), 2);
    // Each registered replica answers (it was registered only once it did).
    let client = reqwest::Client::new();
    let urls: Vec<String> = rec.ready.lock().unwrap().values().cloned().collect();
    for url in urls {
        let r = client.get(format!("{url}/health")).send().await.unwrap();
        assert!(r.status().is_success());
    }

    // Scale in while the victim still has a request running: deregistered at once,
    // stopped only once idle.
    env.set_load(0.0, 1.0);
    let events = driver.reconcile(1).await.unwrap();
    let victim = match events.iter().find(|e| e.kind() == "draining") {
        Some(ReplicaEvent::Draining { id }) => id.clone(),
        other => panic!("{other:?} in {events:?}"),
    };
    assert!(rec.log.lock().unwrap().contains(&format!("-{victim}")));
    let victim_url = driver
        .replicas()
        .into_iter()
        .find(|r| r.id == victim)
        .map(|r| r.url)
        .unwrap();
    assert_eq!(victim, "local-2", "the newest goes first");
    // Still serving its request a while later.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!env.terminated(&victim_url));
    assert!(driver
        .replicas()
        .iter()
        .any(|r| r.id == victim && r.phase == ReplicaPhase::Draining));
    env.set_load(0.0, 0.0);
    let mut seen = Vec::new();
    reconcile_until(&mut driver, 1, &mut seen, |e, _| count(e, "stopped") == 1).await;
    assert!(
        matches!(&seen[..], [.., ReplicaEvent::Stopped { forced: false, .. }]),
        "{seen:?}"
    );
    assert!(
        env.terminated(&victim_url),
        "stopped with SIGTERM after the drain"
    );
    assert_eq!(ready(&driver.replicas()), 1);
    assert_eq!(driver.replicas().len(), 1);

    let events = driver.shutdown().await;
    assert_eq!(count(&events, "stopped"), 1, "{events:?}");
    assert!(driver.replicas().is_empty());
    assert!(rec.ready.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_whose_process_ends_stops_without_waiting_out_the_drain() {
    // A request runs forever by the gauges, so only the process's end can finish the drain.
    let env = Env::new();
    env.set_load(0.0, 1.0);
    let exit_file = env.dir.path().join("exit-now");
    let rec = Arc::new(Recorder::default());
    let cfg = env.config(&[("FAKE_EXIT_ON_FILE", &exit_file.display().to_string())]);
    assert!(cfg.drain_timeout_secs >= 20.0);
    let mut driver = LocalDriver::new(cfg, rec.clone()).unwrap();
    let mut seen = Vec::new();
    reconcile_until(&mut driver, 1, &mut seen, |_, r| ready(r) == 1).await;

    let started = Instant::now();
    let ends = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        std::fs::write(&exit_file, b"").unwrap();
    });
    let events = driver.shutdown().await;
    let took = started.elapsed();
    ends.await.unwrap();
    // It waited for the running request while the process lived, and no longer.
    assert!(took >= Duration::from_millis(500), "{took:?}");
    assert!(
        took < Duration::from_secs(5),
        "{took:?}: waited out the drain"
    );
    assert!(
        matches!(
            &events[..],
            [.., ReplicaEvent::Stopped { forced: false, .. }]
        ),
        "{events:?}"
    );
    assert!(rec.ready.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_never_becomes_ready_is_replaced_and_reported() {
    let env = Env::new();
    let rec = Arc::new(Recorder::default());
    let mut cfg = env.config(&[("FAKE_NEVER_READY", "1")]);
    cfg.ready_timeout_secs = 0.5;
    let mut driver = LocalDriver::new(cfg, rec.clone()).unwrap();
    let mut seen = Vec::new();
    reconcile_until(&mut driver, 1, &mut seen, |e, _| {
        count(e, "never_ready") >= 1 && count(e, "started") >= 2
    })
    .await;
    // Reported, and a replacement started; never registered with the router.
    let first_never = seen.iter().position(|e| e.kind() == "never_ready").unwrap();
    assert!(seen[first_never..].iter().any(|e| e.kind() == "started"));
    assert!(rec.log.lock().unwrap().is_empty());
    assert!(driver.replicas().len() <= 1);
    driver.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_replica_is_deregistered_and_replaced() {
    let env = Env::new();
    let rec = Arc::new(Recorder::default());
    let mut driver =
        LocalDriver::new(env.config(&[("FAKE_EXIT_AFTER_MS", "700")]), rec.clone()).unwrap();
    let mut seen = Vec::new();
    reconcile_until(&mut driver, 1, &mut seen, |e, _| {
        count(e, "exited") >= 1 && count(e, "started") >= 2
    })
    .await;
    let exited = seen.iter().find(|e| e.kind() == "exited").unwrap();
    assert!(
        exited.to_string().contains("exited unexpectedly"),
        "{exited}"
    );
    let log = rec.log.lock().unwrap().clone();
    assert!(
        log.starts_with(&["+local-1".to_string(), "-local-1".to_string()]),
        "{log:?}"
    );
    driver.shutdown().await;
}

#[tokio::test]
async fn a_program_that_cannot_start_is_an_error_not_a_panic() {
    let env = Env::new();
    let mut cfg = env.config(&[]);
    cfg.command = Some("/nonexistent/strata".into());
    let mut driver = LocalDriver::new(cfg, Arc::new(Recorder::default())).unwrap();
    let e = driver.reconcile(1).await.unwrap_err();
    assert!(e.to_string().contains("/nonexistent/strata"), "{e}");
    assert!(driver.replicas().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_loop_scales_local_replicas_on_engine_metrics() {
    let env = Env::new();
    env.set_load(0.0, 0.0);
    let rec = Arc::new(Recorder::default());
    let driver = LocalDriver::new(env.config(&[]), rec.clone()).unwrap();
    let source = MetricsScraper::new(EngineKind::Vllm, Duration::from_secs(2));
    let cfg = AutoscaleConfig {
        min_replicas: 1,
        max_replicas: 3,
        scale_in_cooldown_secs: 0.0,
        stable_window_secs: 1.0,
        panic_window_secs: 0.5,
        ..AutoscaleConfig::default()
    };
    let metrics = Arc::new(ControllerMetrics::new());
    let mut c = Controller::new(
        cfg,
        Duration::from_millis(100),
        driver,
        source,
        rec.clone(),
        metrics.clone(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    // Heavy load: each ready replica reports 20 in flight: up to the max of 3.
    env.set_load(10.0, 10.0);
    loop {
        let r = c.tick().await;
        if ready(&c.driver().replicas()) == 3 {
            assert_eq!(r.decision.desired, 3);
            break;
        }
        assert!(Instant::now() < deadline, "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Load gone: back to one, each stop preceded by a deregistration.
    env.set_load(0.0, 0.0);
    loop {
        let r = c.tick().await;
        if c.driver().replicas().len() == 1 && ready(&c.driver().replicas()) == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rec.ready.lock().unwrap().len(), 1);
    let text = metrics.render();
    assert!(
        text.contains("strata_controller_decisions_total{reason=\"scale_out\"}"),
        "{text}"
    );
    assert!(
        text.contains("strata_controller_decisions_total{reason=\"scale_in\"}"),
        "{text}"
    );
    let (tx, rx) = tokio::sync::watch::channel(false);
    tx.send(true).unwrap();
    let mut driver = c.run(rx).await;
    assert!(driver.replicas().is_empty());
    driver.shutdown().await;
}
