//! Drivers: what actually starts and stops replicas. The control loop only says how many
//! it wants; a driver makes it so and reports what happened.
//!
//! - [`local::LocalDriver`] runs `strata engine` processes on this machine.
//! - [`kubernetes::KubernetesDriver`] scales a Deployment or LeaderWorkerSet through the
//!   API server (cargo feature `kubernetes`, off in the `strata` binary's default build);
//!   [`kubernetes_rollout`] moves a canary's traffic by HTTPRoute weights and reads each
//!   version's pods' metrics.

use std::fmt;
use std::future::Future;

use serde::Serialize;

#[cfg(feature = "kubernetes")]
pub mod kubernetes;
#[cfg(feature = "kubernetes")]
pub mod kubernetes_rollout;
pub mod local;

/// Where a replica is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaPhase {
    /// Started, not yet answering `/health`.
    Starting,
    /// Answering `/health`; registered with the router.
    Ready,
    /// Deregistered; finishing its requests before it is stopped.
    Draining,
}

/// A replica as the control loop sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaInfo {
    /// Unique for the driver's lifetime, e.g. `local-3`.
    pub id: String,
    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    pub phase: ReplicaPhase,
}

/// Something that happened to a replica, reported by [`Driver::reconcile`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "event")]
pub enum ReplicaEvent {
    Started {
        id: String,
        url: String,
    },
    Ready {
        id: String,
        url: String,
        after_secs: f64,
    },
    /// It did not become ready in time: it was killed and will be replaced.
    NeverReady {
        id: String,
        waited_secs: f64,
    },
    /// It exited without being asked to.
    Exited {
        id: String,
        status: String,
    },
    /// Scale-in: deregistered and draining.
    Draining {
        id: String,
    },
    /// Stopped after draining.
    Stopped {
        id: String,
        forced: bool,
    },
}

impl ReplicaEvent {
    /// A short name for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            ReplicaEvent::Started { .. } => "started",
            ReplicaEvent::Ready { .. } => "ready",
            ReplicaEvent::NeverReady { .. } => "never_ready",
            ReplicaEvent::Exited { .. } => "exited",
            ReplicaEvent::Draining { .. } => "draining",
            ReplicaEvent::Stopped { .. } => "stopped",
        }
    }

    /// Whether this is a fault an operator should hear about.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            ReplicaEvent::NeverReady { .. } | ReplicaEvent::Exited { .. }
        )
    }
}

impl fmt::Display for ReplicaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplicaEvent::Started { id, url } => write!(f, "{id} started at {url}"),
            ReplicaEvent::Ready {
                id,
                url,
                after_secs,
            } => write!(f, "{id} ready at {url} after {after_secs:.1} s"),
            ReplicaEvent::NeverReady { id, waited_secs } => write!(
                f,
                "{id} not ready after {waited_secs:.1} s: killed, to be replaced"
            ),
            ReplicaEvent::Exited { id, status } => {
                write!(f, "{id} exited unexpectedly ({status}): to be replaced")
            }
            ReplicaEvent::Draining { id } => write!(f, "{id} deregistered, draining"),
            ReplicaEvent::Stopped { id, forced } => {
                if *forced {
                    write!(f, "{id} killed after the stop grace period")
                } else {
                    write!(f, "{id} stopped")
                }
            }
        }
    }
}

/// A driver failure. The control loop logs it and tries again next tick.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("could not start a replica: {0}")]
    Spawn(String),
    #[error("no free loopback port: {0}")]
    Port(String),
    /// The Kubernetes API server failed, refused or did not answer in time.
    #[error("Kubernetes API: {0}")]
    Api(String),
    /// The driver cannot be set up (no kubeconfig, a bad client setting).
    #[error("driver configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Other(String),
}

/// Starts and stops replicas.
pub trait Driver: Send {
    /// The driver's name for logs (`local`, `kubernetes`).
    fn name(&self) -> &'static str;

    /// Notices what changed since the last call (ready, crashed, never ready), then starts
    /// or stops replicas so that `desired` are starting or ready. Never blocks on a drain.
    fn reconcile(
        &mut self,
        desired: u32,
    ) -> impl Future<Output = Result<Vec<ReplicaEvent>, DriverError>> + Send;

    /// The replicas now (draining ones included).
    fn replicas(&self) -> Vec<ReplicaInfo>;

    /// Drains and stops every replica.
    fn shutdown(&mut self) -> impl Future<Output = Vec<ReplicaEvent>> + Send;
}

/// Tells the router which replicas serve. The lead's router implements it; the driver
/// calls `register` only once a replica answers `/health`, and `deregister` before it
/// drains one.
pub trait ReplicaRegistrar: Send + Sync {
    fn register(&self, replica: &ReplicaInfo);
    fn deregister(&self, id: &str);
    /// Requests the router is holding because no replica is ready (scale-from-zero
    /// activation). Zero when the router does not hold requests.
    fn held_requests(&self) -> u32 {
        0
    }
}

/// A registrar that tells nobody (the controller running alone).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoRegistrar;

impl ReplicaRegistrar for NoRegistrar {
    fn register(&self, _replica: &ReplicaInfo) {}
    fn deregister(&self, _id: &str) {}
}
