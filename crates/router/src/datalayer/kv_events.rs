//! The KV-event subscriber (PROTOCOLS §4): one ZMQ SUB socket per endpoint that publishes
//! events, feeding the precise prefix index, plus replay from the endpoint's replay
//! socket when events were missed.
//!
//! Messages are `[topic, seq (8 bytes BE), msgpack payload]`; the topic filter is `kv@`.
//! Sequence numbers say when the mirror may have diverged from the engine's cache:
//!
//! - the next number: applied;
//! - a gap (events lost: a slow subscriber, a reconnect, a dropped batch): the missing
//!   numbers are asked from the endpoint's replay socket (spec key `kv_events_replay`),
//!   applied in order, then the live message; messages a replay already applied are
//!   skipped when they arrive live, so no event is applied twice;
//! - a replay that cannot cover the gap (no replay socket, buffer too short, a hole, a
//!   timeout, garbage): the endpoint's entries are dropped and the mirror rebuilds from
//!   the live stream. The index must never claim blocks whose removal it may have missed;
//! - a number that goes backwards on one connection (the publisher restarted): the
//!   mirror is dropped, as the engine's cache was;
//! - the first message a fresh (empty) mirror sees: the replay buffer's run of messages
//!   just before it, when there is one without a hole, is applied first (history that is
//!   safe to take: nothing in it was removed without the removal being in it too).
//!
//! Dropping entries costs hit rate for a moment, never correctness of the proxy (a wrong
//! prefix guess only costs a cache miss). The bookkeeping is [`Sequencer`] (pure); the
//! socket work is [`run`] and [`replay`].

use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use strata_api::kv_events::{
    decode_batch, decode_replay_reply, parse_seq, seq_bytes, DecodeError, KvEventBatch,
    ReplayFrame, TOPIC_PREFIX,
};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::datalayer::PoolFeed;
use crate::endpoint::EndpointId;
use crate::telemetry::RouterMetrics;

/// Most batches one replay may return (a publisher's buffer is far smaller).
const MAX_REPLAY_BATCHES: usize = 1 << 16;

/// What to do with one live message, from sequence numbers alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Live {
    /// The next number: apply it.
    Apply,
    /// Numbers `from..seq` are missing: replay them, then apply this one.
    Gap { from: u64 },
    /// The mirror is empty: it may take the replay buffer's run before this message.
    Fresh,
    /// The publisher went backwards (it restarted): drop the mirror, then as `Fresh`.
    Restart,
}

/// Sequence bookkeeping for one endpoint's mirror. Pure: the subscriber feeds it what it
/// received and applied, and does what it says.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sequencer {
    /// The last number applied to the mirror; `None` while the mirror holds nothing
    /// (never filled, or dropped).
    applied: Option<u64>,
    /// The last number received live on this connection.
    live_last: Option<u64>,
}

impl Sequencer {
    /// Classifies the live message numbered `seq`.
    pub(crate) fn on_live(&mut self, seq: u64) -> Live {
        let backwards = self.live_last.is_some_and(|l| seq <= l);
        self.live_last = Some(seq);
        if backwards {
            return Live::Restart;
        }
        match self.applied {
            None => Live::Fresh,
            Some(a) if seq == a.wrapping_add(1) => Live::Apply,
            // Live numbers only grow, and a replay never runs past the live message
            // that asked for it: a number already applied means numbering started again.
            Some(a) if seq <= a => Live::Restart,
            Some(a) => Live::Gap { from: a + 1 },
        }
    }

    /// `seq` was applied to the mirror.
    pub(crate) fn applied(&mut self, seq: u64) {
        self.applied = Some(seq);
    }

    /// The mirror was dropped.
    pub(crate) fn reset(&mut self) {
        self.applied = None;
    }

    /// A new connection: numbering is compared with what was applied, not with the old
    /// connection's last message.
    pub(crate) fn reconnected(&mut self) {
        self.live_last = None;
    }
}

/// From replayed batches (in the order received), the ones that fill the numbers
/// `from..until` exactly, in order; `None` when they leave a hole. `from = None` (an
/// empty mirror) accepts any hole-free run that ends at `until - 1`, including none.
pub(crate) fn fill(
    from: Option<u64>,
    until: u64,
    frames: Vec<(u64, KvEventBatch)>,
) -> Option<Vec<(u64, KvEventBatch)>> {
    let mut run: Vec<(u64, KvEventBatch)> = Vec::new();
    for (seq, batch) in frames {
        if seq >= until || from.is_some_and(|f| seq < f) {
            continue;
        }
        match run.last() {
            Some((prev, _)) if seq <= *prev => continue,
            Some((prev, _)) if seq != prev + 1 => {
                if from.is_some() {
                    return None;
                }
                // An empty mirror only wants the run that reaches `until`.
                run.clear();
            }
            _ => {}
        }
        run.push((seq, batch));
    }
    match (from, run.first(), run.last()) {
        // Nothing missing.
        (Some(f), _, _) if f >= until => Some(Vec::new()),
        (Some(f), Some((first, _)), Some((last, _))) if *first == f && last + 1 == until => {
            Some(run)
        }
        (Some(_), _, _) => None,
        (None, _, Some((last, _))) if last + 1 != until => Some(Vec::new()),
        (None, _, _) => Some(run),
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    #[error("replay socket: {0}")]
    Socket(#[from] zeromq::ZmqError),
    #[error("replay timed out")]
    Timeout,
    #[error("bad replay reply: {0}")]
    Decode(#[from] DecodeError),
    #[error("bad replay reply: {0} frames")]
    Frames(usize),
    #[error("replay returned more than {MAX_REPLAY_BATCHES} batches")]
    TooLong,
}

/// Asks the replay socket at `addr` for every buffered batch numbered `from` or later
/// (stopping early once `until - 1` has arrived), bounded by `timeout` as a whole.
pub(crate) async fn replay(
    addr: &str,
    from: u64,
    until: Option<u64>,
    timeout: Duration,
) -> Result<Vec<(u64, KvEventBatch)>, ReplayError> {
    match tokio::time::timeout(timeout, replay_inner(addr, from, until)).await {
        Ok(r) => r,
        Err(_) => Err(ReplayError::Timeout),
    }
}

async fn replay_inner(
    addr: &str,
    from: u64,
    until: Option<u64>,
) -> Result<Vec<(u64, KvEventBatch)>, ReplayError> {
    let mut socket = DealerSocket::new();
    socket.connect(addr).await?;
    // A DEALER adds no delimiter: send `["", seq]` so the answer is the whole stream
    // (the publisher's note on REQ clients).
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&seq_bytes(from)));
    socket.send(request).await?;
    let mut out = Vec::new();
    loop {
        let frames = socket.recv().await?.into_vec();
        let frames = match frames.as_slice() {
            [empty, rest @ ..] if empty.is_empty() && rest.len() == 2 => rest,
            all => all,
        };
        let [seq, payload] = frames else {
            return Err(ReplayError::Frames(frames.len()));
        };
        match decode_replay_reply(seq, payload)? {
            ReplayFrame::End => break,
            ReplayFrame::Batch { seq, batch } => {
                out.push((seq, batch));
                if out.len() > MAX_REPLAY_BATCHES {
                    return Err(ReplayError::TooLong);
                }
                if until.is_some_and(|u| seq.wrapping_add(1) >= u) {
                    break;
                }
            }
        }
    }
    Ok(out)
}

/// One endpoint's subscriber: runs until the router drops the endpoint.
pub(crate) async fn run<F: PoolFeed>(
    weak: Weak<F>,
    id: EndpointId,
    url: String,
    addr: String,
    replay_addr: Option<String>,
) {
    let mut backoff = Duration::from_millis(50);
    let mut seqs = Sequencer::default();
    loop {
        let Some(inner) = live(&weak, id, &url) else {
            return;
        };
        let replay_timeout = inner.config().kv_replay_timeout();
        drop(inner);
        let mut sub = match subscribe(&addr).await {
            Ok(sub) => sub,
            Err(e) => {
                tracing::debug!(endpoint = %url, %addr, error = %e, "KV events: connect failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        tracing::info!(endpoint = %url, %addr, "KV events: subscribed");
        seqs.reconnected();
        let ep = Subscription {
            id,
            url: &url,
            replay_addr: replay_addr.as_deref(),
            replay_timeout,
        };
        if follow(&weak, &ep, &mut sub, &mut seqs).await == Followed::Gone {
            return;
        }
        // With a replay socket the mirror is kept: the first message of the next
        // connection finds the gap and the replay fills it. Without one, what was missed
        // is unknowable.
        if replay_addr.is_none() {
            if let Some(inner) = weak.upgrade() {
                clear(&*inner, id);
                seqs.reset();
            }
        }
        tokio::time::sleep(backoff).await;
    }
}

/// One endpoint's publisher, as one connection's subscriber sees it.
struct Subscription<'a> {
    id: EndpointId,
    url: &'a str,
    replay_addr: Option<&'a str>,
    replay_timeout: Duration,
}

/// How following one connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Followed {
    /// The connection broke: reconnect.
    Lost,
    /// The router dropped the endpoint: stop.
    Gone,
}

/// A SUB socket on `addr`, subscribed to the KV-event topics.
async fn subscribe(addr: &str) -> Result<SubSocket, zeromq::ZmqError> {
    let mut sub = SubSocket::new();
    sub.subscribe(TOPIC_PREFIX).await?;
    sub.connect(addr).await?;
    Ok(sub)
}

/// Applies one connection's live messages, in sequence, until it breaks or the router
/// drops the endpoint.
async fn follow<F: PoolFeed>(
    weak: &Weak<F>,
    ep: &Subscription<'_>,
    sub: &mut SubSocket,
    seqs: &mut Sequencer,
) -> Followed {
    loop {
        let msg = match sub.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(endpoint = %ep.url, error = %e, "KV events: connection lost");
                return Followed::Lost;
            }
        };
        let Some(inner) = live(weak, ep.id, ep.url) else {
            return Followed::Gone;
        };
        let Some((seq, batch)) = decode(msg) else {
            tracing::warn!(endpoint = %ep.url, "KV events: undecodable message; resetting mirror");
            clear(&*inner, ep.id);
            seqs.reset();
            continue;
        };
        let before = catch_up(&*inner, ep, seqs, seq).await;
        note_block_size(&*inner, ep, &before, &batch);
        apply(&*inner, ep, seqs, before, (seq, batch));
    }
}

/// A live message's sequence number and batch (`[topic, seq, payload]`), or `None` when
/// it does not decode.
fn decode(msg: ZmqMessage) -> Option<(u64, KvEventBatch)> {
    let frames = msg.into_vec();
    match frames.as_slice() {
        [_, seq, payload] => parse_seq(seq)
            .ok()
            .and_then(|s| decode_batch(payload).ok().map(|b| (s, b))),
        _ => None,
    }
}

/// The batches to apply before the live message numbered `seq`: none when it is the
/// next, else the replayed run that fills what is missing. When nothing can fill it (or
/// the publisher restarted) the mirror is dropped first and rebuilds from here.
async fn catch_up<F: PoolFeed + ?Sized>(
    inner: &F,
    ep: &Subscription<'_>,
    seqs: &mut Sequencer,
    seq: u64,
) -> Vec<(u64, KvEventBatch)> {
    let missing = match seqs.on_live(seq) {
        Live::Apply => return Vec::new(),
        Live::Gap { from } => Some(from),
        Live::Fresh => None,
        Live::Restart => {
            tracing::warn!(endpoint = %ep.url, seq, "KV events: sequence went back; resetting mirror");
            clear(inner, ep.id);
            seqs.reset();
            None
        }
    };
    match replay_missing(inner, ep, missing, seq).await {
        Some(batches) => batches,
        None => {
            tracing::warn!(endpoint = %ep.url, seq, "KV events: gap replay could not fill; resetting mirror");
            inner
                .metrics()
                .kv_replay_failures
                .get_or_create(&RouterMetrics::endpoint(ep.url))
                .inc();
            clear(inner, ep.id);
            seqs.reset();
            Vec::new()
        }
    }
}

/// The replayed batches numbered `from..until` (`from = None`: an empty mirror, which
/// takes the hole-free run just before `until`, or nothing), or `None` when no replay can
/// fill the gap.
async fn replay_missing<F: PoolFeed + ?Sized>(
    inner: &F,
    ep: &Subscription<'_>,
    from: Option<u64>,
    until: u64,
) -> Option<Vec<(u64, KvEventBatch)>> {
    match (ep.replay_addr, until) {
        // An empty mirror before message 0 misses nothing.
        (_, 0) if from.is_none() => Some(Vec::new()),
        (Some(raddr), _) => {
            inner
                .metrics()
                .kv_replays
                .get_or_create(&RouterMetrics::endpoint(ep.url))
                .inc();
            match replay(raddr, from.unwrap_or(0), Some(until), ep.replay_timeout).await {
                Ok(frames) => fill(from, until, frames),
                Err(e) => {
                    tracing::warn!(endpoint = %ep.url, error = %e, "KV events: replay failed");
                    None
                }
            }
        }
        (None, _) if from.is_none() => Some(Vec::new()),
        (None, _) => None,
    }
}

/// Tells the router the block size the endpoint's events carry (the first stored block
/// of `before` and then `batch` says it), which its prompts are hashed with.
fn note_block_size<F: PoolFeed + ?Sized>(
    inner: &F,
    ep: &Subscription<'_>,
    before: &[(u64, KvEventBatch)],
    batch: &KvEventBatch,
) {
    let event_block_size = before
        .iter()
        .map(|(_, b)| b)
        .chain(std::iter::once(batch))
        .flat_map(|b| &b.events)
        .find_map(|ev| match ev {
            strata_api::kv_events::KvEvent::BlockStored { block_size, .. } => Some(*block_size),
            _ => None,
        });
    if let Some(bs) = event_block_size {
        inner.note_kv_block_size(ep.id, ep.url, u32::try_from(bs).unwrap_or(0));
    }
}

/// Applies `before`, then the live batch, to the precise index in order, marking each
/// number applied, and counts the events and the index's size.
fn apply<F: PoolFeed + ?Sized>(
    inner: &F,
    ep: &Subscription<'_>,
    seqs: &mut Sequencer,
    before: Vec<(u64, KvEventBatch)>,
    live: (u64, KvEventBatch),
) {
    let mut index = inner.precise().write().unwrap_or_else(|e| e.into_inner());
    let mut events = 0;
    for (s, b) in before.iter().chain(std::iter::once(&live)) {
        for ev in &b.events {
            index.apply(ep.id, ev);
        }
        events += b.events.len();
        seqs.applied(*s);
    }
    let len = index.len();
    drop(index);
    inner
        .metrics()
        .kv_events
        .get_or_create(&RouterMetrics::endpoint(ep.url))
        .inc_by(events as u64);
    inner
        .metrics()
        .index_blocks
        .get_or_create(&RouterMetrics::index("precise"))
        .set(len as i64);
}

/// The router, while it still has this endpoint.
fn live<F: PoolFeed>(weak: &Weak<F>, id: EndpointId, url: &str) -> Option<Arc<F>> {
    weak.upgrade().filter(|inner| inner.has(id, url))
}

fn clear(inner: &(impl PoolFeed + ?Sized), id: EndpointId) {
    inner
        .precise()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove_endpoint(id);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(n: u64) -> (u64, KvEventBatch) {
        (
            n,
            KvEventBatch {
                ts: n as f64,
                events: vec![],
                data_parallel_rank: None,
            },
        )
    }

    fn seqs(v: Option<Vec<(u64, KvEventBatch)>>) -> Option<Vec<u64>> {
        v.map(|b| b.into_iter().map(|(s, _)| s).collect())
    }

    #[test]
    fn sequencer_classifies_live_numbers() {
        let mut s = Sequencer::default();
        assert_eq!(s.on_live(5), Live::Fresh);
        s.applied(5);
        assert_eq!(s.on_live(6), Live::Apply);
        s.applied(6);
        assert_eq!(s.on_live(9), Live::Gap { from: 7 });
        s.applied(9);
        assert_eq!(s.on_live(2), Live::Restart, "backwards on one connection");
        s.reset();
        s.applied(2);
        // A new connection to the same publisher: the next number continues.
        s.reconnected();
        assert_eq!(s.on_live(3), Live::Apply);
        s.applied(3);
        // A new connection to a restarted publisher: numbering starts again.
        s.reconnected();
        assert_eq!(s.on_live(0), Live::Restart);
    }

    #[test]
    fn fill_takes_exactly_the_missing_run() {
        let frames = |v: &[u64]| v.iter().map(|&n| batch(n)).collect::<Vec<_>>();
        // Gap 7..10 covered (the buffer also holds older and newer batches).
        assert_eq!(
            seqs(fill(Some(7), 10, frames(&[5, 6, 7, 8, 9, 10, 11]))),
            Some(vec![7, 8, 9])
        );
        // Buffer too short: starts after the gap does.
        assert_eq!(seqs(fill(Some(7), 10, frames(&[8, 9]))), None);
        // A hole inside, or nothing at all.
        assert_eq!(seqs(fill(Some(7), 10, frames(&[7, 9]))), None);
        assert_eq!(seqs(fill(Some(7), 10, frames(&[]))), None);
        // Duplicates are ignored.
        assert_eq!(seqs(fill(Some(7), 9, frames(&[7, 7, 8]))), Some(vec![7, 8]));
        // An empty mirror takes the hole-free run that reaches the live message, or none.
        assert_eq!(
            seqs(fill(None, 6, frames(&[1, 3, 4, 5, 6]))),
            Some(vec![3, 4, 5])
        );
        assert_eq!(seqs(fill(None, 6, frames(&[1, 2, 3]))), Some(vec![]));
        assert_eq!(seqs(fill(None, 6, frames(&[]))), Some(vec![]));
    }
}
