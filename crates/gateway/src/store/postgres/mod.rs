//! The shared store: PostgreSQL, so that several gateway replicas keep one set of keys,
//! tenants, budgets, one usage ledger and one audit log.
//!
//! The [`Store`] trait is synchronous (the usage writer is a plain thread; admin calls use
//! `spawn_blocking`), and the client is async (`tokio-postgres`). The store therefore owns
//! a small tokio runtime on a thread of its own and runs each call there, waiting for the
//! answer at most `timeout`: a call never starts or drops a runtime inside the caller's,
//! so it is safe from any thread.
//!
//! Connections: a few, each behind a lock, opened on first use and opened again after
//! the server went away (a restart costs the calls made while it is down, not the store).
//!
//! Back-off: after a call finds the server unavailable (no answer within `timeout`, or no
//! connection), calls fail at once for [`RETRY_AFTER`], as the Redis connection does. A
//! stalled server thus costs one call per back-off period the full timeout, and every
//! other call one fast error that its failure mode then decides, instead of adding the
//! timeout to every request.
//!
//! Invariants:
//! * A ledger row is written at most once per [`UsageEvent::id`] (`ON CONFLICT DO
//!   NOTHING`), and only rows actually inserted add to spend, so a batch retried after a
//!   commit whose answer was lost changes nothing twice.
//! * Budget holds and spend change under the tenant's (then the key's) row lock, in that
//!   order everywhere, so two gateways see each other's holds and never deadlock on them.
//!   At any moment every admitted request counts once: as its hold until its ledger row
//!   commits, then as its real cost.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex as AsyncMutex;
use tokio_postgres::{Client, NoTls};

use super::{period_increments, Holder, PeriodSpend, UserRecord};
use super::{
    AuditEntry, BudgetHold, HoldOutcome, KeyRecord, Store, StoreError, StoredResponse,
    TenantRecord, UsageEvent, UsageFilter, UsageRow,
};
use crate::budget::{Period, Window};
use crate::config::RateLimits;
use crate::role::Role;

/// Schema steps, applied in order under an advisory lock (replicas starting together
/// migrate once); entry `i` moves the database to version `i + 1`. Append, never edit.
pub const MIGRATIONS: &[&str] = &[
    // 1: keys, tenants, usage ledger, audit log, budget holds.
    "CREATE TABLE tenants (
        name TEXT PRIMARY KEY,
        rpm BIGINT, tpm BIGINT,
        budget_micros BIGINT,
        spend_micros BIGINT NOT NULL DEFAULT 0
    );
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        salt TEXT NOT NULL,
        hash TEXT NOT NULL,
        allowed_models TEXT NOT NULL DEFAULT '[]',
        rpm BIGINT, tpm BIGINT,
        budget_micros BIGINT,
        spend_micros BIGINT NOT NULL DEFAULT 0,
        created_at BIGINT NOT NULL,
        revoked_at BIGINT
    );
    CREATE INDEX api_keys_tenant ON api_keys(tenant);
    CREATE TABLE usage (
        id BIGSERIAL PRIMARY KEY,
        event_id TEXT UNIQUE,
        ts BIGINT NOT NULL,
        key_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        model TEXT NOT NULL,
        upstream TEXT NOT NULL,
        input_tokens BIGINT NOT NULL,
        output_tokens BIGINT NOT NULL,
        cost_micros BIGINT NOT NULL,
        cached BOOLEAN NOT NULL,
        status INTEGER NOT NULL
    );
    CREATE INDEX usage_ts ON usage(ts);
    CREATE INDEX usage_tenant ON usage(tenant, ts);
    CREATE TABLE audit (
        id BIGSERIAL PRIMARY KEY,
        ts BIGINT NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        detail TEXT NOT NULL
    );
    CREATE TABLE budget_holds (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        key_id TEXT NOT NULL,
        amount_micros BIGINT NOT NULL,
        expires_at BIGINT NOT NULL
    );
    CREATE INDEX budget_holds_tenant ON budget_holds(tenant);
    CREATE INDEX budget_holds_key ON budget_holds(key_id);
    CREATE INDEX budget_holds_expiry ON budget_holds(expires_at);",
    // 2: users, budget periods and roles (issue 29). Additive: every old row reads as
    // before (no user, member, lifetime budget).
    "ALTER TABLE api_keys ADD COLUMN user_name TEXT;
    ALTER TABLE api_keys ADD COLUMN role TEXT NOT NULL DEFAULT 'member';
    ALTER TABLE api_keys ADD COLUMN budget_period TEXT;
    ALTER TABLE tenants ADD COLUMN budget_period TEXT;
    ALTER TABLE usage ADD COLUMN user_name TEXT NOT NULL DEFAULT '';
    ALTER TABLE budget_holds ADD COLUMN user_name TEXT NOT NULL DEFAULT '';
    CREATE TABLE users (
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        budget_micros BIGINT,
        budget_period TEXT,
        spend_micros BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (tenant, name)
    );
    CREATE TABLE period_spend (
        holder TEXT NOT NULL,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        period TEXT NOT NULL,
        start BIGINT NOT NULL,
        micros BIGINT NOT NULL,
        PRIMARY KEY (holder, tenant, name, period)
    );",
    // 3: Responses API responses kept for `GET /v1/responses/{id}` and
    // `previous_response_id`, per tenant, until they expire (issue 27).
    "CREATE TABLE responses (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        body TEXT NOT NULL,
        conversation TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    CREATE INDEX responses_expiry ON responses (tenant, expires_at);",
];

/// Any number; the advisory lock that serializes migrations across replicas.
const MIGRATION_LOCK: i64 = 0x5354_5241_5441_4757;

/// Connections per store: the usage writer, admin calls and budget holds rarely need
/// more at once.
const CONNECTIONS: usize = 4;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How long calls fail at once after one found the server unavailable.
pub const RETRY_AFTER: Duration = Duration::from_millis(500);

/// Settings of a [`PgStore`].
#[derive(Debug, Clone)]
pub struct PgOptions {
    /// `postgres://user:pass@host:port/db` (or the key=value form).
    pub url: String,
    /// Longest wait for one call (connecting included) before it fails as unavailable.
    pub timeout: Duration,
}

pub struct PgStore {
    inner: Arc<Inner>,
    handle: tokio::runtime::Handle,
    timeout: Duration,
    /// Until when calls fail at once (the server was unavailable).
    down_until: parking_lot::Mutex<Option<Instant>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Inner {
    url: String,
    slots: Vec<Arc<AsyncMutex<Option<Client>>>>,
    next: AtomicUsize,
}

impl PgStore {
    /// Starts the store's runtime, connects and migrates the schema.
    pub fn connect(opts: PgOptions) -> Result<PgStore, StoreError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("gateway-pg")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Unavailable(format!("cannot start a runtime: {e}")))?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // The runtime lives and is dropped on this thread, never inside a caller's.
        let thread = std::thread::Builder::new()
            .name("gateway-pg-runtime".into())
            .spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(|e| StoreError::Unavailable(format!("cannot start a thread: {e}")))?;
        let store = PgStore {
            inner: Arc::new(Inner {
                url: opts.url,
                slots: (0..CONNECTIONS)
                    .map(|_| Arc::new(AsyncMutex::new(None)))
                    .collect(),
                next: AtomicUsize::new(0),
            }),
            handle,
            timeout: opts.timeout,
            down_until: parking_lot::Mutex::new(None),
            stop: Some(stop),
            thread: Some(thread),
        };
        store.call(|inner| Box::pin(async move { inner.migrate().await }))?;
        Ok(store)
    }

    /// The schema version after migration.
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        self.call(|inner| {
            Box::pin(async move {
                let mut conn = inner.conn().await?;
                let c = conn.client()?;
                let row = c
                    .query_one(
                        "SELECT COALESCE(MAX(version), 0)::int8 FROM strata_schema",
                        &[],
                    )
                    .await;
                conn.check(row).map(|r| r.get::<_, i64>(0))
            })
        })
    }

    /// Runs `op` on the store's runtime and waits for it, at most `timeout`; fails at
    /// once while backing off after the server was unavailable.
    fn call<T: Send + 'static>(
        &self,
        op: impl FnOnce(Arc<Inner>) -> BoxFuture<'static, Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if self
            .down_until
            .lock()
            .is_some_and(|until| Instant::now() < until)
        {
            return Err(StoreError::Unavailable(
                "recently unavailable; backing off".into(),
            ));
        }
        let res = self.call_now(op);
        // Only an unreachable or silent server backs off; a query error (a constraint,
        // a corrupt row) says the server is there.
        if matches!(res, Err(StoreError::Unavailable(_))) {
            *self.down_until.lock() = Some(Instant::now() + RETRY_AFTER);
        }
        res
    }

    fn call_now<T: Send + 'static>(
        &self,
        op: impl FnOnce(Arc<Inner>) -> BoxFuture<'static, Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let fut = op(self.inner.clone());
        let timeout = self.timeout;
        self.handle.spawn(async move {
            let res = match tokio::time::timeout(timeout, fut).await {
                Ok(r) => r,
                Err(_) => Err(StoreError::Unavailable(format!(
                    "no answer within {} ms",
                    timeout.as_millis()
                ))),
            };
            let _ = tx.send(res);
        });
        rx.recv()
            .map_err(|_| StoreError::Unavailable("the store's runtime stopped".into()))?
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One connection slot, locked for the duration of a call.
struct Conn {
    slot: tokio::sync::OwnedMutexGuard<Option<Client>>,
}

impl Conn {
    fn client(&mut self) -> Result<&mut Client, StoreError> {
        self.slot
            .as_mut()
            .ok_or_else(|| StoreError::Unavailable("not connected".into()))
    }

    /// Passes a result through; after an error on a connection the server closed, the
    /// slot is emptied so the next call connects again.
    fn check<T>(&mut self, res: Result<T, tokio_postgres::Error>) -> Result<T, StoreError> {
        if res.is_err() && self.slot.as_ref().is_some_and(Client::is_closed) {
            *self.slot = None;
        }
        res.map_err(StoreError::from)
    }
}

impl Inner {
    /// A free connection (or the next one in turn when all are busy), connected.
    async fn conn(&self) -> Result<Conn, StoreError> {
        let mut guard = None;
        for s in &self.slots {
            if let Ok(g) = s.clone().try_lock_owned() {
                guard = Some(g);
                break;
            }
        }
        let mut slot = match guard {
            Some(g) => g,
            None => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
                self.slots[i].clone().lock_owned().await
            }
        };
        if slot.as_ref().is_none_or(Client::is_closed) {
            let (client, connection) = tokio_postgres::connect(&self.url, NoTls)
                .await
                .map_err(|e| StoreError::Unavailable(format!("cannot connect: {e}")))?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "postgres connection ended");
                }
            });
            *slot = Some(client);
        }
        Ok(Conn { slot })
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        let res = async {
            let c = conn.client()?;
            let tx = c.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
                .await?;
            tx.batch_execute("CREATE TABLE IF NOT EXISTS strata_schema (version BIGINT NOT NULL)")
                .await?;
            let version: i64 = tx
                .query_one(
                    "SELECT COALESCE(MAX(version), 0)::int8 FROM strata_schema",
                    &[],
                )
                .await?
                .get(0);
            let known = MIGRATIONS.len() as i64;
            if version > known {
                return Err(StoreError::TooNew {
                    found: version,
                    known,
                });
            }
            for (i, step) in MIGRATIONS.iter().enumerate().skip(version as usize) {
                tx.batch_execute(step).await?;
                tx.execute(
                    "INSERT INTO strata_schema (version) VALUES ($1)",
                    &[&((i + 1) as i64)],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(())
        }
        .await;
        if res.is_err() && conn.slot.as_ref().is_some_and(Client::is_closed) {
            *conn.slot = None;
        }
        res
    }
}

fn opt_u64(v: Option<i64>) -> Option<u64> {
    v.and_then(|x| u64::try_from(x).ok())
}

fn opt_i64(v: Option<u64>) -> Option<i64> {
    v.map(|x| i64::try_from(x).unwrap_or(i64::MAX))
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

const KEY_COLUMNS: &str = "id, tenant, name, salt, hash, allowed_models, rpm, tpm, budget_micros, \
                           spend_micros, created_at, revoked_at, user_name, role, budget_period";

/// A stored period name; an unknown one (a newer build's) reads as a lifetime budget.
fn period(v: Option<String>) -> Option<Period> {
    v.as_deref().and_then(Period::parse)
}

fn period_text(p: Option<Period>) -> Option<&'static str> {
    p.map(Period::as_str)
}

fn key_from_row(row: &tokio_postgres::Row) -> Result<KeyRecord, StoreError> {
    let id: String = row.try_get(0)?;
    let models: String = row.try_get(5)?;
    let allowed_models = serde_json::from_str(&models)
        .map_err(|e| StoreError::Corrupt(format!("allowed_models of key {id}: {e}")))?;
    Ok(KeyRecord {
        id,
        tenant: row.try_get(1)?,
        name: row.try_get(2)?,
        salt_hex: row.try_get(3)?,
        hash_hex: row.try_get(4)?,
        allowed_models,
        limits: RateLimits {
            rpm: opt_u64(row.try_get(6)?),
            tpm: opt_u64(row.try_get(7)?),
        },
        budget_micros: row.try_get(8)?,
        budget_period: period(row.try_get(14)?),
        spend_micros: row.try_get(9)?,
        created_at: row.try_get(10)?,
        revoked_at: row.try_get(11)?,
        user: row.try_get(12)?,
        role: Role::parse(row.try_get::<_, &str>(13)?).unwrap_or_default(),
    })
}

/// A holder's spend in the window of `period` holding `now` (0 when none is stored).
async fn window_spend(
    tx: &tokio_postgres::Transaction<'_>,
    holder: Holder,
    tenant: &str,
    name: &str,
    period: Period,
    now: i64,
) -> Result<i64, StoreError> {
    let row = tx
        .query_opt(
            "SELECT micros FROM period_spend WHERE holder = $1 AND tenant = $2 AND name = $3 \
             AND period = $4 AND start = $5",
            &[
                &holder.as_str(),
                &tenant,
                &name,
                &period.as_str(),
                &period.start(now),
            ],
        )
        .await?;
    Ok(row.map(|r| r.try_get(0)).transpose()?.unwrap_or(0))
}

/// The spend that counts against the hold's user budget (its window's, or the user's
/// lifetime spend), with the user's row locked after the tenant's and the key's, as the
/// ledger writes lock them; 0 without a user budget.
async fn user_spend_locked(
    tx: &tokio_postgres::Transaction<'_>,
    h: &BudgetHold,
) -> Result<i64, StoreError> {
    if h.user.is_empty() || h.user_budget_micros.is_none() {
        return Ok(0);
    }
    tx.execute(
        "INSERT INTO users (tenant, name) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        &[&h.tenant, &h.user],
    )
    .await?;
    let lifetime: i64 = tx
        .query_one(
            "SELECT spend_micros FROM users WHERE tenant = $1 AND name = $2 FOR UPDATE",
            &[&h.tenant, &h.user],
        )
        .await?
        .try_get(0)?;
    match h.user_period {
        Some(p) => window_spend(tx, Holder::User, &h.tenant, &h.user, p, h.now).await,
        None => Ok(lifetime),
    }
}

/// Runs one query body against a connection, emptying the slot when the server went
/// away (see [`Conn::check`]).
macro_rules! with_conn {
    ($inner:expr, |$c:ident| $body:expr) => {{
        let mut conn = $inner.conn().await?;
        let res: Result<_, StoreError> = async {
            let $c = conn.client()?;
            $body
        }
        .await;
        if res.is_err() && conn.slot.as_ref().is_some_and(Client::is_closed) {
            *conn.slot = None;
        }
        res
    }};
}

impl Store for PgStore {
    fn insert_key(&self, k: &KeyRecord) -> Result<(), StoreError> {
        let models = serde_json::to_string(&k.allowed_models)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let k = k.clone();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let tx = c.transaction().await?;
                    tx.execute(
                        &format!(
                            "INSERT INTO api_keys ({KEY_COLUMNS}) \
                             VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15)"
                        ),
                        &[
                            &k.id,
                            &k.tenant,
                            &k.name,
                            &k.salt_hex,
                            &k.hash_hex,
                            &models,
                            &opt_i64(k.limits.rpm),
                            &opt_i64(k.limits.tpm),
                            &k.budget_micros,
                            &k.spend_micros,
                            &k.created_at,
                            &k.revoked_at,
                            &k.user,
                            &k.role.as_str(),
                            &period_text(k.budget_period),
                        ],
                    )
                    .await?;
                    tx.execute(
                        "INSERT INTO tenants (name) VALUES ($1) ON CONFLICT DO NOTHING",
                        &[&k.tenant],
                    )
                    .await?;
                    tx.commit().await?;
                    Ok(())
                })
            })
        })
    }

    fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        self.call(|inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let rows = c
                        .query(
                            &format!("SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at, id"),
                            &[],
                        )
                        .await?;
                    rows.iter().map(key_from_row).collect()
                })
            })
        })
    }

    fn get_key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
        let id = id.to_string();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let row = c
                        .query_opt(
                            &format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1"),
                            &[&id],
                        )
                        .await?;
                    row.as_ref().map(key_from_row).transpose()
                })
            })
        })
    }

    fn revoke_key(&self, id: &str, now: i64) -> Result<bool, StoreError> {
        let id = id.to_string();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let n = c
                        .execute(
                            "UPDATE api_keys SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL",
                            &[&id, &now],
                        )
                        .await?;
                    Ok(n > 0)
                })
            })
        })
    }

    fn update_key(
        &self,
        id: &str,
        limits: RateLimits,
        (budget_micros, budget_period): (Option<i64>, Option<Period>),
        allowed_models: &[String],
    ) -> Result<bool, StoreError> {
        let models = serde_json::to_string(allowed_models)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let id = id.to_string();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let n = c
                        .execute(
                            "UPDATE api_keys SET rpm = $2, tpm = $3, budget_micros = $4, \
                             allowed_models = $5, budget_period = $6 WHERE id = $1",
                            &[
                                &id,
                                &opt_i64(limits.rpm),
                                &opt_i64(limits.tpm),
                                &budget_micros,
                                &models,
                                &period_text(budget_period),
                            ],
                        )
                        .await?;
                    Ok(n > 0)
                })
            })
        })
    }

    fn upsert_tenant(
        &self,
        name: &str,
        limits: RateLimits,
        (budget_micros, budget_period): (Option<i64>, Option<Period>),
    ) -> Result<(), StoreError> {
        let name = name.to_string();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    c.execute(
                        "INSERT INTO tenants (name, rpm, tpm, budget_micros, budget_period) \
                         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO UPDATE SET \
                         rpm = $2, tpm = $3, budget_micros = $4, budget_period = $5",
                        &[
                            &name,
                            &opt_i64(limits.rpm),
                            &opt_i64(limits.tpm),
                            &budget_micros,
                            &period_text(budget_period),
                        ],
                    )
                    .await?;
                    Ok(())
                })
            })
        })
    }

    fn upsert_user(
        &self,
        tenant: &str,
        name: &str,
        (budget_micros, budget_period): (Option<i64>, Option<Period>),
    ) -> Result<(), StoreError> {
        let (tenant, name) = (tenant.to_string(), name.to_string());
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    c.execute(
                        "INSERT INTO users (tenant, name, budget_micros, budget_period) \
                         VALUES ($1, $2, $3, $4) ON CONFLICT (tenant, name) DO UPDATE SET \
                         budget_micros = $3, budget_period = $4",
                        &[&tenant, &name, &budget_micros, &period_text(budget_period)],
                    )
                    .await?;
                    Ok(())
                })
            })
        })
    }

    fn list_users(&self) -> Result<Vec<UserRecord>, StoreError> {
        self.call(|inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let rows = c
                        .query(
                            "SELECT tenant, name, budget_micros, budget_period, spend_micros \
                             FROM users ORDER BY tenant, name",
                            &[],
                        )
                        .await?;
                    rows.iter()
                        .map(|r| {
                            Ok(UserRecord {
                                tenant: r.try_get(0)?,
                                name: r.try_get(1)?,
                                budget_micros: r.try_get(2)?,
                                budget_period: period(r.try_get(3)?),
                                spend_micros: r.try_get(4)?,
                            })
                        })
                        .collect()
                })
            })
        })
    }

    fn list_period_spend(&self) -> Result<Vec<PeriodSpend>, StoreError> {
        self.call(|inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let rows = c
                        .query(
                            "SELECT holder, tenant, name, period, start, micros FROM period_spend",
                            &[],
                        )
                        .await?;
                    let mut out = Vec::new();
                    for r in &rows {
                        let holder = Holder::parse(r.try_get::<_, &str>(0)?);
                        let p = Period::parse(r.try_get::<_, &str>(3)?);
                        if let (Some(holder), Some(period)) = (holder, p) {
                            out.push(PeriodSpend {
                                holder,
                                tenant: r.try_get(1)?,
                                name: r.try_get(2)?,
                                period,
                                window: Window {
                                    start: r.try_get(4)?,
                                    micros: r.try_get(5)?,
                                },
                            });
                        }
                    }
                    Ok(out)
                })
            })
        })
    }

    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        self.call(|inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let rows = c
                        .query(
                            "SELECT name, rpm, tpm, budget_micros, spend_micros, budget_period \
                             FROM tenants ORDER BY name",
                            &[],
                        )
                        .await?;
                    rows.iter()
                        .map(|r| {
                            Ok(TenantRecord {
                                name: r.try_get(0)?,
                                limits: RateLimits {
                                    rpm: opt_u64(r.try_get(1)?),
                                    tpm: opt_u64(r.try_get(2)?),
                                },
                                budget_micros: r.try_get(3)?,
                                budget_period: period(r.try_get(5)?),
                                spend_micros: r.try_get(4)?,
                            })
                        })
                        .collect()
                })
            })
        })
    }

    fn record_usage(&self, events: &[UsageEvent]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let events = events.to_vec();
        self.call(move |inner| {
            Box::pin(async move {
                let ids: Vec<Option<&str>> = events
                    .iter()
                    .map(|e| (!e.id.is_empty()).then_some(e.id.as_str()))
                    .collect();
                let ts: Vec<i64> = events.iter().map(|e| e.ts).collect();
                let key_ids: Vec<&str> = events.iter().map(|e| e.key_id.as_str()).collect();
                let tenants: Vec<&str> = events.iter().map(|e| e.tenant.as_str()).collect();
                let models: Vec<&str> = events.iter().map(|e| e.model.as_str()).collect();
                let upstreams: Vec<&str> = events.iter().map(|e| e.upstream.as_str()).collect();
                let input: Vec<i64> = events.iter().map(|e| to_i64(e.input_tokens)).collect();
                let output: Vec<i64> = events.iter().map(|e| to_i64(e.output_tokens)).collect();
                let cost: Vec<i64> = events.iter().map(|e| e.cost_micros).collect();
                let cached: Vec<bool> = events.iter().map(|e| e.cached).collect();
                let status: Vec<i32> = events.iter().map(|e| i32::from(e.status)).collect();
                let users: Vec<&str> = events.iter().map(|e| e.user.as_str()).collect();
                let hold_ids: Vec<&str> = ids.iter().flatten().copied().collect();
                with_conn!(inner, |c| {
                    let tx = c.transaction().await?;
                    // One statement for the whole batch; only rows not seen before come
                    // back, and only they add to spend.
                    let inserted = tx
                        .query(
                            "INSERT INTO usage (event_id, ts, key_id, tenant, model, upstream, \
                             input_tokens, output_tokens, cost_micros, cached, status, user_name) \
                             SELECT * FROM unnest($1::text[], $2::int8[], $3::text[], $4::text[], \
                             $5::text[], $6::text[], $7::int8[], $8::int8[], $9::int8[], \
                             $10::bool[], $11::int4[], $12::text[]) \
                             ON CONFLICT (event_id) DO NOTHING \
                             RETURNING key_id, tenant, cost_micros, ts, user_name",
                            &[
                                &ids, &ts, &key_ids, &tenants, &models, &upstreams, &input,
                                &output, &cost, &cached, &status, &users,
                            ],
                        )
                        .await?;
                    // Sorted maps: rows are locked tenants first, then keys, in name
                    // order, as the budget holds lock them.
                    let mut key_spend: BTreeMap<String, i64> = BTreeMap::new();
                    let mut tenant_spend: BTreeMap<String, i64> = BTreeMap::new();
                    let mut user_spend: BTreeMap<(String, String), i64> = BTreeMap::new();
                    // The rows written (not seen before), for the period windows.
                    let mut written = Vec::with_capacity(inserted.len());
                    for r in &inserted {
                        let c: i64 = r.try_get(2)?;
                        if c != 0 {
                            let (key_id, tenant, user): (String, String, String) =
                                (r.try_get(0)?, r.try_get(1)?, r.try_get(4)?);
                            *key_spend.entry(key_id.clone()).or_default() += c;
                            *tenant_spend.entry(tenant.clone()).or_default() += c;
                            if !user.is_empty() {
                                *user_spend
                                    .entry((tenant.clone(), user.clone()))
                                    .or_default() += c;
                            }
                            written.push(UsageEvent {
                                id: String::new(),
                                ts: r.try_get(3)?,
                                key_id,
                                tenant,
                                user,
                                model: String::new(),
                                upstream: String::new(),
                                input_tokens: 0,
                                output_tokens: 0,
                                cost_micros: c,
                                cached: false,
                                status: 0,
                            });
                        }
                    }
                    for (name, c) in &tenant_spend {
                        tx.execute(
                            "INSERT INTO tenants (name, spend_micros) VALUES ($1, $2) \
                             ON CONFLICT (name) DO UPDATE SET spend_micros = tenants.spend_micros + $2",
                            &[name, c],
                        )
                        .await?;
                    }
                    for (id, c) in &key_spend {
                        tx.execute(
                            "UPDATE api_keys SET spend_micros = spend_micros + $2 WHERE id = $1",
                            &[id, c],
                        )
                        .await?;
                    }
                    for ((tenant, name), c) in &user_spend {
                        tx.execute(
                            "INSERT INTO users (tenant, name, spend_micros) VALUES ($1, $2, $3) \
                             ON CONFLICT (tenant, name) DO UPDATE SET \
                             spend_micros = users.spend_micros + $3",
                            &[tenant, name, c],
                        )
                        .await?;
                    }
                    for w in period_increments(&written) {
                        tx.execute(
                            "INSERT INTO period_spend (holder, tenant, name, period, start, micros) \
                             VALUES ($1, $2, $3, $4, $5, $6) \
                             ON CONFLICT (holder, tenant, name, period) DO UPDATE SET \
                             micros = CASE WHEN excluded.start = period_spend.start \
                                             THEN period_spend.micros + excluded.micros \
                                           WHEN excluded.start > period_spend.start \
                                             THEN excluded.micros \
                                           ELSE period_spend.micros END, \
                             start = GREATEST(period_spend.start, excluded.start)",
                            &[
                                &w.holder.as_str(),
                                &w.tenant,
                                &w.name,
                                &w.period.as_str(),
                                &w.window.start,
                                &w.window.micros,
                            ],
                        )
                        .await?;
                    }
                    if !hold_ids.is_empty() {
                        tx.execute(
                            "DELETE FROM budget_holds WHERE id = ANY($1)",
                            &[&hold_ids],
                        )
                        .await?;
                    }
                    let now = events.iter().map(|e| e.ts).max().unwrap_or(0);
                    tx.execute("DELETE FROM budget_holds WHERE expires_at <= $1", &[&now])
                        .await?;
                    tx.commit().await?;
                    Ok(())
                })
            })
        })
    }

    fn usage(&self, f: &UsageFilter) -> Result<Vec<UsageRow>, StoreError> {
        let f = f.clone();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let rows = c
                        .query(
                            "SELECT tenant, key_id, model, COUNT(*)::int8, \
                             COALESCE(SUM(input_tokens), 0)::int8, \
                             COALESCE(SUM(output_tokens), 0)::int8, \
                             COALESCE(SUM(cost_micros), 0)::int8, user_name FROM usage \
                             WHERE ($1::text IS NULL OR tenant = $1) \
                               AND ($2::text IS NULL OR key_id = $2) \
                               AND ($3::int8 IS NULL OR ts >= $3) \
                               AND ($4::text IS NULL OR user_name = $4) \
                             GROUP BY tenant, key_id, user_name, model \
                             ORDER BY tenant, key_id, user_name, model",
                            &[&f.tenant, &f.key_id, &f.since, &f.user],
                        )
                        .await?;
                    rows.iter()
                        .map(|r| {
                            let cost: i64 = r.try_get(6)?;
                            Ok(UsageRow {
                                tenant: r.try_get(0)?,
                                key_id: r.try_get(1)?,
                                user: r.try_get(7)?,
                                model: r.try_get(2)?,
                                requests: opt_u64(r.try_get(3)?).unwrap_or(0),
                                input_tokens: opt_u64(r.try_get(4)?).unwrap_or(0),
                                output_tokens: opt_u64(r.try_get(5)?).unwrap_or(0),
                                cost_micros: cost,
                                cost_usd: cost as f64 / 1e6,
                            })
                        })
                        .collect()
                })
            })
        })
    }

    fn audit(&self, e: &AuditEntry) -> Result<(), StoreError> {
        let e = e.clone();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    c.execute(
                        "INSERT INTO audit (ts, actor, action, target, detail) \
                         VALUES ($1, $2, $3, $4, $5)",
                        &[&e.ts, &e.actor, &e.action, &e.target, &e.detail],
                    )
                    .await?;
                    Ok(())
                })
            })
        })
    }

    fn put_response(&self, r: &StoredResponse) -> Result<(), StoreError> {
        let r = r.clone();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    c.execute(
                        "DELETE FROM responses WHERE tenant = $1 AND expires_at <= $2",
                        &[&r.tenant, &r.created_at],
                    )
                    .await?;
                    c.execute(
                        "INSERT INTO responses (tenant, id, created_at, expires_at, body, \
                         conversation) VALUES ($1, $2, $3, $4, $5, $6) \
                         ON CONFLICT (tenant, id) DO UPDATE SET created_at = EXCLUDED.created_at, \
                         expires_at = EXCLUDED.expires_at, body = EXCLUDED.body, \
                         conversation = EXCLUDED.conversation",
                        &[
                            &r.tenant,
                            &r.id,
                            &r.created_at,
                            &r.expires_at,
                            &r.body,
                            &r.conversation,
                        ],
                    )
                    .await?;
                    Ok(())
                })
            })
        })
    }

    fn get_response(
        &self,
        tenant: &str,
        id: &str,
        now: i64,
    ) -> Result<Option<StoredResponse>, StoreError> {
        let (tenant, id) = (tenant.to_string(), id.to_string());
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let row = c
                        .query_opt(
                            "SELECT tenant, id, created_at, expires_at, body, conversation \
                             FROM responses WHERE tenant = $1 AND id = $2 AND expires_at > $3",
                            &[&tenant, &id, &now],
                        )
                        .await?;
                    Ok(row.map(|r| StoredResponse {
                        tenant: r.get(0),
                        id: r.get(1),
                        created_at: r.get(2),
                        expires_at: r.get(3),
                        body: r.get(4),
                        conversation: r.get(5),
                    }))
                })
            })
        })
    }

    fn list_audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        let limit = i64::from(limit);
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let rows = c
                        .query(
                            "SELECT ts, actor, action, target, detail FROM audit \
                             ORDER BY id DESC LIMIT $1",
                            &[&limit],
                        )
                        .await?;
                    rows.iter()
                        .map(|r| {
                            Ok(AuditEntry {
                                ts: r.try_get(0)?,
                                actor: r.try_get(1)?,
                                action: r.try_get(2)?,
                                target: r.try_get(3)?,
                                detail: r.try_get(4)?,
                            })
                        })
                        .collect()
                })
            })
        })
    }

    fn shares_budgets(&self) -> bool {
        true
    }

    fn hold_budget(&self, hold: &BudgetHold) -> Result<HoldOutcome, StoreError> {
        let h = hold.clone();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let tx = c.transaction().await?;
                    tx.execute(
                        "INSERT INTO tenants (name) VALUES ($1) ON CONFLICT DO NOTHING",
                        &[&h.tenant],
                    )
                    .await?;
                    // The row locks serialize every gateway's holds on this tenant (and
                    // key) until commit: the sums below cannot change under us.
                    let tenant_spend: i64 = tx
                        .query_one(
                            "SELECT spend_micros FROM tenants WHERE name = $1 FOR UPDATE",
                            &[&h.tenant],
                        )
                        .await?
                        .try_get(0)?;
                    let key_spend: i64 = tx
                        .query_opt(
                            "SELECT spend_micros FROM api_keys WHERE id = $1 FOR UPDATE",
                            &[&h.key_id],
                        )
                        .await?
                        .map(|r| r.try_get(0))
                        .transpose()?
                        .unwrap_or(0);
                    let user_spend = user_spend_locked(&tx, &h).await?;
                    let held = tx
                        .query_one(
                            "SELECT \
                             COALESCE(SUM(amount_micros) FILTER (WHERE tenant = $1), 0)::int8, \
                             COALESCE(SUM(amount_micros) FILTER (WHERE key_id = $2), 0)::int8, \
                             COALESCE(SUM(amount_micros) \
                               FILTER (WHERE tenant = $1 AND user_name = $4 AND $4 <> ''), 0)::int8 \
                             FROM budget_holds \
                             WHERE (tenant = $1 OR key_id = $2) AND expires_at > $3",
                            &[&h.tenant, &h.key_id, &h.now, &h.user],
                        )
                        .await?;
                    let (tenant_held, key_held, user_held): (i64, i64, i64) =
                        (held.try_get(0)?, held.try_get(1)?, held.try_get(2)?);
                    // A budget with a period counts the current window's spend only.
                    let tenant_spend = match h.tenant_period {
                        Some(p) => {
                            window_spend(&tx, Holder::Tenant, &h.tenant, "", p, h.now).await?
                        }
                        None => tenant_spend,
                    };
                    let key_spend = match h.key_period {
                        Some(p) => {
                            window_spend(&tx, Holder::Key, &h.tenant, &h.key_id, p, h.now).await?
                        }
                        None => key_spend,
                    };
                    let checks = [
                        (Holder::Key, key_spend + key_held, h.key_budget_micros),
                        (Holder::User, user_spend + user_held, h.user_budget_micros),
                        (Holder::Tenant, tenant_spend + tenant_held, h.tenant_budget_micros),
                    ];
                    for (holder, spent, budget) in checks {
                        if let Some(b) = budget {
                            if spent >= b {
                                tx.rollback().await?;
                                return Ok(HoldOutcome::Spent {
                                    holder,
                                    spent_micros: spent,
                                    budget_micros: b,
                                });
                            }
                        }
                    }
                    tx.execute(
                        "INSERT INTO budget_holds (id, tenant, key_id, amount_micros, expires_at, \
                         user_name) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (id) DO NOTHING",
                        &[&h.id, &h.tenant, &h.key_id, &h.amount_micros, &h.expires_at, &h.user],
                    )
                    .await?;
                    tx.commit().await?;
                    Ok(HoldOutcome::Held)
                })
            })
        })
    }

    fn release_hold(&self, id: &str) -> Result<(), StoreError> {
        let id = id.to_string();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    c.execute("DELETE FROM budget_holds WHERE id = $1", &[&id])
                        .await?;
                    Ok(())
                })
            })
        })
    }
}
