//! Fields that name a place are never contacted: a JSON schema whose `$ref` points at a URL,
//! and chat content parts whose URL points at a host, are refused with a 400 and the named
//! host sees no connection at all (a listener on loopback counts its accepted connections).

mod common;

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use strata_engine::server::EngineOptions;

const MODEL: &str = "smollm2-135m-instruct";

/// A loopback listener that counts every connection made to it, for as long as the test runs.
fn counting_listener() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the counting listener");
    let addr = listener.local_addr().expect("listener address");
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            seen.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    (addr, count)
}

fn chat(messages: Value, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 8});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

fn assert_refused(status: u16, body: &Value, what: &str) {
    assert_eq!(status, 400, "{what}: expected a 400, got {status}: {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.is_empty(), "{what}: the 400 says why: {body}");
    assert!(
        !message.contains("stack backtrace") && !message.contains("src/"),
        "{what}: no backtrace or source path in the body: {message}"
    );
}

#[test]
fn urls_in_schemas_and_content_parts_are_refused_without_a_connection() {
    let (target, connections) = counting_listener();
    let addr = common::serve(&EngineOptions::default());
    let url = format!("http://{target}/schema.json");
    let user = json!([{"role": "user", "content": "Give me a JSON object."}]);

    // A remote `$ref` in a response_format schema, at the root and nested.
    for schema in [
        json!({"$ref": url}),
        json!({"type": "object", "properties": {"a": {"$ref": url}}, "required": ["a"]}),
    ] {
        let body = chat(
            user.clone(),
            json!({"response_format": {"type": "json_schema",
                   "json_schema": {"name": "remote", "schema": schema}}}),
        );
        let (status, answer) = common::post(addr, "/v1/chat/completions", &body);
        assert_refused(status, &answer, "remote $ref in response_format");
    }
    // The same through vLLM's `guided_json`.
    let body = chat(user.clone(), json!({"guided_json": {"$ref": url}}));
    let (status, answer) = common::post(addr, "/v1/chat/completions", &body);
    assert_refused(status, &answer, "remote $ref in guided_json");

    // Content parts that carry a URL: image, audio and file parts.
    let img = format!("http://{target}/cat.png");
    for part in [
        json!({"type": "image_url", "image_url": {"url": img}}),
        json!({"type": "input_audio", "input_audio": {"data": format!("http://{target}/a.wav"), "format": "wav"}}),
        json!({"type": "file", "file": {"file_data": format!("http://{target}/f.pdf")}}),
    ] {
        let messages =
            json!([{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]);
        let (status, answer) =
            common::post(addr, "/v1/chat/completions", &chat(messages, json!({})));
        assert_refused(status, &answer, &format!("content part {part}"));
    }

    // The server still answers, and nothing ever reached the named host.
    let (status, answer) = common::post(addr, "/v1/chat/completions", &chat(user, json!({})));
    assert_eq!(status, 200, "a plain request still works: {answer}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        connections.load(Ordering::SeqCst),
        0,
        "no request may make the engine connect to a host it names"
    );
}
