//! Responses API responses kept for `GET /v1/responses/{id}` and `previous_response_id`:
//! one row per tenant and id, holding the response object as the client saw it and the
//! conversation up to and including it (chat messages, what a follow-up continues). Rows
//! expire after `responses.retention_secs`; a tenant's expired rows are dropped whenever
//! it stores another, and an expired row is never read.

use serde::{Deserialize, Serialize};

/// One kept response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    pub tenant: String,
    /// `resp_...`
    pub id: String,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds; not read at or after this.
    pub expires_at: i64,
    /// The response object (JSON).
    pub body: String,
    /// The conversation after this response, as chat messages (a JSON list).
    pub conversation: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::SqliteStore;
    use crate::store::Store;

    fn row(tenant: &str, id: &str, created_at: i64, ttl: i64) -> StoredResponse {
        StoredResponse {
            tenant: tenant.into(),
            id: id.into(),
            created_at,
            expires_at: created_at + ttl,
            body: format!("{{\"id\":\"{id}\"}}"),
            conversation: "[]".into(),
        }
    }

    #[test]
    fn kept_per_tenant_until_expiry() {
        let s = SqliteStore::in_memory().unwrap();
        s.put_response(&row("a", "resp_1", 100, 10)).unwrap();
        assert_eq!(
            s.get_response("a", "resp_1", 105).unwrap(),
            Some(row("a", "resp_1", 100, 10))
        );
        // Another tenant does not see it; it is gone once expired.
        assert_eq!(s.get_response("b", "resp_1", 105).unwrap(), None);
        assert_eq!(s.get_response("a", "resp_1", 110).unwrap(), None);
        // Storing again drops the tenant's expired rows.
        s.put_response(&row("a", "resp_2", 200, 10)).unwrap();
        // (read as of a time it was still live: the row itself is gone)
        assert_eq!(s.get_response("a", "resp_1", 105).unwrap(), None);
        assert!(s.get_response("a", "resp_2", 205).unwrap().is_some());
    }
}
