//! Guardrails that call a model: a `classifiers` rule sends the prompt (and, when asked,
//! the whole answer) to a classifier served on the platform — here a real Strata engine
//! serving the tiny three-label classifier of `tests/fixtures/tiny-bert` (written by
//! `tools/make_tiny_bert.py`) — and blocks on its labels; a classifier that is down
//! follows the rule's `on_error`.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::{json, Value};

/// The tiny classifier (labels safe, toxic, spam) served by Strata's encoder server on a
/// loopback port of its own runtime; its base URL.
fn engine_classifier() -> String {
    use strata_engine::embed::server as embed_server;
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-bert/classifier");
    let loaded = embed_server::load(&strata_engine::server::EngineOptions {
        model_path: dir,
        model_name: "tiny-classifier".into(),
        ..strata_engine::server::EngineOptions::default()
    })
    .expect("load the classifier");
    let app = embed_server::router(loaded.state.clone());
    let addr = strata_mock::serve_on_thread(app, loaded).expect("serve the classifier");
    format!("http://{addr}")
}

/// A closed loopback port: a classifier that is down.
fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

fn yaml(chat: &str, guard: &str, rule: &str) -> String {
    format!(
        r#"
upstreams:
  - {{name: up, base_url: "{chat}"}}
  - {{name: guard-engine, base_url: "{guard}"}}
models:
  - name: m
    targets: [{{upstream: up}}]
  - name: guard
    targets: [{{upstream: guard-engine, model: tiny-classifier}}]
guardrails:
  classifiers:
    - {rule}
"#
    )
}

fn user(text: &str) -> Value {
    json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]})
}

/// The engine's own answer for `text`: (label, its probability).
async fn classified(guard: &str, text: &str) -> (String, f64) {
    let (status, _, v) = post(&format!("{guard}/classify"), None, &json!({"input": text})).await;
    assert_eq!(status, 200, "{v}");
    let d = &v["data"][0];
    let p = d["probs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_f64)
        .fold(0f64, f64::max);
    (d["label"].as_str().unwrap().to_string(), p)
}

/// The fixture's texts this test sends: the classifier calls the first `spam` and the
/// second not (`tests/fixtures/tiny-bert/expected.json`).
const SPAM: &str = "I hate this stupid model";
const FINE: &str = "buy now and win a free prize";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_label_refuses_the_prompt_before_the_model() {
    let guard = tokio::task::spawn_blocking(engine_classifier)
        .await
        .unwrap();
    let (label, p) = classified(&guard, SPAM).await;
    assert_eq!(label, "spam");
    assert!(p > 0.5, "{p}");
    assert_ne!(classified(&guard, FINE).await.0, "spam");

    let chat = mock("m").await;
    let gw = gateway(&yaml(
        &chat.url(),
        &guard,
        "{model: guard, block: [spam], threshold: 0.5}",
    ))
    .await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());

    let (status, _, v) = post(&url, Some(&k), &user(SPAM)).await;
    assert_eq!(status, 400, "{v}");
    let err = assert_openai_error(&v);
    assert_eq!(err["code"], "guardrail_blocked");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("`spam`") && msg.contains("model `guard`"),
        "{msg}"
    );
    assert_eq!(
        chat.requests(),
        0,
        "a blocked prompt never reaches the model"
    );

    let (status, _, v) = post(&url, Some(&k), &user(FINE)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(chat.requests(), 1);

    // Any text of the conversation counts, the system prompt included.
    let body = json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "system", "content": SPAM}, {"role": "user", "content": FINE}]});
    let (status, _, _) = post(&url, Some(&k), &body).await;
    assert_eq!(status, 400);
    // A threshold above the label's probability lets it through.
    let lenient = format!(
        "{{model: guard, block: [spam], threshold: {}}}",
        (p + 0.01).min(1.0)
    );
    let gw2 = gateway(&yaml(&chat.url(), &guard, &lenient)).await;
    let k2 = key(&gw2, "t");
    let (status, _, v) = post(
        &format!("{}/v1/chat/completions", gw2.url()),
        Some(&k2),
        &user(SPAM),
    )
    .await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_rules_withhold_whole_answers() {
    let guard = tokio::task::spawn_blocking(engine_classifier)
        .await
        .unwrap();
    let chat = mock("m").await;
    // Every label blocks at any probability: whatever the model says is withheld.
    let rule =
        "{model: guard, block: [safe, toxic, spam], threshold: 0.01, input: false, output: true}";
    let gw = gateway(&yaml(&chat.url(), &guard, rule)).await;
    let k = key(&gw, "t");
    let (status, _, v) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(&k),
        &user(SPAM),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let err = assert_openai_error(&v);
    assert_eq!(err["code"], "guardrail_blocked");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .starts_with("The response was withheld"),
        "{v}"
    );
    assert_eq!(chat.requests(), 1, "input: false sent the prompt on");

    // Asking for a stream does not pass the rule: the stream is held, classified, and
    // withheld before any byte of it is sent.
    let mut streamed = user(SPAM);
    streamed["stream"] = json!(true);
    let (status, _, v) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(&k),
        &streamed,
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let err = assert_openai_error(&v);
    assert_eq!(err["code"], "guardrail_blocked");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .starts_with("The response was withheld"),
        "{v}"
    );
    assert_eq!(chat.requests(), 2);
}

/// A held stream that passes reaches the client whole, as the model streamed it; one whose
/// classifier is down follows `on_error` like a whole answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_answers_are_held_for_output_rules() {
    let guard = tokio::task::spawn_blocking(engine_classifier)
        .await
        .unwrap();
    let chat = mock("m").await;
    // No probability reaches 1.0: nothing blocks.
    let rule =
        "{model: guard, block: [safe, toxic, spam], threshold: 1.0, input: false, output: true}";
    let gw = gateway(&yaml(&chat.url(), &guard, rule)).await;
    let k = key(&gw, "t");
    let mut body = user(FINE);
    body["stream"] = json!(true);
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .bearer_auth(&k)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = resp.text().await.unwrap();
    let content: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert!(!content.is_empty(), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");

    let closed = gateway(&yaml(
        &chat.url(),
        &dead_url(),
        "{model: guard, block: [spam], input: false, output: true}",
    ))
    .await;
    let k = key(&closed, "t");
    let (status, _, v) = post(
        &format!("{}/v1/chat/completions", closed.url()),
        Some(&k),
        &body,
    )
    .await;
    assert_eq!(status, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("guardrail classifier is unavailable"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_classifier_that_is_down_follows_on_error() {
    let chat = mock("m").await;
    let down = dead_url();
    let closed = gateway(&yaml(&chat.url(), &down, "{model: guard, block: [spam]}")).await;
    let k = key(&closed, "t");
    let (status, _, v) = post(
        &format!("{}/v1/chat/completions", closed.url()),
        Some(&k),
        &user(FINE),
    )
    .await;
    assert_eq!(status, 503, "closed is the default: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("guardrail classifier"),
        "{v}"
    );
    assert_eq!(chat.requests(), 0);
    assert!(metrics_text(&closed)
        .await
        .contains("backend=\"guardrail_classifier\""));

    let open = gateway(&yaml(
        &chat.url(),
        &down,
        "{model: guard, block: [spam], on_error: open}",
    ))
    .await;
    let k = key(&open, "t");
    let (status, _, v) = post(
        &format!("{}/v1/chat/completions", open.url()),
        Some(&k),
        &user(FINE),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(chat.requests(), 1);
}

#[test]
fn a_rule_must_name_a_model() {
    let bad = yaml(
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        "{model: nope, block: [spam]}",
    );
    let err = strata_gateway::Config::from_yaml(&bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a model"), "{err}");
}
