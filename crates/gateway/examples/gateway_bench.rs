//! Driver for `bench/gateway_overhead.sh` and `bench/gateway_vs_litellm.sh`: a backend,
//! the gateway, and an HTTP load generator, in one binary so the benchmarks need nothing
//! else.
//!
//! * `gateway_bench [--workers N] <command>`: N tokio worker threads (default 2).
//! * `gateway_bench mock --port P` serves `strata-mock` (model `m`, 4 tokens, no delay).
//! * `gateway_bench fixed --port P` serves one fixed chat completion (model `m`, 4 tokens,
//!   with `usage`) to every POST and `ok` to `GET /health`: no timers, no parsing, so a
//!   direct-to-backend baseline measures little but the load generator and the loopback.
//! * `gateway_bench gateway <gateway flags>` runs `strata gateway` (same flags).
//! * `gateway_bench load --url U --key K [--rate R | --concurrency C] --seconds S` sends
//!   chat completions and prints one JSON line: requests, errors, achieved req/s and
//!   latency percentiles in ms.
//!
//! The load generator is built to be measured the same way whatever it points at:
//! * Open loop (`--rate`): a pacing thread sleeps to each send time (`at = start + n/R`,
//!   with the OS's fine-grained sleep rather than the runtime's 1 ms timer) and hands the
//!   time over; latency runs from `at`, the time the request *should* have been sent, to
//!   the last byte of the answer, so a stall anywhere (gateway, backend or the generator
//!   itself) counts for every request it delays (no coordinated omission). `late_p99_ms`
//!   reports how late the sends themselves started: when it is large the generator, not
//!   the system under test, was the bottleneck.
//! * Closed loop (no `--rate`): C workers send back to back (maximum throughput).
//! * hyper's pooled HTTP/1.1 client with `TCP_NODELAY` (the one the router uses); the
//!   request is built from shared bytes; latencies go to a preallocated buffer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{header, HeaderValue, Method, Request};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::{BodyExt, Full};
use strata_router::client::{http_client, HttpClient};

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
    Fixed {
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
        /// The API asked: `chat`, `messages` (Anthropic's), `responses` (OpenAI's, with
        /// `store: false`) or `responses-store` (kept in the gateway's store).
        #[arg(long, default_value = "chat")]
        api: String,
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
            Cmd::Fixed { port } => fixed(port).await,
            Cmd::Gateway(args) => strata_gateway::run(args).await,
            Cmd::Load {
                url,
                key,
                model,
                rate,
                concurrency,
                seconds,
                api,
            } => load(url, key, model, rate, concurrency, seconds, &api).await,
        }
    })
}

/// The fixed answer: what the mock returns for a 4-token chat completion.
const FIXED_ANSWER: &str = r#"{"id":"chatcmpl-fixed","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":" tok tok tok tok"},"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":7,"completion_tokens":4,"total_tokens":11}}"#;

async fn fixed(port: u16) -> anyhow::Result<()> {
    use axum::routing::{get, post};
    async fn answer(_body: Bytes) -> ([(header::HeaderName, HeaderValue); 1], &'static str) {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            FIXED_ANSWER,
        )
    }
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .fallback(post(answer));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    eprintln!("fixed backend listening on 127.0.0.1:{port}");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// One request; true when it got a 2xx and its whole body.
async fn one(
    client: &HttpClient,
    uri: &axum::http::Uri,
    auth: &Option<HeaderValue>,
    body: &Bytes,
) -> bool {
    let mut req = Request::new(Full::new(body.clone()));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = uri.clone();
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(a) = auth {
        req.headers_mut().insert(header::AUTHORIZATION, a.clone());
    }
    let exchange = async {
        match client.request(req).await {
            Ok(resp) => {
                let ok = resp.status().is_success();
                let drained = resp.into_body().collect().await.is_ok();
                ok && drained
            }
            Err(_) => false,
        }
    };
    // A request that never finishes counts as an error instead of stalling the run.
    tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .unwrap_or(false)
}

/// The longest one request may take before it counts as an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Latencies (ms) of finished requests, and errors.
struct Record {
    lat: parking_lot::Mutex<Vec<f64>>,
    errors: AtomicU64,
    /// `(send time since start, latency)` of every request, in ms, when
    /// `GATEWAY_BENCH_TRACE` names a file to write them to (for finding stalls).
    trace: Option<parking_lot::Mutex<Vec<(f64, f64)>>>,
}

impl Record {
    fn note(&self, ok: bool, ms: f64) {
        if ok {
            self.lat.lock().push(ms);
        } else {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        f64::NAN
    } else {
        sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
    }
}

async fn load(
    url: String,
    key: String,
    model: String,
    rate: Option<f64>,
    concurrency: usize,
    seconds: f64,
    api: &str,
) -> anyhow::Result<()> {
    let client = http_client(Duration::from_secs(5))?;
    let prompt = "Say hello in four words.";
    let (path, body) = match api {
        "chat" => (
            "/v1/chat/completions",
            serde_json::json!({"model": model, "max_tokens": 4,
                "messages": [{"role": "user", "content": prompt}]}),
        ),
        "messages" => (
            "/v1/messages",
            serde_json::json!({"model": model, "max_tokens": 4,
                "messages": [{"role": "user", "content": prompt}]}),
        ),
        "responses" | "responses-store" => (
            "/v1/responses",
            serde_json::json!({"model": model, "max_output_tokens": 4, "input": prompt,
                "store": api == "responses-store"}),
        ),
        other => {
            anyhow::bail!("unknown --api {other}: chat, messages, responses or responses-store")
        }
    };
    let body = Bytes::from(serde_json::to_vec(&body)?);
    let uri: axum::http::Uri = format!("{}{path}", url.trim_end_matches('/')).parse()?;
    let auth = if key.is_empty() {
        None
    } else {
        Some(HeaderValue::from_str(&format!("Bearer {key}"))?)
    };
    let ctx = Arc::new((client, uri, auth, body));
    // Warm the connection pool (several connections, as the measured run will use).
    let mut warm = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let ctx = ctx.clone();
        warm.spawn(async move {
            for _ in 0..8 {
                one(&ctx.0, &ctx.1, &ctx.2, &ctx.3).await;
            }
        });
    }
    while warm.join_next().await.is_some() {}

    let duration = Duration::from_secs_f64(seconds);
    let expected = rate.map_or(1 << 20, |r| (r * seconds) as usize + 16);
    let trace_path = std::env::var_os("GATEWAY_BENCH_TRACE");
    let rec = Arc::new(Record {
        lat: parking_lot::Mutex::new(Vec::with_capacity(expected)),
        errors: AtomicU64::new(0),
        trace: trace_path
            .as_ref()
            .map(|_| parking_lot::Mutex::new(Vec::with_capacity(expected))),
    });
    let mut late = Vec::new();
    let started = Instant::now();
    match rate {
        Some(r) => {
            // Pacing on its own thread: precise sleeps, send times handed to the runtime.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
            let interval = Duration::from_secs_f64(1.0 / r);
            let pacer = std::thread::spawn(move || {
                let mut n = 0u32;
                loop {
                    let at = started + interval * n;
                    if at.duration_since(started) >= duration {
                        break;
                    }
                    let now = Instant::now();
                    if at > now {
                        std::thread::sleep(at - now);
                    }
                    if tx.send(at).is_err() {
                        break;
                    }
                    n += 1;
                }
            });
            let mut tasks = tokio::task::JoinSet::new();
            late.reserve(expected);
            while let Some(at) = rx.recv().await {
                // Lateness as seen by the runtime (pacer and hand-over together).
                late.push(at.elapsed().as_secs_f64() * 1e3);
                let ctx = ctx.clone();
                let rec = rec.clone();
                tasks.spawn(async move {
                    let ok = one(&ctx.0, &ctx.1, &ctx.2, &ctx.3).await;
                    let ms = at.elapsed().as_secs_f64() * 1e3;
                    rec.note(ok, ms);
                    if let Some(t) = &rec.trace {
                        t.lock().push(((at - started).as_secs_f64() * 1e3, ms));
                    }
                });
                while tasks.try_join_next().is_some() {}
            }
            let _ = pacer.join();
            while tasks.join_next().await.is_some() {}
        }
        None => {
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..concurrency {
                let ctx = ctx.clone();
                let rec = rec.clone();
                tasks.spawn(async move {
                    while started.elapsed() < duration {
                        let t = Instant::now();
                        let ok = one(&ctx.0, &ctx.1, &ctx.2, &ctx.3).await;
                        rec.note(ok, t.elapsed().as_secs_f64() * 1e3);
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let (Some(path), Some(t)) = (trace_path, &rec.trace) {
        let mut t = std::mem::take(&mut *t.lock());
        t.sort_by(|a, b| a.0.total_cmp(&b.0));
        let text: String = t.iter().map(|(a, l)| format!("{a:.3} {l:.3}\n")).collect();
        std::fs::write(path, text)?;
    }
    let mut v = std::mem::take(&mut *rec.lat.lock());
    v.sort_by(|a, b| a.total_cmp(b));
    late.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{}",
        serde_json::json!({
            "requests": v.len(),
            "errors": rec.errors.load(Ordering::Relaxed),
            "rps": v.len() as f64 / elapsed,
            "p50_ms": percentile(&v, 0.50),
            "p90_ms": percentile(&v, 0.90),
            "p99_ms": percentile(&v, 0.99),
            "p999_ms": percentile(&v, 0.999),
            "late_p99_ms": if late.is_empty() { serde_json::Value::Null } else { percentile(&late, 0.99).into() },
        })
    );
    Ok(())
}
