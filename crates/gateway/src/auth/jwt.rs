//! JWT bearer tokens: signature against the configured keys (a JWKS file, a JWKS URL
//! fetched and cached, or an HS256 secret from the environment), then `iss`, `aud`, `exp`
//! and `nbf`; the claims then name the caller's tenant, user and role.
//!
//! What a token cannot do: choose its algorithm beyond the configured list (`alg: none`
//! never parses as an algorithm), pick a key by URL (`jku`, `x5u` are ignored: keys come
//! only from the operator's JWKS), or verify with a symmetric key from a JWKS.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use parking_lot::{Mutex, RwLock};
use serde_json::Value;

use super::config::JwtConfig;
use super::jwks::{KeySet, MAX_JWKS_BYTES};
use crate::role::Role;

/// How long one JWKS fetch may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a token was refused (the text the client sees after "Invalid bearer token: ").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TokenError(pub String);

fn refuse(msg: impl Into<String>) -> TokenError {
    TokenError(msg.into())
}

/// A verified token's caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenIdentity {
    pub tenant: String,
    pub user: String,
    pub role: Role,
    /// The token's `sub` (the user claim when `sub` is absent).
    pub subject: String,
}

enum Source {
    /// The keys were read once, at start.
    Fixed,
    Url(String),
}

/// Verifies tokens against the configured keys; see the module doc.
pub struct JwtVerifier {
    cfg: JwtConfig,
    algorithms: Vec<Algorithm>,
    hs_key: Option<DecodingKey>,
    source: Source,
    keys: RwLock<Arc<KeySet>>,
    /// When the keys were last fetched (URL source).
    fetched: Mutex<Option<Instant>>,
    /// One fetch at a time.
    fetching: tokio::sync::Mutex<()>,
    http: reqwest::Client,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtVerifier")
            .field("issuer", &self.cfg.issuer)
            .field("algorithms", &self.algorithms)
            .finish_non_exhaustive()
    }
}

fn algorithm(name: &str) -> Option<Algorithm> {
    match name {
        "RS256" => Some(Algorithm::RS256),
        "ES256" => Some(Algorithm::ES256),
        "HS256" => Some(Algorithm::HS256),
        _ => None,
    }
}

impl JwtVerifier {
    /// Builds the verifier: reads the JWKS file and the HS256 secret now, so a bad file
    /// or a missing secret stops the gateway at start with a message saying which. A JWKS
    /// URL is fetched on first use and refreshed by [`JwtVerifier::refresh`].
    pub fn new(cfg: &JwtConfig, base_dir: Option<&Path>) -> Result<JwtVerifier, String> {
        cfg.validate()?;
        let secret = match &cfg.hs256_secret_env {
            Some(var) => Some(std::env::var(var).map_err(|_| {
                format!("auth.jwt.hs256_secret_env: environment variable `{var}` is not set")
            })?),
            None => None,
        };
        Self::with_secret(cfg, base_dir, secret.as_deref())
    }

    /// [`JwtVerifier::new`] with the HS256 secret given rather than read from the
    /// environment (`None` when HS256 is not configured).
    pub fn with_secret(
        cfg: &JwtConfig,
        base_dir: Option<&Path>,
        hs256_secret: Option<&str>,
    ) -> Result<JwtVerifier, String> {
        cfg.validate()?;
        let algorithms: Vec<Algorithm> =
            cfg.algorithms.iter().filter_map(|a| algorithm(a)).collect();
        let asymmetric: Vec<Algorithm> = algorithms
            .iter()
            .copied()
            .filter(|a| *a != Algorithm::HS256)
            .collect();
        let hs_key = match (algorithms.contains(&Algorithm::HS256), hs256_secret) {
            (false, _) => None,
            (true, None) => return Err("auth.jwt: HS256 needs a secret".into()),
            (true, Some(secret)) if secret.len() < 32 => {
                return Err("auth.jwt.hs256_secret_env: the secret is shorter than 32 bytes".into())
            }
            (true, Some(secret)) => Some(DecodingKey::from_secret(secret.as_bytes())),
        };
        let (source, keys) = match (&cfg.jwks_file, &cfg.jwks_url) {
            (Some(file), _) => {
                let path = match base_dir {
                    Some(dir) if file.is_relative() => dir.join(file),
                    _ => file.clone(),
                };
                let bytes = std::fs::read(&path).map_err(|e| {
                    format!("auth.jwt.jwks_file: cannot read {}: {e}", path.display())
                })?;
                let set = KeySet::parse(&bytes, &asymmetric)
                    .map_err(|e| format!("auth.jwt.jwks_file {}: {e}", path.display()))?;
                (Source::Fixed, set)
            }
            (None, Some(url)) => (Source::Url(url.clone()), KeySet::default()),
            (None, None) => (Source::Fixed, KeySet::default()),
        };
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("auth.jwt: cannot build the JWKS client: {e}"))?;
        Ok(JwtVerifier {
            cfg: cfg.clone(),
            algorithms,
            hs_key,
            source,
            keys: RwLock::new(Arc::new(keys)),
            fetched: Mutex::new(None),
            fetching: tokio::sync::Mutex::new(()),
            http,
        })
    }

    /// Seconds between scheduled refreshes of a JWKS URL; `None` for a fixed key set.
    pub fn refresh_every(&self) -> Option<Duration> {
        match self.source {
            Source::Url(_) => Some(Duration::from_secs(self.cfg.jwks_refresh_secs)),
            Source::Fixed => None,
        }
    }

    /// Fetches the JWKS URL and replaces the keys; on failure the old keys stay.
    pub async fn refresh(&self) -> Result<(), String> {
        let _one = self.fetching.lock().await;
        self.fetch_keys().await
    }

    /// The fetch itself; the caller holds `fetching`.
    async fn fetch_keys(&self) -> Result<(), String> {
        let Source::Url(url) = &self.source else {
            return Ok(());
        };
        *self.fetched.lock() = Some(Instant::now());
        let asymmetric: Vec<Algorithm> = self
            .algorithms
            .iter()
            .copied()
            .filter(|a| *a != Algorithm::HS256)
            .collect();
        let bytes = fetch(&self.http, url).await?;
        let set = KeySet::parse(&bytes, &asymmetric)?;
        *self.keys.write() = Arc::new(set);
        Ok(())
    }

    /// Refreshes for a token whose key is unknown, at most once per
    /// `jwks_min_refetch_secs` (so a flood of bogus `kid`s costs one fetch a period: the
    /// period is checked under the fetch lock, so requests that waited on a fetch do not
    /// each fetch again).
    async fn refetch_for_unknown_kid(&self) -> bool {
        if !matches!(self.source, Source::Url(_)) {
            return false;
        }
        let _one = self.fetching.lock().await;
        let due = self
            .fetched
            .lock()
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(self.cfg.jwks_min_refetch_secs));
        if !due {
            // Another request just fetched: its keys are worth a second look.
            return true;
        }
        match self.fetch_keys().await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "JWKS fetch failed");
                false
            }
        }
    }

    /// Verifies `token` and maps its claims; see the module doc.
    pub async fn verify(&self, token: &str) -> Result<TokenIdentity, TokenError> {
        let header = jsonwebtoken::decode_header(token).map_err(|e| {
            refuse(format!(
                "the token's header does not parse or names an unsupported algorithm ({e})"
            ))
        })?;
        if !self.algorithms.contains(&header.alg) {
            return Err(refuse(format!(
                "algorithm {:?} is not accepted",
                header.alg
            )));
        }
        let claims = if header.alg == Algorithm::HS256 {
            let key = self.hs_key.as_ref().ok_or_else(|| refuse("no HS256 key"))?;
            self.decode(token, key, header.alg)?
        } else {
            let kid = header.kid.as_deref();
            match self.decode_with_set(token, kid, header.alg) {
                Err(e) if e.0.starts_with("no key") && self.refetch_for_unknown_kid().await => {
                    self.decode_with_set(token, kid, header.alg)?
                }
                other => other?,
            }
        };
        self.identity(&claims)
    }

    /// Tries the keys that may have signed the token.
    fn decode_with_set(
        &self,
        token: &str,
        kid: Option<&str>,
        alg: Algorithm,
    ) -> Result<Value, TokenError> {
        let keys = self.keys.read().clone();
        let mut last = None;
        for k in keys.candidates(kid, alg) {
            match self.decode(token, &k.key, alg) {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| match kid {
            Some(kid) => refuse(format!("no key `{kid}` for {alg:?} in the JWKS")),
            None => refuse(format!("no key for {alg:?} in the JWKS")),
        }))
    }

    fn decode(&self, token: &str, key: &DecodingKey, alg: Algorithm) -> Result<Value, TokenError> {
        let mut v = Validation::new(alg);
        v.leeway = self.cfg.leeway_secs;
        v.validate_exp = true;
        v.validate_nbf = true;
        v.set_issuer(&[self.cfg.issuer.as_str()]);
        v.set_audience(&self.cfg.audience);
        v.set_required_spec_claims(&["exp", "iss", "aud"]);
        jsonwebtoken::decode::<Value>(token, key, &v)
            .map(|d| d.claims)
            .map_err(|e| refuse(describe(&e)))
    }

    /// The caller a token's claims name.
    fn identity(&self, claims: &Value) -> Result<TokenIdentity, TokenError> {
        let names = &self.cfg.claims;
        let tenant = match claim(claims, &names.tenant).and_then(non_empty_str) {
            Some(t) => t.to_string(),
            None => self.cfg.default_tenant.clone().ok_or_else(|| {
                refuse(format!(
                    "the token has no `{}` claim naming a tenant",
                    names.tenant
                ))
            })?,
        };
        let user = claim(claims, &names.user)
            .and_then(non_empty_str)
            .ok_or_else(|| {
                refuse(format!(
                    "the token has no `{}` claim naming a user",
                    names.user
                ))
            })?
            .to_string();
        if tenant.len() > 128 || user.len() > 256 {
            return Err(refuse("the token's tenant or user claim is too long"));
        }
        let roles: Vec<&str> = match claim(claims, &names.role) {
            Some(Value::String(s)) => s.split_whitespace().collect(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let role = if roles.contains(&self.cfg.roles.platform_admin.as_str()) {
            Role::PlatformAdmin
        } else if roles.contains(&self.cfg.roles.tenant_admin.as_str()) {
            Role::TenantAdmin
        } else {
            Role::Member
        };
        let subject = claims
            .get("sub")
            .and_then(non_empty_str)
            .unwrap_or(&user)
            .to_string();
        Ok(TokenIdentity {
            tenant,
            user,
            role,
            subject,
        })
    }
}

fn non_empty_str(v: &Value) -> Option<&str> {
    v.as_str().filter(|s| !s.trim().is_empty())
}

/// A claim by dotted path (`realm_access.roles`).
fn claim<'a>(claims: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(claims, |v, part| v.get(part))
}

/// A verification error in words a client can act on.
fn describe(e: &jsonwebtoken::errors::Error) -> String {
    use jsonwebtoken::errors::ErrorKind as K;
    match e.kind() {
        K::ExpiredSignature => "the token has expired".into(),
        K::ImmatureSignature => "the token is not valid yet (nbf)".into(),
        K::InvalidAudience => "the token's audience is not accepted".into(),
        K::InvalidIssuer => "the token's issuer is not accepted".into(),
        K::InvalidSignature => "the signature does not verify".into(),
        K::InvalidAlgorithm => "the token's algorithm does not match its key".into(),
        K::MissingRequiredClaim(c) => format!("the token has no `{c}` claim"),
        K::InvalidToken | K::Base64(_) | K::Json(_) | K::Utf8(_) => "the token is malformed".into(),
        _ => "the token does not verify".into(),
    }
}

/// GETs a JWKS, bounded in time and size; any status but 200 is an error.
async fn fetch(http: &reqwest::Client, url: &str) -> Result<Vec<u8>, String> {
    let mut resp = http
        .get(url)
        .send()
        .await
        .map_err(|e| format!("JWKS fetch from {url} failed: {e}"))?;
    if resp.status() != reqwest::StatusCode::OK {
        return Err(format!("JWKS fetch from {url} answered {}", resp.status()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| format!("JWKS fetch from {url} failed: {e}"))?
    {
        if body.len() + chunk.len() > MAX_JWKS_BYTES {
            return Err(format!(
                "the JWKS at {url} is larger than {MAX_JWKS_BYTES} bytes"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "an-hs256-secret-of-32-bytes-or-more!";

    fn hs_config() -> JwtConfig {
        serde_yaml::from_str(
            "{issuer: iss, audience: [aud], algorithms: [HS256], hs256_secret_env: UNUSED, \
              claims: {tenant: org, user: email, role: realm_access.roles}, \
              roles: {platform_admin: ops, tenant_admin: lead}}",
        )
        .unwrap()
    }

    fn hs_token(claims: serde_json::Value, secret: &str) -> String {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn hs256_with_the_operators_secret_and_configured_claim_names() {
        let v = JwtVerifier::with_secret(&hs_config(), None, Some(SECRET)).unwrap();
        let exp = crate::state::unix_now() + 600;
        let claims = serde_json::json!({"iss": "iss", "aud": "aud", "exp": exp, "sub": "u-1",
            "org": "acme", "email": "a@acme.test", "realm_access": {"roles": ["x", "lead"]}});
        let who = v.verify(&hs_token(claims.clone(), SECRET)).await.unwrap();
        assert_eq!(
            who,
            TokenIdentity {
                tenant: "acme".into(),
                user: "a@acme.test".into(),
                role: Role::TenantAdmin,
                subject: "u-1".into(),
            }
        );
        let e = v
            .verify(&hs_token(claims, "another-secret-of-32-bytes-or-more!!"))
            .await
            .unwrap_err();
        assert!(e.0.contains("signature"), "{e}");
        assert!(JwtVerifier::with_secret(&hs_config(), None, Some("short")).is_err());
        assert!(JwtVerifier::with_secret(&hs_config(), None, None).is_err());
    }

    #[test]
    fn claims_by_dotted_path() {
        let c = serde_json::json!({"a": {"b": ["x"]}, "t": "team"});
        assert_eq!(claim(&c, "a.b"), Some(&serde_json::json!(["x"])));
        assert_eq!(claim(&c, "t"), Some(&serde_json::json!("team")));
        assert_eq!(claim(&c, "a.c"), None);
    }
}
