//! The shared KV tier `strata up --kv-tier-bytes` starts before any engine: one `strata
//! kv-tier` child on a free loopback port, whose address every engine is given.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use super::tls::StackTls;
use crate::pools::PoolSpec;

/// How long the tier has to accept connections after it is started.
const START_TIMEOUT: Duration = Duration::from_secs(15);

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
    ) -> anyhow::Result<KvTier> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("finding a free port for the KV tier")?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let exe = std::env::current_exe().context("finding the strata executable")?;
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
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let path = dir.join("kv-tier.log");
            let out = std::fs::File::create(&path)
                .with_context(|| format!("creating {}", path.display()))?;
            cmd.stdout(out.try_clone()?).stderr(out);
        }
        let mut child = cmd.spawn().context("starting strata kv-tier")?;
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(KvTier {
                    _child: child,
                    addr,
                });
            }
            if let Some(status) = child.try_wait()? {
                anyhow::bail!("strata kv-tier exited at start ({status})");
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "strata kv-tier did not listen on {addr} within 15 s"
            );
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
