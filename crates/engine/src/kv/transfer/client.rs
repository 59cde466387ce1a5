//! [`TransferClient`]: the side that asks. One connection, handshake first, then one
//! exchange at a time, each bounded by the connection's timeout.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader};

use super::wire::{
    blocks_frame, put_str, read_body, read_len, FrameBuf, Reader, E_REFUSED, E_SPEC, K_BLOCKS,
    K_ERROR, K_EVICTED, K_EVICTIONS, K_GET, K_HELLO, K_OK, K_PUT, K_READY, K_RELEASE, MAGIC,
};
use super::{BlockData, BlockSpec, Evictions, TransferError, MAX_HASHES_PER_GET};
use crate::kv::block_pool::HashKey;
use crate::kv::tls::{KvConnector, KvStream};

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
