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
    Router(strata_router::RouterArgs),
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
            Cmd::Router(args) => strata_router::run(args).await,
            Cmd::Load {
                url,
                rate,
                conc,
                secs,
                label,
            } => load(url, rate, conc, Duration::from_secs_f64(secs), label).await,
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
