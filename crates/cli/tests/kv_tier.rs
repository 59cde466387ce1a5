//! `strata kv-tier` as a real process: it serves the block protocol on its port, keeps
//! blocks per spec within its bounds, and exits 0 on SIGTERM; bad sizes are refused.

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{free_port, strata};
use strata_engine::kv::cache::KvDtype;
use strata_engine::kv::transfer::{BlockData, BlockSpec, TransferClient};

fn spec() -> BlockSpec {
    BlockSpec {
        model: "cli-test".into(),
        block_size: 16,
        n_layer: 2,
        slot_width: 8,
        dtype: KvDtype::F16,
        scales_per_slot: 0,
    }
}

#[test]
fn kv_tier_serves_blocks_and_exits_cleanly_on_sigterm() {
    let port = free_port();
    let disk = std::env::temp_dir().join(format!("strata-cli-kv-tier-{}", std::process::id()));
    let mut child = strata()
        .args(["kv-tier", "--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--memory-bytes",
            "2KiB",
            "--disk-bytes",
            "4KiB",
            "--disk-dir",
        ])
        .arg(&disk)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn strata kv-tier");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut c = loop {
            match TransferClient::connect(addr, &spec(), Duration::from_secs(2)).await {
                Ok(c) => break c,
                Err(e) => {
                    assert!(Instant::now() < deadline, "kv-tier never answered: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        // 1 KiB blocks: two fit in memory, four more on disk; the first pushed past both
        // leave the tier and are logged.
        let size = spec().block_bytes();
        assert_eq!(size, 1024);
        let blocks: Vec<BlockData> = (0..8u8)
            .map(|n| BlockData {
                hash: [n; 32],
                bytes: vec![n; size],
            })
            .collect();
        c.put(blocks.clone()).await.unwrap();
        let ev = c.evictions_since(0).await.unwrap();
        assert_eq!(ev.hashes, vec![[0; 32], [1; 32]]);
        // Disk blocks come back intact.
        let hashes: Vec<_> = blocks.iter().map(|b| b.hash).collect();
        assert_eq!(
            c.get(&hashes[2..], None).await.unwrap(),
            blocks[2..].to_vec()
        );
        assert!(c.get(&hashes[..3], None).await.unwrap().is_empty());
    });
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "kv-tier ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut log);
    }
    assert!(status.success(), "exit {status}: {log}");
    assert!(log.contains("KV tier listening"), "{log}");
    let _ = std::fs::remove_dir_all(&disk);
}

#[test]
fn kv_tier_refuses_a_size_it_cannot_read() {
    let out = strata()
        .args([
            "kv-tier",
            "--listen",
            "127.0.0.1:0",
            "--memory-bytes",
            "12XB",
        ])
        .output()
        .expect("run strata kv-tier");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown size unit"), "{err}");
}
