//! Strata's gateway: the OpenAI-compatible front that decides who may call which model,
//! how much, at what cost, and where the request goes.
//!
//! Code map:
//! * [`config`]: `gateway.yaml` types, validation, hot reload ([`config::ConfigHandle`]).
//! * [`store`]: the [`store::Store`] trait, its SQLite implementation (the default) and its
//!   PostgreSQL one (replicas sharing keys, budget holds, the ledger and audit log).
//! * [`keys`]: key format, salted hashing, constant-time verification, header parsing.
//! * [`auth`]: who is calling (API key, JWT bearer token verified against a JWKS, admin
//!   key) as a [`auth::Caller`] with a [`role::Role`].
//! * [`budget`]: pure budget policy (UTC daily/weekly/monthly windows, spend, exhaustion);
//!   [`clock`]: the injected wall clock it is read with; [`caller_budgets`]: the budgets
//!   of a caller and whether one is spent.
//! * [`ratelimit`]: pure GCRA plus in-memory and Redis (Lua) backends.
//! * [`cache`]: exact-match response cache, keyed per tenant (memory LRU or Redis).
//! * [`semantic`]: the semantic cache (similar last user message, exact context, per
//!   tenant and model; in-memory index), [`semantic_share`] (its entries shared across
//!   replicas through a Redis stream) and [`sse_answer`] (a streamed answer as a whole
//!   one and back, so both kinds of request share the caches).
//! * [`guardrails`]: pluggable checks before and after the model (patterns, prompt size).
//! * [`routing`]: pure plan of tries (weighted targets, fallbacks, per-upstream prices),
//!   failure classes; [`retry`]: the pure retry policy (backoff with jitter,
//!   `Retry-After`).
//! * [`provider`]: hosted providers (OpenAI, Anthropic, OpenAI-compatible): keys from an
//!   environment variable or file, each one's auth headers and routes, and a chat
//!   request sent to Anthropic's Messages API (through [`translate`]) and back.
//! * [`translate`]: chat completions ⇄ Anthropic Messages and OpenAI Responses (requests,
//!   answers, streams), pure; [`anthropic`] and [`responses`] serve those APIs through the
//!   proxy's stages as chat requests ([`via_chat`]), or pass them through to upstreams
//!   that speak them ([`passthrough`]).
//! * [`cascade`]: pure cascade policy (which model first, whether an answer escalates).
//! * [`proxy`]: the request path as stages (admit → lookup → plan → try → respond →
//!   settle), one file each; tries go to a fixed base URL or through an embedded router
//!   ([`config::EmbeddedRouter`]).
//! * [`stream_guard`]: output guardrails on streamed answers (hold-back window).
//! * [`state`]: [`state::Gateway`], the shared state and in-memory mirror of keys and spend.
//! * [`server`]: routes, admin API, serving and config watching.
//! * [`upstream`]: the upstream HTTP client (hyper's pooled HTTP/1.1 client, `https://`
//!   over rustls: system roots plus a per-upstream `ca_file`), URIs and auth parsed at load.
//! * [`metrics`]: Prometheus metrics.
//! * [`cli`]: [`GatewayArgs`], [`run`], [`KeysArgs`], [`run_keys`].

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
pub mod admin;
pub mod anthropic;
pub mod apis;
pub mod auth;
pub mod budget;
pub mod cache;
pub mod caller_budgets;
pub mod cascade;
pub mod cli;
pub mod clock;
pub mod config;
pub mod guardrails;
pub mod keys;
pub mod metrics;
pub mod passthrough;
pub mod provider;
pub mod proxy;
pub mod ratelimit;
pub mod redis_conn;
pub mod responses;
pub mod restart_only;
pub mod retry;
pub mod role;
pub mod routing;
pub mod semantic;
pub mod semantic_share;
pub mod server;
pub mod sse_answer;
pub mod state;
pub mod store;
pub mod stream_guard;
pub mod translate;
pub mod upstream;
pub mod via_chat;

pub use cli::{run, run_keys, GatewayArgs, KeysArgs, KeysCommand};
pub use config::{Config, ConfigHandle};
pub use server::{router, spawn, RunningGateway};
pub use state::{CreateKey, Gateway, GatewayOptions};
