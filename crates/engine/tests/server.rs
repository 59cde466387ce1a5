//! The engine's HTTP server on a loopback port, in process, on the default model: bad
//! input of every kind gets an OpenAI-shaped 4xx and the server keeps serving; streaming
//! follows the SSE contract; a client that disconnects frees its blocks; metrics count
//! what was sent; batching does not change greedy output.

mod common;

use common::{parse_response, post, request};

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_engine::server::EngineOptions;

/// Starts a server with a small context so that context-limit cases are cheap.
fn start(opts: EngineOptions) -> SocketAddr {
    common::serve(&opts)
}

fn small() -> EngineOptions {
    EngineOptions {
        num_blocks: Some(64),
        max_model_len: Some(512),
        max_body_bytes: 64 * 1024,
        ..EngineOptions::default()
    }
}

fn assert_openai_error(status: u16, body: &str, want_status: u16, want_param: Option<&str>) {
    assert_eq!(status, want_status, "{body}");
    let v: Value = serde_json::from_str(body).expect("error body is JSON");
    let err = &v["error"];
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(err["type"].as_str().is_some(), "{v}");
    assert!(
        err.as_object().expect("object").contains_key("param"),
        "{v}"
    );
    assert!(err.as_object().expect("object").contains_key("code"), "{v}");
    if let Some(p) = want_param {
        assert_eq!(err["param"], p, "{v}");
    }
}

fn metric(addr: SocketAddr, name: &str, label: Option<&str>) -> f64 {
    let (status, text) = request(addr, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.split(['{', ' ']).next() == Some(name) && label.is_none_or(|lb| l.contains(lb))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Gauges are published after each engine step, a moment after the step's responses go
/// out: wait (bounded) for a gauge to reach `want`.
fn settles_to(addr: SocketAddr, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = metric(addr, name, None);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} is {got}, expected {want}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

#[test]
fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let addr = start(small());
    let long_prompt = "word ".repeat(2000);
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> = vec![
        ("malformed json", b"{\"messages\": [".to_vec(), 400, None),
        ("not an object", b"[1,2,3]".to_vec(), 400, None),
        (
            "wrong type",
            chat("hi", json!({"temperature": "hot"}))
                .to_string()
                .into_bytes(),
            400,
            Some("temperature"),
        ),
        (
            "unknown model",
            chat("hi", json!({"model": "gpt-9"}))
                .to_string()
                .into_bytes(),
            404,
            Some("model"),
        ),
        (
            "empty messages",
            json!({"messages": [], "max_tokens": 4})
                .to_string()
                .into_bytes(),
            400,
            Some("messages"),
        ),
        (
            "prompt longer than the context",
            chat(&long_prompt, json!({})).to_string().into_bytes(),
            400,
            Some("messages"),
        ),
        (
            "max_tokens zero",
            chat("hi", json!({"max_tokens": 0}))
                .to_string()
                .into_bytes(),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens beyond the context",
            chat("hi", json!({"max_tokens": 100000}))
                .to_string()
                .into_bytes(),
            400,
            Some("max_tokens"),
        ),
        (
            "invalid utf-8",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
            None,
        ),
        (
            "absurd n",
            chat("hi", json!({"n": 100000})).to_string().into_bytes(),
            400,
            Some("n"),
        ),
        (
            "absurd top_logprobs",
            chat("hi", json!({"logprobs": true, "top_logprobs": 1000}))
                .to_string()
                .into_bytes(),
            400,
            Some("top_logprobs"),
        ),
        (
            "oversized body",
            chat(&"x".repeat(100 * 1024), json!({}))
                .to_string()
                .into_bytes(),
            413,
            None,
        ),
        (
            "stop token out of vocabulary",
            chat("hi", json!({"stop_token_ids": [99999999]}))
                .to_string()
                .into_bytes(),
            400,
            Some("stop_token_ids"),
        ),
    ];
    for (name, body, want, param) in &cases {
        let (status, text) = request(addr, "POST", "/v1/chat/completions", body);
        eprintln!("{name}: {status}");
        assert_openai_error(status, &text, *want, *param);
    }
    let (status, text) = request(
        addr,
        "POST",
        "/v1/completions",
        json!({"prompt": [1, 2, 49152], "max_tokens": 2})
            .to_string()
            .as_bytes(),
    );
    assert_openai_error(status, &text, 400, Some("prompt"));
    let (status, text) = request(addr, "GET", "/v1/nope", b"");
    assert_openai_error(status, &text, 404, None);
    let (status, text) = request(addr, "GET", "/v1/chat/completions", b"");
    assert_openai_error(status, &text, 405, None);

    // Still serving, and nothing leaked into the engine.
    let (status, v) = post(addr, "/v1/chat/completions", &chat("Hello", json!({})));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(request(addr, "GET", "/health", b"").0, 200);
    settles_to(addr, "vllm:num_requests_running", 0.0);
    settles_to(addr, "vllm:kv_cache_usage_perc", 0.0);
}

#[test]
fn streaming_follows_the_sse_contract() {
    let addr = start(small());
    let body = chat(
        "What is the capital of France? Answer in one sentence.",
        json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 12}),
    );
    let (status, text) = request(
        addr,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("every event is a data line")
        })
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["choices"], json!([]));
    let completion = usage["usage"]["completion_tokens"].as_u64().expect("usage");
    assert!(completion > 0 && completion <= 12);
    let finishes: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter(|c| !c["finish_reason"].is_null())
        .collect();
    assert_eq!(finishes.len(), 1, "exactly one finishing chunk");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str())
        .collect();
    // Same as the non-streaming answer.
    let (_, v) = post(
        addr,
        "/v1/chat/completions",
        &chat(
            "What is the capital of France? Answer in one sentence.",
            json!({"max_tokens": 12}),
        ),
    );
    assert_eq!(v["choices"][0]["message"]["content"], text);
    assert!(text.contains("Paris"), "{text}");
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_blocks() {
    let addr = start(small());
    let body = json!({
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": true,
        "stream": true
    })
    .to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut buf = [0u8; 4096];
    let mut got = 0;
    while got < 600 {
        got += s.read(&mut buf).expect("read stream");
    }
    assert!(metric(addr, "vllm:num_requests_running", None) >= 1.0);
    assert!(metric(addr, "vllm:kv_cache_usage_perc", None) > 0.0);
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = metric(addr, "vllm:num_requests_running", None);
        let kv = metric(addr, "vllm:kv_cache_usage_perc", None);
        if running == 0.0 && kv == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still running={running} kv={kv} after the client left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        metric(
            addr,
            "vllm:request_success_total",
            Some("finished_reason=\"abort\"")
        ),
        1.0
    );
    let generated = metric(addr, "vllm:generation_tokens_total", None);
    assert!(generated < 400.0, "generation went on: {generated} tokens");
}

#[test]
fn metrics_count_what_was_sent() {
    let addr = start(small());
    let mut prompt_total = 0;
    let mut completion_total = 0;
    for (i, max) in [3u64, 5, 7].into_iter().enumerate() {
        let (status, v) = post(
            addr,
            "/v1/completions",
            &json!({"prompt": format!("Count to {i}:"), "max_tokens": max, "ignore_eos": true}),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], max);
        prompt_total += v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
        completion_total += max;
    }
    assert_eq!(
        metric(addr, "vllm:prompt_tokens_total", None),
        prompt_total as f64
    );
    assert_eq!(
        metric(addr, "vllm:generation_tokens_total", None),
        completion_total as f64
    );
    assert_eq!(
        metric(
            addr,
            "vllm:request_success_total",
            Some("finished_reason=\"length\"")
        ),
        3.0
    );
    assert_eq!(
        metric(addr, "vllm:time_to_first_token_seconds_count", None),
        3.0
    );
    assert_eq!(
        metric(addr, "vllm:inter_token_latency_seconds_count", None),
        (completion_total - 3) as f64
    );
    assert_eq!(
        metric(addr, "vllm:e2e_request_latency_seconds_count", None),
        3.0
    );
    let (_, text) = request(addr, "GET", "/metrics", b"");
    assert!(
        text.contains("vllm:cache_config_info{")
            && text.contains("block_size=\"16\"")
            && text.contains("num_gpu_blocks=\"64\""),
        "{text}"
    );
    assert!(text.contains("model_name=\"smollm2-135m-instruct\""));
}

#[test]
fn greedy_output_is_the_same_alone_and_among_32_others() {
    let addr = start(EngineOptions {
        num_blocks: Some(512),
        ..EngineOptions::default()
    });
    let prompts: Vec<String> = (0..33)
        .map(|i| format!("Write a short sentence about the number {i}."))
        .collect();
    let body =
        |p: &str| json!({"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    // Three requests run alone, then again in one batch with all 33.
    let targets = [0, 16, 32];
    let alone: Vec<Value> = targets
        .iter()
        .map(|&i| post(addr, "/v1/completions", &body(&prompts[i])).1)
        .collect();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let b = body(p);
            std::thread::spawn(move || post(addr, "/v1/completions", &b).1)
        })
        .collect();
    let together: Vec<Value> = handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect();
    for (a, &i) in alone.iter().zip(&targets) {
        assert_eq!(a["usage"]["completion_tokens"], 16);
        assert_eq!(
            a["choices"][0]["text"], together[i]["choices"][0]["text"],
            "prompt {i} changed in a batch"
        );
    }
}

#[test]
fn tokenize_detokenize_models_and_version() {
    let addr = start(small());
    let (status, v) = post(addr, "/tokenize", &json!({"prompt": "Hello world"}));
    assert_eq!(status, 200, "{v}");
    let tokens = v["tokens"].as_array().expect("tokens").clone();
    assert_eq!(v["count"], tokens.len());
    assert_eq!(v["max_model_len"], 512);
    let (status, d) = post(addr, "/detokenize", &json!({"tokens": tokens}));
    assert_eq!(status, 200);
    assert_eq!(d["prompt"], "Hello world");
    let (status, v) = post(
        addr,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true}),
    );
    assert_eq!(status, 200);
    assert_eq!(v["tokens"][0], 1, "ChatML starts with <|im_start|>");
    let (status, text) = request(addr, "GET", "/v1/models", b"");
    assert_eq!(status, 200);
    let m: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(m["data"][0]["id"], "smollm2-135m-instruct");
    let (status, _) = request(addr, "GET", "/version", b"");
    assert_eq!(status, 200);
    let (status, text) = request(addr, "POST", "/v1/embeddings", b"{\"input\": \"x\"}");
    assert_openai_error(status, &text, 400, Some("model"));
}

#[test]
fn a_repeated_prefix_is_served_from_the_cache() {
    let addr = start(EngineOptions {
        num_blocks: Some(128),
        ..EngineOptions::default()
    });
    let system = "You are a careful assistant. ".repeat(40);
    let ask = |q: &str| {
        json!({
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "max_tokens": 4,
            "temperature": 0
        })
    };
    let (status, first) = post(addr, "/v1/chat/completions", &ask("What is 2+2?"));
    assert_eq!(status, 200, "{first}");
    assert!(first["usage"]["prompt_tokens_details"].is_null(), "{first}");
    let (_, second) = post(addr, "/v1/chat/completions", &ask("What is 3+3?"));
    let prompt = second["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt tokens");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached tokens reported");
    // The shared system prompt is most of the prompt; only whole blocks are shared.
    assert!(
        cached >= prompt - 32 && cached % 16 == 0,
        "{cached} of {prompt}"
    );
    assert_eq!(
        metric(addr, "vllm:prefix_cache_hits_total", None),
        cached as f64
    );
    let queries = metric(addr, "vllm:prefix_cache_queries_total", None);
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().expect("prompt");
    assert_eq!(queries, (first_prompt + prompt) as f64);
    // Same answer whether the prefix came from the cache or not.
    let (_, again) = post(addr, "/v1/chat/completions", &ask("What is 2+2?"));
    assert_eq!(
        again["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    // Reset: the cache is emptied, and the next request finds nothing.
    let (status, _) = request(addr, "POST", "/reset_prefix_cache", b"");
    assert_eq!(status, 200);
    let (_, cold) = post(addr, "/v1/chat/completions", &ask("What is 2+2?"));
    assert!(cold["usage"]["prompt_tokens_details"].is_null(), "{cold}");
}

#[test]
fn preemption_under_kv_pressure_finishes_every_request_with_the_same_output() {
    // 12 blocks of 16 tokens: four requests of ~75 tokens each cannot all fit at once.
    let addr = start(EngineOptions {
        num_blocks: Some(12),
        ..EngineOptions::default()
    });
    let body = |i: usize| {
        json!({
            "prompt": format!("Story number {i}: once upon a time, in a land far away,"),
            "max_tokens": 60,
            "ignore_eos": true,
            "temperature": 0
        })
    };
    let alone: Vec<Value> = (0..4)
        .map(|i| post(addr, "/v1/completions", &body(i)).1)
        .collect();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let b = body(i);
            std::thread::spawn(move || post(addr, "/v1/completions", &b))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, v) = h.join().expect("client thread");
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 60);
        assert_eq!(
            v["choices"][0]["text"], alone[i]["choices"][0]["text"],
            "request {i} changed under preemption"
        );
    }
    assert!(
        metric(addr, "vllm:num_preemptions_total", None) > 0.0,
        "the workload was meant to preempt"
    );
    settles_to(addr, "vllm:kv_cache_usage_perc", 0.0);
    settles_to(addr, "vllm:num_requests_running", 0.0);
}

#[test]
fn requests_that_cannot_fit_or_overflow_the_queue_are_refused_cleanly() {
    // 8 blocks of 16 tokens: nothing longer than 128 tokens can ever be cached.
    let addr = start(EngineOptions {
        num_blocks: Some(8),
        max_num_seqs: 1,
        max_waiting: 1,
        ..EngineOptions::default()
    });
    let (status, text) = request(
        addr,
        "POST",
        "/v1/completions",
        json!({"prompt": "word ".repeat(200), "max_tokens": 4})
            .to_string()
            .as_bytes(),
    );
    assert_openai_error(status, &text, 400, Some("prompt"));
    let (status, text) = request(
        addr,
        "POST",
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 200})
            .to_string()
            .as_bytes(),
    );
    assert_openai_error(status, &text, 400, Some("max_tokens"));

    // One running, one waiting: further requests are shed with 429 and Retry-After.
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": true}).to_string();
    let handles: Vec<_> = (0..6)
        .map(|_| {
            let b = body.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(120)))
                    .expect("timeout");
                write!(
                    s,
                    "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{b}",
                    b.len()
                )
                .expect("send");
                let mut raw = Vec::new();
                s.read_to_end(&mut raw).expect("read");
                String::from_utf8_lossy(&raw).into_owned()
            })
        })
        .collect();
    let responses: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().expect("client"))
        .collect();
    let shed: Vec<&String> = responses
        .iter()
        .filter(|r| r.starts_with("HTTP/1.1 429"))
        .collect();
    let served = responses
        .iter()
        .filter(|r| r.starts_with("HTTP/1.1 200"))
        .count();
    assert!(!shed.is_empty(), "nothing was shed");
    assert_eq!(served + shed.len(), 6, "{responses:?}");
    for r in shed {
        assert!(r.to_ascii_lowercase().contains("retry-after: "), "{r}");
        let (_, body) = parse_response(r.as_bytes());
        assert_openai_error(429, &body, 429, None);
    }
    settles_to(addr, "vllm:kv_cache_usage_perc", 0.0);
}

/// Twelve requests at once into a batch of four: while they run, the gauges never claim
/// more than was sent or allowed; afterwards every counter and histogram count equals what
/// the requests themselves report.
#[test]
fn metrics_under_concurrent_load_match_what_was_sent() {
    let addr = start(EngineOptions {
        max_num_seqs: 4,
        ..small()
    });
    let n = 12u64;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let (mut max_running, mut max_in_system, mut busy_scrapes) = (0f64, 0f64, 0);
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let running = metric(addr, "vllm:num_requests_running", None);
                let waiting = metric(addr, "vllm:num_requests_waiting", None);
                max_running = max_running.max(running);
                max_in_system = max_in_system.max(running + waiting);
                if running > 0.0 {
                    busy_scrapes += 1;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (max_running, max_in_system, busy_scrapes)
        })
    };
    let clients: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                let max = 4 + i % 7;
                let (status, v) = post(
                    addr,
                    "/v1/completions",
                    &json!({"prompt": format!("Request number {i} says:"), "max_tokens": max,
                            "ignore_eos": true, "temperature": 0}),
                );
                assert_eq!(status, 200, "{v}");
                assert_eq!(v["usage"]["completion_tokens"], max);
                let prompt = v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
                (prompt, max)
            })
        })
        .collect();
    let sent: Vec<(u64, u64)> = clients
        .into_iter()
        .map(|c| c.join().expect("client"))
        .collect();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let (max_running, max_in_system, busy_scrapes) = sampler.join().expect("sampler");
    assert!(busy_scrapes > 0, "no scrape saw a running request");
    assert!(max_running <= 4.0, "running {max_running} > max_num_seqs");
    assert!(
        max_in_system <= n as f64,
        "{max_in_system} requests in the system"
    );

    let prompt_total: u64 = sent.iter().map(|s| s.0).sum();
    let output_total: u64 = sent.iter().map(|s| s.1).sum();
    let itl_total: u64 = sent.iter().map(|s| s.1 - 1).sum();
    let nf = n as f64;
    assert_eq!(
        metric(addr, "vllm:prompt_tokens_total", None),
        prompt_total as f64
    );
    assert_eq!(
        metric(addr, "vllm:generation_tokens_total", None),
        output_total as f64
    );
    assert_eq!(metric(addr, "vllm:num_preemptions_total", None), 0.0);
    assert_eq!(
        metric(addr, "vllm:prefix_cache_queries_total", None),
        prompt_total as f64
    );
    assert_eq!(
        metric(
            addr,
            "vllm:request_success_total",
            Some("finished_reason=\"length\"")
        ),
        nf
    );
    for h in [
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_time_per_output_token_seconds",
    ] {
        assert_eq!(metric(addr, &format!("{h}_count"), None), nf, "{h}");
        // The +Inf bucket holds every observation.
        assert_eq!(
            metric(addr, &format!("{h}_bucket"), Some("le=\"+Inf\"")),
            nf,
            "{h}"
        );
    }
    assert_eq!(
        metric(addr, "vllm:inter_token_latency_seconds_count", None),
        itl_total as f64
    );
    // Twelve requests through four slots: at least eight waited a whole request's time.
    assert!(metric(addr, "vllm:request_queue_time_seconds_sum", None) > 0.0);
    settles_to(addr, "vllm:num_requests_running", 0.0);
    settles_to(addr, "vllm:num_requests_waiting", 0.0);
    settles_to(addr, "vllm:kv_cache_usage_perc", 0.0);
}
