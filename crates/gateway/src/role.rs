//! Who may use the admin API: a caller's role (an API key's, a JWT's role claim, or the
//! admin key's).

use serde::{Deserialize, Serialize};

/// A caller's role.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything: every tenant's keys, budgets and usage, the audit log, reload. The admin
    /// key, or a JWT with the platform-admin role.
    PlatformAdmin,
    /// Their own tenant's keys (create, list, change, revoke), its users' budgets and its
    /// usage; nothing of another tenant's (403).
    TenantAdmin,
    /// Inference only; no admin API.
    #[default]
    Member,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::PlatformAdmin => "platform_admin",
            Role::TenantAdmin => "tenant_admin",
            Role::Member => "member",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        [Role::PlatformAdmin, Role::TenantAdmin, Role::Member]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}
