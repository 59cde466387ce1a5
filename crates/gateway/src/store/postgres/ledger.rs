//! The ledger write: a batch of rows in one statement, each written at most once per
//! event id, so a batch retried after a commit whose answer was lost adds nothing twice.
//! Only the rows written add to spend, and they release their requests' budget holds
//! in the same transaction.

use tokio_postgres::{Client, Transaction};

use super::{values, Postgres};
use crate::store::queries::{self, to_i64};
use crate::store::{StoreError, UsageEvent};

impl Postgres {
    /// [`crate::store::Store::record_usage`] for a batch of at least one row.
    pub(super) fn write_ledger(&self, events: &[UsageEvent]) -> Result<(), StoreError> {
        let events = events.to_vec();
        self.call(move |inner| {
            Box::pin(async move {
                let batch = Columns::of(&events);
                with_conn!(inner, |c| {
                    let tx = c.transaction().await?;
                    let written = batch.insert(&tx).await?;
                    for s in queries::add_spend(&written) {
                        tx.execute(s.sql, &values(&s)).await?;
                    }
                    release_holds(&tx, &events).await?;
                    tx.commit().await?;
                    Ok(())
                })
            })
        })
    }
}

/// A batch of ledger rows as the columns `unnest` takes.
struct Columns<'a> {
    /// `None` for a row of no id (never a duplicate).
    ids: Vec<Option<&'a str>>,
    ts: Vec<i64>,
    key_ids: Vec<&'a str>,
    tenants: Vec<&'a str>,
    models: Vec<&'a str>,
    upstreams: Vec<&'a str>,
    input: Vec<i64>,
    output: Vec<i64>,
    cost: Vec<i64>,
    cached: Vec<bool>,
    status: Vec<i32>,
    users: Vec<&'a str>,
}

impl<'a> Columns<'a> {
    fn of(events: &'a [UsageEvent]) -> Columns<'a> {
        Columns {
            ids: events
                .iter()
                .map(|e| (!e.id.is_empty()).then_some(e.id.as_str()))
                .collect(),
            ts: events.iter().map(|e| e.ts).collect(),
            key_ids: events.iter().map(|e| e.key_id.as_str()).collect(),
            tenants: events.iter().map(|e| e.tenant.as_str()).collect(),
            models: events.iter().map(|e| e.model.as_str()).collect(),
            upstreams: events.iter().map(|e| e.upstream.as_str()).collect(),
            input: events.iter().map(|e| to_i64(e.input_tokens)).collect(),
            output: events.iter().map(|e| to_i64(e.output_tokens)).collect(),
            cost: events.iter().map(|e| e.cost_micros).collect(),
            cached: events.iter().map(|e| e.cached).collect(),
            status: events.iter().map(|e| i32::from(e.status)).collect(),
            users: events.iter().map(|e| e.user.as_str()).collect(),
        }
    }

    /// Inserts the rows in one statement; only rows not seen before come back, as much
    /// of each as its spend needs (tenant, key, user, time and cost).
    async fn insert(&self, tx: &Transaction<'_>) -> Result<Vec<UsageEvent>, StoreError> {
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
                    &self.ids,
                    &self.ts,
                    &self.key_ids,
                    &self.tenants,
                    &self.models,
                    &self.upstreams,
                    &self.input,
                    &self.output,
                    &self.cost,
                    &self.cached,
                    &self.status,
                    &self.users,
                ],
            )
            .await?;
        inserted
            .iter()
            .map(|r| {
                Ok(UsageEvent {
                    id: String::new(),
                    ts: r.try_get(3)?,
                    key_id: r.try_get(0)?,
                    tenant: r.try_get(1)?,
                    user: r.try_get(4)?,
                    model: String::new(),
                    upstream: String::new(),
                    input_tokens: 0,
                    output_tokens: 0,
                    cost_micros: r.try_get(2)?,
                    cached: false,
                    status: 0,
                })
            })
            .collect()
    }
}

/// Drops the holds of the batch's requests (their cost is now spend), and every hold
/// expired by the batch's newest row (a gateway that crashed never settles its own).
async fn release_holds(tx: &Transaction<'_>, events: &[UsageEvent]) -> Result<(), StoreError> {
    let hold_ids: Vec<&str> = events
        .iter()
        .filter(|e| !e.id.is_empty())
        .map(|e| e.id.as_str())
        .collect();
    if !hold_ids.is_empty() {
        tx.execute("DELETE FROM budget_holds WHERE id = ANY($1)", &[&hold_ids])
            .await?;
    }
    let now = events.iter().map(|e| e.ts).max().unwrap_or(0);
    tx.execute("DELETE FROM budget_holds WHERE expires_at <= $1", &[&now])
        .await?;
    Ok(())
}
