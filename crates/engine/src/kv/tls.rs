//! TLS for the KV block protocol ([`super::transfer`]): what an engine or the tier serves
//! blocks over and what an engine connects to peers and the tier with.
//!
//! The protocol runs on a [`KvStream`], plain TCP or TLS over TCP; the frames are the same
//! bytes either way. [`KvConnector`] opens the client side (plain, or TLS verifying the
//! peer's certificate against the name it was addressed by, presenting this engine's own
//! certificate for mutual TLS); [`KvAcceptor`] runs the server side (plain, or TLS with
//! the certificate files reloaded when they change and, with a client CA, every caller
//! required to present a certificate that CA signed). Both speak ALPN [`ALPN`], so a TLS
//! client of another protocol is refused at the handshake.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use strata_api::tls::{load_certs, load_key, load_roots, ServerTls, TlsError, TlsFiles};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::TlsConnector;

/// The application protocol the block endpoint negotiates over TLS.
pub const ALPN: &[u8] = b"strata-kv/1";

/// What the block protocol reads and writes: a byte stream in both directions.
pub trait KvIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> KvIo for T {}

/// One block-protocol connection, plain or TLS.
pub type KvStream = Box<dyn KvIo>;

/// How an engine opens block connections: plain TCP, or TLS.
#[derive(Clone, Default)]
pub struct KvConnector {
    tls: Option<Arc<ClientConfig>>,
    /// Names this connector (and its clones) among the process's connectors, so pooled
    /// connections are reused only by the identity that opened them; 0 is plain TCP.
    id: u64,
}

impl std::fmt::Debug for KvConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvConnector")
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl KvConnector {
    /// Plain TCP (the default).
    pub fn plain() -> Self {
        Self::default()
    }

    /// TLS with `config` (offering ALPN [`ALPN`]; see [`KvTls::load`]).
    pub fn tls(config: Arc<ClientConfig>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self {
            tls: Some(config),
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The same trust and certificate for a peer's HTTP port (the `x-prefiller-host-port`
    /// phase 1 to a prefill engine): ALPN `http/1.1` in place of [`ALPN`].
    pub fn for_http(&self) -> Self {
        let tls = self.tls.as_ref().map(|c| {
            let mut c = ClientConfig::clone(c);
            c.alpn_protocols = vec![b"http/1.1".to_vec()];
            Arc::new(c)
        });
        Self { tls, id: self.id }
    }

    /// The same for this connector and its clones, different for any other TLS
    /// connector; 0 for plain TCP (for keying pooled connections).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Connects to `addr`; over TLS the peer's certificate must carry `host` (an IP SAN
    /// for an address, a DNS SAN for a name). The caller bounds the time this takes.
    pub async fn connect(&self, addr: SocketAddr, host: &str) -> io::Result<KvStream> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let Some(config) = &self.tls else {
            return Ok(Box::new(tcp));
        };
        let name = ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']'))
            .map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("`{host}` is not a TLS server name: {e}"),
                )
            })?
            .to_owned();
        let tls = TlsConnector::from(config.clone())
            .connect(name, tcp)
            .await?;
        Ok(Box::new(tls))
    }
}

/// How a block endpoint takes connections: plain TCP, or TLS.
#[derive(Clone, Default)]
pub struct KvAcceptor {
    tls: Option<Arc<ServerTls>>,
}

impl std::fmt::Debug for KvAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvAcceptor")
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl KvAcceptor {
    /// Plain TCP (the default).
    pub fn plain() -> Self {
        Self::default()
    }

    /// TLS with `server` (built with ALPN [`ALPN`]).
    pub fn tls(server: Arc<ServerTls>) -> Self {
        Self { tls: Some(server) }
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The server side of a connection: over TLS the handshake (and, with a client CA,
    /// the caller's certificate check) must finish within `within`.
    pub async fn accept(&self, tcp: TcpStream, within: Duration) -> io::Result<KvStream> {
        tcp.set_nodelay(true)?;
        match &self.tls {
            None => Ok(Box::new(tcp)),
            Some(tls) => Ok(Box::new(tls.accept(tcp, within).await?)),
        }
    }
}

/// A TLS server for the tier's or an engine's block endpoint from PEM files; with
/// `client_ca`, callers must present a certificate it signed (mutual TLS).
pub fn server_tls(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<KvAcceptor, TlsError> {
    let files = TlsFiles {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        client_ca: client_ca.map(Path::to_path_buf),
    };
    Ok(KvAcceptor::tls(Arc::new(ServerTls::load(files, &[ALPN])?)))
}

/// An engine's KV TLS (`--kv-tls`): its certificate and key, served on its block endpoint
/// and presented to peers and the tier, and the CA both directions verify against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvTlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// An engine's loaded KV TLS: the acceptor for its block endpoint (mutual TLS against
/// the CA) and the connector for its peers and tier (verifying them against the CA,
/// presenting its certificate).
#[derive(Debug, Clone)]
pub struct KvTls {
    pub acceptor: KvAcceptor,
    pub connector: KvConnector,
}

impl KvTls {
    /// Loads the files; a file that does not load is an error naming it.
    pub fn load(files: &KvTlsFiles) -> Result<Self, TlsError> {
        let acceptor = server_tls(&files.cert, &files.key, Some(&files.ca))?;
        Ok(Self {
            acceptor,
            connector: KvConnector::tls(peer_client_config(files)?),
        })
    }
}

/// What an engine dials peers and the tier with: only `files.ca` is trusted (not the
/// system's roots: a KV peer is one of the cluster's own services), and `files.cert` is
/// presented to the peer's mutual-TLS check.
fn peer_client_config(files: &KvTlsFiles) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(load_roots(&files.ca)?)
        .with_client_auth_cert(load_certs(&files.cert)?, load_key(&files.key)?)
        .map_err(|e| TlsError::Config(format!("client certificate: {e}")))?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(config))
}
