//! `strata up` with the lifecycle controller, as real processes on loopback: mock engine
//! replicas (`--engine-arg=--mock`, no model) scaled out under load and back in after it,
//! scaled to zero and woken by a request that waits for the cold start, and canary
//! rollouts driven by `strata rollout` (manual promote, automatic rollback of a crashed
//! canary and of a slower one, manual rollback, and bad input that changes nothing).

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{alive, children, free_port, http, strata};
use serde_json::{json, Value};

/// `strata up` as a child, stopped with SIGINT (then SIGKILL) when dropped.
struct Up {
    child: std::process::Child,
    addr: SocketAddr,
    dir: PathBuf,
}

impl Drop for Up {
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            let _ = Command::new("kill")
                .args(["-INT", &self.child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Up {
    /// Starts `strata up` with `yaml` (mock engines, no gateway) plus `extra` flags and
    /// waits for its banner.
    fn start(name: &str, yaml: &str, extra: &[&str]) -> Up {
        let dir = std::env::temp_dir().join(format!("strata-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("strata.yaml");
        std::fs::write(&file, yaml).expect("write strata.yaml");
        let port = free_port();
        let mut child = strata()
            .args(["up", "--port", &port.to_string()])
            .arg("--config")
            .arg(&file)
            .arg("--log-dir")
            .arg(dir.join("logs"))
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn strata up");
        let banner = common::read_until(&mut child, "controller:", Duration::from_secs(30));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let up = Up { child, addr, dir };
        let banner = banner.unwrap_or_else(|e| panic!("strata up did not come up: {e}"));
        let text = banner.join("\n");
        assert!(
            text.contains(&format!("http://{}/controller/status", up.addr)),
            "{text}"
        );
        up
    }

    fn status(&self) -> Value {
        let (code, body) = http(self.addr, "GET", "/controller/status", "").expect("status");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).expect("status JSON")
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn rollout(&self, args: &[&str]) -> Output {
        strata()
            .args(["rollout", "--url", &self.url()])
            .args(args)
            .output()
            .expect("run strata rollout")
    }

    fn rollout_json(&self) -> Value {
        let out = self.rollout(&["status", "--json"]);
        assert!(out.status.success(), "{out:?}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("status JSON");
        v["rollout"].clone()
    }

    /// Ctrl-C; the process must exit cleanly and leave no replica behind.
    fn stop(mut self) {
        common::interrupt_and_reap(&mut self.child);
    }
}

/// Replica processes of `strata up` serving `version`.
fn engines_of(up: &Up, version: &str) -> Vec<u32> {
    let needle = format!("--model {version} ");
    children(up.child.id())
        .into_iter()
        .filter(|(_, cmd)| cmd.contains(&needle))
        .map(|(p, _)| p)
        .collect()
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn completion(addr: SocketAddr, model: &str, stream: bool) -> (u16, String) {
    let body = json!({"model": model, "prompt": "Hello there", "max_tokens": 8, "stream": stream});
    http(addr, "POST", "/v1/completions", &body.to_string()).expect("front answers")
}

/// `n` threads sending requests back to back until the flag drops.
fn load(
    addr: SocketAddr,
    model: &'static str,
    n: usize,
) -> (Arc<AtomicBool>, Vec<std::thread::JoinHandle<u32>>) {
    let run = Arc::new(AtomicBool::new(true));
    let handles = (0..n)
        .map(|i| {
            let run = run.clone();
            std::thread::spawn(move || {
                let mut failures = 0;
                while run.load(Ordering::Relaxed) {
                    let (code, _) = completion(addr, model, i % 2 == 0);
                    if code != 200 {
                        failures += 1;
                    }
                }
                failures
            })
        })
        .collect();
    (run, handles)
}

fn non_draining(status: &Value) -> usize {
    status["replicas"]
        .as_array()
        .map(|rs| rs.iter().filter(|r| r["phase"] != "draining").count())
        .unwrap_or(0)
}

#[test]
fn autoscales_out_under_load_and_back_in_after_it() {
    let yaml = "model: mock-old\n\
        engine_args: [--mock, --mock-itl-ms, '100', --mock-output-tokens, '30']\n\
        gateway: false\n\
        controller_interval_secs: 0.5\n\
        autoscale:\n  minReplicas: 1\n  maxReplicas: 3\n  targetConcurrency: 2\n  \
        stableWindowSecs: 3\n  panicWindowSecs: 1\n  scaleInCooldownSecs: 2\n";
    let up = Up::start("autoscale", yaml, &[]);
    wait_for("the first replica", Duration::from_secs(10), || {
        up.status()["ready"] == 1
    });
    assert_eq!(engines_of(&up, "mock-old").len(), 1);

    // 8 clients, each request ~1 s long: 8 in flight / 2 per replica asks for 4, capped at 3.
    let body = json!({"model": "mock-old", "prompt": "x", "max_tokens": 10});
    let addr = up.addr;
    let run = Arc::new(AtomicBool::new(true));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let run = run.clone();
            let body = body.to_string();
            std::thread::spawn(move || {
                let mut failures = 0u32;
                while run.load(Ordering::Relaxed) {
                    match http(addr, "POST", "/v1/completions", &body) {
                        Some((200, _)) => {}
                        _ => failures += 1,
                    }
                }
                failures
            })
        })
        .collect();
    wait_for(
        "3 ready replicas under load",
        Duration::from_secs(30),
        || {
            let s = up.status();
            s["ready"] == 3 && s["desired"] == 3
        },
    );
    assert_eq!(engines_of(&up, "mock-old").len(), 3);
    let (code, body) = http(addr, "GET", "/ui/api/state", "").expect("dashboard");
    assert_eq!(code, 200);
    let state: Value = serde_json::from_str(&body).expect("state");
    assert_eq!(state["controller"]["desired"], 3, "{state}");

    run.store(false, Ordering::Relaxed);
    for c in clients {
        assert_eq!(
            c.join().expect("client"),
            0,
            "requests failed during scale-out"
        );
    }
    wait_for(
        "scale-in to 1 after the load",
        Duration::from_secs(40),
        || {
            let s = up.status();
            s["desired"] == 1 && s["ready"] == 1 && non_draining(&s) == 1
        },
    );
    let (_, metrics) = http(addr, "GET", "/controller/metrics", "").expect("metrics");
    assert!(
        metrics.contains("strata_controller_decisions_total{reason=\"scale_out\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("strata_controller_decisions_total{reason=\"scale_in\"}"),
        "{metrics}"
    );
    wait_for(
        "the drained replicas to exit",
        Duration::from_secs(20),
        || engines_of(&up, "mock-old").len() == 1,
    );
    up.stop();
}

#[test]
fn a_request_at_zero_replicas_waits_for_the_cold_start() {
    let yaml = "model: mock-old\n\
        engine_args: [--mock]\n\
        gateway: false\n\
        controller_interval_secs: 0.3\n\
        autoscale:\n  minReplicas: 0\n  maxReplicas: 2\n  stableWindowSecs: 2\n  \
        panicWindowSecs: 1\n  scaleInCooldownSecs: 1\n  scaleToZeroAfterSecs: 1\n";
    let up = Up::start("zero", yaml, &[]);
    // (The status before the first tick says 0 too: wait for a decision.)
    wait_for("zero replicas", Duration::from_secs(30), || {
        let s = up.status();
        s["last"]["decision"]["desired"] == 0
            && non_draining(&s) == 0
            && engines_of(&up, "mock-old").is_empty()
    });
    let (code, _) = http(up.addr, "GET", "/health", "").expect("health");
    assert_ne!(code, 200, "no replica is ready");

    // Sent at zero: held by the front until a replica is up, then served.
    let (code, body) = completion(up.addr, "mock-old", false);
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["usage"]["completion_tokens"], 8);
    let (code, body) = completion(up.addr, "mock-old", true);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("[DONE]"), "{body}");
    let (_, metrics) = http(up.addr, "GET", "/controller/metrics", "").expect("metrics");
    assert!(
        metrics.contains("strata_controller_decisions_total{reason=\"activation\"}"),
        "{metrics}"
    );
    // Idle again: back to zero.
    wait_for("back to zero", Duration::from_secs(30), || {
        let s = up.status();
        s["desired"] == 0 && non_draining(&s) == 0
    });
    up.stop();
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn last_reason(v: &Value) -> String {
    v["decisions"]
        .as_array()
        .and_then(|d| d.last())
        .and_then(|d| d["reason"].as_str())
        .unwrap_or("")
        .to_string()
}

fn canary_ready(up: &Up) -> bool {
    up.rollout_json()["canary_replicas"]
        .as_array()
        .is_some_and(|r| r.iter().any(|x| x["phase"] == "ready"))
}

#[test]
fn rollouts_promote_roll_back_and_refuse_bad_input() {
    let yaml = "model: mock-old\n\
        engine_args: [--mock]\n\
        gateway: false\n\
        controller_interval_secs: 0.3\n\
        rollout:\n  stepMinSecs: 1\n  minRequests: 5\n";
    let up = Up::start("rollout", yaml, &["--replicas", "1"]);
    let old = engines_of(&up, "mock-old");
    assert_eq!(old.len(), 1);

    // Bad input: clear errors, non-zero exits, nothing changed.
    let out = up.rollout(&["promote"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("No rollout is in progress"),
        "{}",
        stderr(&out)
    );
    let out = up.rollout(&["start", "--model", "mock-new", "--baseline", "mock-nope"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("Unknown baseline `mock-nope`"),
        "{}",
        stderr(&out)
    );
    let out = up.rollout(&["status"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("no rollout"));
    assert!(up.rollout_json().is_null());
    // The API itself answers bad bodies with OpenAI-shaped errors.
    for (body, param) in [
        ("not json".to_string(), None),
        (
            json!({"model": "mock-old", "baseline": "mock-old"}).to_string(),
            Some("model"),
        ),
        (
            json!({"model": "mock-new", "baseline": "mock-old", "steps": [50, 10]}).to_string(),
            Some("steps"),
        ),
        (
            json!({"model": "mock-new", "baseline": "mock-old", "replicas": 0}).to_string(),
            Some("replicas"),
        ),
    ] {
        let (code, text) =
            http(up.addr, "POST", "/controller/rollout/start", &body).expect("answer");
        assert_eq!(code, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).expect("error JSON");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{text}");
        }
    }
    let (code, text) = http(up.addr, "GET", "/controller/nope", "").expect("answer");
    assert_eq!(code, 404, "{text}");
    assert!(text.contains("\"error\""), "{text}");
    assert!(up.rollout_json().is_null());
    assert_eq!(children(up.child.id()).len(), 1, "no canary was started");

    // Start: the first step's split, canary replicas of the new version.
    let out = up.rollout(&[
        "start",
        "--model",
        "mock-new",
        "--baseline",
        "mock-old",
        "--steps",
        "50,100",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = up.rollout_json();
    assert_eq!(v["state"]["phase"], "progressing", "{v}");
    assert_eq!(v["state"]["weight"], 50);
    assert_eq!(v["split"]["mock-new"], 50.0);
    assert_eq!(v["split"]["mock-old"], 50.0);
    let text = String::from_utf8_lossy(&up.rollout(&["status"]).stdout).into_owned();
    assert!(text.contains("step 1/2 at 50% canary"), "{text}");
    // A second rollout while this one runs is refused.
    let out = up.rollout(&["start", "--model", "mock-other", "--baseline", "mock-old"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("in progress"), "{}", stderr(&out));
    wait_for("the canary replica", Duration::from_secs(20), || {
        canary_ready(&up)
    });
    assert_eq!(engines_of(&up, "mock-new").len(), 1);
    assert!(engines_of(&up, "mock-other").is_empty());
    // Both versions answer under the public name.
    for _ in 0..6 {
        let (code, body) = completion(up.addr, "mock-old", false);
        assert_eq!(code, 200, "{body}");
    }

    // Promote: all traffic on the new version, then the old replica stops.
    let out = up.rollout(&["promote", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["state"]["phase"], "promoted", "{v}");
    assert_eq!(v["split"]["mock-new"], 100.0);
    wait_for("the old version to stop", Duration::from_secs(20), || {
        engines_of(&up, "mock-old").is_empty()
    });
    assert!(!alive(old[0]));
    assert_eq!(engines_of(&up, "mock-new").len(), 1);
    for _ in 0..4 {
        let (code, body) = completion(up.addr, "mock-old", true);
        assert_eq!(code, 200, "{body}");
    }
    let out = up.rollout(&["promote"]);
    assert!(!out.status.success(), "nothing left to promote");

    // A canary that crashes is rolled back by itself, with the evidence.
    let out = up.rollout(&["start", "--model", "mock-crash", "--baseline", "mock-new"]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_for("the crash canary", Duration::from_secs(20), || {
        canary_ready(&up)
    });
    for pid in engines_of(&up, "mock-crash") {
        assert!(Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill")
            .success());
    }
    wait_for("an automatic rollback", Duration::from_secs(20), || {
        up.rollout_json()["state"]["phase"] == "rolled_back"
    });
    let v = up.rollout_json();
    assert!(last_reason(&v).contains("canary unhealthy"), "{v}");
    assert!(v["canary_faults"].as_u64() >= Some(1), "{v}");
    assert_eq!(v["split"]["mock-crash"], 0.0);
    wait_for("the canary to be gone", Duration::from_secs(20), || {
        engines_of(&up, "mock-crash").is_empty()
    });
    assert_eq!(
        engines_of(&up, "mock-new").len(),
        1,
        "the baseline stayed up"
    );

    // A slower canary regresses on TTFT under live traffic: rolled back with the checks.
    let out = up.rollout(&[
        "start",
        "--model",
        "mock-slow",
        "--baseline",
        "mock-new",
        "--steps",
        "50,100",
        "--engine-arg=--mock-ttft-ms",
        "--engine-arg=300",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_for("the slow canary", Duration::from_secs(20), || {
        canary_ready(&up)
    });
    let (run, clients) = load(up.addr, "mock-old", 4);
    wait_for("a regression rollback", Duration::from_secs(30), || {
        up.rollout_json()["state"]["phase"] == "rolled_back"
    });
    run.store(false, Ordering::Relaxed);
    for c in clients {
        assert_eq!(
            c.join().expect("client"),
            0,
            "a request failed during the rollout"
        );
    }
    let v = up.rollout_json();
    assert!(last_reason(&v).contains("ttft_p90_secs"), "{v}");
    let last = v["decisions"]
        .as_array()
        .and_then(|d| d.last())
        .cloned()
        .unwrap_or_default();
    let ttft = last["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["metric"] == "ttft_p90_secs"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(ttft["passed"], false, "{last}");
    assert!(ttft["canary"].as_f64() > Some(0.25), "{last}");
    assert!(last["canary"]["requests"].as_u64() >= Some(5), "{last}");

    // Rollback by hand.
    let out = up.rollout(&["start", "--model", "mock-manual", "--baseline", "mock-new"]);
    assert!(out.status.success(), "{}", stderr(&out));
    wait_for("the manual canary", Duration::from_secs(20), || {
        canary_ready(&up)
    });
    let out = up.rollout(&["rollback"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("rolled_back"), "{text}");
    let v = up.rollout_json();
    assert_eq!(v["state"]["phase"], "rolled_back");
    assert_eq!(v["split"]["mock-manual"], 0.0);
    wait_for("the manual canary to stop", Duration::from_secs(20), || {
        engines_of(&up, "mock-manual").is_empty()
    });
    let (code, body) = completion(up.addr, "mock-old", false);
    assert_eq!(code, 200, "{body}");
    up.stop();
}
