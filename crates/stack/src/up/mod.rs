//! `strata up`: pulls the model, runs engine replicas under the lifecycle controller (its
//! control loop over the local driver, autoscaling between `autoscale.minReplicas` and
//! `maxReplicas`; `--replicas N` pins N), puts the router in front of them on one port with
//! the dashboard at `/ui` and the controller at `/controller/...`, and on Ctrl-C drains and
//! stops everything.
//!
//! A replica is registered with the router only once it answers `/health`; a replica that
//! crashes is deregistered at once and replaced after an exponential backoff (1 s, 2 s, 4 s
//! ... up to 30 s; reset when a replacement becomes ready). With `minReplicas: 0` the front
//! holds requests while no replica is ready ([`crate::front`]) and the controller starts
//! one for them. Canary rollouts: [`crate::rollout`].
//!
//! Disaggregated serving (`--prefill-replicas N --decode-replicas M`, PROTOCOLS §11): two
//! fixed-size groups of the one model, `strata engine --kv-role prefill --kv-transfer-port
//! <free port>` and `--kv-role decode`, registered with the router under the same served
//! name and their `role` label; the router runs llm-d's profile pair (decode pick first, a
//! prefill pick when its uncached prompt tokens reach `--pd-threshold`) and the two-phase
//! proxy. `--kv-tier-bytes B` also starts `strata kv-tier` on a free loopback port and
//! passes `--kv-tier` to every engine. Fixed counts only: autoscaling and `models:` are
//! refused in this mode.
//!
//! The process, in steps of a file each:
//! - [`config`] (with [`args`]): `strata.yaml` and the flags over it, checked once into a
//!   [`StackConfig`];
//! - [`build`]: every piece made and wired, nothing serving yet ([`pool`] for one pool,
//!   [`routing`], [`kv_tier`], [`gateway`], [`view`] for the dashboard, [`engine_keys`]: the
//!   engines require an API key the router sends, and an admin key; [`tls`]: with
//!   `--tls`, a CA made at start and a certificate per service);
//! - [`serve`]: the pieces started, the [`banner`] once ready, and on Ctrl-C or SIGTERM
//!   shutdown done once ([`shutdown`]: the front drains within the grace period; then
//!   [`control`]: the replicas stop).

mod args;
mod banner;
mod build;
mod config;
mod control;
mod engine_keys;
mod gateway;
mod kv_tier;
mod pool;
mod routing;
mod serve;
mod shutdown;
mod tls;
mod view;

pub use args::UpArgs;
pub use config::{StackConfig, StackConfigError};

use strata_api::http::shutdown_signal;

use build::Stack;
use serve::Running;

/// Runs the stack until Ctrl-C or SIGTERM.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let cfg = StackConfig::load(&args)?;
    let stack = Stack::build(&cfg).await?;
    let running = Running::start(stack).await?;
    running.serve_until(shutdown_signal()).await;
    running.shut_down().await;
    Ok(())
}
