//! `strata kv-tier`: the machine's shared KV tier ([`crate::kv::tier`]) on its own port.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::kv::tier::{parse_bytes, run_tier, TierConfig, TierOptions};

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
}

/// Serves the tier until Ctrl-C or SIGTERM.
pub async fn run_kv_tier(args: KvTierArgs) -> anyhow::Result<()> {
    let config = TierConfig {
        memory_bytes: args.memory_bytes,
        disk: args.disk_dir.map(|d| (d, args.disk_bytes)),
        log_entries: TierConfig::DEFAULT_LOG_ENTRIES,
    };
    Ok(run_tier(TierOptions {
        listen: args.listen,
        config,
    })
    .await?)
}
