//! Certificate chains made in a test (rcgen): a CA, leaves it signs, written as PEM files
//! into a scratch folder removed at the end.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Instant;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use strata_api::tls::{Identity, TlsFiles};

pub use rcgen::ExtendedKeyUsagePurpose as Usage;

pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A leaf for `names` (DNS names or IP addresses): certificate and key, PEM.
    pub fn issue(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> (String, String) {
        let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
        p.distinguished_name.push(DnType::CommonName, names[0]);
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!(
            "strata-router-tls-{tag}-{}-{:?}",
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

    /// `ca`'s certificate as a file.
    pub fn ca_file(&self, name: &str, ca: &Ca) -> PathBuf {
        self.write(name, &ca.pem())
    }

    /// A server certificate for `names` from `ca`, written here.
    pub fn server(
        &self,
        tag: &str,
        ca: &Ca,
        names: &[&str],
        client_ca: Option<PathBuf>,
    ) -> TlsFiles {
        let (cert, key) = ca.issue(names, Usage::ServerAuth);
        TlsFiles {
            cert: self.write(&format!("{tag}.pem"), &cert),
            key: self.write(&format!("{tag}.key"), &key),
            client_ca,
        }
    }

    /// A client certificate named `name` from `ca`, written here.
    pub fn client(&self, name: &str, ca: &Ca) -> Identity {
        let (cert, key) = ca.issue(&[name], Usage::ClientAuth);
        Identity {
            cert: self.write(&format!("{name}.pem"), &cert),
            key: self.write(&format!("{name}.key"), &key),
        }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
