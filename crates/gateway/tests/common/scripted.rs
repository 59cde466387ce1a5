//! A scripted OpenAI-compatible upstream on loopback for the Messages and Responses API
//! tests: chat answers (whole or streamed) that call the request's first tool when it
//! has tools and the conversation does not end in a tool result, `/tokenize` (ten
//! tokens per message), and vLLM 0.32's recorded `/v1/messages` and `/v1/responses`
//! answers for the pass-through routes. It keeps every body it received.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use parking_lot::Mutex;
use serde_json::{json, Value};

/// The bodies received, by path.
#[derive(Default)]
pub struct Seen {
    pub bodies: Mutex<Vec<(String, Value)>>,
}

impl Seen {
    pub fn last(&self, path: &str) -> Option<Value> {
        self.bodies
            .lock()
            .iter()
            .rev()
            .find(|(p, _)| p == path)
            .map(|(_, b)| b.clone())
    }

    pub fn count(&self) -> usize {
        self.bodies.lock().len()
    }
}

pub struct Scripted {
    pub url: String,
    pub seen: Arc<Seen>,
}

pub fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vllm-0.32/api")
        .join(name);
    std::fs::read_to_string(path).unwrap()
}

pub async fn spawn() -> Scripted {
    let seen = Arc::new(Seen::default());
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/v1/messages", post(messages))
        .route("/v1/responses", post(responses))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Scripted { url, seen }
}

type S = State<Arc<Seen>>;

/// What the scripted model says: a call of the first tool, or text.
fn reply(body: &Value) -> (Option<(String, String)>, String) {
    let last_is_tool = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .is_some_and(|m| m["role"] == "tool");
    let tool = body["tools"][0]["function"]["name"].as_str();
    match tool {
        Some(name) if !last_is_tool && body["tool_choice"] != "none" => (
            Some((name.to_string(), "{\"city\": \"Paris\"}".to_string())),
            String::new(),
        ),
        _ => (None, "Hello there!".to_string()),
    }
}

async fn chat(State(seen): S, Json(body): Json<Value>) -> Response {
    seen.bodies
        .lock()
        .push(("/v1/chat/completions".into(), body.clone()));
    let (call, text) = reply(&body);
    let finish = if call.is_some() { "tool_calls" } else { "stop" };
    let usage = json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8});
    let model = body["model"].clone();
    if body["stream"] != true {
        let mut message = json!({"role": "assistant", "content": text});
        if let Some((name, args)) = &call {
            message = json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}
            ]});
        }
        return Json(json!({
            "id": "chatcmpl-s", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage
        }))
        .into_response();
    }
    let chunk = |delta: Value, finish: Value| {
        let c = json!({"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {c}\n\n")
    };
    let mut out = chunk(json!({"role": "assistant", "content": ""}), Value::Null);
    match &call {
        Some((name, args)) => {
            out += &chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": name, "arguments": ""}}]}),
                Value::Null,
            );
            let (a, b) = args.split_at(args.len() / 2);
            for piece in [a, b] {
                out += &chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}),
                    Value::Null,
                );
            }
        }
        None => {
            for piece in ["Hello", " there", "!"] {
                out += &chunk(json!({"content": piece}), Value::Null);
            }
        }
    }
    out += &chunk(json!({}), json!(finish));
    if body["stream_options"]["include_usage"] == true {
        let u = json!({"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [], "usage": usage});
        out += &format!("data: {u}\n\n");
    }
    out += "data: [DONE]\n\n";
    sse(out)
}

fn sse(text: String) -> Response {
    let mut resp = Response::new(Body::from(text));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
    resp
}

async fn tokenize(State(seen): S, Json(body): Json<Value>) -> Response {
    seen.bodies.lock().push(("/tokenize".into(), body.clone()));
    let n = body["messages"].as_array().map_or(0, Vec::len) * 10;
    Json(json!({"count": n, "max_model_len": 2048, "tokens": vec![1; n]})).into_response()
}

async fn messages(State(seen): S, Json(body): Json<Value>) -> Response {
    seen.bodies
        .lock()
        .push(("/v1/messages".into(), body.clone()));
    if body["stream"] == true {
        return sse(fixture("messages-stream.sse"));
    }
    (
        [(header::CONTENT_TYPE, "application/json")],
        fixture("messages.json"),
    )
        .into_response()
}

async fn responses(State(seen): S, Json(body): Json<Value>) -> Response {
    seen.bodies
        .lock()
        .push(("/v1/responses".into(), body.clone()));
    if body["stream"] == true {
        return sse(fixture("responses-stream.sse"));
    }
    (
        [(header::CONTENT_TYPE, "application/json")],
        fixture("responses.json"),
    )
        .into_response()
}

/// A gateway config with model `m` on the scripted upstream as a chat-only server and
/// model `v` on the same upstream declared as speaking both APIs (vLLM).
pub fn yaml(url: &str) -> String {
    format!(
        r#"
upstreams:
  - name: strata
    base_url: {url}
  - name: vllm
    base_url: {url}
    apis: [messages, responses]
models:
  - name: m
    targets: [{{upstream: strata}}]
    price: {{input_per_1m: 1000000, output_per_1m: 1000000}}
  - name: v
    targets: [{{upstream: vllm}}]
    price: {{input_per_1m: 1000000, output_per_1m: 1000000}}
"#
    )
}
