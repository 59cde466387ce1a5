//! Hosted providers through the gateway: a fake provider served over TLS with a CA made
//! here (rcgen) answers as OpenAI (`/v1/chat/completions`) and as Anthropic
//! (`/v1/messages`), and records what it was sent. The gateway sends each its key the
//! provider's way (from an environment variable or a file), translates chat to Anthropic
//! Messages and back (whole and streamed), retries 429/503 (honouring `Retry-After`),
//! falls back past a refused certificate (wrong CA, expired, wrong host name) and prices
//! answers from the upstream's `prices` table. Bad provider configs are refused at load.

mod common;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use common::tls::{chain, serve_tls, Dir, Leaf};
use common::*;
use parking_lot::Mutex;
use serde_json::{json, Value};
use strata_gateway::config::Resolved;
use strata_gateway::Config;

/// What the fake provider was sent: path, headers, body.
type Seen = Arc<Mutex<Vec<(String, HeaderMap, Value)>>>;

/// Answers queued ahead of the normal one: status, headers, body.
type Queue = Arc<Mutex<VecDeque<(u16, Vec<(&'static str, String)>, String)>>>;

/// A loopback provider speaking OpenAI's chat and Anthropic's Messages.
struct Fake {
    url: String,
    seen: Seen,
    queue: Queue,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn openai_answer(model: &str, stream: bool) -> Response {
    if !stream {
        return axum::Json(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello world"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
        }))
        .into_response();
    }
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut text = String::new();
    for v in [
        chunk(
            json!({"role": "assistant", "content": "Hello"}),
            Value::Null,
        ),
        chunk(json!({"content": " world"}), Value::Null),
        chunk(json!({}), json!("stop")),
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
               "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}}),
    ] {
        text.push_str(&format!("data: {v}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response()
}

fn anthropic_answer(model: &str, stream: bool) -> Response {
    if !stream {
        return axum::Json(json!({
            "id": "msg_1", "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": "Hello world"}],
            "model": model, "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 11, "output_tokens": 2}
        }))
        .into_response();
    }
    let events = [
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
               "content": [], "model": model, "stop_reason": null, "stop_sequence": null,
               "usage": {"input_tokens": 11, "output_tokens": 0}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "ping"}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " world"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
               "usage": {"output_tokens": 2}}),
        json!({"type": "message_stop"}),
    ];
    let mut text = String::new();
    for e in events {
        text.push_str(&format!(
            "event: {}\ndata: {e}\n\n",
            e["type"].as_str().unwrap()
        ));
    }
    ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response()
}

impl Fake {
    /// A fake provider over TLS with `files`.
    async fn start(files: strata_api::tls::TlsFiles) -> Fake {
        let seen: Seen = Arc::default();
        let queue: Queue = Arc::default();
        let (s2, q2) = (seen.clone(), queue.clone());
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let (seen, queue) = (s2.clone(), q2.clone());
            async move {
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                seen.lock()
                    .push((uri.path().to_string(), headers, v.clone()));
                if let Some((status, hs, body)) = queue.lock().pop_front() {
                    let mut r = (StatusCode::from_u16(status).unwrap(), body).into_response();
                    for (n, val) in hs {
                        r.headers_mut().insert(n, val.parse().unwrap());
                    }
                    return r;
                }
                let model = v["model"].as_str().unwrap_or_default();
                let stream = v["stream"] == json!(true);
                match uri.path() {
                    "/v1/chat/completions" => openai_answer(model, stream),
                    "/v1/messages" => anthropic_answer(model, stream),
                    "/v1/messages/count_tokens" => {
                        axum::Json(json!({"input_tokens": 7})).into_response()
                    }
                    _ => (StatusCode::NOT_FOUND, "no such route").into_response(),
                }
            }
        });
        let (url, stop) = serve_tls(app, files).await;
        Fake {
            url,
            seen,
            queue,
            _stop: stop,
        }
    }

    fn requests(&self) -> Vec<(String, HeaderMap, Value)> {
        self.seen.lock().clone()
    }
}

/// A trusted fake provider: (its scratch folder, its CA file, the fake).
async fn trusted(tag: &str) -> (Dir, std::path::PathBuf, Fake) {
    let dir = Dir::new(tag);
    let (ca, files) = chain(&dir, "p", Leaf::default());
    let fake = Fake::start(files).await;
    (dir, ca, fake)
}

/// `strata_gateway_cost_usd_total` of tenant `t` and model `m`, in micro-dollars.
async fn cost_micros(gw: &strata_gateway::RunningGateway, model: &str) -> f64 {
    let text = metrics_text(gw).await;
    let prefix = format!("strata_gateway_cost_usd_total{{tenant=\"t\",model=\"{model}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse::<f64>().unwrap() * 1e6)
}

async fn stream_text(url: &str, key: &str, body: &Value) -> String {
    client()
        .post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn openai_provider_over_tls_gets_a_bearer_key_from_the_environment_and_its_price() {
    std::env::set_var("STRATA_GW_PROVIDERS_OPENAI_KEY", "sk-openai-env\n");
    let (_dir, ca, fake) = trusted("openai").await;
    let yaml = format!(
        r#"
upstreams:
  - name: oa
    provider: openai
    base_url: "{}"
    ca_file: "{}"
    api_key_env: STRATA_GW_PROVIDERS_OPENAI_KEY
    prices: {{gpt-up: {{input_per_1m: 2, output_per_1m: 4}}}}
models:
  - name: m
    targets: [{{upstream: oa, model: gpt-up}}]
"#,
        fake.url,
        ca.display()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let (status, headers, body) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "Hello world");
    assert_eq!(headers["x-strata-upstream"], "oa");
    let seen = fake.requests();
    let (path, h, sent) = &seen[0];
    assert_eq!(path, "/v1/chat/completions");
    assert_eq!(h["authorization"], "Bearer sk-openai-env");
    assert!(h.get("x-api-key").is_none());
    assert_eq!(sent["model"], "gpt-up");
    // 11 prompt tokens at $2/1M and 2 completion tokens at $4/1M: 30 micro-dollars.
    assert!((cost_micros(&gw, "m").await - 30.0).abs() < 1e-6);

    // Streamed: the chunks pass through, with the usage the gateway asked for.
    let mut streamed = chat_body("m");
    streamed["stream"] = json!(true);
    let text = stream_text(&chat, &k, &streamed).await;
    let (content, done) = sse_content(&text);
    assert_eq!(content, "Hello world");
    assert!(done, "{text}");
    assert_eq!(
        fake.requests()[1].2["stream_options"]["include_usage"],
        json!(true)
    );

    // A vLLM-only route never leaves for the provider: a clear 404.
    let tokenize = format!("{}/tokenize", gw.url());
    let (status, _, body) = post(&tokenize, Some(&k), &json!({"model": "m", "prompt": "hi"})).await;
    assert_eq!(status, 404, "{body}");
    let e = assert_openai_error(&body);
    assert!(
        e["message"].as_str().unwrap().contains("does not serve"),
        "{body}"
    );
    assert_eq!(
        fake.requests().len(),
        2,
        "nothing more reached the provider"
    );
    gw.shutdown().await;
}

fn anthropic_yaml(fake: &Fake, ca: &std::path::Path, key_file: &std::path::Path) -> String {
    format!(
        r#"
upstreams:
  - name: an
    provider: anthropic
    base_url: "{}"
    ca_file: "{}"
    api_key_file: "{}"
    prices: {{claude-up: {{input_per_1m: 3, output_per_1m: 15}}}}
models:
  - name: c
    targets: [{{upstream: an, model: claude-up}}]
    retries: 0
"#,
        fake.url,
        ca.display(),
        key_file.display()
    )
}

#[tokio::test]
async fn anthropic_provider_is_spoken_to_in_messages_with_its_own_headers_whole_and_streamed() {
    let (dir, ca, fake) = trusted("anthropic").await;
    let key_file = dir.write("anthropic.key", "sk-ant-file\n");
    let gw = gateway(&anthropic_yaml(&fake, &ca, &key_file)).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let ask = json!({"model": "c", "max_tokens": 8, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"}
    ]});
    let (status, headers, body) = post(&chat, Some(&k), &ask).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-strata-upstream"], "an");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["message"]["content"], "Hello world");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["prompt_tokens"], 11);
    assert_eq!(body["usage"]["completion_tokens"], 2);

    let seen = fake.requests();
    let (path, h, sent) = &seen[0];
    assert_eq!(path, "/v1/messages");
    assert_eq!(h["x-api-key"], "sk-ant-file");
    assert_eq!(h["anthropic-version"], "2023-06-01");
    assert!(
        h.get("authorization").is_none(),
        "the gateway key stays here"
    );
    assert_eq!(sent["model"], "claude-up");
    assert_eq!(sent["system"], "be brief");
    assert_eq!(sent["max_tokens"], 8);
    assert_eq!(sent["messages"][0]["role"], "user");
    assert_eq!(sent["messages"][0]["content"][0]["text"], "hello there");
    // 11 input tokens at $3/1M and 2 output tokens at $15/1M: 63 micro-dollars.
    assert!((cost_micros(&gw, "c").await - 63.0).abs() < 1e-6);

    // Streamed: Messages events come back as chat chunks, usage and [DONE] included.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let text = stream_text(&chat, &k, &streamed).await;
    let (content, done) = sse_content(&text);
    assert_eq!(content, "Hello world", "{text}");
    assert!(done, "{text}");
    assert!(
        text.contains("\"object\":\"chat.completion.chunk\""),
        "{text}"
    );
    assert!(text.contains("\"finish_reason\":\"stop\""), "{text}");
    assert!(
        text.contains("\"prompt_tokens\":11") && text.contains("\"completion_tokens\":2"),
        "{text}"
    );
    assert_eq!(fake.requests()[1].2["stream"], json!(true));

    // The provider's error, in Anthropic's shape, reaches the client in OpenAI's.
    fake.queue.lock().push_back((
        400,
        vec![("content-type", "application/json".into())],
        json!({"type": "error", "error": {"type": "invalid_request_error",
               "message": "messages: roles must alternate"}})
        .to_string(),
    ));
    let (status, _, body) = post(&chat, Some(&k), &ask).await;
    assert_eq!(status, 400, "{body}");
    let e = assert_openai_error(&body);
    assert_eq!(e["message"], "messages: roles must alternate");
    assert_eq!(e["code"], "invalid_request_error");

    // The provider refusing the gateway's key is not the client's 401: a 503 after the
    // one target, naming neither key.
    fake.queue.lock().push_back((
        401,
        vec![],
        json!({"type": "error", "error": {"type": "authentication_error",
               "message": "invalid x-api-key"}})
        .to_string(),
    ));
    let (status, _, body) = post(&chat, Some(&k), &ask).await;
    assert_eq!(status, 503, "{body}");
    let msg = assert_openai_error(&body)["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("refused the gateway's key (401)"), "{msg}");
    assert!(!msg.contains("sk-"), "{msg}");

    // A request the Messages API cannot say is refused naming the field, unsent.
    let before = fake.requests().len();
    let mut two = ask.clone();
    two["n"] = json!(2);
    let (status, _, body) = post(&chat, Some(&k), &two).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(assert_openai_error(&body)["param"], "n");
    assert_eq!(fake.requests().len(), before);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_429_then_a_503_are_retried_after_the_wait_asked_for() {
    let (_dir, ca, fake) = trusted("retry").await;
    let busy = json!({"error": {"message": "slow down", "type": "rate_limit_error"}}).to_string();
    fake.queue.lock().extend([
        (429, vec![("retry-after", "1".to_string())], busy.clone()),
        (503, vec![], "overloaded".to_string()),
    ]);
    let yaml = format!(
        "upstreams:\n  - {{name: p, provider: openai-compatible, base_url: \"{}\", ca_file: \"{}\"}}\nmodels:\n  - name: m\n    targets: [{{upstream: p}}]\n    retries: 2\n    backoff_ms: 1\n",
        fake.url,
        ca.display()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let t0 = Instant::now();
    let (status, _, body) = post(&chat, Some(&k), &chat_body("m")).await;
    let took = t0.elapsed();
    assert_eq!(status, 200, "{body}");
    assert_eq!(fake.requests().len(), 3);
    assert!(
        took >= Duration::from_millis(990),
        "Retry-After: 1 honoured ({took:?})"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_retry_after_too_long_to_wait_falls_back_at_once_and_the_local_pool_is_used_again() {
    let (_dir, ca, fake) = trusted("fallback").await;
    let local = mock("m").await;
    // The local pool is tried first; the provider is its fallback.
    let yaml = format!(
        r#"
upstreams:
  - {{name: local, base_url: "{}"}}
  - {{name: hosted, provider: openai-compatible, base_url: "{}", ca_file: "{}"}}
models:
  - name: m
    targets: [{{upstream: local}}]
    fallbacks: [hosted-m]
    retries: 1
  - name: hosted-m
    targets: [{{upstream: hosted, model: big}}]
    retries: 2
  - name: direct
    targets: [{{upstream: hosted, model: big}}]
    fallbacks: [m]
    retries: 2
"#,
        local.url(),
        fake.url,
        ca.display()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let (status, headers, _) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-strata-upstream"], "local");

    // The provider asks for an hour: not waited for, the next target answers now.
    fake.queue.lock().push_back((
        429,
        vec![("retry-after", "3600".to_string())],
        "{}".to_string(),
    ));
    let t0 = Instant::now();
    let (status, headers, body) = post(&chat, Some(&k), &chat_body("direct")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-strata-upstream"], "local");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(fake.requests().len(), 1, "one try of the provider");

    // The local pool fails: the provider answers; it recovers: the pool answers again.
    local.set_fault(strata_mock::Fault::Status(503));
    let (status, headers, body) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-strata-upstream"], "hosted");
    assert_eq!(fake.requests().last().unwrap().2["model"], "big");
    local.set_fault(strata_mock::Fault::None);
    let (status, headers, _) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-strata-upstream"], "local");
    gw.shutdown().await;
}

/// The reason a refused certificate gives, squashed (`UnknownIssuer`, `not valid for
/// name` and the like read the same).
fn squashed(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_alphanumeric())
        .collect::<String>()
        .to_lowercase()
}

#[tokio::test]
async fn a_wrong_ca_an_expired_certificate_and_a_wrong_name_each_fail_clearly_and_fall_back() {
    let dir = Dir::new("refused");
    let good = mock("m").await;
    // Served with one CA's certificate, trusting another CA.
    let (_, served) = chain(&dir, "a", Leaf::default());
    let (other_ca, _) = chain(&dir, "b", Leaf::default());
    let wrong_ca = Fake::start(served).await;
    let (expired_ca, files) = chain(
        &dir,
        "old",
        Leaf {
            expired: true,
            ..Default::default()
        },
    );
    let expired = Fake::start(files).await;
    let (name_ca, files) = chain(
        &dir,
        "name",
        Leaf {
            names: &["other.test"],
            ..Default::default()
        },
    );
    let wrong_name = Fake::start(files).await;
    for (fake, ca, reason) in [
        (&wrong_ca, &other_ca, "unknownissuer"),
        (&expired, &expired_ca, "expired"),
        (&wrong_name, &name_ca, "notvalidforname"),
    ] {
        let yaml = format!(
            r#"
upstreams:
  - {{name: bad, provider: openai-compatible, base_url: "{}", ca_file: "{}"}}
  - {{name: good, base_url: "{}"}}
models:
  - name: primary
    targets: [{{upstream: bad}}]
    fallbacks: [backup]
  - name: backup
    targets: [{{upstream: good, model: m}}]
  - name: lone
    targets: [{{upstream: bad}}]
"#,
            fake.url,
            ca.display(),
            good.url()
        );
        let gw = gateway(&yaml).await;
        let k = key(&gw, "t");
        let chat = format!("{}/v1/chat/completions", gw.url());
        let (status, headers, body) = post(&chat, Some(&k), &chat_body("primary")).await;
        assert_eq!(status, 200, "{reason}: {body}");
        assert_eq!(headers["x-strata-upstream"], "good", "{reason}");
        let (status, _, body) = post(&chat, Some(&k), &chat_body("lone")).await;
        assert_eq!(status, 503, "{reason}: {body}");
        let msg = assert_openai_error(&body)["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(msg.contains("over TLS"), "{reason}: {msg}");
        assert!(squashed(&msg).contains(reason), "{reason}: {msg}");
        assert!(
            fake.requests().is_empty(),
            "no request crossed a refused handshake"
        );
        gw.shutdown().await;
    }
}

fn refused(yaml: &str) -> String {
    match Config::from_yaml(yaml) {
        Err(e) => e.to_string(),
        Ok(c) => Resolved::new(c).expect_err("refused").to_string(),
    }
}

#[test]
fn bad_provider_configs_are_refused_at_load_with_a_clear_message() {
    let up = |fields: &str| {
        format!("upstreams:\n  - {{name: p, {fields}}}\nmodels:\n  - name: m\n    targets: [{{upstream: p}}]\n")
    };
    let cases = [
        (up("provider: azure, base_url: \"https://x.test\""), "unknown variant `azure`"),
        (up("provider: openai"), "provider `openai` needs `api_key_env` or `api_key_file`"),
        (
            up("provider: openai, api_key_env: STRATA_GW_SURELY_UNSET_VAR"),
            "upstream `p`: environment variable `STRATA_GW_SURELY_UNSET_VAR` is not set",
        ),
        (
            up("provider: anthropic, api_key_file: /nonexistent/strata/key"),
            "upstream `p`: api_key_file `/nonexistent/strata/key`",
        ),
        (
            up("provider: openai, api_key_env: A, api_key_file: b"),
            "not both",
        ),
        (
            up("provider: openai-compatible"),
            "provider `openai-compatible` needs a `base_url`",
        ),
        (
            up("provider: openai-compatible, base_url: \"https://x.test/v1\""),
            "without the `/v1` suffix",
        ),
        (
            up("provider: openai-compatible, base_url: \"https://x.test\", anthropic_version: \"2023-06-01\""),
            "`anthropic_version` needs `provider: anthropic`",
        ),
        (
            up("base_url: \"https://x.test\", prices: {m: {input_per_1m: -1}}"),
            "prices of `m`",
        ),
        (
            up("base_url: \"https://x.test\", connect_timeout_ms: 0"),
            "connect_timeout_ms",
        ),
        (
            up("kind: router, provider: openai, endpoints: [\"http://127.0.0.1:1\"]"),
            "not `kind: router`",
        ),
    ];
    for (yaml, want) in cases {
        let err = refused(&yaml);
        assert!(err.contains(want), "{yaml}\n=> {err}\nwanted: {want}");
    }
}

#[test]
fn a_key_is_never_printed() {
    std::env::set_var("STRATA_GW_PROVIDERS_PRINT_KEY", "sk-never-printed");
    let yaml = "upstreams:\n  - {name: p, provider: anthropic, api_key_env: STRATA_GW_PROVIDERS_PRINT_KEY}\nmodels:\n  - name: m\n    targets: [{upstream: p}]\n";
    let r = Resolved::new(Config::from_yaml(yaml).unwrap()).unwrap();
    let up = &r.upstreams["p"];
    assert_eq!(up.base_url, "https://api.anthropic.com");
    assert_eq!(
        up.route_urls[0].to_string(),
        "https://api.anthropic.com/v1/messages"
    );
    let printed = format!("{r:?}");
    assert!(!printed.contains("sk-never-printed"), "{printed}");
}

/// An Anthropic stream cut before `message_stop` (the connection closed after the stop
/// reason) is not a whole answer: the chat client gets no `[DONE]`, and nothing is cached,
/// so the same request asks the provider again.
#[tokio::test]
async fn an_anthropic_stream_cut_before_message_stop_is_not_complete_nor_cached() {
    let (dir, ca, fake) = trusted("anthropic-cut").await;
    let key_file = dir.write("anthropic.key", "sk-ant-file\n");
    let yaml = format!(
        "{}cache: {{enabled: true}}\n",
        anthropic_yaml(&fake, &ca, &key_file)
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let ask = json!({"model": "c", "max_tokens": 8, "temperature": 0, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}]});
    let events = [
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
               "content": [], "model": "claude-up", "stop_reason": null, "stop_sequence": null,
               "usage": {"input_tokens": 11, "output_tokens": 0}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
               "usage": {"output_tokens": 1}}),
    ];
    let cut: String = events
        .iter()
        .map(|e| format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap()))
        .collect();
    fake.queue.lock().push_back((
        200,
        vec![("content-type", "text/event-stream".to_string())],
        cut,
    ));
    // The answer breaks off (here at once, so the connection may close before even the
    // head arrives): read what came before the break.
    let mut text = String::new();
    if let Ok(mut resp) = client().post(&chat).bearer_auth(&k).json(&ask).send().await {
        while let Ok(Some(piece)) = resp.chunk().await {
            text.push_str(&String::from_utf8_lossy(&piece));
        }
    }
    let (content, done) = sse_content(&text);
    assert!(content == "Hello" || content.is_empty(), "{text}");
    assert!(!done, "a cut stream is not complete: {text}");
    assert_eq!(fake.requests().len(), 1);

    // Asked again (after any store in the background would have landed): the provider
    // answers again (nothing was stored), in full this time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let resp = client()
        .post(&chat)
        .bearer_auth(&k)
        .json(&ask)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-strata-cache"], "miss");
    let text = resp.text().await.unwrap();
    let (content, done) = sse_content(&text);
    assert_eq!(content, "Hello world", "{text}");
    assert!(done, "{text}");
    assert_eq!(fake.requests().len(), 2);
    // That whole answer is stored: a third ask is a hit.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let resp = client()
        .post(&chat)
        .bearer_auth(&k)
        .json(&ask)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-strata-cache"], "hit");
    assert_eq!(fake.requests().len(), 2);
    gw.shutdown().await;
}

/// A provider refusing the gateway's key (401, 403) is not retried, whatever `retries`
/// allows (the same key would be refused again): the next target answers at once.
#[tokio::test]
async fn a_refused_key_moves_to_the_next_target_without_a_retry() {
    let (dir, ca, fake) = trusted("anthropic-refused").await;
    let key_file = dir.write("anthropic.key", "sk-ant-file\n");
    let local = mock("m").await;
    let yaml = format!(
        r#"
upstreams:
  - name: an
    provider: anthropic
    base_url: "{}"
    ca_file: "{}"
    api_key_file: "{}"
  - {{name: local, base_url: "{}"}}
models:
  - name: c
    targets: [{{upstream: an, model: claude-up, weight: 1}}, {{upstream: local, model: m, weight: 0}}]
    retries: 2
    backoff_ms: 1
"#,
        fake.url,
        ca.display(),
        key_file.display(),
        local.url()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    for status in [401, 403] {
        let refused = json!({"type": "error", "error": {"type": "authentication_error",
               "message": "invalid x-api-key"}})
        .to_string();
        fake.queue.lock().clear();
        for _ in 0..3 {
            fake.queue
                .lock()
                .push_back((status, vec![], refused.clone()));
        }
        let before = fake.requests().len();
        let (got, headers, body) = post(&chat, Some(&k), &chat_body("c")).await;
        assert_eq!(got, 200, "{status}: {body}");
        assert_eq!(headers["x-strata-upstream"], "local", "{status}");
        assert_eq!(
            fake.requests().len(),
            before + 1,
            "{status}: the refusing provider was asked once"
        );
    }
    let text = metrics_text(&gw).await;
    assert!(
        text.contains(
            r#"strata_gateway_upstream_failures_total{upstream="an",kind="key_refused"} 2"#
        ),
        "{text}"
    );
    gw.shutdown().await;
}

/// `count_tokens` for a model on a hosted Anthropic provider (no `apis:` listed, no
/// `/tokenize` there) is Anthropic's own `/v1/messages/count_tokens`, with the provider's
/// key and the model it is sent; with guardrails, a prompt they refuse never leaves.
#[tokio::test]
async fn count_tokens_for_an_anthropic_provider_model_is_counted_by_the_provider() {
    let (dir, ca, fake) = trusted("anthropic-count").await;
    let key_file = dir.write("anthropic.key", "sk-ant-file\n");
    let gw = gateway(&anthropic_yaml(&fake, &ca, &key_file)).await;
    let k = key(&gw, "t");
    let count = |gw: &strata_gateway::RunningGateway, body: Value| {
        let url = format!("{}/v1/messages/count_tokens", gw.url());
        let k = k.clone();
        async move {
            let resp = client()
                .post(url)
                .header("x-api-key", k)
                .header("anthropic-version", "2023-06-01")
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    let ask = json!({"model": "c", "system": "be brief",
        "messages": [{"role": "user", "content": "hello there"}]});
    let (status, body) = count(&gw, ask.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"input_tokens": 7}));
    let seen = fake.requests();
    let (path, h, sent) = seen.last().unwrap();
    assert_eq!(path, "/v1/messages/count_tokens");
    assert_eq!(h["x-api-key"], "sk-ant-file");
    assert_eq!(sent["model"], "claude-up");
    assert_eq!(sent["system"], "be brief");
    gw.shutdown().await;

    let guarded = format!(
        "{}guardrails:\n  patterns:\n    - {{kind: custom, regex: \"secret\", action: block}}\n",
        anthropic_yaml(&fake, &ca, &key_file)
    );
    let gw = gateway(&guarded).await;
    let k2 = key(&gw, "t");
    let before = fake.requests().len();
    let url = format!("{}/v1/messages/count_tokens", gw.url());
    let resp = client()
        .post(&url)
        .header("x-api-key", &k2)
        .json(&json!({"model": "c", "system": "the secret is 42",
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(
        fake.requests().len(),
        before,
        "the refused prompt never left"
    );
    let resp = client()
        .post(&url)
        .header("x-api-key", &k2)
        .json(&ask)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(fake.requests().len(), before + 1);
    gw.shutdown().await;
}
