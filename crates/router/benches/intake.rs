//! Router CPU per request on the way in: the lean intake (`strata_router::intake`) against
//! the validating intake the router had before it (typed parse with `strata-api`, then
//! validation; kept below as `validating`), on chat bodies of 1 KB, 100 KB and 1 MB, for
//! both transports, in one interleaved run.
//!
//! `cargo bench -p strata-router --bench intake -- [ROUNDS] [MS_PER_CELL]` (defaults 5,
//! 300), or `bench/router_intake.sh`.
//!
//! What one request costs, per transport, from a body in memory to what the router hands
//! on (the transport's own socket work is the same for both intakes and is left out):
//! - HTTP: read the view → priority → prefix keys (approximate-index chunk hashes) and the
//!   prompt estimate; the body goes upstream as the same `Bytes`.
//! - ext_proc: Envoy's 62,000-byte chunks buffered → the view → prefix keys → the body
//!   streamed back as `ProcessingResponse` chunks.
//!
//! CPU time is the thread's own (`/proc/thread-self/schedstat`), so other load on the
//! machine inflates it less than wall time. Cells run in turn, old and new alternating
//! order every round; the table shows medians over rounds. Raw lines go to
//! `target/router-bench/intake.jsonl`.

use std::hint::black_box;
use std::io::Write;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use strata_router::config::RouterConfig;
use strata_router::extproc::messages::request_body_chunks;
use strata_router::intake::{self, Incoming};
use strata_router::scheduling::pd::estimate_prompt_tokens;
use strata_router::Router;

/// The router's intake before the lean one: what `proxy.rs` and `extproc/request.rs` did.
mod validating {
    use strata_api::types::ChatCompletionRequest;
    use strata_api::validate::{parse_json, validate_chat};
    use strata_api::ApiError;

    pub struct Parsed {
        pub model: String,
        pub priority: i32,
        pub prefix_text: String,
        pub salt: Option<String>,
        pub own_kv_transfer: bool,
    }

    pub fn parse_chat(body: &[u8]) -> Result<Parsed, ApiError> {
        let req: ChatCompletionRequest = parse_json(body)?;
        let own_kv_transfer = req.kv_transfer_params.is_some();
        let v = validate_chat(req)?;
        let mut prefix_text = String::new();
        for m in &v.messages {
            prefix_text.push_str(m.role.as_str());
            prefix_text.push('\n');
            prefix_text.push_str(&m.content);
            prefix_text.push('\n');
        }
        let model = v.model.unwrap_or_default();
        if model.is_empty() {
            return Err(ApiError::invalid(
                "model",
                "The request body must name a `model`.",
            ));
        }
        Ok(Parsed {
            model,
            priority: v.sampling.priority,
            prefix_text,
            salt: v.sampling.cache_salt,
            own_kv_transfer,
        })
    }
}

/// A chat request of about `size` bytes: a system message and a user message of prose
/// with line breaks, quotes and a few non-ASCII characters (escapes to decode).
fn chat_body(size: usize) -> Bytes {
    let sentence = "The quick brown fox \\\"jumps\\\" over the lazy dog, caf\u{e9} na\u{ef}ve.\\n";
    let text = sentence.repeat(size / sentence.len() + 1);
    let text = &text[..text
        .char_indices()
        .map(|(i, _)| i)
        .take_while(|&i| i <= size.saturating_sub(200))
        .last()
        .unwrap_or(0)];
    // Cut on a whole escape: drop a trailing lone backslash.
    let text = text.trim_end_matches('\\');
    Bytes::from(format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"You are a careful assistant."}},{{"role":"user","content":"{text}"}}],"max_tokens":16,"temperature":0.7,"stream":false}}"#
    ))
}

fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Transport {
    Http,
    ExtProc,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Validating,
    Lean,
}

/// One request through one intake; returns something that depends on all the work.
fn one(router: &Router, t: Transport, v: Variant, body: &Bytes, chunks: &[Bytes]) -> usize {
    let body = match t {
        Transport::Http => body.clone(),
        Transport::ExtProc => {
            let mut buf = BytesMut::new();
            for c in chunks {
                buf.extend_from_slice(c);
            }
            buf.freeze()
        }
    };
    let (model, text_len, blocks, priority) = match v {
        Variant::Validating => {
            let p = validating::parse_chat(&body).expect("valid");
            let blocks = router.approx_blocks(&p.model, &p.prefix_text);
            let est =
                (!p.own_kv_transfer).then(|| estimate_prompt_tokens(p.prefix_text.len(), None));
            black_box((&p.salt, est));
            (p.model, p.prefix_text.len(), blocks, p.priority)
        }
        Variant::Lean => {
            let i = intake::read(
                Incoming {
                    has_body: true,
                    path: "/v1/chat/completions",
                    content_type: Some("application/json"),
                },
                body.clone(),
                intake::limits(router),
                None,
            )
            .expect("routable");
            let blocks = router.approx_blocks(&i.model, &i.view.prefix_text);
            let est = (!i.view.own_kv_transfer)
                .then(|| estimate_prompt_tokens(i.view.prompt_bytes, None));
            black_box((&i.view.salt, est));
            (
                i.model,
                i.view.prompt_bytes,
                blocks,
                i.view.priority.unwrap_or(0),
            )
        }
    };
    let sent = match t {
        Transport::Http => body.len(),
        Transport::ExtProc => request_body_chunks(&body, true).len(),
    };
    black_box((model, priority));
    text_len + blocks.len() + sent
}

/// CPU nanoseconds per request of one cell, over about `ms` of work.
fn cell(router: &Router, t: Transport, v: Variant, body: &Bytes, chunks: &[Bytes], ms: u64) -> f64 {
    let mut n: u64 = 0;
    let started = Instant::now();
    let cpu0 = thread_cpu_ns();
    let mut sink = 0usize;
    while n < 3 || started.elapsed().as_millis() < u128::from(ms) {
        sink = sink.wrapping_add(one(router, t, v, body, chunks));
        n += 1;
    }
    black_box(sink);
    (thread_cpu_ns() - cpu0) as f64 / n as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; the numbers are ours.
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let rounds = args.first().copied().unwrap_or(5).max(1) as usize;
    let ms = args.get(1).copied().unwrap_or(300);
    let router = Router::new(RouterConfig::default()).expect("router");
    let sizes = [1usize << 10, 100 << 10, 1 << 20];
    let bodies: Vec<(usize, Bytes, Vec<Bytes>)> = sizes
        .iter()
        .map(|&s| {
            let b = chat_body(s);
            let chunks = b.chunks(62_000).map(Bytes::copy_from_slice).collect();
            (s, b, chunks)
        })
        .collect();
    // Both intakes agree on what they read.
    for (_, b, _) in &bodies {
        let old = validating::parse_chat(b).expect("valid");
        let new = intake::read(
            Incoming {
                has_body: true,
                path: "/v1/chat/completions",
                content_type: None,
            },
            b.clone(),
            intake::limits(&router),
            None,
        )
        .expect("routable");
        assert_eq!(old.model, new.model);
        assert!(old.prefix_text.starts_with(&new.view.prefix_text));
        assert_eq!(
            router.approx_blocks(&old.model, &old.prefix_text),
            router.approx_blocks(&new.model, &new.view.prefix_text)
        );
    }
    std::fs::create_dir_all("target/router-bench").ok();
    let mut raw = std::fs::File::create("target/router-bench/intake.jsonl").ok();
    let transports = [Transport::Http, Transport::ExtProc];
    let mut results: Vec<((usize, Transport, Variant), Vec<f64>)> = Vec::new();
    for round in 0..rounds {
        let order = if round % 2 == 0 {
            [Variant::Validating, Variant::Lean]
        } else {
            [Variant::Lean, Variant::Validating]
        };
        for (size, body, chunks) in &bodies {
            for t in transports {
                for v in order {
                    let ns = cell(&router, t, v, body, chunks, ms);
                    if let Some(f) = raw.as_mut() {
                        let _ = writeln!(
                            f,
                            r#"{{"round":{round},"bytes":{},"transport":"{t:?}","intake":"{v:?}","cpu_ns_per_request":{ns:.0}}}"#,
                            body.len()
                        );
                    }
                    let key = (*size, t, v);
                    match results.iter_mut().find(|(k, _)| *k == key) {
                        Some((_, xs)) => xs.push(ns),
                        None => results.push((key, vec![ns])),
                    }
                }
            }
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    println!("| body | transport | validating intake (µs CPU/request) | lean intake | validating / lean |");
    println!("|---|---|---|---|---|");
    for (size, _, _) in &bodies {
        for t in transports {
            let get = |v| {
                median(
                    results
                        .iter()
                        .find(|(k, _)| *k == (*size, t, v))
                        .map(|(_, xs)| xs.clone())
                        .unwrap_or_default(),
                )
            };
            let (old, new) = (get(Variant::Validating), get(Variant::Lean));
            let label = match size {
                s if *s >= 1 << 20 => format!("{} MB", s >> 20),
                s => format!("{} KB", s >> 10),
            };
            println!(
                "| {label} | {t:?} | {:.1} | {:.1} | {:.2}× |",
                old / 1e3,
                new / 1e3,
                old / new
            );
        }
    }
}
