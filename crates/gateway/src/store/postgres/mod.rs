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
//!
//! The statements both stores run are written once (`queries.rs`); this module
//! holds how Postgres runs them, its schema, its ledger insert (`ledger.rs`) and the
//! budget holds (`holds.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::sync::Mutex as AsyncMutex;
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};
use tokio_postgres::{Client, NoTls};

use super::backend::{Backend, SqlStore};
use super::stmt::{Query, Row, Stmt, Value};
use super::{BudgetHold, HoldOutcome, StoreError, UsageEvent};

/// Schema steps, applied in order under an advisory lock (replicas starting together
/// migrate once); entry `i` moves the database to version `i + 1`. Append, never edit.
/// Not shared with SQLite: the column types differ, and only here does the ledger keep
/// an event id and budget holds a table.
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

/// Postgres's side of [`PgStore`]: the runtime its calls run on and its connections.
pub struct Postgres {
    inner: Arc<Inner>,
    handle: tokio::runtime::Handle,
    timeout: Duration,
    /// Until when calls fail at once (the server was unavailable).
    down_until: parking_lot::Mutex<Option<Instant>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The shared store.
pub type PgStore = SqlStore<Postgres>;

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
        let db = Postgres {
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
        db.call(|inner| Box::pin(async move { inner.migrate().await }))?;
        Ok(SqlStore { db })
    }

    /// The schema version after migration.
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        self.db.call(|inner| {
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
}

impl Postgres {
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

impl Drop for Postgres {
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

// Below `with_conn!`: a macro is in scope only after its definition.
mod holds;
mod ledger;

impl Backend for Postgres {
    fn execute(&self, stmts: &[Stmt<'_>]) -> Result<u64, StoreError> {
        let stmts: Vec<Stmt<'static>> = stmts.iter().cloned().map(Stmt::into_owned).collect();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let mut changed = 0;
                    for s in &stmts {
                        changed += c.execute(s.sql, &values(s)).await?;
                    }
                    Ok(changed)
                })
            })
        })
    }

    fn execute_atomic(&self, stmts: &[Stmt<'_>]) -> Result<(), StoreError> {
        let stmts: Vec<Stmt<'static>> = stmts.iter().cloned().map(Stmt::into_owned).collect();
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let tx = c.transaction().await?;
                    for s in &stmts {
                        tx.execute(s.sql, &values(s)).await?;
                    }
                    tx.commit().await?;
                    Ok(())
                })
            })
        })
    }

    fn query<T: Send + 'static>(&self, q: Query<'_, T>) -> Result<Vec<T>, StoreError> {
        let (stmt, read) = (q.stmt.into_owned(), q.read);
        self.call(move |inner| {
            Box::pin(async move {
                with_conn!(inner, |c| {
                    let rows = c.query(stmt.sql, &values(&stmt)).await?;
                    rows.iter().map(|r| read(r)).collect()
                })
            })
        })
    }

    fn record_usage(&self, events: &[UsageEvent]) -> Result<(), StoreError> {
        self.write_ledger(events)
    }

    fn shares_budgets(&self) -> bool {
        true
    }

    fn hold_budget(&self, hold: &BudgetHold) -> Result<HoldOutcome, StoreError> {
        self.hold(hold)
    }

    fn release_hold(&self, id: &str) -> Result<(), StoreError> {
        self.release(id)
    }
}

/// A statement's values as the client binds them.
fn values<'a>(s: &'a Stmt<'_>) -> Vec<&'a (dyn ToSql + Sync)> {
    s.values.iter().map(|v| v as &(dyn ToSql + Sync)).collect()
}

impl ToSql for Value<'_> {
    /// Binds as the inner value, whose own type check applies (an integer to a BIGINT, a
    /// text to a TEXT column).
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Value::Int(v) => v.to_sql_checked(ty, out),
            Value::Text(v) => v.as_deref().to_sql_checked(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        <Option<i64> as ToSql>::accepts(ty) || <Option<&str> as ToSql>::accepts(ty)
    }

    to_sql_checked!();
}

impl Row for tokio_postgres::Row {
    fn int(&self, i: usize) -> Result<i64, StoreError> {
        Ok(self.try_get(i)?)
    }

    fn opt_int(&self, i: usize) -> Result<Option<i64>, StoreError> {
        Ok(self.try_get(i)?)
    }

    fn text(&self, i: usize) -> Result<String, StoreError> {
        Ok(self.try_get(i)?)
    }

    fn opt_text(&self, i: usize) -> Result<Option<String>, StoreError> {
        Ok(self.try_get(i)?)
    }
}
