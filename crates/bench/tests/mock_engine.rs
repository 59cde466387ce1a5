//! End-to-end runs against `strata-mock` engines on loopback.

use std::time::Duration;

use strata_bench::*;
use strata_mock::{EngineKind, Fault, MockConfig, MockEngine};

async fn mock(output_tokens: usize, itl: Duration) -> MockEngine {
    MockEngine::spawn(MockConfig {
        model: "m".into(),
        kind: EngineKind::Vllm,
        output_tokens,
        ttft: Duration::ZERO,
        itl,
        ..Default::default()
    })
    .await
    .unwrap()
}

fn config(url: &str, workload: Workload, load: LoadShape, requests: u64) -> LoadConfig {
    LoadConfig {
        client: ClientConfig {
            url: url.to_string(),
            model: "m".into(),
            endpoint: Endpoint::Completions,
            prompt_mode: PromptMode::Text,
            ignore_eos: true,
            keepalive: true,
            timeout: Duration::from_secs(10),
            api_key: None,
        },
        workload,
        load,
        stop: StopCondition {
            max_requests: Some(requests),
            duration: None,
        },
        seed: 7,
        slo: Slo::default(),
        label: "test".into(),
    }
}

fn random(input_len: u32, output_len: u32) -> Workload {
    Workload::Random(RandomSpec {
        input_len,
        output_len,
        range_ratio: 0.0,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_closed_loop_counts_every_token() {
    let m = mock(8, Duration::from_millis(1)).await;
    let cfg = config(
        &m.url(),
        random(40, 8),
        LoadShape::Concurrency { users: 4 },
        20,
    );
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.requests.sent, 20);
    assert_eq!(r.requests.completed, 20, "{:?}", r.error_examples);
    assert!(r.errors.is_empty());
    assert_eq!(m.requests(), 20);
    // The mock counts prompt words as tokens: one word per planned token.
    assert_eq!(r.tokens.input_total, 20 * 40);
    assert_eq!(r.tokens.output_total, 20 * 8);
    assert_eq!(r.latency_ms.ttft.unwrap().count, 20);
    assert_eq!(r.latency_ms.itl.unwrap().count, 20 * 7);
    assert_eq!(r.latency_ms.tpot.unwrap().count, 20);
    assert!(r.throughput.output_tokens_per_s > 0.0);
    assert_eq!(r.request_lines.len(), 20);
    // The mock names itself in `x-mock-replica`: every response is attributed to it.
    assert_eq!(r.served_by.values().sum::<u64>(), 20);
    assert_eq!(r.served_by.len(), 1);
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_endpoint_and_open_loop_rate() {
    let m = mock(4, Duration::ZERO).await;
    let mut cfg = config(
        &m.url(),
        random(10, 4),
        LoadShape::Rate {
            rate: 200.0,
            arrival: Arrival::Poisson,
            max_concurrency: Some(3),
        },
        15,
    );
    cfg.client.endpoint = Endpoint::Chat;
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.requests.completed, 15, "{:?}", r.error_examples);
    assert_eq!(r.tokens.output_total, 15 * 4);
    assert_eq!(m.requests(), 15);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_stops_issuing() {
    let m = mock(4, Duration::from_millis(5)).await;
    let mut cfg = config(
        &m.url(),
        random(5, 4),
        LoadShape::Concurrency { users: 2 },
        1,
    );
    cfg.stop = StopCondition {
        max_requests: None,
        duration: Some(Duration::from_millis(300)),
    };
    let r = run_load(&cfg).await.unwrap();
    assert!(r.requests.completed >= 2, "{}", r.requests.completed);
    assert_eq!(r.requests.sent, m.requests());
    assert_eq!(r.requests.failed, 0);
    // Nothing is sent after the deadline: the last send is before it.
    let last = r
        .request_lines
        .iter()
        .map(|l| l.start_s)
        .fold(0.0, f64::max);
    assert!(last < 0.3, "last send at {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connections_are_counted() {
    let m = mock(4, Duration::ZERO).await;
    let url = m.url();
    m.shutdown().await;
    let cfg = config(&url, random(5, 4), LoadShape::Concurrency { users: 2 }, 6);
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.requests.sent, 6);
    assert_eq!(r.requests.completed, 0);
    assert_eq!(
        r.errors.get("connection_refused"),
        Some(&6),
        "{:?}",
        r.errors
    );
    assert!(r.latency_ms.ttft.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_errors_are_counted_by_status() {
    let m = mock(4, Duration::ZERO).await;
    m.set_fault(Fault::Status(503));
    let cfg = config(
        &m.url(),
        random(5, 4),
        LoadShape::Concurrency { users: 2 },
        5,
    );
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.errors.get("http_503"), Some(&5), "{:?}", r.errors);
    assert!(r.error_examples["http_503"].contains("injected failure"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_streams_are_counted() {
    let m = mock(6, Duration::ZERO).await;
    m.set_fault(Fault::CloseMidStream { after_chunks: 3 });
    let cfg = config(
        &m.url(),
        random(5, 6),
        LoadShape::Concurrency { users: 1 },
        4,
    );
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.errors.get("stream_cut"), Some(&4), "{:?}", r.errors);
    assert_eq!(r.requests.completed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_requests_time_out() {
    let m = mock(4, Duration::ZERO).await;
    m.set_fault(Fault::Hang);
    let mut cfg = config(
        &m.url(),
        random(5, 4),
        LoadShape::Concurrency { users: 2 },
        2,
    );
    cfg.client.timeout = Duration::from_millis(200);
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.errors.get("timeout"), Some(&2), "{:?}", r.errors);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_mid_run_are_counted_beside_successes() {
    // Each request takes ~20 ms (4 tokens, 5 ms apart), so the fault set after the 4th
    // response lands long before the 10th request.
    let m = mock(4, Duration::from_millis(5)).await;
    let cfg = config(
        &m.url(),
        random(5, 4),
        LoadShape::Concurrency { users: 1 },
        10,
    );
    let seen = std::sync::atomic::AtomicU64::new(0);
    let observe = |_: &RequestRecord| {
        if seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == 4 {
            m.set_fault(Fault::Status(500));
        }
    };
    let r = run_load_with(&cfg, &observe, &StopHandle::new())
        .await
        .unwrap();
    assert_eq!(r.requests.sent, 10);
    // One user. The observer sees records after the load loop sent them, so the request
    // after the 4th may already be on its way when the fault is set: at least 4 succeed,
    // and every later one is counted as an error, none lost.
    let completed = r.requests.completed;
    assert!((4..10).contains(&completed), "completed {completed}");
    assert_eq!(
        r.errors.get("http_500").copied(),
        Some(10 - completed),
        "{:?}",
        r.errors
    );
    assert_eq!(m.requests(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_handle_ends_the_run() {
    let m = mock(4, Duration::from_millis(2)).await;
    let mut cfg = config(
        &m.url(),
        random(5, 4),
        LoadShape::Concurrency { users: 2 },
        1,
    );
    cfg.stop.max_requests = None; // would run forever
    let stop = StopHandle::new();
    let observe = |_: &RequestRecord| stop.stop();
    let r = run_load_with(&cfg, &observe, &stop).await.unwrap();
    // The run ends; each user sends at most a request or two after the stop is observed.
    assert!(
        r.requests.sent >= 1 && r.requests.sent <= 6,
        "{}",
        r.requests.sent
    );
    assert_eq!(r.requests.failed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_sends_system_plus_question() {
    let m = mock(3, Duration::ZERO).await;
    let w = Workload::SharedPrefix(SharedPrefixSpec {
        groups: 2,
        prompts_per_group: 3,
        system_len: 50,
        question_len: 5,
        output_len: 3,
    });
    let mut cfg = config(&m.url(), w, LoadShape::Concurrency { users: 2 }, 6);
    cfg.client.endpoint = Endpoint::Chat;
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.requests.completed, 6, "{:?}", r.error_examples);
    assert_eq!(r.tokens.input_total, 6 * 55);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_resends_growing_history() {
    let m = mock(8, Duration::ZERO).await;
    let w = Workload::MultiTurn(MultiTurnSpec {
        turns: 3,
        system_len: 20,
        user_len: 5,
        output_len: 8,
        think_time: Duration::from_millis(10),
    });
    for endpoint in [Endpoint::Chat, Endpoint::Completions] {
        let mut cfg = config(&m.url(), w.clone(), LoadShape::Concurrency { users: 1 }, 3);
        cfg.client.endpoint = endpoint;
        let r = run_load(&cfg).await.unwrap();
        assert_eq!(r.requests.completed, 3, "{:?}", r.error_examples);
        let inputs: Vec<u32> = r.request_lines.iter().map(|l| l.input_tokens).collect();
        // The mock replies " tok" x 8: each turn adds 5 user words and the 8-word reply.
        assert_eq!(inputs, [25, 38, 51], "{endpoint:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_id_prompts_have_exact_lengths() {
    let m = mock(2, Duration::ZERO).await;
    let mut cfg = config(
        &m.url(),
        random(123, 2),
        LoadShape::Concurrency { users: 1 },
        3,
    );
    cfg.client.prompt_mode = PromptMode::TokenIds;
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.requests.completed, 3);
    assert_eq!(r.tokens.input_total, 3 * 123);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_replays_every_line() {
    let m = mock(16, Duration::ZERO).await;
    let text = r#"{"timestamp": 0, "input_length": 30, "output_length": 2, "hash_ids": [1]}
{"timestamp": 20, "input_length": 40, "output_length": 3, "hash_ids": [1, 2]}
{"timestamp": 50, "input_length": 7, "output_length": 4}
"#;
    let w = Workload::Trace(TraceSpec {
        entries: strata_bench::workload::parse_trace(text, "inline").unwrap(),
        source: "inline".into(),
        block_size: 16,
        speed: 1.0,
    });
    let mut cfg = config(
        &m.url(),
        w,
        LoadShape::Recorded {
            max_concurrency: None,
        },
        1,
    );
    cfg.stop.max_requests = None;
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.requests.completed, 3, "{:?}", r.error_examples);
    assert_eq!(r.tokens.input_total, 77);
    assert_eq!(r.tokens.output_total, 9);
    let starts: Vec<f64> = r.request_lines.iter().map(|l| l.start_s).collect();
    assert!(starts[2] >= 0.05, "{starts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slo_goodput_counts_requests_within_objectives() {
    let m = mock(4, Duration::ZERO).await;
    let mut cfg = config(
        &m.url(),
        random(5, 4),
        LoadShape::Concurrency { users: 1 },
        5,
    );
    cfg.slo = Slo {
        ttft_ms: Some(10_000.0),
        ..Default::default()
    };
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.slo.unwrap().good, 5);
    cfg.slo = Slo {
        e2e_ms: Some(0.000_001),
        ..Default::default()
    };
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.slo.unwrap().good, 0);
    assert_eq!(r.throughput.goodput_requests_per_s, Some(0.0));
}

/// A server that ignores `stream: true`: a JSON body, or a non-JSON error page.
async fn plain_server(body: &'static str, content_type: &'static str) -> String {
    use axum::routing::post;
    let app = axum::Router::new().route(
        "/v1/completions",
        post(move || async move { ([(axum::http::header::CONTENT_TYPE, content_type)], body) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_answers_count_with_ttft_equal_to_latency() {
    let url = plain_server(
        r#"{"choices":[{"text":" a b c","finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}"#,
        "application/json",
    )
    .await;
    let cfg = config(&url, random(5, 3), LoadShape::Concurrency { users: 1 }, 3);
    let r = run_load(&cfg).await.unwrap();
    assert_eq!(r.requests.completed, 3, "{:?}", r.error_examples);
    assert_eq!(r.tokens.output_total, 9);
    assert!(r.latency_ms.itl.is_none());
    let (ttft, e2e) = (r.latency_ms.ttft.unwrap(), r.latency_ms.e2e.unwrap());
    assert!(ttft.max <= e2e.max);

    let url = plain_server(r#"{"choices":[]}"#, "application/json").await;
    let r = run_load(&config(
        &url,
        random(5, 3),
        LoadShape::Concurrency { users: 1 },
        2,
    ))
    .await
    .unwrap();
    assert_eq!(r.errors.get("invalid_response"), Some(&2), "{:?}", r.errors);

    let url = plain_server("<html>oops</html>", "text/html").await;
    let r = run_load(&config(
        &url,
        random(5, 3),
        LoadShape::Concurrency { users: 1 },
        2,
    ))
    .await
    .unwrap();
    assert_eq!(r.errors.get("invalid_response"), Some(&2), "{:?}", r.errors);
    assert!(r.error_examples["invalid_response"].contains("text/html"));
}
