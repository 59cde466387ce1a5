//! The mock behaves as documented: it is the fixture other crates' tests stand on.

use std::time::Duration;

use serde_json::{json, Value};
use strata_api::sse::SseDecoder;
use strata_mock::{EngineKind, Fault, MockConfig, MockEngine};

fn config(kind: EngineKind) -> MockConfig {
    MockConfig {
        model: "m".into(),
        kind,
        output_tokens: 5,
        ..Default::default()
    }
}

async fn sse_events(resp: reqwest::Response) -> Result<Vec<String>, reqwest::Error> {
    let mut dec = SseDecoder::new();
    let mut out = Vec::new();
    let mut resp = resp;
    while let Some(chunk) = resp.chunk().await? {
        for ev in dec.feed(&chunk).expect("sse") {
            out.push(ev.data.clone());
        }
    }
    Ok(out)
}

#[tokio::test]
async fn chat_json_counts_prompt_words_and_caps_by_max_tokens() {
    let mock = MockEngine::spawn(config(EngineKind::Vllm)).await.unwrap();
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{}/v1/chat/completions", mock.url()))
        .json(&json!({"model": "m", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "one two three four"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-mock-replica"].to_str().unwrap(),
        mock.addr().to_string()
    );
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], " tok tok tok");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(mock.requests(), 1);
    assert_eq!(mock.in_flight(), 0);
}

#[tokio::test]
async fn streamed_completion_has_one_chunk_per_token_usage_and_done() {
    let mock = MockEngine::spawn(config(EngineKind::Vllm)).await.unwrap();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", mock.url()))
        .json(&json!({"model": "m", "prompt": [1, 2, 3], "stream": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let events = sse_events(resp).await.unwrap();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let texts = chunks
        .iter()
        .filter(|c| c["choices"][0]["text"] == " tok")
        .count();
    assert_eq!(texts, 5);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], 3);
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "stop"
    );
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let mock = MockEngine::spawn(config(EngineKind::Vllm)).await.unwrap();
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", mock.url());
    for (body, status) in [
        ("{not json", 400),
        ("[1]", 400),
        (
            r#"{"model":"other","messages":[{"role":"user","content":"x"}]}"#,
            404,
        ),
        (r#"{"model":"m"}"#, 400),
    ] {
        let resp = client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), status, "{body}");
        let v: Value = resp.json().await.unwrap();
        assert!(v["error"]["message"].is_string(), "{v}");
    }
}

#[tokio::test]
async fn faults_status_cut_not_ready_and_garbage_metrics() {
    let mock = MockEngine::spawn(config(EngineKind::Vllm)).await.unwrap();
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", mock.url());
    let body = json!({"model": "m", "prompt": "hi", "stream": true});

    mock.set_fault(Fault::Status(503));
    let resp = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 503);

    mock.set_fault(Fault::CloseMidStream { after_chunks: 2 });
    let resp = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut dec = SseDecoder::new();
    let mut resp = resp;
    let mut datas = Vec::new();
    let err = loop {
        match resp.chunk().await {
            Ok(Some(c)) => datas.extend(dec.feed(&c).unwrap().into_iter().map(|e| e.data)),
            Ok(None) => panic!("stream ended cleanly: {datas:?}"),
            Err(e) => break e,
        }
    };
    assert!(err.is_body() || err.is_decode(), "{err}");
    assert_eq!(datas.len(), 2, "{datas:?}");
    assert!(!datas.iter().any(|d| d == "[DONE]"));

    mock.set_fault(Fault::NotReady);
    let resp = client
        .get(format!("{}/health", mock.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);

    mock.set_fault(Fault::GarbageMetrics);
    let text = client
        .get(format!("{}/metrics", mock.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!text.contains("vllm:"));

    mock.set_fault(Fault::HangMetrics);
    let r = client
        .get(format!("{}/metrics", mock.url()))
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(r.unwrap_err().is_timeout());
}

#[tokio::test]
async fn metrics_use_the_kind_names_and_count_in_flight_as_running() {
    for (kind, waiting_name) in [
        (EngineKind::Vllm, "vllm:num_requests_waiting"),
        (EngineKind::Sglang, "sglang:num_queue_reqs"),
        (EngineKind::Trtllm, "trtllm_num_requests_waiting"),
        (EngineKind::Llamacpp, "llamacpp:requests_deferred"),
    ] {
        let mock = MockEngine::spawn(config(kind)).await.unwrap();
        mock.set_gauges(7, 2, 0.25);
        mock.set_fault(Fault::Hang);
        let client = reqwest::Client::new();
        let url = format!("{}/v1/completions", mock.url());
        let pending = tokio::spawn({
            let client = client.clone();
            async move {
                client
                    .post(url)
                    .json(&json!({"model": "m", "prompt": "x"}))
                    .send()
                    .await
            }
        });
        tokio::time::timeout(Duration::from_secs(5), async {
            while mock.in_flight() == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
        let text = client
            .get(format!("{}/metrics", mock.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with(waiting_name))
            .unwrap_or_else(|| panic!("{kind:?}: {text}"));
        assert!(line.ends_with(" 7"), "{line}");
        // 2 configured + 1 hanging request.
        assert!(
            text.lines().any(|l| !l.starts_with('#')
                && (l.contains("running") || l.contains("processing"))
                && l.ends_with(" 3")),
            "{kind:?}: {text}"
        );
        pending.abort();
    }
}

#[tokio::test]
async fn a_gauges_file_sets_the_load_seen_by_the_next_scrape() {
    let dir = std::env::temp_dir().join(format!("strata-mock-gauges-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gauges.json");
    let mock = MockEngine::spawn(MockConfig {
        gauges_file: Some(file.clone()),
        ..config(EngineKind::Vllm)
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let scrape = || async {
        let text = client
            .get(format!("{}/metrics", mock.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let value = |name: &str| -> f64 {
            let line = text.lines().find(|l| l.starts_with(name)).unwrap();
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        (
            value("vllm:num_requests_waiting"),
            value("vllm:num_requests_running"),
            value("vllm:kv_cache_usage_perc"),
        )
    };
    // No file yet: an idle engine.
    assert_eq!(scrape().await, (0.0, 0.0, 0.0));
    std::fs::write(&file, r#"{"waiting": 4, "running": 2.0, "kv_usage": 0.5}"#).unwrap();
    assert_eq!(scrape().await, (4.0, 2.0, 0.5));
    // The file wins over set_gauges; garbage reads as idle.
    mock.set_gauges(9, 9, 0.9);
    std::fs::write(&file, "not json").unwrap();
    assert_eq!(scrape().await, (0.0, 0.0, 0.0));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn shutdown_cuts_open_streams_and_refuses_new_connections() {
    let mut cfg = config(EngineKind::Vllm);
    cfg.output_tokens = 1000;
    cfg.itl = Duration::from_millis(20);
    let mock = MockEngine::spawn(cfg).await.unwrap();
    let url = mock.url();
    let client = reqwest::Client::new();
    let mut resp = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "m", "prompt": "x", "stream": true}))
        .send()
        .await
        .unwrap();
    assert!(resp.chunk().await.unwrap().is_some());
    mock.shutdown().await;
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match resp.chunk().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .expect("stream not cut");
    assert!(end.is_err(), "stream ended cleanly after shutdown");
    let err = client
        .get(format!("{url}/health"))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_connect(), "{err}");
}
