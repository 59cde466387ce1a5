//! vLLM's own Grafana dashboards on a Strata engine: a real Prometheus (Debian's
//! `prometheus`) scrapes an engine under load, and every PromQL expression of those
//! dashboards whose metrics the engine exports must return data.
//!
//! The expressions are `tests/fixtures/vllm-dashboards/promql.json`, extracted from
//! `examples/observability/dashboards/grafana/` of vLLM's repository (the commit of each
//! file is recorded there). An expression is tested when every `vllm:*`, `http_*` and
//! `process_*` name it reads appears on the engine's page; the names the issue asks for must
//! all appear, so the selection cannot shrink to nothing.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_engine::server::EngineOptions;

const MODEL: &str = "smollm2-135m-instruct";
const JOB: &str = "strata-engine";

fn start_engine() -> SocketAddr {
    common::serve(&EngineOptions {
        num_blocks: Some(128),
        max_model_len: Some(1024),
        ..EngineOptions::default()
    })
}

/// One HTTP/1.1 exchange (`Connection: close`): status and de-chunked body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write");
    s.write_all(body.as_bytes()).expect("write body");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("header end");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("status");
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || tail.len() < n {
                break;
            }
            out.push_str(&tail[..n]);
            rest = tail[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        body.to_string()
    };
    (status, body)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_prometheus(dir: &std::path::Path, target: SocketAddr) -> (Prometheus, SocketAddr) {
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: ['{target}']\n"
    );
    let cfg = dir.join("prometheus.yml");
    std::fs::write(&cfg, config).expect("write config");
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start prometheus (Debian package `prometheus`; .ci/run installs it)");
    let p = Prometheus(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "prometheus did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    (p, addr)
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn query(prom: SocketAddr, expr: &str) -> Value {
    let (status, body) = http(
        prom,
        "GET",
        &format!("/api/v1/query?query={}", encode(expr)),
        "",
    );
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    assert_eq!(status, 200, "{expr}: {body}");
    v
}

/// Metric names an expression reads: `vllm:*`, `http_*`, `process_*` identifiers.
fn metric_names(expr: &str) -> Vec<String> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
        let preceded = start > 0 && rest[..start].ends_with(is_ident);
        let tail = &rest[start..];
        let end = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
        let word = &tail[..end];
        let quoted = rest[..start].ends_with('"') || rest[..start].ends_with('$');
        if !preceded
            && !quoted
            && (word.starts_with("vllm:")
                || word.starts_with("http_")
                || word.starts_with("process_"))
        {
            out.push(word.to_string());
        }
        rest = &tail[end.max(1)..];
    }
    out
}

fn substitute(expr: &str, instance: &str) -> String {
    expr.replace("$__rate_interval", "20s")
        .replace("$__range", "1m")
        .replace("$job", JOB)
        .replace("$model_name", MODEL)
        .replace("$Deployment_id", MODEL)
        .replace("$instance", instance)
        .replace("$engine", "0")
        .replace("$ttft_slo", "0.5")
        .replace("$tpot_slo", "0.1")
}

#[test]
fn vllm_dashboard_queries_return_data_from_a_strata_engine() {
    let engine = start_engine();
    let dir = std::env::temp_dir().join(format!("strata-prom-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (_prom, prom) = start_prometheus(&dir, engine);

    // Load: completions and chats, a shared prefix (cache hits), n = 2, a bad route (4xx),
    // spread over several scrapes so rates have two samples to work with.
    let shared = "You are a helpful assistant who answers briefly and precisely. ".repeat(6);
    let load_until = Instant::now() + Duration::from_secs(8);
    let mut i = 0;
    while Instant::now() < load_until {
        let bodies = [
            format!(r#"{{"prompt":"{shared} Question {i}:","max_tokens":8,"temperature":0}}"#),
            format!(
                r#"{{"messages":[{{"role":"user","content":"Say {i} words."}}],"max_tokens":6,"n":2}}"#
            ),
        ];
        let handles: Vec<_> = bodies
            .into_iter()
            .zip(["/v1/completions", "/v1/chat/completions"])
            .map(|(b, path)| std::thread::spawn(move || http(engine, "POST", path, &b)))
            .collect();
        for h in handles {
            let (status, body) = h.join().expect("client");
            assert_eq!(status, 200, "{body}");
        }
        let (status, _) = http(engine, "GET", "/no/such/route", "");
        assert_eq!(status, 404);
        i += 1;
    }
    // Let Prometheus scrape the settled counters a few more times.
    std::thread::sleep(Duration::from_secs(3));

    let (_, page) = http(engine, "GET", "/metrics", "");
    let exported: BTreeSet<String> = strata_api::prometheus::samples(&page)
        .0
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    for needed in [
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket",
        "vllm:iteration_tokens_total_bucket",
        "vllm:num_requests_waiting_by_reason",
        "vllm:prompt_tokens_cached_total",
        "vllm:prompt_tokens_by_source_total",
        "vllm:request_prefill_kv_computed_tokens_sum",
        "vllm:request_max_num_generation_tokens_bucket",
        "vllm:request_params_n_bucket",
        "vllm:request_params_max_tokens_bucket",
        "vllm:request_inference_time_seconds_bucket",
        "http_requests_total",
        "http_request_duration_seconds_bucket",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            exported.contains(needed),
            "the engine does not export {needed}"
        );
    }

    let fixture: Value = serde_json::from_str(include_str!(
        "../../../tests/fixtures/vllm-dashboards/promql.json"
    ))
    .expect("fixture");
    let instance = engine.to_string();
    let (mut tested, mut skipped) = (0, BTreeSet::new());
    let mut pending = Vec::new();
    for db in fixture["dashboards"].as_array().expect("dashboards") {
        for panel in db["panels"].as_array().expect("panels") {
            let expr = panel["expr"].as_str().unwrap_or_default();
            let missing: Vec<String> = metric_names(expr)
                .into_iter()
                .filter(|m| !exported.contains(m))
                .collect();
            if !missing.is_empty() {
                skipped.extend(missing);
                continue;
            }
            tested += 1;
            pending.push((
                format!("{} / {}", db["file"], panel["title"]),
                substitute(expr, &instance),
            ));
        }
    }
    // On a loaded machine Prometheus may lag a scrape or two behind the load, so an
    // expression without data yet is asked again for a while; one that never gets data
    // fails the test.
    let settle_until = Instant::now() + Duration::from_secs(20);
    let mut empty;
    loop {
        empty = Vec::new();
        for (name, q) in pending {
            let v = query(prom, &q);
            assert_eq!(v["status"], "success", "{q}: {v}");
            let result = &v["data"]["result"];
            let has_data = match v["data"]["resultType"].as_str() {
                Some("vector" | "matrix") => result.as_array().is_some_and(|r| !r.is_empty()),
                Some("scalar" | "string") => !result.is_null(),
                _ => false,
            };
            if !has_data {
                empty.push((name, q));
            }
        }
        if empty.is_empty() || Instant::now() >= settle_until {
            break;
        }
        pending = empty.clone();
        std::thread::sleep(Duration::from_secs(1));
    }
    let empty: Vec<String> = empty
        .into_iter()
        .map(|(n, q)| format!("{n}: {q}"))
        .collect();
    eprintln!(
        "{tested} dashboard expressions tested; metrics this engine does not export: {skipped:?}"
    );
    assert!(tested >= 150, "only {tested} expressions could be tested");
    assert!(
        empty.is_empty(),
        "expressions without data:\n{}",
        empty.join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
