//! The embedded store: one SQLite file in WAL mode, schema managed by numbered migrations
//! recorded in `PRAGMA user_version`. The statements it runs are the shared ones
//! (`queries.rs`); this file holds how SQLite runs them, its schema and its
//! ledger insert.
//!
//! One connection behind a mutex: the gateway writes in batches from one thread and reads
//! rarely (admin API, key refresh), so a pool would buy nothing.

use std::path::Path;

use parking_lot::Mutex;
use rusqlite::types::{Null, ToSqlOutput};
use rusqlite::{params, params_from_iter, Connection};

use super::backend::{Backend, SqlStore};
use super::queries::{self, to_i64};
use super::stmt::{Query, Row, Stmt, Value};
use super::{StoreError, UsageEvent};

/// Schema steps, applied in order; entry `i` moves the database to version `i + 1`.
/// Never edit a released step: append a new one. Not shared with Postgres: the column
/// types differ, and Postgres's ledger keeps an event id and its budget holds a table.
const MIGRATIONS: &[&str] = &[
    // 1: keys, tenants, usage ledger, audit log.
    "CREATE TABLE tenants (
        name TEXT PRIMARY KEY,
        rpm INTEGER, tpm INTEGER,
        budget_micros INTEGER,
        spend_micros INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        salt TEXT NOT NULL,
        hash TEXT NOT NULL,
        allowed_models TEXT NOT NULL DEFAULT '[]',
        rpm INTEGER, tpm INTEGER,
        budget_micros INTEGER,
        spend_micros INTEGER NOT NULL DEFAULT 0,
        created_at INTEGER NOT NULL,
        revoked_at INTEGER
    );
    CREATE INDEX api_keys_tenant ON api_keys(tenant);
    CREATE TABLE usage (
        id INTEGER PRIMARY KEY,
        ts INTEGER NOT NULL,
        key_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        model TEXT NOT NULL,
        upstream TEXT NOT NULL,
        input_tokens INTEGER NOT NULL,
        output_tokens INTEGER NOT NULL,
        cost_micros INTEGER NOT NULL,
        cached INTEGER NOT NULL,
        status INTEGER NOT NULL
    );
    CREATE INDEX usage_ts ON usage(ts);
    CREATE INDEX usage_tenant ON usage(tenant, ts);
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY,
        ts INTEGER NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        detail TEXT NOT NULL
    );",
    // 2: users, budget periods and roles (issue 29). Additive: every old row reads as
    // before (no user, member, lifetime budget).
    "ALTER TABLE api_keys ADD COLUMN user_name TEXT;
    ALTER TABLE api_keys ADD COLUMN role TEXT NOT NULL DEFAULT 'member';
    ALTER TABLE api_keys ADD COLUMN budget_period TEXT;
    ALTER TABLE tenants ADD COLUMN budget_period TEXT;
    ALTER TABLE usage ADD COLUMN user_name TEXT NOT NULL DEFAULT '';
    CREATE TABLE users (
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        budget_micros INTEGER,
        budget_period TEXT,
        spend_micros INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (tenant, name)
    );
    CREATE TABLE period_spend (
        holder TEXT NOT NULL,
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        period TEXT NOT NULL,
        start INTEGER NOT NULL,
        micros INTEGER NOT NULL,
        PRIMARY KEY (holder, tenant, name, period)
    );",
    // 3: Responses API responses kept for `GET /v1/responses/{id}` and
    // `previous_response_id`, per tenant, until they expire (issue 27).
    "CREATE TABLE responses (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL,
        body TEXT NOT NULL,
        conversation TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    CREATE INDEX responses_expiry ON responses (tenant, expires_at);",
];

/// SQLite's side of [`SqliteStore`]: its one connection.
pub struct Sqlite {
    conn: Mutex<Connection>,
}

/// The embedded store.
pub type SqliteStore = SqlStore<Sqlite>;

impl SqliteStore {
    /// Opens (creating when absent) the database at `path` and migrates it.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() {
                let _ = std::fs::create_dir_all(dir);
            }
        }
        Self::init(Connection::open(path)?)
    }

    /// A private in-memory database (tests, `--db :memory:`).
    pub fn in_memory() -> Result<SqliteStore, StoreError> {
        Self::init(Connection::open_in_memory()?)
    }

    fn init(mut conn: Connection) -> Result<SqliteStore, StoreError> {
        // WAL lets readers (another process running `strata keys`) proceed during writes;
        // NORMAL sync is durable across application crashes, which is what a ledger needs.
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        migrate(&mut conn)?;
        Ok(SqlStore {
            db: Sqlite {
                conn: Mutex::new(conn),
            },
        })
    }

    /// The schema version after migration.
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        Ok(self
            .db
            .conn
            .lock()
            .pragma_query_value(None, "user_version", |r| r.get(0))?)
    }
}

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(StoreError::TooNew {
            found: version,
            known,
        });
    }
    for (i, step) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let tx = conn.transaction()?;
        tx.execute_batch(step)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        tx.commit()?;
    }
    Ok(())
}

impl Backend for Sqlite {
    fn execute(&self, stmts: &[Stmt<'_>]) -> Result<u64, StoreError> {
        let conn = self.conn.lock();
        let mut changed = 0;
        for s in stmts {
            changed += run(&conn, s)? as u64;
        }
        Ok(changed)
    }

    fn execute_atomic(&self, stmts: &[Stmt<'_>]) -> Result<(), StoreError> {
        let mut conn = self.conn.lock();
        let tx = conn.transaction()?;
        for s in stmts {
            run(&tx, s)?;
        }
        tx.commit()?;
        Ok(())
    }

    fn query<T: Send + 'static>(&self, q: Query<'_, T>) -> Result<Vec<T>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare_cached(&q.stmt.sqlite_text())?;
        let mut rows = stmt.query(params_from_iter(&q.stmt.values))?;
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            out.push((q.read)(row)?);
        }
        Ok(out)
    }

    fn record_usage(&self, events: &[UsageEvent]) -> Result<(), StoreError> {
        let mut conn = self.conn.lock();
        let tx = conn.transaction()?;
        insert_ledger_rows(&tx, events)?;
        for s in queries::add_spend(events) {
            run(&tx, &s)?;
        }
        tx.commit()?;
        Ok(())
    }
}

/// Runs one statement (prepared once per connection); the rows it changed.
fn run(conn: &Connection, s: &Stmt<'_>) -> Result<usize, StoreError> {
    let mut stmt = conn.prepare_cached(&s.sqlite_text())?;
    Ok(stmt.execute(params_from_iter(&s.values))?)
}

/// Appends the ledger rows, one statement each (one process writes this ledger, so a
/// row never comes twice).
fn insert_ledger_rows(conn: &Connection, events: &[UsageEvent]) -> Result<(), StoreError> {
    let mut ins = conn.prepare_cached(
        "INSERT INTO usage (ts, key_id, tenant, model, upstream, input_tokens, \
         output_tokens, cost_micros, cached, status, user_name) \
         VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11)",
    )?;
    for e in events {
        ins.execute(params![
            e.ts,
            e.key_id,
            e.tenant,
            e.model,
            e.upstream,
            to_i64(e.input_tokens),
            to_i64(e.output_tokens),
            e.cost_micros,
            e.cached,
            e.status,
            e.user
        ])?;
    }
    Ok(())
}

impl rusqlite::ToSql for Value<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self {
            Value::Int(Some(v)) => ToSqlOutput::from(*v),
            Value::Text(Some(v)) => ToSqlOutput::from(v.as_ref()),
            Value::Int(None) | Value::Text(None) => ToSqlOutput::from(Null),
        })
    }
}

impl Row for rusqlite::Row<'_> {
    fn int(&self, i: usize) -> Result<i64, StoreError> {
        Ok(self.get(i)?)
    }

    fn opt_int(&self, i: usize) -> Result<Option<i64>, StoreError> {
        Ok(self.get(i)?)
    }

    fn text(&self, i: usize) -> Result<String, StoreError> {
        Ok(self.get(i)?)
    }

    fn opt_text(&self, i: usize) -> Result<Option<String>, StoreError> {
        Ok(self.get(i)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{Period, Window};
    use crate::config::RateLimits;
    use crate::role::Role;
    use crate::store::{AuditEntry, Holder, KeyRecord, Store, UsageFilter};

    fn key(id: &str, tenant: &str) -> KeyRecord {
        KeyRecord {
            id: id.into(),
            tenant: tenant.into(),
            name: "test".into(),
            salt_hex: "00".into(),
            hash_hex: "11".into(),
            allowed_models: vec!["m".into()],
            limits: RateLimits {
                rpm: Some(10),
                tpm: None,
            },
            budget_micros: Some(5),
            budget_period: Some(Period::Daily),
            spend_micros: 0,
            created_at: 1,
            revoked_at: None,
            user: Some("alice".into()),
            role: Role::TenantAdmin,
        }
    }

    #[test]
    fn keys_round_trip_and_revoke() {
        let s = SqliteStore::in_memory().unwrap();
        assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64);
        s.insert_key(&key("a", "t1")).unwrap();
        assert_eq!(s.get_key("a").unwrap().unwrap(), key("a", "t1"));
        assert!(s.revoke_key("a", 99).unwrap());
        assert!(!s.revoke_key("a", 100).unwrap(), "second revoke is a no-op");
        assert_eq!(s.get_key("a").unwrap().unwrap().revoked_at, Some(99));
        assert!(!s.revoke_key("missing", 1).unwrap());
        assert!(s
            .update_key("a", RateLimits::default(), (None, None), &[])
            .unwrap());
        let k = s.get_key("a").unwrap().unwrap();
        assert_eq!(k.limits, RateLimits::default());
        assert!(k.allowed_models.is_empty());
        assert_eq!(s.list_tenants().unwrap()[0].name, "t1");
    }

    #[test]
    fn usage_adds_spend_and_sums() {
        let s = SqliteStore::in_memory().unwrap();
        s.insert_key(&key("a", "t1")).unwrap();
        let ev = UsageEvent {
            id: String::new(),
            ts: 10,
            key_id: "a".into(),
            tenant: "t1".into(),
            user: "alice".into(),
            model: "m".into(),
            upstream: "u".into(),
            input_tokens: 3,
            output_tokens: 4,
            cost_micros: 7,
            cached: false,
            status: 200,
        };
        s.record_usage(&[ev.clone(), ev.clone()]).unwrap();
        assert_eq!(s.get_key("a").unwrap().unwrap().spend_micros, 14);
        assert_eq!(s.list_tenants().unwrap()[0].spend_micros, 14);
        let users = s.list_users().unwrap();
        assert_eq!(
            (users[0].name.as_str(), users[0].spend_micros),
            ("alice", 14)
        );
        let rows = s.usage(&UsageFilter::default()).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].user, "alice");
        assert_eq!(rows[0].requests, 2);
        assert_eq!(rows[0].output_tokens, 8);
        let none = s
            .usage(&UsageFilter {
                since: Some(11),
                ..Default::default()
            })
            .unwrap();
        assert!(none.is_empty());
    }

    #[test]
    fn period_windows_add_and_roll_over() {
        let s = SqliteStore::in_memory().unwrap();
        s.insert_key(&key("a", "t1")).unwrap();
        let day = 1_796_256_000; // 2026-12-03 00:00 UTC
        let ev = |ts: i64, cost: i64| UsageEvent {
            id: String::new(),
            ts,
            key_id: "a".into(),
            tenant: "t1".into(),
            user: "alice".into(),
            model: "m".into(),
            upstream: "u".into(),
            input_tokens: 1,
            output_tokens: 1,
            cost_micros: cost,
            cached: false,
            status: 200,
        };
        s.record_usage(&[ev(day + 10, 5), ev(day + 20, 6)]).unwrap();
        let find = |holder: Holder, period: Period| {
            s.list_period_spend()
                .unwrap()
                .into_iter()
                .find(|w| w.holder == holder && w.period == period)
                .unwrap()
                .window
        };
        assert_eq!(
            find(Holder::Key, Period::Daily),
            Window {
                start: day,
                micros: 11
            }
        );
        assert_eq!(find(Holder::User, Period::Daily).micros, 11);
        // The next day restarts the daily window; the month goes on.
        s.record_usage(&[ev(day + 86_400 + 1, 2)]).unwrap();
        assert_eq!(
            find(Holder::Tenant, Period::Daily),
            Window {
                start: day + 86_400,
                micros: 2
            }
        );
        assert_eq!(find(Holder::Tenant, Period::Monthly).micros, 13);
        // A late row of the day before counts in the lifetime only.
        s.record_usage(&[ev(day + 30, 100)]).unwrap();
        assert_eq!(find(Holder::Tenant, Period::Daily).micros, 2);
        assert_eq!(s.list_tenants().unwrap()[0].spend_micros, 113);
        s.upsert_user("t1", "alice", (Some(9), Some(Period::Weekly)))
            .unwrap();
        let u = &s.list_users().unwrap()[0];
        assert_eq!(
            (u.budget_micros, u.budget_period),
            (Some(9), Some(Period::Weekly))
        );
        s.upsert_tenant(
            "t1",
            RateLimits::default(),
            (Some(3), Some(Period::Monthly)),
        )
        .unwrap();
        assert_eq!(
            s.list_tenants().unwrap()[0].budget_period,
            Some(Period::Monthly)
        );
    }

    #[test]
    fn a_version_1_database_opens_and_keeps_its_rows() {
        let dir = std::env::temp_dir().join(format!("strata-gw-v1-{}", std::process::id()));
        let path = dir.join("gw.db");
        std::fs::create_dir_all(&dir).unwrap();
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(MIGRATIONS[0]).unwrap();
            conn.pragma_update(None, "user_version", 1).unwrap();
            conn.execute(
                "INSERT INTO api_keys (id, tenant, name, salt, hash, budget_micros, spend_micros, \
                 created_at) VALUES ('old', 't', 'n', '00', '11', 7, 3, 1)",
                [],
            )
            .unwrap();
        }
        let s = SqliteStore::open(&path).unwrap();
        assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64);
        let k = s.get_key("old").unwrap().unwrap();
        assert_eq!((k.budget_micros, k.spend_micros), (Some(7), 3));
        assert_eq!(
            (k.budget_period, k.role, k.user),
            (None, Role::Member, None)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn migrations_are_idempotent_on_reopen_and_audit_works() {
        let dir = std::env::temp_dir().join(format!("strata-gw-db-{}", std::process::id()));
        let path = dir.join("gw.db");
        {
            let s = SqliteStore::open(&path).unwrap();
            s.audit(&AuditEntry {
                ts: 1,
                actor: "admin".into(),
                action: "create_key".into(),
                target: "a".into(),
                detail: "{}".into(),
            })
            .unwrap();
        }
        let s = SqliteStore::open(&path).unwrap();
        assert_eq!(s.list_audit(10).unwrap().len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
