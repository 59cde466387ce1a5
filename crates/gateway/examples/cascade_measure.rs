//! Cascade measurement on a labelled prompt set (`bench/cascade_prompts.jsonl`), with the
//! models this machine can serve: Strata's engine loaded twice in process with the same
//! SmolLM2-135M-Instruct file, as two "models" that differ in cost:
//! * `small`: the file's own 4-bit blocks (the engine's default, fast);
//! * `large`: the same weights dequantized to f32 (`WeightFormat::F32`, the exact reference
//!   mode, slower), priced ten times higher.
//!
//! So the two are the same network at two precisions, not two sizes: what the run shows is
//! how the cascade decides (who answered, why, what it cost against always asking the
//! large model), and what the labels say about those decisions; it cannot show a quality
//! gain from a bigger model. Each prompt goes through the gateway to the cascade `auto`
//! and, for the baseline, straight to `large`; greedy decoding, `max_tokens` 48.
//!
//!   cargo run --release -p strata-gateway --example cascade_measure -- \
//!     [bench/cascade_prompts.jsonl] [path/to/smollm2-135m-instruct.gguf]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use strata_engine::model::WeightFormat;
use strata_engine::server::{self as engine, EngineOptions};
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::{Config, ConfigHandle, CreateKey, Gateway, GatewayOptions};

const MAX_TOKENS: u64 = 48;
/// USD per 1M tokens (input, output): illustrative, in a 1:10 ratio.
const SMALL_PRICE: (f64, f64) = (0.05, 0.20);
const LARGE_PRICE: (f64, f64) = (0.50, 2.00);

fn serve(path: PathBuf, weights: WeightFormat) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let opts = EngineOptions {
            model_path: path,
            model_name: "smollm2-135m-instruct".into(),
            weights,
            ..EngineOptions::default()
        };
        let loaded = engine::load(&opts).expect("load the model");
        let app = engine::router(loaded.state.clone());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(l.local_addr().expect("addr")).expect("send");
            let _keep = loaded;
            let _ = axum::serve(l, app).await;
        });
    });
    format!("http://{}", rx.recv().expect("engine address"))
}

fn cost(usage: &Value, price: (f64, f64)) -> f64 {
    let n = |k: &str| usage[k].as_f64().unwrap_or(0.0);
    (n("prompt_tokens") * price.0 + n("completion_tokens") * price.1) / 1e6
}

fn passes(answer: &str, expect: &[Value]) -> bool {
    let a = answer.to_lowercase();
    expect
        .iter()
        .filter_map(Value::as_str)
        .any(|e| a.contains(&e.to_lowercase()))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let prompts = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "bench/cascade_prompts.jsonl".into());
    let model = args.get(2).map(PathBuf::from).unwrap_or_else(|| {
        strata_engine::model_cache::ModelCache::from_env().path_of("smollm2-135m-instruct")
    });
    let set: Vec<Value> = std::fs::read_to_string(&prompts)
        .expect("read the prompt set")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let small = serve(model.clone(), WeightFormat::Gguf);
    let large = serve(model, WeightFormat::F32);
    let yaml = format!(
        r#"
upstreams:
  - {{name: small-engine, base_url: "{small}"}}
  - {{name: large-engine, base_url: "{large}"}}
models:
  - name: small
    targets: [{{upstream: small-engine, model: smollm2-135m-instruct}}]
    price: {{input_per_1m: {}, output_per_1m: {}}}
    timeout_ms: 300000
    try_timeout_ms: 300000
  - name: large
    targets: [{{upstream: large-engine, model: smollm2-135m-instruct}}]
    price: {{input_per_1m: {}, output_per_1m: {}}}
    timeout_ms: 300000
    try_timeout_ms: 300000
  - name: auto
    cascade:
      models: [small, large]
      escalate_prompt_chars: 400
      escalate_patterns: ["(?i)\\b(prove|derive|step by step|write (a|an) (program|function|essay))\\b"]
      min_mean_logprob: -1.0
limits: {{default_key: {{rpm: 100000, tpm: 100000000}}}}
"#,
        SMALL_PRICE.0, SMALL_PRICE.1, LARGE_PRICE.0, LARGE_PRICE.1
    );
    let config = Config::from_yaml(&yaml).expect("config");
    let store = Arc::new(SqliteStore::in_memory().expect("store"));
    let gw = Gateway::new(
        Arc::new(ConfigHandle::fixed(config).expect("config")),
        store,
        GatewayOptions {
            admin_key: Some("bench".into()),
            seed: Some(1),
            ..Default::default()
        },
    )
    .expect("gateway");
    let (key, _) = gw
        .create_key(CreateKey {
            tenant: "bench".into(),
            ..Default::default()
        })
        .expect("key");
    let running = strata_gateway::spawn(gw, "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("serve");
    let url = format!("{}/v1/chat/completions", running.url());
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");

    let mut rows = Vec::new();
    let started = Instant::now();
    for p in &set {
        let body = |model: &str| {
            json!({"model": model, "temperature": 0, "max_tokens": MAX_TOKENS,
                   "messages": [{"role": "user", "content": p["prompt"]}]})
        };
        let resp = client
            .post(&url)
            .bearer_auth(&key)
            .json(&body("auto"))
            .send()
            .await
            .expect("cascade request");
        let cascade = resp
            .headers()
            .get("x-strata-cascade")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let v: Value = resp.json().await.expect("cascade answer");
        let answer = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let direct: Value = client
            .post(&url)
            .bearer_auth(&key)
            .json(&body("large"))
            .send()
            .await
            .expect("large request")
            .json()
            .await
            .expect("large answer");
        let large_answer = direct["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("");
        let expect = p["expect"].as_array().cloned().unwrap_or_default();
        let (by, reason) = cascade.split_once(';').unwrap_or((&cascade, ""));
        let row = json!({
            "id": p["id"], "label": p["label"], "answered_by": by, "reason": reason,
            "cascade_pass": passes(&answer, &expect),
            "large_pass": passes(large_answer, &expect),
            "large_cost_usd": cost(&direct["usage"], LARGE_PRICE),
            "answer": answer.chars().take(80).collect::<String>(),
        });
        println!("{row}");
        rows.push(row);
    }
    // The cascade's cost as charged: every try, from the ledger (the baseline's rows are
    // the `large` ones sent directly, so they are subtracted).
    running.gateway.flush_usage();
    let usage = running
        .gateway
        .store
        .usage(&Default::default())
        .expect("usage");
    let mut by_model: BTreeMap<String, i64> = BTreeMap::new();
    for u in &usage {
        *by_model.entry(u.model.clone()).or_default() += u.cost_micros;
    }
    let always_large: f64 = rows
        .iter()
        .map(|r| r["large_cost_usd"].as_f64().unwrap_or(0.0))
        .sum();
    let total: f64 = by_model.values().sum::<i64>() as f64 / 1e6;
    let cascade_cost = total - always_large;
    let mut summary: BTreeMap<String, Value> = BTreeMap::new();
    for label in ["easy", "hard"] {
        let mine: Vec<&Value> = rows.iter().filter(|r| r["label"] == label).collect();
        let count = |f: &dyn Fn(&Value) -> bool| mine.iter().filter(|r| f(r)).count();
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        for r in &mine {
            *reasons
                .entry(format!(
                    "{};{}",
                    r["answered_by"].as_str().unwrap_or(""),
                    r["reason"].as_str().unwrap_or("")
                ))
                .or_default() += 1;
        }
        summary.insert(
            label.into(),
            json!({
                "prompts": mine.len(),
                "answered_by_small": count(&|r| r["answered_by"] == "small"),
                "answered_by_large": count(&|r| r["answered_by"] == "large"),
                "by_model_and_reason": reasons,
                "cascade_keyword_pass": count(&|r| r["cascade_pass"] == true),
                "large_keyword_pass": count(&|r| r["large_pass"] == true),
            }),
        );
    }
    println!(
        "{}",
        json!({
            "summary": summary,
            "cost_usd": {"cascade_all_tries": cascade_cost, "always_large": always_large,
                         "ledger_by_model": by_model},
            "seconds": started.elapsed().as_secs_f64(),
        })
    );
    running.shutdown().await;
}
