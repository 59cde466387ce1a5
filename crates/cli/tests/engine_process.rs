//! `strata engine` as a real process on a loopback port: the OpenAI Python client drives
//! it, and Ctrl-C finishes in-flight requests before it exits 0.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{http, start_engine, start_engine_with, strata, workspace_root};

#[test]
fn openai_python_client_drives_chat_completions_and_streaming() {
    let engine = start_engine();
    let script = workspace_root().join("tests/openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}/v1", engine.addr))
        .arg("smollm2-135m-instruct")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client checks failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

#[test]
fn ctrl_c_finishes_in_flight_requests_and_exits_zero() {
    let mut engine = start_engine();
    let addr = engine.addr;
    // A request long enough to still be running when the signal arrives.
    let body =
        r#"{"prompt":"Once upon a time","max_tokens":200,"ignore_eos":true,"temperature":0}"#;
    let client = std::thread::spawn(move || http(addr, "POST", "/v1/completions", body));
    std::thread::sleep(Duration::from_millis(500));
    let pid = engine.child.id().to_string();
    let kill = Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .expect("send SIGINT");
    assert!(kill.success());
    let (status, body) = client
        .join()
        .expect("client thread")
        .expect("in-flight request answered");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json body");
    assert_eq!(v["usage"]["completion_tokens"], 200, "{body}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = engine.child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "engine did not exit after Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status {status}");
}

#[test]
fn shutdown_is_bounded_by_the_grace_period() {
    let mut engine = start_engine_with(&[
        "--kv-cache-memory",
        "268435456",
        "--shutdown-grace-secs",
        "1",
    ]);
    let addr = engine.addr;
    // A request far longer than the grace period.
    let body = r#"{"prompt":"Once upon a time","max_tokens":6000,"ignore_eos":true,"stream":true}"#;
    let client = std::thread::spawn(move || http(addr, "POST", "/v1/completions", body));
    std::thread::sleep(Duration::from_millis(500));
    let pid = engine.child.id().to_string();
    let term = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("send SIGTERM");
    assert!(term.success());
    let signalled = Instant::now();
    let deadline = signalled + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = engine.child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the engine still runs 10 s after SIGTERM with a 1 s grace period"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = signalled.elapsed();
    assert!(status.success(), "exit status {status}");
    assert!(
        took >= Duration::from_millis(900),
        "it waited for the grace: {took:?}"
    );
    // The aborted stream ended (the client is not left hanging), before its 6000 tokens.
    let answer = client.join().expect("client thread");
    if let Some((status, body)) = answer {
        assert_eq!(status, 200);
        assert!(!body.contains("\"finish_reason\":\"length\""), "{body}");
    }
}

#[test]
fn sim_runs_and_bad_profiles_are_clear_errors() {
    let out = strata()
        .args(["sim", "--seed", "7"])
        .output()
        .expect("run strata sim");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "strata sim: {stdout}");
    assert!(stdout.contains("strata bench: sim:"), "{stdout}");
    assert!(stdout.contains("0 failed"), "{stdout}");
    let out = strata()
        .args(["sim", "--hardware", "nonsense"])
        .output()
        .expect("run strata sim");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown hardware profile `nonsense`"), "{err}");
}

/// `strata sim` restarts itself once with glibc's huge-page tunables where the kernel has
/// transparent huge pages (`strata_sim::heap`), keeps them off where it has not, and
/// leaves an operator's own tunables alone: read from the running process's environment.
#[test]
fn sim_restarts_with_huge_page_tunables_where_the_kernel_has_them() {
    use strata_sim::heap::{should_restart, OPT_OUT, THP_ENABLED, TUNABLES};
    let thp = std::fs::read_to_string(THP_ENABLED).ok();
    let gnu = cfg!(all(target_os = "linux", target_env = "gnu"));
    let expect = gnu && should_restart(None, None, thp.as_deref());
    // glibc parses `GLIBC_TUNABLES` in place at start, leaving the first tunable where
    // `/proc/PID/environ` reads it: matched by that.
    let first_of = |t: &str| format!("GLIBC_TUNABLES={}", t.split(':').next().unwrap_or(t));
    let want = first_of(TUNABLES);
    let mine = first_of("glibc.malloc.arena_max=2");
    for operator_set in [false, true] {
        let mut cmd = strata();
        cmd.args([
            "sim",
            "--seed",
            "7",
            "--requests",
            "4000",
            "--replicas",
            "4",
        ])
        .env_remove(OPT_OUT)
        .stdout(std::process::Stdio::piped());
        if operator_set {
            cmd.env("GLIBC_TUNABLES", "glibc.malloc.arena_max=2");
        } else {
            cmd.env_remove("GLIBC_TUNABLES");
        }
        let mut child = cmd.spawn().expect("run strata sim");
        let environ = format!("/proc/{}/environ", child.id());
        let (mut saw_ours, mut saw_mine) = (false, false);
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Ok(env) = std::fs::read(&environ) {
                for kv in env.split(|b| *b == 0) {
                    saw_ours |= kv.starts_with(want.as_bytes());
                    saw_mine |= kv.starts_with(mine.as_bytes());
                }
            }
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "strata sim did not finish");
            std::thread::sleep(Duration::from_millis(2));
        };
        let out = child.wait_with_output().expect("output");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(status.success(), "{stdout}");
        assert!(
            stdout.contains("4000 sent, 4000 completed"),
            "the same arguments: {stdout}"
        );
        if operator_set {
            assert!(!saw_ours && saw_mine, "the operator's tunables stand");
        } else {
            assert_eq!(saw_ours, expect, "THP mode {thp:?}");
        }
    }
}
