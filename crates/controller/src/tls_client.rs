//! The controller's HTTP clients (replica health checks, `/metrics` scrapes, the picker's
//! held requests), verifying `https://` servers as every Strata client does
//! ([`strata_api::tls::client_config`]: the system's roots plus an operator's CA file).

use std::path::Path;

/// Why a client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientTlsError {
    /// The CA file does not load (the file is named).
    #[error(transparent)]
    Tls(#[from] strata_api::tls::TlsError),
    #[error("HTTP client: {0}")]
    Build(#[from] reqwest::Error),
}

/// A client for `http://` and `https://` servers, trusting `ca` (a PEM file) on top of the
/// system's roots when given.
pub fn http_client(ca: Option<&Path>) -> Result<reqwest::Client, ClientTlsError> {
    let config = strata_api::tls::client_config(ca, None, &[b"http/1.1"])?;
    Ok(reqwest::Client::builder()
        .use_preconfigured_tls((*config).clone())
        .build()?)
}
