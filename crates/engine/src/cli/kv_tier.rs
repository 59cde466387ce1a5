//! `strata kv-tier`: the machine's shared KV tier ([`crate::kv::tier`]) on its own port.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::kv::tier::{parse_bytes, run_tier, TierConfig, TierOptions};
use crate::kv::tls::{server_tls, KvAcceptor};

/// `strata kv-tier`: keeps blocks engines evicted (memory, then disk) and serves them to
/// engines of the same model and shape.
#[derive(Debug, Clone, clap::Args)]
pub struct KvTierArgs {
    /// Address the tier's block-transfer endpoint listens on.
    #[arg(long, default_value = "127.0.0.1:5600")]
    pub listen: SocketAddr,
    /// Memory bound for blocks (e.g. 512MiB, 2GiB, 1000000).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub memory_bytes: u64,
    /// A directory for blocks pushed out of memory (its block files are cleared at start).
    #[arg(long, value_name = "DIR")]
    pub disk_dir: Option<PathBuf>,
    /// Disk bound for blocks (with --disk-dir).
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pub disk_bytes: u64,
    /// Serve the block endpoint over TLS with this certificate (PEM, leaf first; reloaded
    /// when the file changes).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: engines must present a certificate this CA (PEM) signed; others are
    /// refused at the handshake.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

/// Serves the tier until Ctrl-C or SIGTERM.
pub async fn run_kv_tier(args: KvTierArgs) -> anyhow::Result<()> {
    let config = TierConfig {
        memory_bytes: args.memory_bytes,
        disk: args.disk_dir.map(|d| (d, args.disk_bytes)),
        log_entries: TierConfig::DEFAULT_LOG_ENTRIES,
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => server_tls(cert, key, args.tls_client_ca.as_deref())?,
        _ => KvAcceptor::plain(),
    };
    Ok(run_tier(TierOptions {
        listen: args.listen,
        config,
        tls,
    })
    .await?)
}
