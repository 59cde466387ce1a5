//! The embedding model (all-MiniLM-L6-v2) through the encoder path and `/v1/embeddings`,
//! in process on a loopback port: token ids and vectors match the transformers reference,
//! batched inputs equal each alone, base64 decodes to the floats, bad input of every kind is
//! an OpenAI-shaped error and the server keeps serving, concurrent requests share forwards,
//! and the OpenAI Python SDK's `embeddings.create` works.

mod common;

use common::request;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};
use strata_engine::embed::bert::BertModel;
use strata_engine::embed::linear::EncoderWeights;
use strata_engine::embed::server::EmbedState;
use strata_engine::embed::tokenizer::EmbedTokenizer;
use strata_engine::embed::{is_encoder_model, EncoderConfig};
use strata_engine::server::EngineOptions;

const NAME: &str = "all-minilm-l6-v2";

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Item {
    text: String,
    ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn reference() -> Vec<Item> {
    let path = workspace_root().join("tests/fixtures/minilm/reference.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|it| Item {
            text: it["text"].as_str().unwrap().to_string(),
            ids: serde_json::from_value(it["input_ids"].clone()).unwrap(),
            embedding: serde_json::from_value(it["embedding"].clone()).unwrap(),
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn token_ids_and_vectors_match_the_transformers_reference() {
    let dir = common::embedding_model_dir();
    assert!(is_encoder_model(&dir));
    let config = EncoderConfig::from_dir(&dir).unwrap();
    assert_eq!(config.max_len, 256, "sentence-transformers' max_seq_length");
    let tokenizer = EmbedTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let items = reference();
    assert_eq!(items.len(), 10);
    // The last sentence is 300 words: the reference cut it at sentence-transformers'
    // max_seq_length, as `truncate_prompt_tokens` does.
    let long = &items[9];
    assert!(tokenizer.encode(&long.text, true, None).unwrap().len() > 256);
    let mut inputs = Vec::new();
    for item in &items {
        let ids = tokenizer.encode(&item.text, true, Some(256)).unwrap();
        assert_eq!(ids, item.ids, "token ids of {:?}", item.text);
        inputs.push(ids);
    }
    // Both weight formats: the 8-bit default and the f32 one, each held to the bound.
    let mut vectors = Vec::new();
    for format in [EncoderWeights::Int8, EncoderWeights::F32] {
        let model = BertModel::load_as(&dir, config.clone(), format).unwrap();
        assert_eq!(
            model.weights(),
            format,
            "every dense layer in {}",
            format.name()
        );
        // One ragged forward over all ten (lengths 7 to 256).
        let batch = model.embed(&inputs).unwrap();
        let mut worst = 1.0f64;
        for (item, v) in items.iter().zip(&batch) {
            let c = cosine(v, &item.embedding);
            assert!(c >= 0.999, "{}: {:?}: cosine {c}", format.name(), item.text);
            worst = worst.min(c);
        }
        eprintln!(
            "{}: lowest cosine with the reference: {worst:.7}",
            format.name()
        );
        // Each alone gives what it gets in the batch (the shortest, a middle one, the longest).
        for k in [4, 0, 9] {
            let (input, v) = (&inputs[k], &batch[k]);
            let alone = model.embed(std::slice::from_ref(input)).unwrap();
            let d = max_diff(&alone[0], v);
            assert!(
                d < 1e-5,
                "{}: alone vs batched differ by {d}",
                format.name()
            );
        }
        vectors.push(batch);
    }
    // The two formats agree with each other as closely as each with the reference.
    for (a, b) in vectors[0].iter().zip(&vectors[1]) {
        let c = cosine(a, b);
        assert!(c >= 0.999, "int8 vs f32 cosine {c}");
    }
}

fn start(opts: EngineOptions) -> (SocketAddr, Arc<EmbedState>) {
    common::serve_encoder(&EngineOptions {
        model_path: common::embedding_model_dir(),
        model_name: NAME.into(),
        ..opts
    })
}

fn small() -> EngineOptions {
    EngineOptions {
        max_body_bytes: 256 * 1024,
        ..EngineOptions::default()
    }
}

fn post(addr: SocketAddr, body: &Value) -> (u16, Value) {
    let (status, text) = request(addr, "POST", "/v1/embeddings", body.to_string().as_bytes());
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

fn vector(v: &Value) -> Vec<f32> {
    serde_json::from_value(v.clone()).expect("float vector")
}

fn assert_error(status: u16, body: &Value, want_status: u16, want_param: Option<&str>) {
    assert_eq!(status, want_status, "{body}");
    let err = &body["error"];
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(err["type"].as_str().is_some(), "{body}");
    let obj = err.as_object().expect("error object");
    assert!(
        obj.contains_key("param") && obj.contains_key("code"),
        "{body}"
    );
    if let Some(p) = want_param {
        assert_eq!(err["param"], p, "{body}");
    }
}

#[test]
fn embeddings_in_floats_and_base64_for_text_batches_and_token_ids() {
    let (addr, _) = start(small());
    let items = reference();
    let texts: Vec<&str> = items.iter().map(|i| i.text.as_str()).collect();

    // The last of the ten is longer than the model's 256 tokens; the reference cut it.
    let (status, batch) = post(
        addr,
        &json!({"model": NAME, "input": texts, "truncate_prompt_tokens": -1}),
    );
    assert_eq!(status, 200, "{batch}");
    assert_eq!(batch["object"], "list");
    assert_eq!(batch["model"], NAME);
    let want_tokens: usize = items.iter().map(|i| i.ids.len()).sum();
    assert_eq!(batch["usage"]["prompt_tokens"], want_tokens);
    assert_eq!(batch["usage"]["total_tokens"], want_tokens);
    let data = batch["data"].as_array().expect("data");
    assert_eq!(data.len(), items.len());
    let mut floats = Vec::new();
    for (i, (d, item)) in data.iter().zip(&items).enumerate() {
        assert_eq!(d["object"], "embedding");
        assert_eq!(d["index"], i);
        let v = vector(&d["embedding"]);
        assert_eq!(v.len(), 384);
        let c = cosine(&v, &item.embedding);
        assert!(c >= 0.999, "item {i}: cosine {c}");
        floats.push(v);
    }

    // base64: little-endian f32, bit-for-bit the floats of the same input.
    let (status, b64) = post(
        addr,
        &json!({"input": [texts[0], texts[3]], "encoding_format": "base64"}),
    );
    assert_eq!(status, 200, "{b64}");
    for (k, want) in [(0usize, &floats[0]), (1, &floats[3])] {
        let text = b64["data"][k]["embedding"].as_str().expect("base64 string");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .expect("valid base64");
        let got: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert!(max_diff(&got, want) < 1e-6, "base64 item {k}");
    }

    // Token ids, one list and a batch of lists, give the text's vectors.
    let (status, one) = post(addr, &json!({"input": items[2].ids}));
    assert_eq!(status, 200, "{one}");
    assert!(max_diff(&vector(&one["data"][0]["embedding"]), &floats[2]) < 1e-5);
    assert_eq!(one["usage"]["prompt_tokens"], items[2].ids.len());
    let (status, many) = post(addr, &json!({"input": [items[4].ids, items[5].ids]}));
    assert_eq!(status, 200, "{many}");
    assert!(max_diff(&vector(&many["data"][1]["embedding"]), &floats[5]) < 1e-5);

    // Its native size may be asked for by name.
    let (status, dims) = post(addr, &json!({"input": "a", "dimensions": 384}));
    assert_eq!(status, 200, "{dims}");

    // Long input cut only when asked: 300 words -> 256 tokens, [CLS] and [SEP] kept.
    let long = "word ".repeat(300);
    let (status, cut) = post(addr, &json!({"input": long, "truncate_prompt_tokens": -1}));
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["usage"]["prompt_tokens"], 256);
    let (status, cut) = post(addr, &json!({"input": long, "truncate_prompt_tokens": 10}));
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["usage"]["prompt_tokens"], 10);

    let (status, models) = request(addr, "GET", "/v1/models", b"");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], NAME);
    assert_eq!(models["data"][0]["max_model_len"], 256);
}

#[test]
fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let (addr, _) = start(small());
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (json!({"input": ""}), 400, Some("input")),
        (json!({"input": ["ok", ""]}), 400, Some("input[1]")),
        (json!({"input": []}), 400, Some("input")),
        (json!({"input": [[101, 102], []]}), 400, Some("input[1]")),
        (json!({"input": vec!["a"; 2049]}), 400, Some("input")),
        (json!({"input": "word ".repeat(300)}), 400, Some("input")),
        (json!({"input": vec![7592; 257]}), 400, Some("input")),
        (json!({"input": [101, 30522]}), 400, Some("input")),
        (json!({"input": [-5]}), 400, Some("input")),
        (
            json!({"input": "a", "dimensions": 128}),
            400,
            Some("dimensions"),
        ),
        (
            json!({"input": "a", "dimensions": -1}),
            400,
            Some("dimensions"),
        ),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            400,
            Some("encoding_format"),
        ),
        (
            json!({"input": "a", "truncate_prompt_tokens": 0}),
            400,
            Some("truncate_prompt_tokens"),
        ),
        (
            json!({"input": "a", "truncate_prompt_tokens": 300}),
            400,
            Some("truncate_prompt_tokens"),
        ),
        (json!({"input": {"text": "a"}}), 400, Some("input")),
        (json!({"model": NAME}), 400, Some("input")),
        (
            json!({"model": "no-such-model", "input": "a"}),
            404,
            Some("model"),
        ),
    ];
    for (body, want_status, want_param) in &cases {
        let (status, resp) = post(addr, body);
        assert_error(status, &resp, *want_status, *want_param);
    }
    // Malformed bodies.
    for raw in [&b"{not json"[..], b"", b"[1,2]", b"\xff\xfe"] {
        let (status, text) = request(addr, "POST", "/v1/embeddings", raw);
        let v: Value = serde_json::from_str(&text).expect("JSON error body");
        assert_error(status, &v, 400, None);
    }
    let huge = json!({"input": "a ".repeat(200_000)}).to_string();
    let (status, text) = request(addr, "POST", "/v1/embeddings", huge.as_bytes());
    assert_error(status, &serde_json::from_str(&text).unwrap(), 413, None);
    // Generation routes say what this model is.
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = json!({"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                          "prompt": "hi"});
        let (status, text) = request(addr, "POST", path, body.to_string().as_bytes());
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_error(status, &v, 400, Some("model"));
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("embedding model"),
            "{v}"
        );
    }
    let (status, text) = request(addr, "GET", "/v1/embeddings", b"");
    assert_error(status, &serde_json::from_str(&text).unwrap(), 405, None);
    let (status, _) = request(addr, "GET", "/nope", b"");
    assert_eq!(status, 404);

    // Still serving, and the metrics counted only the good request.
    let (status, ok) = post(addr, &json!({"input": "still here"}));
    assert_eq!(status, 200, "{ok}");
    let (status, health) = request(addr, "GET", "/health", b"");
    assert_eq!(status, 200, "{health}");
    let (_, metrics) = request(addr, "GET", "/metrics", b"");
    let prompt_tokens: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("vllm:prompt_tokens_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(prompt_tokens, 4.0, "[CLS] still here [SEP]");
}

#[test]
fn concurrent_requests_share_forwards_and_get_what_they_get_alone() {
    let (addr, state) = start(EngineOptions {
        max_num_batched_tokens: 1024,
        ..small()
    });
    let items = reference();
    // Each sentence alone, one request at a time.
    let mut alone = Vec::new();
    for item in &items[..8] {
        let (status, v) = post(addr, &json!({"input": item.text}));
        assert_eq!(status, 200, "{v}");
        alone.push(vector(&v["data"][0]["embedding"]));
    }
    let before = state.worker.forwards();
    assert_eq!(before, 8);
    // A long request keeps the worker busy while eight small ones queue up behind it.
    let long: Vec<Vec<u32>> = vec![items[9].ids.clone(); 12];
    let busy = std::thread::spawn(move || post(addr, &json!({"input": long})));
    std::thread::sleep(Duration::from_millis(30));
    let clients: Vec<_> = items[..8]
        .iter()
        .map(|item| {
            let text = item.text.clone();
            std::thread::spawn(move || post(addr, &json!({"input": text})))
        })
        .collect();
    for (client, want) in clients.into_iter().zip(&alone) {
        let (status, v) = client.join().expect("client");
        assert_eq!(status, 200, "{v}");
        let d = max_diff(&vector(&v["data"][0]["embedding"]), want);
        assert!(d < 1e-5, "shared forward changed a vector by {d}");
    }
    let (status, v) = busy.join().expect("busy client");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["data"].as_array().map(Vec::len), Some(12));
    let used = state.worker.forwards() - before;
    // 12 × 256 tokens is 3 forwards at a 1,024-token budget; the eight small requests ride
    // along in fewer than eight more.
    assert!(used < 3 + 8, "{used} forwards: no request shared one");
}

#[test]
fn openai_python_sdk_embeddings_create() {
    let (addr, _) = start(small());
    let root = workspace_root();
    let out = Command::new("python3")
        .arg(root.join("tests/openai_embeddings.py"))
        .arg(format!("http://{addr}/v1"))
        .arg(NAME)
        .arg(root.join("tests/fixtures/minilm/reference.json"))
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

/// One exchange with an optional bearer key: the status and the body as JSON.
fn call_with_key(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    key: Option<&str>,
) -> (u16, Value) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(common::READ_TIMEOUT))
        .expect("timeout");
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{auth}Connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let (status, text) = common::parse_response(&raw);
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The embeddings server takes the same `--api-key` as the generation server (issue 29).
#[test]
fn the_api_key_guards_the_embeddings_server() {
    let (addr, _) = start(EngineOptions {
        auth: strata_engine::auth::AuthOptions {
            api_keys: vec!["embed-key".into()],
            admin_key: Some("embed-admin".into()),
            protect_metrics: false,
        },
        ..small()
    });
    let body = json!({"model": NAME, "input": "hello"}).to_string();
    for (method, path, body) in [
        ("POST", "/v1/embeddings", body.as_str()),
        ("GET", "/v1/models", ""),
        ("POST", "/tokenize", r#"{"prompt": "hello"}"#),
    ] {
        for key in [None, Some("wrong")] {
            let (status, answer) = call_with_key(addr, method, path, body, key);
            assert_eq!(status, 401, "{path}: {answer}");
            assert_eq!(answer["error"]["type"], "authentication_error", "{answer}");
        }
        for key in ["embed-key", "embed-admin"] {
            let (status, answer) = call_with_key(addr, method, path, body, Some(key));
            assert_eq!(status, 200, "{path}: {answer}");
        }
    }
    for path in ["/health", "/version", "/metrics"] {
        let (status, answer) = call_with_key(addr, "GET", path, "", None);
        assert_eq!(status, 200, "{path}: {answer}");
    }
}
