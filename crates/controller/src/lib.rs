//! Strata's lifecycle controller: it watches what engines report, adds and removes
//! replicas ahead of need, and replaces model versions safely.
//!
//! - [`autoscale`]: the autoscaling policy, a pure function (no clock, no I/O).
//! - [`rollout`]: canary analysis, a pure function; [`rollout_runner`] applies it live;
//!   [`rollout_client`] is `strata rollout`, the client of the API `strata up` serves.
//! - [`registry`]: model digests, ed25519 signing and verification ([`verify_model`]).
//! - [`signals`]: reading engine `/metrics` into the policy's load sample.
//! - [`tls_client`]: the HTTP clients, verifying `https://` servers against an operator's CA.
//! - [`driver`]: the [`driver::Driver`] trait and the local process driver.
//! - [`controller`]: the control loop.
//! - `keda`: the KEDA external scaler (gRPC) exposing the controller's judgement.
//! - `kubernetes_rollouts`: the rollout API on Kubernetes (HTTPRoute weights).
//! - [`cli`]: `strata controller` and `strata model keygen|sign|verify`, wired by `strata`.
//!
//! Everything but `autoscale`, `rollout` and `registry` sits behind the default `runtime`
//! feature: `default-features = false` links only the pure policies and the registry. The
//! Kubernetes parts (the driver, `kubernetes_rollouts`, `keda`) sit behind `kubernetes`,
//! also default here; the `strata` binary turns it on with its own `kubernetes` feature.

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
pub mod autoscale;
pub mod registry;
pub mod rollout;

#[cfg(feature = "runtime")]
pub mod cli;
#[cfg(feature = "runtime")]
pub mod config;
#[cfg(feature = "runtime")]
pub mod controller;
#[cfg(feature = "runtime")]
pub mod driver;
#[cfg(feature = "runtime")]
pub mod held;
#[cfg(feature = "runtime")]
pub mod http;
#[cfg(feature = "kubernetes")]
pub mod keda;
#[cfg(feature = "kubernetes")]
pub mod kubernetes_rollouts;
#[cfg(feature = "runtime")]
pub mod metrics;
#[cfg(feature = "runtime")]
pub mod rollout_client;
#[cfg(feature = "runtime")]
pub mod rollout_runner;
#[cfg(feature = "runtime")]
pub mod signals;
#[cfg(feature = "runtime")]
pub mod tls_client;

#[cfg(feature = "runtime")]
pub use cli::{
    run, run_keygen, run_sign, run_verify, serve, ControllerArgs, ModelKeygenArgs, ModelSignArgs,
    ModelVerifyArgs,
};
#[cfg(feature = "runtime")]
pub use config::ControllerConfig;
pub use registry::{verify_model, Digest, VerifyError};
