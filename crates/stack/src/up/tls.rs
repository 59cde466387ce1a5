//! `strata up --tls`: a certificate authority made at each start and one certificate per
//! service it signed, so every hop of the stack speaks TLS and every client in it verifies
//! its server against that CA.
//!
//! The CA's private key never touches the disk: it signs the services' certificates here
//! and is dropped, so nothing can sign another certificate this stack would trust. The CA
//! certificate and the services' certificates and keys go into a fresh directory only this
//! user can read (keys `0600`), removed when the stack stops. Every certificate names
//! `localhost`, `127.0.0.1` and `::1`, and the front's `host` when it is a specific
//! address or name.
//!
//! Who serves what (each with its own key):
//! - `engine`: every engine replica's HTTP port (`--tls-cert`/`--tls-key`), and, with a KV
//!   tier or prefill/decode roles, its KV-transfer endpoint and client certificate
//!   (`--kv-tls --kv-tls-ca`, mutual TLS);
//! - `front`: the router, dashboard and controller port;
//! - `gateway`: the gateway (`server.tls`);
//! - `kv-tier`: the shared KV tier (`--tls-cert`/`--tls-key`, callers certified by the CA).
//!
//! Who trusts the CA: the router (`upstream_tls.ca`, `https://` engines), the control
//! loops' health checks and drains (the local driver's `caFile`), canary replicas (the same
//! driver settings), the gateway's upstream (`ca_file`), engines' KV pulls and the tier.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::pools::PoolSpec;

/// The stack's certificates could not be made or written.
#[derive(Debug, thiserror::Error)]
pub(super) enum StackTlsError {
    #[error("creating {}", path.display())]
    Create {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("making the stack's CA")]
    Ca(#[source] rcgen::Error),
    #[error("making the {service} certificate")]
    Leaf {
        service: &'static str,
        #[source]
        error: rcgen::Error,
    },
}

/// A service's certificate chain and key files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl CertFiles {
    /// As a server's files (no client certificates asked for).
    pub fn server(&self) -> strata_api::tls::TlsFiles {
        strata_api::tls::TlsFiles {
            cert: self.cert.clone(),
            key: self.key.clone(),
            client_ca: None,
        }
    }
}

/// The stack's CA and its services' certificates, on disk until this is dropped.
#[derive(Debug)]
pub(super) struct StackTls {
    dir: PathBuf,
    /// The CA certificate (PEM) every client of the stack trusts.
    pub ca: PathBuf,
    pub engine: CertFiles,
    pub front: CertFiles,
    pub gateway: CertFiles,
    pub kv_tier: CertFiles,
}

impl StackTls {
    /// A fresh CA and the services' certificates for a front on `host`, written to a new
    /// private directory under the system's temporary directory.
    pub fn generate(host: &str) -> Result<StackTls, StackTlsError> {
        let random: u64 = rand::random();
        let dir = std::env::temp_dir().join(format!(
            "strata-up-tls-{}-{random:016x}",
            std::process::id()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|error| StackTlsError::Create {
                path: dir.clone(),
                error,
            })?;
        // From here on, a failure removes the directory (Drop).
        let mut tls = StackTls {
            ca: dir.join("ca.pem"),
            engine: CertFiles::named(&dir, "engine"),
            front: CertFiles::named(&dir, "front"),
            gateway: CertFiles::named(&dir, "gateway"),
            kv_tier: CertFiles::named(&dir, "kv-tier"),
            dir,
        };
        tls.write_all(host)?;
        Ok(tls)
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn write_all(&mut self, host: &str) -> Result<(), StackTlsError> {
        let (ca, ca_key) = make_ca().map_err(StackTlsError::Ca)?;
        write_file(&self.ca, ca.pem().as_bytes(), 0o644)?;
        let names = subject_alt_names(host);
        for (service, files) in [
            ("engine", &self.engine),
            ("front", &self.front),
            ("gateway", &self.gateway),
            ("kv-tier", &self.kv_tier),
        ] {
            let (cert, key) = make_leaf(service, &names, &ca, &ca_key)
                .map_err(|error| StackTlsError::Leaf { service, error })?;
            write_file(&files.cert, cert.as_bytes(), 0o644)?;
            write_file(&files.key, key.as_bytes(), 0o600)?;
        }
        Ok(())
    }

    /// Gives every pool's engines their certificate, and mutual TLS on KV transfer where
    /// they move blocks (a prefill/decode role, or the shared tier).
    pub fn share_with(&self, pools: &mut [PoolSpec], with_tier: bool) {
        for p in pools {
            let args = &mut p.engine_args;
            args.push("--tls-cert".into());
            args.push(self.engine.cert.display().to_string());
            args.push("--tls-key".into());
            args.push(self.engine.key.display().to_string());
            if with_tier || p.role.is_some() {
                args.push("--kv-tls".into());
                args.push("--kv-tls-ca".into());
                args.push(self.ca.display().to_string());
            }
        }
    }
}

impl Drop for StackTls {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "removing the TLS directory");
        }
    }
}

impl CertFiles {
    fn named(dir: &Path, service: &str) -> CertFiles {
        CertFiles {
            cert: dir.join(format!("{service}.pem")),
            key: dir.join(format!("{service}-key.pem")),
        }
    }
}

/// The names every certificate carries: loopback by name and address, and the front's
/// host when it names one place (not `0.0.0.0` or `::`).
fn subject_alt_names(host: &str) -> Vec<String> {
    let mut names: Vec<String> = ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let unspecified = host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified());
    if !host.is_empty() && !unspecified && !names.iter().any(|n| n == host) {
        names.push(host.to_string());
    }
    names
}

/// A self-signed CA that may sign only end-entity certificates (path length 0).
fn make_ca() -> Result<(Certificate, KeyPair), rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(DnType::CommonName, "strata up CA");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key)?;
    Ok((cert, key))
}

/// A certificate for `service` naming `names`, for serving and for presenting as a client
/// (mutual TLS on KV transfer); its chain (leaf then CA) and key as PEM.
fn make_leaf(
    service: &str,
    names: &[String],
    ca: &Certificate,
    ca_key: &KeyPair,
) -> Result<(String, String), rcgen::Error> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names.to_vec())?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("strata {service}"));
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = params.signed_by(&key, ca, ca_key)?;
    Ok((format!("{}{}", cert.pem(), ca.pem()), key.serialize_pem()))
}

/// Writes `bytes` to a new file `path` with `mode`.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), StackTlsError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|error| StackTlsError::Create {
            path: path.to_path_buf(),
            error,
        })?;
    f.write_all(bytes).map_err(|error| StackTlsError::Write {
        path: path.to_path_buf(),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_fresh_private_ca_per_start_whose_certificates_load_and_are_removed_on_drop() {
        let a = StackTls::generate("127.0.0.1").unwrap();
        let b = StackTls::generate("127.0.0.1").unwrap();
        assert_ne!(a.dir(), b.dir());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(a.dir()), 0o700);
        assert_eq!(mode(&a.engine.key), 0o600);
        // No CA key on disk: only the CA certificate and the services' files.
        let mut files: Vec<String> = std::fs::read_dir(a.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            [
                "ca.pem",
                "engine-key.pem",
                "engine.pem",
                "front-key.pem",
                "front.pem",
                "gateway-key.pem",
                "gateway.pem",
                "kv-tier-key.pem",
                "kv-tier.pem"
            ]
        );
        // Each service's files make a server configuration; the CA makes a client's.
        for f in [&a.engine, &a.front, &a.gateway, &a.kv_tier] {
            strata_api::tls::ServerTls::load(f.server(), &[b"http/1.1"]).unwrap();
        }
        strata_api::tls::client_config(Some(&a.ca), None, &[]).unwrap();
        // Two starts, two CAs.
        assert_ne!(std::fs::read(&a.ca).unwrap(), std::fs::read(&b.ca).unwrap());
        let dir = a.dir().to_path_buf();
        drop(a);
        assert!(!dir.exists());
    }

    #[test]
    fn certificates_name_loopback_and_a_specific_front_host() {
        assert_eq!(
            subject_alt_names("127.0.0.1"),
            ["localhost", "127.0.0.1", "::1"]
        );
        assert_eq!(subject_alt_names("0.0.0.0").len(), 3);
        assert_eq!(subject_alt_names("[::]").len(), 3);
        assert_eq!(subject_alt_names("10.1.2.3")[3], "10.1.2.3");
        assert_eq!(subject_alt_names("gpu-box.lan")[3], "gpu-box.lan");
    }

    #[test]
    fn engines_get_their_certificate_and_kv_tls_only_where_blocks_move() {
        let tls = StackTls::generate("127.0.0.1").unwrap();
        let args = crate::up::UpArgs {
            prefill_replicas: Some(1),
            decode_replicas: Some(1),
            ..Default::default()
        };
        let c = super::super::config::StackConfig::load(&args).unwrap();
        let mut pd = c.pools().unwrap();
        tls.share_with(&mut pd, false);
        for p in &pd {
            let a = &p.engine_args;
            let at = |f: &str| a.iter().position(|x| x == f).unwrap();
            assert_eq!(PathBuf::from(&a[at("--tls-cert") + 1]), tls.engine.cert);
            assert_eq!(PathBuf::from(&a[at("--tls-key") + 1]), tls.engine.key);
            assert_eq!(PathBuf::from(&a[at("--kv-tls-ca") + 1]), tls.ca);
            assert!(a.contains(&"--kv-tls".to_string()));
        }
        let mut plain = super::super::config::StackConfig::default()
            .pools()
            .unwrap();
        tls.share_with(&mut plain, false);
        assert!(plain[0].engine_args.contains(&"--tls-cert".to_string()));
        assert!(!plain[0].engine_args.contains(&"--kv-tls".to_string()));
        let mut tiered = super::super::config::StackConfig::default()
            .pools()
            .unwrap();
        tls.share_with(&mut tiered, true);
        assert!(tiered[0].engine_args.contains(&"--kv-tls".to_string()));
    }
}
