//! A server's TLS configuration that follows its files on disk.

use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::{load_certs, load_key, load_roots, provider, TlsError, TlsFiles};

/// How often a handshake looks at the files' modification times (at most).
pub const RELOAD_CHECK: Duration = Duration::from_secs(2);

/// A server configuration built from [`TlsFiles`] and rebuilt when one of them changes:
/// the first handshake after [`RELOAD_CHECK`] compares the files' modification times and
/// sizes with those it loaded, and on a change builds a new configuration. A change that
/// does not load (a half-written file, a key that does not match) is logged and the old
/// configuration keeps serving until the files change again.
pub struct ServerTls {
    files: TlsFiles,
    alpn: Vec<Vec<u8>>,
    check_every: Duration,
    state: Mutex<State>,
}

struct State {
    config: Arc<ServerConfig>,
    stamps: Stamps,
    checked: Instant,
}

/// Modification time and size of each file, as last seen.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamps(Vec<Option<(SystemTime, u64)>>);

impl Stamps {
    fn read(files: &TlsFiles) -> Stamps {
        let stamp = |p: &Path| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        };
        let mut v = vec![stamp(&files.cert), stamp(&files.key)];
        if let Some(ca) = &files.client_ca {
            v.push(stamp(ca));
        }
        Stamps(v)
    }
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads the files; `alpn` lists the application protocols the server speaks (a
    /// client offering others only is refused; one offering none is served).
    pub fn load(files: TlsFiles, alpn: &[&[u8]]) -> Result<ServerTls, TlsError> {
        let alpn: Vec<Vec<u8>> = alpn.iter().map(|p| p.to_vec()).collect();
        let stamps = Stamps::read(&files);
        let config = build(&files, &alpn)?;
        Ok(ServerTls {
            files,
            alpn,
            check_every: RELOAD_CHECK,
            state: Mutex::new(State {
                config,
                stamps,
                checked: Instant::now(),
            }),
        })
    }

    /// Looks at the files at most this often (default [`RELOAD_CHECK`]).
    pub fn with_reload_check(mut self, every: Duration) -> Self {
        self.check_every = every;
        self
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The configuration for the next handshake, reloaded first when the files changed.
    pub fn config(&self) -> Arc<ServerConfig> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if now.duration_since(state.checked) >= self.check_every {
            state.checked = now;
            let stamps = Stamps::read(&self.files);
            if stamps != state.stamps {
                state.stamps = stamps;
                match build(&self.files, &self.alpn) {
                    Ok(config) => {
                        tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
                        state.config = config;
                    }
                    Err(e) => tracing::warn!(
                        error = %e,
                        "TLS files changed but do not load; keeping the previous certificate"
                    ),
                }
            }
        }
        state.config.clone()
    }

    /// Runs the server side of a handshake on `io`, failing if it takes longer than
    /// `within`.
    pub async fn accept<IO>(&self, io: IO, within: Duration) -> io::Result<TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let acceptor = TlsAcceptor::from(self.config());
        tokio::time::timeout(within, acceptor.accept(io))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))?
    }
}

fn build(files: &TlsFiles, alpn: &[Vec<u8>]) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = load_certs(&files.cert)?;
    let key = load_key(&files.key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let roots = Arc::new(load_roots(ca)?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| TlsError::Config(format!("client CA {}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(format!("{}: {e}", files.cert.display())))?;
    config.alpn_protocols = alpn.to_vec();
    Ok(Arc::new(config))
}
