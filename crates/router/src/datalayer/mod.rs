//! The data layer: what the router knows about each endpoint and how it learns it.
//!
//! - [`metrics`]: pure parsing of `/metrics` per engine kind into `EndpointMetrics`;
//! - [`scrape`]: the per-endpoint task reading `/metrics` and `/health`;
//! - [`kv_events`]: the per-endpoint ZMQ subscriber feeding the precise prefix index.
pub(crate) mod kv_events;
pub mod metrics;
pub(crate) mod scrape;
