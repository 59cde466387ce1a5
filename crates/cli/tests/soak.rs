//! Soak: a real `strata engine` process under a bounded mixed workload on loopback, with a
//! KV cache small enough that requests are preempted all the time. Every accepted request
//! must finish (or end when its client leaves), bad ones must get their 400s, and at the end
//! no KV block is still held, nothing is queued or running, and the resident set did not
//! keep growing after warm-up.
//!
//! `STRATA_SOAK_SECS` sets the load duration (default 60; use a few minutes by hand).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{http, start_engine_with};
use serde_json::{json, Value};

const WORDS: &[&str] = &[
    "river", "stone", "cloud", "paper", "green", "quiet", "metal", "north", "table", "light",
    "sugar", "winter", "garden", "music", "copper", "engine", "bridge", "forest", "signal",
    "window", "orange", "silver", "planet", "letter",
];

/// xorshift64*: the test's own seeded randomness (no clock, reproducible per thread).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// `base` words and up to `spread - 1` more.
    fn some_words(&mut self, base: u64, spread: u64) -> String {
        let n = base + self.below(spread);
        self.words(n)
    }
    fn words(&mut self, n: u64) -> String {
        (0..n)
            .map(|_| WORDS[self.below(WORDS.len() as u64) as usize])
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[derive(Default)]
struct Tally {
    completed: AtomicU64,
    streamed: AtomicU64,
    abandoned: AtomicU64,
    rejected: AtomicU64,
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    metric_with(addr, name, "")
}

/// Sums the samples of `name` whose line contains `label`.
fn metric_with(addr: SocketAddr, name: &str, label: &str) -> f64 {
    let (status, text) = http(addr, "GET", "/metrics", "").expect("scrape /metrics");
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Sends a streamed request and reads `keep` data events (all of them when `None`);
/// returns the raw text read.
fn stream(addr: SocketAddr, path: &str, body: &Value, keep: Option<usize>) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let body = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).expect("read stream");
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if let Some(k) = keep {
            if String::from_utf8_lossy(&out).matches("data: ").count() >= k {
                break; // hang up mid-stream
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn client(addr: SocketAddr, seed: u64, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    let mut rng = Rng(seed);
    let system = Rng(7).words(220);
    while !stop.load(Ordering::SeqCst) {
        match rng.below(6) {
            0 => {
                let max = 4 + rng.below(20);
                let prompt = rng.some_words(5, 120);
                let body = json!({"prompt": prompt, "max_tokens": max, "ignore_eos": true});
                let (status, text) =
                    http(addr, "POST", "/v1/completions", &body.to_string()).expect("answer");
                assert_eq!(status, 200, "{text}");
                let v: Value = serde_json::from_str(&text).expect("json");
                assert_eq!(v["usage"]["completion_tokens"], max, "{text}");
                tally.completed.fetch_add(1, Ordering::SeqCst);
            }
            1 => {
                let body = json!({
                    "messages": [{"role": "user", "content": rng.some_words(10, 60)}],
                    "max_tokens": 4 + rng.below(16), "stream": true,
                    "stream_options": {"include_usage": true}
                });
                let text = stream(addr, "/v1/chat/completions", &body, None);
                assert!(text.starts_with("HTTP/1.1 200"), "{text}");
                assert!(text.contains("data: [DONE]"), "{text}");
                assert!(text.contains("\"finish_reason\":\""), "{text}");
                tally.streamed.fetch_add(1, Ordering::SeqCst);
            }
            2 => {
                let body = json!({"prompt": rng.words(40), "max_tokens": 64, "stream": true,
                                  "ignore_eos": true});
                let text = stream(addr, "/v1/completions", &body, Some(2));
                assert!(text.starts_with("HTTP/1.1 200"), "{text}");
                tally.abandoned.fetch_add(1, Ordering::SeqCst);
            }
            3 => {
                // Shared system prompt: prefix-cache hits and shared blocks under pressure.
                let body = json!({
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": rng.some_words(5, 20)}],
                    "max_tokens": 4 + rng.below(8), "ignore_eos": true
                });
                let (status, text) =
                    http(addr, "POST", "/v1/chat/completions", &body.to_string()).expect("answer");
                assert_eq!(status, 200, "{text}");
                tally.completed.fetch_add(1, Ordering::SeqCst);
            }
            4 => {
                let (status, text) =
                    http(addr, "POST", "/v1/completions", "{\"prompt\": [1, 2,").expect("answer");
                assert_eq!(status, 400, "{text}");
                tally.rejected.fetch_add(1, Ordering::SeqCst);
            }
            _ => {
                // Longer than --max-model-len.
                let body = json!({"prompt": rng.words(700), "max_tokens": 4});
                let (status, text) =
                    http(addr, "POST", "/v1/completions", &body.to_string()).expect("answer");
                assert_eq!(status, 400, "{text}");
                assert!(text.contains("\"error\""), "{text}");
                tally.rejected.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

#[test]
fn soak_under_kv_pressure_leaks_no_blocks_and_keeps_rss_flat() {
    let secs: u64 = std::env::var("STRATA_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    // 40 blocks of 16 tokens: six clients with prompts of up to ~350 tokens do not fit.
    let engine = start_engine_with(&[
        "--num-blocks",
        "40",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
    ]);
    let addr = engine.addr;
    let pid = engine.child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let samples: Arc<Mutex<Vec<(f64, u64)>>> = Arc::default();
    let started = Instant::now();
    let sampler = {
        let (stop, samples) = (stop.clone(), samples.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if let Some(kib) = rss_kib(pid) {
                    let t = started.elapsed().as_secs_f64();
                    samples.lock().expect("samples").push((t, kib));
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };
    // A burst first: three long requests whose prompts fit together but whose outputs do
    // not, so that running sequences are preempted whatever the machine's speed.
    let burst: Vec<_> = (0..3u64)
        .map(|i| {
            std::thread::spawn(move || {
                let prompt = Rng(100 + i).words(250);
                let body = json!({"prompt": prompt, "max_tokens": 96, "ignore_eos": true});
                let (status, text) =
                    http(addr, "POST", "/v1/completions", &body.to_string()).expect("answer");
                assert_eq!(status, 200, "{text}");
                let v: Value = serde_json::from_str(&text).expect("json");
                assert_eq!(v["usage"]["completion_tokens"], 96, "{text}");
            })
        })
        .collect();
    for b in burst {
        b.join().expect("a burst request failed");
    }
    let clients: Vec<_> = (0..6)
        .map(|i| {
            let (stop, tally) = (stop.clone(), tally.clone());
            std::thread::spawn(move || client(addr, 0x9e37_79b9 + i, stop, tally))
        })
        .collect();
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().expect("a client saw a wrong answer");
    }
    sampler.join().expect("sampler");

    // Nothing held, queued or running once the clients are gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (usage, running, waiting) = (
            metric(addr, "vllm:kv_cache_usage_perc"),
            metric(addr, "vllm:num_requests_running"),
            metric(addr, "vllm:num_requests_waiting"),
        );
        if usage == 0.0 && running == 0.0 && waiting == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the soak: kv usage {usage}, running {running}, waiting {waiting}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let preemptions = metric(addr, "vllm:num_preemptions_total");
    let aborted = metric_with(
        addr,
        "vllm:request_success_total",
        "finished_reason=\"abort\"",
    );
    let completed = tally.completed.load(Ordering::SeqCst);
    let streamed = tally.streamed.load(Ordering::SeqCst);
    let abandoned = tally.abandoned.load(Ordering::SeqCst);
    let rejected = tally.rejected.load(Ordering::SeqCst);
    eprintln!(
        "soak {secs} s: {completed} completed, {streamed} streamed, {abandoned} abandoned, \
         {rejected} rejected, {preemptions} preemptions, {aborted} aborts"
    );
    assert!(completed > 0 && streamed > 0 && abandoned > 0 && rejected > 0);
    assert!(
        preemptions > 0.0,
        "the soak never put the KV cache under pressure"
    );

    // The engine still answers after the soak.
    let body = json!({"prompt": "Still there?", "max_tokens": 3, "ignore_eos": true});
    let (status, text) = http(addr, "POST", "/v1/completions", &body.to_string()).expect("answer");
    assert_eq!(status, 200, "{text}");

    // Flat RSS: the peak of the last quarter is within 5% (or 8 MiB) of the peak of the
    // second quarter, after allocator and cache warm-up.
    let samples = samples.lock().expect("samples");
    let span = samples.last().map_or(0.0, |s| s.0);
    let peak = |from: f64, to: f64| {
        samples
            .iter()
            .filter(|s| s.0 >= from * span && s.0 <= to * span)
            .map(|s| s.1)
            .max()
            .unwrap_or(0)
    };
    let (warm, end) = (peak(0.25, 0.5), peak(0.75, 1.0));
    eprintln!(
        "RSS peak: {} MiB in the second quarter, {} MiB in the last ({} samples)",
        warm / 1024,
        end / 1024,
        samples.len()
    );
    assert!(warm > 0 && end > 0, "no RSS samples");
    let allowed = (warm / 20).max(8 * 1024);
    assert!(
        end <= warm + allowed,
        "RSS grew from {warm} KiB to {end} KiB during the soak"
    );
}
