//! Persistent state: tenants, keys, budgets, the usage ledger and the admin audit log.
//!
//! [`Store`] is a synchronous trait with two implementations: the embedded SQLite one
//! ([`sqlite::SqliteStore`], the default, one gateway) and PostgreSQL
//! ([`postgres::PgStore`], several gateway replicas sharing one truth). Both are a
//! [`backend::SqlStore`]: the statements and row readings are written once
//! (`queries.rs`, in [`stmt`]'s terms), and each backend says how it runs them. Callers on async
//! paths use it from `spawn_blocking` or from the usage writer thread. Keys and spend are
//! mirrored in memory by [`crate::state`]; the request path waits on the store only to
//! hold budget in a shared store ([`Store::hold_budget`]).
//!
//! Money is integer micro-dollars (1e-6 USD) everywhere, so sums never drift.

pub mod backend;
pub mod postgres;
mod queries;
pub mod responses;
pub mod sqlite;
pub mod stmt;

pub use responses::StoredResponse;

use serde::{Deserialize, Serialize};

use crate::budget::{Period, Window};
use crate::config::RateLimits;
use crate::role::Role;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(#[from] rusqlite::Error),
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// The store could not be reached in time (connect failure, timeout, shut down).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("stored value is corrupt: {0}")]
    Corrupt(String),
    #[error("database schema version {found} is newer than this build knows ({known})")]
    TooNew { found: i64, known: i64 },
}

/// One API key as stored (never the secret itself).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyRecord {
    pub id: String,
    pub tenant: String,
    pub name: String,
    #[serde(skip_serializing)]
    pub salt_hex: String,
    #[serde(skip_serializing)]
    pub hash_hex: String,
    /// Public model names this key may use; empty means all the tenant may use.
    pub allowed_models: Vec<String>,
    pub limits: RateLimits,
    pub budget_micros: Option<i64>,
    /// How often the key's budget resets (`None`: a lifetime cap).
    #[serde(default)]
    pub budget_period: Option<Period>,
    /// Lifetime spend.
    pub spend_micros: i64,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
    /// The user the key belongs to (whose user budget it also spends); `None`: no user.
    #[serde(default)]
    pub user: Option<String>,
    /// `member`, or `tenant_admin` for a key that may manage its own tenant.
    #[serde(default)]
    pub role: Role,
}

/// A tenant's stored overrides and spend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantRecord {
    pub name: String,
    pub limits: RateLimits,
    pub budget_micros: Option<i64>,
    /// How often the stored budget resets (`None`: a lifetime cap).
    #[serde(default)]
    pub budget_period: Option<Period>,
    /// Lifetime spend.
    pub spend_micros: i64,
}

/// A user of a tenant (an API key's `user`, or a JWT's user claim) with a stored budget
/// and lifetime spend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UserRecord {
    pub tenant: String,
    pub name: String,
    pub budget_micros: Option<i64>,
    #[serde(default)]
    pub budget_period: Option<Period>,
    pub spend_micros: i64,
}

/// What a spend window belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Holder {
    Tenant,
    Key,
    User,
}

impl Holder {
    pub fn as_str(self) -> &'static str {
        match self {
            Holder::Tenant => "tenant",
            Holder::Key => "key",
            Holder::User => "user",
        }
    }

    pub fn parse(s: &str) -> Option<Holder> {
        [Holder::Tenant, Holder::Key, Holder::User]
            .into_iter()
            .find(|h| h.as_str() == s)
    }
}

/// One holder's spend in one period window, as stored. `name` is the key id, the user,
/// or empty for the tenant itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeriodSpend {
    pub holder: Holder,
    pub tenant: String,
    pub name: String,
    pub period: Period,
    pub window: Window,
}

/// The period windows a batch of ledger rows adds to: per holder and window, the sum, in
/// order of window start (so a newer window replaces an older one last).
pub fn period_increments(events: &[UsageEvent]) -> Vec<PeriodSpend> {
    let mut sums: std::collections::BTreeMap<(i64, Holder, String, String, Period), i64> =
        std::collections::BTreeMap::new();
    for e in events.iter().filter(|e| e.cost_micros != 0) {
        let mut holders = vec![(Holder::Tenant, String::new())];
        if !e.key_id.is_empty() {
            holders.push((Holder::Key, e.key_id.clone()));
        }
        if !e.user.is_empty() {
            holders.push((Holder::User, e.user.clone()));
        }
        for p in Period::ALL {
            let start = p.start(e.ts);
            for (h, name) in &holders {
                *sums
                    .entry((start, *h, e.tenant.clone(), name.clone(), p))
                    .or_default() += e.cost_micros;
            }
        }
    }
    sums.into_iter()
        .map(
            |((start, holder, tenant, name, period), micros)| PeriodSpend {
                holder,
                tenant,
                name,
                period,
                window: Window { start, micros },
            },
        )
        .collect()
}

/// One served (or cached) request, for the ledger.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageEvent {
    /// Unique per request (empty when unknown). A shared store writes a row at most once
    /// per id, so a batch retried after an unclear commit is not counted twice, and
    /// releases the budget hold of the same id in the same transaction.
    #[serde(default)]
    pub id: String,
    pub ts: i64,
    pub key_id: String,
    pub tenant: String,
    /// The user charged besides the key and tenant (empty: none).
    #[serde(default)]
    pub user: String,
    pub model: String,
    pub upstream: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_micros: i64,
    pub cached: bool,
    pub status: u16,
}

/// Usage summed per tenant, key and model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRow {
    pub tenant: String,
    pub key_id: String,
    /// Empty for requests of no user.
    #[serde(default)]
    pub user: String,
    pub model: String,
    pub requests: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_micros: i64,
    pub cost_usd: f64,
}

/// One admin action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    pub ts: i64,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub detail: String,
}

/// Filter for [`Store::usage`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UsageFilter {
    pub tenant: Option<String>,
    pub key_id: Option<String>,
    pub user: Option<String>,
    /// Unix seconds; rows at or after.
    pub since: Option<i64>,
}

/// A request's claim on its key's and tenant's budgets while it runs (shared stores).
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetHold {
    /// The request's ledger id ([`UsageEvent::id`]); its ledger row releases the hold.
    pub id: String,
    pub tenant: String,
    pub key_id: String,
    /// The estimated cost, held until the real cost is recorded.
    pub amount_micros: i64,
    /// The effective budgets (`None`: unlimited) with their periods (`None`: lifetime).
    pub tenant_budget_micros: Option<i64>,
    pub key_budget_micros: Option<i64>,
    pub tenant_period: Option<Period>,
    pub key_period: Option<Period>,
    /// The user charged (empty: none), with that user's budget and period.
    pub user: String,
    pub user_budget_micros: Option<i64>,
    pub user_period: Option<Period>,
    /// Unix seconds now, and when the hold lapses if its request never settles (a
    /// crashed gateway).
    pub now: i64,
    pub expires_at: i64,
}

/// The answer to [`Store::hold_budget`].
#[derive(Debug, Clone, PartialEq)]
pub enum HoldOutcome {
    Held,
    /// A budget is spent: spend plus other requests' holds reached it.
    Spent {
        /// Whose budget: the key's, the user's or the tenant's.
        holder: Holder,
        spent_micros: i64,
        budget_micros: i64,
    },
}

/// Persistence for everything the gateway must remember across restarts.
pub trait Store: Send + Sync {
    fn insert_key(&self, key: &KeyRecord) -> Result<(), StoreError>;
    fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError>;
    fn get_key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError>;
    /// Marks a key revoked; false when no such key (or already revoked).
    fn revoke_key(&self, id: &str, now: i64) -> Result<bool, StoreError>;
    /// Sets a key's limits, budget (and its period) and model list; false when no such key.
    fn update_key(
        &self,
        id: &str,
        limits: RateLimits,
        budget: (Option<i64>, Option<Period>),
        allowed_models: &[String],
    ) -> Result<bool, StoreError>;
    fn upsert_tenant(
        &self,
        name: &str,
        limits: RateLimits,
        budget: (Option<i64>, Option<Period>),
    ) -> Result<(), StoreError>;
    fn list_tenants(&self) -> Result<Vec<TenantRecord>, StoreError>;
    /// Sets a user's budget and its period (creating the user).
    fn upsert_user(
        &self,
        tenant: &str,
        name: &str,
        budget: (Option<i64>, Option<Period>),
    ) -> Result<(), StoreError>;
    fn list_users(&self) -> Result<Vec<UserRecord>, StoreError>;
    /// Every holder's current spend windows.
    fn list_period_spend(&self) -> Result<Vec<PeriodSpend>, StoreError>;
    /// Appends ledger rows and adds their cost to key, tenant and user spend (lifetime and
    /// per period window, [`period_increments`]), atomically.
    fn record_usage(&self, events: &[UsageEvent]) -> Result<(), StoreError>;
    fn usage(&self, filter: &UsageFilter) -> Result<Vec<UsageRow>, StoreError>;
    fn audit(&self, entry: &AuditEntry) -> Result<(), StoreError>;
    fn list_audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError>;

    /// True when several gateways may share this store: budgets are then held here
    /// ([`Store::hold_budget`]) rather than checked against one process's memory.
    fn shares_budgets(&self) -> bool {
        false
    }

    /// Atomically: admits when neither budget is reached by stored spend plus live holds,
    /// and then records the hold. A store used by one gateway has nothing to add to the
    /// in-memory check and admits.
    fn hold_budget(&self, _hold: &BudgetHold) -> Result<HoldOutcome, StoreError> {
        Ok(HoldOutcome::Held)
    }

    /// Drops a hold whose request was refused after it was taken.
    fn release_hold(&self, _id: &str) -> Result<(), StoreError> {
        Ok(())
    }

    /// Keeps a Responses API response (`store: true`) until its `expires_at`, replacing
    /// one of the same tenant and id, and drops the tenant's expired ones
    /// ([`responses`]).
    fn put_response(&self, _r: &StoredResponse) -> Result<(), StoreError> {
        Err(StoreError::Unavailable(
            "this store keeps no responses".into(),
        ))
    }

    /// The tenant's response `id` when kept and not expired at `now`.
    fn get_response(
        &self,
        _tenant: &str,
        _id: &str,
        _now: i64,
    ) -> Result<Option<StoredResponse>, StoreError> {
        Ok(None)
    }
}
