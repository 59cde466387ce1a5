//! `strata up`'s flags: each overrides the key of the same name in `strata.yaml`
//! (`StackConfig::load` applies them).

use std::path::PathBuf;

/// `strata up` flags; each overrides the same key of `--config`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct UpArgs {
    /// `strata.yaml` (keys listed in the README); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A fixed number of engine replicas (no autoscaling) [default: 2].
    #[arg(long, conflicts_with_all = ["min_replicas", "max_replicas"])]
    pub replicas: Option<u32>,
    /// Autoscale from this many replicas (0: scale to zero when idle).
    #[arg(long)]
    pub min_replicas: Option<u32>,
    /// Autoscale up to this many replicas.
    #[arg(long)]
    pub max_replicas: Option<u32>,
    /// Model name or GGUF path [default: smollm2-135m-instruct].
    #[arg(long)]
    pub model: Option<String>,
    /// Front address [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Front port [default: 8080].
    #[arg(long)]
    pub port: Option<u16>,
    /// KV-cache bytes per replica [default: 268435456].
    #[arg(long)]
    pub kv_cache_memory: Option<u64>,
    /// An extra `strata engine` flag for every replica (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Router config file.
    #[arg(long)]
    pub router_config: Option<PathBuf>,
    /// Seconds Ctrl-C waits for in-flight requests [default: 30].
    #[arg(long)]
    pub shutdown_grace_secs: Option<u64>,
    /// Directory for replica logs [default: this terminal].
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Leave the gateway out.
    #[arg(long)]
    pub no_gateway: bool,
    /// Gateway port [default: 4000; 0 picks a free one].
    #[arg(long)]
    pub gateway_port: Option<u16>,
    /// Gateway database [default: $STRATA_HOME/gateway.db; `:memory:` for none].
    #[arg(long)]
    pub gateway_db: Option<PathBuf>,
    /// Disaggregated serving: this many prefill engines (`--kv-role prefill`), with
    /// `--decode-replicas`; fixed counts, no autoscaling.
    #[arg(long, requires = "decode_replicas",
          conflicts_with_all = ["replicas", "min_replicas", "max_replicas"])]
    pub prefill_replicas: Option<u32>,
    /// Disaggregated serving: this many decode engines (`--kv-role decode`), with
    /// `--prefill-replicas`.
    #[arg(long, requires = "prefill_replicas",
          conflicts_with_all = ["replicas", "min_replicas", "max_replicas"])]
    pub decode_replicas: Option<u32>,
    /// Disaggregated serving: uncached prompt tokens at which a request goes through a
    /// prefill engine (0: every request) [default: 256].
    #[arg(long)]
    pub pd_threshold: Option<u32>,
    /// Start a shared KV tier (`strata kv-tier`) of this many memory bytes for every
    /// engine (`--kv-tier`).
    #[arg(long)]
    pub kv_tier_bytes: Option<u64>,
    /// Every service over TLS: a CA made at this start signs a certificate for each
    /// (engines, router and dashboard, gateway, KV tier), and every client in the stack
    /// trusts it; its file is printed for yours (`curl --cacert`).
    #[arg(long)]
    pub tls: bool,
}
