//! `--api-key` and `--admin-key` on a real engine over HTTP (issue 29): every route but
//! `/health`, `/version` and `/metrics` needs the API key, admin routes the admin key (or are
//! disabled without one), refusals are OpenAI-shaped 401/403s, and an engine started with
//! neither key serves as before.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use serde_json::{json, Value};
use strata_engine::auth::AuthOptions;
use strata_engine::server::{self, EngineOptions};

const MODEL: &str = "smollm2-135m-instruct";
const API: &str = "api-key-for-tests";
const ADMIN: &str = "admin-key-for-tests";

fn engine(auth: AuthOptions) -> SocketAddr {
    common::serve(&EngineOptions {
        num_blocks: Some(64),
        max_model_len: Some(256),
        auth,
        ..EngineOptions::default()
    })
}

fn keys(api: &[&str], admin: Option<&str>) -> AuthOptions {
    AuthOptions {
        api_keys: api.iter().map(|s| s.to_string()).collect(),
        admin_key: admin.map(str::to_string),
        protect_metrics: false,
    }
}

/// One exchange with an optional bearer key: the status, the response head and the body.
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &Value,
    key: Option<&str>,
) -> (u16, String, Value) {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(common::READ_TIMEOUT))
        .expect("timeout");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if let Some(k) = key {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("write head");
    let _ = s.write_all(body.as_bytes());
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let head = text
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_string();
    let (status, body) = common::parse_response(&raw);
    let v = serde_json::from_str(&body).unwrap_or(Value::String(body));
    (status, head, v)
}

fn completion() -> Value {
    json!({"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
}

/// An OpenAI-shaped 401 with the bearer challenge, naming nothing of the keys.
fn assert_401(what: &str, status: u16, head: &str, body: &Value) {
    assert_eq!(status, 401, "{what}: {body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{what}: {head}"
    );
    assert_eq!(
        body["error"]["type"], "authentication_error",
        "{what}: {body}"
    );
    assert_eq!(body["error"]["code"], "invalid_api_key", "{what}: {body}");
    let text = body.to_string();
    assert!(
        !text.contains(API) && !text.contains(ADMIN),
        "{what}: {text}"
    );
}

#[test]
fn api_and_admin_keys_guard_their_routes() {
    let addr = engine(keys(&[API, "second-key"], Some(ADMIN)));
    let tok = json!({"model": MODEL, "prompt": "Hello"});
    let api_routes: [(&str, &str, Value); 5] = [
        ("POST", "/v1/completions", completion()),
        (
            "POST",
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 1,
                   "messages": [{"role": "user", "content": "Hi"}]}),
        ),
        ("GET", "/v1/models", Value::Null),
        ("POST", "/tokenize", tok),
        (
            "POST",
            "/detokenize",
            json!({"model": MODEL, "tokens": [1, 2]}),
        ),
    ];
    for (method, path, body) in &api_routes {
        let (status, head, answer) = call(addr, method, path, body, None);
        assert_401(&format!("{path} without a key"), status, &head, &answer);
        let (status, head, answer) = call(addr, method, path, body, Some("wrong"));
        assert_401(&format!("{path} with a wrong key"), status, &head, &answer);
        for key in [API, "second-key", ADMIN] {
            let (status, _, answer) = call(addr, method, path, body, Some(key));
            assert_eq!(status, 200, "{path}: {answer}");
        }
    }
    // An unknown path is refused before it is looked up, then a 404 with the key.
    let (status, head, answer) = call(addr, "GET", "/v1/nothing", &Value::Null, None);
    assert_401("unknown path", status, &head, &answer);
    let (status, _, _) = call(addr, "GET", "/v1/nothing", &Value::Null, Some(API));
    assert_eq!(status, 404);

    // Open routes, as in vLLM.
    for path in ["/health", "/version", "/metrics"] {
        let (status, _, answer) = call(addr, "GET", path, &Value::Null, None);
        assert_eq!(status, 200, "{path}: {answer}");
    }

    // Admin routes: no key or a wrong one 401, the API key 403, the admin key passes.
    let lora = json!({"lora_name": "a", "lora_path": "/etc/shadow"});
    for (path, body) in [
        ("/reset_prefix_cache", Value::Null),
        ("/v1/load_lora_adapter", lora.clone()),
        ("/v1/unload_lora_adapter", json!({"lora_name": "a"})),
    ] {
        let (status, head, answer) = call(addr, "POST", path, &body, None);
        assert_401(path, status, &head, &answer);
        let (status, head, answer) = call(addr, "POST", path, &body, Some("wrong"));
        assert_401(path, status, &head, &answer);
        let (status, _, answer) = call(addr, "POST", path, &body, Some(API));
        assert_eq!(status, 403, "{path}: {answer}");
        assert_eq!(answer["error"]["type"], "permission_error", "{answer}");
    }
    let (status, _, answer) = call(
        addr,
        "POST",
        "/reset_prefix_cache",
        &Value::Null,
        Some(ADMIN),
    );
    assert_eq!(status, 200, "{answer}");
    // Past the key, the route's own checks answer (LoRA is off on this engine).
    let (status, _, answer) = call(addr, "POST", "/v1/load_lora_adapter", &lora, Some(ADMIN));
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["param"], "lora_name", "{answer}");

    // Refusals are counted under their route like any answer.
    let (_, _, metrics) = call(addr, "GET", "/metrics", &Value::Null, None);
    let metrics = metrics.as_str().unwrap_or_default().to_string();
    assert!(
        metrics.lines().any(|l| l.starts_with("http_requests_total")
            && l.contains("handler=\"/v1/completions\"")
            && l.contains("status=\"4xx\"")),
        "{metrics}"
    );
}

#[test]
fn api_key_alone_disables_admin_routes_and_protected_metrics_need_it() {
    let addr = engine(AuthOptions {
        protect_metrics: true,
        ..keys(&[API], None)
    });
    for key in [None, Some(API)] {
        let (status, _, answer) = call(addr, "POST", "/reset_prefix_cache", &Value::Null, key);
        assert_eq!(status, 403, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("disabled") && message.contains("--admin-key"),
            "{answer}"
        );
    }
    let (status, head, answer) = call(addr, "GET", "/metrics", &Value::Null, None);
    assert_401("/metrics", status, &head, &answer);
    let (status, _, _) = call(addr, "GET", "/metrics", &Value::Null, Some(API));
    assert_eq!(status, 200);
    let (status, _, _) = call(addr, "GET", "/health", &Value::Null, None);
    assert_eq!(status, 200);
}

#[test]
fn without_keys_the_engine_is_open_and_bad_keys_stop_the_start() {
    let addr = engine(AuthOptions::default());
    let (status, _, answer) = call(addr, "POST", "/v1/completions", &completion(), None);
    assert_eq!(status, 200, "{answer}");
    let (status, _, answer) = call(addr, "POST", "/reset_prefix_cache", &Value::Null, None);
    assert_eq!(status, 200, "{answer}");

    for bad in [
        keys(&[""], None),
        keys(&["two words"], None),
        keys(&[], Some("")),
    ] {
        let opts = EngineOptions {
            model_path: common::model_path(),
            model_name: MODEL.into(),
            auth: bad,
            ..EngineOptions::default()
        };
        match server::load(&opts) {
            Err(e) => assert!(e.to_string().contains("key"), "{e}"),
            Ok(_) => panic!("a bad key was accepted"),
        }
    }
}
