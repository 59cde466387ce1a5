//! The engine loop with the real model: block transfer between a prefill and a decode
//! engine, pins, and the tier offloader.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::test_support::{request, SEED};
use super::*;
use crate::kv::block_pool::{HashKey, PoolEvent};
use crate::kv::cache::KvDtype;
use crate::kv::offload::TierChange;
use crate::planner::Policy;
use crate::sequence::{FinishReason, SeqEvent};

fn model() -> (Arc<Llama>, Arc<Tokenizer>, PathBuf) {
    static M: OnceLock<(Arc<Llama>, Arc<Tokenizer>, PathBuf)> = OnceLock::new();
    M.get_or_init(|| {
        let path = match std::env::var_os("STRATA_TEST_MODEL") {
            Some(p) => PathBuf::from(p),
            None => crate::model_cache::ModelCache::from_env()
                .path_of(crate::model_cache::DEFAULT_MODEL),
        };
        assert!(
            path.is_file(),
            "the default model is missing at {}; run `cargo run -p strata-cli -- model pull`",
            path.display()
        );
        let mut file = crate::gguf::GgufFile::open(&path).unwrap();
        let tokenizer = Tokenizer::from_gguf(&file.content).unwrap();
        let model = Llama::from_gguf(&mut file, crate::model::WeightFormat::Gguf).unwrap();
        (Arc::new(model), Arc::new(tokenizer), path)
    })
    .clone()
}

fn engine_config(num_blocks: usize, pin_timeout: Duration) -> EngineOptions {
    let (_, _, path) = model();
    EngineOptions {
        model_path: path,
        block_size: 16,
        num_blocks: Some(num_blocks),
        kv_cache_dtype: Some(KvDtype::F16),
        max_num_seqs: 4,
        max_num_batched_tokens: 512,
        max_waiting: 64,
        policy: Policy::Fcfs,
        seed: 0,
        prefix_caching: true,
        prefix_caching_hash_seed: SEED.into(),
        speculative: None,
        lora: None,
        step_time_budget: None,
        kv_pin_timeout: pin_timeout,
        ..EngineOptions::default()
    }
}

type Events = std::sync::mpsc::Receiver<Vec<PoolEvent>>;

fn engine(
    config: EngineOptions,
    evicted: Option<tokio::sync::mpsc::Sender<BlockData>>,
) -> (EngineHandle, Events) {
    let (model, tokenizer, _) = model();
    let (tx, rx) = std::sync::mpsc::channel();
    let sink: KvEventSink = Box::new(move |events, _| {
        let _ = tx.send(events);
    });
    let num_blocks = config.num_blocks.expect("a fixed pool");
    let metrics = Arc::new(EngineMetrics::new("m", config.block_size, num_blocks));
    let (handle, _thread) = start(
        model,
        tokenizer,
        &config,
        num_blocks,
        metrics,
        Some(sink),
        evicted,
    );
    (handle, rx)
}

/// What one finished request produced.
#[derive(Debug)]
struct Done {
    tokens: Vec<u32>,
    cached: usize,
    pinned: Vec<u32>,
}

async fn generate(
    h: &EngineHandle,
    prompt: &[u32],
    max_tokens: usize,
    pin: Option<&str>,
    imported: Vec<BlockData>,
) -> Done {
    let (mut req, mut rx) = request("r", prompt.to_vec(), max_tokens);
    req.pin = pin.map(str::to_string);
    req.imported = imported;
    h.submit(req).unwrap();
    let mut tokens = Vec::new();
    let wait = Duration::from_secs(120);
    loop {
        match tokio::time::timeout(wait, rx.recv())
            .await
            .expect("engine answers")
        {
            Some(SeqEvent::Token { token, .. }) => tokens.push(token),
            Some(SeqEvent::Finished {
                reason,
                cached_tokens,
                pinned_blocks,
                ..
            }) => {
                assert_eq!(reason, FinishReason::Length);
                return Done {
                    tokens,
                    cached: cached_tokens,
                    pinned: pinned_blocks,
                };
            }
            None => panic!("the engine dropped the request"),
        }
    }
}

fn prompt(tag: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 200 + (i * 37 + tag * 11) % 4000)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn imported_blocks_decode_the_same_greedy_tokens_as_computed_or_cached_ones() {
    let (prefill, _) = engine(engine_config(64, DEFAULT_PIN_TIMEOUT), None);
    let (decode, _) = engine(engine_config(64, DEFAULT_PIN_TIMEOUT), None);
    let p = prompt(1, 70); // 4 full blocks and 6 tokens
    let spec = prefill.block_spec();
    assert_eq!(spec, decode.block_spec(), "same weights, same spec");
    assert!(spec.model.contains("sha256:"), "{}", spec.model);
    assert!(spec.validate().is_ok());

    // Prefill role: one token, the 4 prompt blocks kept under the pin.
    let first = generate(&prefill, &p, 1, Some("req-1"), Vec::new()).await;
    assert_eq!(first.pinned.len(), 4);
    let stats = prefill.block_stats().await;
    assert_eq!((stats.pins, stats.pinned), (1, 4));
    let hashes = decode.block_hashes(&p, None, None);
    assert_eq!(hashes, prefill.block_hashes(&p, None, None));
    assert_eq!(hashes.len(), 4);
    assert_eq!(prefill.cached_index().leading(&hashes), 4);
    assert_eq!(decode.cached_index().leading(&hashes), 0);
    let mut shared = prefill.cached_index().len();
    assert_eq!(shared, prefill.cached_block_hashes().await.len());

    // The decoder pulls them (releasing the pin) and decodes from them.
    let blocks = prefill
        .export_blocks(hashes.clone(), Some("req-1".into()))
        .await;
    assert_eq!(blocks.len(), 4);
    assert!(blocks.iter().all(|b| b.bytes.len() == spec.block_bytes()));
    let stats = prefill.block_stats().await;
    assert_eq!((stats.pins, stats.pinned, stats.free), (0, 0, 64));
    let remote = generate(&decode, &p, 8, None, blocks).await;
    assert_eq!(remote.cached, 64, "the imported blocks are prefix hits");
    decode.block_stats().await; // after the finishing step's pool changes are published
    assert_eq!(decode.cached_index().leading(&hashes), 4);
    let page = decode.metrics.render();
    assert!(
        page.contains("strata:kv_transfer_blocks_total{direction=\"received\",model_name=\"m\",engine=\"0\"} 4")
            || page.lines().any(|l| l.starts_with("strata:kv_transfer_blocks_total")
                && l.contains("received") && l.ends_with(" 4")),
        "{page}"
    );
    assert!(page
        .lines()
        .any(|l| l.contains("external_kv_transfer") && l.ends_with(" 64")));
    let sent = prefill.metrics.render();
    assert!(sent
        .lines()
        .any(|l| l.starts_with("strata:kv_transfer_blocks_total")
            && l.contains("sent")
            && l.ends_with(" 4")));

    // The same prompt from the prefill engine's own cache, and computed from scratch.
    let cached = generate(&prefill, &p, 8, None, Vec::new()).await;
    assert_eq!(cached.cached, 64);
    assert!(prefill.reset_prefix_cache().await);
    shared = prefill.cached_index().len();
    assert_eq!(shared, 0, "the index follows a reset");
    let computed = generate(&prefill, &p, 8, None, Vec::new()).await;
    assert_eq!(computed.cached, 0);
    assert_eq!(remote.tokens, computed.tokens);
    assert_eq!(cached.tokens, computed.tokens);
    assert_eq!(computed.tokens.len(), 8);

    // Imports that do not match the prompt are ignored: computed as usual.
    let other = prompt(2, 40);
    let wrong = prefill.export_blocks(hashes.clone(), None).await;
    let alone = generate(&decode, &other, 2, None, wrong).await;
    assert_eq!(alone.cached, 0);
    let stats = decode.block_stats().await;
    assert_eq!(
        stats.free, stats.num_blocks,
        "nothing held after the requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn pins_expire_unpulled_or_on_release_and_free_their_blocks() {
    // 10 blocks: pins hold at most 5 together.
    let (h, _) = engine(engine_config(10, Duration::from_secs(5)), None);
    let p = prompt(3, 40); // 2 full blocks
    let done = generate(&h, &p, 1, Some("a"), Vec::new()).await;
    assert_eq!(done.pinned.len(), 2);
    let done = generate(&h, &prompt(4, 40), 1, Some("b"), Vec::new()).await;
    assert_eq!(done.pinned.len(), 2);
    let stats = h.block_stats().await;
    assert_eq!((stats.pins, stats.pinned, stats.free), (2, 4, 6));
    // A prompt shorter than a block has nothing to pin.
    let short = generate(&h, &prompt(5, 10), 1, Some("s"), Vec::new()).await;
    assert!(short.pinned.is_empty());
    assert_eq!(h.block_stats().await.pins, 2);
    // A third pin would pass the cap: the oldest (a) is released for it.
    let c = prompt(6, 40);
    let done = generate(&h, &c, 1, Some("c"), Vec::new()).await;
    assert_eq!(done.pinned.len(), 2);
    let stats = h.block_stats().await;
    assert_eq!((stats.pins, stats.pinned, stats.free), (2, 4, 6));
    h.release_pin("b".into());
    h.release_pin("unknown".into());
    let stats = h.block_stats().await;
    assert_eq!((stats.pins, stats.pinned, stats.free), (1, 2, 8));
    // The idle loop wakes for the expiry on its own.
    let deadline = Instant::now() + Duration::from_secs(20);
    let stats = loop {
        let stats = h.block_stats().await;
        if stats.pins == 0 || Instant::now() > deadline {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((stats.pins, stats.pinned, stats.free), (0, 0, 10));
    // The blocks stay cached (merely unpinned): an export still finds them.
    let hashes = h.block_hashes(&c, None, None);
    assert_eq!(h.export_blocks(hashes, None).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn evicted_blocks_go_to_the_offloader_and_tier_changes_become_cpu_events() {
    // 8 blocks of 16 tokens: a second prompt of 120 tokens takes all of them, evicting
    // the first one's blocks.
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let (h, events) = engine(engine_config(8, DEFAULT_PIN_TIMEOUT), Some(tx));
    let p = prompt(5, 50); // 3 full blocks
    generate(&h, &p, 1, None, Vec::new()).await;
    let hashes = h.block_hashes(&p, None, None);
    let before = h.export_blocks(hashes.clone(), None).await;
    assert_eq!(before.len(), 3);
    generate(&h, &prompt(6, 120), 1, None, Vec::new()).await;
    // The loop answers a command only after the step that finished the request has
    // published its pool changes (the index follows them).
    h.block_stats().await;
    assert_eq!(h.cached_index().leading(&hashes), 0, "evicted");
    let mut copies = HashMap::new();
    while let Ok(b) = rx.try_recv() {
        copies.insert(b.hash, b.bytes);
    }
    for b in &before {
        assert_eq!(copies.get(&b.hash), Some(&b.bytes), "copied intact");
    }
    // The tier takes them: CPU-medium stores with the blocks' parents and tokens.
    let stored: Vec<HashKey> = copies.keys().copied().collect();
    h.tier_changed(TierChange::Stored(stored.clone()));
    let stats = h.block_stats().await;
    assert_eq!(stats.tier_announced, stored.len());
    let mut tier_events = Vec::new();
    while let Ok(batch) = events.try_recv() {
        tier_events.extend(batch.into_iter().filter(|e| {
            matches!(
                e,
                PoolEvent::TierStored { .. } | PoolEvent::TierRemoved { .. }
            )
        }));
    }
    for (i, hash) in hashes.iter().enumerate() {
        let want = PoolEvent::TierStored {
            hash: *hash,
            parent: i.checked_sub(1).map(|p| hashes[p]),
            tokens: p[i * 16..(i + 1) * 16].to_vec(),
            lora: None,
        };
        assert!(tier_events.contains(&want), "block {i}");
    }
    let page = h.metrics.render();
    assert!(page.lines().any(|l| l.starts_with("strata:kv_tier_blocks")
        && l.contains("CPU")
        && l.ends_with(&format!(" {}", stored.len()))));
    // Removal of one, then loss of the log: each announced block withdrawn once.
    h.tier_changed(TierChange::Removed(vec![hashes[0]]));
    h.tier_changed(TierChange::Lost);
    let stats = h.block_stats().await;
    assert_eq!(stats.tier_announced, 0);
    let mut removed = Vec::new();
    while let Ok(batch) = events.try_recv() {
        for e in batch {
            if let PoolEvent::TierRemoved { hash } = e {
                removed.push(hash);
            }
        }
    }
    assert_eq!(removed.len(), stored.len());
    assert_eq!(removed[0], hashes[0]);
}
