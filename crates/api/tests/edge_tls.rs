//! The edge server over TLS, with a certificate chain made here: a client trusting the CA
//! is served; a client trusting another CA, or asking for another name, is refused at the
//! handshake; with a client CA, a client without a certificate is refused and one with a
//! certificate the CA signed is served; a renewed certificate is picked up from its file
//! (and a broken one is not); a handshake that never comes is cut at the head timeout.
#![cfg(feature = "http")]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use strata_api::edge::{serve, EdgeArgs, EdgeLimits};
use strata_api::tls::{client_config, Identity, TlsFiles};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::TlsConnector;

/// A CA made for one test.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// A leaf for `names` (DNS names or IP addresses): certificate and key, PEM.
    fn issue(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> (String, String) {
        let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
        p.distinguished_name.push(DnType::CommonName, names[0]);
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A scratch folder removed at the end of the test.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!(
            "strata-edge-tls-{tag}-{}-{:?}",
            std::process::id(),
            Instant::now()
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

/// A server certificate for `localhost` and 127.0.0.1 from `ca`, written to `dir`.
fn server_files(dir: &Dir, ca: &Ca, client_ca: Option<PathBuf>) -> TlsFiles {
    let (cert, key) = ca.issue(
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    TlsFiles {
        cert: dir.write("server.pem", &cert),
        key: dir.write("server.key", &key),
        client_ca,
    }
}

async fn start(
    files: TlsFiles,
    limits: EdgeLimits,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = Router::new().route("/health", get(|| async { "ok" }));
    let limits = EdgeLimits {
        tls: Some(files),
        ..limits
    };
    tokio::spawn(serve(listener, app, limits, async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

fn trusting(ca_file: &Path, identity: Option<&Identity>) -> Arc<ClientConfig> {
    client_config(Some(ca_file), identity, &[b"http/1.1"]).unwrap()
}

/// `GET /health` over TLS to `addr`, asking for `name`: the answer, or why it failed.
async fn https_get(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    name: &str,
) -> Result<String, String> {
    let work = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let name = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
        let mut tls = TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tls.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut out = Vec::new();
        let read = tls.read_to_end(&mut out).await;
        let text = String::from_utf8_lossy(&out).into_owned();
        match read {
            // A server that closes without close_notify still answered in full.
            Err(e) if text.is_empty() => Err(format!("read: {e}")),
            _ => Ok(text),
        }
    };
    tokio::time::timeout(Duration::from_secs(5), work)
        .await
        .map_err(|_| "timed out".to_string())?
}

fn served(answer: &Result<String, String>) -> bool {
    matches!(answer, Ok(text) if text.starts_with("HTTP/1.1 200") && text.ends_with("ok"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trusting_the_ca_is_served_and_others_are_refused() {
    let dir = Dir::new("chain");
    let ca = Ca::new("strata test CA");
    let ca_file = dir.write("ca.pem", &ca.cert.pem());
    let (addr, _stop) = start(server_files(&dir, &ca, None), EdgeLimits::default()).await;

    let ok = https_get(addr, trusting(&ca_file, None), "localhost").await;
    assert!(served(&ok), "{ok:?}");
    let by_ip = https_get(addr, trusting(&ca_file, None), "127.0.0.1").await;
    assert!(served(&by_ip), "{by_ip:?}");

    // Another CA: the server's certificate is not trusted.
    let other = Ca::new("another CA");
    let other_file = dir.write("other.pem", &other.cert.pem());
    let wrong_ca = https_get(addr, trusting(&other_file, None), "localhost").await;
    assert!(
        matches!(&wrong_ca, Err(e) if e.starts_with("handshake") && e.to_lowercase().replace(" ", "").contains("unknownissuer")),
        "{wrong_ca:?}"
    );
    // The right CA but another name.
    let wrong_name = https_get(addr, trusting(&ca_file, None), "engine.example").await;
    assert!(
        matches!(&wrong_name, Err(e) if e.starts_with("handshake") && e.contains("not valid for name")),
        "{wrong_name:?}"
    );
    // Plain HTTP to the TLS port gets no HTTP answer.
    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut out)).await;
    assert!(!String::from_utf8_lossy(&out).contains("200"));
    // The server still serves.
    assert!(served(
        &https_get(addr, trusting(&ca_file, None), "localhost").await
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_a_client_without_a_certificate_the_ca_signed() {
    let dir = Dir::new("mtls");
    let ca = Ca::new("strata test CA");
    let ca_file = dir.write("ca.pem", &ca.cert.pem());
    let clients = Ca::new("strata clients CA");
    let clients_file = dir.write("clients.pem", &clients.cert.pem());
    let files = server_files(&dir, &ca, Some(clients_file));
    let (addr, _stop) = start(files, EdgeLimits::default()).await;

    let anonymous = https_get(addr, trusting(&ca_file, None), "localhost").await;
    assert!(!served(&anonymous), "{anonymous:?}");

    let (cert, key) = clients.issue(&["router"], ExtendedKeyUsagePurpose::ClientAuth);
    let id = Identity {
        cert: dir.write("router.pem", &cert),
        key: dir.write("router.key", &key),
    };
    let signed = https_get(addr, trusting(&ca_file, Some(&id)), "localhost").await;
    assert!(served(&signed), "{signed:?}");

    // A client certificate from a CA the server does not name is refused too.
    let (cert, key) = ca.issue(&["intruder"], ExtendedKeyUsagePurpose::ClientAuth);
    let stranger = Identity {
        cert: dir.write("intruder.pem", &cert),
        key: dir.write("intruder.key", &key),
    };
    let refused = https_get(addr, trusting(&ca_file, Some(&stranger)), "localhost").await;
    assert!(!served(&refused), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_picked_up_and_a_broken_one_is_not() {
    let dir = Dir::new("reload");
    let ca = Ca::new("strata test CA");
    let ca_file = dir.write("ca.pem", &ca.cert.pem());
    let files = server_files(&dir, &ca, None);
    let (addr, _stop) = start(files.clone(), EdgeLimits::default()).await;
    let client = || trusting(&ca_file, None);
    assert!(served(&https_get(addr, client(), "localhost").await));
    assert!(https_get(addr, client(), "renewed.test").await.is_err());

    // A broken certificate file: the old certificate keeps serving.
    std::fs::write(&files.cert, "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    tokio::time::sleep(strata_api::tls::server::RELOAD_CHECK + Duration::from_millis(300)).await;
    let kept = https_get(addr, client(), "localhost").await;
    assert!(served(&kept), "{kept:?}");

    // A renewed certificate for another name: used from the next check on.
    let (cert, key) = ca.issue(&["renewed.test"], ExtendedKeyUsagePurpose::ServerAuth);
    std::fs::write(&files.key, key).unwrap();
    std::fs::write(&files.cert, cert).unwrap();
    tokio::time::sleep(strata_api::tls::server::RELOAD_CHECK + Duration::from_millis(300)).await;
    // The first handshake after the interval triggers the check and already uses it.
    let renewed = https_get(addr, client(), "renewed.test").await;
    assert!(served(&renewed), "{renewed:?}");
    let old_name = https_get(addr, client(), "localhost").await;
    assert!(
        matches!(&old_name, Err(e) if e.contains("not valid for name")),
        "{old_name:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_that_never_comes_is_cut_at_the_head_timeout() {
    let dir = Dir::new("slow");
    let ca = Ca::new("strata test CA");
    let ca_file = dir.write("ca.pem", &ca.cert.pem());
    let limits = EdgeLimits {
        header_timeout: Duration::from_secs(1),
        max_connections: 4,
        ..EdgeLimits::default()
    };
    let (addr, _stop) = start(server_files(&dir, &ca, None), limits).await;
    // Four silent connections fill the cap; one more is refused with a 503 over TLS.
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = https_get(addr, trusting(&ca_file, None), "localhost").await;
    assert!(
        matches!(&refused, Ok(t) if t.starts_with("HTTP/1.1 503") && t.contains("too_many_connections")),
        "{refused:?}"
    );
    // Each silent one is closed at the head timeout, freeing its slot.
    let started = Instant::now();
    for s in &mut silent {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
        assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "{n:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(3));
    let ok = https_get(addr, trusting(&ca_file, None), "localhost").await;
    assert!(served(&ok), "{ok:?}");
}

#[tokio::test]
async fn certificate_files_that_do_not_load_stop_the_server_with_a_clear_error() {
    let dir = Dir::new("bad");
    let ca = Ca::new("strata test CA");
    let good = server_files(&dir, &ca, None);
    let cases = [
        TlsFiles {
            cert: dir.0.join("missing.pem"),
            ..good.clone()
        },
        TlsFiles {
            cert: dir.write("empty.pem", ""),
            ..good.clone()
        },
        TlsFiles {
            key: dir.write("nokey.pem", &ca.cert.pem()),
            ..good.clone()
        },
        TlsFiles {
            key: dir.write("other.key", &KeyPair::generate().unwrap().serialize_pem()),
            ..good.clone()
        },
        TlsFiles {
            client_ca: Some(dir.write("garbage-ca.pem", "hello")),
            ..good.clone()
        },
    ];
    for files in cases {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let limits = EdgeLimits {
            tls: Some(files.clone()),
            ..EdgeLimits::default()
        };
        let ended = tokio::time::timeout(
            Duration::from_secs(5),
            serve(listener, Router::new(), limits, std::future::pending()),
        )
        .await
        .expect("serve returns at once");
        let err = ended.expect_err("bad files are an error");
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::InvalidInput,
            "{files:?}: {err}"
        );
    }
}

#[test]
fn tls_flags_come_in_pairs() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        edge: EdgeArgs,
    }
    let cli = Cli::try_parse_from(["x", "--tls-cert", "c.pem", "--tls-key", "k.pem"]).unwrap();
    let files = cli.edge.limits().tls.unwrap();
    assert_eq!(files.cert, PathBuf::from("c.pem"));
    assert_eq!(files.client_ca, None);
    assert!(Cli::try_parse_from(["x", "--tls-cert", "c.pem"]).is_err());
    assert!(Cli::try_parse_from(["x", "--tls-key", "k.pem"]).is_err());
    assert!(Cli::try_parse_from(["x", "--tls-client-ca", "ca.pem"]).is_err());
    assert_eq!(Cli::try_parse_from(["x"]).unwrap().edge.limits().tls, None);
}
