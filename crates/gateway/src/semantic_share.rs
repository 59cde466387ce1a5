//! Semantic-cache entries shared across gateway replicas through Redis
//! (`cache.semantic.redis_url`).
//!
//! Each replica keeps answering from its own in-memory index ([`crate::semantic`]): a
//! lookup never waits on Redis. What Redis adds is a shared log of stored entries, a Redis
//! stream (`XADD .. MAXLEN ~ max_entries`, so it is bounded like the index):
//! * a replica that stores an answer also appends it to the stream ([`SemanticShare::publish`]);
//! * every replica follows the stream ([`follow`], one blocking `XREAD` at a time on its
//!   own connection) and puts the other replicas' entries into its index. A replica that
//!   starts reads the stream from its beginning, so it starts warm.
//!
//! An entry carries its scope and context (the bucket: a hash over tenant, model and the
//! exact part of the request, so an entry can never match another tenant's request), the
//! unit vector, the answer and when it was stored (wall clock, so its remaining time to
//! live carries over). Entries older than the TTL are skipped.
//!
//! Failure mode: as for the rest of the gateway's Redis use, a Redis that is down or slow
//! costs a bounded call ([`RedisConn`]'s timeout), is counted in
//! `strata_gateway_backend_errors_total{backend="semantic_cache"}` and changes nothing
//! else: each replica keeps its own index and answers on; entries stored meanwhile are
//! not shared (a cache, not a store of record). The follower retries after a pause.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use redis::Value as RedisValue;

use crate::metrics::Metrics;
use crate::redis_conn::{RedisConn, RedisError};
use crate::semantic::SemanticIndex;

/// Version tag at the start of every entry.
const MAGIC: &[u8; 4] = b"SSC1";
/// The stream field holding an entry.
const FIELD: &str = "e";
/// Entries read per `XREAD`.
const READ_BATCH: usize = 256;
/// How long one `XREAD` waits for new entries.
const BLOCK: Duration = Duration::from_millis(1000);
/// Pause after a failed read before the next one.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Longest vector accepted from the stream.
const MAX_DIM: usize = 8192;

/// One shared entry (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedEntry {
    /// The replica that stored it.
    pub origin: u64,
    /// Milliseconds since the Unix epoch when it was stored.
    pub stored_ms: u64,
    pub bucket: [u8; 32],
    pub vector: Vec<f32>,
    pub answer: Bytes,
}

impl SharedEntry {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(56 + 4 * self.vector.len() + self.answer.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.origin.to_le_bytes());
        out.extend_from_slice(&self.stored_ms.to_le_bytes());
        out.extend_from_slice(&self.bucket);
        out.extend_from_slice(&(self.vector.len() as u32).to_le_bytes());
        for x in &self.vector {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&self.answer);
        out
    }

    /// `None` for anything that is not a well-formed entry (another version, a cut or
    /// forged blob, a vector that is not finite).
    pub fn decode(bytes: &[u8]) -> Option<SharedEntry> {
        let rest = bytes.strip_prefix(MAGIC)?;
        let (origin, rest) = take_u64(rest)?;
        let (stored_ms, rest) = take_u64(rest)?;
        let bucket: [u8; 32] = rest.get(..32)?.try_into().ok()?;
        let rest = &rest[32..];
        let dim = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let rest = &rest[4..];
        if dim == 0 || dim > MAX_DIM {
            return None;
        }
        let raw = rest.get(..4 * dim)?;
        let vector: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let vector = crate::semantic::normalized(vector)?;
        Some(SharedEntry {
            origin,
            stored_ms,
            bucket,
            vector,
            answer: Bytes::copy_from_slice(&rest[4 * dim..]),
        })
    }
}

fn take_u64(b: &[u8]) -> Option<(u64, &[u8])> {
    let v = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    Some((v, &b[8..]))
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// When an entry stored at `stored_ms` was stored, on this process's clock, if it is
/// still alive at `now_ms` under `ttl`.
pub fn stored_instant(stored_ms: u64, now_ms: u64, ttl: Duration, now: Instant) -> Option<Instant> {
    let age = Duration::from_millis(now_ms.saturating_sub(stored_ms));
    if age >= ttl {
        return None;
    }
    Some(now.checked_sub(age).unwrap_or(now))
}

/// The Redis side of the semantic cache (see the module doc).
pub struct SemanticShare {
    /// Appends (bounded by the Redis timeout).
    writer: RedisConn,
    /// The follower's own connection: a blocking read must not hold up appends.
    reader: RedisConn,
    stream: String,
    origin: u64,
    ttl: Duration,
    max_len: usize,
}

impl SemanticShare {
    pub fn new(
        url: &str,
        stream: &str,
        timeout: Duration,
        ttl: Duration,
        max_len: usize,
    ) -> Result<SemanticShare, RedisError> {
        Ok(SemanticShare {
            writer: RedisConn::new(url, timeout)?,
            reader: RedisConn::new(url, timeout + BLOCK)?,
            stream: stream.to_string(),
            origin: rand::random(),
            ttl,
            max_len: max_len.max(1),
        })
    }

    /// Appends a freshly stored answer to the shared stream.
    pub async fn publish(
        &self,
        bucket: &[u8; 32],
        vector: &[f32],
        answer: &Bytes,
    ) -> Result<(), RedisError> {
        let entry = SharedEntry {
            origin: self.origin,
            stored_ms: unix_ms(),
            bucket: *bucket,
            vector: vector.to_vec(),
            answer: answer.clone(),
        };
        let cmd = redis::cmd("XADD")
            .arg(&self.stream)
            .arg("MAXLEN")
            .arg("~")
            .arg(self.max_len)
            .arg("*")
            .arg(FIELD)
            .arg(entry.encode())
            .clone();
        self.writer.query::<RedisValue>(&cmd).await.map(|_| ())
    }

    /// One read of entries after `last` (waits up to [`BLOCK`] for some): their stream
    /// ids and blobs.
    async fn read(&self, last: &str) -> Result<Vec<(String, Vec<u8>)>, RedisError> {
        let cmd = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(READ_BATCH)
            .arg("BLOCK")
            .arg(BLOCK.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(last)
            .clone();
        let v = self.reader.query::<RedisValue>(&cmd).await?;
        Ok(parse_xread(v))
    }
}

fn text(v: &RedisValue) -> Option<String> {
    match v {
        RedisValue::BulkString(b) => String::from_utf8(b.clone()).ok(),
        RedisValue::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn items(v: RedisValue) -> Vec<RedisValue> {
    match v {
        RedisValue::Array(a) | RedisValue::Set(a) => a,
        // RESP3 answers `XREAD` with a map of stream name to entries.
        RedisValue::Map(m) => m
            .into_iter()
            .map(|(k, v)| RedisValue::Array(vec![k, v]))
            .collect(),
        _ => Vec::new(),
    }
}

/// `XREAD`'s answer (`[[stream, [[id, [field, value, ...]], ...]]]`, or nil when nothing
/// came) as (id, entry blob) pairs; anything malformed is left out.
fn parse_xread(v: RedisValue) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for stream in items(v) {
        let mut parts = items(stream).into_iter();
        let (Some(_name), Some(entries)) = (parts.next(), parts.next()) else {
            continue;
        };
        for entry in items(entries) {
            let mut e = items(entry).into_iter();
            let (Some(id), Some(fields)) = (e.next(), e.next()) else {
                continue;
            };
            let Some(id) = text(&id) else { continue };
            let fields = items(fields);
            let blob = fields.chunks(2).find_map(|kv| match kv {
                [k, RedisValue::BulkString(b)] if text(k).as_deref() == Some(FIELD) => {
                    Some(b.clone())
                }
                _ => None,
            });
            // An id without our field still advances the cursor.
            out.push((id, blob.unwrap_or_default()));
        }
    }
    out
}

/// Follows the shared stream for as long as the gateway serves, putting other replicas'
/// entries into this replica's `index` (see the module doc); read failures are counted
/// in `metrics`.
pub async fn follow(share: &SemanticShare, index: &SemanticIndex, metrics: &Metrics) {
    // From the beginning: the stream is bounded, and a new replica starts warm.
    let mut last = "0-0".to_string();
    loop {
        match share.read(&last).await {
            Ok(batch) => {
                let now_ms = unix_ms();
                let now = Instant::now();
                for (id, blob) in batch {
                    last = id;
                    let Some(e) = SharedEntry::decode(&blob) else {
                        continue;
                    };
                    if e.origin == share.origin {
                        continue; // already in this index
                    }
                    if let Some(at) = stored_instant(e.stored_ms, now_ms, share.ttl, now) {
                        index.put(e.bucket, e.vector, e.answer, at);
                    }
                }
            }
            Err(e) => {
                metrics.backend_error("semantic_cache");
                tracing::warn!(error = %e, "semantic cache: reading shared entries failed");
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> SharedEntry {
        SharedEntry {
            origin: 7,
            stored_ms: 1_000,
            bucket: [3; 32],
            vector: vec![0.6, 0.8],
            answer: Bytes::from_static(b"{\"answer\":1}"),
        }
    }

    #[test]
    fn entries_round_trip_and_bad_blobs_are_refused() {
        let e = entry();
        let blob = e.encode();
        assert_eq!(SharedEntry::decode(&blob), Some(e.clone()));
        assert!(SharedEntry::decode(&blob[..blob.len() - e.answer.len() - 1]).is_none());
        assert!(SharedEntry::decode(b"").is_none());
        let mut other_version = blob.clone();
        other_version[3] = b'9';
        assert!(SharedEntry::decode(&other_version).is_none());
        let mut huge = blob.clone();
        huge[52..56].copy_from_slice(&(MAX_DIM as u32 + 1).to_le_bytes());
        assert!(SharedEntry::decode(&huge).is_none());
        let nan = SharedEntry {
            vector: vec![f32::NAN, 1.0],
            ..entry()
        };
        assert!(SharedEntry::decode(&nan.encode()).is_none());
        // A vector that is not unit length is normalized on the way in.
        let long = SharedEntry {
            vector: vec![3.0, 4.0],
            ..entry()
        };
        assert_eq!(
            SharedEntry::decode(&long.encode()).unwrap().vector,
            [0.6, 0.8]
        );
    }

    #[test]
    fn time_to_live_carries_over() {
        let now = Instant::now();
        let ttl = Duration::from_secs(10);
        let at = stored_instant(1_000, 4_000, ttl, now).unwrap();
        assert_eq!(now - at, Duration::from_secs(3));
        assert!(stored_instant(1_000, 11_000, ttl, now).is_none(), "expired");
        // A clock behind the writer's: stored "now", never in the future.
        assert_eq!(stored_instant(5_000, 4_000, ttl, now), Some(now));
    }

    #[test]
    fn xread_answers_are_parsed_and_malformed_parts_skipped() {
        let bulk = |s: &[u8]| RedisValue::BulkString(s.to_vec());
        let v = RedisValue::Array(vec![RedisValue::Array(vec![
            bulk(b"strata:semantic"),
            RedisValue::Array(vec![
                RedisValue::Array(vec![
                    bulk(b"1-0"),
                    RedisValue::Array(vec![bulk(b"e"), bulk(b"blob")]),
                ]),
                RedisValue::Array(vec![
                    bulk(b"2-0"),
                    RedisValue::Array(vec![bulk(b"x"), bulk(b"other")]),
                ]),
                RedisValue::Int(5),
            ]),
        ])]);
        assert_eq!(
            parse_xread(v),
            vec![("1-0".into(), b"blob".to_vec()), ("2-0".into(), Vec::new())]
        );
        assert!(parse_xread(RedisValue::Nil).is_empty());
        let resp3 = RedisValue::Map(vec![(
            bulk(b"s"),
            RedisValue::Array(vec![RedisValue::Array(vec![
                bulk(b"9-1"),
                RedisValue::Array(vec![bulk(b"e"), bulk(b"z")]),
            ])]),
        )]);
        assert_eq!(parse_xread(resp3), vec![("9-1".into(), b"z".to_vec())]);
    }
}
