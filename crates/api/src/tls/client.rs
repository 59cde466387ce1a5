//! What a Strata client trusts: the system's roots plus an operator's CA file, and the
//! certificate it presents when a server asks for one.

use std::path::Path;
use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore};

use super::{load_certs, load_key, load_roots, provider, Identity, TlsError};

/// A client configuration verifying servers against the system's roots and, when given,
/// every certificate in `ca` (a PEM file); presenting `identity` when given (mutual TLS).
/// `alpn` lists the protocols offered (`http/1.1`, `h2`), most preferred first.
pub fn client_config(
    ca: Option<&Path>,
    identity: Option<&Identity>,
    alpn: &[&[u8]],
) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = system_roots();
    if let Some(ca) = ca {
        roots.roots.extend(load_roots(ca)?.roots);
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots);
    let mut config = match identity {
        Some(id) => builder
            .with_client_auth_cert(load_certs(&id.cert)?, load_key(&id.key)?)
            .map_err(|e| TlsError::Config(format!("client certificate: {e}")))?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The operating system's trusted roots; a certificate the platform store holds but rustls
/// cannot parse is skipped (and an unreadable store leaves only the operator's CA).
fn system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::debug!(error = %e, "system certificate store");
    }
    let (added, skipped) = roots.add_parsable_certificates(found.certs);
    tracing::debug!(added, skipped, "system roots loaded");
    roots
}
