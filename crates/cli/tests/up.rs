//! `strata up` as a real process: two engine replicas behind the router, the dashboard in
//! headless Chromium (a screenshot lands in `target/strata-up-dashboard.png`), a killed
//! replica replaced and re-admitted, and Ctrl-C finishing in-flight work and leaving no
//! child process behind.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, http, strata, workspace_root, Supervised};
use serde_json::{json, Value};

/// Process ids of `pid`'s live children.
fn children(pid: u32) -> Vec<u32> {
    common::children(pid).into_iter().map(|(p, _)| p).collect()
}

fn state(addr: SocketAddr) -> Value {
    let (status, body) = http(addr, "GET", "/ui/api/state", "").expect("dashboard state");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("state JSON")
}

fn ready_names(addr: SocketAddr) -> Vec<String> {
    state(addr)["replicas"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .filter(|r| r["ready"] == true)
                .filter_map(|r| r["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn chromium() -> Command {
    let bin = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .expect("headless Chromium is required for the dashboard test (Debian: apt-get install chromium)");
    // Headless Chromium can hang on a loaded machine (seen: 15 minutes on the screenshot);
    // `timeout` turns a hang into a failure of the run that says so.
    let mut c = Command::new("timeout");
    c.args(["--kill-after=10", "180", bin]);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1400,1100",
        "--virtual-time-budget=6000",
    ]);
    c.stderr(Stdio::null());
    c
}

fn completion(addr: SocketAddr, prompt: &str, max_tokens: u32) -> (u16, Value) {
    let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt,
                      "max_tokens": max_tokens, "ignore_eos": true});
    let (status, text) =
        http(addr, "POST", "/v1/completions", &body.to_string()).expect("router answers");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[test]
fn up_serves_shows_the_dashboard_replaces_a_dead_replica_and_stops_cleanly() {
    let port = free_port();
    let logs = std::env::temp_dir().join(format!("strata-up-test-{}", std::process::id()));
    let mut up = Supervised(
        strata()
            .args(["up", "--replicas", "2", "--port", &port.to_string()])
            .arg("--log-dir")
            .arg(&logs)
            .args(["--engine-arg=--num-blocks", "--engine-arg=256"])
            .args(["--gateway-port", "0", "--gateway-db", ":memory:"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn strata up"),
    );
    let child = &mut up.0;
    let up_pid = child.id();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let banner = match common::read_until(child, "gateway:", Duration::from_secs(180)) {
        Ok(lines) => lines,
        Err(e) => {
            let _ = child.kill();
            panic!("strata up did not come up: {e}");
        }
    };
    let text = banner.join("\n");
    assert!(
        text.contains(&format!("http://127.0.0.1:{port}/v1")),
        "{text}"
    );
    assert!(
        text.contains(&format!("http://127.0.0.1:{port}/ui")),
        "{text}"
    );
    let engines = children(up_pid);
    assert_eq!(engines.len(), 2, "two engine processes: {engines:?}");

    // The gateway in front: the printed key works, no key gets a 401.
    let gw_line = banner
        .iter()
        .find(|l| l.contains("gateway:"))
        .expect("gateway line");
    let gw_addr: SocketAddr = gw_line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("gateway address in {gw_line:?}"));
    let key = gw_line
        .split("API key: ")
        .nth(1)
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("key in {gw_line:?}"));
    let body = json!({"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 3,
                      "ignore_eos": true})
    .to_string();
    let (status, text) = http(gw_addr, "POST", "/v1/completions", &body).expect("gateway answers");
    assert_eq!(status, 401, "{text}");
    let (status, text) = common::http_with_headers(
        gw_addr,
        "POST",
        "/v1/completions",
        &body,
        &[("Authorization", &format!("Bearer {key}"))],
    )
    .expect("gateway answers");
    assert_eq!(status, 200, "{text}");

    // Traffic through the router reaches both replicas.
    for i in 0..6 {
        let (status, v) = completion(addr, &format!("Story number {i}:"), 6);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 6);
    }
    wait_for("dashboard series", Duration::from_secs(30), || {
        let s = state(addr);
        let tps = s["series"]["output_tokens_per_s"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        tps.iter().any(|v| v.as_f64().is_some_and(|x| x > 0.0))
            && s["series"]["ttft_p50"]
                .as_array()
                .is_some_and(|a| a.iter().any(Value::is_number))
    });

    // The page, rendered by a real browser.
    let url = format!("http://127.0.0.1:{port}/ui");
    let dom = chromium()
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .expect("run chromium");
    assert!(
        dom.status.success(),
        "chromium failed or timed out: {:?}",
        dom.status
    );
    let dom = String::from_utf8_lossy(&dom.stdout);
    let points = |id: &str| -> u64 {
        let at = dom
            .find(&format!("id=\"{id}\""))
            .unwrap_or_else(|| panic!("no #{id} in the page"));
        let tag_end = at + dom[at..].find('>').expect("tag end");
        dom[at..tag_end]
            .split("data-points=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    for id in [
        "chart-ttft",
        "chart-itl",
        "chart-tps",
        "chart-rps",
        "chart-queue",
        "chart-kv",
    ] {
        assert!(points(id) > 0, "{id} drew no points:\n{dom}");
    }
    assert_eq!(dom.matches("data-ready=\"true\"").count(), 2, "{dom}");
    assert!(dom.contains("smollm2-135m-instruct"));
    // A CI artifact under the target directory (wherever CARGO_TARGET_DIR puts it).
    let target: PathBuf = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    std::fs::create_dir_all(&target).expect("create the target directory");
    let shot = target.join("strata-up-dashboard.png");
    let status = chromium()
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .status()
        .expect("run chromium");
    assert!(status.success(), "chromium failed or timed out: {status:?}");
    assert!(
        std::fs::metadata(&shot).is_ok_and(|m| m.len() > 10_000),
        "no screenshot"
    );

    // Kill one replica: the router stops using it, a replacement comes up and is admitted.
    let before = ready_names(addr);
    assert_eq!(before.len(), 2, "{before:?}");
    let victim = engines[0];
    assert!(Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .expect("kill")
        .success());
    wait_for("a replacement replica", Duration::from_secs(120), || {
        let names = ready_names(addr);
        names.len() == 2 && names.iter().any(|n| !before.contains(n))
    });
    for i in 0..4 {
        let (status, v) = completion(addr, &format!("After the crash {i}:"), 4);
        assert_eq!(status, 200, "{v}");
    }
    let engines = children(up_pid);
    assert_eq!(engines.len(), 2, "{engines:?}");

    // Ctrl-C with a request in flight: it finishes, then everything stops.
    let inflight = std::thread::spawn(move || completion(addr, "A long story:", 120));
    std::thread::sleep(Duration::from_millis(700));
    assert!(Command::new("kill")
        .args(["-INT", &up_pid.to_string()])
        .status()
        .expect("kill -INT")
        .success());
    let (status, v) = inflight.join().expect("in-flight client");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 120);
    let deadline = Instant::now() + Duration::from_secs(60);
    let exit = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("strata up did not exit after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(exit.success(), "strata up exited with {exit}");
    for pid in engines {
        assert!(!common::alive(pid), "engine {pid} outlived strata up");
    }
    let _ = std::fs::remove_dir_all(&logs);
}
