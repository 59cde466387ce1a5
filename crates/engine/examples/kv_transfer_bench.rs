//! What moving KV blocks over the block protocol costs, without an engine around it:
//! put a prefix's blocks to a tier, then pull them back, one block and the whole prefix at a
//! time, on a warm connection and on a fresh one (connect + handshake + get).
//!
//!   cargo run --release -p strata-engine --example kv_transfer_bench -- \
//!       [--addr HOST:PORT] [--tokens 1000] [--rounds 30]
//!
//! Without `--addr` the tier is served in this process on a loopback port; with it, a
//! running `strata kv-tier` is used (the realistic case: another process). Blocks are the
//! default model's (SmolLM2-135M: 30 layers, 3 KV heads x 64, block size 16, f16 cache):
//! 368,640 bytes each. Prints one JSON object; times are medians over the rounds, in ms.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_engine::kv::cache::KvDtype;
use strata_engine::kv::tier::{Tier, TierConfig, TierStore};
use strata_engine::kv::transfer::{self, BlockData, BlockSource, BlockSpec, TransferClient};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let tokens: usize = arg("--tokens").and_then(|s| s.parse().ok()).unwrap_or(1000);
    let rounds: usize = arg("--rounds").and_then(|s| s.parse().ok()).unwrap_or(30);
    let spec = BlockSpec {
        model: format!("kv-transfer-bench-{}", std::process::id()),
        block_size: 16,
        n_layer: 30,
        slot_width: 3 * 64,
        dtype: KvDtype::F16,
        scales_per_slot: 0,
    };
    let n_blocks = tokens / spec.block_size as usize;
    assert!(n_blocks > 0, "--tokens must cover at least one block");
    let addr: SocketAddr = match arg("--addr") {
        Some(a) => a.parse().expect("--addr HOST:PORT"),
        None => {
            let tier = Tier::new(
                TierStore::new(TierConfig::memory(
                    (spec.block_bytes() * (n_blocks + 8)) as u64,
                ))
                .expect("tier"),
            );
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let a = l.local_addr().expect("addr");
            let src: Arc<dyn BlockSource> = Arc::new(tier);
            tokio::spawn(transfer::serve(l, src, std::future::pending()));
            a
        }
    };
    let t = Duration::from_secs(10);
    // Distinct, non-constant bytes per block, so nothing downstream can shortcut them.
    let blocks: Vec<BlockData> = (0..n_blocks)
        .map(|i| {
            let mut hash = [0u8; 32];
            hash[..8].copy_from_slice(&(i as u64).to_le_bytes());
            let bytes = (0..spec.block_bytes())
                .map(|j| (j as u64 * 2654435761 + i as u64) as u8)
                .collect();
            BlockData { hash, bytes }
        })
        .collect();
    let hashes: Vec<_> = blocks.iter().map(|b| b.hash).collect();

    let mut c = TransferClient::connect(addr, &spec, t)
        .await
        .expect("connect");
    let t0 = Instant::now();
    c.put(blocks.clone()).await.expect("put");
    let put_prefix = ms(t0.elapsed());

    let (mut one, mut prefix, mut fresh, mut connect) = (vec![], vec![], vec![], vec![]);
    for r in 0..rounds {
        let t0 = Instant::now();
        let got = c
            .get(&hashes[r % n_blocks..][..1], None)
            .await
            .expect("get");
        one.push(ms(t0.elapsed()));
        assert_eq!(got.len(), 1);

        let t0 = Instant::now();
        let got = c.get(&hashes, None).await.expect("get");
        prefix.push(ms(t0.elapsed()));
        assert_eq!(got.len(), n_blocks);
        assert!(got == blocks, "the tier returned other bytes");

        let t0 = Instant::now();
        let mut f = TransferClient::connect(addr, &spec, t)
            .await
            .expect("connect");
        connect.push(ms(t0.elapsed()));
        let got = f.get(&hashes, None).await.expect("get");
        fresh.push(ms(t0.elapsed()));
        assert_eq!(got.len(), n_blocks);
    }
    let prefix_ms = median(prefix);
    println!(
        "{{\"tokens\": {tokens}, \"blocks\": {n_blocks}, \"block_bytes\": {}, \"rounds\": {rounds}, \
         \"put_prefix_ms\": {put_prefix:.3}, \"get_one_block_ms\": {:.3}, \
         \"get_prefix_ms\": {prefix_ms:.3}, \"get_prefix_per_block_ms\": {:.4}, \
         \"connect_ms\": {:.3}, \"connect_and_get_prefix_ms\": {:.3}, \"get_prefix_mb_per_s\": {:.0}}}",
        spec.block_bytes(),
        median(one),
        prefix_ms / n_blocks as f64,
        median(connect),
        median(fresh),
        (n_blocks * spec.block_bytes()) as f64 / 1e6 / (prefix_ms / 1e3),
    );
}
