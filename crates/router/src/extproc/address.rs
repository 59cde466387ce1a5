//! Endpoint addresses as the data plane names them: `host:port`, and the allow lists
//! (the subset hint, the conformance selection header) that restrict a pick.

/// `host:port` of an endpoint's base URL.
pub fn address_of(url: &str) -> &str {
    url.trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
}

/// Whether `addr` (`host:port`) is one of `allowed` (each `host:port`, or a bare host that
/// matches every port).
pub fn address_allowed(addr: &str, allowed: &[String]) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let bare = |s: &str| s.trim_start_matches('[').trim_end_matches(']').to_string();
    let host = bare(host);
    allowed.iter().any(|a| {
        let a = a.trim();
        a == addr || bare(a) == host
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_match_with_or_without_port() {
        let allowed = vec!["10.0.0.1".to_string(), "10.0.0.2:8000".to_string()];
        assert!(address_allowed("10.0.0.1:9000", &allowed));
        assert!(address_allowed("10.0.0.2:8000", &allowed));
        assert!(!address_allowed("10.0.0.2:8001", &allowed));
        assert!(!address_allowed("10.0.0.3:8000", &allowed));
        assert!(address_allowed("[::1]:80", &["::1".to_string()]));
        assert_eq!(address_of("http://127.0.0.1:80"), "127.0.0.1:80");
    }
}
