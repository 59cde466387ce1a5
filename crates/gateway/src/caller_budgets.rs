//! Which budgets apply to a caller (its key's, its user's, its tenant's: stored values
//! over `gateway.yaml`'s) and whether one is spent, read from the gateway's live mirror of
//! spend at the gateway's clock. The policy itself is [`crate::budget`].

use crate::budget::{Budget, Spend};
use crate::state::{usd_to_micros, Gateway, KeyEntry};

impl Gateway {
    /// The budgets that apply to a key: its own and its tenant's (stored overrides the
    /// config); `None` is unlimited.
    pub fn budgets(&self, key: &KeyEntry) -> (Option<Budget>, Option<Budget>) {
        let own = key.record.budget_micros.map(|b| Budget {
            limit_micros: b,
            period: key.record.budget_period,
        });
        (own, self.tenant_budget(&key.record.tenant))
    }

    /// A tenant's budget: the stored one, else `gateway.yaml`'s.
    pub fn tenant_budget(&self, tenant: &str) -> Option<Budget> {
        let stored = self.tenants.read().get(tenant).and_then(|t| {
            t.record.budget_micros.map(|b| Budget {
                limit_micros: b,
                period: t.record.budget_period,
            })
        });
        stored.or_else(|| {
            let resolved = self.config.get();
            let t = resolved.tenants.get(tenant)?;
            t.budget_usd.map(|b| Budget {
                limit_micros: usd_to_micros(b),
                period: t.budget_period,
            })
        })
    }

    /// A user's budget: the stored one, else the tenant's `user_budget_usd` in
    /// `gateway.yaml`.
    pub fn user_budget(&self, tenant: &str, user: &str) -> Option<Budget> {
        let id = (tenant.to_string(), user.to_string());
        let stored = self.users.read().get(&id).and_then(|u| {
            u.record.budget_micros.map(|b| Budget {
                limit_micros: b,
                period: u.record.budget_period,
            })
        });
        stored.or_else(|| {
            let resolved = self.config.get();
            let t = resolved.tenants.get(tenant)?;
            t.user_budget_usd.map(|b| Budget {
                limit_micros: usd_to_micros(b),
                period: t.user_budget_period,
            })
        })
    }

    /// Live spend of a tenant and of a user (zero when never seen).
    pub fn tenant_spend(&self, tenant: &str) -> Spend {
        self.tenants
            .read()
            .get(tenant)
            .map(|t| *t.spend.lock())
            .unwrap_or_default()
    }

    pub fn user_spend(&self, tenant: &str, user: &str) -> Spend {
        self.users
            .read()
            .get(&(tenant.to_string(), user.to_string()))
            .map(|u| *u.spend.lock())
            .unwrap_or_default()
    }

    /// `Some(message)` when the key's, its user's or its tenant's budget is spent in its
    /// current period (at the gateway's clock).
    pub fn budget_exhausted(&self, key: &KeyEntry) -> Option<String> {
        let now = self.now();
        let (own, tenant) = self.budgets(key);
        if let Some(b) = own {
            let spend = *key.spend.lock();
            if let Some(e) = crate::budget::exhausted(b, &spend, now) {
                let who = format!("API key {}", key.record.id);
                return Some(crate::budget::describe(&who, &e, b.period));
            }
        }
        if let Some(user) = &key.record.user {
            if let Some(b) = self.user_budget(&key.record.tenant, user) {
                let spend = self.user_spend(&key.record.tenant, user);
                if let Some(e) = crate::budget::exhausted(b, &spend, now) {
                    let who = format!("user `{user}` of tenant `{}`", key.record.tenant);
                    return Some(crate::budget::describe(&who, &e, b.period));
                }
            }
        }
        if let Some(b) = tenant {
            let spend = self.tenant_spend(&key.record.tenant);
            if let Some(e) = crate::budget::exhausted(b, &spend, now) {
                let who = format!("tenant `{}`", key.record.tenant);
                return Some(crate::budget::describe(&who, &e, b.period));
            }
        }
        None
    }
}
