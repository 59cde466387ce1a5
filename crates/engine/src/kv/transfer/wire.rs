//! The frames on the wire: building them ([`FrameBuf`]), reading them off a stream
//! ([`read_len`], [`read_body`]) and walking their payload ([`Reader`]).

use tokio::io::{AsyncRead, AsyncReadExt};

use super::{BlockData, TransferError, MAX_FRAME_BYTES, PROTOCOL_VERSION};
use crate::kv::block_pool::HashKey;

pub(super) const MAGIC: &[u8; 4] = b"SKVX";

// Frame kinds: requests from the client, answers from the server.
pub(super) const K_HELLO: u8 = 0x01;
pub(super) const K_GET: u8 = 0x02;
pub(super) const K_PUT: u8 = 0x03;
pub(super) const K_EVICTIONS: u8 = 0x04;
pub(super) const K_RELEASE: u8 = 0x05;
pub(super) const K_READY: u8 = 0x81;
pub(super) const K_BLOCKS: u8 = 0x82;
pub(super) const K_OK: u8 = 0x83;
pub(super) const K_EVICTED: u8 = 0x84;
pub(super) const K_ERROR: u8 = 0xFF;

// Error frame codes.
pub(super) const E_SPEC: u8 = 1;
pub(super) const E_REFUSED: u8 = 2;
pub(super) const E_PROTOCOL: u8 = 3;

/// Room left in a frame for everything but the blocks (version, kind, counts).
pub(super) const FRAME_OVERHEAD: usize = 64;

pub(super) fn put_str(out: &mut Vec<u8>, s: &str) {
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
pub(super) struct FrameBuf(pub(super) Vec<u8>);

impl FrameBuf {
    pub(super) fn new(kind: u8, capacity: usize) -> Self {
        let mut v = Vec::with_capacity(6 + capacity);
        v.extend_from_slice(&[0, 0, 0, 0, PROTOCOL_VERSION, kind]);
        Self(v)
    }
    pub(super) fn finish(mut self) -> Vec<u8> {
        let len = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

pub(super) fn error_frame(code: u8, msg: &str) -> Vec<u8> {
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
pub(super) async fn read_len<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<usize>, TransferError> {
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
pub(super) async fn read_body<R: AsyncRead + Unpin>(
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
pub(super) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], TransferError> {
        if self.buf.len() < n {
            return Err(TransferError::Protocol("truncated frame payload".into()));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    pub(super) fn u8(&mut self) -> Result<u8, TransferError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, TransferError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub(super) fn u32(&mut self) -> Result<u32, TransferError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    pub(super) fn u64(&mut self) -> Result<u64, TransferError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn hash(&mut self) -> Result<HashKey, TransferError> {
        let mut h = [0u8; 32];
        h.copy_from_slice(self.take(32)?);
        Ok(h)
    }
    pub(super) fn str(&mut self) -> Result<String, TransferError> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| TransferError::Protocol("a string that is not UTF-8".into()))
    }
    pub(super) fn opt_str(&mut self) -> Result<Option<String>, TransferError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.str()?)),
            f => Err(TransferError::Protocol(format!("option flag {f}"))),
        }
    }
    /// `count` hashes, the count checked against what is actually left before allocating.
    pub(super) fn hashes(&mut self, count: usize) -> Result<Vec<HashKey>, TransferError> {
        if count.saturating_mul(32) > self.buf.len() {
            return Err(TransferError::Protocol(format!(
                "{count} hashes announced, {} bytes sent",
                self.buf.len()
            )));
        }
        (0..count).map(|_| self.hash()).collect()
    }
    /// `count` blocks of `block_bytes` each, sized against the payload first.
    pub(super) fn blocks(
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
    pub(super) fn end(&self) -> Result<(), TransferError> {
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

pub(super) fn blocks_frame(kind: u8, blocks: &[BlockData], block_bytes: usize) -> Vec<u8> {
    let mut f = FrameBuf::new(kind, 4 + blocks.len() * (32 + block_bytes));
    f.0.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    for b in blocks {
        f.0.extend_from_slice(&b.hash);
        f.0.extend_from_slice(&b.bytes);
    }
    f.finish()
}
