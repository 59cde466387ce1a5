//! Strata's gateway: the OpenAI-compatible front that decides who may call which model,
//! how much, at what cost, and where the request goes.
//!
//! Code map:
//! * [`config`]: `gateway.yaml` types, validation, hot reload ([`config::ConfigHandle`]).
//! * [`store`]: the [`store::Store`] trait and its SQLite implementation (keys, tenants,
//!   budgets, usage ledger, audit log; WAL; versioned migrations).
//! * [`keys`]: key format, salted hashing, constant-time verification, header parsing.
//! * [`ratelimit`]: pure GCRA plus in-memory and Redis (Lua) backends.
//! * [`cache`]: exact-match response cache, keyed per tenant (memory LRU or Redis).
//! * [`guardrails`]: pluggable checks before and after the model (patterns, prompt size).
//! * [`routing`]: pure plan of tries (weighted targets, fallbacks), backoff, failure classes.
//! * [`proxy`]: the request path, streaming passthrough and usage accounting; tries go
//!   to a fixed base URL or through an embedded router ([`config::EmbeddedRouter`]).
//! * [`stream_guard`]: output guardrails on streamed answers (hold-back window).
//! * [`state`]: [`state::Gateway`], the shared state and in-memory mirror of keys and spend.
//! * [`server`]: routes, admin API, serving and config watching.
//! * [`upstream`]: the upstream HTTP client (hyper's pooled HTTP/1.1 client; reqwest for
//!   `https://` with the `tls` feature), URIs and auth parsed at load.
//! * [`metrics`]: Prometheus metrics.
//! * [`cli`]: [`GatewayArgs`], [`run`], [`KeysArgs`], [`run_keys`].

pub mod cache;
pub mod cli;
pub mod config;
pub mod guardrails;
pub mod keys;
pub mod metrics;
pub mod proxy;
pub mod ratelimit;
pub mod redis_conn;
pub mod routing;
pub mod server;
pub mod state;
pub mod store;
pub mod stream_guard;
pub mod upstream;

pub use cli::{run, run_keys, GatewayArgs, KeysArgs, KeysCommand};
pub use config::{Config, ConfigHandle};
pub use server::{router, spawn, RunningGateway};
pub use state::{CreateKey, Gateway, GatewayOptions};
