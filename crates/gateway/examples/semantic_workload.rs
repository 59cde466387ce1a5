//! Semantic cache against the exact cache alone on a paraphrase-heavy workload (see
//! docs/BENCHMARKS.md).
//!
//! `bench/semantic_paraphrases.jsonl`: 20 questions, five wordings each. The workload draws
//! a question and one of its wordings at random (seeded) per request. Three gateways see the
//! same requests, interleaved (request i goes to each before request i + 1): the exact cache
//! only; exact + semantic at the default threshold 0.9; exact + semantic at 0.8. The
//! embeddings come from Strata's own MiniLM encoder (in process); the chat upstream is a
//! stand-in that answers "answer to: <the question>" after `MODEL_MS` (a model's latency),
//! so a semantic hit shows which question it was stored for: a hit for a wording of another
//! question counts as a wrong hit.
//!
//!   cargo run --release -p strata-gateway --example semantic_workload -- [REQUESTS=300]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::{Config, ConfigHandle, CreateKey, Gateway, GatewayOptions};

const MODEL_MS: u64 = 150;

async fn chat_stand_in() -> String {
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(|axum::Json(req): axum::Json<Value>| async move {
            tokio::time::sleep(Duration::from_millis(MODEL_MS)).await;
            let q = req["messages"][0]["content"].as_str().unwrap_or("").to_string();
            axum::Json(json!({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("answer to: {q}")},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}}))
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    url
}

fn encoder() -> String {
    use strata_engine::embed::server as embed_server;
    use strata_engine::model_cache::{ModelCache, EMBEDDING_MODEL};
    let dir = ModelCache::from_env().path_of(EMBEDDING_MODEL);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let opts = strata_engine::server::EngineOptions {
            model_path: dir,
            model_name: EMBEDDING_MODEL.into(),
            ..Default::default()
        };
        let loaded = embed_server::load(&opts)
            .expect("load the encoder (strata model pull all-minilm-l6-v2)");
        let app = embed_server::router(loaded.state.clone());
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
    format!("http://{}", rx.recv().expect("encoder address"))
}

async fn gateway(
    chat: &str,
    embed: &str,
    semantic: Option<f32>,
) -> (strata_gateway::RunningGateway, String) {
    let sem = match semantic {
        Some(t) => {
            format!("  semantic: {{enabled: true, embedding_model: minilm, threshold: {t}}}")
        }
        None => String::new(),
    };
    let yaml = format!(
        "upstreams:\n  - {{name: up, base_url: \"{chat}\"}}\n  - {{name: emb, base_url: \"{embed}\"}}\n\
         models:\n  - name: m\n    targets: [{{upstream: up}}]\n  - name: minilm\n    targets: [{{upstream: emb, model: all-minilm-l6-v2}}]\n\
         limits: {{default_key: {{rpm: 1000000}}}}\ncache:\n  enabled: true\n  ttl_secs: 3600\n{sem}\n"
    );
    let gw = Gateway::new(
        Arc::new(ConfigHandle::fixed(Config::from_yaml(&yaml).expect("config")).expect("config")),
        Arc::new(SqliteStore::in_memory().expect("store")),
        GatewayOptions {
            admin_key: None,
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
    (
        strata_gateway::spawn(gw, "127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("serve"),
        key,
    )
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(300);
    let groups: Vec<Vec<String>> = std::fs::read_to_string("bench/semantic_paraphrases.jsonl")
        .expect("read bench/semantic_paraphrases.jsonl (run from the repository root)")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("a JSON array of strings"))
        .collect();
    let chat = chat_stand_in().await;
    let embed = tokio::task::spawn_blocking(encoder).await.expect("encoder");
    let setups = [
        ("exact only", None),
        ("exact + semantic 0.9", Some(0.9)),
        ("exact + semantic 0.8", Some(0.8)),
    ];
    let mut gws = Vec::new();
    for (_, t) in &setups {
        gws.push(gateway(&chat, &embed, *t).await);
    }
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let mut rng = StdRng::seed_from_u64(17);
    // Per setup: latencies (ms), exact hits, semantic hits, wrong semantic hits.
    let mut stats: Vec<(Vec<f64>, usize, usize, usize)> = vec![(Vec::new(), 0, 0, 0); setups.len()];
    for _ in 0..n {
        let g = rng.random_range(0..groups.len());
        let q = &groups[g][rng.random_range(0..groups[g].len())];
        let body = json!({"model": "m", "temperature": 0, "max_tokens": 16,
                          "messages": [{"role": "user", "content": q}]});
        for (i, (gw, key)) in gws.iter().enumerate() {
            let t = Instant::now();
            let resp = client
                .post(format!("{}/v1/chat/completions", gw.url()))
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .expect("request");
            let outcome = resp
                .headers()
                .get("x-strata-cache")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let v: Value = resp.json().await.expect("answer");
            stats[i].0.push(t.elapsed().as_secs_f64() * 1e3);
            let answer = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
            match outcome.as_str() {
                "hit" => stats[i].1 += 1,
                "semantic" => {
                    stats[i].2 += 1;
                    let from = answer.trim_start_matches("answer to: ");
                    if !groups[g].iter().any(|w| w == from) {
                        stats[i].3 += 1;
                    }
                }
                _ => {}
            }
        }
    }
    for ((name, _), (lat, exact, sem, wrong)) in setups.iter().zip(stats.iter_mut()) {
        let mean = lat.iter().sum::<f64>() / lat.len() as f64;
        println!(
            "{}",
            json!({"setup": name, "requests": n, "exact_hits": exact, "semantic_hits": sem,
                   "wrong_semantic_hits": wrong,
                   "hit_rate": (*exact + *sem) as f64 / n as f64,
                   "latency_ms": {"mean": mean, "p50": pct(lat, 0.5), "p90": pct(lat, 0.9), "p99": pct(lat, 0.99)}})
        );
    }
    for (gw, _) in gws {
        gw.shutdown().await;
    }
}
