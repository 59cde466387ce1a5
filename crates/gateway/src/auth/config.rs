//! `auth:` in `gateway.yaml`: who may call besides API keys (JWT/OIDC bearer tokens) and
//! how a token's claims name the caller's tenant, user and role.
//!
//! ```yaml
//! auth:
//!   jwt:
//!     issuer: https://idp.example.com/realms/acme     # `iss` must equal this
//!     audience: [strata-gateway]                       # `aud` must contain one of these
//!     jwks_file: /etc/strata/jwks.json                 # or jwks_url (not both)
//!     jwks_url: https://idp.example.com/realms/acme/protocol/openid-connect/certs
//!     jwks_refresh_secs: 300
//!     algorithms: [RS256, ES256]                       # HS256 only with hs256_secret_env
//!     hs256_secret_env: GATEWAY_JWT_SECRET
//!     leeway_secs: 30
//!     claims: {tenant: tenant, user: sub, role: roles} # dotted paths allowed (realm_access.roles)
//!     roles: {platform_admin: platform_admin, tenant_admin: tenant_admin}
//!     default_tenant: null                             # tenant when the claim is absent
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The `auth:` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// JWT bearer tokens; API keys keep working beside them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt: Option<JwtConfig>,
}

/// Verification of JWT bearer tokens and the mapping of their claims.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// The issuer every token's `iss` must equal.
    pub issuer: String,
    /// Accepted audiences: a token's `aud` must name one of them.
    pub audience: Vec<String>,
    /// A JWKS document on disk, read at start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwks_file: Option<PathBuf>,
    /// A JWKS URL the gateway fetches (at first use, every `jwks_refresh_secs`, and for a
    /// token naming a key it does not know, at most every `jwks_min_refetch_secs`). Only
    /// this configured URL is ever fetched, never one named by a request or a token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwks_url: Option<String>,
    #[serde(default = "default_refresh_secs")]
    pub jwks_refresh_secs: u64,
    /// Shortest time between two fetches caused by tokens with an unknown `kid`.
    #[serde(default = "default_min_refetch_secs")]
    pub jwks_min_refetch_secs: u64,
    /// Signature algorithms accepted: `RS256`, `ES256`, and `HS256` (with
    /// `hs256_secret_env`). Anything else, `none` included, is refused at load.
    #[serde(default = "default_algorithms")]
    pub algorithms: Vec<String>,
    /// Environment variable holding the HS256 shared secret (read at start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hs256_secret_env: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`, in seconds.
    #[serde(default = "default_leeway_secs")]
    pub leeway_secs: u64,
    #[serde(default)]
    pub claims: ClaimNames,
    #[serde(default)]
    pub roles: RoleNames,
    /// The tenant of a token without the tenant claim; such a token is refused when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_tenant: Option<String>,
}

/// Which claims carry the tenant, the user and the role (dotted paths into nested objects).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimNames {
    #[serde(default = "default_tenant_claim")]
    pub tenant: String,
    #[serde(default = "default_user_claim")]
    pub user: String,
    /// A string or an array of strings.
    #[serde(default = "default_role_claim")]
    pub role: String,
}

impl Default for ClaimNames {
    fn default() -> Self {
        ClaimNames {
            tenant: default_tenant_claim(),
            user: default_user_claim(),
            role: default_role_claim(),
        }
    }
}

/// The role claim's values that make a caller a platform or a tenant admin (any other
/// value, or none, is a member).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleNames {
    #[serde(default = "default_platform_admin")]
    pub platform_admin: String,
    #[serde(default = "default_tenant_admin")]
    pub tenant_admin: String,
}

impl Default for RoleNames {
    fn default() -> Self {
        RoleNames {
            platform_admin: default_platform_admin(),
            tenant_admin: default_tenant_admin(),
        }
    }
}

fn default_refresh_secs() -> u64 {
    300
}
fn default_min_refetch_secs() -> u64 {
    10
}
fn default_algorithms() -> Vec<String> {
    vec!["RS256".into(), "ES256".into()]
}
fn default_leeway_secs() -> u64 {
    30
}
fn default_tenant_claim() -> String {
    "tenant".into()
}
fn default_user_claim() -> String {
    "sub".into()
}
fn default_role_claim() -> String {
    "roles".into()
}
fn default_platform_admin() -> String {
    "platform_admin".into()
}
fn default_tenant_admin() -> String {
    "tenant_admin".into()
}

/// The algorithms the gateway knows, by their JOSE names.
pub const KNOWN_ALGORITHMS: [&str; 3] = ["RS256", "ES256", "HS256"];

impl JwtConfig {
    /// Checks the section without reading files or the network: the first fault found.
    pub fn validate(&self) -> Result<(), String> {
        if self.issuer.trim().is_empty() {
            return Err("auth.jwt.issuer must be set".into());
        }
        if self.audience.is_empty() || self.audience.iter().any(|a| a.trim().is_empty()) {
            return Err("auth.jwt.audience must list at least one non-empty audience".into());
        }
        if self.algorithms.is_empty() {
            return Err("auth.jwt.algorithms must name at least one algorithm".into());
        }
        for a in &self.algorithms {
            if !KNOWN_ALGORITHMS.contains(&a.as_str()) {
                return Err(format!(
                    "auth.jwt.algorithms: unknown or refused algorithm `{a}` (allowed: RS256, ES256, HS256)"
                ));
            }
        }
        let hs = self.algorithms.iter().any(|a| a == "HS256");
        if hs && self.hs256_secret_env.is_none() {
            return Err(
                "auth.jwt.algorithms has HS256 but auth.jwt.hs256_secret_env is unset".into(),
            );
        }
        if !hs && self.hs256_secret_env.is_some() {
            return Err(
                "auth.jwt.hs256_secret_env is set but HS256 is not in auth.jwt.algorithms".into(),
            );
        }
        let asymmetric = self.algorithms.iter().any(|a| a != "HS256");
        match (&self.jwks_file, &self.jwks_url) {
            (Some(_), Some(_)) => {
                return Err("auth.jwt: give jwks_file or jwks_url, not both".into());
            }
            (None, None) if asymmetric => {
                return Err("auth.jwt: RS256/ES256 need jwks_file or jwks_url".into());
            }
            _ => {}
        }
        if let Some(url) = &self.jwks_url {
            let ok = url.starts_with("http://") || url.starts_with("https://");
            if !ok || url.parse::<reqwest::Url>().is_err() {
                return Err(format!(
                    "auth.jwt.jwks_url `{url}` is not an http:// or https:// URL"
                ));
            }
        }
        if self.jwks_refresh_secs == 0 {
            return Err("auth.jwt.jwks_refresh_secs must be > 0".into());
        }
        for (what, v) in [
            ("claims.tenant", &self.claims.tenant),
            ("claims.user", &self.claims.user),
            ("claims.role", &self.claims.role),
            ("roles.platform_admin", &self.roles.platform_admin),
            ("roles.tenant_admin", &self.roles.tenant_admin),
        ] {
            if v.trim().is_empty() {
                return Err(format!("auth.jwt.{what} must not be empty"));
            }
        }
        if self.roles.platform_admin == self.roles.tenant_admin {
            return Err("auth.jwt.roles: platform_admin and tenant_admin must differ".into());
        }
        if self
            .default_tenant
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err("auth.jwt.default_tenant must not be empty".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> JwtConfig {
        serde_yaml::from_str(
            "{issuer: https://idp.test, audience: [strata], jwks_file: /tmp/jwks.json}",
        )
        .unwrap()
    }

    #[test]
    fn defaults_and_faults() {
        let c = good();
        assert!(c.validate().is_ok());
        assert_eq!(c.algorithms, ["RS256", "ES256"]);
        assert_eq!(c.claims.user, "sub");
        let mut bad = good();
        bad.algorithms = vec!["none".into()];
        assert!(bad.validate().unwrap_err().contains("`none`"));
        let mut bad = good();
        bad.algorithms = vec!["HS256".into()];
        assert!(bad.validate().unwrap_err().contains("hs256_secret_env"));
        let mut bad = good();
        bad.jwks_url = Some("http://127.0.0.1:1/jwks".into());
        assert!(bad.validate().unwrap_err().contains("not both"));
        let mut bad = good();
        bad.jwks_file = None;
        assert!(bad.validate().unwrap_err().contains("need jwks_file"));
        let mut bad = good();
        bad.jwks_file = None;
        bad.jwks_url = Some("file:///etc/passwd".into());
        assert!(bad.validate().unwrap_err().contains("not an http"));
        let mut bad = good();
        bad.audience.clear();
        assert!(bad.validate().is_err());
        let mut bad = good();
        bad.issuer.clear();
        assert!(bad.validate().is_err());
        let mut hs = good();
        hs.jwks_file = None;
        hs.algorithms = vec!["HS256".into()];
        hs.hs256_secret_env = Some("X".into());
        assert!(hs.validate().is_ok(), "HS256 alone needs no JWKS");
        // TLS is in the default build: an https:// JWKS URL is accepted.
        let mut https = good();
        https.jwks_file = None;
        https.jwks_url = Some("https://idp.test/.well-known/jwks.json".into());
        assert!(https.validate().is_ok());
    }
}
