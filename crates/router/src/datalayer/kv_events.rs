//! The KV-event subscriber (PROTOCOLS §4): one ZMQ SUB socket per endpoint that publishes
//! events, feeding the precise prefix index.
//!
//! Messages are `[topic, seq (8 bytes BE), msgpack payload]`; the topic filter is `kv@`.
//! The index must never claim blocks an engine no longer holds for long, so whenever the
//! mirror may have diverged (a sequence gap, an undecodable payload, a lost connection)
//! the endpoint's entries are dropped and rebuilt from the events that follow. That
//! costs hit rate for a moment, never correctness of the proxy (a wrong prefix guess only
//! costs a cache miss).

use std::sync::Weak;
use std::time::Duration;

use strata_api::kv_events::{decode_batch, parse_seq, TOPIC_PREFIX};
use zeromq::{Socket, SocketRecv, SubSocket};

use crate::endpoint::EndpointId;
use crate::router::{upgrade, Inner};
use crate::telemetry::RouterMetrics;

pub(crate) async fn run(weak: Weak<Inner>, id: EndpointId, url: String, addr: String) {
    let mut backoff = Duration::from_millis(50);
    loop {
        match upgrade(&weak) {
            Some(inner) if inner.has(id, &url) => {}
            _ => return,
        }
        let mut sub = SubSocket::new();
        let connected = async {
            sub.subscribe(TOPIC_PREFIX).await?;
            sub.connect(&addr).await
        };
        if let Err(e) = connected.await {
            tracing::debug!(endpoint = %url, %addr, error = %e, "KV events: connect failed");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            continue;
        }
        backoff = Duration::from_millis(50);
        tracing::info!(endpoint = %url, %addr, "KV events: subscribed");
        let mut last_seq: Option<u64> = None;
        loop {
            let msg = match sub.recv().await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(endpoint = %url, error = %e, "KV events: connection lost");
                    break;
                }
            };
            let Some(inner) = upgrade(&weak) else { return };
            if !inner.has(id, &url) {
                return;
            }
            let frames = msg.into_vec();
            let decoded = match frames.as_slice() {
                [_, seq, payload] => parse_seq(seq)
                    .ok()
                    .and_then(|s| decode_batch(payload).ok().map(|b| (s, b))),
                _ => None,
            };
            let mut index = inner.precise.write().unwrap_or_else(|e| e.into_inner());
            let Some((seq, batch)) = decoded else {
                tracing::warn!(endpoint = %url, "KV events: undecodable message; resetting mirror");
                index.remove_endpoint(id);
                last_seq = None;
                continue;
            };
            if last_seq.is_some_and(|l| seq != l.wrapping_add(1)) {
                tracing::warn!(endpoint = %url, seq, "KV events: sequence gap; resetting mirror");
                index.remove_endpoint(id);
            }
            last_seq = Some(seq);
            for ev in &batch.events {
                index.apply(id, ev);
            }
            let len = index.len();
            drop(index);
            inner
                .metrics
                .kv_events
                .get_or_create(&RouterMetrics::endpoint(&url))
                .inc_by(batch.events.len() as u64);
            inner
                .metrics
                .index_blocks
                .get_or_create(&RouterMetrics::index("precise"))
                .set(len as i64);
        }
        if let Some(inner) = upgrade(&weak) {
            inner
                .precise
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove_endpoint(id);
        }
        tokio::time::sleep(backoff).await;
    }
}
