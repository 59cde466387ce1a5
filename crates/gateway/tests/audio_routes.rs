//! vLLM's (and OpenAI's) audio routes through the gateway: `/v1/audio/transcriptions` and
//! `/v1/audio/translations` take a multipart form, passed through byte for byte (only the
//! `model` field's value changes when the target names another model), with the key,
//! model, limits and a body bound of their own (`server.max_audio_bytes`) applied and the
//! answer's usage booked when it carries one. Bad forms are OpenAI-shaped 400s that never
//! reach the upstream.

mod common;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, Uri};
use axum::response::IntoResponse;
use common::*;
use parking_lot::Mutex;
use serde_json::{json, Value};

/// What the stand-in was sent: path, `Content-Type`, body.
type Seen = Arc<Mutex<Vec<(String, String, Bytes)>>>;

/// A loopback stand-in for vLLM's audio routes.
async fn fake_vllm() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
        let seen = s2.clone();
        async move {
            let ct = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            seen.lock().push((uri.path().to_string(), ct, body));
            let answer = match uri.path() {
                "/v1/audio/transcriptions" => json!({"text": "hello world",
                    "usage": {"type": "tokens", "input_tokens": 30, "output_tokens": 5, "total_tokens": 35}}),
                _ => json!({"text": "hi"}),
            };
            ([(header::CONTENT_TYPE, "application/json")], answer.to_string()).into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, seen)
}

const BOUNDARY: &str = "strata-audio-test-boundary";

/// A form with `model`, `language` and a `file` of `audio` bytes.
fn form(model: &str, audio: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    let field = |b: &mut Vec<u8>, name: &str, value: &str| {
        b.extend_from_slice(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n")
                .as_bytes(),
        );
    };
    field(&mut b, "model", model);
    field(&mut b, "language", "en");
    b.extend_from_slice(
        format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n")
            .as_bytes(),
    );
    b.extend_from_slice(audio);
    b.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    b
}

fn content_type() -> String {
    format!("multipart/form-data; boundary={BOUNDARY}")
}

/// Audio bytes that look like a boundary and are not valid UTF-8.
fn audio(len: usize) -> Vec<u8> {
    let mut a = b"RIFF\xff\xfe\r\n--strata-audio\r\n".to_vec();
    a.extend((0..len).map(|i| (i % 251) as u8));
    a
}

async fn send(url: &str, key: &str, ct: &str, body: Vec<u8>) -> (u16, HeaderMap, Value) {
    let resp = client()
        .post(url)
        .bearer_auth(key)
        .header("content-type", ct)
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.unwrap();
    (
        status,
        headers,
        serde_json::from_str(&text).unwrap_or(Value::Null),
    )
}

fn yaml(url: &str, extra: &str) -> String {
    format!(
        r#"
upstreams:
  - {{name: vllm, base_url: "{url}"}}
models:
  - name: whisper
    targets: [{{upstream: vllm, model: large-v3}}]
    price: {{input_per_1m: 1, output_per_1m: 2}}
  - name: same
    targets: [{{upstream: vllm}}]
{extra}
"#
    )
}

#[tokio::test]
async fn audio_forms_pass_through_with_their_model_replaced_and_usage_booked() {
    let (url, seen) = fake_vllm().await;
    let gw = gateway(&yaml(&url, "")).await;
    let k = key(&gw, "t");
    let sound = audio(4096);

    let transcribe = format!("{}/v1/audio/transcriptions", gw.url());
    let (status, headers, body) =
        send(&transcribe, &k, &content_type(), form("whisper", &sound)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["text"], "hello world");
    assert_eq!(headers["x-strata-upstream"], "vllm");
    {
        let seen = seen.lock();
        let (path, ct, sent) = &seen[0];
        assert_eq!(path, "/v1/audio/transcriptions");
        assert_eq!(ct, &content_type(), "the boundary travels with the body");
        assert_eq!(&sent[..], &form("large-v3", &sound)[..]);
    }
    // 30 input tokens at $1/1M and 5 output tokens at $2/1M: 40 micro-dollars.
    let metrics = metrics_text(&gw).await;
    let cost = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("strata_gateway_cost_usd_total{tenant=\"t\",model=\"whisper\"} ")
        })
        .map(|v| v.trim().parse::<f64>().unwrap() * 1e6)
        .unwrap_or(0.0);
    assert!((cost - 40.0).abs() < 1e-6, "{metrics}");

    // The same model name upstream: the body goes byte for byte as sent.
    let translate = format!("{}/v1/audio/translations", gw.url());
    let sent_form = form("same", &sound);
    let (status, _, body) = send(&translate, &k, &content_type(), sent_form.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["text"], "hi");
    let (path, _, sent) = seen.lock()[1].clone();
    assert_eq!(path, "/v1/audio/translations");
    assert_eq!(&sent[..], &sent_form[..]);
    gw.shutdown().await;
}

#[tokio::test]
async fn bad_and_oversized_audio_forms_are_refused_before_the_upstream() {
    let (url, seen) = fake_vllm().await;
    let gw = gateway(&yaml(&url, "server: {max_audio_bytes: 2000}")).await;
    let k = key(&gw, "t");
    let transcribe = format!("{}/v1/audio/transcriptions", gw.url());

    let (status, _, body) = send(
        &transcribe,
        &k,
        &content_type(),
        form("whisper", &audio(4096)),
    )
    .await;
    assert_eq!(status, 413, "{body}");
    assert_openai_error(&body);

    let json_body = json!({"model": "whisper", "file": "a.wav"})
        .to_string()
        .into_bytes();
    let (status, _, body) = send(&transcribe, &k, "application/json", json_body).await;
    assert_eq!(status, 400, "{body}");
    let e = assert_openai_error(&body);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("multipart/form-data"),
        "{body}"
    );

    let no_file = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--{BOUNDARY}--\r\n"
    );
    let (status, _, body) = send(&transcribe, &k, &content_type(), no_file.into_bytes()).await;
    assert_eq!(status, 400, "{body}");
    assert!(assert_openai_error(&body)["message"]
        .as_str()
        .unwrap()
        .contains("`file`"));

    let mut no_model = form("whisper", &audio(16));
    let cut = b"name=\"model\"";
    let at = no_model.windows(cut.len()).position(|w| w == cut).unwrap();
    no_model.splice(at..at + cut.len(), b"name=\"other\"".iter().copied());
    let (status, _, body) = send(&transcribe, &k, &content_type(), no_model).await;
    assert_eq!(status, 400, "{body}");
    assert_openai_error(&body);

    let (status, _, body) = send(
        &transcribe,
        "sk-wrong",
        &content_type(),
        form("whisper", &audio(16)),
    )
    .await;
    assert_eq!(status, 401, "{body}");
    assert!(seen.lock().is_empty(), "nothing reached the upstream");
    gw.shutdown().await;
}
