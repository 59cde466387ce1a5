//! `server:` in gateway.yaml: body and response bounds, the edge server's limits, and TLS.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Largest request body accepted, in bytes (413 above).
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Largest audio form accepted (`/v1/audio/*`, multipart), in bytes (413 above).
    #[serde(default = "default_max_audio")]
    pub max_audio_bytes: usize,
    /// Largest non-streamed upstream response read, in bytes.
    #[serde(default = "default_max_response")]
    pub max_response_bytes: usize,
    /// Seconds between re-reads of keys from the store (changes made by another process).
    #[serde(default = "default_key_refresh")]
    pub key_refresh_secs: u64,
    /// Edge bounds ([`strata_api::edge::EdgeLimits`]); each absent one keeps the edge
    /// server's default. Most connections open at once (more get a 503).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Time to receive a request head; it also closes a keep-alive connection idle that
    /// long (the edge server has one timer for both).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_timeout_ms: Option<u64>,
    /// Largest request head in bytes (431 above).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_header_bytes: Option<usize>,
    /// Grace for a request body before `body_min_bytes_per_sec` applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_timeout_ms: Option<u64>,
    /// Slowest sustained body upload accepted after the grace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_min_bytes_per_sec: Option<u64>,
    /// Serve HTTPS with this certificate (reloaded when its files change); with
    /// `client_ca`, clients must present a certificate that CA signed (mutual TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ServerTls>,
}

/// `server.tls`: PEM files, as the other services' `--tls-cert`, `--tls-key` and
/// `--tls-client-ca`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_body_bytes: default_max_body(),
            max_audio_bytes: default_max_audio(),
            max_response_bytes: default_max_response(),
            key_refresh_secs: default_key_refresh(),
            max_connections: None,
            header_timeout_ms: None,
            max_header_bytes: None,
            body_timeout_ms: None,
            body_min_bytes_per_sec: None,
            tls: None,
        }
    }
}

impl ServerConfig {
    /// The edge server's bounds: the defaults with this section's values over them.
    pub fn edge_limits(&self) -> strata_api::edge::EdgeLimits {
        let mut l = strata_api::edge::EdgeLimits::default();
        if let Some(n) = self.max_connections {
            l.max_connections = n;
        }
        if let Some(ms) = self.header_timeout_ms {
            l.header_timeout = Duration::from_millis(ms);
        }
        if let Some(n) = self.max_header_bytes {
            l.max_header_bytes = n;
        }
        if let Some(ms) = self.body_timeout_ms {
            l.body_timeout = Duration::from_millis(ms);
        }
        if let Some(r) = self.body_min_bytes_per_sec {
            l.body_min_bytes_per_sec = r;
        }
        l.tls = self.tls.as_ref().map(|t| strata_api::tls::TlsFiles {
            cert: t.cert.clone(),
            key: t.key.clone(),
            client_ca: t.client_ca.clone(),
        });
        l
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_audio_bytes == 0 {
            return Err(invalid("server.max_audio_bytes must be > 0"));
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes must be > 0"));
        }
        let zero = [
            ("max_connections", self.max_connections.map(|v| v as u64)),
            ("header_timeout_ms", self.header_timeout_ms),
            ("max_header_bytes", self.max_header_bytes.map(|v| v as u64)),
            ("body_timeout_ms", self.body_timeout_ms),
        ];
        if let Some((name, _)) = zero.iter().find(|(_, v)| *v == Some(0)) {
            return Err(invalid(format!("server.{name} must be > 0")));
        }
        if self.max_header_bytes.is_some_and(|n| n < 1024) {
            return Err(invalid("server.max_header_bytes must be at least 1024"));
        }
        Ok(())
    }
}

pub(super) fn default_max_body() -> usize {
    4 << 20
}
pub(super) fn default_max_response() -> usize {
    32 << 20
}
pub(super) fn default_key_refresh() -> u64 {
    5
}

/// OpenAI's limit on an audio upload: 25 MiB.
fn default_max_audio() -> usize {
    25 << 20
}
