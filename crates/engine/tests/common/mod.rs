//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::PathBuf;

pub mod kv_engine;
pub mod reference_fixture;

/// The default model: `$STRATA_TEST_MODEL`, else the cache entry that `strata model pull`
/// writes. A missing model fails the test with what to run; it is never skipped.
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let cache = strata_engine::model_cache::ModelCache::from_env();
    let path = cache.path_of(strata_engine::model_cache::DEFAULT_MODEL);
    assert!(
        path.is_file(),
        "the default model is missing at {}; run `cargo run -p strata-cli -- model pull` \
         (scripts/test.sh does this first)",
        path.display()
    );
    path
}

/// The embedding model's directory: `$STRATA_TEST_EMBED_MODEL`, else the cache entry
/// `strata model pull all-minilm-l6-v2` writes. A missing model fails the test with what to
/// run; it is never skipped.
pub fn embedding_model_dir() -> PathBuf {
    use strata_engine::model_cache::{ModelCache, EMBEDDING_MODEL};
    if let Some(p) = std::env::var_os("STRATA_TEST_EMBED_MODEL") {
        return PathBuf::from(p);
    }
    let dir = ModelCache::from_env().path_of(EMBEDDING_MODEL);
    assert!(
        dir.join("model.safetensors").is_file(),
        "the embedding model is missing at {}; run `cargo run -p strata-cli -- model pull \
         {EMBEDDING_MODEL}` (scripts/test.sh does this first)",
        dir.display()
    );
    dir
}

/// Serves the default model with `opts` on a loopback port, in process, on a runtime thread
/// of its own; returns the address once it is listening.
pub fn serve(opts: &strata_engine::server::EngineOptions) -> std::net::SocketAddr {
    serve_model(&model_path(), opts)
}

/// Serves the model file at `model` (the default model, or a link to it) like [`serve`].
pub fn serve_model(
    model: &std::path::Path,
    opts: &strata_engine::server::EngineOptions,
) -> std::net::SocketAddr {
    use strata_engine::server;
    let loaded = server::load(&server::EngineOptions {
        model_path: model.to_path_buf(),
        model_name: "smollm2-135m-instruct".into(),
        ..opts.clone()
    })
    .expect("load the model");
    serve_app(server::router(loaded.state.clone()), loaded.state)
}

/// Serves `app` on a loopback port on a runtime thread of its own, keeping `state` alive
/// with it; returns the address once it is listening.
pub fn serve_app<S: Send + Sync + 'static>(
    app: axum::Router,
    state: std::sync::Arc<S>,
) -> std::net::SocketAddr {
    strata_mock::serve_on_thread(app, state).expect("serve on a thread of its own")
}

/// How long a test waits for an answer before calling the server hung (a long generation
/// on a loaded 2-core machine takes minutes).
pub const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// A minimal HTTP/1.1 exchange (`Connection: close`); a chunked body is de-chunked.
pub fn request(addr: std::net::SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(READ_TIMEOUT)).expect("timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    // A server may answer (and close) before reading a refused body.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    parse_response(&raw)
}

/// The status and (de-chunked) body of one raw HTTP/1.1 response.
pub fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("header end");
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, body)
}

/// A chunked transfer-encoded body, decoded.
pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// An encoder (`embed_server`) loaded with `opts` and served on a thread of its own: its
/// address and its state, for looking inside.
pub fn serve_encoder(
    opts: &strata_engine::server::EngineOptions,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<strata_engine::embed::server::EmbedState>,
) {
    use strata_engine::embed::server as embed_server;
    let loaded = embed_server::load(opts).expect("load the encoder");
    let state = loaded.state.clone();
    let addr = serve_app(embed_server::router(loaded.state.clone()), loaded.state);
    (addr, state)
}

/// A POST of `body`; the answer as JSON (a string when it is not JSON).
pub fn post(
    addr: std::net::SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let (status, text) = request(addr, "POST", path, body.to_string().as_bytes());
    let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, v)
}
