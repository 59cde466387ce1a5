//! Prompt-lookup speculative decoding on the default model, through the HTTP server in
//! process: greedy output is identical with and without speculation, alone and batched;
//! seeded sampling gives the same tokens (so the same statistics over seeds); rejected
//! proposals give their KV blocks back, under preemption too; the `vllm:spec_decode_*`
//! counters count what happened; and the default, measured row prices change nothing of
//! that.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_engine::server::EngineOptions;
use strata_engine::spec_decode::SpeculativeConfig;

const MODEL: &str = "smollm2-135m-instruct";

fn start(opts: EngineOptions) -> SocketAddr {
    common::serve(&opts)
}

fn exchange(addr: SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(common::READ_TIMEOUT))
        .expect("timeout");
    s.write_all(head.as_bytes()).expect("write");
    s.write_all(body).expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    common::parse_response(&raw)
}

/// One chat completion; returns the text and the completion token count.
fn complete(addr: SocketAddr, body: &Value) -> (String, u64) {
    let body = body.to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let (status, text) = exchange(addr, &head, body.as_bytes());
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().expect("usage"),
    )
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let head = "GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n";
    let (status, text) = exchange(addr, head, b"");
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Gauges are published after each step: wait (bounded) for one to reach `want`.
fn settles_to(addr: SocketAddr, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = metric(addr, name);
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

/// vLLM's example configuration, with rows priced at nothing so that the adaptive policy
/// proposes in batched steps too (the default prices rows as a CPU does and mostly stops
/// proposing in large batches), and verification is exercised everywhere.
fn spec() -> Option<SpeculativeConfig> {
    Some(
        SpeculativeConfig::parse(
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2, "row_cost": 0.0}"#,
        )
        .expect("config"),
    )
}

fn opts(num_blocks: usize, speculative: Option<SpeculativeConfig>) -> EngineOptions {
    EngineOptions {
        num_blocks: Some(num_blocks),
        max_model_len: Some(1024),
        speculative,
        ..EngineOptions::default()
    }
}

/// Prompts whose answers repeat their input (copying, editing) and ones that do not.
fn prompts() -> Vec<String> {
    let para = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, \
                and the fox runs into the forest to find its friends.";
    vec![
        format!("Copy this text exactly, word for word:\n{para}"),
        "Rename the variable x to total in this code and print the result:\n\
         def add(x, y):\n    x = x + y\n    return x\n\nprint(add(1, 2))"
            .to_string(),
        "List the numbers from 1 to 20, separated by commas.".to_string(),
        format!("Summarize in one sentence, quoting it: {para}"),
        "What is the capital of France?".to_string(),
        "Write a haiku about winter.".to_string(),
    ]
}

fn chat(prompt: &str, temperature: f64, seed: u64, max_tokens: u64) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
    })
}

/// Every body, all at once; outputs in the bodies' order.
fn concurrently(addr: SocketAddr, bodies: &[Value]) -> Vec<String> {
    let handles: Vec<_> = bodies
        .iter()
        .cloned()
        .map(|b| std::thread::spawn(move || complete(addr, &b).0))
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("request"))
        .collect()
}

#[test]
fn greedy_output_is_identical_with_and_without_speculation_alone_and_batched() {
    let plain = start(opts(512, None));
    let fast = start(opts(512, spec()));
    let bodies: Vec<Value> = prompts().iter().map(|p| chat(p, 0.0, 0, 96)).collect();
    for b in &bodies {
        let (want, _) = complete(plain, b);
        let (got, _) = complete(fast, b);
        assert_eq!(got, want, "alone: {b}");
    }
    let want = concurrently(plain, &bodies);
    let got = concurrently(fast, &bodies);
    assert_eq!(got, want, "batched");

    // Speculation happened, and acceptance is counted per position.
    let drafts = metric(fast, "vllm:spec_decode_num_drafts_total");
    let proposed = metric(fast, "vllm:spec_decode_num_draft_tokens_total");
    let accepted = metric(fast, "vllm:spec_decode_num_accepted_tokens_total");
    let per_pos = metric(fast, "vllm:spec_decode_num_accepted_tokens_per_pos_total");
    assert!(
        drafts > 0.0 && accepted > 0.0,
        "{drafts} drafts, {accepted} accepted"
    );
    assert!(accepted <= proposed && proposed <= 4.0 * drafts);
    assert_eq!(per_pos, accepted);
    assert_eq!(metric(plain, "vllm:spec_decode_num_drafts_total"), 0.0);
    println!(
        "acceptance {:.2}, mean acceptance length {:.2}",
        accepted / proposed,
        1.0 + accepted / drafts
    );
    settles_to(fast, "vllm:kv_cache_usage_perc", 0.0);

    // A request that opts out is not speculated on.
    let mut body = bodies[0].clone();
    body["speculative"] = json!(false);
    let (text, _) = complete(fast, &body);
    assert_eq!(text, complete(plain, &bodies[0]).0);
    assert_eq!(metric(fast, "vllm:spec_decode_num_drafts_total"), drafts);
}

#[test]
fn seeded_sampling_gives_the_same_tokens_with_and_without_speculation() {
    let plain = start(opts(512, None));
    let fast = start(opts(512, spec()));
    let prompts = prompts();
    let mut bodies = Vec::new();
    for seed in 0..24u64 {
        let p = &prompts[seed as usize % 4];
        let mut b = chat(p, 0.8, seed, 48);
        if seed % 3 == 0 {
            // Penalties see the accepted proposals as output, exactly as one at a time.
            b["repetition_penalty"] = json!(1.1);
            b["top_k"] = json!(40);
        }
        bodies.push(b);
    }
    let want = concurrently(plain, &bodies);
    let got = concurrently(fast, &bodies);
    // Same seed, same tokens: speculation draws the sampler's own random numbers, one
    // per emitted token, so the distribution over seeds is the same too.
    let mut counts_want = std::collections::BTreeMap::<String, usize>::new();
    let mut counts_got = std::collections::BTreeMap::<String, usize>::new();
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(g, w, "seed {i}");
        for word in w.split_whitespace() {
            *counts_want.entry(word.to_string()).or_default() += 1;
        }
        for word in g.split_whitespace() {
            *counts_got.entry(word.to_string()).or_default() += 1;
        }
    }
    assert_eq!(counts_got, counts_want);
    // Under sampling some proposals were rejected.
    let proposed = metric(fast, "vllm:spec_decode_num_draft_tokens_total");
    let accepted = metric(fast, "vllm:spec_decode_num_accepted_tokens_total");
    assert!(
        proposed > accepted && accepted > 0.0,
        "{proposed} vs {accepted}"
    );
    settles_to(fast, "vllm:kv_cache_usage_perc", 0.0);
}

#[test]
fn rejected_proposals_and_preemption_leave_no_block_behind() {
    // 16 blocks of 16 tokens for 12 concurrent requests of ~100-150 tokens each:
    // running sequences outgrow the cache and are preempted.
    let plain = start(opts(512, None));
    let tight = start(EngineOptions {
        max_model_len: Some(256),
        ..opts(16, spec())
    });
    let prompts = prompts();
    let bodies: Vec<Value> = (0..12)
        .map(|i| chat(&prompts[i % prompts.len()], 0.0, 0, 64))
        .collect();
    let want = concurrently(plain, &bodies);
    let got = concurrently(tight, &bodies);
    assert_eq!(got, want);
    assert!(metric(tight, "vllm:num_preemptions_total") > 0.0);
    let proposed = metric(tight, "vllm:spec_decode_num_draft_tokens_total");
    let accepted = metric(tight, "vllm:spec_decode_num_accepted_tokens_total");
    assert!(
        proposed > accepted,
        "{proposed} vs {accepted}: no rejection"
    );
    settles_to(tight, "vllm:kv_cache_usage_perc", 0.0);
    settles_to(tight, "vllm:num_requests_running", 0.0);
}

#[test]
fn measured_row_prices_keep_outputs_identical() {
    // The default configuration prices rows by timing the engine's own steps: whatever
    // it decides to propose, outputs stay those without speculation, and blocks return.
    let plain = start(opts(512, None));
    let measured = start(opts(512, Some(SpeculativeConfig::default())));
    let prompts = prompts();
    for p in &prompts[..3] {
        let body = chat(p, 0.0, 0, 64);
        assert_eq!(complete(measured, &body), complete(plain, &body), "{p}");
    }
    let bodies: Vec<Value> = prompts.iter().map(|p| chat(p, 0.0, 0, 48)).collect();
    assert_eq!(
        concurrently(measured, &bodies),
        concurrently(plain, &bodies)
    );
    let proposed = metric(measured, "vllm:spec_decode_num_draft_tokens_total");
    let accepted = metric(measured, "vllm:spec_decode_num_accepted_tokens_total");
    assert!(accepted <= proposed, "{accepted} of {proposed}");
    settles_to(measured, "vllm:kv_cache_usage_perc", 0.0);
}
