//! `strata up --tls` as a real process on loopback: one flag, and every hop speaks TLS
//! with certificates from a CA made at start. A client trusting the printed CA gets a chat
//! answer from the front and through the gateway (gateway → front → engine, each verified
//! against that CA); plain HTTP to the front, the gateway or an engine is refused, and so
//! is a client that does not trust the CA. The certificates are gone once it stops.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::{free_port, http, strata, Supervised};
use serde_json::{json, Value};

/// The word after `label` on the banner line that has it.
fn banner_value(lines: &[String], label: &str) -> String {
    lines
        .iter()
        .find_map(|l| l.split_once(label).map(|x| x.1.trim().to_string()))
        .and_then(|rest| rest.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| panic!("no {label:?} in the banner: {lines:?}"))
}

fn chat_body() -> String {
    json!({"model": "smollm2-135m-instruct",
           "messages": [{"role": "user", "content": "Say hi"}],
           "max_tokens": 4})
    .to_string()
}

fn post(
    client: &reqwest::blocking::Client,
    url: &str,
    key: Option<&str>,
) -> reqwest::Result<(u16, Value)> {
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(chat_body());
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send()?;
    let status = resp.status().as_u16();
    Ok((status, resp.json().unwrap_or(Value::Null)))
}

#[test]
fn up_with_tls_serves_every_hop_over_tls_with_its_own_ca() {
    let port = free_port();
    let logs = std::env::temp_dir().join(format!("strata-up-tls-test-{}", std::process::id()));
    let mut up = Supervised(
        strata()
            .args([
                "up",
                "--tls",
                "--replicas",
                "1",
                "--port",
                &port.to_string(),
            ])
            .arg("--log-dir")
            .arg(&logs)
            .args(["--engine-arg=--num-blocks", "--engine-arg=256"])
            .args(["--gateway-port", "0", "--gateway-db", ":memory:"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn strata up"),
    );
    let banner = match common::read_until(&mut up.0, "TLS CA:", Duration::from_secs(180)) {
        Ok(lines) => lines,
        Err(e) => panic!("strata up --tls did not come up: {e}"),
    };
    let front = format!("https://127.0.0.1:{port}");
    assert_eq!(banner_value(&banner, "OpenAI API:"), format!("{front}/v1"));
    let ca = PathBuf::from(banner_value(&banner, "TLS CA:"));
    let gateway = banner_value(&banner, "gateway:");
    assert!(gateway.starts_with("https://127.0.0.1:"), "{gateway}");
    let key = banner
        .iter()
        .find_map(|l| l.split_once("API key: ").map(|x| x.1.trim_end_matches(')')))
        .expect("the gateway's key in the banner")
        .to_string();

    let pem = std::fs::read(&ca).expect("the CA file the banner names");
    let trusting = reqwest::blocking::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("a PEM CA"))
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client");

    // The front (router → engine over https) and the gateway (→ front over https).
    let (status, answer) = post(&trusting, &format!("{front}/v1/chat/completions"), None)
        .expect("the front answers over TLS");
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{answer}"
    );
    let (status, answer) = post(
        &trusting,
        &format!("{gateway}/chat/completions"),
        Some(&key),
    )
    .expect("the gateway answers over TLS");
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{answer}"
    );

    // The dashboard and the controller share the front's certificate; the replica the
    // controller's health check admitted is an https:// engine.
    let state: Value = trusting
        .get(format!("{front}/ui/api/state"))
        .send()
        .and_then(|r| r.json())
        .expect("dashboard state over TLS");
    let replicas = state["replicas"].as_array().expect("replicas");
    assert_eq!(
        replicas.iter().filter(|r| r["ready"] == true).count(),
        1,
        "{state}"
    );
    let status = trusting
        .get(format!("{front}/controller/status"))
        .send()
        .expect("controller over TLS")
        .status();
    assert_eq!(status, 200);
    let url = replicas[0]["url"].as_str().expect("the replica's URL");
    let engine: SocketAddr = url
        .strip_prefix("https://")
        .unwrap_or_else(|| panic!("the replica is not https: {url}"))
        .trim_end_matches('/')
        .parse()
        .expect("the engine's address");

    // Plain HTTP is refused everywhere: no HTTP answer comes back.
    let front_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let gateway_addr: SocketAddr = gateway
        .trim_start_matches("https://")
        .trim_end_matches("/v1")
        .parse()
        .expect("gateway address");
    for addr in [front_addr, gateway_addr, engine] {
        assert_eq!(
            http(addr, "POST", "/v1/chat/completions", &chat_body()),
            None,
            "plain HTTP to {addr} got an answer"
        );
    }
    // A client that does not trust the stack's CA is refused at the handshake.
    let stranger = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    assert!(post(&stranger, &format!("{front}/v1/chat/completions"), None).is_err());
    assert!(post(
        &stranger,
        &format!("https://{engine}/v1/chat/completions"),
        None
    )
    .is_err());

    // Stopped, it leaves no certificate or key behind.
    drop(up);
    assert!(!ca.exists(), "{} outlived the stack", ca.display());
    let _ = std::fs::remove_dir_all(&logs);
}
