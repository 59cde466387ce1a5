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
//!
//! The files follow the roles: `wire` builds and reads frames, `spec` is what both ends
//! agree on, `client` is the side that asks ([`TransferClient`]), `server` the side that
//! answers ([`serve`]) from a [`BlockSource`] (`source`).

mod client;
mod server;
mod source;
mod spec;
mod wire;

use std::time::Duration;

use crate::kv::block_pool::HashKey;

pub use client::TransferClient;
pub use server::{serve, serve_on, serve_with, ServeLimits};
pub use source::{BlockSource, BoxFuture, Evictions};
pub use spec::BlockSpec;

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

#[cfg(test)]
mod tests;
