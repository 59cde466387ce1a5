//! The controller's clients against `https://` replicas and pickers (a chain made here): a
//! scrape and a held-requests read trusting the CA (`tls.caFile`) are served; without it,
//! or trusting another CA, they fail; a CA file that does not load is an error naming it;
//! `tls:` in controller.yaml is checked.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::routing::get;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use strata_api::edge::{serve, EdgeLimits};
use strata_api::tls::TlsFiles;
use strata_controller::config::ControllerConfig;
use strata_controller::driver::ReplicaRegistrar;
use strata_controller::held::{spawn as held_spawn, HeldRequestsSource};
use strata_controller::signals::{EngineKind, MetricsScraper};
use strata_controller::tls_client::{http_client, ClientTlsError};

const PAGE: &str = "vllm:num_requests_running{model_name=\"m\"} 2\n\
                    vllm:num_requests_waiting{model_name=\"m\"} 1\n\
                    strata_router_flow_held_requests{pool=\"chat\"} 4\n";

/// A scratch folder removed at the end of the test.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!(
            "strata-controller-tls-{tag}-{}-{:x}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
}

/// A CA's certificate (PEM) and a leaf for 127.0.0.1 it signed (certificate, key).
fn chain(name: &str) -> (String, String, String) {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    let ca_key = KeyPair::generate().unwrap();
    let ca = p.self_signed(&ca_key).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &ca, &ca_key)
        .unwrap();
    (ca.pem(), leaf.pem(), leaf_key.serialize_pem())
}

/// An HTTPS server of `PAGE` at `/metrics` on loopback.
async fn https_metrics(cert: &Path, key: &Path) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route("/metrics", get(|| async { PAGE }));
    let limits = EdgeLimits {
        tls: Some(TlsFiles {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            client_ca: None,
        }),
        ..EdgeLimits::default()
    };
    tokio::spawn(serve(listener, app, limits, std::future::pending::<()>()));
    addr
}

#[tokio::test]
async fn scrapes_and_held_requests_verify_https_servers_against_the_configured_ca() {
    let dir = Dir::new("scrape");
    let (ca, cert, key) = chain("replicas CA");
    let (other_ca, _, _) = chain("another CA");
    let ca = dir.write("ca.pem", &ca);
    let other_ca = dir.write("other-ca.pem", &other_ca);
    let addr = https_metrics(&dir.write("c.pem", &cert), &dir.write("k.pem", &key)).await;
    let url = format!("https://{addr}");
    let timeout = Duration::from_secs(2);

    let trusting =
        MetricsScraper::with_client(EngineKind::Vllm, timeout, http_client(Some(&ca)).unwrap());
    let sample = trusting.scrape(&url).await.expect("served over TLS");
    assert_eq!((sample.running, sample.waiting), (2.0, 1.0));

    for client in [
        reqwest::Client::new(),
        http_client(Some(&other_ca)).unwrap(),
    ] {
        let refused = MetricsScraper::with_client(EngineKind::Vllm, timeout, client);
        assert!(refused.scrape(&url).await.is_err(), "an unverified server");
    }
    // Plain HTTP to the TLS port gets no page either.
    assert!(trusting.scrape(&format!("http://{addr}")).await.is_err());

    // The picker's held requests over HTTPS.
    let held = held_spawn(
        HeldRequestsSource {
            metrics_url: format!("{url}/metrics"),
            pool: Some("chat".into()),
            interval_ms: 20,
        },
        http_client(Some(&ca)).unwrap(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while held.held_requests() != 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never read over TLS"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // A CA file that does not load names itself.
    let bad = dir.write("bad.pem", "not a certificate");
    match http_client(Some(&bad)) {
        Err(e @ ClientTlsError::Tls(_)) => assert!(e.to_string().contains("bad.pem"), "{e}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

#[test]
fn tls_settings_in_controller_yaml_are_checked() {
    let c = ControllerConfig::parse(
        "tls:\n  caFile: /etc/strata/ca.pem\n  certFile: /c.pem\n  keyFile: /k.pem\n\
         driver:\n  kind: local\n  https: true\n  caFile: /etc/strata/ca.pem\n",
        "t",
    )
    .unwrap();
    let files = c.tls.server_files().unwrap();
    assert_eq!(files.cert, PathBuf::from("/c.pem"));
    let err = |y: &str| ControllerConfig::parse(y, "t").unwrap_err().to_string();
    assert!(err("tls:\n  certFile: /c.pem\n").contains("keyFile"));
    assert!(err("tls:\n  clientCaFile: /ca.pem\n").contains("clientCaFile"));
    assert!(err("tls:\n  bogus: 1\n").contains("bogus"));
    assert!(err("driver:\n  kind: local\n  caFile: /ca.pem\n").contains("https"));
}
