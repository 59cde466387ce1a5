//! The OpenAI Python client runs a whole tool loop (`tests/openai_tools.py`: two tools,
//! `required`, the call parsed, a `tool` message with the result, the final answer; the
//! call streamed; a named function; seeded calls at temperature 1.0 that validate; an
//! unknown function refused) against `strata engine --enable-auto-tool-choice
//! --tool-call-parser hermes` as a real process, directly and through `strata gateway`;
//! and through `strata up` (its front and its gateway) with the flags in `engine_args`,
//! where the Anthropic and Responses SDK scripts run through its gateway too.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, http, read_until, start_engine_with, strata, workspace_root, Supervised};

const MODEL: &str = "smollm2-135m-instruct";

fn run_script(base_url: &str, key: Option<&str>) {
    let script = workspace_root().join("tests/openai_tools.py");
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(base_url).arg(MODEL);
    if let Some(k) = key {
        cmd.arg(k);
    }
    let out = cmd.output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "tool loop through {base_url} failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

/// Runs `tests/SCRIPT ARGS...`, which prints "all checks passed" when every check held.
fn run_sdk_script(script: &str, args: &[&str]) {
    let out = Command::new("python3")
        .arg(workspace_root().join("tests").join(script))
        .args(args)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

#[test]
fn openai_client_runs_the_tool_loop_against_the_engine_and_through_the_gateway() {
    let engine = start_engine_with(&[
        "--kv-cache-memory",
        "268435456",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]);
    run_script(&format!("http://{}/v1", engine.addr), None);

    let port = free_port();
    let mut gateway = Supervised(
        strata()
            .args([
                "gateway",
                "--port",
                &port.to_string(),
                "--db",
                ":memory:",
                "--upstream",
                &format!("http://{}", engine.addr),
                "--model",
                MODEL,
                "--create-key-for",
                "tools",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn strata gateway"),
    );
    let lines = read_until(&mut gateway.0, "gateway API key", Duration::from_secs(60))
        .expect("the gateway prints its key");
    let key = lines
        .last()
        .and_then(|l| l.rsplit(": ").next())
        .expect("a key")
        .trim()
        .to_string();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(http(addr, "GET", "/health", ""), Some((200, _))) {
        if let Ok(Some(status)) = gateway.0.try_wait() {
            panic!("the gateway exited early with {status}");
        }
        assert!(Instant::now() < deadline, "gateway not ready in 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    run_script(&format!("http://{addr}/v1"), Some(&key));
}

/// The same loop through `strata up`: its engines get the tool flags from `engine_args`,
/// and the script runs through the front and through the gateway with its printed key;
/// then the official Anthropic SDK (`tests/anthropic_client.py`) and the OpenAI SDK's
/// Responses API (`tests/openai_responses.py`) through that gateway.
#[test]
fn openai_client_runs_the_tool_loop_through_strata_up() {
    let dir = std::env::temp_dir().join(format!("strata-tool-up-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("strata.yaml");
    std::fs::write(
        &file,
        "gateway_port: 0\ngateway_db: ':memory:'\nkv_cache_memory: 268435456\n\
         engine_args: [--enable-auto-tool-choice, --tool-call-parser, hermes]\n",
    )
    .expect("write strata.yaml");
    let port = free_port();
    let mut up = Supervised(
        strata()
            .args(["up", "--port", &port.to_string()])
            .arg("--config")
            .arg(&file)
            .arg("--log-dir")
            .arg(dir.join("logs"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn strata up"),
    );
    let banner = read_until(&mut up.0, "gateway:", Duration::from_secs(240))
        .unwrap_or_else(|e| panic!("strata up did not come up: {e}"));
    run_script(&format!("http://127.0.0.1:{port}/v1"), None);
    let line = banner
        .iter()
        .find(|l| l.contains("gateway:"))
        .expect("gateway line");
    let gw = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .expect("gateway URL (its /v1)");
    let key = line
        .rsplit("API key: ")
        .next()
        .map(|k| k.trim_end_matches(')'))
        .expect("key");
    run_script(gw, Some(key));
    // The official SDKs on the gateway's Messages and Responses APIs (translated to chat
    // for the stack's engines).
    let base = gw.trim_end_matches("/v1");
    run_sdk_script("anthropic_client.py", &[base, key, MODEL]);
    run_sdk_script("openai_responses.py", &[gw, key, MODEL]);
    common::interrupt_and_reap(&mut up.0);
    let _ = std::fs::remove_dir_all(&dir);
}
