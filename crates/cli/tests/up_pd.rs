//! `strata up --prefill-replicas 1 --decode-replicas 2` as real processes on loopback with
//! mock engines: the engines start with their `--kv-role` (the prefill one with a transfer
//! port of its own), register with the router under their role, and the router's profile
//! pair sends a long prompt through the prefill engine (phase 1, then the decode engine
//! with the returned `kv_transfer_params`) and a short one straight to a decoder. Bad
//! combinations (autoscaling, one of the two counts) are refused at startup.

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use common::{free_port, http, http_with_headers, interrupt_and_reap, read_until, strata};
use serde_json::{json, Value};

fn get(addr: SocketAddr, path: &str) -> Value {
    let (status, body) = http(addr, "GET", path, "").expect("an answer");
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).expect("JSON")
}

/// A log directory of this test process's own under the temp dir.
fn log_dir(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{name}-{}", std::process::id()))
}

/// Starts `strata <args> --port PORT --log-dir LOGS` and waits (at most `within`) for its
/// banner; kills it and fails when it does not come up.
fn start_up(
    args: &[&str],
    port: u16,
    logs: &std::path::Path,
    within: Duration,
) -> (std::process::Child, Vec<String>) {
    let mut child = strata()
        .args(args)
        .args(["--port", &port.to_string()])
        .arg("--log-dir")
        .arg(logs)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn strata up");
    match read_until(&mut child, "OpenAI API", within) {
        Ok(banner) => (child, banner),
        Err(e) => {
            let _ = child.kill();
            panic!("strata up did not come up: {e}");
        }
    }
}

/// What the engine at `url` received for request id `rid`.
fn received(url: &str, rid: &str) -> Vec<Value> {
    let addr: SocketAddr = url.trim_start_matches("http://").parse().expect("addr");
    get(addr, "/mock/received")
        .as_array()
        .expect("a list")
        .iter()
        .filter(|r| r["request_id"] == rid)
        .cloned()
        .collect()
}

#[test]
fn up_splits_long_prompts_between_prefill_and_decode_engines() {
    let (port, logs) = (free_port(), log_dir("strata-up-pd"));
    let (mut child, banner) = start_up(
        &[
            "up",
            "--model",
            "mock-pd",
            "--engine-arg=--mock",
            "--prefill-replicas",
            "1",
            "--decode-replicas",
            "2",
            "--pd-threshold",
            "64",
            "--no-gateway",
            "--kv-tier-bytes",
            "16777216",
        ],
        port,
        &logs,
        Duration::from_secs(60),
    );
    assert!(
        banner
            .iter()
            .any(|l| l.contains("1 prefill + 2 decode replica(s) of mock-pd")),
        "{banner:?}"
    );
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();

    // Three engines, registered with their roles once ready.
    let mut roles: Vec<(String, String)> = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while roles.len() < 3 {
        assert!(std::time::Instant::now() < deadline, "{roles:?}");
        std::thread::sleep(Duration::from_millis(200));
        roles = get(addr, "/debug/endpoints")["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ready"] == true)
            .map(|e| {
                (
                    e["role"].as_str().unwrap_or("").to_string(),
                    e["url"].as_str().unwrap().to_string(),
                )
            })
            .collect();
    }
    let prefill: Vec<&String> = roles
        .iter()
        .filter(|r| r.0 == "prefill")
        .map(|r| &r.1)
        .collect();
    let decode: Vec<&String> = roles
        .iter()
        .filter(|r| r.0 == "decode")
        .map(|r| &r.1)
        .collect();
    assert_eq!((prefill.len(), decode.len()), (1, 2), "{roles:?}");

    // The processes: a KV tier on a loopback port, every engine told where it is and its
    // role, the prefill engine with a transfer port of its own.
    let kids = common::children(child.id());
    let tier = kids
        .iter()
        .find_map(|(_, cmd)| {
            cmd.split_once("kv-tier --listen ")
                .map(|(_, rest)| rest.split_whitespace().next().unwrap_or("").to_string())
        })
        .unwrap_or_else(|| panic!("a kv-tier child: {kids:?}"));
    assert!(tier.starts_with("127.0.0.1:"), "{tier}");
    let engines: Vec<&String> = kids
        .iter()
        .map(|(_, c)| c)
        .filter(|c| c.contains(" engine "))
        .collect();
    assert_eq!(engines.len(), 3, "{kids:?}");
    for cmd in &engines {
        assert!(cmd.contains(&format!("--kv-tier {tier}")), "{cmd}");
    }
    let prefill_cmd: Vec<&&String> = engines
        .iter()
        .filter(|c| c.contains("--kv-role prefill"))
        .collect();
    assert_eq!(prefill_cmd.len(), 1, "{engines:?}");
    let transfer_port = prefill_cmd[0]
        .split_once("--kv-transfer-port ")
        .and_then(|(_, r)| r.split_whitespace().next())
        .and_then(|p| p.parse::<u16>().ok());
    assert!(transfer_port.is_some_and(|p| p > 0), "{}", prefill_cmd[0]);
    assert_eq!(
        engines
            .iter()
            .filter(|c| c.contains("--kv-role decode"))
            .count(),
        2
    );

    // Long: phase 1 on the prefill engine, then a decoder with its kv_transfer_params.
    let long: String = (0..200).map(|i| format!("word{i} ")).collect();
    let body = json!({"model": "mock-pd", "prompt": long, "max_tokens": 3});
    let (status, text) = http_with_headers(
        addr,
        "POST",
        "/v1/completions",
        &body.to_string(),
        &[("x-request-id", "up-pd-long")],
    )
    .expect("an answer");
    assert_eq!(status, 200, "{text}");
    let p = received(prefill[0], "up-pd-long");
    assert_eq!(p.len(), 1, "one phase-1 request");
    assert_eq!(p[0]["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(
        (p[0]["max_tokens"].as_u64(), &p[0]["stream"]),
        (Some(1), &json!(false))
    );
    let d: Vec<Value> = decode
        .iter()
        .flat_map(|u| received(u, "up-pd-long"))
        .collect();
    assert_eq!(d.len(), 1, "then one decoder");
    assert_eq!(d[0]["kv_transfer_params"]["do_remote_prefill"], true);
    assert_eq!(d[0]["max_tokens"], 3);

    // Short: a decoder alone.
    let body = json!({"model": "mock-pd", "prompt": "hello", "max_tokens": 2});
    let (status, text) = http_with_headers(
        addr,
        "POST",
        "/v1/completions",
        &body.to_string(),
        &[("x-request-id", "up-pd-short")],
    )
    .expect("an answer");
    assert_eq!(status, 200, "{text}");
    assert!(received(prefill[0], "up-pd-short").is_empty());
    let d: Vec<Value> = decode
        .iter()
        .flat_map(|u| received(u, "up-pd-short"))
        .collect();
    assert_eq!(d.len(), 1);
    assert!(d[0]["kv_transfer_params"].is_null());

    // The router counts both paths.
    let (_, metrics) = http(addr, "GET", "/metrics", "").unwrap();
    assert!(
        metrics.contains("strata_router_pd_requests_total{path=\"disaggregated\"} 1")
            && metrics.contains("strata_router_pd_requests_total{path=\"decode_only\"} 1"),
        "{metrics}"
    );
    interrupt_and_reap(&mut child);
    let _ = std::fs::remove_dir_all(&logs);
}

#[test]
fn disaggregated_up_refuses_autoscaling_and_half_a_pair() {
    for (args, want) in [
        (
            vec![
                "--prefill-replicas",
                "1",
                "--decode-replicas",
                "1",
                "--min-replicas",
                "0",
            ],
            "cannot be used with",
        ),
        (vec!["--prefill-replicas", "1"], "--decode-replicas"),
        (
            vec![
                "--prefill-replicas",
                "1",
                "--decode-replicas",
                "1",
                "--replicas",
                "2",
            ],
            "cannot be used with",
        ),
    ] {
        let out = strata()
            .args(["up", "--engine-arg=--mock", "--no-gateway"])
            .args(["--port", &free_port().to_string()])
            .args(&args)
            .output()
            .expect("run strata up");
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// A counter's value on a Prometheus page: the first series of `name` with `label`.
fn counter(page: &str, name: &str, label: &str) -> f64 {
    page.lines()
        .find(|l| l.starts_with(name) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// The engines' key in the real-engine test.
const ENGINE_KEY: &str = "up-pd-test-engine-key";

#[test]
fn up_with_real_engines_gives_the_colocated_greedy_tokens_through_a_prefill_engine() {
    let (port, logs) = (free_port(), log_dir("strata-up-pd-real"));
    let (mut child, _) = start_up(
        &[
            "up",
            "--prefill-replicas",
            "1",
            "--decode-replicas",
            "1",
            "--pd-threshold",
            "0",
            "--no-gateway",
            "--engine-arg=--num-blocks",
            "--engine-arg=256",
            // The engines require a key (strata up generates one otherwise); this test
            // also calls them directly with it.
            &format!("--engine-arg=--api-key={ENGINE_KEY}"),
        ],
        port,
        &logs,
        Duration::from_secs(240),
    );
    let bearer = format!("Bearer {ENGINE_KEY}");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // The banner can come before the router has seen both engines ready: wait (bounded)
    // until it routes to each role, or the first request may be served decode-only.
    let url_of = |role: &str| -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let found = get(addr, "/debug/endpoints")["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["role"] == role && e["ready"] == true && e["stale"] == false)
                .and_then(|e| e["url"].as_str())
                .map(str::to_string);
            if let Some(url) = found {
                return url;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no ready {role} engine in the router"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let (prefill, decode) = (url_of("prefill"), url_of("decode"));
    let engine = |url: &str| -> SocketAddr { url.trim_start_matches("http://").parse().unwrap() };

    // Several blocks of prompt (16 tokens each), greedy.
    let prompt = "The history of the lighthouse begins with fires on hilltops that guided \
                  ships along dangerous coasts. Over centuries these became towers of stone \
                  with lamps, lenses and keepers who trimmed the wicks through long nights, \
                  until electric lights and automation replaced them. Tell the rest:";
    let ask = |to: SocketAddr, salt: Option<&str>, rid: &str| -> Value {
        let mut body = json!({"model": "smollm2-135m-instruct", "prompt": prompt,
                              "max_tokens": 12, "temperature": 0, "ignore_eos": true});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let (status, text) = http_with_headers(
            to,
            "POST",
            "/v1/completions",
            &body.to_string(),
            &[("x-request-id", rid), ("authorization", &bearer)],
        )
        .expect("an answer");
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).expect("JSON")
    };
    // Through the router: phase 1 on the prefill engine, the decoder pulls the blocks.
    let disaggregated = ask(addr, None, "pd-real-1");
    let (_, page) = http(engine(&decode), "GET", "/metrics", "").unwrap();
    assert!(
        counter(
            &page,
            "strata:kv_transfer_requests_total{",
            "path=\"remote_prefill\""
        ) >= 1.0,
        "the decoder served it from the prefill engine's blocks: {page}"
    );
    assert!(
        counter(
            &page,
            "strata:kv_transfer_blocks_total{",
            "direction=\"received\""
        ) >= 1.0
    );
    let (_, page) = http(engine(&prefill), "GET", "/metrics", "").unwrap();
    assert!(
        counter(
            &page,
            "strata:kv_transfer_blocks_total{",
            "direction=\"sent\""
        ) >= 1.0
    );
    // Colocated reference: the same prompt computed from scratch on one engine (another
    // cache salt names other blocks, so nothing is reused).
    let colocated = ask(engine(&prefill), Some("reference"), "pd-real-ref");
    assert_eq!(
        disaggregated["choices"][0]["text"], colocated["choices"][0]["text"],
        "greedy tokens identical: {disaggregated} vs {colocated}"
    );
    // Streamed as the client asks (phase 1 is not): the same tokens, chunk by chunk.
    let body = json!({"model": "smollm2-135m-instruct", "prompt": format!("{prompt} Again:"),
                      "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stream": true});
    let (status, sse) = http_with_headers(
        addr,
        "POST",
        "/v1/completions",
        &body.to_string(),
        &[("x-request-id", "pd-real-2")],
    )
    .expect("an answer");
    assert_eq!(status, 200, "{sse}");
    assert!(sse.contains("data: [DONE]"), "{sse}");
    let streamed: String = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    let mut reference = body.clone();
    reference["stream"] = json!(false);
    reference["cache_salt"] = json!("reference");
    // The engine itself answers only its key.
    let (status, _) = http(
        engine(&decode),
        "POST",
        "/v1/completions",
        &reference.to_string(),
    )
    .expect("an answer");
    assert_eq!(status, 401);
    let (_, text) = http_with_headers(
        engine(&decode),
        "POST",
        "/v1/completions",
        &reference.to_string(),
        &[("authorization", &bearer)],
    )
    .expect("an answer");
    let reference: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(
        streamed, reference["choices"][0]["text"],
        "streamed through the pair = computed on one engine"
    );
    let (_, metrics) = http(addr, "GET", "/metrics", "").unwrap();
    assert!(
        metrics.contains("strata_router_pd_requests_total{path=\"disaggregated\"} 2"),
        "{metrics}"
    );
    interrupt_and_reap(&mut child);
    let _ = std::fs::remove_dir_all(&logs);
}
