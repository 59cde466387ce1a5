//! Driver for `bench/gateway_vs_litellm.sh`: a fast fixed-response backend, the gateway,
//! and an HTTP load generator, in one binary so the benchmark needs nothing else.
//!
//! * `gateway_bench [--workers N] <command>`: N tokio worker threads (default 2).
//! * `gateway_bench mock --port P` serves `strata-mock` (model `m`, 4 tokens, no delay).
//! * `gateway_bench gateway <gateway flags>` runs `strata gateway` (same flags).
//! * `gateway_bench load --url U --key K [--rate R | --concurrency C] --seconds S` sends
//!   chat completions and prints one JSON line: requests, errors, achieved req/s and
//!   latency percentiles in ms. With `--rate` arrivals are open-loop at R req/s (latency
//!   is measured from the scheduled send time, so queueing counts); without it, C workers
//!   send back to back (maximum throughput).

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    /// Tokio worker threads (`bench/gateway_overhead.sh` pins the gateway to one core and
    /// gives it one worker).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Mock {
        #[arg(long, default_value_t = 9100)]
        port: u16,
    },
    Gateway(strata_gateway::GatewayArgs),
    Load {
        #[arg(long)]
        url: String,
        #[arg(long, default_value = "")]
        key: String,
        #[arg(long, default_value = "m")]
        model: String,
        #[arg(long)]
        rate: Option<f64>,
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Two workers each by default: the benchmark machine has two cores shared by every
    // process.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.workers.max(1))
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cli.cmd {
            Cmd::Mock { port } => {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
                let _mock = strata_mock::MockEngine::serve(
                    strata_mock::MockConfig {
                        model: "m".into(),
                        output_tokens: 4,
                        ..Default::default()
                    },
                    listener,
                )?;
                eprintln!("mock listening on 127.0.0.1:{port}");
                tokio::signal::ctrl_c().await?;
                Ok(())
            }
            Cmd::Gateway(args) => strata_gateway::run(args).await,
            Cmd::Load {
                url,
                key,
                model,
                rate,
                concurrency,
                seconds,
            } => load(url, key, model, rate, concurrency, seconds).await,
        }
    })
}

async fn load(
    url: String,
    key: String,
    model: String,
    rate: Option<f64>,
    concurrency: usize,
    seconds: f64,
) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(4096)
        .build()?;
    let body = bytes::Bytes::from(serde_json::to_vec(&serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in four words."}],
        "max_tokens": 4,
    }))?);
    let endpoint = format!("{}/v1/chat/completions", url.trim_end_matches('/'));
    let one = {
        let client = client.clone();
        let endpoint = endpoint.clone();
        let key = key.clone();
        move || {
            let mut rb = client
                .post(&endpoint)
                .header("content-type", "application/json")
                .body(body.clone());
            if !key.is_empty() {
                rb = rb.bearer_auth(&key);
            }
            async move {
                match rb.send().await {
                    Ok(r) => {
                        let ok = r.status().is_success();
                        let drained = r.bytes().await.is_ok();
                        ok && drained
                    }
                    Err(_) => false,
                }
            }
        }
    };
    // Warm the connection pool.
    for _ in 0..50 {
        one().await;
    }
    let duration = Duration::from_secs_f64(seconds);
    let lat = Arc::new(parking_lot::Mutex::new(Vec::<f64>::new()));
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    match rate {
        Some(r) => {
            let interval = Duration::from_secs_f64(1.0 / r);
            let mut tasks = tokio::task::JoinSet::new();
            let mut n = 0u64;
            loop {
                let at = started + interval.mul_f64(n as f64);
                if at.duration_since(started) >= duration {
                    break;
                }
                tokio::time::sleep_until(at.into()).await;
                let req = one();
                let lat = lat.clone();
                let errors = errors.clone();
                tasks.spawn(async move {
                    let ok = req.await;
                    let ms = at.elapsed().as_secs_f64() * 1e3;
                    if ok {
                        lat.lock().push(ms);
                    } else {
                        errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                n += 1;
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        }
        None => {
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..concurrency {
                let one = one.clone();
                let lat = lat.clone();
                let errors = errors.clone();
                tasks.spawn(async move {
                    while started.elapsed() < duration {
                        let t = Instant::now();
                        if one().await {
                            lat.lock().push(t.elapsed().as_secs_f64() * 1e3);
                        } else {
                            errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut v = lat.lock().clone();
    v.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| {
        if v.is_empty() {
            f64::NAN
        } else {
            v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
        }
    };
    println!(
        "{}",
        serde_json::json!({
            "requests": v.len(),
            "errors": errors.load(std::sync::atomic::Ordering::Relaxed),
            "rps": v.len() as f64 / elapsed,
            "p50_ms": pct(0.50),
            "p90_ms": pct(0.90),
            "p99_ms": pct(0.99),
        })
    );
    Ok(())
}
