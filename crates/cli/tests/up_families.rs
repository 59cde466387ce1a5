//! `strata up --model PATH` over each model family's tiny GGUF
//! (`crates/engine/tests/fixtures/families/`, written by `tools/families/make_tiny.py`):
//! the stack starts on the file, lists it under its file name, and answers a chat request
//! through its front, the family's own chat template rendering the messages; the greedy
//! answer is the same when asked twice (the second from the prefix cache).

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{free_port, strata, workspace_root, Supervised};
use serde_json::{json, Value};

fn chat(client: &reqwest::blocking::Client, base: &str, model: &str) -> Value {
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": model, "max_tokens": 6, "temperature": 0,
                      "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Name a colour."}]}))
        .send()
        .expect("the front answers");
    let status = resp.status().as_u16();
    let body: Value = resp.json().expect("JSON");
    assert_eq!(status, 200, "{model}: {body}");
    body
}

#[test]
fn strata_up_serves_every_familys_gguf_by_path() {
    let dir = workspace_root().join("crates/engine/tests/fixtures/families");
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    for family in [
        "llama3",
        "llama_yarn",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma2",
        "gemma3",
    ] {
        let path = dir.join(format!("{family}.gguf"));
        let logs =
            std::env::temp_dir().join(format!("strata-up-family-{family}-{}", std::process::id()));
        let port = free_port();
        let mut up = Supervised(
            strata()
                .args(["up", "--no-gateway", "--port", &port.to_string()])
                .args(["--kv-cache-memory", "33554432", "--model"])
                .arg(&path)
                .arg("--log-dir")
                .arg(&logs)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn strata up"),
        );
        common::read_until(&mut up.0, "controller:", Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("{family}: strata up did not come up: {e}"));
        let base = format!("http://127.0.0.1:{port}");
        let models: Value = client
            .get(format!("{base}/v1/models"))
            .send()
            .and_then(|r| r.json())
            .expect("models");
        let ids: Vec<&str> = models["data"]
            .as_array()
            .expect("a model list")
            .iter()
            .filter_map(|m| m["id"].as_str())
            .collect();
        assert_eq!(ids, vec![family], "{family}: {models}");
        let first = chat(&client, &base, family);
        assert_eq!(first["model"], family);
        assert_eq!(first["choices"][0]["message"]["role"], "assistant");
        let usage = &first["usage"];
        assert!(usage["prompt_tokens"].as_u64().unwrap_or(0) > 4, "{first}");
        assert!(
            usage["completion_tokens"].as_u64().unwrap_or(0) > 0,
            "{first}"
        );
        let again = chat(&client, &base, family);
        assert_eq!(
            again["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"],
            "{family}: greedy answers differ"
        );
        drop(up);
        let _ = std::fs::remove_dir_all(&logs);
    }
}
