//! The embedded store: one SQLite file in WAL mode, schema managed by numbered migrations
//! recorded in `PRAGMA user_version`.
//!
//! One connection behind a mutex: the gateway writes in batches from one thread and reads
//! rarely (admin API, key refresh), so a pool would buy nothing.

use std::collections::HashMap;
use std::path::Path;

use parking_lot::Mutex;
use rusqlite::{params, Connection, OptionalExtension};

use super::{
    period_increments, AuditEntry, Holder, KeyRecord, PeriodSpend, Store, StoreError,
    StoredResponse, TenantRecord, UsageEvent, UsageFilter, UsageRow, UserRecord,
};
use crate::budget::{Period, Window};
use crate::config::RateLimits;
use crate::role::Role;

/// Schema steps, applied in order; entry `i` moves the database to version `i + 1`.
/// Never edit a released step: append a new one.
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

pub struct SqliteStore {
    conn: Mutex<Connection>,
}

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
        Ok(SqliteStore {
            conn: Mutex::new(conn),
        })
    }

    /// The schema version after migration.
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        Ok(self
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

fn opt_u64(v: Option<i64>) -> Option<u64> {
    v.and_then(|x| u64::try_from(x).ok())
}

fn opt_i64(v: Option<u64>) -> Option<i64> {
    v.map(|x| i64::try_from(x).unwrap_or(i64::MAX))
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

fn key_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<(KeyRecord, String)> {
    let models: String = row.get(5)?;
    let role: String = row.get(13)?;
    Ok((
        KeyRecord {
            id: row.get(0)?,
            tenant: row.get(1)?,
            name: row.get(2)?,
            salt_hex: row.get(3)?,
            hash_hex: row.get(4)?,
            allowed_models: Vec::new(),
            limits: RateLimits {
                rpm: opt_u64(row.get(6)?),
                tpm: opt_u64(row.get(7)?),
            },
            budget_micros: row.get(8)?,
            budget_period: period(row.get(14)?),
            spend_micros: row.get(9)?,
            created_at: row.get(10)?,
            revoked_at: row.get(11)?,
            user: row.get(12)?,
            role: Role::parse(&role).unwrap_or_default(),
        },
        models,
    ))
}

fn finish_key((mut k, models): (KeyRecord, String)) -> Result<KeyRecord, StoreError> {
    k.allowed_models = serde_json::from_str(&models)
        .map_err(|e| StoreError::Corrupt(format!("allowed_models of key {}: {e}", k.id)))?;
    Ok(k)
}

impl Store for SqliteStore {
    fn insert_key(&self, k: &KeyRecord) -> Result<(), StoreError> {
        let models = serde_json::to_string(&k.allowed_models)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let conn = self.conn.lock();
        conn.execute(
            &format!("INSERT INTO api_keys ({KEY_COLUMNS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15)"),
            params![
                k.id,
                k.tenant,
                k.name,
                k.salt_hex,
                k.hash_hex,
                models,
                opt_i64(k.limits.rpm),
                opt_i64(k.limits.tpm),
                k.budget_micros,
                k.spend_micros,
                k.created_at,
                k.revoked_at,
                k.user,
                k.role.as_str(),
                period_text(k.budget_period)
            ],
        )?;
        conn.execute(
            "INSERT OR IGNORE INTO tenants (name) VALUES (?1)",
            params![k.tenant],
        )?;
        Ok(())
    }

    fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at, id"
        ))?;
        let rows = stmt.query_map([], key_from_row)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(finish_key(r?)?);
        }
        Ok(out)
    }

    fn get_key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
        let conn = self.conn.lock();
        let row = conn
            .query_row(
                &format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = ?1"),
                params![id],
                key_from_row,
            )
            .optional()?;
        row.map(finish_key).transpose()
    }

    fn revoke_key(&self, id: &str, now: i64) -> Result<bool, StoreError> {
        let n = self.conn.lock().execute(
            "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
            params![id, now],
        )?;
        Ok(n > 0)
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
        let n = self.conn.lock().execute(
            "UPDATE api_keys SET rpm = ?2, tpm = ?3, budget_micros = ?4, allowed_models = ?5, \
             budget_period = ?6 WHERE id = ?1",
            params![
                id,
                opt_i64(limits.rpm),
                opt_i64(limits.tpm),
                budget_micros,
                models,
                period_text(budget_period)
            ],
        )?;
        Ok(n > 0)
    }

    fn upsert_tenant(
        &self,
        name: &str,
        limits: RateLimits,
        (budget_micros, budget_period): (Option<i64>, Option<Period>),
    ) -> Result<(), StoreError> {
        self.conn.lock().execute(
            "INSERT INTO tenants (name, rpm, tpm, budget_micros, budget_period) \
             VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT(name) DO UPDATE SET rpm = ?2, tpm = ?3, \
             budget_micros = ?4, budget_period = ?5",
            params![
                name,
                opt_i64(limits.rpm),
                opt_i64(limits.tpm),
                budget_micros,
                period_text(budget_period)
            ],
        )?;
        Ok(())
    }

    fn upsert_user(
        &self,
        tenant: &str,
        name: &str,
        (budget_micros, budget_period): (Option<i64>, Option<Period>),
    ) -> Result<(), StoreError> {
        self.conn.lock().execute(
            "INSERT INTO users (tenant, name, budget_micros, budget_period) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT(tenant, name) DO UPDATE SET budget_micros = ?3, budget_period = ?4",
            params![tenant, name, budget_micros, period_text(budget_period)],
        )?;
        Ok(())
    }

    fn list_users(&self) -> Result<Vec<UserRecord>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare(
            "SELECT tenant, name, budget_micros, budget_period, spend_micros FROM users \
             ORDER BY tenant, name",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(UserRecord {
                tenant: r.get(0)?,
                name: r.get(1)?,
                budget_micros: r.get(2)?,
                budget_period: period(r.get(3)?),
                spend_micros: r.get(4)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn list_period_spend(&self) -> Result<Vec<PeriodSpend>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt =
            conn.prepare("SELECT holder, tenant, name, period, start, micros FROM period_spend")?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, i64>(5)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (holder, tenant, name, p, start, micros) = row?;
            if let (Some(holder), Some(period)) = (Holder::parse(&holder), Period::parse(&p)) {
                out.push(PeriodSpend {
                    holder,
                    tenant,
                    name,
                    period,
                    window: Window { start, micros },
                });
            }
        }
        Ok(out)
    }

    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare(
            "SELECT name, rpm, tpm, budget_micros, spend_micros, budget_period FROM tenants \
             ORDER BY name",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(TenantRecord {
                name: r.get(0)?,
                limits: RateLimits {
                    rpm: opt_u64(r.get(1)?),
                    tpm: opt_u64(r.get(2)?),
                },
                budget_micros: r.get(3)?,
                budget_period: period(r.get(5)?),
                spend_micros: r.get(4)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn record_usage(&self, events: &[UsageEvent]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn.lock();
        let tx = conn.transaction()?;
        {
            let mut ins = tx.prepare_cached(
                "INSERT INTO usage (ts, key_id, tenant, model, upstream, input_tokens, \
                 output_tokens, cost_micros, cached, status, user_name) \
                 VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11)",
            )?;
            let mut user_spend = tx.prepare_cached(
                "INSERT INTO users (tenant, name, spend_micros) VALUES (?1, ?2, ?3) \
                 ON CONFLICT(tenant, name) DO UPDATE SET spend_micros = spend_micros + ?3",
            )?;
            let mut window = tx.prepare_cached(
                "INSERT INTO period_spend (holder, tenant, name, period, start, micros) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
                 ON CONFLICT(holder, tenant, name, period) DO UPDATE SET \
                 micros = CASE WHEN excluded.start = period_spend.start \
                                 THEN period_spend.micros + excluded.micros \
                               WHEN excluded.start > period_spend.start THEN excluded.micros \
                               ELSE period_spend.micros END, \
                 start = MAX(period_spend.start, excluded.start)",
            )?;
            let mut key_spend = tx.prepare_cached(
                "UPDATE api_keys SET spend_micros = spend_micros + ?2 WHERE id = ?1",
            )?;
            let mut tenant_spend = tx.prepare_cached(
                "INSERT INTO tenants (name, spend_micros) VALUES (?1, ?2) \
                 ON CONFLICT(name) DO UPDATE SET spend_micros = spend_micros + ?2",
            )?;
            // Spend is summed per key and tenant first: one UPDATE each per batch
            // rather than two per row.
            let mut keys: HashMap<&str, i64> = HashMap::new();
            let mut tenants: HashMap<&str, i64> = HashMap::new();
            let mut users: HashMap<(&str, &str), i64> = HashMap::new();
            for e in events {
                ins.execute(params![
                    e.ts,
                    e.key_id,
                    e.tenant,
                    e.model,
                    e.upstream,
                    opt_i64(Some(e.input_tokens)),
                    opt_i64(Some(e.output_tokens)),
                    e.cost_micros,
                    e.cached,
                    e.status,
                    e.user
                ])?;
                if e.cost_micros != 0 {
                    *keys.entry(&e.key_id).or_default() += e.cost_micros;
                    *tenants.entry(&e.tenant).or_default() += e.cost_micros;
                    if !e.user.is_empty() {
                        *users.entry((&e.tenant, &e.user)).or_default() += e.cost_micros;
                    }
                }
            }
            for ((tenant, name), cost) in users {
                user_spend.execute(params![tenant, name, cost])?;
            }
            for w in period_increments(events) {
                window.execute(params![
                    w.holder.as_str(),
                    w.tenant,
                    w.name,
                    w.period.as_str(),
                    w.window.start,
                    w.window.micros
                ])?;
            }
            for (id, cost) in keys {
                key_spend.execute(params![id, cost])?;
            }
            for (name, cost) in tenants {
                tenant_spend.execute(params![name, cost])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn usage(&self, f: &UsageFilter) -> Result<Vec<UsageRow>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare(
            "SELECT tenant, key_id, model, COUNT(*), SUM(input_tokens), SUM(output_tokens), \
             SUM(cost_micros), user_name FROM usage \
             WHERE (?1 IS NULL OR tenant = ?1) AND (?2 IS NULL OR key_id = ?2) \
               AND (?3 IS NULL OR ts >= ?3) AND (?4 IS NULL OR user_name = ?4) \
             GROUP BY tenant, key_id, user_name, model ORDER BY tenant, key_id, user_name, model",
        )?;
        let rows = stmt.query_map(params![f.tenant, f.key_id, f.since, f.user], |r| {
            let cost: i64 = r.get(6)?;
            Ok(UsageRow {
                tenant: r.get(0)?,
                key_id: r.get(1)?,
                user: r.get(7)?,
                model: r.get(2)?,
                requests: opt_u64(r.get(3)?).unwrap_or(0),
                input_tokens: opt_u64(r.get(4)?).unwrap_or(0),
                output_tokens: opt_u64(r.get(5)?).unwrap_or(0),
                cost_micros: cost,
                cost_usd: cost as f64 / 1e6,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn audit(&self, e: &AuditEntry) -> Result<(), StoreError> {
        self.conn.lock().execute(
            "INSERT INTO audit (ts, actor, action, target, detail) VALUES (?1,?2,?3,?4,?5)",
            params![e.ts, e.actor, e.action, e.target, e.detail],
        )?;
        Ok(())
    }

    fn put_response(&self, r: &StoredResponse) -> Result<(), StoreError> {
        let conn = self.conn.lock();
        conn.execute(
            "DELETE FROM responses WHERE tenant = ?1 AND expires_at <= ?2",
            params![r.tenant, r.created_at],
        )?;
        conn.execute(
            "INSERT OR REPLACE INTO responses (tenant, id, created_at, expires_at, body, \
             conversation) VALUES (?1,?2,?3,?4,?5,?6)",
            params![
                r.tenant,
                r.id,
                r.created_at,
                r.expires_at,
                r.body,
                r.conversation
            ],
        )?;
        Ok(())
    }

    fn get_response(
        &self,
        tenant: &str,
        id: &str,
        now: i64,
    ) -> Result<Option<StoredResponse>, StoreError> {
        Ok(self
            .conn
            .lock()
            .query_row(
                "SELECT tenant, id, created_at, expires_at, body, conversation FROM responses \
                 WHERE tenant = ?1 AND id = ?2 AND expires_at > ?3",
                params![tenant, id, now],
                |r| {
                    Ok(StoredResponse {
                        tenant: r.get(0)?,
                        id: r.get(1)?,
                        created_at: r.get(2)?,
                        expires_at: r.get(3)?,
                        body: r.get(4)?,
                        conversation: r.get(5)?,
                    })
                },
            )
            .optional()?)
    }

    fn list_audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare(
            "SELECT ts, actor, action, target, detail FROM audit ORDER BY id DESC LIMIT ?1",
        )?;
        let rows = stmt.query_map(params![limit], |r| {
            Ok(AuditEntry {
                ts: r.get(0)?,
                actor: r.get(1)?,
                action: r.get(2)?,
                target: r.get(3)?,
                detail: r.get(4)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
