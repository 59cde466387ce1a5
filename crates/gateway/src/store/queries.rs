//! The statements the SQLite and Postgres stores share, and how their rows read, each
//! written once. The text is SQL both databases run as it stands: upserts as
//! `INSERT ... ON CONFLICT`, a later window start taken with `CASE` (SQLite has no
//! `GREATEST`, Postgres no two-argument `MAX`), casts as `CAST` (Postgres types a bare
//! `$1 IS NULL` by it and a `SUM` of BIGINT as NUMERIC). Placeholders are the one
//! difference ([`super::stmt`]).
//!
//! What differs in kind stays with its backend: the schema and its migrations (the
//! column types, and released steps are never edited), the ledger rows' insert
//! (Postgres writes a batch in one statement, once per event id) and budget holds
//! (Postgres only).

use std::collections::BTreeMap;

use super::stmt::{Query, Row, Stmt, Value};
use super::{
    period_increments, AuditEntry, Holder, KeyRecord, PeriodSpend, StoreError, StoredResponse,
    TenantRecord, UsageEvent, UsageFilter, UsageRow, UserRecord,
};
use crate::budget::{Period, Window};
use crate::config::RateLimits;
use crate::role::Role;

/// The columns of a key, as [`key`] reads them.
macro_rules! key_columns {
    () => {
        "id, tenant, name, salt, hash, allowed_models, rpm, tpm, budget_micros, \
         spend_micros, created_at, revoked_at, user_name, role, budget_period"
    };
}

fn opt_u64(v: Option<i64>) -> Option<u64> {
    v.and_then(|x| u64::try_from(x).ok())
}

fn opt_i64(v: Option<u64>) -> Option<i64> {
    v.map(to_i64)
}

/// A count as stored (BIGINT): saturates rather than wraps.
pub fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A stored period name; an unknown one (a newer build's) reads as a lifetime budget.
fn period(v: Option<String>) -> Option<Period> {
    v.as_deref().and_then(Period::parse)
}

fn period_text(p: Option<Period>) -> Value<'static> {
    p.map(Period::as_str).into()
}

fn models_json(models: &[String]) -> Result<String, StoreError> {
    serde_json::to_string(models).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// A new key, and its tenant's row when the tenant has none (one transaction).
pub fn insert_key(k: &KeyRecord) -> Result<[Stmt<'_>; 2], StoreError> {
    let models = models_json(&k.allowed_models)?;
    Ok([
        Stmt::new(
            concat!(
                "INSERT INTO api_keys (",
                key_columns!(),
                ") VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15)"
            ),
            vec![
                (&k.id).into(),
                (&k.tenant).into(),
                (&k.name).into(),
                (&k.salt_hex).into(),
                (&k.hash_hex).into(),
                models.into(),
                opt_i64(k.limits.rpm).into(),
                opt_i64(k.limits.tpm).into(),
                k.budget_micros.into(),
                k.spend_micros.into(),
                k.created_at.into(),
                k.revoked_at.into(),
                k.user.as_deref().into(),
                k.role.as_str().into(),
                period_text(k.budget_period),
            ],
        ),
        Stmt::new(
            "INSERT INTO tenants (name) VALUES ($1) ON CONFLICT DO NOTHING",
            vec![(&k.tenant).into()],
        ),
    ])
}

pub fn list_keys() -> Query<'static, KeyRecord> {
    Query {
        stmt: Stmt::new(
            concat!(
                "SELECT ",
                key_columns!(),
                " FROM api_keys ORDER BY created_at, id"
            ),
            vec![],
        ),
        read: key,
    }
}

pub fn get_key(id: &str) -> Query<'_, KeyRecord> {
    Query {
        stmt: Stmt::new(
            concat!("SELECT ", key_columns!(), " FROM api_keys WHERE id = $1"),
            vec![id.into()],
        ),
        read: key,
    }
}

fn key(row: &dyn Row) -> Result<KeyRecord, StoreError> {
    let id = row.text(0)?;
    let models = row.text(5)?;
    let allowed_models = serde_json::from_str(&models)
        .map_err(|e| StoreError::Corrupt(format!("allowed_models of key {id}: {e}")))?;
    Ok(KeyRecord {
        id,
        tenant: row.text(1)?,
        name: row.text(2)?,
        salt_hex: row.text(3)?,
        hash_hex: row.text(4)?,
        allowed_models,
        limits: RateLimits {
            rpm: opt_u64(row.opt_int(6)?),
            tpm: opt_u64(row.opt_int(7)?),
        },
        budget_micros: row.opt_int(8)?,
        budget_period: period(row.opt_text(14)?),
        spend_micros: row.int(9)?,
        created_at: row.int(10)?,
        revoked_at: row.opt_int(11)?,
        user: row.opt_text(12)?,
        role: Role::parse(&row.text(13)?).unwrap_or_default(),
    })
}

/// Revokes a key not yet revoked (one row changed, or none).
pub fn revoke_key(id: &str, now: i64) -> Stmt<'_> {
    Stmt::new(
        "UPDATE api_keys SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL",
        vec![id.into(), now.into()],
    )
}

pub fn update_key<'a>(
    id: &'a str,
    limits: RateLimits,
    (budget_micros, budget_period): (Option<i64>, Option<Period>),
    allowed_models: &[String],
) -> Result<Stmt<'a>, StoreError> {
    let models = models_json(allowed_models)?;
    Ok(Stmt::new(
        "UPDATE api_keys SET rpm = $2, tpm = $3, budget_micros = $4, allowed_models = $5, \
         budget_period = $6 WHERE id = $1",
        vec![
            id.into(),
            opt_i64(limits.rpm).into(),
            opt_i64(limits.tpm).into(),
            budget_micros.into(),
            models.into(),
            period_text(budget_period),
        ],
    ))
}

pub fn upsert_tenant(
    name: &str,
    limits: RateLimits,
    (budget_micros, budget_period): (Option<i64>, Option<Period>),
) -> Stmt<'_> {
    Stmt::new(
        "INSERT INTO tenants (name, rpm, tpm, budget_micros, budget_period) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO UPDATE SET \
         rpm = $2, tpm = $3, budget_micros = $4, budget_period = $5",
        vec![
            name.into(),
            opt_i64(limits.rpm).into(),
            opt_i64(limits.tpm).into(),
            budget_micros.into(),
            period_text(budget_period),
        ],
    )
}

pub fn list_tenants() -> Query<'static, TenantRecord> {
    Query {
        stmt: Stmt::new(
            "SELECT name, rpm, tpm, budget_micros, spend_micros, budget_period FROM tenants \
             ORDER BY name",
            vec![],
        ),
        read: |r| {
            Ok(TenantRecord {
                name: r.text(0)?,
                limits: RateLimits {
                    rpm: opt_u64(r.opt_int(1)?),
                    tpm: opt_u64(r.opt_int(2)?),
                },
                budget_micros: r.opt_int(3)?,
                budget_period: period(r.opt_text(5)?),
                spend_micros: r.int(4)?,
            })
        },
    }
}

pub fn upsert_user<'a>(
    tenant: &'a str,
    name: &'a str,
    (budget_micros, budget_period): (Option<i64>, Option<Period>),
) -> Stmt<'a> {
    Stmt::new(
        "INSERT INTO users (tenant, name, budget_micros, budget_period) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (tenant, name) DO UPDATE SET \
         budget_micros = $3, budget_period = $4",
        vec![
            tenant.into(),
            name.into(),
            budget_micros.into(),
            period_text(budget_period),
        ],
    )
}

pub fn list_users() -> Query<'static, UserRecord> {
    Query {
        stmt: Stmt::new(
            "SELECT tenant, name, budget_micros, budget_period, spend_micros FROM users \
             ORDER BY tenant, name",
            vec![],
        ),
        read: |r| {
            Ok(UserRecord {
                tenant: r.text(0)?,
                name: r.text(1)?,
                budget_micros: r.opt_int(2)?,
                budget_period: period(r.opt_text(3)?),
                spend_micros: r.int(4)?,
            })
        },
    }
}

/// Every stored window; one of a holder or period this build does not know reads as
/// `None` (and is skipped).
pub fn list_period_spend() -> Query<'static, Option<PeriodSpend>> {
    Query {
        stmt: Stmt::new(
            "SELECT holder, tenant, name, period, start, micros FROM period_spend",
            vec![],
        ),
        read: |r| {
            let holder = Holder::parse(&r.text(0)?);
            let period = Period::parse(&r.text(3)?);
            let (Some(holder), Some(period)) = (holder, period) else {
                return Ok(None);
            };
            Ok(Some(PeriodSpend {
                holder,
                tenant: r.text(1)?,
                name: r.text(2)?,
                period,
                window: Window {
                    start: r.int(4)?,
                    micros: r.int(5)?,
                },
            }))
        },
    }
}

/// The spend the ledger rows `written` add: lifetime spend per tenant, key and user, then
/// each holder's period windows ([`period_increments`]), in the order Postgres locks
/// rows (tenants, then keys, each in name order, as the budget holds lock them). Rows
/// of no cost add nothing.
pub fn add_spend(written: &[UsageEvent]) -> Vec<Stmt<'_>> {
    let mut tenants: BTreeMap<&str, i64> = BTreeMap::new();
    let mut keys: BTreeMap<&str, i64> = BTreeMap::new();
    let mut users: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for e in written.iter().filter(|e| e.cost_micros != 0) {
        *tenants.entry(e.tenant.as_str()).or_default() += e.cost_micros;
        *keys.entry(e.key_id.as_str()).or_default() += e.cost_micros;
        if !e.user.is_empty() {
            *users
                .entry((e.tenant.as_str(), e.user.as_str()))
                .or_default() += e.cost_micros;
        }
    }
    let tenants = tenants.into_iter().map(|(name, cost)| {
        Stmt::new(
            "INSERT INTO tenants (name, spend_micros) VALUES ($1, $2) \
             ON CONFLICT (name) DO UPDATE SET spend_micros = tenants.spend_micros + $2",
            vec![name.into(), cost.into()],
        )
    });
    let keys = keys.into_iter().map(|(id, cost)| {
        Stmt::new(
            "UPDATE api_keys SET spend_micros = spend_micros + $2 WHERE id = $1",
            vec![id.into(), cost.into()],
        )
    });
    let users = users.into_iter().map(|((tenant, name), cost)| {
        Stmt::new(
            "INSERT INTO users (tenant, name, spend_micros) VALUES ($1, $2, $3) \
             ON CONFLICT (tenant, name) DO UPDATE SET spend_micros = users.spend_micros + $3",
            vec![tenant.into(), name.into(), cost.into()],
        )
    });
    let windows = period_increments(written).into_iter().map(add_to_window);
    tenants.chain(keys).chain(users).chain(windows).collect()
}

/// Adds to a holder's window: to its sum when the window is the stored one, replacing it
/// when newer; a row of an older window (a late batch) leaves it as it is.
fn add_to_window<'a>(w: PeriodSpend) -> Stmt<'a> {
    Stmt::new(
        "INSERT INTO period_spend (holder, tenant, name, period, start, micros) \
         VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (holder, tenant, name, period) DO UPDATE SET \
         micros = CASE WHEN excluded.start = period_spend.start \
                         THEN period_spend.micros + excluded.micros \
                       WHEN excluded.start > period_spend.start THEN excluded.micros \
                       ELSE period_spend.micros END, \
         start = CASE WHEN excluded.start > period_spend.start THEN excluded.start \
                      ELSE period_spend.start END",
        vec![
            w.holder.as_str().into(),
            w.tenant.into(),
            w.name.into(),
            w.period.as_str().into(),
            w.window.start.into(),
            w.window.micros.into(),
        ],
    )
}

/// Ledger rows summed per tenant, key, user and model, filtered.
pub fn usage(f: &UsageFilter) -> Query<'_, UsageRow> {
    Query {
        stmt: Stmt::new(
            "SELECT tenant, key_id, model, CAST(COUNT(*) AS BIGINT), \
             CAST(COALESCE(SUM(input_tokens), 0) AS BIGINT), \
             CAST(COALESCE(SUM(output_tokens), 0) AS BIGINT), \
             CAST(COALESCE(SUM(cost_micros), 0) AS BIGINT), user_name FROM usage \
             WHERE (CAST($1 AS TEXT) IS NULL OR tenant = $1) \
               AND (CAST($2 AS TEXT) IS NULL OR key_id = $2) \
               AND (CAST($3 AS BIGINT) IS NULL OR ts >= $3) \
               AND (CAST($4 AS TEXT) IS NULL OR user_name = $4) \
             GROUP BY tenant, key_id, user_name, model \
             ORDER BY tenant, key_id, user_name, model",
            vec![
                f.tenant.as_deref().into(),
                f.key_id.as_deref().into(),
                f.since.into(),
                f.user.as_deref().into(),
            ],
        ),
        read: |r| {
            let cost = r.int(6)?;
            Ok(UsageRow {
                tenant: r.text(0)?,
                key_id: r.text(1)?,
                user: r.text(7)?,
                model: r.text(2)?,
                requests: opt_u64(r.opt_int(3)?).unwrap_or(0),
                input_tokens: opt_u64(r.opt_int(4)?).unwrap_or(0),
                output_tokens: opt_u64(r.opt_int(5)?).unwrap_or(0),
                cost_micros: cost,
                cost_usd: cost as f64 / 1e6,
            })
        },
    }
}

pub fn audit(e: &AuditEntry) -> Stmt<'_> {
    Stmt::new(
        "INSERT INTO audit (ts, actor, action, target, detail) VALUES ($1, $2, $3, $4, $5)",
        vec![
            e.ts.into(),
            (&e.actor).into(),
            (&e.action).into(),
            (&e.target).into(),
            (&e.detail).into(),
        ],
    )
}

/// The newest `limit` audit entries, newest first.
pub fn list_audit(limit: u32) -> Query<'static, AuditEntry> {
    Query {
        stmt: Stmt::new(
            "SELECT ts, actor, action, target, detail FROM audit ORDER BY id DESC LIMIT $1",
            vec![i64::from(limit).into()],
        ),
        read: |r| {
            Ok(AuditEntry {
                ts: r.int(0)?,
                actor: r.text(1)?,
                action: r.text(2)?,
                target: r.text(3)?,
                detail: r.text(4)?,
            })
        },
    }
}

/// Drops the tenant's expired responses, then keeps `r` (replacing one of its id).
pub fn put_response(r: &StoredResponse) -> [Stmt<'_>; 2] {
    [
        Stmt::new(
            "DELETE FROM responses WHERE tenant = $1 AND expires_at <= $2",
            vec![(&r.tenant).into(), r.created_at.into()],
        ),
        Stmt::new(
            "INSERT INTO responses (tenant, id, created_at, expires_at, body, conversation) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (tenant, id) DO UPDATE SET created_at = excluded.created_at, \
             expires_at = excluded.expires_at, body = excluded.body, \
             conversation = excluded.conversation",
            vec![
                (&r.tenant).into(),
                (&r.id).into(),
                r.created_at.into(),
                r.expires_at.into(),
                (&r.body).into(),
                (&r.conversation).into(),
            ],
        ),
    ]
}

/// The tenant's response `id` unless expired at `now`.
pub fn get_response<'a>(tenant: &'a str, id: &'a str, now: i64) -> Query<'a, StoredResponse> {
    Query {
        stmt: Stmt::new(
            "SELECT tenant, id, created_at, expires_at, body, conversation FROM responses \
             WHERE tenant = $1 AND id = $2 AND expires_at > $3",
            vec![tenant.into(), id.into(), now.into()],
        ),
        read: |r| {
            Ok(StoredResponse {
                tenant: r.text(0)?,
                id: r.text(1)?,
                created_at: r.int(2)?,
                expires_at: r.int(3)?,
                body: r.text(4)?,
                conversation: r.text(5)?,
            })
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The placeholders `$1` to `$n` a statement's text names, each at least once.
    fn placeholders(sql: &str) -> Vec<usize> {
        let mut found: Vec<usize> = sql
            .split('$')
            .skip(1)
            .map(|rest| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().expect("a `$` is only ever a placeholder")
            })
            .collect();
        found.sort_unstable();
        found.dedup();
        found
    }

    #[test]
    fn every_statement_binds_one_value_per_placeholder() {
        let key = KeyRecord {
            id: "k".into(),
            tenant: "t".into(),
            name: "n".into(),
            salt_hex: "00".into(),
            hash_hex: "11".into(),
            allowed_models: vec![],
            limits: RateLimits::default(),
            budget_micros: None,
            budget_period: None,
            spend_micros: 0,
            created_at: 1,
            revoked_at: None,
            user: None,
            role: Role::Member,
        };
        let event = UsageEvent {
            id: String::new(),
            ts: 10,
            key_id: "k".into(),
            tenant: "t".into(),
            user: "u".into(),
            model: "m".into(),
            upstream: "up".into(),
            input_tokens: 1,
            output_tokens: 1,
            cost_micros: 5,
            cached: false,
            status: 200,
        };
        let audit_entry = AuditEntry {
            ts: 1,
            actor: "a".into(),
            action: "x".into(),
            target: "t".into(),
            detail: "{}".into(),
        };
        let response = StoredResponse {
            tenant: "t".into(),
            id: "r".into(),
            created_at: 1,
            expires_at: 2,
            body: "{}".into(),
            conversation: "[]".into(),
        };
        let filter = UsageFilter::default();
        let budget = (Some(1), Some(Period::Daily));
        let mut all: Vec<Stmt<'_>> = insert_key(&key).unwrap().into();
        all.extend([
            list_keys().stmt,
            get_key("k").stmt,
            revoke_key("k", 1),
            update_key("k", RateLimits::default(), budget, &[]).unwrap(),
            upsert_tenant("t", RateLimits::default(), budget),
            list_tenants().stmt,
            upsert_user("t", "u", budget),
            list_users().stmt,
            list_period_spend().stmt,
            usage(&filter).stmt,
            audit(&audit_entry),
            list_audit(5).stmt,
            get_response("t", "r", 1).stmt,
        ]);
        all.extend(put_response(&response));
        let events = [event];
        let spend = add_spend(&events);
        // A tenant, a key, a user, and each holder's window per period.
        assert_eq!(spend.len(), 3 + 3 * Period::ALL.len());
        all.extend(spend);
        for s in &all {
            let want: Vec<usize> = (1..=s.values.len()).collect();
            assert_eq!(placeholders(s.sql), want, "{}", s.sql);
        }
    }
}
