//! The engine's KV-event publisher (PROTOCOLS §4): a PUB socket plus an optional replay
//! ROUTER socket, served by a thread of its own so that the engine loop never waits on the
//! network. The event model and msgpack codec live in [`strata_api::kv_events`] (re-exported
//! here) so that subscribers need not link the engine.
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

pub use strata_api::kv_events::*;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

// ---------------------------------------------------------------------------------------
// Publisher
// ---------------------------------------------------------------------------------------

/// Where and how a [`KvEventPublisher`] publishes.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// The PUB socket's endpoint, `tcp://HOST:PORT`; `*` binds every interface and port 0
    /// an ephemeral port (see [`BoundAddrs`]).
    pub endpoint: String,
    /// The replay ROUTER socket's endpoint; `None` disables replay.
    pub replay_endpoint: Option<String>,
    /// The first frame of every message (`kv@<endpoint-id>@<model>`, see [`topic`]).
    pub topic: String,
    /// How many recent messages are kept for replay (vLLM's `buffer_steps`); 0 keeps none
    /// and replays answer with the end marker only.
    pub buffer_steps: usize,
    /// How many batches may wait for the publisher thread before `publish` drops them.
    pub queue_capacity: usize,
    /// The batch's third element; vLLM publishes its data-parallel rank (0 without DP).
    pub data_parallel_rank: Option<i64>,
    pub encoding: EventEncoding,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            queue_capacity: 10_000,
            data_parallel_rank: Some(0),
            encoding: EventEncoding::Map,
        }
    }
}

/// The endpoints actually bound, with ephemeral ports resolved (e.g. `tcp://127.0.0.1:41234`
/// for a configured `tcp://127.0.0.1:0`, `tcp://0.0.0.0:5557` for `tcp://*:5557`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundAddrs {
    pub publisher: String,
    pub replay: Option<String>,
}

impl BoundAddrs {
    /// The PUB socket's TCP port.
    pub fn publisher_port(&self) -> Option<u16> {
        endpoint_port(&self.publisher)
    }

    /// The replay socket's TCP port.
    pub fn replay_port(&self) -> Option<u16> {
        self.replay.as_deref().and_then(endpoint_port)
    }
}

fn endpoint_port(endpoint: &str) -> Option<u16> {
    endpoint.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    #[error("invalid KV-events endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },
    #[error("cannot bind the KV-events socket to {endpoint}: {reason}")]
    Bind { endpoint: String, reason: String },
    #[error("queue_capacity must be at least 1")]
    ZeroQueueCapacity,
    #[error("cannot start the KV-events thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("the KV-events thread stopped during startup")]
    StartupLost,
}

/// How long one send to the subscribers may take before the message is given up on (for
/// the subscribers it has not reached), so that a stalled subscriber cannot stall the
/// stream for long.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a dropped publisher keeps sending what was queued (vLLM's
/// `SHUTDOWN_TIMEOUT`).
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(1);

/// Publishes KV events on a ZMQ PUB socket, keeps the last `buffer_steps` messages and
/// replays them on request. Dropping it stops its thread (after sending, for at most a
/// second, what was already queued).
pub struct KvEventPublisher {
    tx: Option<mpsc::Sender<Outgoing>>,
    /// The next sequence number; held across the enqueue so that sequence order is queue
    /// order even with several publishing threads.
    next_seq: Mutex<u64>,
    stats: Arc<Stats>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

struct Outgoing {
    seq: u64,
    ts: f64,
    events: Vec<KvEvent>,
}

#[derive(Default)]
struct Stats {
    dropped: AtomicU64,
    sent: AtomicU64,
    send_errors: AtomicU64,
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("sent", &self.sent())
            .field("dropped", &self.dropped())
            .field("send_errors", &self.send_errors())
            .finish()
    }
}

/// libzmq binds `*` as every interface; the Rust transport needs an address.
fn bind_address(endpoint: &str) -> Result<String, KvEventsError> {
    let invalid = |reason: &str| KvEventsError::InvalidEndpoint {
        endpoint: endpoint.to_string(),
        reason: reason.to_string(),
    };
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| invalid("only tcp:// endpoints are supported"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| invalid("expected tcp://HOST:PORT"))?;
    port.parse::<u16>()
        .map_err(|_| invalid("the port is not a number in 0..=65535"))?;
    match host {
        "*" => Ok(format!("tcp://0.0.0.0:{port}")),
        "" => Err(invalid("empty host")),
        _ => Ok(endpoint.to_string()),
    }
}

impl KvEventPublisher {
    /// Binds the sockets and starts the publisher thread. Returns once both sockets are
    /// bound (or binding failed).
    pub fn start(config: KvEventsConfig) -> Result<(KvEventPublisher, BoundAddrs), KvEventsError> {
        if config.queue_capacity == 0 {
            return Err(KvEventsError::ZeroQueueCapacity);
        }
        let pub_endpoint = bind_address(&config.endpoint)?;
        let replay_endpoint = config
            .replay_endpoint
            .as_deref()
            .map(bind_address)
            .transpose()?;
        let (tx, rx) = mpsc::channel(config.queue_capacity);
        let (stop_tx, stop_rx) = oneshot::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(Stats::default());
        let thread_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("strata-kv-events".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(KvEventsError::Thread(e)));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let (publisher, replay, addrs) =
                        match bind(&pub_endpoint, replay_endpoint.as_deref()).await {
                            Ok(bound) => bound,
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                        };
                    if ready_tx.send(Ok(addrs)).is_err() {
                        return;
                    }
                    let mut worker = Worker {
                        publisher,
                        replay,
                        topic: Bytes::from(config.topic.into_bytes()),
                        buffer: VecDeque::with_capacity(config.buffer_steps.min(1 << 16)),
                        buffer_steps: config.buffer_steps,
                        encoding: config.encoding,
                        data_parallel_rank: config.data_parallel_rank,
                        stats: thread_stats,
                    };
                    worker.run(rx, stop_rx).await;
                    worker.close().await;
                });
            })
            .map_err(KvEventsError::Thread)?;
        let addrs = match ready_rx.recv() {
            Ok(Ok(addrs)) => addrs,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(KvEventsError::StartupLost);
            }
        };
        let publisher = KvEventPublisher {
            tx: Some(tx),
            next_seq: Mutex::new(0),
            stats,
            stop: Some(stop_tx),
            thread: Some(thread),
        };
        Ok((publisher, addrs))
    }

    /// Queues one batch, stamped with the current time, as the next message. Never blocks:
    /// returns `false` when the batch was dropped because the queue is full (or the
    /// publisher thread has died), which [`dropped`](Self::dropped) counts and which leaves a
    /// gap in the sequence numbers. An empty batch is not published and returns `true`.
    pub fn publish(&self, events: Vec<KvEvent>) -> bool {
        if events.is_empty() {
            return true;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let Some(tx) = &self.tx else {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        let mut next = self.next_seq.lock().unwrap_or_else(|e| e.into_inner());
        let seq = *next;
        *next += 1;
        match tx.try_send(Outgoing { seq, ts, events }) {
            Ok(()) => true,
            Err(_) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Batches dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.stats.dropped.load(Ordering::Relaxed)
    }

    /// Messages handed to the PUB socket.
    pub fn sent(&self) -> u64 {
        self.stats.sent.load(Ordering::Relaxed)
    }

    /// Messages whose send failed or timed out (they are still kept for replay).
    pub fn send_errors(&self) -> u64 {
        self.stats.send_errors.load(Ordering::Relaxed)
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::warn!("the KV-events thread panicked");
            }
        }
    }
}

async fn bind(
    pub_endpoint: &str,
    replay_endpoint: Option<&str>,
) -> Result<(PubSocket, Option<RouterSocket>, BoundAddrs), KvEventsError> {
    let bind_error = |endpoint: &str, e: zeromq::ZmqError| KvEventsError::Bind {
        endpoint: endpoint.to_string(),
        reason: e.to_string(),
    };
    let mut publisher = PubSocket::new();
    let bound = publisher
        .bind(pub_endpoint)
        .await
        .map_err(|e| bind_error(pub_endpoint, e))?;
    let mut addrs = BoundAddrs {
        publisher: bound.to_string(),
        replay: None,
    };
    let replay = match replay_endpoint {
        Some(endpoint) => {
            let mut router = RouterSocket::new();
            let bound = router
                .bind(endpoint)
                .await
                .map_err(|e| bind_error(endpoint, e))?;
            addrs.replay = Some(bound.to_string());
            Some(router)
        }
        None => None,
    };
    Ok((publisher, replay, addrs))
}

struct Worker {
    publisher: PubSocket,
    replay: Option<RouterSocket>,
    topic: Bytes,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    encoding: EventEncoding,
    data_parallel_rank: Option<i64>,
    stats: Arc<Stats>,
}

impl Worker {
    async fn run(&mut self, mut rx: mpsc::Receiver<Outgoing>, mut stop: oneshot::Receiver<()>) {
        loop {
            // Biased: a stop wins, then queued batches, so a replay request is answered
            // only after everything published before it has been sent and buffered.
            tokio::select! {
                biased;
                _ = &mut stop => break,
                msg = rx.recv() => match msg {
                    Some(msg) => self.send(msg, SEND_TIMEOUT).await,
                    None => return,
                },
                request = recv_replay(&mut self.replay) => match request {
                    Ok(request) => self.serve_replay(request).await,
                    Err(e) => {
                        tracing::debug!(error = %e, "KV-events replay socket");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
            }
        }
        let deadline = Instant::now() + SHUTDOWN_DRAIN;
        while let Ok(msg) = rx.try_recv() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!("KV-events publisher stopped with batches still queued");
                break;
            }
            self.send(msg, left.min(SEND_TIMEOUT)).await;
        }
    }

    async fn send(&mut self, msg: Outgoing, timeout: Duration) {
        let batch = KvEventBatch {
            ts: msg.ts,
            events: msg.events,
            data_parallel_rank: self.data_parallel_rank,
        };
        let payload = Bytes::from(encode_batch(&batch, self.encoding));
        let mut frames = ZmqMessage::from(self.topic.clone());
        frames.push_back(Bytes::copy_from_slice(&seq_bytes(msg.seq)));
        frames.push_back(payload.clone());
        match tokio::time::timeout(timeout, self.publisher.send(frames)).await {
            Ok(Ok(())) => {
                self.stats.sent.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(e)) => {
                self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(seq = msg.seq, error = %e, "KV-events send failed");
            }
            Err(_) => {
                self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(seq = msg.seq, "KV-events send timed out");
            }
        }
        if self.buffer_steps > 0 {
            if self.buffer.len() == self.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((msg.seq, payload));
        }
    }

    async fn serve_replay(&mut self, request: ZmqMessage) {
        let frames = request.into_vec();
        let (identity, delimited, start) = match frames.as_slice() {
            [identity, empty, start] if empty.is_empty() => (identity.clone(), true, start),
            [identity, start] => (identity.clone(), false, start),
            _ => {
                tracing::warn!(frames = frames.len(), "invalid KV-events replay request");
                return;
            }
        };
        let start = match parse_seq(start) {
            Ok(seq) => seq,
            Err(e) => {
                tracing::warn!(error = %e, "invalid KV-events replay request");
                return;
            }
        };
        let Some(router) = self.replay.as_mut() else {
            return;
        };
        let reply = |seq: [u8; 8], payload: Bytes| {
            let mut m = ZmqMessage::from(identity.clone());
            if delimited {
                m.push_back(Bytes::new());
            }
            m.push_back(Bytes::copy_from_slice(&seq));
            m.push_back(payload);
            m
        };
        let pending: Vec<(u64, Bytes)> = self
            .buffer
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let end = std::iter::once(reply(END_SEQ.to_be_bytes(), Bytes::new()));
        for message in pending
            .into_iter()
            .map(|(seq, payload)| reply(seq_bytes(seq), payload))
            .chain(end)
        {
            match tokio::time::timeout(SEND_TIMEOUT, router.send(message)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "KV-events replay aborted");
                    return;
                }
                Err(_) => {
                    tracing::warn!("KV-events replay timed out");
                    return;
                }
            }
        }
    }

    async fn close(self) {
        let close = async {
            self.publisher.close().await;
            if let Some(router) = self.replay {
                router.close().await;
            }
        };
        let _ = tokio::time::timeout(SHUTDOWN_DRAIN, close).await;
    }
}

async fn recv_replay(socket: &mut Option<RouterSocket>) -> Result<ZmqMessage, zeromq::ZmqError> {
    match socket {
        Some(socket) => socket.recv().await,
        None => std::future::pending().await,
    }
}
