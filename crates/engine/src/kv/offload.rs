//! The engine's side of the shared KV tier: the task that sends the blocks the pool evicts to
//! the tier ([`spawn_offloader`]) and the lookup a new request makes there before the engine
//! recomputes a prefix ([`tier_lookup`]). Both speak the block protocol of [`super::transfer`].
//!
//! The offloader owns one connection. It batches whatever the pool's copy queue holds, puts
//! it, and reports what the tier acknowledged as [`TierChange::Stored`]; about every `poll`
//! it asks the tier what left since its last look and reports that as
//! [`TierChange::Removed`]. When the tier cannot be reached it drops the blocks it is given
//! (the queue is bounded by its creator, and nothing here keeps more than one batch) and
//! retries the connection with a doubling backoff. When the tier's eviction log no longer
//! reaches back to where it last looked (entries were dropped, or the tier restarted and
//! numbers its log anew), it reports [`TierChange::Lost`]: nothing it announced can be
//! trusted to be there any more.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;

use crate::kv::block_pool::HashKey;
use crate::kv::tls::KvConnector;
use crate::kv::transfer::{BlockData, BlockSpec, TransferClient, TransferError};

/// What changed on the tier, as this engine announces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierChange {
    Stored(Vec<HashKey>),
    Removed(Vec<HashKey>),
    /// The eviction log was truncated: every block announced on the tier may be gone.
    Lost,
}

/// The bound on each call the offloader makes (connect, put, poll). The tier runs on this
/// machine, so this only matters when it is stuck.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Reconnect backoff: first wait and ceiling.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The most blocks and bytes in one put.
const BATCH_BLOCKS: usize = 64;
const BATCH_BYTES: usize = 32 << 20;

/// Takes evicted blocks from `rx`, puts them to the tier at `addr` in batches (reconnecting
/// with backoff when the tier is down, dropping what it cannot send), polls evictions about
/// every `poll` and reports both through `on_change`. Ends when `rx` closes. Connections
/// go through `connector` (plain, or TLS verifying the tier by its address).
pub fn spawn_offloader(
    connector: KvConnector,
    addr: SocketAddr,
    spec: BlockSpec,
    rx: mpsc::Receiver<BlockData>,
    poll: Duration,
    on_change: Box<dyn Fn(TierChange) + Send + Sync>,
) -> tokio::task::JoinHandle<()> {
    let offloader = Offloader {
        connector,
        addr,
        spec,
        on_change,
        conn: None,
        seq: None,
        announced: false,
        retry_at: Instant::now(),
        backoff: BACKOFF_MIN,
        dropped: 0,
    };
    tokio::spawn(offloader.run(rx, poll))
}

struct Offloader {
    connector: KvConnector,
    addr: SocketAddr,
    spec: BlockSpec,
    on_change: Box<dyn Fn(TierChange) + Send + Sync>,
    conn: Option<TransferClient>,
    /// Where in the tier's eviction log the next poll starts; `None` before first contact.
    seq: Option<u64>,
    /// Whether a `Stored` went out since the start or the last `Lost`.
    announced: bool,
    /// No connection attempt before this.
    retry_at: Instant,
    backoff: Duration,
    /// Blocks dropped because the tier could not take them (logged, for the operator).
    dropped: u64,
}

impl Offloader {
    async fn run(mut self, mut rx: mpsc::Receiver<BlockData>, poll: Duration) {
        let mut ticker = tokio::time::interval(poll.max(Duration::from_millis(10)));
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                first = rx.recv() => {
                    let Some(first) = first else { break };
                    let batch = take_batch(first, &mut rx);
                    self.send(batch).await;
                }
                _ = ticker.tick() => {
                    if self.connected().await {
                        self.poll().await;
                    }
                }
            }
        }
        if self.dropped > 0 {
            tracing::info!(
                dropped = self.dropped,
                "KV offloader ends; blocks were dropped while the tier was unreachable"
            );
        }
    }

    /// Whether a connection is open, making one if the backoff allows.
    async fn connected(&mut self) -> bool {
        if self.conn.is_some() {
            return true;
        }
        if Instant::now() < self.retry_at {
            return false;
        }
        let host = self.addr.ip().to_string();
        let connect = TransferClient::connect_with(
            &self.connector,
            self.addr,
            &host,
            &self.spec,
            CALL_TIMEOUT,
        );
        match connect.await {
            Ok(c) => {
                self.conn = Some(c);
                self.backoff = BACKOFF_MIN;
                // Learn (or check) the log position before anything is announced.
                self.poll().await;
                self.conn.is_some()
            }
            Err(e) => {
                self.fail(&e);
                false
            }
        }
    }

    fn fail(&mut self, e: &TransferError) {
        if self.conn.take().is_some() || self.backoff == BACKOFF_MIN {
            tracing::warn!(tier = %self.addr, error = %e, "KV tier unreachable; dropping offloaded blocks until it is back");
        }
        self.retry_at = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
    }

    async fn send(&mut self, batch: Vec<BlockData>) {
        if !self.connected().await {
            self.dropped += batch.len() as u64;
            return;
        }
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let hashes: Vec<HashKey> = batch.iter().map(|b| b.hash).collect();
        match conn.put(batch).await {
            Ok(()) => {
                self.announced = true;
                (self.on_change)(TierChange::Stored(hashes));
            }
            Err(e) => {
                self.dropped += hashes.len() as u64;
                self.fail(&e);
            }
        }
    }

    async fn poll(&mut self) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        // First contact asks from the end of the log: what left before this engine announced
        // anything is none of its business.
        let ask = self.seq.unwrap_or(u64::MAX);
        match conn.evictions_since(ask).await {
            Ok(ev) => {
                if let Some(seq) = self.seq {
                    if !ev.complete || ev.next < seq {
                        if self.announced {
                            (self.on_change)(TierChange::Lost);
                            self.announced = false;
                        }
                    } else if !ev.hashes.is_empty() {
                        (self.on_change)(TierChange::Removed(ev.hashes));
                    }
                }
                self.seq = Some(ev.next);
            }
            Err(e) => self.fail(&e),
        }
    }
}

/// `first` and whatever else is queued now, up to one batch.
fn take_batch(first: BlockData, rx: &mut mpsc::Receiver<BlockData>) -> Vec<BlockData> {
    let mut bytes = first.bytes.len();
    let mut batch = vec![first];
    while batch.len() < BATCH_BLOCKS && bytes < BATCH_BYTES {
        match rx.try_recv() {
            Ok(b) => {
                bytes += b.bytes.len();
                batch.push(b);
            }
            Err(_) => break,
        }
    }
    batch
}

/// Pooled lookup connections, per connector (plain, or one TLS identity), tier and spec,
/// each with when it was last used.
type PoolKey = (u64, SocketAddr, String);
type Pool = Mutex<HashMap<PoolKey, Vec<(TransferClient, Instant)>>>;

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(Default::default)
}

/// A pooled connection idle this long may have been closed by the tier (it closes at 60 s).
const POOL_IDLE: Duration = Duration::from_secs(30);
/// Connections kept per tier and spec.
const POOL_MAX: usize = 4;

fn pool_key(connector: &KvConnector, addr: SocketAddr, spec: &BlockSpec) -> PoolKey {
    (connector.id(), addr, spec.to_string())
}

fn pool_take(key: &PoolKey) -> Option<TransferClient> {
    let mut pool = pool().lock().unwrap_or_else(|p| p.into_inner());
    let list = pool.get_mut(key)?;
    while let Some((c, used)) = list.pop() {
        if used.elapsed() < POOL_IDLE {
            return Some(c);
        }
    }
    None
}

fn pool_put(key: PoolKey, c: TransferClient) {
    let mut pool = pool().lock().unwrap_or_else(|p| p.into_inner());
    let list = pool.entry(key).or_default();
    list.retain(|(_, used)| used.elapsed() < POOL_IDLE);
    if list.len() < POOL_MAX {
        list.push((c, Instant::now()));
    }
}

/// Looks up the leading run of `hashes` in the tier within `timeout` (a fresh or pooled
/// connection, opened through `connector`); any error is an empty answer (the engine
/// recomputes).
pub async fn tier_lookup(
    connector: &KvConnector,
    addr: SocketAddr,
    spec: &BlockSpec,
    hashes: &[HashKey],
    timeout: Duration,
) -> Vec<BlockData> {
    if hashes.is_empty() {
        return Vec::new();
    }
    let key = pool_key(connector, addr, spec);
    let lookup = async {
        // A pooled connection the tier has since closed fails at once; then a fresh one.
        if let Some(mut c) = pool_take(&key) {
            if let Ok(blocks) = c.get(hashes, None).await {
                pool_put(key, c);
                return Ok(blocks);
            }
        }
        let host = addr.ip().to_string();
        let mut c = TransferClient::connect_with(connector, addr, &host, spec, timeout).await?;
        let blocks = c.get(hashes, None).await?;
        pool_put(key, c);
        Ok::<_, TransferError>(blocks)
    };
    match tokio::time::timeout(timeout, lookup).await {
        Ok(Ok(blocks)) => blocks,
        Ok(Err(e)) => {
            tracing::debug!(tier = %addr, error = %e, "KV tier lookup failed; recomputing");
            Vec::new()
        }
        Err(_) => {
            tracing::debug!(tier = %addr, "KV tier lookup timed out; recomputing");
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::cache::KvDtype;
    use crate::kv::tier::{Tier, TierConfig, TierStore};
    use crate::kv::transfer::{self, BlockSource};
    use std::sync::Arc;

    fn spec() -> BlockSpec {
        BlockSpec {
            model: "m".into(),
            block_size: 2,
            n_layer: 1,
            slot_width: 2,
            dtype: KvDtype::F16,
            scales_per_slot: 0,
        }
    }
    const B: u64 = 16;

    fn blk(n: u8) -> BlockData {
        BlockData {
            hash: [n; 32],
            bytes: vec![n; B as usize],
        }
    }

    /// A tier served on a loopback port for as long as the returned sender lives.
    async fn tier(config: TierConfig) -> (SocketAddr, Tier, tokio::sync::oneshot::Sender<()>) {
        let t = Tier::new(TierStore::new(config).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let src: Arc<dyn BlockSource> = Arc::new(t.clone());
        tokio::spawn(transfer::serve(listener, src, async {
            let _ = rx.await;
        }));
        (addr, t, tx)
    }

    type Changes = Arc<Mutex<Vec<TierChange>>>;

    fn recorder() -> (Changes, Box<dyn Fn(TierChange) + Send + Sync>) {
        let changes: Changes = Default::default();
        let c = changes.clone();
        (changes, Box::new(move |ch| c.lock().unwrap().push(ch)))
    }

    /// Waits (bounded) until `pred` holds for the changes so far.
    async fn until(changes: &Changes, pred: impl Fn(&[TierChange]) -> bool) {
        let t0 = Instant::now();
        while !pred(&changes.lock().unwrap()) {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "changes so far: {:?}",
                changes.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn stored(ch: &[TierChange]) -> Vec<HashKey> {
        ch.iter()
            .filter_map(|c| match c {
                TierChange::Stored(h) => Some(h.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn removed(ch: &[TierChange]) -> Vec<HashKey> {
        ch.iter()
            .filter_map(|c| match c {
                TierChange::Removed(h) => Some(h.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[tokio::test]
    async fn offloaded_blocks_are_announced_then_their_eviction() {
        let (addr, t, _stop) = tier(TierConfig::memory(2 * B)).await;
        let (changes, on_change) = recorder();
        let (tx, rx) = mpsc::channel(16);
        let task = spawn_offloader(
            KvConnector::plain(),
            addr,
            spec(),
            rx,
            Duration::from_millis(30),
            on_change,
        );
        for n in 1..=2 {
            tx.send(blk(n)).await.unwrap();
        }
        until(&changes, |c| stored(c).len() == 2).await;
        assert_eq!(stored(&changes.lock().unwrap()), vec![[1; 32], [2; 32]]);
        assert_eq!(t.stats().memory_blocks, 2);
        // A third block pushes the first out of the tier; the poll reports it.
        tx.send(blk(3)).await.unwrap();
        until(&changes, |c| !removed(c).is_empty()).await;
        assert_eq!(removed(&changes.lock().unwrap()), vec![[1; 32]]);
        assert!(!changes.lock().unwrap().contains(&TierChange::Lost));
        // The lookup an engine does finds what is left, as a leading run.
        let found = tier_lookup(
            &KvConnector::plain(),
            addr,
            &spec(),
            &[[2; 32], [3; 32], [1; 32]],
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(found, vec![blk(2), blk(3)]);
        drop(tx);
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_cut_eviction_log_means_lost() {
        let config = TierConfig {
            log_entries: 2,
            ..TierConfig::memory(B)
        };
        let (addr, _t, _stop) = tier(config).await;
        let (changes, on_change) = recorder();
        let (tx, rx) = mpsc::channel(16);
        let _task = spawn_offloader(
            KvConnector::plain(),
            addr,
            spec(),
            rx,
            Duration::from_millis(200),
            on_change,
        );
        tx.send(blk(1)).await.unwrap();
        until(&changes, |c| stored(c).len() == 1).await;
        // Five more in one batch push six departures past a log of two before the next poll.
        for n in 2..=6 {
            tx.try_send(blk(n)).unwrap();
        }
        until(&changes, |c| c.contains(&TierChange::Lost)).await;
        let ch = changes.lock().unwrap();
        assert_eq!(
            ch.iter().filter(|c| **c == TierChange::Lost).count(),
            1,
            "{ch:?}"
        );
    }

    #[tokio::test]
    async fn a_tier_that_restarts_means_lost_and_offloading_resumes() {
        let (addr, _t, stop) = tier(TierConfig::memory(8 * B)).await;
        let (changes, on_change) = recorder();
        let (tx, rx) = mpsc::channel(16);
        let _task = spawn_offloader(
            KvConnector::plain(),
            addr,
            spec(),
            rx,
            Duration::from_millis(30),
            on_change,
        );
        tx.send(blk(1)).await.unwrap();
        until(&changes, |c| stored(c).len() == 1).await;
        // The tier goes away and a new one (empty, its log numbered anew) takes its port.
        stop.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t2 = Tier::new(TierStore::new(TierConfig::memory(8 * B)).unwrap());
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let src: Arc<dyn BlockSource> = Arc::new(t2.clone());
        tokio::spawn(transfer::serve(listener, src, std::future::pending()));
        until(&changes, |c| c.contains(&TierChange::Lost)).await;
        // Once back, new blocks are stored on the new tier and announced again.
        let t0 = Instant::now();
        while t2.stats().memory_blocks == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{:?}",
                changes.lock().unwrap()
            );
            let _ = tx.try_send(blk(2));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        until(&changes, |c| stored(c).contains(&[2; 32])).await;
        let ch = changes.lock().unwrap();
        let lost_at = ch.iter().position(|c| *c == TierChange::Lost).unwrap();
        assert!(
            matches!(&ch[0], TierChange::Stored(h) if h == &vec![[1; 32]]),
            "{ch:?}"
        );
        assert!(lost_at > 0);
    }

    #[tokio::test]
    async fn a_dead_tier_costs_nothing_but_the_dropped_blocks() {
        // A port nobody listens on.
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let (changes, on_change) = recorder();
        let (tx, rx) = mpsc::channel(4);
        let task = spawn_offloader(
            KvConnector::plain(),
            addr,
            spec(),
            rx,
            Duration::from_millis(20),
            on_change,
        );
        // The offloader keeps draining its queue while the tier is away: a sender that waits
        // for room is never stuck.
        let t0 = Instant::now();
        for n in 0..200u8 {
            tokio::time::timeout(Duration::from_secs(1), tx.send(blk(n)))
                .await
                .expect("the queue drains")
                .unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(changes.lock().unwrap().is_empty());
        assert!(tier_lookup(
            &KvConnector::plain(),
            addr,
            &spec(),
            &[[1; 32]],
            Duration::from_millis(200)
        )
        .await
        .is_empty());
        drop(tx);
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("the offloader ends when its queue closes")
            .unwrap();
    }

    #[tokio::test]
    async fn a_stalled_tier_lookup_gives_up_within_its_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let t0 = Instant::now();
        let found = tier_lookup(
            &KvConnector::plain(),
            addr,
            &spec(),
            &[[1; 32]],
            Duration::from_millis(150),
        )
        .await;
        assert!(found.is_empty());
        assert!(t0.elapsed() < Duration::from_secs(1));
    }
}
