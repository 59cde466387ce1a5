//! Who is calling: an API key (`sk-strata-...`), a JWT bearer token verified against the
//! operator's keys ([`jwt`], configured in [`config`]), or the admin key. Each gives a
//! [`Caller`]: the accounting entry the request path charges (a key, or one made per JWT
//! tenant and user), the caller's role for the admin API, and the name the audit log
//! gives it.

pub mod config;
pub mod jwks;
pub mod jwt;

use std::sync::Arc;

use axum::http::HeaderMap;

use crate::keys;
pub use crate::role::Role;
use crate::state::{Gateway, KeyEntry};

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    /// What the request path checks and charges: limits, budgets, model lists, tenant.
    pub key: Arc<KeyEntry>,
    pub role: Role,
    /// How the audit log names the caller: `key:<id> (role)` or `jwt:<subject> (role)`.
    pub actor: String,
}

impl Caller {
    pub fn tenant(&self) -> &str {
        &self.key.record.tenant
    }
}

/// Why a caller was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    /// No credential in `Authorization: Bearer` or `x-api-key`.
    Missing,
    /// A key that is malformed, unknown, wrong or revoked (or a token when no JWT is
    /// configured).
    BadKey,
    /// A JWT that does not verify; the reason is safe to show.
    BadToken(String),
}

/// True when `presented` is shaped like a JWT (three base64url parts).
fn looks_like_jwt(presented: &str) -> bool {
    presented.split('.').count() == 3
        && presented
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'='))
}

/// The caller a request's headers name: an API key, or a JWT when `auth.jwt` is set.
pub async fn authenticate(gw: &Gateway, headers: &HeaderMap) -> Result<Caller, AuthError> {
    let presented = keys::from_headers(headers).ok_or(AuthError::Missing)?;
    authenticate_token(gw, presented).await
}

/// The caller a presented credential names (see [`authenticate`]).
pub async fn authenticate_token(gw: &Gateway, presented: &str) -> Result<Caller, AuthError> {
    if keys::parse(presented).is_some() {
        let key = gw.authenticate(presented).ok_or(AuthError::BadKey)?;
        let role = key.record.role;
        return Ok(Caller {
            actor: format!("key:{} ({})", key.record.id, role.as_str()),
            role,
            key,
        });
    }
    match &gw.jwt {
        Some(verifier) if looks_like_jwt(presented) => {
            let who = verifier
                .verify(presented)
                .await
                .map_err(|e| AuthError::BadToken(e.0))?;
            Ok(Caller {
                actor: format!("jwt:{} ({})", who.subject, who.role.as_str()),
                role: who.role,
                key: gw.jwt_caller(&who),
            })
        }
        _ => Err(AuthError::BadKey),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jwt_shape() {
        assert!(looks_like_jwt("eyJh.eyJz.c2ln"));
        assert!(!looks_like_jwt("sk-strata-00-11"));
        assert!(!looks_like_jwt("a.b"));
        assert!(!looks_like_jwt("a.b.c d"));
    }
}
