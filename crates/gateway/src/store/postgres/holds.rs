//! Budget holds: a request's estimated cost held against its key's, user's and tenant's
//! budgets while it runs, so that gateways sharing the store never admit together more
//! than a budget has left. Postgres only: a store of one gateway has its memory's check.

use tokio_postgres::Client;

use super::Postgres;
use crate::budget::Period;
use crate::store::{BudgetHold, HoldOutcome, Holder, StoreError};

impl Postgres {
    /// [`crate::store::Store::hold_budget`]: under the
    /// tenant's, the key's and the user's row locks, admits when no budget is reached by
    /// its spend plus the live holds, and then records the hold.
    pub(super) fn hold(&self, hold: &BudgetHold) -> Result<HoldOutcome, StoreError> {
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

    /// Drops a hold whose request was refused after it was taken.
    pub(super) fn release(&self, id: &str) -> Result<(), StoreError> {
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
