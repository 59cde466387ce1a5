//! The [`Store`] both SQL databases share: [`SqlStore`] runs the shared statements
//! (`queries.rs`) on a [`Backend`], which says only how a statement runs there
//! (its connection, transaction and retries) and writes what differs in kind: the
//! ledger rows and, in a store several gateways share, the budget holds.

use super::queries;
use super::stmt::{Query, Stmt};
use super::{
    AuditEntry, BudgetHold, HoldOutcome, KeyRecord, PeriodSpend, Store, StoreError, StoredResponse,
    TenantRecord, UsageEvent, UsageFilter, UsageRow, UserRecord,
};
use crate::budget::Period;
use crate::config::RateLimits;

/// How one database runs statements, and what it writes its own way.
pub trait Backend: Send + Sync {
    /// Runs `stmts` in order on one connection, each on its own; the rows they changed.
    fn execute(&self, stmts: &[Stmt<'_>]) -> Result<u64, StoreError>;

    /// Runs `stmts` in order in one transaction: all of them or none.
    fn execute_atomic(&self, stmts: &[Stmt<'_>]) -> Result<(), StoreError>;

    /// The rows of a query, each read by the query's reader.
    fn query<T: Send + 'static>(&self, query: Query<'_, T>) -> Result<Vec<T>, StoreError>;

    /// [`Store::record_usage`] for a batch of at least one row. Each backend inserts
    /// the ledger rows its own way and adds their spend with `queries::add_spend`.
    fn record_usage(&self, events: &[UsageEvent]) -> Result<(), StoreError>;

    /// [`Store::shares_budgets`].
    fn shares_budgets(&self) -> bool {
        false
    }

    /// [`Store::hold_budget`]: a store of one gateway has nothing to add to the
    /// in-memory check and admits.
    fn hold_budget(&self, _hold: &BudgetHold) -> Result<HoldOutcome, StoreError> {
        Ok(HoldOutcome::Held)
    }

    /// [`Store::release_hold`].
    fn release_hold(&self, _id: &str) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A [`Store`] in a SQL database ([`super::sqlite::SqliteStore`],
/// [`super::postgres::PgStore`]).
pub struct SqlStore<B> {
    pub(super) db: B,
}

impl<B: Backend> Store for SqlStore<B> {
    fn insert_key(&self, key: &KeyRecord) -> Result<(), StoreError> {
        self.db.execute_atomic(&queries::insert_key(key)?)
    }

    fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        self.db.query(queries::list_keys())
    }

    fn get_key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.db.query(queries::get_key(id))?.pop())
    }

    fn revoke_key(&self, id: &str, now: i64) -> Result<bool, StoreError> {
        Ok(self.db.execute(&[queries::revoke_key(id, now)])? > 0)
    }

    fn update_key(
        &self,
        id: &str,
        limits: RateLimits,
        budget: (Option<i64>, Option<Period>),
        allowed_models: &[String],
    ) -> Result<bool, StoreError> {
        let stmt = queries::update_key(id, limits, budget, allowed_models)?;
        Ok(self.db.execute(&[stmt])? > 0)
    }

    fn upsert_tenant(
        &self,
        name: &str,
        limits: RateLimits,
        budget: (Option<i64>, Option<Period>),
    ) -> Result<(), StoreError> {
        self.db
            .execute(&[queries::upsert_tenant(name, limits, budget)])?;
        Ok(())
    }

    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        self.db.query(queries::list_tenants())
    }

    fn upsert_user(
        &self,
        tenant: &str,
        name: &str,
        budget: (Option<i64>, Option<Period>),
    ) -> Result<(), StoreError> {
        self.db
            .execute(&[queries::upsert_user(tenant, name, budget)])?;
        Ok(())
    }

    fn list_users(&self) -> Result<Vec<UserRecord>, StoreError> {
        self.db.query(queries::list_users())
    }

    fn list_period_spend(&self) -> Result<Vec<PeriodSpend>, StoreError> {
        let windows = self.db.query(queries::list_period_spend())?;
        Ok(windows.into_iter().flatten().collect())
    }

    fn record_usage(&self, events: &[UsageEvent]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        self.db.record_usage(events)
    }

    fn usage(&self, filter: &UsageFilter) -> Result<Vec<UsageRow>, StoreError> {
        self.db.query(queries::usage(filter))
    }

    fn audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        self.db.execute(&[queries::audit(entry)])?;
        Ok(())
    }

    fn list_audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        self.db.query(queries::list_audit(limit))
    }

    fn shares_budgets(&self) -> bool {
        self.db.shares_budgets()
    }

    fn hold_budget(&self, hold: &BudgetHold) -> Result<HoldOutcome, StoreError> {
        self.db.hold_budget(hold)
    }

    fn release_hold(&self, id: &str) -> Result<(), StoreError> {
        self.db.release_hold(id)
    }

    fn put_response(&self, r: &StoredResponse) -> Result<(), StoreError> {
        self.db.execute(&queries::put_response(r))?;
        Ok(())
    }

    fn get_response(
        &self,
        tenant: &str,
        id: &str,
        now: i64,
    ) -> Result<Option<StoredResponse>, StoreError> {
        Ok(self.db.query(queries::get_response(tenant, id, now))?.pop())
    }
}
