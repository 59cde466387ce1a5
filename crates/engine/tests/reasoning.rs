//! `--reasoning-parser deepseek_r1` on the default model through HTTP: the reasoning
//! before `</think>` is `reasoning_content`, what follows is `content`, and a stream
//! sends the same split as `delta.reasoning_content` / `delta.content`.

mod common;

use common::post;
use serde_json::{json, Value};
use strata_engine::options::ToolOptions;
use strata_engine::reasoning::ReasoningParser;
use strata_engine::server::EngineOptions;

fn serve() -> std::net::SocketAddr {
    common::serve(&EngineOptions {
        tools: ToolOptions {
            reasoning_parser: Some(ReasoningParser::DeepSeekR1),
            ..Default::default()
        },
        ..Default::default()
    })
}

fn streamed(addr: std::net::SocketAddr, body: &Value) -> (String, String) {
    let (status, text) = common::request(
        addr,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    let (mut reasoning, mut content) = (String::new(), String::new());
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(line).expect("chunk");
        let delta = &chunk["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(delta["content"].as_str().unwrap_or(""));
    }
    (reasoning, content)
}

#[test]
fn think_block_is_reasoning_content_whole_and_streamed() {
    let addr = serve();
    // The echoed assistant prefix closes the thinking; the model's words are the answer.
    let body = json!({
        "messages": [
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "<think>A greeting is asked for.</think>"},
        ],
        "continue_final_message": true,
        "echo": true,
        "temperature": 0.0,
        "max_tokens": 8,
    });
    let (status, resp) = post(addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{resp}");
    let message = &resp["choices"][0]["message"];
    assert_eq!(
        message["reasoning_content"], "A greeting is asked for.",
        "{resp}"
    );
    let content = message["content"].as_str().unwrap_or_default().to_string();
    assert!(!content.contains("think>"), "{resp}");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    assert_eq!(
        streamed(addr, &stream_body),
        ("A greeting is asked for.".to_string(), content)
    );

    // No `</think>`: deepseek_r1 makes the whole output reasoning, streamed alike.
    let body = json!({
        "messages": [{"role": "user", "content": "Think about the sea."}],
        "temperature": 0.0,
        "max_tokens": 12,
    });
    let (status, resp) = post(addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{resp}");
    let message = &resp["choices"][0]["message"];
    let reasoning = message["reasoning_content"]
        .as_str()
        .expect("reasoning")
        .to_string();
    assert!(!reasoning.is_empty());
    assert!(message["content"].is_null(), "{resp}");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    assert_eq!(streamed(addr, &stream_body), (reasoning, String::new()));
}
