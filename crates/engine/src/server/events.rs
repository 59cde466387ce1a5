//! The KV-event sink (PROTOCOLS §4): the engine loop's pool changes, converted to vLLM's
//! KV events and handed to the ZMQ publisher, when `--kv-events-endpoint` is set.

use crate::engine::KvEventSink;
use crate::kv::block_pool::{HashKey, PoolEvent};
use crate::kv::hashing::BlockHash;
use crate::kv_events::{self, KvEvent, KvEventPublisher, KvEventsConfig};
use crate::options::EngineOptions;
use crate::serve::ServerError;

/// The KV-event publisher, when an endpoint is configured.
pub(super) fn kv_event_sink(
    opts: &EngineOptions,
    model_name: &str,
) -> Result<Option<KvEventSink>, ServerError> {
    let Some(endpoint) = &opts.kv_events_endpoint else {
        return Ok(None);
    };
    let topic = opts
        .kv_events_topic
        .clone()
        .unwrap_or_else(|| kv_events::topic("localhost", model_name));
    let (publisher, addrs) = KvEventPublisher::start(KvEventsConfig {
        endpoint: endpoint.clone(),
        replay_endpoint: opts.kv_events_replay_endpoint.clone(),
        topic: topic.clone(),
        ..KvEventsConfig::default()
    })
    .map_err(|e| ServerError::Option(format!("KV events: {e}")))?;
    tracing::info!(publisher = %addrs.publisher, replay = ?addrs.replay, %topic, "publishing KV events");
    Ok(Some(Box::new(move |events, block_size| {
        publisher.publish(to_kv_events(events, block_size));
    })))
}

/// Pool changes as vLLM KV events: consecutive stores of a chain on one medium become one
/// BlockStored, consecutive removals from one medium one BlockRemoved. The engine's own
/// cache is `medium: "GPU"` (vLLM's name for the primary tier, on CPU too); blocks it
/// offloaded to the shared tier are `"CPU"`.
pub fn to_kv_events(events: Vec<PoolEvent>, block_size: usize) -> Vec<KvEvent> {
    let wire = |h: &HashKey| BlockHash(*h).to_u64();
    let mut out: Vec<KvEvent> = Vec::new();
    for ev in events {
        let (stored, medium) = match ev {
            PoolEvent::Stored {
                hash,
                parent,
                tokens,
                lora,
            } => ((hash, parent, tokens, lora), kv_events::MEDIUM_GPU),
            PoolEvent::TierStored {
                hash,
                parent,
                tokens,
                lora,
            } => ((hash, parent, tokens, lora), kv_events::MEDIUM_CPU),
            PoolEvent::Removed { hash } => {
                push_removed(&mut out, wire(&hash), kv_events::MEDIUM_GPU);
                continue;
            }
            PoolEvent::TierRemoved { hash } => {
                push_removed(&mut out, wire(&hash), kv_events::MEDIUM_CPU);
                continue;
            }
            PoolEvent::Cleared => {
                out.push(KvEvent::AllBlocksCleared);
                continue;
            }
        };
        let (hash, parent, tokens, lora) = stored;
        if let Some(KvEvent::BlockStored {
            block_hashes,
            token_ids,
            lora_name,
            medium: last_medium,
            ..
        }) = out.last_mut()
        {
            if parent.as_ref().map(wire) == block_hashes.last().copied()
                && lora_name.as_deref() == lora.as_ref().map(|l| l.name.as_str())
                && last_medium.as_deref() == Some(medium)
            {
                block_hashes.push(wire(&hash));
                token_ids.extend_from_slice(&tokens);
                continue;
            }
        }
        out.push(KvEvent::BlockStored {
            block_hashes: vec![wire(&hash)],
            parent_block_hash: parent.as_ref().map(wire),
            token_ids: tokens,
            block_size,
            lora_id: lora.as_ref().map(|l| l.id),
            medium: Some(medium.to_string()),
            lora_name: lora.map(|l| l.name),
        });
    }
    out
}

/// Appends a removal, joining the previous BlockRemoved of the same medium.
fn push_removed(out: &mut Vec<KvEvent>, hash: u64, medium: &str) {
    if let Some(KvEvent::BlockRemoved {
        block_hashes,
        medium: last,
    }) = out.last_mut()
    {
        if last.as_deref() == Some(medium) {
            block_hashes.push(hash);
            return;
        }
    }
    out.push(KvEvent::BlockRemoved {
        block_hashes: vec![hash],
        medium: Some(medium.to_string()),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> HashKey {
        [n; 32]
    }

    #[test]
    fn tier_events_are_cpu_blocks_and_never_merge_with_gpu_ones() {
        let wire = |n| BlockHash(h(n)).to_u64();
        let stored = |n: u8, parent: Option<u8>| PoolEvent::Stored {
            hash: h(n),
            parent: parent.map(h),
            tokens: vec![n as u32; 2],
            lora: None,
        };
        let tier = |n: u8, parent: Option<u8>| PoolEvent::TierStored {
            hash: h(n),
            parent: parent.map(h),
            tokens: vec![n as u32; 2],
            lora: None,
        };
        let events = vec![
            stored(1, None),
            stored(2, Some(1)),
            // The same chain on the tier is a separate CPU event.
            tier(3, Some(2)),
            tier(4, Some(3)),
            PoolEvent::Removed { hash: h(1) },
            PoolEvent::TierRemoved { hash: h(3) },
            PoolEvent::TierRemoved { hash: h(4) },
            PoolEvent::Removed { hash: h(2) },
        ];
        let out = to_kv_events(events, 2);
        let gpu = Some("GPU".to_string());
        let cpu = Some("CPU".to_string());
        assert_eq!(
            out,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![wire(1), wire(2)],
                    parent_block_hash: None,
                    token_ids: vec![1, 1, 2, 2],
                    block_size: 2,
                    lora_id: None,
                    medium: gpu.clone(),
                    lora_name: None,
                },
                KvEvent::BlockStored {
                    block_hashes: vec![wire(3), wire(4)],
                    parent_block_hash: Some(wire(2)),
                    token_ids: vec![3, 3, 4, 4],
                    block_size: 2,
                    lora_id: None,
                    medium: cpu.clone(),
                    lora_name: None,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![wire(1)],
                    medium: gpu.clone(),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![wire(3), wire(4)],
                    medium: cpu,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![wire(2)],
                    medium: gpu,
                },
            ]
        );
    }
}
