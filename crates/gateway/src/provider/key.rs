//! An upstream's API key: read once at load from an environment variable
//! (`api_key_env`) or a file (`api_key_file`, e.g. a mounted Kubernetes secret), never
//! written in `gateway.yaml` itself, and never printed: [`ApiKey`]'s `Debug` and
//! `Display` say `[redacted]`, and errors name the variable or file, not what it holds.

use std::path::{Path, PathBuf};

use axum::http::{HeaderName, HeaderValue};

use super::kind::Provider;

/// A key held for sending upstream; prints as `[redacted]`.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    pub fn new(key: String) -> ApiKey {
        ApiKey(key)
    }

    /// The key itself, for the header that carries it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey([redacted])")
    }
}

impl std::fmt::Display for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

/// Longest key file read (a key is a few hundred bytes at most).
const MAX_KEY_FILE_BYTES: u64 = 16 * 1024;

/// Reads the key from `env` or `file` (relative paths from `base_dir`); `Ok(None)` when
/// neither is given. Surrounding whitespace (a file's trailing newline) is dropped; an
/// unset variable, an unreadable, oversized or empty file, or an empty key is an error
/// naming where it was looked for.
pub fn read_key(
    env: Option<&str>,
    file: Option<&Path>,
    base_dir: Option<&Path>,
) -> Result<Option<ApiKey>, String> {
    let (raw, from) = match (env, file) {
        (Some(_), Some(_)) => return Err("give `api_key_env` or `api_key_file`, not both".into()),
        (None, None) => return Ok(None),
        (Some(var), None) => {
            let v = std::env::var(var)
                .map_err(|_| format!("environment variable `{var}` is not set"))?;
            (v, format!("environment variable `{var}`"))
        }
        (None, Some(path)) => {
            let path = resolve(path, base_dir);
            (read_file(&path)?, format!("`{}`", path.display()))
        }
    };
    let key = raw.trim();
    if key.is_empty() {
        return Err(format!("the API key in {from} is empty"));
    }
    Ok(Some(ApiKey(key.to_string())))
}

fn resolve(path: &Path, base_dir: Option<&Path>) -> PathBuf {
    match base_dir {
        Some(dir) if path.is_relative() => dir.join(path),
        _ => path.to_path_buf(),
    }
}

fn read_file(path: &Path) -> Result<String, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("api_key_file `{shown}`: {e}"))?;
    if meta.len() > MAX_KEY_FILE_BYTES {
        return Err(format!(
            "api_key_file `{shown}` is larger than {MAX_KEY_FILE_BYTES} bytes"
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("api_key_file `{shown}`: {e}"))?;
    String::from_utf8(bytes).map_err(|_| format!("api_key_file `{shown}` is not UTF-8 text"))
}

/// The headers that carry an upstream's key, in its provider's way; `None` when the key
/// cannot be sent in a header (a control character in it). Values are marked sensitive,
/// so they print as `Sensitive` in any debug output.
pub fn auth_headers(
    provider: Option<Provider>,
    key: Option<&ApiKey>,
    anthropic_version: &str,
) -> Option<Vec<(HeaderName, HeaderValue)>> {
    let mut out = Vec::new();
    if provider == Some(Provider::Anthropic) {
        out.push((
            HeaderName::from_static("anthropic-version"),
            HeaderValue::from_str(anthropic_version).ok()?,
        ));
        if let Some(k) = key {
            let mut v = HeaderValue::from_str(k.expose()).ok()?;
            v.set_sensitive(true);
            out.push((HeaderName::from_static("x-api-key"), v));
        }
        return Some(out);
    }
    if let Some(k) = key {
        out.push((
            axum::http::header::AUTHORIZATION,
            crate::upstream::bearer(k.expose())?,
        ));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(h: &[(HeaderName, HeaderValue)]) -> Vec<(String, String)> {
        h.iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("?").to_string()))
            .collect()
    }

    #[test]
    fn each_provider_sends_its_key_its_own_way() {
        let k = ApiKey::new("sk-test".into());
        let openai = auth_headers(Some(Provider::Openai), Some(&k), "x").unwrap();
        assert_eq!(
            names(&openai),
            [("authorization".into(), "Bearer sk-test".into())]
        );
        let plain = auth_headers(None, Some(&k), "x").unwrap();
        assert_eq!(names(&plain), names(&openai));
        let anthropic = auth_headers(Some(Provider::Anthropic), Some(&k), "2023-06-01").unwrap();
        assert_eq!(
            names(&anthropic),
            [
                ("anthropic-version".into(), "2023-06-01".into()),
                ("x-api-key".into(), "sk-test".into())
            ]
        );
        assert!(anthropic.iter().any(|(_, v)| v.is_sensitive()));
        assert!(format!("{anthropic:?}").find("sk-test").is_none());
        assert!(auth_headers(None, None, "x").unwrap().is_empty());
        let bad = ApiKey::new("sk\ntest".into());
        assert!(auth_headers(Some(Provider::Anthropic), Some(&bad), "x").is_none());
        assert!(auth_headers(Some(Provider::Openai), Some(&bad), "x").is_none());
    }

    #[test]
    fn key_never_prints() {
        let k = ApiKey::new("sk-secret".into());
        assert_eq!(format!("{k:?}"), "ApiKey([redacted])");
        assert_eq!(k.to_string(), "[redacted]");
        assert_eq!(k.expose(), "sk-secret");
    }

    #[test]
    fn reads_from_a_file_relative_to_the_config() {
        let dir = std::env::temp_dir().join(format!("strata-gw-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("key"), "sk-file\n").unwrap();
        let k = read_key(None, Some(Path::new("key")), Some(&dir)).unwrap();
        assert_eq!(k.unwrap().expose(), "sk-file");
        std::fs::write(dir.join("blank"), " \n").unwrap();
        let err = read_key(None, Some(Path::new("blank")), Some(&dir)).unwrap_err();
        assert!(err.contains("is empty") && !err.contains("sk-"), "{err}");
        let err = read_key(None, Some(Path::new("missing")), Some(&dir)).unwrap_err();
        assert!(
            err.contains("api_key_file") && err.contains("missing"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn env_and_file_together_or_unset_are_errors() {
        let err = read_key(Some("X"), Some(Path::new("y")), None).unwrap_err();
        assert!(err.contains("not both"), "{err}");
        let err = read_key(Some("STRATA_TEST_SURELY_UNSET_KEY_VAR"), None, None).unwrap_err();
        assert!(err.contains("is not set"), "{err}");
        assert!(read_key(None, None, None).unwrap().is_none());
    }
}
