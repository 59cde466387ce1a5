//! Output guardrails on streamed answers, end to end: the mock streams `" tok"` chunks, so
//! a pattern `tok tok` only ever matches across two chunks.

mod common;

use common::*;
use serde_json::{json, Value};

async fn stream_text(url: &str, key: &str) -> (u16, String) {
    let mut body = chat_body("m");
    body["stream"] = json!(true);
    let resp = client()
        .post(url)
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn contents(sse: &str) -> String {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect()
}

#[tokio::test]
async fn a_pattern_split_across_chunks_is_redacted_or_blocks_the_stream() {
    let m = mock("m").await;
    let redact = r#"
guardrails:
  patterns:
    - {kind: custom, regex: "tok tok", action: redact, input: false}
"#;
    let gw = gateway(&yaml_one(&m.url(), "m", "", redact)).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let (status, text) = stream_text(&url, &k).await;
    assert_eq!(status, 200);
    let said = contents(&text);
    assert!(said.contains("[REDACTED:custom]"), "{text}");
    assert!(!said.contains("tok tok"), "{said}");
    assert!(text.contains("data: [DONE]"), "{text}");
    gw.shutdown().await;

    let block = redact.replace("action: redact", "action: block");
    let gw = gateway(&yaml_one(&m.url(), "m", "", &block)).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let (status, text) = stream_text(&url, &k).await;
    assert_eq!(status, 200, "headers were sent before the match");
    assert!(!contents(&text).contains("tok tok"), "{text}");
    let err = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v.get("error").is_some())
        .unwrap_or_else(|| panic!("no error event: {text}"));
    assert_eq!(assert_openai_error(&err)["code"], "guardrail_blocked");
    assert!(
        !text.contains("[DONE]"),
        "the stream ends at the error: {text}"
    );
    gw.shutdown().await;
}
