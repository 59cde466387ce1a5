//! Multi-LoRA on the default model (issue 16): adapters written by
//! `tools/make_lora_adapter.py` into a temporary directory, then
//! - an adapter whose `B` is zero gives the base model's output, logit for logit;
//! - a real adapter's greedy output equals the model with `W + scale·B·A` merged into its
//!   f32 weights (and differs from the base model's);
//! - one step mixing two adapters and the base gives each row exactly what it gets alone;
//! - over HTTP: `model` selects an adapter, `/v1/models` lists them with `parent`, runtime
//!   load/unload with vLLM's shapes and errors (each bad input its own case, the engine
//!   serving on), prefix caching keeps adapters apart, `--max-loras` makes a request for
//!   another adapter wait, `vllm:lora_requests_info` shows it, and unloading an adapter in
//!   use is refused;
//! - the OpenAI Python SDK chats through two adapters (`tests/openai_lora.py`).

mod common;

use common::{post, request};

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_engine::kv::block_pool::{BlockLora, PoolEvent};
use strata_engine::kv::cache::KvCache;
use strata_engine::kv_events::KvEvent;
use strata_engine::lora::{LoraAdapter, LoraModule, LoraOptions};
use strata_engine::model::{Llama, SeqInput, WeightFormat};
use strata_engine::server::{self, EngineOptions};

const MODEL: &str = "smollm2-135m-instruct";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!(
            "strata-lora-test-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        Self(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a seeded PEFT adapter for the default model with the tools script.
fn make_adapter(dir: &Path, args: &[&str]) -> PathBuf {
    let out = Command::new("python3")
        .arg(workspace_root().join("tools/make_lora_adapter.py"))
        .arg(dir)
        .args(args)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "make_lora_adapter.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir.to_path_buf()
}

/// The adapters the model-level tests use: a real one on every attention and MLP
/// projection, a second real one (other seed, attention only), and one with `B = 0`.
struct Adapters {
    _dir: TempDir,
    real: PathBuf,
    other: PathBuf,
    zero: PathBuf,
}

fn adapters() -> Adapters {
    let dir = TempDir::new("adapters");
    let real = make_adapter(
        &dir.0.join("real"),
        &[
            "--rank",
            "8",
            "--alpha",
            "16",
            "--seed",
            "1",
            "--std",
            "0.05",
            "--targets",
            "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        ],
    );
    let other = make_adapter(
        &dir.0.join("other"),
        &[
            "--rank", "4", "--alpha", "16", "--seed", "2", "--std", "0.05",
        ],
    );
    let zero = make_adapter(
        &dir.0.join("zero"),
        &[
            "--rank",
            "8",
            "--targets",
            "q_proj,v_proj,down_proj",
            "--zero-b",
        ],
    );
    Adapters {
        _dir: dir,
        real,
        other,
        zero,
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let v: Value =
        serde_json::from_str(include_str!("fixtures/reference_smollm2.json")).expect("fixture");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            c["prompt_ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|t| t.as_u64().expect("id") as u32)
                .collect()
        })
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of several sequences in lockstep in one cache: every step runs all of
/// them in one forward, sequence `i` with adapter `loras[i]`. Returns each sequence's
/// logits after the prompt and after each generated token.
fn lockstep(
    model: &Llama,
    prompts: &[&[u32]],
    loras: &[Option<&LoraAdapter>],
    steps: usize,
) -> Vec<Vec<Vec<f32>>> {
    let bs = 16;
    let per_seq = (prompts.iter().map(|p| p.len()).max().unwrap_or(0) + steps).div_ceil(bs);
    let mut cache = KvCache::new(
        model.config.n_layer,
        per_seq * prompts.len(),
        bs,
        model.kv_slot_width(),
    );
    let tables: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    let mut tokens: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut done = vec![0usize; prompts.len()];
    let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    for _ in 0..=steps {
        let inputs: Vec<SeqInput<'_>> = (0..prompts.len())
            .map(|i| SeqInput {
                tokens: &tokens[i][done[i]..],
                start_pos: done[i],
                block_table: &tables[i],
                want_logits: true,
                prompt_len: prompts[i].len(),
            })
            .collect();
        let tails = vec![1; prompts.len()];
        let logits = model
            .forward_rows_lora(&mut cache, &inputs, &tails, loras)
            .expect("forward");
        drop(inputs);
        for (i, mut rows) in logits.into_iter().enumerate() {
            let row = rows.pop().expect("logits");
            done[i] = tokens[i].len();
            tokens[i].push(argmax(&row));
            out[i].push(row);
        }
    }
    out
}

fn greedy(model: &Llama, prompt: &[u32], lora: Option<&LoraAdapter>, steps: usize) -> Vec<u32> {
    lockstep(model, &[prompt], &[lora], steps)[0]
        .iter()
        .map(|r| argmax(r))
        .collect()
}

fn load_adapter(name: &str, path: &Path, model: &Llama) -> LoraAdapter {
    LoraAdapter::load(name, path, &model.config, 16).expect("adapter loads")
}

#[test]
fn an_adapter_with_zero_b_gives_the_base_models_output_token_for_token() {
    let a = adapters();
    let model = Llama::load(&common::model_path(), WeightFormat::Gguf).expect("model");
    let zero = load_adapter("zero", &a.zero, &model);
    for prompt in prompts().iter().take(3) {
        let base = lockstep(&model, &[prompt], &[None], 12);
        let with = lockstep(&model, &[prompt], &[Some(&zero)], 12);
        // Adding exactly zero changes no logit at all.
        assert_eq!(base, with);
    }
}

#[test]
fn a_real_adapter_matches_its_weights_merged_in_f32() {
    let a = adapters();
    let mut model = Llama::load(&common::model_path(), WeightFormat::F32).expect("model");
    let real = load_adapter("real", &a.real, &model);
    let steps = 16;
    let cases = prompts();
    let cases: Vec<&Vec<u32>> = [0, 5].iter().map(|&i| &cases[i]).collect();
    let base: Vec<Vec<u32>> = cases
        .iter()
        .map(|p| greedy(&model, p, None, steps))
        .collect();
    let per_row: Vec<Vec<Vec<f32>>> = cases
        .iter()
        .map(|p| lockstep(&model, &[p], &[Some(&real)], steps).remove(0))
        .collect();
    model.merge_lora(&real).expect("merge");
    for (i, p) in cases.iter().enumerate() {
        let lora_tokens: Vec<u32> = per_row[i].iter().map(|r| argmax(r)).collect();
        let merged = lockstep(&model, &[p], &[None], steps).remove(0);
        let merged_tokens: Vec<u32> = merged.iter().map(|r| argmax(r)).collect();
        assert_eq!(lora_tokens, merged_tokens, "case {i}");
        // The first step's logits (same input on both sides) agree to rounding.
        let diff = per_row[i][0]
            .iter()
            .zip(&merged[0])
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(diff < 2e-3, "case {i}: logits differ by {diff}");
        // And the adapter does change what the model says.
        assert_ne!(
            lora_tokens, base[i],
            "case {i}: the adapter changed nothing"
        );
    }
    // Merging needs f32 weights.
    let gguf = Llama::load(&common::model_path(), WeightFormat::Gguf).expect("model");
    let mut gguf = gguf;
    assert!(gguf.merge_lora(&real).is_err());
}

#[test]
fn a_step_mixing_two_adapters_and_the_base_gives_each_row_what_it_gets_alone() {
    let a = adapters();
    let model = Llama::load(&common::model_path(), WeightFormat::Gguf).expect("model");
    let real = load_adapter("real", &a.real, &model);
    let other = load_adapter("other", &a.other, &model);
    let all = prompts();
    let ps: Vec<&[u32]> = vec![&all[0], &all[2], &all[5], &all[1]];
    let loras = [Some(&real), None, Some(&other), Some(&real)];
    let steps = 8;
    let mixed = lockstep(&model, &ps, &loras, steps);
    for i in 0..ps.len() {
        let alone = lockstep(&model, &[ps[i]], &[loras[i]], steps).remove(0);
        assert_eq!(mixed[i], alone, "row {i} changed by its neighbours");
    }
    // The adapters do act: the same prompt with and without one differs.
    let base0 = lockstep(&model, &[ps[0]], &[None], 0).remove(0);
    assert_ne!(base0[0], mixed[0][0]);
}

// --- HTTP ---

/// An OpenAI-shaped error with this status whose message mentions `needle`.
fn assert_error(got: (u16, Value), status: u16, needle: &str) {
    let (s, v) = got;
    assert_eq!(s, status, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.to_lowercase().contains(&needle.to_lowercase()),
        "`{needle}` not in {v}"
    );
}

fn complete(addr: SocketAddr, model: &str, prompt: &str, max_tokens: u32) -> Value {
    let (s, v) = post(
        addr,
        "/v1/completions",
        &json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
    v
}

/// The `vllm:lora_requests_info` series' labels.
fn lora_info(addr: SocketAddr) -> Option<String> {
    let (_, page) = request(addr, "GET", "/metrics", b"");
    page.lines()
        .find(|l| l.starts_with("vllm:lora_requests_info{"))
        .map(str::to_string)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts a stream that runs long, returning once its first token arrived; dropping the
/// stream aborts the request.
fn long_stream(addr: SocketAddr, model: &str) -> TcpStream {
    let body = json!({"model": model, "prompt": "Once upon a time", "max_tokens": 3000,
        "ignore_eos": true, "temperature": 0, "stream": true})
    .to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write");
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).expect("read") > 0, "stream ended");
        if line.starts_with("data: {") {
            return s;
        }
    }
}

#[test]
fn adapters_over_http_select_list_load_unload_wait_and_refuse() {
    let a = adapters();
    let dir = TempDir::new("http");
    let addr = common::serve(&EngineOptions {
        num_blocks: Some(256),
        max_model_len: Some(4096),
        lora: Some(LoraOptions {
            max_loras: 1,
            max_lora_rank: 8,
            max_cpu_loras: Some(3),
            // Runtime loads read only under --lora-dir (issue 29).
            dirs: vec![a._dir.0.clone(), dir.0.clone()],
            modules: vec![
                LoraModule {
                    name: "real".into(),
                    path: a.real.to_string_lossy().into_owned(),
                },
                format!(r#"{{"name": "zero", "path": "{}"}}"#, a.zero.display())
                    .parse()
                    .expect("JSON form"),
            ],
        }),
        ..EngineOptions::default()
    });

    // /v1/models: the base, then each adapter with parent = the base and root = its path.
    let (s, body) = request(addr, "GET", "/v1/models", b"");
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).expect("json");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, vec![MODEL, "real", "zero"]);
    assert_eq!(v["data"][1]["parent"], MODEL);
    assert_eq!(v["data"][1]["root"], a.real.to_string_lossy().as_ref());

    // `model` selects: the zero-B adapter answers as the base does; the real one differs
    // and its answers name it.
    let prompt = "The capital of France is";
    let base = complete(addr, MODEL, prompt, 12);
    let zero = complete(addr, "zero", prompt, 12);
    let real = complete(addr, "real", prompt, 12);
    assert_eq!(zero["choices"][0]["text"], base["choices"][0]["text"]);
    assert_ne!(real["choices"][0]["text"], base["choices"][0]["text"]);
    assert_eq!(real["model"], "real");
    let (s, chat) = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "real", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4}),
    );
    assert_eq!((s, chat["model"].as_str()), (200, Some("real")), "{chat}");
    assert_error(
        post(
            addr,
            "/v1/completions",
            &json!({"model": "nope", "prompt": "x", "max_tokens": 1}),
        ),
        404,
        "does not exist",
    );

    // Prefix caching keeps adapters apart: a prompt the base has cached is a miss for an
    // adapter the first time, a hit the second.
    let long = "Tell me about the history of the city of Paris, its rivers, bridges, \
                museums, and the people who built it over many centuries of growth.";
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    complete(addr, MODEL, long, 1);
    assert!(cached(&complete(addr, MODEL, long, 1)).is_some_and(|n| n > 0));
    assert_eq!(cached(&complete(addr, "real", long, 1)), None);
    assert!(cached(&complete(addr, "real", long, 1)).is_some_and(|n| n > 0));

    // Runtime load: each bad input is its own 4xx naming the problem.
    let load = |body: Value| post(addr, "/v1/load_lora_adapter", &body);
    assert_error(load(json!({"lora_path": "/x"})), 400, "lora_name");
    assert_error(load(json!({"lora_name": "n"})), 400, "lora_path");
    assert_error(
        load(json!({"lora_name": "real", "lora_path": a.other.to_string_lossy()})),
        400,
        "already been loaded",
    );
    assert_error(
        load(json!({"lora_name": MODEL, "lora_path": a.other.to_string_lossy()})),
        400,
        "base model",
    );
    let missing = dir.0.join("missing");
    assert_error(
        load(json!({"lora_name": "m", "lora_path": missing.to_string_lossy()})),
        404,
        "no adapter",
    );
    let corrupt = make_adapter(&dir.0.join("corrupt"), &["--rank", "2", "--layers", "1"]);
    std::fs::write(
        corrupt.join("adapter_model.safetensors"),
        b"not safetensors",
    )
    .unwrap();
    assert_error(
        load(json!({"lora_name": "c", "lora_path": corrupt.to_string_lossy()})),
        400,
        "safetensors",
    );
    let high = make_adapter(&dir.0.join("high"), &["--rank", "16", "--layers", "1"]);
    assert_error(
        load(json!({"lora_name": "h", "lora_path": high.to_string_lossy()})),
        400,
        "max-lora-rank",
    );
    // Tensors of rank 4 under a config that says 2: the shapes do not match.
    let bad = make_adapter(&dir.0.join("shape"), &["--rank", "4", "--layers", "1"]);
    let cfg = std::fs::read_to_string(bad.join("adapter_config.json")).unwrap();
    std::fs::write(
        bad.join("adapter_config.json"),
        cfg.replace("\"r\": 4", "\"r\": 2"),
    )
    .unwrap();
    assert_error(
        load(json!({"lora_name": "s", "lora_path": bad.to_string_lossy()})),
        400,
        "shape",
    );
    assert_error(
        post(addr, "/v1/load_lora_adapter", &json!("not an object")),
        400,
        "",
    );
    // The engine still serves, and none of those was registered.
    complete(addr, MODEL, "Hello", 2);
    let (_, body) = request(addr, "GET", "/v1/models", b"");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["data"]
            .as_array()
            .unwrap()
            .len(),
        3
    );

    // A good load, timed; it serves at once; a fourth adapter exceeds --max-cpu-loras.
    let started = Instant::now();
    let (s, text) = load(json!({"lora_name": "other", "lora_path": a.other.to_string_lossy()}));
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
    assert_eq!(s, 200, "{text}");
    assert!(
        text.as_str()
            .unwrap_or_default()
            .contains("added successfully"),
        "{text}"
    );
    eprintln!("runtime adapter load over HTTP: {load_ms:.1} ms");
    complete(addr, "other", prompt, 2);
    assert_error(
        load(json!({"lora_name": "fourth", "lora_path": a.other.to_string_lossy()})),
        400,
        "max-cpu-loras",
    );

    // --max-loras 1: while a request for `real` runs, one for `other` waits, and the
    // metric says so.
    let stream = long_stream(addr, "real");
    wait_for("running adapter in the metric", || {
        lora_info(addr).is_some_and(|l| l.contains(r#"running_lora_adapters="real""#))
    });
    let waiter = std::thread::spawn(move || complete(addr, "other", "Hello", 3));
    wait_for("waiting adapter in the metric", || {
        lora_info(addr).is_some_and(|l| l.contains(r#"waiting_lora_adapters="other""#))
    });
    let info = lora_info(addr).unwrap();
    assert!(info.contains(r#"max_lora="1""#), "{info}");
    assert!(
        !waiter.is_finished(),
        "the other adapter's request did not wait"
    );
    // The base model needs no slot.
    complete(addr, MODEL, "Hi", 2);

    // Unloading the adapter in use is refused (after a short wait), naming the reason.
    let unload = |name: &str| post(addr, "/v1/unload_lora_adapter", &json!({"lora_name": name}));
    assert_error(unload("real"), 400, "in use");
    // Once its request is gone the waiter runs and the adapter unloads.
    drop(stream);
    let done = waiter.join().expect("waiter");
    assert_eq!(done["model"], "other");
    let (s, text) = unload("real");
    assert_eq!(s, 200, "{text}");
    assert!(text
        .as_str()
        .unwrap_or_default()
        .contains("removed successfully"));
    assert_error(unload("real"), 404, "cannot be found");
    assert_error(
        post(addr, "/v1/unload_lora_adapter", &json!({})),
        400,
        "lora_name",
    );
    assert_error(
        post(
            addr,
            "/v1/completions",
            &json!({"model": "real", "prompt": "x", "max_tokens": 1}),
        ),
        404,
        "does not exist",
    );
    wait_for("the metric to drop the finished adapters", || {
        lora_info(addr).is_some_and(|l| l.contains(r#"running_lora_adapters="""#))
    });
}

/// Runtime loads read only under `--lora-dir`: a path outside, existing or not, earns one
/// and the same 400 naming the rule, with nothing of the file in it; a GGUF-looking file
/// inside that is not one is named without its bytes or a backtrace.
#[test]
fn runtime_loads_read_only_under_lora_dir_and_refusals_carry_nothing_of_the_file() {
    let a = adapters();
    let allowed = TempDir::new("allowed");
    let outside = TempDir::new("outside");
    let inside = allowed.0.join("inside");
    copy_dir(&a.other, &inside);
    let secret = outside.0.join("secret");
    std::fs::write(&secret, b"root:$6$hash:19000:0:99999:7:::").unwrap();
    let addr = common::serve(&EngineOptions {
        num_blocks: Some(64),
        lora: Some(LoraOptions {
            max_cpu_loras: Some(4),
            dirs: vec![allowed.0.clone()],
            ..LoraOptions::default()
        }),
        ..EngineOptions::default()
    });
    let load = |name: &str, path: &Path| {
        post(
            addr,
            "/v1/load_lora_adapter",
            &json!({"lora_name": name, "lora_path": path.to_string_lossy()}),
        )
    };
    let refusals: Vec<(u16, Value)> = [
        secret.clone(),
        outside.0.join("no-such-file"),
        PathBuf::from("/etc/shadow"),
        PathBuf::from("/etc/passwd"),
        allowed.0.join("../outside/secret"),
        inside.join("../../outside/secret"),
    ]
    .iter()
    .map(|p| load("x", p))
    .collect();
    for (s, v) in &refusals {
        assert_eq!(*s, 400, "{v}");
        assert_eq!(v, &refusals[0].1, "every refusal is the same answer");
        let text = v.to_string();
        assert!(text.contains("--lora-dir"), "{text}");
        assert!(!text.contains("root") && !text.contains("magic"), "{text}");
    }
    // Inside: loads and serves; nothing there is a 404; a junk file is named without
    // its bytes and without a backtrace.
    let (s, _) = load("inside", &inside);
    assert_eq!(s, 200);
    assert_eq!(complete(addr, "inside", "Hello", 2)["model"], "inside");
    let (s, v) = load("m", &allowed.0.join("missing"));
    assert_eq!(s, 404, "{v}");
    let junk = allowed.0.join("junk.gguf");
    std::fs::write(&junk, b"root:x:0:0:root:/root:/bin/bash").unwrap();
    let (s, v) = load("j", &junk);
    let text = v.to_string();
    assert_eq!(s, 400, "{text}");
    assert!(text.contains("not a GGUF file"), "{text}");
    assert!(!text.contains("0x") && !text.contains("root:") && !text.contains("backtrace"));
    assert!(!text.contains("\\n"), "one line, no frames: {text}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn lora_is_refused_clearly_when_off_and_bad_start_up_adapters_stop_the_load() {
    let a = adapters();
    let addr = common::serve(&EngineOptions {
        num_blocks: Some(64),
        ..EngineOptions::default()
    });
    assert_error(
        post(
            addr,
            "/v1/load_lora_adapter",
            &json!({"lora_name": "a", "lora_path": a.real.to_string_lossy()}),
        ),
        400,
        "--enable-lora",
    );
    let (_, page) = request(addr, "GET", "/metrics", b"");
    assert!(!page.contains("vllm:lora_requests_info{"));
    let bad = LoraOptions {
        max_lora_rank: 4,
        modules: vec![LoraModule {
            name: "real".into(),
            path: a.real.to_string_lossy().into_owned(),
        }],
        ..LoraOptions::default()
    };
    let err = server::load(&EngineOptions {
        model_path: common::model_path(),
        model_name: MODEL.into(),
        num_blocks: Some(16),
        lora: Some(bad),
        ..EngineOptions::default()
    })
    .err()
    .expect("a rank-8 adapter under --max-lora-rank 4 stops the start-up");
    assert!(err.to_string().contains("max-lora-rank"), "{err}");
}

#[test]
fn kv_events_name_the_adapter_of_stored_blocks() {
    let events = server::to_kv_events(
        vec![
            PoolEvent::Stored {
                hash: [1; 32],
                parent: None,
                tokens: vec![1, 2],
                lora: Some(BlockLora {
                    id: 3,
                    name: "sql".into(),
                }),
            },
            // The base model's block after it starts a new event even though it chains.
            PoolEvent::Stored {
                hash: [2; 32],
                parent: Some([1; 32]),
                tokens: vec![3, 4],
                lora: None,
            },
        ],
        2,
    );
    assert_eq!(events.len(), 2);
    match &events[0] {
        KvEvent::BlockStored {
            lora_id, lora_name, ..
        } => assert_eq!((lora_id, lora_name.as_deref()), (&Some(3), Some("sql"))),
        other => panic!("{other:?}"),
    }
    match &events[1] {
        KvEvent::BlockStored {
            lora_id, lora_name, ..
        } => assert_eq!((lora_id, lora_name), (&None, &None)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn openai_python_sdk_chats_through_two_adapters() {
    let a = adapters();
    let addr = common::serve(&EngineOptions {
        num_blocks: Some(128),
        lora: Some(LoraOptions {
            max_loras: 2,
            max_lora_rank: 8,
            max_cpu_loras: None,
            dirs: Vec::new(),
            modules: vec![
                LoraModule {
                    name: "real".into(),
                    path: a.real.to_string_lossy().into_owned(),
                },
                LoraModule {
                    name: "zero".into(),
                    path: a.zero.to_string_lossy().into_owned(),
                },
            ],
        }),
        ..EngineOptions::default()
    });
    let out = Command::new("python3")
        .arg(workspace_root().join("tests/openai_lora.py"))
        .arg(format!("http://{addr}/v1"))
        .args([MODEL, "real", "zero"])
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai LoRA checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

/// The GGUF name of a projection's weight, as llama.cpp's converter writes it.
fn gguf_stem(m: strata_engine::lora::Module) -> &'static str {
    use strata_engine::lora::Module::*;
    match m {
        Q => "attn_q",
        K => "attn_k",
        V => "attn_v",
        O => "attn_output",
        Gate => "ffn_gate",
        Up => "ffn_up",
        Down => "ffn_down",
    }
}

/// Writes `adapter` as a llama.cpp GGUF LoRA adapter (its `B` rows are already in the
/// GGUF order, as the converter leaves them) with the given metadata type.
fn write_gguf_adapter(adapter: &LoraAdapter, path: &Path, general_type: &str, alpha: f32) {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let mut tensors = Vec::new();
    for (layer, m) in adapter.targets() {
        let p = adapter.pair(layer, m).unwrap();
        let a = Tensor::from_vec(p.a.clone(), (adapter.rank, p.inp), &Device::Cpu).unwrap();
        let b = Tensor::from_vec(p.b.clone(), (p.out, adapter.rank), &Device::Cpu).unwrap();
        let stem = format!("blk.{layer}.{}.weight", gguf_stem(m));
        tensors.push((
            format!("{stem}.lora_a"),
            QTensor::quantize(&a, GgmlDType::F32).unwrap(),
        ));
        tensors.push((
            format!("{stem}.lora_b"),
            QTensor::quantize(&b, GgmlDType::F32).unwrap(),
        ));
    }
    let (gt, at, arch, al) = (
        Value::String(general_type.into()),
        Value::String("lora".into()),
        Value::String("llama".into()),
        Value::F32(alpha),
    );
    let md: Vec<(&str, &Value)> = vec![
        ("general.type", &gt),
        ("adapter.type", &at),
        ("general.architecture", &arch),
        ("adapter.lora.alpha", &al),
    ];
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &ts).unwrap();
}

#[test]
fn a_gguf_adapter_loads_as_the_same_peft_adapter_and_bad_ones_are_named() {
    let a = adapters();
    let dir = TempDir::new("gguf");
    let file = strata_engine::gguf::GgufFile::open(&common::model_path()).expect("model");
    let cfg = strata_engine::model::config::read(&file).expect("config").0;
    let peft = LoraAdapter::load("p", &a.real, &cfg, 16).expect("peft");
    let path = dir.0.join("real.gguf");
    write_gguf_adapter(&peft, &path, "adapter", 16.0);
    let gguf = LoraAdapter::load("g", &path, &cfg, 16).expect("gguf adapter");
    assert_eq!((gguf.rank, gguf.scale), (peft.rank, peft.scale));
    let targets: Vec<_> = peft.targets().collect();
    assert_eq!(gguf.targets().collect::<Vec<_>>(), targets);
    for (l, m) in targets {
        let (x, y) = (peft.pair(l, m).unwrap(), gguf.pair(l, m).unwrap());
        assert_eq!((&x.a, &x.b), (&y.a, &y.b), "layer {l} {m:?}");
    }
    // Not an adapter, rank above the limit, not GGUF at all: each a named error.
    let model_file = dir.0.join("model.gguf");
    write_gguf_adapter(&peft, &model_file, "model", 16.0);
    let err = LoraAdapter::load("x", &model_file, &cfg, 16).unwrap_err();
    assert!(err.to_string().contains("not a LoRA adapter"), "{err}");
    let err = LoraAdapter::load("x", &path, &cfg, 4).unwrap_err();
    assert!(err.to_string().contains("max-lora-rank"), "{err}");
    let junk = dir.0.join("junk.gguf");
    std::fs::write(&junk, b"GGUF but not really").unwrap();
    let err = LoraAdapter::load("x", &junk, &cfg, 16).unwrap_err();
    assert!(err.to_string().contains("cannot read"), "{err}");
}
