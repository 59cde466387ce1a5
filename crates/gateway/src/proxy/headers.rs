//! The HTTP headers the gateway reads and writes on the request path: their names, in one
//! place, and the one way a header value is made from text.

use axum::http::HeaderValue;

/// `hit`, `semantic` or `miss` on an answer that a cache could have served.
pub const CACHE_HEADER: &str = "x-strata-cache";
/// On a cascade's answer: `<model that answered>;<reason>` ([`crate::cascade`]).
pub const CASCADE_HEADER: &str = "x-strata-cascade";
pub const UPSTREAM_HEADER: &str = "x-strata-upstream";
pub const MODEL_HEADER: &str = "x-strata-model";
/// Taken from the client when present, generated otherwise; sent upstream and back.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// The replica (`host:port`) that served, when an embedded router chose it.
pub const SERVED_BY_HEADER: &str = strata_router::proxy::SERVED_BY;

/// A header value from text the gateway made (ids, numbers, names from the config); text
/// that is not a valid value becomes empty rather than failing the request.
pub(crate) fn hv(v: impl ToString) -> HeaderValue {
    HeaderValue::from_str(&v.to_string()).unwrap_or_else(|_| HeaderValue::from_static(""))
}
