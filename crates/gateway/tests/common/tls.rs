//! Certificate chains made in a test (rcgen) and a loopback server speaking TLS with one,
//! for the tests of `https://` upstreams.

use std::path::PathBuf;
use std::time::Instant;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use strata_api::edge::EdgeLimits;
use strata_api::tls::TlsFiles;

/// A scratch folder for PEM files, removed at the end.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!(
            "strata-gw-tls-{tag}-{}-{:?}",
            std::process::id(),
            Instant::now()
        ));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
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

/// How the server's certificate is made.
#[derive(Clone, Copy, Default)]
pub struct Leaf<'a> {
    /// The names it is issued for (default `127.0.0.1` and `localhost`).
    pub names: &'a [&'a str],
    /// Valid only in 2020: long expired.
    pub expired: bool,
}

/// A CA and a server certificate it signs: (CA PEM, server files), written as
/// `<tag>-ca.pem`, `<tag>-server.pem` and `<tag>-server.key`.
pub fn chain(dir: &Dir, tag: &str, leaf: Leaf<'_>) -> (PathBuf, TlsFiles) {
    let names: &[&str] = if leaf.names.is_empty() {
        &["127.0.0.1", "localhost"]
    } else {
        leaf.names
    };
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(DnType::CommonName, format!("test ca {tag}"));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().unwrap();
    let ca = p.self_signed(&ca_key).unwrap();
    let mut params =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    params.distinguished_name.push(DnType::CommonName, names[0]);
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    if leaf.expired {
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2020, 12, 31);
    }
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    (
        dir.write(&format!("{tag}-ca.pem"), &ca.pem()),
        TlsFiles {
            cert: dir.write(&format!("{tag}-server.pem"), &cert.pem()),
            key: dir.write(&format!("{tag}-server.key"), &key.serialize_pem()),
            client_ca: None,
        },
    )
}

/// Serves `app` over HTTPS with `files` on loopback: its `https://127.0.0.1:PORT` URL and
/// the sender that stops it (dropping it stops it too).
pub async fn serve_tls(
    app: axum::Router,
    files: TlsFiles,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = EdgeLimits {
        tls: Some(files),
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(strata_api::edge::serve(listener, app, limits, async move {
        let _ = rx.await;
    }));
    (format!("https://{addr}"), tx)
}
