//! A JWKS document (RFC 7517) as the verification keys the gateway uses: RSA keys (for
//! RS256) and P-256 EC keys (for ES256). Symmetric (`oct`) keys in a JWKS are ignored: an
//! HS256 secret comes only from the operator's environment, never from a fetched document.
//! Keys whose `use` is not `sig`, or whose `alg` names another algorithm, are skipped.

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// Largest JWKS document read (file or URL).
pub const MAX_JWKS_BYTES: usize = 1 << 20;

/// One usable verification key.
#[derive(Clone)]
pub struct VerifyKey {
    pub kid: Option<String>,
    /// RS256 or ES256.
    pub alg: Algorithm,
    pub key: DecodingKey,
}

impl std::fmt::Debug for VerifyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifyKey")
            .field("kid", &self.kid)
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

/// The keys of one JWKS document.
#[derive(Debug, Clone, Default)]
pub struct KeySet {
    pub keys: Vec<VerifyKey>,
}

impl KeySet {
    /// Parses a JWKS document, keeping the keys usable with `allowed` algorithms. An
    /// unparsable document, or one with no usable key, is an error naming why.
    pub fn parse(bytes: &[u8], allowed: &[Algorithm]) -> Result<KeySet, String> {
        if bytes.len() > MAX_JWKS_BYTES {
            return Err(format!("the JWKS is larger than {MAX_JWKS_BYTES} bytes"));
        }
        let set: JwkSet =
            serde_json::from_slice(bytes).map_err(|e| format!("not a JWKS document: {e}"))?;
        let mut keys = Vec::new();
        for jwk in &set.keys {
            if jwk
                .common
                .public_key_use
                .as_ref()
                .is_some_and(|u| *u != PublicKeyUse::Signature)
            {
                continue;
            }
            let alg = match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => Algorithm::RS256,
                AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => {
                    Algorithm::ES256
                }
                _ => continue,
            };
            if !allowed.contains(&alg) {
                continue;
            }
            let declared = jwk.common.key_algorithm.map(|a| format!("{a:?}"));
            if declared.is_some_and(|d| d != format!("{alg:?}")) {
                continue;
            }
            let key = DecodingKey::from_jwk(jwk).map_err(|e| {
                format!(
                    "key {}: {e}",
                    jwk.common.key_id.as_deref().unwrap_or("(no kid)")
                )
            })?;
            keys.push(VerifyKey {
                kid: jwk.common.key_id.clone(),
                alg,
                key,
            });
        }
        if keys.is_empty() {
            return Err(format!(
                "the JWKS has no signing key for {}",
                allowed
                    .iter()
                    .map(|a| format!("{a:?}"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ));
        }
        Ok(KeySet { keys })
    }

    /// The keys that may have signed a token with this `kid` and `alg`: the key with that
    /// id, or, for a token without `kid`, every key of that algorithm.
    pub fn candidates<'a>(
        &'a self,
        kid: Option<&'a str>,
        alg: Algorithm,
    ) -> impl Iterator<Item = &'a VerifyKey> + 'a {
        self.keys
            .iter()
            .filter(move |k| k.alg == alg && (kid.is_none() || k.kid.as_deref() == kid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EC: &str = r#"{"keys":[
        {"kty":"EC","crv":"P-256","kid":"e1","use":"sig",
         "x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
         "y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"},
        {"kty":"oct","kid":"s1","k":"c2VjcmV0"},
        {"kty":"EC","crv":"P-256","kid":"enc","use":"enc",
         "x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
         "y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}
    ]}"#;

    #[test]
    fn keeps_signing_keys_of_allowed_algorithms() {
        let set = KeySet::parse(EC.as_bytes(), &[Algorithm::ES256, Algorithm::RS256]).unwrap();
        assert_eq!(set.keys.len(), 1, "oct and enc keys are skipped");
        assert_eq!(set.keys[0].kid.as_deref(), Some("e1"));
        assert_eq!(set.candidates(Some("e1"), Algorithm::ES256).count(), 1);
        assert_eq!(set.candidates(Some("e2"), Algorithm::ES256).count(), 0);
        assert_eq!(set.candidates(None, Algorithm::ES256).count(), 1);
        assert_eq!(set.candidates(Some("e1"), Algorithm::RS256).count(), 0);
    }

    #[test]
    fn refuses_garbage_and_sets_without_usable_keys() {
        assert!(KeySet::parse(b"not json", &[Algorithm::RS256])
            .unwrap_err()
            .contains("not a JWKS"));
        assert!(KeySet::parse(EC.as_bytes(), &[Algorithm::RS256])
            .unwrap_err()
            .contains("no signing key"));
        assert!(KeySet::parse(br#"{"keys":[]}"#, &[Algorithm::ES256]).is_err());
    }
}
