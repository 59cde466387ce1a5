//! Endpoints: what a replica is (URL, engine kind, labels) and how lists of them are parsed
//! from flags and files.
//!
//! An endpoint is named by its base URL (`http://host:port` or `https://host:port`, no
//! trailing slash; `https://` endpoints are verified as `upstream_tls` says). The
//! router gives each one a small integer slot ([`EndpointId`]) while it is registered;
//! the prefix indexes and the scheduler work on slots, so slots are reused after removal
//! only once every index has forgotten the old holder.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A registered endpoint's slot: dense, small, reused after removal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EndpointId(pub u32);

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Which server software a replica runs (the metric names read from its `/metrics`): the
/// one definition in `strata-api`.
pub use strata_api::model_server::EngineKind;

/// One replica as configured: where it is, what it runs, and labels that filters and
/// the traffic split read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// Base URL, `http://host:port` or `https://host:port`.
    pub url: String,
    #[serde(default)]
    pub kind: EngineKind,
    /// Disaggregation role (`prefill`, `decode`, `both`); free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The model this replica serves; requests for another model never go here. `None`
    /// serves whatever is asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// LoRA adapters this replica can serve (besides those its metrics report).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lora: Vec<String>,
    /// Version or group, for traffic splits between endpoint groups (canaries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// ZMQ endpoint of the replica's KV-event publisher (PROTOCOLS §4), e.g.
    /// `tcp://127.0.0.1:5557`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// ZMQ endpoint of the publisher's replay socket (PROTOCOLS §4), e.g.
    /// `tcp://127.0.0.1:5558`: sequence gaps are filled from it instead of dropping the
    /// endpoint's precise-index entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// Any other labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl EndpointSpec {
    /// A spec with only a URL and kind.
    pub fn new(url: impl Into<String>, kind: EngineKind) -> Self {
        EndpointSpec {
            url: url.into(),
            kind,
            role: None,
            model: None,
            lora: Vec::new(),
            group: None,
            kv_events: None,
            kv_events_replay: None,
            labels: BTreeMap::new(),
        }
    }

    /// Checks and normalises the URL (scheme `http` or `https`, host and port, no path).
    pub fn normalized(mut self) -> Result<Self, EndpointError> {
        self.url = normalize_url(&self.url)?;
        Ok(self)
    }

    /// `host:port` of the URL.
    pub fn authority(&self) -> &str {
        strip_scheme(&self.url)
    }
}

/// Problems with an endpoint list.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointError {
    #[error(transparent)]
    Kind(#[from] strata_api::model_server::UnknownEngineKind),
    #[error("bad endpoint URL `{0}`: {1}")]
    Url(String, &'static str),
    #[error("endpoints file: {0}")]
    File(String),
    #[error("endpoint `{0}` is listed twice")]
    Duplicate(String),
}

/// `host:port` of a base URL (its `http://` or `https://` removed).
pub fn strip_scheme(url: &str) -> &str {
    url.strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .unwrap_or(url)
}

/// `http://host:port` or `https://host:port` with no trailing slash; a bare `host:port`
/// gets `http://`.
pub fn normalize_url(raw: &str) -> Result<String, EndpointError> {
    let raw = raw.trim();
    let (scheme, rest) = if let Some(rest) = raw.strip_prefix("http://") {
        ("http", rest)
    } else if let Some(rest) = raw.strip_prefix("https://") {
        ("https", rest)
    } else if raw.contains("://") {
        return Err(EndpointError::Url(
            raw.into(),
            "only http:// and https:// are supported",
        ));
    } else {
        ("http", raw)
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() {
        return Err(EndpointError::Url(raw.into(), "no host"));
    }
    if rest.contains('/') || rest.contains('?') || rest.contains('#') {
        return Err(EndpointError::Url(raw.into(), "a base URL has no path"));
    }
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(EndpointError::Url(raw.into(), "no port"));
    };
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(EndpointError::Url(raw.into(), "bad host or port"));
    }
    Ok(format!("{scheme}://{rest}"))
}

/// Parses `--endpoints`: comma-separated `[kind=]URL` items, e.g.
/// `http://127.0.0.1:8001,sglang=http://127.0.0.1:8002`.
pub fn parse_endpoint_list(
    list: &str,
    default_kind: EngineKind,
) -> Result<Vec<EndpointSpec>, EndpointError> {
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (kind, url) = match item.split_once('=') {
            Some((k, u)) => (k.parse()?, u),
            None => (default_kind, item),
        };
        out.push(EndpointSpec::new(url, kind).normalized()?);
    }
    check_unique(&out)?;
    Ok(out)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FileItem {
    Url(String),
    Spec(EndpointSpec),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointsFile {
    endpoints: Vec<FileItem>,
}

/// Parses an endpoints file: YAML (or JSON) `endpoints:` with a list of URLs or
/// [`EndpointSpec`] maps; or, when it is not such a document, one `[kind=]URL` per line
/// (`#` starts a comment).
pub fn parse_endpoints_file(
    text: &str,
    default_kind: EngineKind,
) -> Result<Vec<EndpointSpec>, EndpointError> {
    let looks_structured = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .is_some_and(|l| l.starts_with("endpoints") || l.starts_with('{'));
    if !looks_structured {
        let joined: Vec<&str> = text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .collect();
        return parse_endpoint_list(&joined.join(","), default_kind);
    }
    let file: EndpointsFile =
        serde_yaml::from_str(text).map_err(|e| EndpointError::File(e.to_string()))?;
    let mut out = Vec::with_capacity(file.endpoints.len());
    for item in file.endpoints {
        let spec = match item {
            FileItem::Url(u) => {
                let (kind, url) = match u.split_once('=') {
                    Some((k, u)) => (k.parse()?, u.to_string()),
                    None => (default_kind, u),
                };
                EndpointSpec::new(url, kind)
            }
            FileItem::Spec(s) => s,
        };
        out.push(spec.normalized()?);
    }
    check_unique(&out)?;
    Ok(out)
}

fn check_unique(specs: &[EndpointSpec]) -> Result<(), EndpointError> {
    let mut seen = std::collections::HashSet::new();
    for s in specs {
        if !seen.insert(s.url.as_str()) {
            return Err(EndpointError::Duplicate(s.url.clone()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalized_and_checked() {
        assert_eq!(
            normalize_url("127.0.0.1:80").unwrap(),
            "http://127.0.0.1:80"
        );
        assert_eq!(
            normalize_url("http://h:1/").unwrap(),
            "http://h:1",
            "trailing slash dropped"
        );
        assert_eq!(
            normalize_url("https://engine.internal:8443/").unwrap(),
            "https://engine.internal:8443"
        );
        assert_eq!(strip_scheme("https://h:1"), "h:1");
        assert_eq!(strip_scheme("http://h:1"), "h:1");
        for bad in [
            "",
            "ftp://h:1",
            "https://h",
            "http://h",
            "http://h:x",
            "http://h:1/v1",
            ":1",
        ] {
            assert!(normalize_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn list_takes_kinds_and_rejects_duplicates() {
        let l = parse_endpoint_list("http://a:1, sglang=b:2,", EngineKind::Vllm).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].kind, EngineKind::Vllm);
        assert_eq!(l[1].kind, EngineKind::Sglang);
        assert_eq!(l[1].url, "http://b:2");
        assert_eq!(l[1].authority(), "b:2");
        assert!(matches!(
            parse_endpoint_list("a:1,http://a:1", EngineKind::Vllm),
            Err(EndpointError::Duplicate(_))
        ));
        assert!(matches!(
            parse_endpoint_list("foo=a:1", EngineKind::Vllm),
            Err(EndpointError::Kind(_))
        ));
    }

    #[test]
    fn file_in_both_forms() {
        let yaml = "endpoints:\n  - http://a:1\n  - url: b:2\n    kind: llamacpp\n    group: canary\n    lora: [x]\n    kv_events: tcp://127.0.0.1:5557\n";
        let l = parse_endpoints_file(yaml, EngineKind::Strata).unwrap();
        assert_eq!(l[0].kind, EngineKind::Strata);
        assert_eq!(l[1].kind, EngineKind::Llamacpp);
        assert_eq!(l[1].group.as_deref(), Some("canary"));
        assert_eq!(l[1].lora, vec!["x".to_string()]);
        let lines = "# replicas\nhttp://a:1\n\ntrtllm=c:3  # gpu box\n";
        let l = parse_endpoints_file(lines, EngineKind::Vllm).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l[1].kind, EngineKind::Trtllm);
        assert!(
            parse_endpoints_file("endpoints: [{url: a:1, bogus: 1}]", EngineKind::Vllm).is_err()
        );
        assert!(parse_endpoints_file("endpoints: 3", EngineKind::Vllm).is_err());
    }
}
