//! `https://` upstreams in the default build: an upstream served over TLS on loopback
//! with a certificate chain made here (rcgen) answers through the gateway when the
//! upstream's `ca_file` holds the CA, and is a clear 503 without it (its certificate
//! is not trusted), or when the name it presents is not the one dialled.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::tls::{self, Dir, Leaf};
use common::*;
use strata_api::tls::TlsFiles;
use strata_mock::MockConfig;

/// A CA and a server certificate it signs for `names`: (CA PEM, server files).
fn chain(dir: &Dir, names: &[&str]) -> (PathBuf, TlsFiles) {
    tls::chain(
        dir,
        "t",
        Leaf {
            names,
            ..Default::default()
        },
    )
}

/// A mock engine serving `m` over HTTPS with `files`; its `https://127.0.0.1:PORT` URL.
async fn tls_mock(files: TlsFiles) -> (String, tokio::sync::oneshot::Sender<()>) {
    let app = strata_mock::app(
        MockConfig {
            model: "m".into(),
            output_tokens: 4,
            ttft: Duration::ZERO,
            itl: Duration::ZERO,
            ..Default::default()
        },
        "tls".into(),
    );
    tls::serve_tls(app, files).await
}

fn yaml(url: &str, ca: Option<&PathBuf>) -> String {
    let ca = ca.map_or(String::new(), |p| format!(", ca_file: \"{}\"", p.display()));
    format!(
        "upstreams:\n  - {{name: up, base_url: \"{url}\"{ca}}}\nmodels:\n  - name: m\n    targets: [{{upstream: up}}]\n"
    )
}

#[tokio::test]
async fn https_upstream_with_ca_file_answers_and_without_it_is_a_clear_503() {
    let dir = Dir::new("ca");
    let (ca, files) = chain(&dir, &["127.0.0.1", "localhost"]);
    let (url, _stop) = tls_mock(files).await;

    // Trusted through `ca_file`: the answer comes back, streamed and not.
    let gw = gateway(&yaml(&url, Some(&ca))).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let (status, _, body) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    let mut streamed = chat_body("m");
    streamed["stream"] = serde_json::json!(true);
    let text = client()
        .post(&chat)
        .bearer_auth(&k)
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("data: [DONE]"), "{text}");
    gw.shutdown().await;

    // System roots only: the test CA is unknown, so every try fails at the handshake and
    // the client hears a 503 in OpenAI's shape.
    let gw = gateway(&yaml(&url, None)).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let (status, _, body) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 503, "{body}");
    let e = assert_openai_error(&body);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("could not be reached"),
        "{body}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn https_upstream_with_a_wrong_host_name_is_refused() {
    let dir = Dir::new("name");
    // The certificate names another host than the one dialled (127.0.0.1).
    let (ca, files) = chain(&dir, &["other.test"]);
    let (url, _stop) = tls_mock(files).await;
    let gw = gateway(&yaml(&url, Some(&ca))).await;
    let k = key(&gw, "t");
    let chat = format!("{}/v1/chat/completions", gw.url());
    let (status, _, body) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 503, "{body}");
    assert_openai_error(&body);
    gw.shutdown().await;
}

#[test]
fn ca_file_is_checked_at_load() {
    use strata_gateway::config::Resolved;
    use strata_gateway::Config;
    let dir = Dir::new("load");
    // A missing file and a file with no certificate are refused at load, naming the upstream.
    let missing = dir.0.join("nope.pem");
    let empty = dir.write("empty.pem", "not a certificate\n");
    for ca in [&missing, &empty] {
        let cfg = Config::from_yaml(&yaml("https://127.0.0.1:9", Some(ca))).unwrap();
        let err = Resolved::new(cfg).expect_err("bad ca_file").to_string();
        assert!(err.contains("upstream `up`: ca_file"), "{err}");
    }
    // `ca_file` on a plain http:// upstream is a mistake worth hearing about.
    let err = Config::from_yaml(&yaml("http://127.0.0.1:9", Some(&missing)))
        .expect_err("http with ca_file")
        .to_string();
    assert!(err.contains("needs an https:// base_url"), "{err}");
}

/// `server.tls`: the gateway itself serves HTTPS with the certificate in its config; a
/// client trusting the CA is answered, a plain-HTTP client is not.
#[tokio::test]
async fn the_gateway_serves_https_with_server_tls() {
    let dir = Dir::new("listener");
    let (ca, files) = chain(&dir, &["127.0.0.1", "localhost"]);
    let upstream = mock("m").await;
    let yaml = format!(
        "server:\n  tls: {{cert: \"{}\", key: \"{}\"}}\nupstreams:\n  - {{name: up, base_url: \"{}\"}}\nmodels:\n  - name: m\n    targets: [{{upstream: up}}]\n",
        files.cert.display(),
        files.key.display(),
        upstream.url()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&ca).unwrap()).unwrap();
    let trusting = reqwest::Client::builder()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    let url = format!("https://127.0.0.1:{}/v1/chat/completions", gw.addr.port());
    let resp = trusting
        .post(&url)
        .bearer_auth(&k)
        .json(&chat_body("m"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // Plain HTTP on the same port gets no answer (the server expects a TLS handshake).
    let plain = format!("http://127.0.0.1:{}/v1/chat/completions", gw.addr.port());
    let r = client()
        .post(&plain)
        .bearer_auth(&k)
        .json(&chat_body("m"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(r.is_err() || r.is_ok_and(|r| r.status() != 200));
    gw.shutdown().await;
}
