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
use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};
use prometheus_client::metrics::counter::Counter;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::auth::jwt::{JwtVerifier, TokenIdentity};
use crate::budget::{Period, Spend};
use crate::cache::{MemoryCache, RedisCache, ResponseCache};
use crate::clock::{Clock, SystemClock};
use crate::config::{Backend, ConfigHandle, RateLimits};
use crate::keys;
use crate::metrics::Metrics;
use crate::ratelimit::{LimitCheck, LimitKind, Limiter, MemoryLimiter, RedisLimiter};
use crate::redis_conn::{RedisConn, RedisError};
use crate::role::Role;
use crate::store::{
    AuditEntry, Holder, KeyRecord, Store, StoreError, TenantRecord, UsageEvent, UserRecord,
};

pub const MINUTE_US: i64 = 60_000_000;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Redis(#[from] RedisError),
    #[error("http client: {0}")]
    Client(String),
    #[error("{0}")]
    Auth(String),
}

/// A key as the request path sees it (for a JWT caller, one made per tenant and user).
#[derive(Debug)]
pub struct KeyEntry {
    pub record: KeyRecord,
    /// Live spend, lifetime and per period window.
    pub spend: Mutex<Spend>,
}

/// A tenant's stored overrides and live spend.
#[derive(Debug)]
pub struct TenantEntry {
    pub record: TenantRecord,
    pub spend: Mutex<Spend>,
}

/// A user's stored budget and live spend.
#[derive(Debug)]
pub struct UserEntry {
    pub record: UserRecord,
    pub spend: Mutex<Spend>,
}

/// The prefix of the key id a JWT caller is accounted under (`jwt:<tenant>:<user>`).
pub const JWT_KEY_PREFIX: &str = "jwt:";

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
    /// The wall clock for budget periods and ledger times (the system's when `None`).
    pub clock: Option<Arc<dyn Clock>>,
}

pub struct Gateway {
    pub config: Arc<ConfigHandle>,
    pub store: Arc<dyn Store>,
    pub keys: RwLock<HashMap<String, Arc<KeyEntry>>>,
    pub tenants: RwLock<HashMap<String, Arc<TenantEntry>>>,
    /// Users with a stored budget or spend, by (tenant, user).
    pub users: RwLock<HashMap<(String, String), Arc<UserEntry>>>,
    /// JWT callers seen, by their key id (`jwt:<tenant>:<user>`).
    jwt_callers: RwLock<HashMap<String, Arc<KeyEntry>>>,
    /// JWT verification, when `auth.jwt` is configured (read at start).
    pub jwt: Option<JwtVerifier>,
    pub clock: Arc<dyn Clock>,
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

/// Unix seconds by the system clock (the gateway's own is [`Gateway::now`]).
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
        let client = crate::upstream::UpstreamClient::new(crate::upstream::CONNECT_TIMEOUT, None)
            .map_err(|e| StateError::Client(e.to_string()))?;
        let (tx, rx) = std_mpsc::sync_channel(LEDGER_QUEUE);
        let writer_store = store.clone();
        let metrics = Metrics::new();
        let dropped = metrics.ledger_dropped.clone();
        let handle = std::thread::Builder::new()
            .name("gateway-usage-writer".into())
            .spawn(move || usage_writer(writer_store, rx, dropped))
            .map_err(|e| StateError::Client(format!("cannot start usage writer: {e}")))?;
        let jwt = match &c.auth.jwt {
            Some(j) => Some(
                JwtVerifier::new(j, config.path().and_then(std::path::Path::parent))
                    .map_err(StateError::Auth)?,
            ),
            None => None,
        };
        let rng = match opts.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let gw = Arc::new(Gateway {
            config,
            store,
            keys: RwLock::new(HashMap::new()),
            tenants: RwLock::new(HashMap::new()),
            users: RwLock::new(HashMap::new()),
            jwt_callers: RwLock::new(HashMap::new()),
            jwt,
            clock: opts.clock.unwrap_or_else(|| Arc::new(SystemClock)),
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

    /// Unix seconds by the gateway's clock.
    pub fn now(&self) -> i64 {
        self.clock.now()
    }

    /// Re-reads keys, tenants, users and their period spend from the store into memory.
    /// Live spend never goes down: each figure takes the larger of memory and the store
    /// (rows may still be queued for the store), each window the newer.
    pub fn refresh_from_store(&self) -> Result<(), StoreError> {
        let keys = self.store.list_keys()?;
        let tenants = self.store.list_tenants()?;
        let users = self.store.list_users()?;
        let mut windows: HashMap<(Holder, String, String), Vec<(Period, crate::budget::Window)>> =
            HashMap::new();
        for w in self.store.list_period_spend()? {
            windows
                .entry((w.holder, w.tenant, w.name))
                .or_default()
                .push((w.period, w.window));
        }
        let spend_of = |live: Option<Spend>, stored_lifetime: i64, key: (Holder, &str, &str)| {
            let mut s = live.unwrap_or_default();
            s.lifetime = s.lifetime.max(stored_lifetime);
            let k = (key.0, key.1.to_string(), key.2.to_string());
            for (p, w) in windows.get(&k).into_iter().flatten() {
                s.merge_window(*p, *w);
            }
            Mutex::new(s)
        };
        let key_map: HashMap<String, Arc<KeyEntry>> = {
            let old = self.keys.read();
            keys.into_iter()
                .map(|k| {
                    let live = old.get(&k.id).map(|e| *e.spend.lock());
                    let spend = spend_of(live, k.spend_micros, (Holder::Key, &k.tenant, &k.id));
                    (k.id.clone(), Arc::new(KeyEntry { record: k, spend }))
                })
                .collect()
        };
        *self.keys.write() = key_map;
        let tenant_map: HashMap<String, Arc<TenantEntry>> = {
            let old = self.tenants.read();
            tenants
                .into_iter()
                .map(|t| {
                    let live = old.get(&t.name).map(|e| *e.spend.lock());
                    let spend = spend_of(live, t.spend_micros, (Holder::Tenant, &t.name, ""));
                    (t.name.clone(), Arc::new(TenantEntry { record: t, spend }))
                })
                .collect()
        };
        // A tenant or user seen only in ledger rows still queued is not in the store yet:
        // keep its live spend.
        let mut tenant_map = tenant_map;
        for (name, e) in self.tenants.read().iter() {
            tenant_map.entry(name.clone()).or_insert_with(|| e.clone());
        }
        *self.tenants.write() = tenant_map;
        let user_map: HashMap<(String, String), Arc<UserEntry>> = {
            let old = self.users.read();
            users
                .into_iter()
                .map(|u| {
                    let id = (u.tenant.clone(), u.name.clone());
                    let live = old.get(&id).map(|e| *e.spend.lock());
                    let spend = spend_of(live, u.spend_micros, (Holder::User, &u.tenant, &u.name));
                    (id, Arc::new(UserEntry { record: u, spend }))
                })
                .collect()
        };
        let mut user_map = user_map;
        for (id, e) in self.users.read().iter() {
            user_map.entry(id.clone()).or_insert_with(|| e.clone());
        }
        *self.users.write() = user_map;
        Ok(())
    }

    /// The accounting entry of a JWT caller: one per tenant and user, made on first sight
    /// (default key limits, no key budget; the user's and tenant's budgets apply).
    pub fn jwt_caller(&self, who: &TokenIdentity) -> Arc<KeyEntry> {
        let id = format!("{JWT_KEY_PREFIX}{}:{}", who.tenant, who.user);
        if let Some(e) = self.jwt_callers.read().get(&id) {
            return e.clone();
        }
        let entry = Arc::new(KeyEntry {
            record: KeyRecord {
                id: id.clone(),
                tenant: who.tenant.clone(),
                name: format!("jwt {}", who.subject),
                salt_hex: String::new(),
                hash_hex: String::new(),
                allowed_models: Vec::new(),
                limits: RateLimits::default(),
                budget_micros: None,
                budget_period: None,
                spend_micros: 0,
                created_at: self.now(),
                revoked_at: None,
                user: Some(who.user.clone()),
                role: Role::Member,
            },
            spend: Mutex::new(Spend::default()),
        });
        self.jwt_callers.write().entry(id).or_insert(entry).clone()
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

    /// Creates a key as the system (at start, `strata up`); see [`Gateway::create_key_as`].
    pub fn create_key(&self, req: CreateKey) -> Result<(String, KeyRecord), StoreError> {
        self.create_key_as(req, "system")
    }

    /// Creates a key and returns the full key text (shown once) with its record; the audit
    /// entry names `actor`.
    pub fn create_key_as(
        &self,
        req: CreateKey,
        actor: &str,
    ) -> Result<(String, KeyRecord), StoreError> {
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
            budget_period: req.budget_period,
            spend_micros: 0,
            created_at: self.now(),
            revoked_at: None,
            user: req.user,
            role: req.role.unwrap_or_default(),
        };
        self.store.insert_key(&record)?;
        self.audit(
            actor,
            "create_key",
            &record.id,
            &serde_json::to_string(&record).unwrap_or_default(),
        );
        self.refresh_from_store()?;
        Ok((new.full, record))
    }

    /// Revokes a key; effective for the next request.
    pub fn revoke_key(&self, id: &str, actor: &str) -> Result<bool, StoreError> {
        let done = self.store.revoke_key(id, self.now())?;
        if done {
            self.audit(actor, "revoke_key", id, "");
            self.refresh_from_store()?;
        }
        Ok(done)
    }

    /// Appends to the audit log, naming the actor (`admin-key`, `key:<id> (role)`,
    /// `jwt:<subject> (role)`, `system`); a failure is logged, not returned.
    pub fn audit(&self, actor: &str, action: &str, target: &str, detail: &str) {
        let entry = AuditEntry {
            ts: self.now(),
            actor: actor.into(),
            action: action.into(),
            target: target.into(),
            detail: detail.into(),
        };
        if let Err(e) = self.store.audit(&entry) {
            tracing::error!(error = %e, action, "audit write failed");
        }
    }

    /// Queues a ledger row and updates live spend (key, tenant and user).
    pub fn record_usage(&self, ev: UsageEvent) {
        if ev.cost_micros != 0 {
            self.add_spend(&ev);
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

    fn add_spend(&self, ev: &UsageEvent) {
        let key = self.keys.read().get(&ev.key_id).cloned();
        let key = key.or_else(|| self.jwt_callers.read().get(&ev.key_id).cloned());
        if let Some(k) = key {
            k.spend.lock().add(ev.ts, ev.cost_micros);
        }
        let tenant = self.tenants.read().get(&ev.tenant).cloned();
        let tenant = tenant.unwrap_or_else(|| {
            let entry = Arc::new(TenantEntry {
                record: TenantRecord {
                    name: ev.tenant.clone(),
                    limits: RateLimits::default(),
                    budget_micros: None,
                    budget_period: None,
                    spend_micros: 0,
                },
                spend: Mutex::new(Spend::default()),
            });
            self.tenants
                .write()
                .entry(ev.tenant.clone())
                .or_insert(entry)
                .clone()
        });
        tenant.spend.lock().add(ev.ts, ev.cost_micros);
        if !ev.user.is_empty() {
            let id = (ev.tenant.clone(), ev.user.clone());
            let user = self.users.read().get(&id).cloned();
            let user = user.unwrap_or_else(|| {
                let entry = Arc::new(UserEntry {
                    record: UserRecord {
                        tenant: ev.tenant.clone(),
                        name: ev.user.clone(),
                        budget_micros: None,
                        budget_period: None,
                        spend_micros: 0,
                    },
                    spend: Mutex::new(Spend::default()),
                });
                self.users.write().entry(id).or_insert(entry).clone()
            });
            user.spend.lock().add(ev.ts, ev.cost_micros);
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
    /// How often the key's budget resets (absent: a lifetime cap).
    #[serde(default)]
    pub budget_period: Option<Period>,
    /// The user the key belongs to (whose user budget it also spends).
    #[serde(default)]
    pub user: Option<String>,
    /// `member` (the default) or `tenant_admin`.
    #[serde(default)]
    pub role: Option<Role>,
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
