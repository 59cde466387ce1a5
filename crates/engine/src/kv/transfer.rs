//! The KV block wire protocol: how one engine pulls the keys and values of cached blocks from
//! another engine, or puts them to and gets them from the shared tier (issue 21).
//!
//! One TCP connection (plain, or TLS: [`super::tls`]) carries a conversation of frames. A frame is
//! `len: u32 LE` then `len` bytes of body: `version: u8`, `kind: u8`, payload. Every integer
//! is little-endian, a string is `u16 len` + UTF-8 bytes, a hash is its 32 raw bytes.
//!
//! 1. The client opens with `HELLO` (magic, its [`BlockSpec`]); the server answers `READY`
//!    with the spec it will serve under (an engine: its own; the tier: the client's), or an
//!    error frame when it holds blocks of another model or shape. The client checks the
//!    answer against its own spec too, so a mismatch is refused on both sides.
//! 2. Then requests, each answered by one frame, in order: `GET` (an optional pin to release
//!    and up to [`MAX_HASHES_PER_GET`] hashes) → `BLOCKS`; `PUT` (blocks) → `OK`;
//!    `EVICTIONS` (a sequence number) → `EVICTED`; `RELEASE` (a pin) → `OK`.
//! 3. A request the server cannot serve (a put to an engine) is answered by an error frame
//!    and the connection stays open; a malformed or oversized frame is answered by an error
//!    frame and the connection is closed. Nothing a client sends can make the server
//!    allocate more than the frame limit or panic.
//!
//! Every block of one spec has the same size ([`BlockSpec::block_bytes`]), so a block on the
//! wire is its hash followed by exactly that many bytes and needs no length of its own.
//! Replies never exceed the frame limit: the client splits long gets and puts into chunks
//! that fit, and the server cuts a reply short at the limit (a shorter leading run is still
//! a correct answer).

use std::fmt;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::kv::block_pool::HashKey;
use crate::kv::cache::{KvCache, KvDtype};
use crate::kv::tls::{KvAcceptor, KvConnector, KvStream};

/// The protocol version every frame carries; a peer speaking another one is refused.
pub const PROTOCOL_VERSION: u8 = 1;
/// The largest frame either side sends or accepts (its body, in bytes).
pub const MAX_FRAME_BYTES: usize = 256 << 20;
/// The most hashes one `GET` frame may ask for.
pub const MAX_HASHES_PER_GET: usize = 4096;
/// A server connection with no request for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest model identity accepted in a handshake.
pub const MAX_MODEL_ID_BYTES: usize = 1024;

const MAGIC: &[u8; 4] = b"SKVX";

// Frame kinds: requests from the client, answers from the server.
const K_HELLO: u8 = 0x01;
const K_GET: u8 = 0x02;
const K_PUT: u8 = 0x03;
const K_EVICTIONS: u8 = 0x04;
const K_RELEASE: u8 = 0x05;
const K_READY: u8 = 0x81;
const K_BLOCKS: u8 = 0x82;
const K_OK: u8 = 0x83;
const K_EVICTED: u8 = 0x84;
const K_ERROR: u8 = 0xFF;

// Error frame codes.
const E_SPEC: u8 = 1;
const E_REFUSED: u8 = 2;
const E_PROTOCOL: u8 = 3;

/// Room left in a frame for everything but the blocks (version, kind, counts).
const FRAME_OVERHEAD: usize = 64;

/// What two ends must agree on for a block's bytes to mean the same thing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSpec {
    /// Model identity: a string the engine derives from the loaded weights; two engines
    /// with different weights must never accept each other's blocks.
    pub model: String,
    pub block_size: u32,
    pub n_layer: u32,
    /// Numbers per slot: n_kv_head * head_dim.
    pub slot_width: u32,
    pub dtype: KvDtype,
    /// 8-bit dtypes: scale groups per slot (the KV heads; each carries an f32 scale). 0 for
    /// f16 and f32, which carry none.
    pub scales_per_slot: u32,
}

impl BlockSpec {
    /// The spec of `cache`'s blocks for `model`.
    pub fn of_cache(model: String, cache: &KvCache) -> Self {
        Self {
            model,
            block_size: cache.block_size as u32,
            n_layer: cache.keys.len() as u32,
            slot_width: cache.slot_width as u32,
            dtype: cache.dtype,
            scales_per_slot: if cache.dtype.is_scaled() {
                cache.groups_per_slot as u32
            } else {
                0
            },
        }
    }

    /// Bytes of one block on the wire: 2 (keys, values) * n_layer * block_size * the bytes
    /// of a slot (slot_width * dtype bytes, plus 4 per scale for 8-bit dtypes). Saturates
    /// instead of overflowing, so an absurd spec from a peer is simply too large (see
    /// [`BlockSpec::validate`]).
    pub fn block_bytes(&self) -> usize {
        let slot = (self.slot_width as usize)
            .saturating_mul(self.dtype.bytes())
            .saturating_add(4usize.saturating_mul(self.scales_per_slot as usize));
        [self.n_layer as usize, self.block_size as usize, slot]
            .iter()
            .fold(2usize, |acc, &x| acc.saturating_mul(x))
    }

    /// Why this spec cannot be served, if it cannot: empty dimensions, an overlong model
    /// identity, or a block that does not fit in one frame.
    pub fn validate(&self) -> Result<(), String> {
        if self.model.is_empty() || self.model.len() > MAX_MODEL_ID_BYTES {
            return Err(format!(
                "model identity must be 1..={MAX_MODEL_ID_BYTES} bytes, got {}",
                self.model.len()
            ));
        }
        if self.block_size == 0 || self.n_layer == 0 || self.slot_width == 0 {
            return Err(format!("empty block dimensions in {self}"));
        }
        let scales_fit = if self.dtype.is_scaled() {
            self.scales_per_slot > 0 && self.slot_width.is_multiple_of(self.scales_per_slot)
        } else {
            self.scales_per_slot == 0
        };
        if !scales_fit {
            return Err(format!("scale groups do not fit the slot in {self}"));
        }
        if self.block_bytes() > MAX_FRAME_BYTES - FRAME_OVERHEAD - 32 {
            return Err(format!(
                "a block of {self} does not fit in a {MAX_FRAME_BYTES}-byte frame"
            ));
        }
        Ok(())
    }

    /// How many blocks fit in one frame (at least one for a valid spec).
    pub fn blocks_per_frame(&self) -> usize {
        ((MAX_FRAME_BYTES - FRAME_OVERHEAD) / (32 + self.block_bytes().max(1))).max(1)
    }

    fn encode(&self, out: &mut Vec<u8>) {
        put_str(out, &self.model);
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&self.n_layer.to_le_bytes());
        out.extend_from_slice(&self.slot_width.to_le_bytes());
        out.push(match self.dtype {
            KvDtype::F16 => 0,
            KvDtype::F32 => 1,
            KvDtype::Int8 => 2,
            KvDtype::Fp8E4m3 => 3,
        });
        // Only 8-bit dtypes carry scales: the f16 and f32 encoding is unchanged.
        if self.dtype.is_scaled() {
            out.extend_from_slice(&self.scales_per_slot.to_le_bytes());
        }
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, TransferError> {
        let model = r.str()?;
        let block_size = r.u32()?;
        let n_layer = r.u32()?;
        let slot_width = r.u32()?;
        let dtype = match r.u8()? {
            0 => KvDtype::F16,
            1 => KvDtype::F32,
            2 => KvDtype::Int8,
            3 => KvDtype::Fp8E4m3,
            d => {
                return Err(TransferError::Protocol(format!(
                    "unknown KV dtype code {d}"
                )))
            }
        };
        let scales_per_slot = if dtype.is_scaled() { r.u32()? } else { 0 };
        Ok(Self {
            model,
            block_size,
            n_layer,
            slot_width,
            dtype,
            scales_per_slot,
        })
    }
}

impl fmt::Display for BlockSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "model={} block_size={} n_layer={} slot_width={} dtype={}",
            self.model, self.block_size, self.n_layer, self.slot_width, self.dtype
        )?;
        if self.dtype.is_scaled() {
            write!(f, " scales_per_slot={}", self.scales_per_slot)?;
        }
        Ok(())
    }
}

// `KvDtype` has no `Hash`; hash its width (and an 8-bit dtype's name) so specs can key
// maps (the tier's namespaces).
impl Hash for BlockSpec {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.model.hash(state);
        self.block_size.hash(state);
        self.n_layer.hash(state);
        self.slot_width.hash(state);
        self.dtype.bytes().hash(state);
        // The f16 and f32 hashes predate 8-bit entries and stay as they were.
        if self.dtype.is_scaled() {
            self.dtype.to_string().hash(state);
            self.scales_per_slot.hash(state);
        }
    }
}

/// One block's KV. Layout of `bytes`: for layer 0..n_layer: the block's keys
/// (block_size * slot_width elements), then its values; little-endian elements of `dtype`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockData {
    pub hash: HashKey,
    pub bytes: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("KV transfer i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("KV transfer timed out")]
    Timeout,
    /// The peer holds blocks of another model/shape.
    #[error("KV block spec mismatch: ours {ours}, theirs {theirs}")]
    SpecMismatch { ours: String, theirs: String },
    #[error("KV transfer protocol error: {0}")]
    Protocol(String),
    #[error("KV transfer refused: {0}")]
    Refused(String),
}

/// Tier evictions since a sequence number.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evictions {
    /// Pass this back next time.
    pub next: u64,
    pub hashes: Vec<HashKey>,
    /// False when the log no longer reaches back to the asked seq (entries were dropped):
    /// the caller must treat every block it announced as possibly gone.
    pub complete: bool,
}

pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// What a transfer endpoint serves from: an engine's block pool or the tier.
pub trait BlockSource: Send + Sync + 'static {
    /// Whether a client's spec is acceptable (an engine: equal to its own; the tier: any,
    /// blocks are kept apart per spec).
    fn accepts(&self, spec: &BlockSpec) -> bool;
    fn get(
        &self,
        spec: &BlockSpec,
        hashes: Vec<HashKey>,
        release: Option<String>,
    ) -> BoxFuture<Vec<BlockData>>;
    fn put(&self, spec: &BlockSpec, blocks: Vec<BlockData>) -> BoxFuture<Result<(), String>>;
    fn evictions_since(&self, spec: &BlockSpec, seq: u64) -> Evictions;
    fn release(&self, pin: String) -> BoxFuture<()>;
    /// The one spec this source serves, if it serves only one (an engine): named in the
    /// refusal a client with another spec gets, so both ends can log what differs.
    fn own_spec(&self) -> Option<BlockSpec> {
        None
    }
}

// ---------------------------------------------------------------------------------------
// Framing

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Callers keep strings short (model ids are validated, pins and messages are cut), so
    // the cut here only guards the u16 length; it falls back to a char boundary.
    let mut end = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// A frame body being built: version and kind first, the length prefix filled in at the end.
struct FrameBuf(Vec<u8>);

impl FrameBuf {
    fn new(kind: u8, capacity: usize) -> Self {
        let mut v = Vec::with_capacity(6 + capacity);
        v.extend_from_slice(&[0, 0, 0, 0, PROTOCOL_VERSION, kind]);
        Self(v)
    }
    fn finish(mut self) -> Vec<u8> {
        let len = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

fn error_frame(code: u8, msg: &str) -> Vec<u8> {
    let mut f = FrameBuf::new(K_ERROR, 3 + msg.len().min(4096));
    f.0.push(code);
    let mut end = msg.len().min(4096);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    put_str(&mut f.0, &msg[..end]);
    f.finish()
}

/// Reads a frame's length prefix. `Ok(None)` is a clean close between frames.
async fn read_len<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<usize>, TransferError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(TransferError::Protocol(
                    "connection closed inside a frame header".into(),
                ))
            };
        }
        got += n;
    }
    let len = u32::from_le_bytes(len) as usize;
    if len < 2 {
        return Err(TransferError::Protocol(format!("frame of {len} bytes")));
    }
    if len > MAX_FRAME_BYTES {
        return Err(TransferError::Protocol(format!(
            "frame of {len} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
        )));
    }
    Ok(Some(len))
}

/// Reads a frame body of `len` (already checked against the limit) and splits off version
/// and kind. The buffer grows only as bytes arrive, so a peer that announces a large frame
/// and sends little costs little.
async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    len: usize,
) -> Result<(u8, Vec<u8>), TransferError> {
    let mut body = Vec::with_capacity(len.min(1 << 20));
    (&mut *r).take(len as u64).read_to_end(&mut body).await?;
    if body.len() < len {
        return Err(TransferError::Protocol(format!(
            "connection closed inside a frame ({} of {len} bytes)",
            body.len()
        )));
    }
    if body[0] != PROTOCOL_VERSION {
        return Err(TransferError::Protocol(format!(
            "protocol version {} (this side speaks {PROTOCOL_VERSION})",
            body[0]
        )));
    }
    let kind = body[1];
    body.drain(..2);
    Ok((kind, body))
}

/// A cursor over a frame's payload; running off its end is a protocol error.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], TransferError> {
        if self.buf.len() < n {
            return Err(TransferError::Protocol("truncated frame payload".into()));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, TransferError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, TransferError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, TransferError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, TransferError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn hash(&mut self) -> Result<HashKey, TransferError> {
        let mut h = [0u8; 32];
        h.copy_from_slice(self.take(32)?);
        Ok(h)
    }
    fn str(&mut self) -> Result<String, TransferError> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| TransferError::Protocol("a string that is not UTF-8".into()))
    }
    fn opt_str(&mut self) -> Result<Option<String>, TransferError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.str()?)),
            f => Err(TransferError::Protocol(format!("option flag {f}"))),
        }
    }
    /// `count` hashes, the count checked against what is actually left before allocating.
    fn hashes(&mut self, count: usize) -> Result<Vec<HashKey>, TransferError> {
        if count.saturating_mul(32) > self.buf.len() {
            return Err(TransferError::Protocol(format!(
                "{count} hashes announced, {} bytes sent",
                self.buf.len()
            )));
        }
        (0..count).map(|_| self.hash()).collect()
    }
    /// `count` blocks of `block_bytes` each, sized against the payload first.
    fn blocks(
        &mut self,
        count: usize,
        block_bytes: usize,
    ) -> Result<Vec<BlockData>, TransferError> {
        if count.saturating_mul(32 + block_bytes) != self.buf.len() {
            return Err(TransferError::Protocol(format!(
                "{count} blocks of {block_bytes} bytes announced, {} bytes sent",
                self.buf.len()
            )));
        }
        (0..count)
            .map(|_| {
                Ok(BlockData {
                    hash: self.hash()?,
                    bytes: self.take(block_bytes)?.to_vec(),
                })
            })
            .collect()
    }
    fn end(&self) -> Result<(), TransferError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(TransferError::Protocol(format!(
                "{} unexpected trailing bytes",
                self.buf.len()
            )))
        }
    }
}

fn blocks_frame(kind: u8, blocks: &[BlockData], block_bytes: usize) -> Vec<u8> {
    let mut f = FrameBuf::new(kind, 4 + blocks.len() * (32 + block_bytes));
    f.0.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    for b in blocks {
        f.0.extend_from_slice(&b.hash);
        f.0.extend_from_slice(&b.bytes);
    }
    f.finish()
}

fn decode_error(payload: &[u8], ours: &BlockSpec) -> TransferError {
    let mut r = Reader::new(payload);
    let (code, msg) = match (r.u8(), r.str()) {
        (Ok(c), Ok(m)) => (c, m),
        _ => return TransferError::Protocol("malformed error frame".into()),
    };
    match code {
        E_SPEC => TransferError::SpecMismatch {
            ours: ours.to_string(),
            theirs: msg,
        },
        E_REFUSED => TransferError::Refused(msg),
        _ => TransferError::Protocol(format!("peer: {msg}")),
    }
}

// ---------------------------------------------------------------------------------------
// Client

/// `fut` within `t`, a timeout being [`TransferError::Timeout`].
async fn bound<T>(
    t: Duration,
    fut: impl Future<Output = Result<T, TransferError>>,
) -> Result<T, TransferError> {
    tokio::time::timeout(t, fut)
        .await
        .unwrap_or(Err(TransferError::Timeout))
}

/// One connection to a peer engine or tier, handshake done (spec checked both ways).
pub struct TransferClient {
    stream: BufReader<KvStream>,
    spec: BlockSpec,
    timeout: Duration,
    peer: SocketAddr,
    /// Set once a call failed in a way that leaves the conversation out of step (a timeout
    /// or i/o error mid-exchange); later calls fail fast instead of reading a stale answer.
    broken: bool,
}

impl fmt::Debug for TransferClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferClient")
            .field("peer", &self.peer)
            .field("spec", &self.spec)
            .field("timeout", &self.timeout)
            .field("broken", &self.broken)
            .finish()
    }
}

impl TransferClient {
    /// Connects and handshakes within `timeout`; every later call is also bounded by `timeout`
    /// (a stalled peer gives TransferError::Timeout, never a hang).
    pub async fn connect(
        addr: SocketAddr,
        spec: &BlockSpec,
        timeout: Duration,
    ) -> Result<Self, TransferError> {
        let host = addr.ip().to_string();
        Self::connect_with(&KvConnector::plain(), addr, &host, spec, timeout).await
    }

    /// [`connect`](Self::connect) through `connector` (plain or TLS); over TLS the peer's
    /// certificate must carry `host`, and the TLS handshake counts against `timeout`.
    pub async fn connect_with(
        connector: &KvConnector,
        addr: SocketAddr,
        host: &str,
        spec: &BlockSpec,
        timeout: Duration,
    ) -> Result<Self, TransferError> {
        spec.validate().map_err(TransferError::Protocol)?;
        let fut = async {
            let stream = connector.connect(addr, host).await?;
            let mut client = Self {
                stream: BufReader::new(stream),
                spec: spec.clone(),
                timeout,
                peer: addr,
                broken: false,
            };
            let mut f = FrameBuf::new(K_HELLO, 64 + spec.model.len());
            f.0.extend_from_slice(MAGIC);
            spec.encode(&mut f.0);
            let (kind, payload) = client.exchange(&f.finish()).await?;
            if kind != K_READY {
                return Err(TransferError::Protocol(format!(
                    "handshake answered by frame kind {kind:#x}"
                )));
            }
            let mut r = Reader::new(&payload);
            let theirs = BlockSpec::decode(&mut r)?;
            r.end()?;
            if theirs != *spec {
                return Err(TransferError::SpecMismatch {
                    ours: spec.to_string(),
                    theirs: theirs.to_string(),
                });
            }
            Ok(client)
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(TransferError::Timeout),
        }
    }

    /// The spec this connection was opened with.
    pub fn spec(&self) -> &BlockSpec {
        &self.spec
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The leading run of `hashes` the peer holds (stops at the first it lacks), in order.
    /// `release`: a pin id (the request id) the peer may drop once these are sent.
    pub async fn get(
        &mut self,
        hashes: &[HashKey],
        release: Option<&str>,
    ) -> Result<Vec<BlockData>, TransferError> {
        self.usable()?;
        bound(self.timeout, self.get_inner(hashes, release)).await
    }

    async fn get_inner(
        &mut self,
        hashes: &[HashKey],
        release: Option<&str>,
    ) -> Result<Vec<BlockData>, TransferError> {
        if hashes.is_empty() {
            if let Some(pin) = release {
                self.release_inner(pin).await?;
            }
            return Ok(Vec::new());
        }
        let per = self.spec.blocks_per_frame().min(MAX_HASHES_PER_GET);
        let block_bytes = self.spec.block_bytes();
        let mut out = Vec::with_capacity(hashes.len());
        let n_chunks = hashes.len().div_ceil(per);
        for (i, chunk) in hashes.chunks(per).enumerate() {
            // The pin goes with the last chunk only: the peer may drop the blocks as soon as
            // it has answered a get that carries it.
            let last = i + 1 == n_chunks;
            let pin = if last { release } else { None };
            let mut f = FrameBuf::new(K_GET, 8 + chunk.len() * 32);
            match pin {
                Some(p) => {
                    f.0.push(1);
                    put_str(&mut f.0, p);
                }
                None => f.0.push(0),
            }
            f.0.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
            for h in chunk {
                f.0.extend_from_slice(h);
            }
            let (kind, payload) = self.exchange(&f.finish()).await?;
            if kind != K_BLOCKS {
                return Err(self.unexpected(kind, &payload));
            }
            let mut r = Reader::new(&payload);
            let count = r.u32()? as usize;
            if count > chunk.len() {
                return Err(TransferError::Protocol(format!(
                    "{count} blocks for {} hashes asked",
                    chunk.len()
                )));
            }
            let blocks = r.blocks(count, block_bytes)?;
            if blocks.iter().zip(chunk).any(|(b, h)| b.hash != *h) {
                return Err(TransferError::Protocol(
                    "the peer's blocks are not the leading run asked for".into(),
                ));
            }
            out.extend(blocks);
            if count < chunk.len() {
                // The run ended here; a pin meant for the last chunk was never sent.
                if !last {
                    if let Some(p) = release {
                        self.release_inner(p).await?;
                    }
                }
                break;
            }
        }
        Ok(out)
    }

    /// Stores blocks (a tier accepts; an engine answers Refused).
    pub async fn put(&mut self, blocks: Vec<BlockData>) -> Result<(), TransferError> {
        let block_bytes = self.spec.block_bytes();
        if let Some(b) = blocks.iter().find(|b| b.bytes.len() != block_bytes) {
            return Err(TransferError::Protocol(format!(
                "a block of {} bytes where the spec has {block_bytes}",
                b.bytes.len()
            )));
        }
        self.usable()?;
        let per = self.spec.blocks_per_frame();
        let timeout = self.timeout;
        let fut = async {
            for chunk in blocks.chunks(per) {
                let (kind, payload) = self
                    .exchange(&blocks_frame(K_PUT, chunk, block_bytes))
                    .await?;
                if kind != K_OK {
                    return Err(self.unexpected(kind, &payload));
                }
            }
            Ok(())
        };
        bound(timeout, fut).await
    }

    /// Hashes evicted from the peer (a tier) since `seq`.
    pub async fn evictions_since(&mut self, seq: u64) -> Result<Evictions, TransferError> {
        self.usable()?;
        let timeout = self.timeout;
        let fut = async {
            let mut f = FrameBuf::new(K_EVICTIONS, 8);
            f.0.extend_from_slice(&seq.to_le_bytes());
            let (kind, payload) = self.exchange(&f.finish()).await?;
            if kind != K_EVICTED {
                return Err(self.unexpected(kind, &payload));
            }
            let mut r = Reader::new(&payload);
            let next = r.u64()?;
            let complete = r.u8()? != 0;
            let count = r.u32()? as usize;
            let hashes = r.hashes(count)?;
            r.end()?;
            Ok(Evictions {
                next,
                hashes,
                complete,
            })
        };
        bound(timeout, fut).await
    }

    /// Drops a pin without fetching (a decoder that found the blocks elsewhere, or gave up).
    pub async fn release(&mut self, pin: &str) -> Result<(), TransferError> {
        self.usable()?;
        bound(self.timeout, self.release_inner(pin)).await
    }

    async fn release_inner(&mut self, pin: &str) -> Result<(), TransferError> {
        let mut f = FrameBuf::new(K_RELEASE, 2 + pin.len());
        put_str(&mut f.0, pin);
        let (kind, payload) = self.exchange(&f.finish()).await?;
        if kind != K_OK {
            return Err(self.unexpected(kind, &payload));
        }
        Ok(())
    }

    /// Fails fast on a connection an earlier call left out of step.
    fn usable(&self) -> Result<(), TransferError> {
        if self.broken {
            return Err(TransferError::Io(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the connection failed earlier; open a new one",
            )));
        }
        Ok(())
    }

    /// Sends one frame and reads the answer. Marks the connection broken for the duration,
    /// so an interrupted exchange (timeout, i/o error) is never resumed.
    async fn exchange(&mut self, frame: &[u8]) -> Result<(u8, Vec<u8>), TransferError> {
        self.broken = true;
        let w = self.stream.get_mut();
        w.write_all(frame).await?;
        w.flush().await?;
        let len = read_len(&mut self.stream).await?.ok_or_else(|| {
            TransferError::Protocol("the peer closed the connection before answering".into())
        })?;
        let (kind, payload) = read_body(&mut self.stream, len).await?;
        if kind == K_ERROR {
            let err = decode_error(&payload, &self.spec);
            // A refusal leaves the conversation in step; anything else closed it.
            self.broken = !matches!(err, TransferError::Refused(_));
            return Err(err);
        }
        self.broken = false;
        Ok((kind, payload))
    }

    fn unexpected(&mut self, kind: u8, _payload: &[u8]) -> TransferError {
        self.broken = true;
        TransferError::Protocol(format!("unexpected answer frame kind {kind:#x}"))
    }
}

// ---------------------------------------------------------------------------------------
// Server

/// The bounds a transfer endpoint keeps per connection.
#[derive(Debug, Clone)]
pub struct ServeLimits {
    /// A connection with no request for this long is closed.
    pub idle: Duration,
    /// Reading one frame's body, answering it from the source, and writing the answer are
    /// each bounded by this.
    pub io: Duration,
    /// Connections served at once; more are closed on accept.
    pub max_connections: usize,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            idle: IDLE_TIMEOUT,
            io: Duration::from_secs(30),
            max_connections: 256,
        }
    }
}

/// Serves `source` on `listener` until `shutdown` resolves; each connection is bounded
/// (idle/read timeouts, frame and block-count limits), a bad client costs only its connection.
pub async fn serve(
    listener: TcpListener,
    source: Arc<dyn BlockSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, source, shutdown, ServeLimits::default()).await
}

/// [`serve`] with explicit limits.
pub async fn serve_with(
    listener: TcpListener,
    source: Arc<dyn BlockSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    limits: ServeLimits,
) -> std::io::Result<()> {
    serve_on(listener, KvAcceptor::plain(), source, shutdown, limits).await
}

/// [`serve_with`] taking connections through `acceptor` (plain or TLS). A TLS handshake
/// runs inside the connection's slot and must finish within `limits.io`; a caller that
/// fails it (no certificate, another CA's, a stall) is closed before any frame is read.
pub async fn serve_on(
    listener: TcpListener,
    acceptor: KvAcceptor,
    source: Arc<dyn BlockSource>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    limits: ServeLimits,
) -> std::io::Result<()> {
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        // Reap finished connections so the set does not grow with the connection count.
        while conns.try_join_next().is_some() {}
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "KV transfer accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if conns.len() >= limits.max_connections {
                    tracing::warn!(%peer, "KV transfer endpoint at its connection limit; closing");
                    drop(stream);
                    continue;
                }
                let source = source.clone();
                let limits = limits.clone();
                let acceptor = acceptor.clone();
                conns.spawn(async move {
                    let stream = match acceptor.accept(stream, limits.io).await {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(%peer, error = %e, "KV transfer TLS handshake refused");
                            return;
                        }
                    };
                    if let Err(e) = serve_conn(stream, source.as_ref(), &limits).await {
                        tracing::debug!(%peer, error = %e, "KV transfer connection ended");
                    }
                });
            }
        }
    }
    conns.shutdown().await;
    Ok(())
}

/// One connection: handshake, then requests until the client closes, idles out or breaks
/// the protocol.
async fn serve_conn(
    stream: KvStream,
    source: &dyn BlockSource,
    limits: &ServeLimits,
) -> Result<(), TransferError> {
    let mut stream = BufReader::new(stream);
    let mut spec: Option<BlockSpec> = None;
    loop {
        let len = match tokio::time::timeout(limits.idle, read_len(&mut stream)).await {
            Err(_) => return Ok(()),
            Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(len))) => len,
            Ok(Err(e)) => return fail(&mut stream, limits, e).await,
        };
        let (kind, payload) =
            match tokio::time::timeout(limits.io, read_body(&mut stream, len)).await {
                Err(_) => return Err(TransferError::Timeout),
                Ok(Ok(b)) => b,
                Ok(Err(e)) => return fail(&mut stream, limits, e).await,
            };
        let answer = match &spec {
            None => match handshake(kind, &payload, source) {
                Ok(s) => {
                    let mut f = FrameBuf::new(K_READY, 64 + s.model.len());
                    s.encode(&mut f.0);
                    spec = Some(s);
                    f.finish()
                }
                Err(e) => return fail(&mut stream, limits, e).await,
            },
            Some(s) => {
                match tokio::time::timeout(limits.io, answer(kind, &payload, s, source)).await {
                    Err(_) => {
                        let e = TransferError::Timeout;
                        return fail(&mut stream, limits, e).await;
                    }
                    Ok(Ok(frame)) => frame,
                    Ok(Err(TransferError::Refused(msg))) => error_frame(E_REFUSED, &msg),
                    Ok(Err(e)) => return fail(&mut stream, limits, e).await,
                }
            }
        };
        let w = stream.get_mut();
        let write = async {
            w.write_all(&answer).await?;
            w.flush().await
        };
        match tokio::time::timeout(limits.io, write).await {
            Err(_) => return Err(TransferError::Timeout),
            Ok(r) => r?,
        }
    }
}

/// Tells the client why its connection ends (best effort, bounded), then ends it with `e`.
async fn fail(
    stream: &mut BufReader<KvStream>,
    limits: &ServeLimits,
    e: TransferError,
) -> Result<(), TransferError> {
    let (code, msg) = match &e {
        TransferError::SpecMismatch { theirs, .. } => (E_SPEC, theirs.clone()),
        TransferError::Refused(m) => (E_REFUSED, m.clone()),
        other => (E_PROTOCOL, other.to_string()),
    };
    let frame = error_frame(code, &msg);
    let w = stream.get_mut();
    let _ = tokio::time::timeout(limits.io.min(Duration::from_secs(5)), async {
        w.write_all(&frame).await?;
        w.shutdown().await
    })
    .await;
    Err(e)
}

fn handshake(
    kind: u8,
    payload: &[u8],
    source: &dyn BlockSource,
) -> Result<BlockSpec, TransferError> {
    if kind != K_HELLO {
        return Err(TransferError::Protocol(format!(
            "expected a handshake, got frame kind {kind:#x}"
        )));
    }
    let mut r = Reader::new(payload);
    if r.take(4)? != MAGIC {
        return Err(TransferError::Protocol("bad handshake magic".into()));
    }
    let spec = BlockSpec::decode(&mut r)?;
    r.end()?;
    spec.validate().map_err(TransferError::Protocol)?;
    if !source.accepts(&spec) {
        // For the client this is "theirs": what this end serves, when it serves one spec.
        let ours = source
            .own_spec()
            .map(|s| s.to_string())
            .unwrap_or_else(|| "a source that does not accept this spec".into());
        return Err(TransferError::SpecMismatch {
            ours: spec.to_string(),
            theirs: ours,
        });
    }
    Ok(spec)
}

async fn answer(
    kind: u8,
    payload: &[u8],
    spec: &BlockSpec,
    source: &dyn BlockSource,
) -> Result<Vec<u8>, TransferError> {
    let block_bytes = spec.block_bytes();
    let mut r = Reader::new(payload);
    match kind {
        K_GET => {
            let release = r.opt_str()?;
            let count = r.u32()? as usize;
            if count > MAX_HASHES_PER_GET {
                return Err(TransferError::Protocol(format!(
                    "{count} hashes in one get (at most {MAX_HASHES_PER_GET})"
                )));
            }
            let hashes = r.hashes(count)?;
            r.end()?;
            let mut blocks = source.get(spec, hashes.clone(), release).await;
            // Keep only what is correct to send: the leading run asked for, of the spec's
            // size, within one frame.
            let ok = blocks
                .iter()
                .zip(&hashes)
                .take_while(|(b, h)| b.hash == **h && b.bytes.len() == block_bytes)
                .count()
                .min(spec.blocks_per_frame());
            blocks.truncate(ok);
            Ok(blocks_frame(K_BLOCKS, &blocks, block_bytes))
        }
        K_PUT => {
            let count = r.u32()? as usize;
            let blocks = r.blocks(count, block_bytes)?;
            source
                .put(spec, blocks)
                .await
                .map_err(TransferError::Refused)?;
            Ok(FrameBuf::new(K_OK, 0).finish())
        }
        K_EVICTIONS => {
            let seq = r.u64()?;
            r.end()?;
            let ev = source.evictions_since(spec, seq);
            // A log longer than a frame is cut and the answer marked incomplete: the client
            // then treats every block it announced as possibly gone instead of missing some.
            let max = (MAX_FRAME_BYTES - FRAME_OVERHEAD) / 32;
            let complete = ev.complete && ev.hashes.len() <= max;
            let n = ev.hashes.len().min(max);
            let mut f = FrameBuf::new(K_EVICTED, 13 + n * 32);
            f.0.extend_from_slice(&ev.next.to_le_bytes());
            f.0.push(complete as u8);
            f.0.extend_from_slice(&(n as u32).to_le_bytes());
            for h in &ev.hashes[..n] {
                f.0.extend_from_slice(h);
            }
            Ok(f.finish())
        }
        K_RELEASE => {
            let pin = r.str()?;
            r.end()?;
            source.release(pin).await;
            Ok(FrameBuf::new(K_OK, 0).finish())
        }
        K_HELLO => Err(TransferError::Protocol("a second handshake".into())),
        other => Err(TransferError::Protocol(format!(
            "unknown request frame kind {other:#x}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Instant;
    use tokio::net::TcpStream;

    fn spec(model: &str) -> BlockSpec {
        BlockSpec {
            model: model.into(),
            block_size: 4,
            n_layer: 2,
            slot_width: 3,
            dtype: KvDtype::F16,
            scales_per_slot: 0,
        }
    }

    fn block(spec: &BlockSpec, n: u32) -> BlockData {
        let mut hash = [0u8; 32];
        hash[..4].copy_from_slice(&n.to_le_bytes());
        let bytes = (0..spec.block_bytes())
            .map(|i| (i as u32).wrapping_mul(31).wrapping_add(n) as u8)
            .collect();
        BlockData { hash, bytes }
    }

    const T: Duration = Duration::from_secs(5);

    /// Serves `source` on a loopback port until the returned sender is dropped or fired.
    async fn start(
        source: Arc<dyn BlockSource>,
        limits: ServeLimits,
    ) -> (
        SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve_with(
            listener,
            source,
            async move {
                let _ = rx.await;
            },
            limits,
        ));
        (addr, tx, task)
    }

    fn hello(spec: &BlockSpec) -> Vec<u8> {
        let mut f = FrameBuf::new(K_HELLO, 64);
        f.0.extend_from_slice(MAGIC);
        spec.encode(&mut f.0);
        f.finish()
    }

    /// Reads one frame from a raw stream: (kind, payload), or None at a clean close.
    async fn raw_frame(s: &mut BufReader<TcpStream>) -> Option<(u8, Vec<u8>)> {
        let len = read_len(s).await.unwrap()?;
        Some(read_body(s, len).await.unwrap())
    }

    /// A hand-driven peer: accepts one connection on `listener`, reads the client's hello
    /// and answers ready with `sp`, then returns the connection for the test to misbehave on.
    async fn accept_and_greet(listener: TcpListener, sp: &BlockSpec) -> BufReader<TcpStream> {
        let (s, _) = listener.accept().await.unwrap();
        let mut s = BufReader::new(s);
        let _ = raw_frame(&mut s).await;
        let mut f = FrameBuf::new(K_READY, 64);
        sp.encode(&mut f.0);
        s.get_mut().write_all(&f.finish()).await.unwrap();
        s
    }

    #[tokio::test]
    async fn get_put_release_and_evictions_round_trip() {
        let sp = spec("m1");
        let src = Arc::new(MemorySource::new(sp.clone()));
        for n in 1..=3 {
            src.insert(block(&sp, n));
        }
        let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
        let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();

        // The leading run only: block 4 is missing, so 3 after it is not sent.
        let asked = [
            block(&sp, 1).hash,
            block(&sp, 2).hash,
            block(&sp, 4).hash,
            block(&sp, 3).hash,
        ];
        let got = c.get(&asked, Some("req-1")).await.unwrap();
        assert_eq!(got, vec![block(&sp, 1), block(&sp, 2)]);
        assert_eq!(src.released(), vec!["req-1".to_string()]);

        c.put(vec![block(&sp, 4), block(&sp, 5)]).await.unwrap();
        assert!(src.contains(&block(&sp, 5).hash));
        let got = c.get(&asked, None).await.unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(got[2], block(&sp, 4));
        assert_eq!(got[3], block(&sp, 3));

        c.release("req-2").await.unwrap();
        assert_eq!(
            src.released(),
            vec!["req-1".to_string(), "req-2".to_string()]
        );
        let ev = c.evictions_since(7).await.unwrap();
        assert_eq!(
            ev,
            Evictions {
                next: 7,
                hashes: vec![],
                complete: true
            }
        );
        // An empty get with a pin only releases it.
        assert!(c.get(&[], Some("req-3")).await.unwrap().is_empty());
        assert_eq!(src.released().last().map(String::as_str), Some("req-3"));
    }

    #[tokio::test]
    async fn long_gets_are_split_and_the_pin_goes_once_with_the_last_chunk() {
        let sp = BlockSpec {
            block_size: 1,
            n_layer: 1,
            slot_width: 1,
            ..spec("tiny")
        };
        let src = Arc::new(MemorySource::new(sp.clone()));
        let n = MAX_HASHES_PER_GET as u32 + 100;
        for i in 0..n {
            src.insert(block(&sp, i));
        }
        let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
        let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();
        let hashes: Vec<HashKey> = (0..n).map(|i| block(&sp, i).hash).collect();
        let got = c.get(&hashes, Some("p")).await.unwrap();
        assert_eq!(got.len(), n as usize);
        assert!(got.iter().zip(&hashes).all(|(b, h)| b.hash == *h));
        assert_eq!(src.released(), vec!["p".to_string()]);

        // A run that ends in the first chunk still releases the pin, once.
        let mut short = hashes.clone();
        short[10] = [0xEE; 32];
        let got = c.get(&short, Some("q")).await.unwrap();
        assert_eq!(got.len(), 10);
        assert_eq!(src.released(), vec!["p".to_string(), "q".to_string()]);
    }

    #[tokio::test]
    async fn a_spec_mismatch_is_refused_on_both_sides() {
        let ours = spec("model-a");
        let src = Arc::new(MemorySource::new(ours.clone()));
        let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;

        // The server refuses a client of another model, naming what it serves.
        let other = spec("model-b");
        match TransferClient::connect(addr, &other, T).await {
            Err(TransferError::SpecMismatch { ours: o, theirs }) => {
                assert!(o.contains("model-b"), "{o}");
                assert!(theirs.contains("model-a"), "{theirs}");
            }
            r => panic!("expected a spec mismatch, got {r:?}"),
        }
        // ... and one of another shape or dtype.
        let shape = BlockSpec {
            dtype: KvDtype::F32,
            scales_per_slot: 0,
            ..ours.clone()
        };
        assert!(matches!(
            TransferClient::connect(addr, &shape, T).await,
            Err(TransferError::SpecMismatch { .. })
        ));
        // The server side sees the same mismatch.
        assert!(matches!(
            handshake(K_HELLO, &hello(&other)[6..], src.as_ref()),
            Err(TransferError::SpecMismatch { .. })
        ));

        // A peer that accepts but answers with another spec is refused by the client.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let liar = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _s = accept_and_greet(listener, &spec("model-z")).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        });
        match TransferClient::connect(liar, &ours, T).await {
            Err(TransferError::SpecMismatch { theirs, .. }) => assert!(theirs.contains("model-z")),
            r => panic!("expected a spec mismatch, got {r:?}"),
        }
        // The real server is still fine for a matching client.
        assert!(TransferClient::connect(addr, &ours, T).await.is_ok());
    }

    #[tokio::test]
    async fn a_silent_peer_times_out_within_the_bound() {
        let sp = spec("m");
        // Accepts and never answers the handshake.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let (s, _) = listener.accept().await.unwrap();
                held.push(s);
            }
        });
        let t0 = Instant::now();
        let r = TransferClient::connect(addr, &sp, Duration::from_millis(200)).await;
        assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2));

        // Handshakes, then goes silent on the first request.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sp2 = sp.clone();
        tokio::spawn(async move {
            let _s = accept_and_greet(listener, &sp2).await;
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let mut c = TransferClient::connect(addr, &sp, Duration::from_millis(200))
            .await
            .unwrap();
        let t0 = Instant::now();
        let r = c.get(&[[1; 32]], Some("pin")).await;
        assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        // The conversation is out of step now: later calls fail at once.
        let r = c.release("pin").await;
        assert!(matches!(r, Err(TransferError::Io(_))), "{r:?}");
    }

    #[tokio::test]
    async fn a_peer_that_closes_mid_frame_is_an_error() {
        let sp = spec("m");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sp2 = sp.clone();
        tokio::spawn(async move {
            let mut s = accept_and_greet(listener, &sp2).await;
            let _ = raw_frame(&mut s).await;
            // Announces 1,000 bytes, sends a few, hangs up.
            let mut part = 1000u32.to_le_bytes().to_vec();
            part.extend_from_slice(&[PROTOCOL_VERSION, K_BLOCKS, 1, 0, 0]);
            s.get_mut().write_all(&part).await.unwrap();
        });
        let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();
        let r = c.get(&[[1; 32]], None).await;
        assert!(matches!(r, Err(TransferError::Protocol(_))), "{r:?}");
    }

    #[tokio::test]
    async fn bad_frames_cost_only_their_connection() {
        let sp = spec("m");
        let src = Arc::new(MemorySource::new(sp.clone()));
        src.insert(block(&sp, 1));
        let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
        let mut good = TransferClient::connect(addr, &sp, T).await.unwrap();

        async fn raw(addr: SocketAddr, sp: &BlockSpec) -> BufReader<TcpStream> {
            let mut s = BufReader::new(TcpStream::connect(addr).await.unwrap());
            s.get_mut().write_all(&hello(sp)).await.unwrap();
            assert_eq!(raw_frame(&mut s).await.unwrap().0, K_READY);
            s
        }
        async fn refused_then_closed(s: &mut BufReader<TcpStream>) {
            let (kind, payload) = raw_frame(s).await.unwrap();
            assert_eq!(kind, K_ERROR);
            assert_eq!(payload[0], E_PROTOCOL);
            assert!(raw_frame(s).await.is_none(), "connection should be closed");
        }

        // A frame over the limit: refused from its header, nothing allocated for it.
        let mut s = raw(addr, &sp).await;
        let huge = (MAX_FRAME_BYTES as u32 + 1).to_le_bytes();
        s.get_mut().write_all(&huge).await.unwrap();
        refused_then_closed(&mut s).await;

        // Too many hashes in one get.
        let mut s = raw(addr, &sp).await;
        let n = MAX_HASHES_PER_GET + 1;
        let mut f = FrameBuf::new(K_GET, 8 + n * 32);
        f.0.push(0);
        f.0.extend_from_slice(&(n as u32).to_le_bytes());
        f.0.extend(std::iter::repeat_n(7u8, n * 32));
        s.get_mut().write_all(&f.finish()).await.unwrap();
        refused_then_closed(&mut s).await;

        // A count that promises more hashes than the frame holds.
        let mut s = raw(addr, &sp).await;
        let mut f = FrameBuf::new(K_GET, 8);
        f.0.push(0);
        f.0.extend_from_slice(&1000u32.to_le_bytes());
        f.0.extend_from_slice(&[1; 32]);
        s.get_mut().write_all(&f.finish()).await.unwrap();
        refused_then_closed(&mut s).await;

        // A put whose blocks are not the spec's size, an unknown kind, a wrong version.
        for frame in [
            {
                let mut f = FrameBuf::new(K_PUT, 64);
                f.0.extend_from_slice(&1u32.to_le_bytes());
                f.0.extend_from_slice(&[0; 40]);
                f.finish()
            },
            FrameBuf::new(0x42, 0).finish(),
            vec![2, 0, 0, 0, 9, K_GET],
        ] {
            let mut s = raw(addr, &sp).await;
            s.get_mut().write_all(&frame).await.unwrap();
            refused_then_closed(&mut s).await;
        }

        // Garbage instead of a handshake.
        let mut s = BufReader::new(TcpStream::connect(addr).await.unwrap());
        s.get_mut()
            .write_all(&[5, 0, 0, 0, 1, K_HELLO, 1, 2, 3])
            .await
            .unwrap();
        refused_then_closed(&mut s).await;

        // The well-behaved client was never disturbed.
        let got = good.get(&[block(&sp, 1).hash], None).await.unwrap();
        assert_eq!(got, vec![block(&sp, 1)]);
    }

    #[tokio::test]
    async fn a_refused_put_keeps_the_connection_and_bad_blocks_never_leave() {
        let sp = spec("m");
        let src = Arc::new(MemorySource {
            refuse_puts: true,
            ..MemorySource::new(sp.clone())
        });
        src.insert(block(&sp, 1));
        let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
        let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();
        let r = c.put(vec![block(&sp, 2)]).await;
        assert!(matches!(r, Err(TransferError::Refused(_))), "{r:?}");
        assert!(!src.contains(&block(&sp, 2).hash));
        // Wrong size: refused before anything is sent.
        let bad = BlockData {
            hash: [9; 32],
            bytes: vec![0; 3],
        };
        assert!(matches!(
            c.put(vec![bad]).await,
            Err(TransferError::Protocol(_))
        ));
        assert_eq!(c.get(&[block(&sp, 1).hash], None).await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn idle_connections_are_closed_and_shutdown_ends_the_server() {
        let sp = spec("m");
        let src = Arc::new(MemorySource::new(sp.clone()));
        let limits = ServeLimits {
            idle: Duration::from_millis(100),
            ..Default::default()
        };
        let (addr, stop, task) = start(src, limits).await;
        let mut c = TransferClient::connect(addr, &sp, T).await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(c.get(&[[1; 32]], None).await.is_err());

        let _open = TransferClient::connect(addr, &sp, T).await.unwrap();
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("serve ends on shutdown")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn eight_bit_specs_cross_the_wire_and_meet_only_their_own() {
        let int8 = BlockSpec {
            dtype: KvDtype::Int8,
            scales_per_slot: 3,
            ..spec("model-a")
        };
        // 2 kinds × 2 layers × 4 slots × (3 codes + 3 scales of 4 bytes).
        assert_eq!(int8.block_bytes(), 2 * 2 * 4 * (3 + 3 * 4));
        let src = Arc::new(MemorySource::new(int8.clone()));
        let (addr, _stop, _task) = start(src.clone(), ServeLimits::default()).await;
        // The same 8-bit spec round-trips through the handshake and is accepted.
        assert!(TransferClient::connect(addr, &int8, T).await.is_ok());
        // Another 8-bit format, another scale layout, or the f16 cache of the same model
        // is another block: never exchanged.
        for other in [
            BlockSpec {
                dtype: KvDtype::Fp8E4m3,
                ..int8.clone()
            },
            BlockSpec {
                scales_per_slot: 1,
                ..int8.clone()
            },
            spec("model-a"),
        ] {
            match TransferClient::connect(addr, &other, T).await {
                Err(TransferError::SpecMismatch { ours, theirs }) => {
                    assert!(theirs.contains("dtype=int8 scales_per_slot=3"), "{theirs}");
                    assert_ne!(ours, theirs);
                }
                r => panic!("expected a spec mismatch for {other}, got {r:?}"),
            }
        }
        let mut wire = Vec::new();
        int8.encode(&mut wire);
        let mut r = Reader::new(&wire);
        assert_eq!(BlockSpec::decode(&mut r).unwrap(), int8);
    }

    #[test]
    fn specs_that_cannot_be_served_are_rejected() {
        let int8 = BlockSpec {
            dtype: KvDtype::Int8,
            scales_per_slot: 3,
            ..spec("m")
        };
        assert!(int8.validate().is_ok());
        for scales_per_slot in [0, 2] {
            assert!(BlockSpec {
                scales_per_slot,
                ..int8.clone()
            }
            .validate()
            .is_err());
        }
        assert!(BlockSpec {
            scales_per_slot: 3,
            ..spec("m")
        }
        .validate()
        .is_err());
        assert!(spec("m").validate().is_ok());
        assert_eq!(spec("m").block_bytes(), 2 * 2 * 4 * 3 * 2);
        assert!(spec("").validate().is_err());
        assert!(BlockSpec {
            block_size: 0,
            ..spec("m")
        }
        .validate()
        .is_err());
        let huge = BlockSpec {
            n_layer: u32::MAX,
            slot_width: u32::MAX,
            ..spec("m")
        };
        assert_eq!(huge.block_bytes(), usize::MAX);
        assert!(huge.validate().is_err());
    }

    /// A `BlockSource` over a map: blocks of one spec, no eviction log, pins recorded so a
    /// test can see releases; puts refused when `refuse_puts` (an engine does that).
    #[derive(Debug, Default)]
    struct MemorySource {
        pub spec: Option<BlockSpec>,
        pub refuse_puts: bool,
        inner: std::sync::Mutex<MemoryInner>,
    }

    #[derive(Debug, Default)]
    struct MemoryInner {
        blocks: HashMap<HashKey, Vec<u8>>,
        released: Vec<String>,
    }

    impl MemorySource {
        /// A source that accepts exactly `spec`.
        fn new(spec: BlockSpec) -> Self {
            Self {
                spec: Some(spec),
                refuse_puts: false,
                inner: Default::default(),
            }
        }

        fn insert(&self, block: BlockData) {
            self.lock().blocks.insert(block.hash, block.bytes);
        }

        fn contains(&self, hash: &HashKey) -> bool {
            self.lock().blocks.contains_key(hash)
        }

        /// The pins released so far, in order.
        fn released(&self) -> Vec<String> {
            self.lock().released.clone()
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, MemoryInner> {
            // The map stays consistent across a panic elsewhere (every edit is one call).
            self.inner.lock().unwrap_or_else(|p| p.into_inner())
        }
    }

    impl BlockSource for MemorySource {
        fn accepts(&self, spec: &BlockSpec) -> bool {
            self.spec.as_ref() == Some(spec)
        }
        fn get(
            &self,
            _spec: &BlockSpec,
            hashes: Vec<HashKey>,
            release: Option<String>,
        ) -> BoxFuture<Vec<BlockData>> {
            let mut g = self.lock();
            let out: Vec<BlockData> = hashes
                .iter()
                .map_while(|h| {
                    g.blocks.get(h).map(|b| BlockData {
                        hash: *h,
                        bytes: b.clone(),
                    })
                })
                .collect();
            if let Some(p) = release {
                g.released.push(p);
            }
            Box::pin(async move { out })
        }
        fn put(&self, _spec: &BlockSpec, blocks: Vec<BlockData>) -> BoxFuture<Result<(), String>> {
            if self.refuse_puts {
                return Box::pin(async { Err("an engine does not take blocks".to_string()) });
            }
            let mut g = self.lock();
            for b in blocks {
                g.blocks.insert(b.hash, b.bytes);
            }
            Box::pin(async { Ok(()) })
        }
        fn evictions_since(&self, _spec: &BlockSpec, seq: u64) -> Evictions {
            Evictions {
                next: seq,
                hashes: Vec::new(),
                complete: true,
            }
        }
        fn release(&self, pin: String) -> BoxFuture<()> {
            self.lock().released.push(pin);
            Box::pin(async {})
        }
        fn own_spec(&self) -> Option<BlockSpec> {
            self.spec.clone()
        }
    }
}
