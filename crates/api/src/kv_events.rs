//! KV-cache events: the wire format of vLLM's ZMQ event stream (PROTOCOLS §4), shared by
//! the engine that publishes it and every subscriber that mirrors a prefix cache (the router).
//!
//! The module has three parts, none of which knows about engine types:
//!
//! - the event model ([`KvEvent`], [`KvEventBatch`]) and its msgpack codec
//!   ([`encode_batch`], [`decode_batch`]);
//! - [`KvEventPublisher`]: a PUB socket plus an optional replay ROUTER socket, served by a
//!   thread of its own so that the engine loop never waits on the network;
//! - helpers for the frames around a payload ([`seq_bytes`], [`parse_seq`],
//!   [`decode_replay_reply`]).
//!
//! # Wire format (checked against vLLM's `vllm/distributed/kv_events.py`)
//!
//! Every publish is one 3-frame message `[topic, seq, payload]`: the topic as UTF-8, the
//! sequence number as an 8-byte big-endian unsigned integer (counting from 0), and a
//! msgpack payload. vLLM encodes the payload with msgspec:
//!
//! - the batch (`EventBatch`, `array_like=True`) is an array
//!   `[ts: float64, events: array, data_parallel_rank: int | nil]`; msgspec writes all three
//!   elements even when the rank is `None`, and vLLM's publisher fills in its rank (0
//!   without data parallelism) before encoding;
//! - each event (`KVCacheEvent`, `tag=True`) is a **map** keyed by field name, with the
//!   class name under `"type"` first and the fields in declaration order:
//!   `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name}`, `BlockRemoved {block_hashes, medium}`, `AllBlocksCleared {}`. Fields with
//!   defaults that are at their default (`extra_keys`, `group_idx`, ...) are omitted
//!   (`omit_defaults=True`); required ones are written even when `None`.
//!
//!   Older releases encoded events as positional tagged arrays (`docs/PROTOCOLS.md` §4).
//!   vLLM used `array_like=True` on events until vllm-project/vllm#42892 (merged
//!   2026-06) switched them to maps; current releases and llm-d (since
//!   llm-d/llm-d-kv-cache#661, which accepts both) use maps. [`EventEncoding::Map`] is the
//!   default; [`EventEncoding::Array`] still produces the older 8-element tagged arrays
//!   `["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name]` for
//!   subscribers that predate the switch. [`decode_batch`] accepts both.
//!
//! Block hashes are `u64`s: the last 8 bytes of the SHA-256 digest, big-endian
//! (`strata_engine::kv::hashing::BlockHash::to_u64`; vLLM's `maybe_convert_block_hash` with the
//! default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`). The decoder also accepts raw digest
//! bytes (what vLLM sends with that variable set to 0) and folds them the same way, and
//! negative integers (publishers that send signed 64-bit hashes) by their two's-complement
//! bits.
//!
//! # Replay
//!
//! With a replay endpoint, a ROUTER socket answers a request whose last frame is an 8-byte
//! big-endian start sequence. A REQ client's request reaches the ROUTER as
//! `[identity, "", seq]`; the publisher answers with one message
//! `[identity, "", seq, payload]` per buffered message whose seq is at least the start,
//! oldest first, then `[identity, "", END_SEQ, ""]` where `END_SEQ` is -1 as a signed 8-byte
//! big-endian integer (`ff ff ff ff ff ff ff ff`). The identity and the empty delimiter are
//! ROUTER framing; the client sees `[seq, payload]`. Exactly as in vLLM. Like newer vLLM, a
//! request without the empty delimiter (`[identity, seq]`, from a DEALER that does not add
//! one) is answered without it. Note that a libzmq REQ socket accepts only the first reply
//! of the stream; clients that want the whole replay should use a DEALER and send
//! `["", seq]` themselves.
//!
//! # Differences from vLLM's `ZmqEventPublisher`
//!
//! - vLLM's `publish` blocks when its queue is full; [`KvEventPublisher::publish`] never
//!   blocks: when its bounded queue is full the batch is dropped and counted
//!   ([`KvEventPublisher::dropped`]). A dropped batch still consumes its sequence number, so
//!   subscribers see a gap and know they lost events.
//! - vLLM binds when the endpoint contains `*` or `::` (or is ipc/inproc) and connects
//!   otherwise; Strata always binds, and only `tcp://` endpoints are supported. `*` is
//!   bound as `0.0.0.0`. There is no data-parallel port offset (one rank per engine).
//! - A message is kept for replay even if sending it to some subscriber failed.
//! - Empty batches are not published (vLLM's scheduler never publishes one either).

use std::convert::Infallible;

use rmp::encode::{self as enc, ByteBuf, ValueWriteError};
use rmp::Marker;

/// The default publisher endpoint (vLLM's `KVEventsConfig.endpoint`).
pub const DEFAULT_ENDPOINT: &str = "tcp://*:5557";
/// The prefix every Strata topic starts with; subscribers filter on it.
pub const TOPIC_PREFIX: &str = "kv@";
/// The sequence number that ends a replay (vLLM's `END_SEQ`).
pub const END_SEQ: i64 = -1;
/// `medium` of the primary (GPU or, for Strata on CPU, main-memory) KV tier.
pub const MEDIUM_GPU: &str = "GPU";
/// `medium` of an offload tier in host memory.
pub const MEDIUM_CPU: &str = "CPU";

/// The topic Strata publishes on: `kv@<endpoint-id>@<model-name>`.
pub fn topic(endpoint_id: &str, model_name: &str) -> String {
    format!("{TOPIC_PREFIX}{endpoint_id}@{model_name}")
}

/// One change to an engine's KV cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks were filled and can now be found by hash. `block_hashes` are in chain
    /// order; `parent_block_hash` is the hash of the block before the first one (`None`
    /// when the first block starts the sequence); `token_ids` are the tokens of all the
    /// blocks, `block_size` per block.
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        /// Deprecated in vLLM in favour of `lora_name`; kept on the wire.
        lora_id: Option<i64>,
        /// `"GPU"` for the primary tier, `"CPU"` for an offload tier.
        medium: Option<String>,
        lora_name: Option<String>,
    },
    /// Blocks were evicted and their hashes no longer name cached content.
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    /// The whole cache was reset.
    AllBlocksCleared,
}

impl KvEvent {
    /// The msgspec tag (vLLM's class name).
    pub fn type_name(&self) -> &'static str {
        match self {
            KvEvent::BlockStored { .. } => "BlockStored",
            KvEvent::BlockRemoved { .. } => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }
}

/// The payload of one message: vLLM's `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch when the batch was made.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// How events inside a batch are encoded (the batch itself is always an array).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventEncoding {
    /// Tagged maps, `{"type": "BlockStored", "block_hashes": ..., ...}`: current vLLM.
    #[default]
    Map,
    /// Tagged positional arrays, `["BlockStored", hashes, ...]`: vLLM before #42892.
    Array,
}

// ---------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------

/// Unwraps a write into a `ByteBuf`, which cannot fail.
fn done<T>(r: Result<T, ValueWriteError<Infallible>>) {
    if let Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) = r {
        match e {}
    }
}

fn infallible(r: Result<(), Infallible>) {
    if let Err(e) = r {
        match e {}
    }
}

fn put_str(buf: &mut ByteBuf, s: &str) {
    done(enc::write_str(buf, s));
}

fn put_uint(buf: &mut ByteBuf, v: u64) {
    done(enc::write_uint(buf, v));
}

fn put_opt_uint(buf: &mut ByteBuf, v: Option<u64>) {
    match v {
        Some(v) => put_uint(buf, v),
        None => infallible(enc::write_nil(buf)),
    }
}

fn put_opt_sint(buf: &mut ByteBuf, v: Option<i64>) {
    match v {
        Some(v) => done(enc::write_sint(buf, v)),
        None => infallible(enc::write_nil(buf)),
    }
}

fn put_opt_str(buf: &mut ByteBuf, v: Option<&str>) {
    match v {
        Some(s) => put_str(buf, s),
        None => infallible(enc::write_nil(buf)),
    }
}

fn put_array_len(buf: &mut ByteBuf, len: usize) {
    // msgpack arrays hold at most 2^32 - 1 elements; nothing Strata sends comes close.
    done(enc::write_array_len(buf, len.min(u32::MAX as usize) as u32));
}

fn put_u64s(buf: &mut ByteBuf, values: impl ExactSizeIterator<Item = u64>) {
    put_array_len(buf, values.len());
    for v in values {
        put_uint(buf, v);
    }
}

fn encode_event(buf: &mut ByteBuf, event: &KvEvent, encoding: EventEncoding) {
    let map = encoding == EventEncoding::Map;
    // Each field is written as `key, value` for maps and `value` for arrays.
    let key = |buf: &mut ByteBuf, name: &str| {
        if map {
            put_str(buf, name);
        }
    };
    let header = |buf: &mut ByteBuf, fields: u32| {
        if map {
            done(enc::write_map_len(buf, fields + 1));
            put_str(buf, "type");
        } else {
            done(enc::write_array_len(buf, fields + 1));
        }
        put_str(buf, event.type_name());
    };
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
        } => {
            header(buf, 7);
            key(buf, "block_hashes");
            put_u64s(buf, block_hashes.iter().copied());
            key(buf, "parent_block_hash");
            put_opt_uint(buf, *parent_block_hash);
            key(buf, "token_ids");
            put_u64s(buf, token_ids.iter().map(|&t| u64::from(t)));
            key(buf, "block_size");
            put_uint(buf, *block_size as u64);
            key(buf, "lora_id");
            put_opt_sint(buf, *lora_id);
            key(buf, "medium");
            put_opt_str(buf, medium.as_deref());
            key(buf, "lora_name");
            put_opt_str(buf, lora_name.as_deref());
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
        } => {
            header(buf, 2);
            key(buf, "block_hashes");
            put_u64s(buf, block_hashes.iter().copied());
            key(buf, "medium");
            put_opt_str(buf, medium.as_deref());
        }
        KvEvent::AllBlocksCleared => header(buf, 0),
    }
}

/// The msgpack payload of one batch, byte for byte what vLLM's msgspec encoder writes for
/// the same batch (with events as maps or, for [`EventEncoding::Array`], as the pre-#42892
/// arrays).
pub fn encode_batch(batch: &KvEventBatch, encoding: EventEncoding) -> Vec<u8> {
    let mut buf = ByteBuf::with_capacity(64 + batch.events.len() * 128);
    done(enc::write_array_len(&mut buf, 3));
    done(enc::write_f64(&mut buf, batch.ts));
    put_array_len(&mut buf, batch.events.len());
    for event in &batch.events {
        encode_event(&mut buf, event, encoding);
    }
    put_opt_sint(&mut buf, batch.data_parallel_rank);
    buf.into_vec()
}

// ---------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------

/// Why a payload or frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload ends early (needed {needed} more bytes at byte {at})")]
    Truncated { at: usize, needed: usize },
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
    #[error("expected {expected} at byte {at}, found marker 0x{marker:02x}")]
    UnexpectedType {
        expected: &'static str,
        at: usize,
        marker: u8,
    },
    #[error("a batch has 2 or 3 elements, this one has {0}")]
    BatchArity(usize),
    #[error("an event is an empty array")]
    EmptyEvent,
    #[error("event map has no \"type\"")]
    MissingTag,
    #[error("unknown event type {0:?}")]
    UnknownEventType(String),
    #[error("{event} lacks {field}")]
    MissingField {
        event: &'static str,
        field: &'static str,
    },
    #[error("{event} has {field} twice")]
    DuplicateField {
        event: &'static str,
        field: &'static str,
    },
    #[error("{field} value out of range")]
    OutOfRange { field: &'static str },
    #[error("invalid UTF-8 in the string at byte {0}")]
    InvalidUtf8(usize),
    #[error("values nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
    #[error("a sequence number is 8 bytes, this frame has {0}")]
    BadSeqLength(usize),
}

/// How deep unknown values may nest before the decoder gives up.
pub const MAX_DEPTH: usize = 32;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

type Res<T> = Result<T, DecodeError>;

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn peek(&self) -> Res<u8> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or(DecodeError::Truncated {
                at: self.pos,
                needed: 1,
            })
    }

    fn take(&mut self, n: usize) -> Res<&'a [u8]> {
        if self.remaining() < n {
            return Err(DecodeError::Truncated {
                at: self.pos,
                needed: n - self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Res<u64> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn unexpected(&self, expected: &'static str) -> DecodeError {
        DecodeError::UnexpectedType {
            expected,
            at: self.pos,
            marker: self.buf.get(self.pos).copied().unwrap_or(0),
        }
    }

    /// Consumes a nil if there is one.
    fn nil(&mut self) -> Res<bool> {
        if Marker::from_u8(self.peek()?) == Marker::Null {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// The length of a container whose `count` items each take at least `min_item` bytes,
    /// checked against what is left so that no allocation exceeds the payload.
    fn checked_len(&self, len: u64, min_item: usize) -> Res<usize> {
        let need = len.saturating_mul(min_item as u64);
        if need > self.remaining() as u64 {
            return Err(DecodeError::Truncated {
                at: self.pos,
                needed: usize::try_from(need - self.remaining() as u64).unwrap_or(usize::MAX),
            });
        }
        usize::try_from(len).map_err(|_| DecodeError::OutOfRange { field: "length" })
    }

    fn array_len(&mut self) -> Res<usize> {
        let len = match Marker::from_u8(self.peek()?) {
            Marker::FixArray(n) => {
                self.pos += 1;
                u64::from(n)
            }
            Marker::Array16 => {
                self.pos += 1;
                self.be(2)?
            }
            Marker::Array32 => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.unexpected("an array")),
        };
        self.checked_len(len, 1)
    }

    fn map_len(&mut self) -> Res<usize> {
        let len = match Marker::from_u8(self.peek()?) {
            Marker::FixMap(n) => {
                self.pos += 1;
                u64::from(n)
            }
            Marker::Map16 => {
                self.pos += 1;
                self.be(2)?
            }
            Marker::Map32 => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.unexpected("a map")),
        };
        self.checked_len(len, 2)
    }

    fn str(&mut self) -> Res<&'a str> {
        let len = match Marker::from_u8(self.peek()?) {
            Marker::FixStr(n) => {
                self.pos += 1;
                u64::from(n)
            }
            Marker::Str8 => {
                self.pos += 1;
                self.be(1)?
            }
            Marker::Str16 => {
                self.pos += 1;
                self.be(2)?
            }
            Marker::Str32 => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.unexpected("a string")),
        };
        let at = self.pos;
        let len = self.checked_len(len, 1)?;
        std::str::from_utf8(self.take(len)?).map_err(|_| DecodeError::InvalidUtf8(at))
    }

    fn opt_string(&mut self) -> Res<Option<String>> {
        if self.nil()? {
            return Ok(None);
        }
        Ok(Some(self.str()?.to_string()))
    }

    /// Any msgpack integer, widened.
    fn int(&mut self) -> Res<i128> {
        let v = match Marker::from_u8(self.peek()?) {
            Marker::FixPos(n) => {
                self.pos += 1;
                return Ok(i128::from(n));
            }
            Marker::FixNeg(n) => {
                self.pos += 1;
                return Ok(i128::from(n));
            }
            Marker::U8 => (1, false),
            Marker::U16 => (2, false),
            Marker::U32 => (4, false),
            Marker::U64 => (8, false),
            Marker::I8 => (1, true),
            Marker::I16 => (2, true),
            Marker::I32 => (4, true),
            Marker::I64 => (8, true),
            _ => return Err(self.unexpected("an integer")),
        };
        self.pos += 1;
        let (width, signed) = v;
        let raw = self.be(width)?;
        if !signed {
            return Ok(i128::from(raw));
        }
        // Sign-extend a `width`-byte two's-complement value.
        let shift = 64 - 8 * width as u32;
        Ok(i128::from(((raw << shift) as i64) >> shift))
    }

    fn uint(&mut self, field: &'static str) -> Res<u64> {
        u64::try_from(self.int()?).map_err(|_| DecodeError::OutOfRange { field })
    }

    fn f64(&mut self) -> Res<f64> {
        match Marker::from_u8(self.peek()?) {
            Marker::F64 => {
                self.pos += 1;
                Ok(f64::from_bits(self.be(8)?))
            }
            Marker::F32 => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(self.be(4)? as u32)))
            }
            _ => match self.int() {
                Ok(v) => Ok(v as f64),
                Err(DecodeError::UnexpectedType { at, marker, .. }) => {
                    Err(DecodeError::UnexpectedType {
                        expected: "a number",
                        at,
                        marker,
                    })
                }
                Err(e) => Err(e),
            },
        }
    }

    /// A block hash: an integer (negative ones by their 64-bit two's-complement bits) or
    /// raw digest bytes folded like vLLM's `maybe_convert_block_hash`.
    fn block_hash(&mut self, field: &'static str) -> Res<u64> {
        match Marker::from_u8(self.peek()?) {
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let bytes = self.bin()?;
                let tail = &bytes[bytes.len().saturating_sub(8)..];
                Ok(tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
            }
            _ => {
                let v = self.int()?;
                if let Ok(u) = u64::try_from(v) {
                    Ok(u)
                } else if let Ok(i) = i64::try_from(v) {
                    Ok(i as u64)
                } else {
                    Err(DecodeError::OutOfRange { field })
                }
            }
        }
    }

    fn bin(&mut self) -> Res<&'a [u8]> {
        let len = match Marker::from_u8(self.peek()?) {
            Marker::Bin8 => {
                self.pos += 1;
                self.be(1)?
            }
            Marker::Bin16 => {
                self.pos += 1;
                self.be(2)?
            }
            Marker::Bin32 => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.unexpected("bytes")),
        };
        let len = self.checked_len(len, 1)?;
        self.take(len)
    }

    fn opt_block_hash(&mut self, field: &'static str) -> Res<Option<u64>> {
        if self.nil()? {
            return Ok(None);
        }
        self.block_hash(field).map(Some)
    }

    fn block_hashes(&mut self, field: &'static str) -> Res<Vec<u64>> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.block_hash(field)?);
        }
        Ok(out)
    }

    fn token_ids(&mut self) -> Res<Vec<u32>> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let t = self.int()?;
            out.push(u32::try_from(t).map_err(|_| DecodeError::OutOfRange { field: "token_ids" })?);
        }
        Ok(out)
    }

    fn block_size(&mut self) -> Res<usize> {
        let v = self.uint("block_size")?;
        usize::try_from(v).map_err(|_| DecodeError::OutOfRange {
            field: "block_size",
        })
    }

    fn opt_i64(&mut self, field: &'static str) -> Res<Option<i64>> {
        if self.nil()? {
            return Ok(None);
        }
        i64::try_from(self.int()?)
            .map(Some)
            .map_err(|_| DecodeError::OutOfRange { field })
    }

    /// Skips one value of any type.
    fn skip(&mut self, depth: usize) -> Res<()> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        let marker = Marker::from_u8(self.peek()?);
        let (header, payload): (usize, u64) = match marker {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                (1, 0)
            }
            Marker::U8 | Marker::I8 => (1, 1),
            Marker::U16 | Marker::I16 => (1, 2),
            Marker::U32 | Marker::I32 | Marker::F32 => (1, 4),
            Marker::U64 | Marker::I64 | Marker::F64 => (1, 8),
            Marker::FixExt1 => (1, 2),
            Marker::FixExt2 => (1, 3),
            Marker::FixExt4 => (1, 5),
            Marker::FixExt8 => (1, 9),
            Marker::FixExt16 => (1, 17),
            Marker::FixStr(n) => (1, u64::from(n)),
            Marker::Str8 | Marker::Bin8 => {
                self.pos += 1;
                (0, self.be(1)?)
            }
            Marker::Str16 | Marker::Bin16 => {
                self.pos += 1;
                (0, self.be(2)?)
            }
            Marker::Str32 | Marker::Bin32 => {
                self.pos += 1;
                (0, self.be(4)?)
            }
            Marker::Ext8 => {
                self.pos += 1;
                (0, self.be(1)? + 1)
            }
            Marker::Ext16 => {
                self.pos += 1;
                (0, self.be(2)? + 1)
            }
            Marker::Ext32 => {
                self.pos += 1;
                (0, self.be(4)? + 1)
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let n = self.array_len()?;
                for _ in 0..n {
                    self.skip(depth + 1)?;
                }
                return Ok(());
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let n = self.map_len()?;
                for _ in 0..n {
                    self.skip(depth + 1)?;
                    self.skip(depth + 1)?;
                }
                return Ok(());
            }
            Marker::Reserved => return Err(self.unexpected("a msgpack value")),
        };
        self.pos += header;
        let len = self.checked_len(payload, 1)?;
        self.take(len)?;
        Ok(())
    }

    fn event(&mut self) -> Res<KvEvent> {
        match Marker::from_u8(self.peek()?) {
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => self.array_event(),
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => self.map_event(),
            _ => Err(self.unexpected("an event (array or map)")),
        }
    }

    /// `["BlockStored", hashes, parent, tokens, block_size, lora_id?, medium?, lora_name?,
    /// ...]`: trailing fields may be missing (older vLLM) or extra (newer), both tolerated.
    fn array_event(&mut self) -> Res<KvEvent> {
        let n = self.array_len()?;
        if n == 0 {
            return Err(DecodeError::EmptyEvent);
        }
        let tag = self.str()?;
        let (event, used) = match tag {
            "BlockStored" => {
                const E: &str = "BlockStored";
                let need = |i: usize, field: &'static str| {
                    if n > i {
                        Ok(())
                    } else {
                        Err(DecodeError::MissingField { event: E, field })
                    }
                };
                need(1, "block_hashes")?;
                let block_hashes = self.block_hashes("block_hashes")?;
                need(2, "parent_block_hash")?;
                let parent_block_hash = self.opt_block_hash("parent_block_hash")?;
                need(3, "token_ids")?;
                let token_ids = self.token_ids()?;
                need(4, "block_size")?;
                let block_size = self.block_size()?;
                let lora_id = if n > 5 {
                    self.opt_i64("lora_id")?
                } else {
                    None
                };
                let medium = if n > 6 { self.opt_string()? } else { None };
                let lora_name = if n > 7 { self.opt_string()? } else { None };
                let event = KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                };
                (event, n.min(8))
            }
            "BlockRemoved" => {
                if n < 2 {
                    return Err(DecodeError::MissingField {
                        event: "BlockRemoved",
                        field: "block_hashes",
                    });
                }
                let block_hashes = self.block_hashes("block_hashes")?;
                let medium = if n > 2 { self.opt_string()? } else { None };
                (
                    KvEvent::BlockRemoved {
                        block_hashes,
                        medium,
                    },
                    n.min(3),
                )
            }
            "AllBlocksCleared" => (KvEvent::AllBlocksCleared, 1),
            other => return Err(DecodeError::UnknownEventType(other.to_string())),
        };
        for _ in used..n {
            self.skip(1)?;
        }
        Ok(event)
    }

    /// `{"type": "BlockStored", "block_hashes": ..., ...}` in any key order; unknown keys
    /// (fields newer than this decoder) are skipped.
    fn map_event(&mut self) -> Res<KvEvent> {
        let n = self.map_len()?;
        let mut f = MapFields::default();
        for _ in 0..n {
            let key = self.str()?;
            macro_rules! set {
                ($slot:ident, $name:literal, $read:expr) => {{
                    if f.$slot.is_some() {
                        return Err(DecodeError::DuplicateField {
                            event: "event",
                            field: $name,
                        });
                    }
                    f.$slot = Some($read);
                }};
            }
            match key {
                "type" => set!(tag, "type", self.str()?.to_string()),
                "block_hashes" => set!(
                    block_hashes,
                    "block_hashes",
                    self.block_hashes("block_hashes")?
                ),
                "parent_block_hash" => set!(
                    parent_block_hash,
                    "parent_block_hash",
                    self.opt_block_hash("parent_block_hash")?
                ),
                "token_ids" => set!(token_ids, "token_ids", self.token_ids()?),
                "block_size" => set!(block_size, "block_size", self.block_size()?),
                "lora_id" => set!(lora_id, "lora_id", self.opt_i64("lora_id")?),
                "medium" => set!(medium, "medium", self.opt_string()?),
                "lora_name" => set!(lora_name, "lora_name", self.opt_string()?),
                _ => self.skip(1)?,
            }
        }
        let tag = f.tag.ok_or(DecodeError::MissingTag)?;
        match tag.as_str() {
            "BlockStored" => {
                const E: &str = "BlockStored";
                let missing = |field| DecodeError::MissingField { event: E, field };
                Ok(KvEvent::BlockStored {
                    block_hashes: f.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                    parent_block_hash: f.parent_block_hash.flatten(),
                    token_ids: f.token_ids.ok_or_else(|| missing("token_ids"))?,
                    block_size: f.block_size.ok_or_else(|| missing("block_size"))?,
                    lora_id: f.lora_id.flatten(),
                    medium: f.medium.flatten(),
                    lora_name: f.lora_name.flatten(),
                })
            }
            "BlockRemoved" => Ok(KvEvent::BlockRemoved {
                block_hashes: f.block_hashes.ok_or(DecodeError::MissingField {
                    event: "BlockRemoved",
                    field: "block_hashes",
                })?,
                medium: f.medium.flatten(),
            }),
            "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
            _ => Err(DecodeError::UnknownEventType(tag)),
        }
    }
}

#[derive(Default)]
struct MapFields {
    tag: Option<String>,
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<Option<u64>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<usize>,
    lora_id: Option<Option<i64>>,
    medium: Option<Option<String>>,
    lora_name: Option<Option<String>>,
}

/// Parses a payload (`[ts, events, data_parallel_rank]`), with events as maps or arrays.
/// Fields newer than this decoder are ignored; an event type it does not know is an error.
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let n = r.array_len()?;
    if !(2..=3).contains(&n) {
        return Err(DecodeError::BatchArity(n));
    }
    let ts = r.f64()?;
    let count = r.array_len()?;
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        events.push(r.event()?);
    }
    let data_parallel_rank = if n == 3 {
        r.opt_i64("data_parallel_rank")?
    } else {
        None
    };
    if r.remaining() > 0 {
        return Err(DecodeError::TrailingBytes(r.remaining()));
    }
    Ok(KvEventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// A sequence number as the 8-byte big-endian frame vLLM sends.
pub fn seq_bytes(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// The 8-byte big-endian sequence frame of a published message or replay request.
pub fn parse_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| DecodeError::BadSeqLength(frame.len()))
}

/// One reply of a replay stream, as a client sees it (`[seq, payload]`).
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayFrame {
    Batch {
        seq: u64,
        batch: KvEventBatch,
    },
    /// `seq = -1`, empty payload: nothing more follows.
    End,
}

/// Decodes a replay reply's `[seq, payload]` frames.
pub fn decode_replay_reply(seq: &[u8], payload: &[u8]) -> Result<ReplayFrame, DecodeError> {
    let seq = parse_seq(seq)?;
    if seq as i64 == END_SEQ && payload.is_empty() {
        return Ok(ReplayFrame::End);
    }
    Ok(ReplayFrame::Batch {
        seq,
        batch: decode_batch(payload)?,
    })
}
