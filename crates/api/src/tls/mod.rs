//! TLS for Strata's servers and clients (feature `http`): rustls on the `ring` provider,
//! certificates and keys read from PEM files.
//!
//! * [`server`]: [`ServerTls`], a server configuration that follows its files: when the
//!   certificate, key or client CA file changes on disk the next handshake (at most every
//!   [`server::RELOAD_CHECK`]) uses the new one; a new file that does not load is logged and
//!   the old certificate stays. With a client CA, clients must present a certificate it
//!   signed (mutual TLS).
//! * [`client`]: [`client_config`], what a Strata client verifies servers with: the system's
//!   roots plus an optional CA file, and an optional client certificate for mutual TLS.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

pub mod client;
pub mod server;

pub use client::client_config;
pub use server::ServerTls;

/// A server's certificate files: the chain (leaf first) and its key, and optionally the CA
/// whose certificates clients must present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// A client's certificate and key, for mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file is missing, unreadable, or holds no usable PEM item.
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
    /// The files load but do not make a configuration (a key that does not match the
    /// certificate, a CA file rustls rejects).
    #[error("TLS configuration: {0}")]
    Config(String),
}

impl From<TlsError> for std::io::Error {
    fn from(e: TlsError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
    }
}

/// The one provider every configuration is built on.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn file_error(path: &Path, reason: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Every certificate in a PEM file, in order; at least one.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e))?;
    if certs.is_empty() {
        return Err(file_error(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The first private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| file_error(path, e))
}

/// A root store holding every certificate of a PEM file.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots
            .add(cert)
            .map_err(|e| file_error(path, format!("not a CA certificate: {e}")))?;
    }
    Ok(roots)
}
