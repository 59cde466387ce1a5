//! `--generation-config` through the HTTP server in process, with vLLM's semantics: a
//! folder (or file) with a Hugging Face `generation_config.json`, `auto` (the file beside
//! the model) and `vllm` (no defaults). A request that leaves sampling fields out gets the
//! defaults; what a request sends wins; a bad config stops the engine at startup with an
//! error naming the file and the problem.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;

use common::post;

use serde_json::{json, Value};
use strata_engine::server::{self, EngineOptions};

const MODEL: &str = "smollm2-135m-instruct";

/// A scratch folder removed at the end of the test.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("strata-gencfg-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn opts(generation_config: &str) -> EngineOptions {
    EngineOptions {
        num_blocks: Some(128),
        max_model_len: Some(1024),
        generation_config: generation_config.to_string(),
        ..EngineOptions::default()
    }
}

/// A chat answer: its text and completion token count.
fn chat(addr: SocketAddr, body: Value) -> (String, u64) {
    let (status, v) = post(addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().expect("usage"),
    )
}

fn question(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

#[test]
fn defaults_fill_what_a_request_leaves_out_and_sent_values_win() {
    let dir = TempDir::new("dir");
    // transformers' greedy switch and an output limit, plus keys Strata does not use.
    std::fs::write(
        dir.0.join("generation_config.json"),
        r#"{"do_sample": false, "temperature": 0.9, "max_new_tokens": 6,
            "bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.42.3"}"#,
    )
    .unwrap();
    let model = common::model_path();
    let with = common::serve_model(&model, &opts(dir.0.to_str().unwrap()));
    let plain = common::serve_model(&model, &opts("vllm"));

    // No sampling fields: greedy, at most 6 tokens, exactly what the plain engine gives
    // for temperature 0 and max_tokens 6.
    let (text, n) = chat(with, question(json!({})));
    let (want, want_n) = chat(plain, question(json!({"temperature": 0, "max_tokens": 6})));
    assert_eq!((text.as_str(), n), (want.as_str(), want_n));
    assert!(n <= 6 && n > 0, "{n} tokens");
    // Greedy whatever the seed: the default temperature is 0.
    let (again, _) = chat(with, question(json!({"seed": 12345})));
    assert_eq!(again, text);

    // Sent values win: sampled at temperature 1 with a seed, 24 tokens allowed, exactly
    // as the plain engine does with the same fields.
    let sent = json!({"temperature": 1.0, "seed": 7, "max_tokens": 24});
    let (got, got_n) = chat(with, question(sent.clone()));
    let (want, want_n) = chat(plain, question(sent));
    assert_eq!((got.as_str(), got_n), (want.as_str(), want_n));
    // `max_completion_tokens` counts as sending the limit.
    let (_, n) = chat(
        with,
        question(json!({"temperature": 0, "max_completion_tokens": 9, "ignore_eos": true})),
    );
    assert_eq!(n, 9);

    // Completions get the same defaults.
    let body = json!({"model": MODEL, "prompt": "The capital of France is", "ignore_eos": true});
    let (status, v) = post(with, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 6);
    let mut greedy = body.clone();
    greedy["temperature"] = json!(0);
    greedy["max_tokens"] = json!(6);
    let (_, w) = post(plain, "/v1/completions", &greedy);
    assert_eq!(v["choices"][0]["text"], w["choices"][0]["text"]);

    // Without defaults (`vllm`) a request without max_tokens may run to the context end:
    // with ignore_eos and a 40-token cap set by the request it produces all 40.
    let (_, n) = chat(
        plain,
        question(json!({"temperature": 0, "max_tokens": 40, "ignore_eos": true})),
    );
    assert_eq!(n, 40);
}

#[test]
fn auto_reads_the_config_beside_the_model_file() {
    let dir = TempDir::new("auto");
    let link = dir.0.join("smollm2.gguf");
    std::os::unix::fs::symlink(common::model_path(), &link).expect("link the model");
    // `<model stem>.generation_config.json` beside the file (one folder may hold several
    // models); a plain `generation_config.json` there is the fallback.
    std::fs::write(
        dir.0.join("smollm2.generation_config.json"),
        r#"{"temperature": 0.0, "max_new_tokens": 3}"#,
    )
    .unwrap();
    std::fs::write(
        dir.0.join("generation_config.json"),
        r#"{"temperature": 0.0, "max_new_tokens": 5}"#,
    )
    .unwrap();
    let auto = common::serve_model(&link, &opts("auto"));
    let (_, n) = chat(auto, question(json!({"ignore_eos": true})));
    assert_eq!(n, 3);
    // `vllm` ignores both files.
    let none = common::serve_model(&link, &opts("vllm"));
    let (_, n) = chat(none, question(json!({"ignore_eos": true, "max_tokens": 8})));
    assert_eq!(n, 8);
}

#[test]
fn a_bad_generation_config_is_a_clear_startup_error() {
    let model = common::model_path();
    let dir = TempDir::new("bad");
    let file = dir.0.join("generation_config.json");
    let fails = |spec: &str| -> String {
        let opts = EngineOptions {
            model_path: model.clone(),
            model_name: MODEL.into(),
            ..opts(spec)
        };
        match server::load(&opts) {
            Ok(_) => panic!("`--generation-config {spec}` was accepted"),
            Err(e) => e.to_string(),
        }
    };

    // Not JSON.
    std::fs::write(&file, "{temperature: 0.2").unwrap();
    let e = fails(dir.0.to_str().unwrap());
    assert!(
        e.contains("generation_config.json") && e.contains("not valid"),
        "{e}"
    );
    // A key of the wrong type.
    std::fs::write(&file, r#"{"top_k": "forty"}"#).unwrap();
    let e = fails(file.to_str().unwrap());
    assert!(e.contains("not valid") && e.contains("invalid type"), "{e}");
    // Out of range: refused at startup, naming the field, not at every request.
    std::fs::write(&file, r#"{"temperature": 5.0}"#).unwrap();
    let e = fails(dir.0.to_str().unwrap());
    assert!(
        e.contains("out of range") && e.contains("temperature"),
        "{e}"
    );
    std::fs::write(&file, r#"{"max_new_tokens": 0}"#).unwrap();
    let e = fails(dir.0.to_str().unwrap());
    assert!(e.contains("max_tokens"), "{e}");
    // A folder without the file, and a path that does not exist.
    std::fs::remove_file(&file).unwrap();
    let e = fails(dir.0.to_str().unwrap());
    assert!(
        e.contains("cannot read") && e.contains("generation_config.json"),
        "{e}"
    );
    let e = fails("/nonexistent/strata/generation-config");
    assert!(e.contains("cannot read"), "{e}");
}
