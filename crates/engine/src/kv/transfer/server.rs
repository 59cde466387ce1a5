//! The side that answers: [`serve`] accepts connections and serves each one from a
//! [`BlockSource`], within [`ServeLimits`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::wire::{
    blocks_frame, error_frame, read_body, read_len, FrameBuf, Reader, E_PROTOCOL, E_REFUSED,
    E_SPEC, FRAME_OVERHEAD, K_BLOCKS, K_EVICTED, K_EVICTIONS, K_GET, K_HELLO, K_OK, K_PUT, K_READY,
    K_RELEASE, MAGIC,
};
use super::{
    BlockSource, BlockSpec, TransferError, IDLE_TIMEOUT, MAX_FRAME_BYTES, MAX_HASHES_PER_GET,
};
use crate::kv::tls::{KvAcceptor, KvStream};

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

pub(super) fn handshake(
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
