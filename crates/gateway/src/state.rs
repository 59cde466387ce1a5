//! The gateway's shared state: config, store, the in-memory mirror of keys and tenants,
//! the limiter, the cache, metrics, the upstream client and the usage writer.
//!
//! Invariants:
//! * The request path reads keys and spend from memory only; the store is written by the
//!   usage writer thread (batched) and by admin calls, which update memory at once (so a
//!   revoked key is refused on the very next request).
//! * In-memory spend is never lower than the stored spend: a refresh from the store takes
//!   the larger of the two, because ledger rows may still be queued.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};
use prometheus_client::metrics::counter::Counter;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::cache::{MemoryCache, RedisCache, ResponseCache};
use crate::config::{Backend, ConfigHandle, RateLimits};
use crate::keys;
use crate::metrics::Metrics;
use crate::ratelimit::{LimitCheck, LimitKind, Limiter, MemoryLimiter, RedisLimiter};
use crate::redis_conn::{RedisConn, RedisError};
use crate::store::{AuditEntry, KeyRecord, Store, StoreError, TenantRecord, UsageEvent};

pub const MINUTE_US: i64 = 60_000_000;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Redis(#[from] RedisError),
    #[error("http client: {0}")]
    Client(String),
}

/// A key as the request path sees it.
#[derive(Debug)]
pub struct KeyEntry {
    pub record: KeyRecord,
    pub spend: AtomicI64,
}

/// A tenant's stored overrides and live spend.
#[derive(Debug)]
pub struct TenantEntry {
    pub record: TenantRecord,
    pub spend: AtomicI64,
}

enum WriterMsg {
    Usage(UsageEvent),
    Flush(std_mpsc::Sender<()>),
}

/// Ledger rows that may wait for the usage writer. When SQLite falls this far behind, the
/// request path waits for room rather than dropping rows (counted in
/// `strata_gateway_ledger_backpressure_total`).
pub const LEDGER_QUEUE: usize = 65_536;

/// How long a ledger row may wait in memory before the usage writer commits it. The writer
/// lets rows gather this long instead of waking for every row: one transaction per
/// interval rather than one per request (live spend is in memory at once; only the
/// durable copy waits). [`Gateway::flush_usage`], a full queue and shutdown wake it early.
pub const LEDGER_FLUSH_INTERVAL: Duration = Duration::from_millis(50);

/// Rows per ledger transaction at most.
const LEDGER_BATCH: usize = 4096;

/// Options that are not part of `gateway.yaml`.
#[derive(Debug, Clone, Default)]
pub struct GatewayOptions {
    /// Admin API key; the admin API is disabled without one.
    pub admin_key: Option<String>,
    /// Seed for routing choices and backoff jitter (random when `None`).
    pub seed: Option<u64>,
}

pub struct Gateway {
    pub config: Arc<ConfigHandle>,
    pub store: Arc<dyn Store>,
    pub keys: RwLock<HashMap<String, Arc<KeyEntry>>>,
    pub tenants: RwLock<HashMap<String, Arc<TenantEntry>>>,
    pub limiter: Limiter,
    pub cache: Option<ResponseCache>,
    /// The semantic cache's index, when `cache.semantic.enabled` at start.
    pub semantic: Option<crate::semantic::SemanticIndex>,
    /// The semantic cache's entries shared through Redis, when `cache.semantic.redis_url`.
    pub semantic_share: Option<crate::semantic_share::SemanticShare>,
    pub metrics: Metrics,
    pub client: crate::upstream::UpstreamClient,
    pub admin_key: Option<String>,
    pub rng: Mutex<StdRng>,
    request_prefix: u32,
    request_seq: std::sync::atomic::AtomicU64,
    writer: Mutex<Option<std_mpsc::SyncSender<WriterMsg>>>,
    /// The usage writer, to wake it (flush, full queue, shutdown).
    writer_wake: std::thread::Thread,
    writer_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Gateway {
    /// Builds the state. The limiter and cache backends are chosen here, from the config
    /// at start (changing them needs a restart; everything else reloads).
    pub fn new(
        config: Arc<ConfigHandle>,
        store: Arc<dyn Store>,
        opts: GatewayOptions,
    ) -> Result<Arc<Gateway>, StateError> {
        let resolved = config.get();
        let c = &resolved.config;
        let redis_timeout = Duration::from_millis(c.limits.redis_timeout_ms);
        let limiter = match c.limits.backend {
            Backend::Memory => Limiter::Memory(MemoryLimiter::default()),
            Backend::Redis => Limiter::Redis(RedisLimiter::new(RedisConn::new(
                c.limits.redis_url.as_deref().unwrap_or_default(),
                redis_timeout,
            )?)),
        };
        let cache = if c.cache.enabled {
            let ttl = Duration::from_secs(c.cache.ttl_secs);
            Some(match c.cache.backend {
                Backend::Memory => ResponseCache::Memory(MemoryCache::new(
                    c.cache.max_entries,
                    ttl,
                    c.cache.max_entry_bytes,
                )),
                Backend::Redis => ResponseCache::Redis(RedisCache::new(
                    RedisConn::new(
                        c.cache.redis_url.as_deref().unwrap_or_default(),
                        redis_timeout,
                    )?,
                    ttl,
                    c.cache.max_entry_bytes,
                )),
            })
        } else {
            None
        };
        let semantic = c.cache.semantic.enabled.then(|| {
            crate::semantic::SemanticIndex::new(
                c.cache.semantic.max_entries,
                Duration::from_secs(c.cache.semantic.ttl_secs),
            )
        });
        let sem = &c.cache.semantic;
        let semantic_share = match (&sem.redis_url, sem.enabled) {
            (Some(url), true) => Some(crate::semantic_share::SemanticShare::new(
                url,
                &sem.redis_stream,
                redis_timeout,
                Duration::from_secs(sem.ttl_secs),
                sem.max_entries,
            )?),
            _ => None,
        };
        let client = crate::upstream::UpstreamClient::new(Duration::from_secs(5))
            .map_err(|e| StateError::Client(e.to_string()))?;
        let (tx, rx) = std_mpsc::sync_channel(LEDGER_QUEUE);
        let writer_store = store.clone();
        let metrics = Metrics::new();
        let dropped = metrics.ledger_dropped.clone();
        let handle = std::thread::Builder::new()
            .name("gateway-usage-writer".into())
            .spawn(move || usage_writer(writer_store, rx, dropped))
            .map_err(|e| StateError::Client(format!("cannot start usage writer: {e}")))?;
        let rng = match opts.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let gw = Arc::new(Gateway {
            config,
            store,
            keys: RwLock::new(HashMap::new()),
            tenants: RwLock::new(HashMap::new()),
            limiter,
            cache,
            semantic,
            semantic_share,
            metrics,
            client,
            admin_key: opts.admin_key.filter(|k| !k.is_empty()),
            request_prefix: rand::random(),
            request_seq: std::sync::atomic::AtomicU64::new(0),
            rng: Mutex::new(rng),
            writer: Mutex::new(Some(tx)),
            writer_wake: handle.thread().clone(),
            writer_thread: Mutex::new(Some(handle)),
        });
        gw.refresh_from_store()?;
        Ok(gw)
    }

    /// A fresh request id (`gw-<process prefix>-<sequence>`) for requests that bring none.
    pub fn next_request_id(&self) -> String {
        let n = self.request_seq.fetch_add(1, Ordering::Relaxed);
        format!("gw-{:08x}-{n}", self.request_prefix)
    }

    /// Re-reads keys and tenants from the store into memory.
    pub fn refresh_from_store(&self) -> Result<(), StoreError> {
        let keys = self.store.list_keys()?;
        let tenants = self.store.list_tenants()?;
        {
            let old = self.keys.read();
            let mut map = HashMap::with_capacity(keys.len());
            for k in keys {
                let live = old
                    .get(&k.id)
                    .map_or(0, |e| e.spend.load(Ordering::Relaxed));
                let spend = live.max(k.spend_micros);
                map.insert(
                    k.id.clone(),
                    Arc::new(KeyEntry {
                        record: k,
                        spend: AtomicI64::new(spend),
                    }),
                );
            }
            drop(old);
            *self.keys.write() = map;
        }
        let old = self.tenants.read();
        let mut map = HashMap::with_capacity(tenants.len());
        for t in tenants {
            let live = old
                .get(&t.name)
                .map_or(0, |e| e.spend.load(Ordering::Relaxed));
            let spend = live.max(t.spend_micros);
            map.insert(
                t.name.clone(),
                Arc::new(TenantEntry {
                    record: t,
                    spend: AtomicI64::new(spend),
                }),
            );
        }
        drop(old);
        *self.tenants.write() = map;
        Ok(())
    }

    /// Looks up a presented key. `None` for unknown, malformed, wrong or revoked keys.
    pub fn authenticate(&self, presented: &str) -> Option<Arc<KeyEntry>> {
        let (id, secret) = keys::parse(presented)?;
        let entry = self.keys.read().get(id).cloned()?;
        if entry.record.revoked_at.is_some() {
            return None;
        }
        keys::verify(secret, &entry.record.salt_hex, &entry.record.hash_hex).then_some(entry)
    }

    /// Creates a key and returns the full key text (shown once) with its record.
    pub fn create_key(&self, req: CreateKey) -> Result<(String, KeyRecord), StoreError> {
        let new = keys::generate(&mut rand::rng());
        let record = KeyRecord {
            id: new.id.clone(),
            tenant: req.tenant,
            name: req.name.unwrap_or_default(),
            salt_hex: new.salt_hex,
            hash_hex: new.hash_hex,
            allowed_models: req.allowed_models,
            limits: RateLimits {
                rpm: req.rpm,
                tpm: req.tpm,
            },
            budget_micros: req.budget_usd.map(usd_to_micros),
            spend_micros: 0,
            created_at: unix_now(),
            revoked_at: None,
        };
        self.store.insert_key(&record)?;
        self.audit(
            "create_key",
            &record.id,
            &serde_json::to_string(&record).unwrap_or_default(),
        );
        self.refresh_from_store()?;
        Ok((new.full, record))
    }

    /// Revokes a key; effective for the next request.
    pub fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
        let done = self.store.revoke_key(id, unix_now())?;
        if done {
            self.audit("revoke_key", id, "");
            self.refresh_from_store()?;
        }
        Ok(done)
    }

    /// Appends to the audit log; a failure is logged, not returned.
    pub fn audit(&self, action: &str, target: &str, detail: &str) {
        let entry = AuditEntry {
            ts: unix_now(),
            actor: "admin".into(),
            action: action.into(),
            target: target.into(),
            detail: detail.into(),
        };
        if let Err(e) = self.store.audit(&entry) {
            tracing::error!(error = %e, action, "audit write failed");
        }
    }

    /// Queues a ledger row and updates live spend.
    pub fn record_usage(&self, ev: UsageEvent) {
        if ev.cost_micros != 0 {
            if let Some(k) = self.keys.read().get(&ev.key_id) {
                k.spend.fetch_add(ev.cost_micros, Ordering::Relaxed);
            }
            let tenant = self.tenants.read().get(&ev.tenant).cloned();
            match tenant {
                Some(t) => {
                    t.spend.fetch_add(ev.cost_micros, Ordering::Relaxed);
                }
                None => {
                    let entry = Arc::new(TenantEntry {
                        record: TenantRecord {
                            name: ev.tenant.clone(),
                            limits: RateLimits::default(),
                            budget_micros: None,
                            spend_micros: 0,
                        },
                        spend: AtomicI64::new(ev.cost_micros),
                    });
                    self.tenants
                        .write()
                        .entry(ev.tenant.clone())
                        .or_insert(entry);
                }
            }
        }
        let tx = self.writer.lock().clone();
        if let Some(tx) = tx {
            match tx.try_send(WriterMsg::Usage(ev)) {
                Ok(()) | Err(std_mpsc::TrySendError::Disconnected(_)) => {}
                Err(std_mpsc::TrySendError::Full(msg)) => {
                    // Lossless: wake the writer and wait for room.
                    self.metrics.ledger_backpressure.inc();
                    self.writer_wake.unpark();
                    let _ = tx.send(msg);
                }
            }
        }
    }

    /// Waits until every queued ledger row is written.
    pub fn flush_usage(&self) {
        let (tx, rx) = std_mpsc::channel();
        let writer = self.writer.lock().clone();
        let sent = writer.is_some_and(|w| w.send(WriterMsg::Flush(tx)).is_ok());
        if sent {
            self.writer_wake.unpark();
            let _ = rx.recv_timeout(Duration::from_secs(10));
        }
    }

    /// Stops the usage writer after it drains its queue.
    pub fn close(&self) {
        self.writer.lock().take();
        self.writer_wake.unpark();
        if let Some(h) = self.writer_thread.lock().take() {
            let _ = h.join();
        }
    }

    /// Effective limits of a key and of its tenant.
    pub fn limits_for(&self, key: &KeyEntry) -> (RateLimits, RateLimits) {
        let resolved = self.config.get();
        let c = &resolved.config;
        let key_limits = c.limits.default_key.overlay(key.record.limits);
        let mut tenant_limits = c.limits.default_tenant;
        if let Some(t) = resolved.tenants.get(&key.record.tenant) {
            tenant_limits = tenant_limits.overlay(t.limits);
        }
        if let Some(t) = self.tenants.read().get(&key.record.tenant) {
            tenant_limits = tenant_limits.overlay(t.record.limits);
        }
        (key_limits, tenant_limits)
    }

    /// The limit checks of one request: requests (cost 1) and tokens (cost `tokens`).
    pub fn limit_checks(&self, key: &KeyEntry, tokens: u64) -> (Vec<LimitCheck>, Vec<LimitCheck>) {
        let (kl, tl) = self.limits_for(key);
        let mut requests = Vec::new();
        let mut token_checks = Vec::new();
        let sides = [
            (format!("k:{}", key.record.id), kl),
            (format!("t:{}", key.record.tenant), tl),
        ];
        for (prefix, limits) in sides {
            if let Some(rpm) = limits.rpm {
                requests.push(LimitCheck {
                    bucket: format!("{prefix}:rpm"),
                    limit: rpm,
                    period_us: MINUTE_US,
                    cost: 1,
                    kind: LimitKind::Requests,
                });
            }
            if let Some(tpm) = limits.tpm {
                token_checks.push(LimitCheck {
                    bucket: format!("{prefix}:tpm"),
                    limit: tpm,
                    period_us: MINUTE_US,
                    cost: tokens,
                    kind: LimitKind::Tokens,
                });
            }
        }
        (requests, token_checks)
    }

    /// The budgets that apply to a key: its own and its tenant's (stored overrides the
    /// config), in micro-dollars; `None` is unlimited.
    pub fn budgets(&self, key: &KeyEntry) -> (Option<i64>, Option<i64>) {
        let stored = self
            .tenants
            .read()
            .get(&key.record.tenant)
            .and_then(|t| t.record.budget_micros);
        let tenant = stored.or_else(|| {
            self.config
                .get()
                .tenants
                .get(&key.record.tenant)
                .and_then(|t| t.budget_usd)
                .map(usd_to_micros)
        });
        (key.record.budget_micros, tenant)
    }

    /// `Some(message)` when the key's or tenant's budget is spent.
    pub fn budget_exhausted(&self, key: &KeyEntry) -> Option<String> {
        if let Some(b) = key.record.budget_micros {
            let spent = key.spend.load(Ordering::Relaxed);
            if spent >= b {
                return Some(format!(
                    "Budget exceeded for API key {}: spent ${:.6} of ${:.6}.",
                    key.record.id,
                    spent as f64 / 1e6,
                    b as f64 / 1e6
                ));
            }
        }
        let tenant = self.tenants.read().get(&key.record.tenant).cloned();
        let stored_budget = tenant.as_ref().and_then(|t| t.record.budget_micros);
        let config_budget = self
            .config
            .get()
            .tenants
            .get(&key.record.tenant)
            .and_then(|t| t.budget_usd)
            .map(usd_to_micros);
        if let Some(b) = stored_budget.or(config_budget) {
            let spent = tenant.map_or(0, |t| t.spend.load(Ordering::Relaxed));
            if spent >= b {
                return Some(format!(
                    "Budget exceeded for tenant `{}`: spent ${:.6} of ${:.6}.",
                    key.record.tenant,
                    spent as f64 / 1e6,
                    b as f64 / 1e6
                ));
            }
        }
        None
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.close();
    }
}

/// Fields of a new key.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    pub tenant: String,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub allowed_models: Vec<String>,
    #[serde(default)]
    pub rpm: Option<u64>,
    #[serde(default)]
    pub tpm: Option<u64>,
    #[serde(default)]
    pub budget_usd: Option<f64>,
}

pub fn usd_to_micros(usd: f64) -> i64 {
    (usd * 1e6).round() as i64
}

/// Ledger rows kept in memory while the store refuses them (a database restart); past
/// this the oldest are dropped and counted in `strata_gateway_ledger_dropped_total`.
pub const LEDGER_RETRY_ROWS: usize = 1 << 20;

/// Longest pause between tries of a failed ledger write.
const LEDGER_RETRY_MAX: Duration = Duration::from_secs(1);

/// How long a closing gateway keeps trying to write rows the store refuses.
const LEDGER_CLOSE_GRACE: Duration = Duration::from_secs(10);

/// The ledger writer thread. It sleeps in `recv` while no row is queued (no periodic
/// wake-ups when idle); once a row arrives it lets rows gather for
/// [`LEDGER_FLUSH_INTERVAL`] (cut short by a flush, a full queue or shutdown), drains the
/// queue, commits the rows in transactions of at most [`LEDGER_BATCH`] and then answers
/// the flushes queued behind them. It exits, after a last write, once every sender is
/// gone.
///
/// A write the store refuses keeps its rows: they are tried again with a doubling pause
/// (at most [`LEDGER_RETRY_MAX`]) while new rows keep joining the queue, so the request
/// path never waits on a store that is down and no row is lost while it comes back
/// (bounded by [`LEDGER_RETRY_ROWS`]; flushes are answered once the rows are written).
fn usage_writer(store: Arc<dyn Store>, rx: std_mpsc::Receiver<WriterMsg>, dropped: Counter) {
    lower_thread_priority();
    let mut pending: VecDeque<UsageEvent> = VecDeque::with_capacity(LEDGER_BATCH);
    let mut flushes = Vec::new();
    let mut retry: Option<Duration> = None;
    let mut closing_since: Option<std::time::Instant> = None;
    let mut open = true;
    loop {
        let first = match retry {
            None if open => rx
                .recv()
                .map_err(|_| std_mpsc::RecvTimeoutError::Disconnected),
            None => Err(std_mpsc::RecvTimeoutError::Disconnected),
            // The store refused the last write: wait the whole pause (rows keep queueing
            // in the channel meanwhile) rather than retrying on every new row.
            Some(wait) => {
                std::thread::sleep(wait);
                Err(std_mpsc::RecvTimeoutError::Timeout)
            }
        };
        match first {
            Ok(WriterMsg::Usage(ev)) => {
                pending.push_back(ev);
                if retry.is_none() {
                    // While the writer sleeps here, senders queue without waking it.
                    std::thread::park_timeout(LEDGER_FLUSH_INTERVAL);
                }
            }
            Ok(WriterMsg::Flush(done)) => flushes.push(done),
            Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            Err(std_mpsc::RecvTimeoutError::Disconnected) => open = false,
        }
        if open {
            open = take_queued(&rx, &mut pending, &mut flushes);
        }
        trim_backlog(&mut pending, &dropped);
        let failed = !write_pending(store.as_ref(), &mut pending);
        retry = if failed {
            Some(retry.map_or(Duration::from_millis(50), |d| (d * 2).min(LEDGER_RETRY_MAX)))
        } else {
            None
        };
        if pending.is_empty() {
            for f in flushes.drain(..) {
                let _ = f.send(());
            }
        }
        if !open {
            if pending.is_empty() {
                break;
            }
            let since = *closing_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() >= LEDGER_CLOSE_GRACE {
                dropped.inc_by(pending.len() as u64);
                tracing::error!(
                    rows = pending.len(),
                    "closing with ledger rows the store refused"
                );
                break;
            }
        }
    }
    for f in flushes.drain(..) {
        let _ = f.send(());
    }
}

/// Takes every message already queued, without waiting: false once every sender is gone.
fn take_queued(
    rx: &std_mpsc::Receiver<WriterMsg>,
    pending: &mut VecDeque<UsageEvent>,
    flushes: &mut Vec<std_mpsc::Sender<()>>,
) -> bool {
    loop {
        match rx.try_recv() {
            Ok(WriterMsg::Usage(ev)) => pending.push_back(ev),
            Ok(WriterMsg::Flush(done)) => flushes.push(done),
            Err(std_mpsc::TryRecvError::Empty) => return true,
            Err(std_mpsc::TryRecvError::Disconnected) => return false,
        }
    }
}

/// Drops the oldest rows beyond [`LEDGER_RETRY_ROWS`] (counted and logged).
fn trim_backlog(pending: &mut VecDeque<UsageEvent>, dropped: &Counter) {
    if pending.len() > LEDGER_RETRY_ROWS {
        let over = pending.len() - LEDGER_RETRY_ROWS;
        pending.drain(..over);
        dropped.inc_by(over as u64);
        tracing::error!(
            rows = over,
            "usage ledger backlog full; oldest rows dropped"
        );
    }
}

/// Writes `pending` from the front, a transaction per batch of at most [`LEDGER_BATCH`],
/// stopping at the first refusal: false when the store refused (those rows stay queued).
fn write_pending(store: &dyn Store, pending: &mut VecDeque<UsageEvent>) -> bool {
    while !pending.is_empty() {
        let n = pending.len().min(LEDGER_BATCH);
        let batch = pending.make_contiguous();
        if let Err(e) = store.record_usage(&batch[..n]) {
            tracing::error!(error = %e, rows = pending.len(), "usage ledger write failed; will retry");
            return false;
        }
        pending.drain(..n);
    }
    true
}

/// Background work yields to the request path: the writer runs at a lower scheduling
/// priority (nice 10), so a request that becomes ready preempts a ledger commit instead of
/// queueing behind it. Best effort: a failure leaves the default priority.
#[cfg(target_os = "linux")]
fn lower_thread_priority() {
    // SAFETY: `setpriority` takes plain integers and touches no memory of ours; on Linux,
    // `who = 0` with `PRIO_PROCESS` names the calling thread only.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
    if rc != 0 {
        tracing::debug!("could not lower the usage writer's priority");
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_thread_priority() {}
