//! API key format, hashing and constant-time verification.
//!
//! A key reads `sk-strata-<id>-<secret>`: `id` is 8 random bytes in hex (public: it names
//! the key in lists, logs and usage rows), `secret` 32 random bytes in hex. The store keeps
//! only `id`, a random 16-byte salt and SHA-256(salt ‖ secret); the full key is shown once,
//! at creation. Verification recomputes the hash and compares it with [`subtle`] so the
//! time taken does not depend on how many bytes matched. Keys never appear in logs: only
//! the id does.

use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

const PREFIX: &str = "sk-strata-";
const ID_BYTES: usize = 8;
const SECRET_BYTES: usize = 32;
const SALT_BYTES: usize = 16;

/// A freshly generated key: the full text (shown once) and what the store keeps.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub full: String,
    pub id: String,
    pub salt_hex: String,
    pub hash_hex: String,
}

/// Generates a key with randomness from `rng` (the OS generator in production).
pub fn generate(rng: &mut impl RngCore) -> NewKey {
    let mut id = [0u8; ID_BYTES];
    let mut secret = [0u8; SECRET_BYTES];
    let mut salt = [0u8; SALT_BYTES];
    rng.fill_bytes(&mut id);
    rng.fill_bytes(&mut secret);
    rng.fill_bytes(&mut salt);
    let id = hex::encode(id);
    let secret = hex::encode(secret);
    NewKey {
        full: format!("{PREFIX}{id}-{secret}"),
        hash_hex: hex::encode(hash(&salt, secret.as_bytes())),
        salt_hex: hex::encode(salt),
        id,
    }
}

fn hash(salt: &[u8], secret: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(secret);
    h.finalize().into()
}

/// Splits a presented key into `(id, secret)`; `None` when it is not shaped like ours.
pub fn parse(presented: &str) -> Option<(&str, &str)> {
    let rest = presented.strip_prefix(PREFIX)?;
    let (id, secret) = rest.split_once('-')?;
    let ok = id.len() == ID_BYTES * 2
        && secret.len() == SECRET_BYTES * 2
        && id.bytes().all(|b| b.is_ascii_hexdigit())
        && secret.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then_some((id, secret))
}

/// True when `secret` hashes, with `salt_hex`, to `hash_hex`. Constant time in the
/// comparison; malformed stored values simply fail.
pub fn verify(secret: &str, salt_hex: &str, hash_hex: &str) -> bool {
    let (Ok(salt), Ok(expected)) = (hex::decode(salt_hex), hex::decode(hash_hex)) else {
        return false;
    };
    let actual = hash(&salt, secret.as_bytes());
    expected.len() == actual.len() && bool::from(actual.ct_eq(&expected[..]))
}

/// Hashes an admin key so it can be compared in constant time whatever its length.
pub fn admin_matches(presented: &str, admin_key: &str) -> bool {
    let a = Sha256::digest(presented.as_bytes());
    let b = Sha256::digest(admin_key.as_bytes());
    bool::from(a.ct_eq(&b))
}

/// The key a request presents: `Authorization: Bearer <key>` or `x-api-key: <key>`.
pub fn from_headers(headers: &axum::http::HeaderMap) -> Option<&str> {
    if let Some(v) = headers.get(axum::http::header::AUTHORIZATION) {
        let v = v.to_str().ok()?.trim();
        let (scheme, token) = v.split_once(' ')?;
        if scheme.eq_ignore_ascii_case("bearer") {
            return Some(token.trim());
        }
        return None;
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn generated_keys_parse_and_verify() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let k = generate(&mut rng);
        let (id, secret) = parse(&k.full).unwrap();
        assert_eq!(id, k.id);
        assert!(verify(secret, &k.salt_hex, &k.hash_hex));
        assert!(!k.hash_hex.contains(secret));
        let other = generate(&mut rng);
        assert_ne!(other.full, k.full);
        let (_, other_secret) = parse(&other.full).unwrap();
        assert!(!verify(other_secret, &k.salt_hex, &k.hash_hex));
    }

    #[test]
    fn malformed_keys_do_not_parse() {
        for bad in [
            "",
            "sk-strata-",
            "sk-strata-zz-zz",
            "sk-other-0011223344556677-00",
            "sk-strata-0011223344556677",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
        assert!(!verify("abc", "not-hex", "00"));
    }

    #[test]
    fn headers_bearer_and_x_api_key() {
        let mut h = axum::http::HeaderMap::new();
        assert_eq!(from_headers(&h), None);
        h.insert("x-api-key", "k1".parse().unwrap());
        assert_eq!(from_headers(&h), Some("k1"));
        h.insert("authorization", "Bearer k2".parse().unwrap());
        assert_eq!(from_headers(&h), Some("k2"));
        h.insert("authorization", "Basic xyz".parse().unwrap());
        assert_eq!(from_headers(&h), None);
    }

    #[test]
    fn admin_compare() {
        assert!(admin_matches("secret", "secret"));
        assert!(!admin_matches("secret2", "secret"));
        assert!(!admin_matches("", "secret"));
    }
}
