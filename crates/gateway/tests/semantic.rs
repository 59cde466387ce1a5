//! The semantic cache end to end: paraphrases are answered from the cache, unrelated
//! questions and other tenants miss, a follow-up ("and the second one?") never gets
//! another conversation's answer, and a header can raise the threshold but not lower it.
//!
//! Embeddings are real all-MiniLM-L6-v2 vectors: first from the fixture
//! (`tests/fixtures/minilm/reference.json`, served by a small `/v1/embeddings` stand-in
//! that looks the text up), then from Strata's own encoder (`strata engine --model
//! all-minilm-l6-v2`) loaded in process.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::{json, Value};

const FRANCE: &str = "What is the capital city of France?";
const FRANCE_AGAIN: &str = "Tell me the capital of France.";
const GERMANY: &str = "What is the capital of Germany?";
const BREAD: &str = "How long should I knead bread dough?";
const FOLLOW_UP: &str = "and the second one?";

fn yaml(chat: &str, embed: &str) -> String {
    format!(
        r#"
upstreams:
  - {{name: up, base_url: "{chat}"}}
  - {{name: local-embed, base_url: "{embed}"}}
models:
  - name: m
    targets: [{{upstream: up}}]
  - name: minilm
    targets: [{{upstream: local-embed, model: all-minilm-l6-v2}}]
cache:
  semantic: {{enabled: true, embedding_model: minilm, threshold: 0.9, max_messages: 3, ttl_secs: 300, max_entries: 1000}}
"#
    )
}

fn ask(msgs: Value) -> Value {
    json!({"model": "m", "temperature": 0, "max_tokens": 8, "messages": msgs})
}

fn user(text: &str) -> Value {
    ask(json!([{"role": "user", "content": text}]))
}

fn follow_up(first: &str) -> Value {
    ask(json!([
        {"role": "user", "content": first},
        {"role": "assistant", "content": "There are two."},
        {"role": "user", "content": FOLLOW_UP}
    ]))
}

async fn cache_result(url: &str, key: &str, body: &Value, header: Option<&str>) -> String {
    let mut rb = client().post(url).bearer_auth(key).json(body);
    if let Some(h) = header {
        rb = rb.header("x-strata-semantic-cache", h);
    }
    let resp = rb.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let r = resp
        .headers()
        .get("x-strata-cache")
        .map_or(String::new(), |v| v.to_str().unwrap().to_string());
    let _ = resp.text().await.unwrap();
    r
}

/// The scenario every embedding source must pass.
async fn paraphrases_hit_and_the_rest_miss(embed_url: &str) {
    let chat = mock("m").await;
    let gw = gateway(&yaml(&chat.url(), embed_url)).await;
    let (a, b) = (key(&gw, "tenant-a"), key(&gw, "tenant-b"));
    let url = format!("{}/v1/chat/completions", gw.url());

    assert_eq!(cache_result(&url, &a, &user(FRANCE), None).await, "miss");
    assert_eq!(chat.requests(), 1);
    // A paraphrase is answered from the cache, without the model.
    assert_eq!(
        cache_result(&url, &a, &user(FRANCE_AGAIN), None).await,
        "semantic"
    );
    assert_eq!(chat.requests(), 1);
    // A raised threshold (0.95 > the pair's ~0.91) misses; a lowered one is ignored.
    assert_eq!(
        cache_result(&url, &a, &user(FRANCE_AGAIN), Some("0.95")).await,
        "miss"
    );
    assert_eq!(
        cache_result(&url, &a, &user(GERMANY), Some("0.5")).await,
        "miss"
    );
    assert_eq!(cache_result(&url, &a, &user(BREAD), None).await, "miss");
    // Opted out: the model answers.
    let before = chat.requests();
    assert_eq!(
        cache_result(&url, &a, &user(FRANCE_AGAIN), Some("off")).await,
        ""
    );
    assert_eq!(chat.requests(), before + 1);
    // Another tenant never sees tenant a's answers.
    assert_eq!(cache_result(&url, &b, &user(FRANCE), None).await, "miss");
    // Follow-ups: the same words after different conversations are different questions.
    assert_eq!(
        cache_result(&url, &a, &follow_up(FRANCE), None).await,
        "miss"
    );
    assert_eq!(
        cache_result(&url, &a, &follow_up(BREAD), None).await,
        "miss"
    );
    assert_eq!(
        cache_result(&url, &a, &follow_up(FRANCE), None).await,
        "semantic"
    );

    let metrics = metrics_text(&gw).await;
    assert!(
        metrics
            .contains(r#"strata_gateway_semantic_cache_total{tenant="tenant-a",result="hit"} 2"#),
        "{metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semantic_cache_with_fixture_minilm_vectors() {
    let embed = fixture_embeddings().await;
    paraphrases_hit_and_the_rest_miss(&embed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semantic_cache_skips_when_the_embedding_model_fails() {
    // The stand-in does not know this text: no embedding, so no semantic cache (and no
    // error for the client).
    let embed = fixture_embeddings().await;
    let chat = mock("m").await;
    let gw = gateway(&yaml(&chat.url(), &embed)).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    for _ in 0..2 {
        let (status, headers, _) = post(&url, Some(&k), &user("an unknown sentence")).await;
        assert_eq!(status, 200);
        assert!(headers.get("x-strata-cache").is_none());
    }
    assert_eq!(chat.requests(), 2);
}

/// Strata's encoder (`strata model pull all-minilm-l6-v2`, or
/// `$STRATA_TEST_EMBED_MODEL`) serving `/v1/embeddings` in process. A missing model fails
/// the test with what to run; it is never skipped.
fn engine_embeddings() -> String {
    use strata_engine::embed::server as embed_server;
    use strata_engine::model_cache::{ModelCache, EMBEDDING_MODEL};
    let dir = match std::env::var_os("STRATA_TEST_EMBED_MODEL") {
        Some(p) => PathBuf::from(p),
        None => ModelCache::from_env().path_of(EMBEDDING_MODEL),
    };
    assert!(
        dir.join("model.safetensors").is_file(),
        "the embedding model is missing at {}; run `cargo run -p strata-cli -- model pull \
         {EMBEDDING_MODEL}`",
        dir.display()
    );
    let loaded = embed_server::load(&strata_engine::server::EngineOptions {
        model_path: dir,
        model_name: EMBEDDING_MODEL.into(),
        ..Default::default()
    })
    .expect("load the encoder");
    let app = embed_server::router(loaded.state.clone());
    // Its own runtime: the encoder outlives any one test's runtime.
    let addr = strata_mock::serve_on_thread(app, loaded).expect("encoder address");
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semantic_cache_with_strata_minilm_encoder() {
    let embed = tokio::task::spawn_blocking(engine_embeddings)
        .await
        .unwrap();
    paraphrases_hit_and_the_rest_miss(&embed).await;
}

/// Both caches on (exact and semantic), in front of a chat model that streams slowly
/// enough for a client to leave mid-answer.
fn yaml_both(chat: &str, embed: &str) -> String {
    yaml(chat, embed).replace(
        "cache:\n  semantic:",
        "cache:\n  enabled: true\n  ttl_secs: 60\n  semantic:",
    )
}

async fn stream(url: &str, key: &str, body: &Value) -> (String, String, String) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let resp = client()
        .post(url)
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map_or(String::new(), |v| v.to_str().unwrap().to_string())
    };
    let (cache, ct) = (header("x-strata-cache"), header("content-type"));
    (cache, ct, resp.text().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_answers_enter_the_caches_only_when_complete_and_hits_stream_back() {
    let embed = fixture_embeddings().await;
    let chat = strata_mock::MockEngine::spawn(strata_mock::MockConfig {
        model: "m".into(),
        output_tokens: 8,
        itl: std::time::Duration::from_millis(25),
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = gateway(&yaml_both(&chat.url(), &embed)).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let index = || gw.gateway.semantic.as_ref().unwrap().len();

    // A stream the upstream cuts is not stored.
    chat.set_fault(strata_mock::Fault::CloseMidStream { after_chunks: 2 });
    let (cache, _, text) = stream(&url, &k, &user(FRANCE)).await;
    assert_eq!(cache, "miss");
    assert!(!sse_content(&text).1, "cut: no [DONE]");
    chat.set_fault(strata_mock::Fault::None);
    // Nor is one the client leaves after the first chunk.
    let mut body = user(FRANCE);
    body["stream"] = json!(true);
    let mut resp = client()
        .post(&url)
        .bearer_auth(&k)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-strata-cache"], "miss");
    assert!(resp.chunk().await.unwrap().is_some());
    drop(resp);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    assert_eq!(
        index(),
        0,
        "nothing stored from broken or abandoned streams"
    );

    // A stream that completes is stored (in the background, once it ended).
    let (cache, _, text) = stream(&url, &k, &user(FRANCE)).await;
    assert_eq!(cache, "miss");
    let (answer, done) = sse_content(&text);
    assert!(done && !answer.is_empty(), "{text}");
    for _ in 0..100 {
        if index() == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(index(), 1);
    let served = chat.requests();

    // A streamed paraphrase is answered from the semantic cache, as a stream.
    let (cache, ct, text) = stream(&url, &k, &user(FRANCE_AGAIN)).await;
    assert_eq!(cache, "semantic");
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    assert_eq!(sse_content(&text), (answer.clone(), true), "{text}");
    assert!(
        text.contains("\"usage\""),
        "the usage chunk is replayed: {text}"
    );
    // The same stored answer serves a non-streamed paraphrase as JSON...
    let (status, headers, whole) = post(&url, Some(&k), &user(FRANCE_AGAIN)).await;
    assert_eq!(
        (status, headers["x-strata-cache"].to_str().unwrap()),
        (200, "semantic")
    );
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["content"], answer.as_str());
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    // ...and the identical streamed request is an exact hit, streamed.
    let (cache, ct, text) = stream(&url, &k, &user(FRANCE)).await;
    assert_eq!(cache, "hit");
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    assert_eq!(sse_content(&text), (answer, true));
    assert_eq!(chat.requests(), served, "no model call for any hit");

    let metrics = metrics_text(&gw).await;
    for (outcome, n) in [("miss", 3), ("semantic", 2), ("hit", 1)] {
        let line = format!(
            "strata_gateway_cache_outcomes_total{{tenant=\"t\",outcome=\"{outcome}\"}} {n}"
        );
        assert!(metrics.contains(&line), "{line}\n{metrics}");
    }
    gw.shutdown().await;
}
