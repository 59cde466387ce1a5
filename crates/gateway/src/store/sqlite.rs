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
    AuditEntry, KeyRecord, Store, StoreError, TenantRecord, UsageEvent, UsageFilter, UsageRow,
};
use crate::config::RateLimits;

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
                           spend_micros, created_at, revoked_at";

fn key_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<(KeyRecord, String)> {
    let models: String = row.get(5)?;
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
            spend_micros: row.get(9)?,
            created_at: row.get(10)?,
            revoked_at: row.get(11)?,
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
            &format!("INSERT INTO api_keys ({KEY_COLUMNS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12)"),
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
                k.revoked_at
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
        budget_micros: Option<i64>,
        allowed_models: &[String],
    ) -> Result<bool, StoreError> {
        let models = serde_json::to_string(allowed_models)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let n = self.conn.lock().execute(
            "UPDATE api_keys SET rpm = ?2, tpm = ?3, budget_micros = ?4, allowed_models = ?5 \
             WHERE id = ?1",
            params![
                id,
                opt_i64(limits.rpm),
                opt_i64(limits.tpm),
                budget_micros,
                models
            ],
        )?;
        Ok(n > 0)
    }

    fn upsert_tenant(
        &self,
        name: &str,
        limits: RateLimits,
        budget_micros: Option<i64>,
    ) -> Result<(), StoreError> {
        self.conn.lock().execute(
            "INSERT INTO tenants (name, rpm, tpm, budget_micros) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT(name) DO UPDATE SET rpm = ?2, tpm = ?3, budget_micros = ?4",
            params![
                name,
                opt_i64(limits.rpm),
                opt_i64(limits.tpm),
                budget_micros
            ],
        )?;
        Ok(())
    }

    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare(
            "SELECT name, rpm, tpm, budget_micros, spend_micros FROM tenants ORDER BY name",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(TenantRecord {
                name: r.get(0)?,
                limits: RateLimits {
                    rpm: opt_u64(r.get(1)?),
                    tpm: opt_u64(r.get(2)?),
                },
                budget_micros: r.get(3)?,
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
                 output_tokens, cost_micros, cached, status) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10)",
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
                    e.status
                ])?;
                if e.cost_micros != 0 {
                    *keys.entry(&e.key_id).or_default() += e.cost_micros;
                    *tenants.entry(&e.tenant).or_default() += e.cost_micros;
                }
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
             SUM(cost_micros) FROM usage \
             WHERE (?1 IS NULL OR tenant = ?1) AND (?2 IS NULL OR key_id = ?2) \
               AND (?3 IS NULL OR ts >= ?3) \
             GROUP BY tenant, key_id, model ORDER BY tenant, key_id, model",
        )?;
        let rows = stmt.query_map(params![f.tenant, f.key_id, f.since], |r| {
            let cost: i64 = r.get(6)?;
            Ok(UsageRow {
                tenant: r.get(0)?,
                key_id: r.get(1)?,
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
            spend_micros: 0,
            created_at: 1,
            revoked_at: None,
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
        assert!(s.update_key("a", RateLimits::default(), None, &[]).unwrap());
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
        let rows = s.usage(&UsageFilter::default()).unwrap();
        assert_eq!(rows.len(), 1);
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
