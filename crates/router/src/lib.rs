//! Strata's router: sends each request to the replica that will answer it soonest.
//!
//! Shaped like the Gateway API Inference Extension / llm-d endpoint picker:
//!
//! - **data layer** ([`datalayer`], [`endpoint`]): endpoints and their engine kinds,
//!   `/metrics` scraping into one [`scheduling::EndpointMetrics`] per endpoint, `/health`
//!   readiness gating, staleness, and KV-event subscribers feeding the precise index;
//! - **prefix indexes** ([`prefix`]): approximate (prompt-text chunks the router sent) and
//!   precise (block hashes from KV events), plus vLLM-compatible block hashing;
//! - **scheduling** ([`scheduling`]): filters → weighted scorers → picker in named
//!   profiles, configured in llm-d's `EndpointPickerConfig` shape; pure (no clock, I/O or
//!   tokio), so the simulator runs it in virtual time;
//! - **request control** ([`router`], [`admission`], [`circuit`]): flow control (priority
//!   bands, fair shares between flows, bounded queues, held requests), traffic
//!   splits, circuit breakers, in-flight accounting: the [`Router`] handle the gateway
//!   embeds and the controller drives;
//! - **transport** ([`proxy`], [`server`]): the OpenAI-compatible HTTP front that streams
//!   through, retries before the first byte, and exports [`telemetry`]; and `extproc`,
//!   the Gateway API Inference Extension endpoint picker over Envoy's ext_proc gRPC
//!   (cargo feature `ext-proc`);
//! - **discovery** (`k8s`): endpoints from an `InferencePool` and its pods, watched
//!   through the Kubernetes API (cargo feature `kubernetes`).
//!
//! Both features are on by default for this crate; the `strata` binary turns them on
//! with its own `kubernetes` feature, so a one-machine build compiles neither.
//!
//! Entry points for the CLI: [`RouterArgs`] and [`run`].

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
pub mod admission;
pub mod auth;
pub mod circuit;
pub mod client;
pub mod config;
pub mod datalayer;
pub mod endpoint;
#[cfg(feature = "ext-proc")]
pub mod extproc;
pub mod headers;
pub mod intake;
#[cfg(feature = "kubernetes")]
pub mod k8s;
pub mod objectives;
pub mod prefix;
pub mod proxy;
pub mod response_homes;
pub mod router;
pub mod scheduling;
pub mod server;
pub mod telemetry;
pub mod usage;

pub use config::RouterConfig;
pub use endpoint::{EndpointId, EndpointSpec, EngineKind};
pub use router::{Lease, Picked, PoolError, RouteError, Router};
pub use scheduling::{EndpointPicker, EndpointPickerConfig, TrafficSplit};
pub use server::{run, RouterArgs};
