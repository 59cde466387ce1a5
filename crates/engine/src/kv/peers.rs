//! Which KV-transfer peers an engine may connect to (`--kv-peers`, issue 29): the one place
//! that decides whether a `host:port` a request names (`kv_transfer_params.remote_host` /
//! `remote_port`, the `x-prefiller-host-port` header, or a prefill engine's answer) is
//! somewhere this engine will open a connection to.
//!
//! - `--kv-peers host:port,...`: only those, whoever asks.
//! - `--kv-peers any`: any peer (an operator's explicit choice, warned about at start).
//! - no `--kv-peers`: any peer only when the engine requires `--api-key` (every request that
//!   reaches a handler then comes from a key holder, the router or another internal
//!   service); otherwise none, so an open engine never connects where a client says.
//!
//! Hosts compare as written after normalizing (lower case, no trailing dot, IP literals in
//! their canonical form); names are not resolved to match, so a listed name allows that
//! name and nothing that happens to resolve alike.

use std::net::IpAddr;

/// One allowed peer: a normalized host and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPeer {
    host: String,
    port: u16,
}

impl KvPeer {
    pub fn new(host: &str, port: u16) -> Result<Self, String> {
        check_host_port(host, port)?;
        Ok(Self {
            host: normalize(host),
            port,
        })
    }

    fn is(&self, host: &str, port: u16) -> bool {
        self.port == port && self.host == normalize(host)
    }
}

impl std::fmt::Display for KvPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl std::str::FromStr for KvPeer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (host, port) = split_host_port(s.trim())
            .ok_or_else(|| format!("`{s}` is not `host:port` (`[v6]:port` for IPv6)"))?;
        Self::new(&host, port)
    }
}

/// The peers an engine may connect to for KV transfer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KvPeers {
    /// No `--kv-peers`: any peer when the engine requires an API key, else none.
    #[default]
    Unset,
    /// `--kv-peers any`.
    Any,
    /// `--kv-peers host:port,...`.
    List(Vec<KvPeer>),
}

impl KvPeers {
    /// `--kv-peers`'s values: `any`, or `host:port` entries (none is a mistake).
    pub fn parse(values: &[String]) -> Result<Self, String> {
        if values.iter().any(|v| v.trim() == "any") {
            if values.len() > 1 {
                return Err("--kv-peers any cannot be combined with listed peers".into());
            }
            return Ok(Self::Any);
        }
        if values.is_empty() {
            return Ok(Self::Unset);
        }
        values
            .iter()
            .map(|v| v.parse::<KvPeer>().map_err(|e| format!("--kv-peers: {e}")))
            .collect::<Result<Vec<_>, _>>()
            .map(Self::List)
    }

    /// Whether this engine may connect to `host:port`; `authenticated` says every request
    /// presented the engine's API key. The refusal says what the operator can do.
    pub fn check(&self, host: &str, port: u16, authenticated: bool) -> Result<(), String> {
        let shown = || {
            let h: String = host.chars().take(80).collect();
            if h.contains(':') {
                format!("[{h}]:{port}")
            } else {
                format!("{h}:{port}")
            }
        };
        match self {
            Self::Any => Ok(()),
            Self::Unset if authenticated => Ok(()),
            Self::Unset => Err(format!(
                "KV peer {} refused: this engine connects only to peers an operator allowed \
                 (start it with --kv-peers, or with --api-key so that only key holders can name \
                 peers).",
                shown()
            )),
            Self::List(peers) if peers.iter().any(|p| p.is(host, port)) => Ok(()),
            Self::List(_) => Err(format!(
                "KV peer {} is not in this engine's --kv-peers.",
                shown()
            )),
        }
    }
}

fn normalize(host: &str) -> String {
    match host.parse::<IpAddr>() {
        Ok(ip) => ip.to_string(),
        Err(_) => host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase(),
    }
}

/// `host:port`, with `[v6]:port` for IPv6 literals.
pub fn split_host_port(s: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest.split_once("]:")?;
        (h, p)
    } else {
        s.rsplit_once(':')?
    };
    let port: u16 = port.parse().ok()?;
    Some((host.to_string(), port))
}

/// A host that is an IP address or a DNS name (RFC 1123 labels), and a port other than 0.
pub fn check_host_port(host: &str, port: u16) -> Result<(), String> {
    if port == 0 {
        return Err("remote_port must be between 1 and 65535.".into());
    }
    if host.parse::<IpAddr>().is_ok() || is_hostname(host) {
        Ok(())
    } else {
        Err(format!(
            "remote_host `{}` is neither an IP address nor a host name.",
            host.chars().take(80).collect::<String>()
        ))
    }
}

fn is_hostname(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_forms() {
        assert_eq!(
            split_host_port("10.0.0.7:8001"),
            Some(("10.0.0.7".into(), 8001))
        );
        assert_eq!(split_host_port("[::1]:9"), Some(("::1".into(), 9)));
        assert_eq!(
            split_host_port("prefill-0.svc:80"),
            Some(("prefill-0.svc".into(), 80))
        );
        assert_eq!(split_host_port("nohost"), None);
        assert_eq!(split_host_port("h:70000"), None);
        assert_eq!(split_host_port("[::1]9"), None);
    }

    #[test]
    fn hosts_must_be_ips_or_names() {
        for ok in [
            "127.0.0.1",
            "::1",
            "localhost",
            "prefill-0.ns.svc.cluster.local",
            "a.",
        ] {
            assert!(check_host_port(ok, 1).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a b",
            "-a",
            "a..b",
            "http://x",
            "x/y",
            "é",
            &"a".repeat(64),
        ] {
            assert!(check_host_port(bad, 1).is_err(), "{bad}");
        }
        assert!(check_host_port("127.0.0.1", 0).is_err());
    }

    fn list(v: &[&str]) -> KvPeers {
        KvPeers::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn listed_peers_only_whoever_asks() {
        let p = list(&[
            "10.0.0.7:8001",
            "Prefill-0.svc.:9000",
            "[0:0:0:0:0:0:0:1]:7",
        ]);
        for auth in [false, true] {
            assert!(p.check("10.0.0.7", 8001, auth).is_ok());
            assert!(p.check("prefill-0.svc", 9000, auth).is_ok());
            assert!(p.check("PREFILL-0.SVC.", 9000, auth).is_ok());
            assert!(p.check("::1", 7, auth).is_ok());
            // Another port of a listed host, or another host, is refused.
            assert!(p.check("10.0.0.7", 8002, auth).is_err());
            assert!(p.check("10.0.0.8", 8001, auth).is_err());
            assert!(p.check("127.0.0.1", 8001, auth).is_err());
        }
        let e = p.check("169.254.169.254", 80, true).unwrap_err();
        assert!(
            e.contains("169.254.169.254:80") && e.contains("--kv-peers"),
            "{e}"
        );
    }

    #[test]
    fn unset_allows_only_key_holders_and_any_allows_all() {
        let unset = KvPeers::default();
        assert!(unset.check("10.0.0.7", 1, true).is_ok());
        let e = unset.check("10.0.0.7", 1, false).unwrap_err();
        assert!(e.contains("--kv-peers") && e.contains("--api-key"), "{e}");
        assert!(list(&["any"]).check("10.0.0.7", 1, false).is_ok());
        assert_eq!(list(&[]), KvPeers::Unset);
    }

    #[test]
    fn bad_lists_are_refused() {
        for bad in [
            &["any", "h:1"][..],
            &["h"],
            &["h:0"],
            &["bad host:1"],
            &["[::1]"],
        ] {
            let v: Vec<String> = bad.iter().map(|s| s.to_string()).collect();
            assert!(KvPeers::parse(&v).is_err(), "{bad:?}");
        }
    }
}
