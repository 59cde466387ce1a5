//! The shared KV tier `strata up --kv-tier-bytes` starts before any engine: one `strata
//! kv-tier` child on a free loopback port, whose address every engine is given.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use super::tls::StackTls;
use crate::pools::PoolSpec;

/// How long the tier has to accept connections after it is started.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// A KV tier that did not start.
#[derive(Debug, thiserror::Error)]
pub(super) enum KvTierError {
    #[error("finding a free port for the KV tier")]
    Port(#[source] std::io::Error),
    #[error("finding the strata executable")]
    Executable(#[source] std::io::Error),
    #[error("creating {}", path.display())]
    Create {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    /// Sharing the log file between stdout and stderr, or asking whether the child exited.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("starting strata kv-tier")]
    Spawn(#[source] std::io::Error),
    #[error("strata kv-tier exited at start ({0})")]
    Exited(ExitStatus),
    #[error("strata kv-tier did not listen on {0} within 15 s")]
    NotListening(SocketAddr),
}

/// A running `strata kv-tier`; the child is stopped when this is dropped.
pub(super) struct KvTier {
    _child: tokio::process::Child,
    pub addr: SocketAddr,
}

impl KvTier {
    /// Starts `strata kv-tier` on a free loopback port with `bytes` of memory (its log in
    /// `log_dir/kv-tier.log`, if given); returns once it accepts connections. With `tls`
    /// it serves its certificate and takes only callers the stack's CA certified.
    pub async fn start(
        bytes: u64,
        log_dir: Option<&Path>,
        tls: Option<&StackTls>,
    ) -> Result<KvTier, KvTierError> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(KvTierError::Port)?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let exe = std::env::current_exe().map_err(KvTierError::Executable)?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.args([
            "kv-tier",
            "--listen",
            &addr.to_string(),
            "--memory-bytes",
            &bytes.to_string(),
        ])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
        if let Some(t) = tls {
            cmd.arg("--tls-cert")
                .arg(&t.kv_tier.cert)
                .arg("--tls-key")
                .arg(&t.kv_tier.key)
                .arg("--tls-client-ca")
                .arg(&t.ca);
        }
        if let Some(dir) = log_dir {
            std::fs::create_dir_all(dir).map_err(|error| KvTierError::Create {
                path: dir.to_path_buf(),
                error,
            })?;
            let path = dir.join("kv-tier.log");
            let out = std::fs::File::create(&path)
                .map_err(|error| KvTierError::Create { path, error })?;
            cmd.stdout(out.try_clone()?).stderr(out);
        }
        let mut child = cmd.spawn().map_err(KvTierError::Spawn)?;
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(KvTier {
                    _child: child,
                    addr,
                });
            }
            if let Some(status) = child.try_wait()? {
                return Err(KvTierError::Exited(status));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(KvTierError::NotListening(addr));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Tells every pool's engines where the tier is (`--kv-tier`).
    pub fn share_with(&self, pools: &mut [PoolSpec]) {
        for p in pools {
            p.engine_args.push("--kv-tier".into());
            p.engine_args.push(self.addr.to_string());
        }
    }
}
