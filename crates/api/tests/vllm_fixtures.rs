//! Real payloads recorded from a vLLM 0.32 server (CPU build, SmolLM2-135M-Instruct,
//! `--block-size 32 --enable-prefix-caching --prefix-caching-hash-algo sha256_cbor`, KV
//! events on): the decoders must read them, and the block hashes Strata computes for the
//! same tokens must be the ones vLLM published.

use serde_json::Value;
use strata_api::block_hash::{BlockHasher, DEFAULT_HASH_SEED};
use strata_api::kv_events::{decode_batch, KvEvent};
use strata_api::model_server::{parse_load, EngineKind};
use strata_api::prometheus;

const KV: &str = include_str!("../../../tests/fixtures/vllm-0.32/kv_events_block32.json");
const METRICS: &str = include_str!("../../../tests/fixtures/vllm-0.32/metrics.txt");

#[test]
fn a_real_kv_event_batch_decodes_and_its_hashes_are_ours() {
    let fixture: Value = serde_json::from_str(KV).unwrap();
    let prompt: Vec<u32> = fixture["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(prompt.len(), 100);
    let batch = &fixture["batches"][0];
    assert_eq!(batch["topic"], "kv");
    let payload = hex::decode(batch["payload_hex"].as_str().unwrap()).unwrap();
    let decoded = decode_batch(&payload).unwrap();
    assert!(decoded.ts > 1.7e9);
    let stored: Vec<_> = decoded
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                ..
            } => Some((
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
            )),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 1, "{decoded:?}");
    let (hashes, parent, tokens, block_size, medium) = stored[0];
    assert_eq!(*block_size, 32);
    assert_eq!(*parent, None);
    assert_eq!(medium.as_deref(), Some("GPU"));
    // Three full blocks of 32 out of a 100-token prompt.
    assert_eq!(hashes.len(), 3);
    assert_eq!(tokens.as_slice(), &prompt[..96]);
    // With vLLM's default seed, Strata's sha256_cbor chain names the same blocks.
    let ours: Vec<u64> = BlockHasher::new(DEFAULT_HASH_SEED, 32)
        .hash_sequence(&prompt, None, None)
        .iter()
        .map(|h| h.to_u64())
        .collect();
    assert_eq!(&ours, hashes);
    // And a block size of 16 (Strata's default) names none of them: why the router hashes
    // each endpoint's requests with that endpoint's own block size.
    let at16: Vec<u64> = BlockHasher::new(DEFAULT_HASH_SEED, 16)
        .hash_sequence(&prompt, None, None)
        .iter()
        .map(|h| h.to_u64())
        .collect();
    assert!(at16.iter().all(|h| !hashes.contains(h)));
}

#[test]
fn a_real_metrics_page_parses_whole() {
    let (samples, bad) = prometheus::samples(METRICS);
    assert_eq!(bad, 0);
    assert!(samples.len() > 300, "{}", samples.len());
    let load = parse_load(EngineKind::Vllm, METRICS.as_bytes()).unwrap();
    assert_eq!(load.block_size, Some(32));
    assert_eq!(load.num_blocks, Some(2912));
    // The page's own counters.
    assert_eq!(load.generation_tokens, 504.0);
    assert_eq!(load.prefix_queries, 2094.0);
    assert_eq!(load.prefix_hits, 32.0);
    let count = samples
        .iter()
        .find(|s| s.name == "vllm:time_to_first_token_seconds_count")
        .unwrap()
        .value;
    assert_eq!(load.ttft.last().map(|b| b.1), Some(count));
}
