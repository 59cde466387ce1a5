//! `strata engine` as a real process on a loopback port: the OpenAI Python client drives
//! it, and Ctrl-C finishes in-flight requests before it exits 0.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{http, start_engine, strata, workspace_root};

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
fn unbuilt_roles_say_so_and_exit_2() {
    let out = strata().arg("sim").output().expect("run strata");
    assert_eq!(out.status.code(), Some(2), "strata sim");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not built yet"), "strata sim: {err}");
}
