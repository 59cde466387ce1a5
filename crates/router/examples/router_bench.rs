//! Helpers for `bench/router_overhead.sh`: fast mock backends, the Strata router, and a
//! small load generator (open-loop at a fixed rate, or closed-loop for max req/s).
//!
//! ```text
//! router_bench mock --ports 19001,19002
//! router_bench router --port 18080 --endpoints http://127.0.0.1:19001,http://127.0.0.1:19002
//! router_bench load --url http://127.0.0.1:18080 --rate 2000 --secs 10
//! router_bench load --url http://127.0.0.1:18080 --conc 64 --secs 10
//! ```
//!
//! `load` prints one JSON line: requests sent, ok, errors, achieved req/s and latency
//! percentiles in milliseconds (open-loop latencies count from the scheduled send time,
//! so a stalled target cannot hide queueing).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve fast mock engines (model `m`, 8 tokens, no delays) on these ports.
    Mock {
        #[arg(long, value_delimiter = ',')]
        ports: Vec<u16>,
    },
    /// Run the Strata router.
    Router(Box<strata_router::RouterArgs>),
    /// Send chat completions and report latency and throughput.
    Load {
        #[arg(long)]
        url: String,
        /// Open-loop requests per second (omit for closed-loop with `--conc` workers).
        #[arg(long)]
        rate: Option<f64>,
        #[arg(long, default_value_t = 64)]
        conc: usize,
        #[arg(long, default_value_t = 10.0)]
        secs: f64,
        /// Label copied into the output line.
        #[arg(long, default_value = "")]
        label: String,
    },
    /// The shared-prefix workload (BENCHMARKS.md): `groups` system prompts, each followed
    /// by `per_group` short questions, sent interleaved across groups; reports TTFT and
    /// output tokens/s from streamed `/v1/completions`.
    SharedPrefix {
        #[arg(long)]
        url: String,
        #[arg(long, default_value = "m")]
        model: String,
        #[arg(long, default_value_t = 8)]
        groups: usize,
        #[arg(long, default_value_t = 8)]
        per_group: usize,
        /// Words of each system prompt (about one token each).
        #[arg(long, default_value_t = 400)]
        system_words: usize,
        #[arg(long, default_value_t = 8)]
        question_words: usize,
        #[arg(long, default_value_t = 16)]
        max_tokens: u32,
        #[arg(long, default_value_t = 4)]
        conc: usize,
        #[arg(long, default_value = "")]
        label: String,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let threads = match &cli.cmd {
        Cmd::Mock { .. } => 1,
        _ => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cli.cmd {
            Cmd::Mock { ports } => mock(ports).await,
            Cmd::Router(args) => strata_router::run(*args).await,
            Cmd::Load {
                url,
                rate,
                conc,
                secs,
                label,
            } => load(url, rate, conc, Duration::from_secs_f64(secs), label).await,
            Cmd::SharedPrefix {
                url,
                model,
                groups,
                per_group,
                system_words,
                question_words,
                max_tokens,
                conc,
                label,
            } => {
                let prompts =
                    shared_prefix_prompts(&label, groups, per_group, system_words, question_words);
                shared_prefix(url, model, prompts, max_tokens, conc, label).await
            }
        }
    })
}

async fn mock(ports: Vec<u16>) -> anyhow::Result<()> {
    let mut mocks = Vec::new();
    for port in ports {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let m = strata_mock::MockEngine::serve(
            strata_mock::MockConfig {
                model: "m".into(),
                output_tokens: 8,
                ..Default::default()
            },
            listener,
        )?;
        eprintln!("mock on {}", m.url());
        mocks.push(m);
    }
    tokio::signal::ctrl_c().await?;
    Ok(())
}

const BODY: &str = r#"{"model":"m","messages":[{"role":"user","content":"Say hello to the benchmark."}],"max_tokens":8}"#;

async fn one(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    uri: &str,
) -> bool {
    let req = match hyper::Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
    {
        Ok(r) => r,
        Err(_) => return false,
    };
    match client.request(req).await {
        Ok(resp) => {
            let ok = resp.status().is_success();
            ok && resp.into_body().collect().await.is_ok()
        }
        Err(_) => false,
    }
}

async fn load(
    url: String,
    rate: Option<f64>,
    conc: usize,
    secs: Duration,
    label: String,
) -> anyhow::Result<()> {
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build_http::<Full<Bytes>>();
    let uri: Arc<str> = format!("{}/v1/chat/completions", url.trim_end_matches('/')).into();
    // Warm up connections.
    for _ in 0..conc.min(64) {
        one(&client, &uri).await;
    }
    let start = Instant::now();
    let mut lat: Vec<Duration> = Vec::new();
    let mut errors = 0u64;
    let mode;
    match rate {
        Some(rate) => {
            mode = "rate";
            let n = (rate * secs.as_secs_f64()) as u64;
            let period = Duration::from_secs_f64(1.0 / rate);
            let mut set = tokio::task::JoinSet::new();
            for i in 0..n {
                let due = start + period.mul_f64(i as f64);
                tokio::time::sleep_until(due.into()).await;
                let (c, u) = (client.clone(), uri.clone());
                set.spawn(async move {
                    let ok = one(&c, &u).await;
                    (ok, due.elapsed())
                });
                while let Some(Ok((ok, d))) = set.try_join_next() {
                    if ok {
                        lat.push(d)
                    } else {
                        errors += 1
                    }
                }
            }
            while let Some(r) = set.join_next().await {
                match r {
                    Ok((true, d)) => lat.push(d),
                    _ => errors += 1,
                }
            }
        }
        None => {
            mode = "max";
            let deadline = start + secs;
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..conc {
                let (c, u) = (client.clone(), uri.clone());
                set.spawn(async move {
                    let mut l = Vec::new();
                    let mut e = 0u64;
                    while Instant::now() < deadline {
                        let t = Instant::now();
                        if one(&c, &u).await {
                            l.push(t.elapsed());
                        } else {
                            e += 1;
                        }
                    }
                    (l, e)
                });
            }
            while let Some(r) = set.join_next().await {
                if let Ok((l, e)) = r {
                    lat.extend(l);
                    errors += e;
                }
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    lat.sort();
    let p = |q: f64| {
        lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    };
    println!(
        "{}",
        serde_json::json!({
            "label": label, "mode": mode, "rate": rate, "conc": conc,
            "ok": lat.len(), "errors": errors, "secs": elapsed,
            "rps": lat.len() as f64 / elapsed,
            "p50_ms": p(0.5), "p90_ms": p(0.9), "p99_ms": p(0.99), "max_ms": p(1.0),
        })
    );
    Ok(())
}

const WORDS: &[&str] = &[
    "river", "stone", "cloud", "paper", "garden", "silver", "window", "market", "forest", "engine",
    "candle", "orange", "planet", "bridge", "winter", "letter", "harbor", "meadow", "violin",
    "tunnel", "lantern", "copper", "island", "mirror", "pocket", "saddle", "thunder", "velvet",
    "walnut", "yellow",
];

/// Deterministic prompts: request `i` belongs to group `i % groups`. `run` is written into
/// each system prompt so that runs never share prefixes through a warm engine cache.
fn shared_prefix_prompts(
    run: &str,
    groups: usize,
    per_group: usize,
    system_words: usize,
    question_words: usize,
) -> Vec<String> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut word = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        WORDS[(state % WORDS.len() as u64) as usize]
    };
    let systems: Vec<String> = (0..groups)
        .map(|g| {
            let body: Vec<&str> = (0..system_words).map(|_| word()).collect();
            format!("[{run}] System prompt {g}: {}.", body.join(" "))
        })
        .collect();
    (0..groups * per_group)
        .map(|i| {
            let q: Vec<&str> = (0..question_words).map(|_| word()).collect();
            format!(
                "{}\nQuestion {i}: {}?\nAnswer:",
                systems[i % groups],
                q.join(" ")
            )
        })
        .collect()
}

async fn shared_prefix(
    url: String,
    model: String,
    prompts: Vec<String>,
    max_tokens: u32,
    conc: usize,
    label: String,
) -> anyhow::Result<()> {
    use futures_util::StreamExt;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let uri: Arc<str> = format!("{}/v1/completions", url.trim_end_matches('/')).into();
    let queue = Arc::new(std::sync::Mutex::new(
        prompts
            .into_iter()
            .collect::<std::collections::VecDeque<_>>(),
    ));
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conc {
        let (client, uri, queue, model) =
            (client.clone(), uri.clone(), queue.clone(), model.clone());
        set.spawn(async move {
            let mut out: Vec<(f64, u64)> = Vec::new();
            let mut errors = 0u64;
            // The guard must not live across the request: pop in a function of its own.
            let next = || queue.lock().ok().and_then(|mut q| q.pop_front());
            while let Some(prompt) = next() {
                let body = serde_json::json!({
                    "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
                });
                let req = hyper::Request::post(&*uri)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body.to_string())));
                let Ok(req) = req else {
                    errors += 1;
                    continue;
                };
                let t = Instant::now();
                let Ok(resp) = client.request(req).await else {
                    errors += 1;
                    continue;
                };
                if !resp.status().is_success() {
                    errors += 1;
                    continue;
                }
                let mut data = resp.into_body().into_data_stream();
                let mut ttft = None;
                let mut tokens = 0u64;
                let mut buf = String::new();
                while let Some(Ok(chunk)) = data.next().await {
                    if ttft.is_none() {
                        ttft = Some(t.elapsed().as_secs_f64());
                    }
                    buf.push_str(&String::from_utf8_lossy(&chunk));
                }
                for line in buf.lines().filter_map(|l| l.strip_prefix("data: ")) {
                    if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                            tokens = n;
                        }
                    }
                }
                match ttft {
                    Some(x) => out.push((x, tokens)),
                    None => errors += 1,
                }
            }
            (out, errors)
        });
    }
    let mut ttfts = Vec::new();
    let (mut tokens, mut errors) = (0u64, 0u64);
    while let Some(r) = set.join_next().await {
        if let Ok((o, e)) = r {
            errors += e;
            for (t, n) in o {
                ttfts.push(t);
                tokens += n;
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    ttfts.sort_by(f64::total_cmp);
    let p = |q: f64| {
        ttfts
            .get(((ttfts.len() as f64 * q) as usize).min(ttfts.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!(
        "{}",
        serde_json::json!({
            "label": label, "requests": ttfts.len(), "errors": errors, "wall_s": wall,
            "ttft_p50_s": p(0.5), "ttft_p90_s": p(0.9), "output_tok_s": tokens as f64 / wall,
        })
    );
    Ok(())
}
