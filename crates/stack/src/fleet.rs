//! The replicas of `strata up`: the serving version's [`LocalDriver`] (the *primary*,
//! scaled by the controller's loop) and, during a rollout, a second one running the
//! canary version at a fixed count.
//!
//! [`FleetDriver`] is the [`Driver`] the controller's loop ticks: each reconcile scales
//! the primary to the policy's count and keeps the canary at its count. The canary's
//! crashes are counted for the rollout's health check and never reach the controller
//! (its backoff is for the primary). Promotion swaps the two (the old primary is drained
//! and stopped in the background, only then); dropping the canary stops it the same way.
//!
//! Every replica is registered with the router under the public model name, labelled
//! with its version as the endpoint `group`, so the router's [`TrafficSplit`] can move
//! traffic between versions. Invariant: a URL is in [`GroupMap`] exactly while its
//! replica is registered.
//!
//! [`TrafficSplit`]: strata_router::TrafficSplit

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use strata_controller::driver::local::LocalDriver;
use strata_controller::driver::{
    Driver, DriverError, ReplicaEvent, ReplicaInfo, ReplicaPhase, ReplicaRegistrar,
};
use strata_router::{EndpointSpec, EngineKind, Router};

/// Which version each registered replica serves, by `host:port` (the form the router
/// names the serving endpoint in its `x-gateway-destination-endpoint-served` header).
#[derive(Debug, Default, Clone)]
pub struct GroupMap(Arc<RwLock<HashMap<String, String>>>);

impl GroupMap {
    fn key(url: &str) -> &str {
        url.trim_start_matches("http://")
            .trim_start_matches("https://")
            .trim_end_matches('/')
    }

    pub fn group_of(&self, endpoint: &str) -> Option<String> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(Self::key(endpoint))
            .cloned()
    }

    fn insert(&self, url: &str, group: &str) {
        self.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(Self::key(url).to_string(), group.to_string());
    }

    fn remove(&self, url: &str) {
        self.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(Self::key(url));
    }
}

/// Registers one version's ready replicas with the in-process router.
pub struct RouterRegistrar {
    router: Router,
    /// The name clients send.
    served_model: String,
    /// The version: the endpoints' `group` label.
    group: String,
    groups: GroupMap,
    /// Requests the front holds while no replica is ready (scale-from-zero activation).
    held: Arc<AtomicU32>,
    /// LoRA adapters every replica serves (the pool's `adapters`), for the router's model
    /// filter and LoRA affinity.
    lora: Vec<String>,
    /// Disaggregated serving: the replicas' `role` label (`prefill`, `decode`).
    role: Option<String>,
    urls: Mutex<HashMap<String, String>>,
}

impl RouterRegistrar {
    pub fn new(
        router: Router,
        served_model: String,
        group: String,
        groups: GroupMap,
        held: Arc<AtomicU32>,
    ) -> RouterRegistrar {
        RouterRegistrar {
            router,
            served_model,
            group,
            groups,
            held,
            lora: Vec::new(),
            role: None,
            urls: Mutex::default(),
        }
    }

    /// Registers every replica with this `role` label (the router's profile pair reads it).
    pub fn with_role(mut self, role: Option<String>) -> RouterRegistrar {
        self.role = role;
        self
    }

    /// Registers every replica as serving these adapters too.
    pub fn with_adapters(mut self, lora: Vec<String>) -> RouterRegistrar {
        self.lora = lora;
        self
    }
}

impl ReplicaRegistrar for RouterRegistrar {
    fn register(&self, replica: &ReplicaInfo) {
        let mut spec = EndpointSpec::new(replica.url.clone(), EngineKind::Strata);
        spec.model = Some(self.served_model.clone());
        spec.group = Some(self.group.clone());
        spec.lora = self.lora.clone();
        spec.role = self.role.clone();
        match self.router.add_endpoint(spec) {
            Ok(_) => {
                self.groups.insert(&replica.url, &self.group);
                self.urls
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(replica.id.clone(), replica.url.clone());
            }
            Err(e) => tracing::warn!(replica = %replica.id, error = %e, "router refused a replica"),
        }
    }

    fn deregister(&self, id: &str) {
        let url = self
            .urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(url) = url {
            self.groups.remove(&url);
            if let Err(e) = self.router.remove_endpoint(&url) {
                tracing::debug!(replica = %id, error = %e, "already gone from the router");
            }
        }
    }

    fn held_requests(&self) -> u32 {
        self.held.load(Ordering::Acquire)
    }
}

/// One version's replicas.
pub struct Member {
    pub version: String,
    driver: LocalDriver,
}

impl Member {
    pub fn new(version: String, driver: LocalDriver) -> Member {
        Member { version, driver }
    }
}

struct Canary {
    member: Member,
    desired: u32,
    /// Crashed or never-ready replicas since the canary started.
    faults: u32,
    /// Its recent replica events, newest last (bounded).
    events: Vec<ReplicaEvent>,
}

struct Inner {
    primary: Member,
    canary: Option<Canary>,
    /// Versions being drained and stopped after a promotion or a rollback.
    retiring: tokio::task::JoinSet<()>,
}

/// A replica of either version, for views.
#[derive(Debug, Clone)]
pub struct VersionedReplica {
    pub version: String,
    pub canary: bool,
    pub info: ReplicaInfo,
}

/// What the rollout reads about its canary.
#[derive(Debug, Clone, Default)]
pub struct CanaryHealth {
    pub replicas: Vec<ReplicaInfo>,
    pub ready: u32,
    pub faults: u32,
}

/// Both versions' drivers, shared by the controller's loop ([`FleetDriver`]), the rollout
/// and the dashboard.
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<tokio::sync::Mutex<Inner>>,
    /// The replicas as of the last reconcile, for readers that find the lock taken.
    snapshot: Arc<Mutex<Vec<VersionedReplica>>>,
}

fn snapshot_of(inner: &Inner) -> Vec<VersionedReplica> {
    let mut out: Vec<VersionedReplica> = inner
        .primary
        .driver
        .replicas()
        .into_iter()
        .map(|info| VersionedReplica {
            version: inner.primary.version.clone(),
            canary: false,
            info,
        })
        .collect();
    if let Some(c) = &inner.canary {
        out.extend(
            c.member
                .driver
                .replicas()
                .into_iter()
                .map(|info| VersionedReplica {
                    version: c.member.version.clone(),
                    canary: true,
                    info,
                }),
        );
    }
    out
}

impl Fleet {
    pub fn new(primary: Member) -> Fleet {
        Fleet {
            inner: Arc::new(tokio::sync::Mutex::new(Inner {
                primary,
                canary: None,
                retiring: tokio::task::JoinSet::new(),
            })),
            snapshot: Arc::default(),
        }
    }

    /// The driver the controller's loop owns.
    pub fn driver(&self) -> FleetDriver {
        FleetDriver(self.clone())
    }

    /// The serving version.
    pub async fn primary_version(&self) -> String {
        self.inner.lock().await.primary.version.clone()
    }

    /// Every replica of both versions (draining ones included).
    pub fn replicas(&self) -> Vec<VersionedReplica> {
        match self.inner.try_lock() {
            Ok(inner) => snapshot_of(&inner),
            Err(_) => self
                .snapshot
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }

    /// Starts a canary version at `desired` replicas (at the next reconcile). Refused
    /// while one runs.
    pub async fn start_canary(&self, member: Member, desired: u32) -> Result<(), String> {
        let mut inner = self.inner.lock().await;
        if let Some(c) = &inner.canary {
            return Err(format!("canary {} is running", c.member.version));
        }
        inner.canary = Some(Canary {
            member,
            desired,
            faults: 0,
            events: Vec::new(),
        });
        Ok(())
    }

    pub async fn canary_health(&self) -> CanaryHealth {
        let inner = self.inner.lock().await;
        match &inner.canary {
            Some(c) => {
                let replicas = c.member.driver.replicas();
                let ready = replicas
                    .iter()
                    .filter(|r| r.phase == ReplicaPhase::Ready)
                    .count();
                CanaryHealth {
                    replicas,
                    ready: u32::try_from(ready).unwrap_or(u32::MAX),
                    faults: c.faults,
                }
            }
            None => CanaryHealth::default(),
        }
    }

    /// The canary becomes the primary (the controller scales it from now on); the old
    /// primary is deregistered, drained and stopped in the background.
    pub async fn promote(&self) -> Result<String, String> {
        let mut inner = self.inner.lock().await;
        let Some(c) = inner.canary.take() else {
            return Err("no canary is running".into());
        };
        let old = std::mem::replace(&mut inner.primary, c.member);
        tracing::info!(old = %old.version, new = %inner.primary.version, "promoted; stopping the old version");
        let version = old.version.clone();
        inner.retiring.spawn(retire(old));
        *self.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = snapshot_of(&inner);
        Ok(version)
    }

    /// Stops the canary (drained first), if one runs.
    pub async fn drop_canary(&self) {
        let mut inner = self.inner.lock().await;
        if let Some(c) = inner.canary.take() {
            tracing::info!(canary = %c.member.version, "stopping the canary");
            inner.retiring.spawn(retire(c.member));
        }
        *self.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = snapshot_of(&inner);
    }
}

async fn retire(mut m: Member) {
    for e in m.driver.shutdown().await {
        tracing::info!(version = %m.version, event = %e, "replica");
    }
}

/// The controller loop's view of the fleet: the policy's count applies to the primary.
pub struct FleetDriver(Fleet);

impl Driver for FleetDriver {
    fn name(&self) -> &'static str {
        "local"
    }

    async fn reconcile(&mut self, desired: u32) -> Result<Vec<ReplicaEvent>, DriverError> {
        let fleet = &self.0;
        let mut inner = fleet.inner.lock().await;
        while inner.retiring.try_join_next().is_some() {}
        let result = inner.primary.driver.reconcile(desired).await;
        if let Some(c) = &mut inner.canary {
            let version = c.member.version.clone();
            match c.member.driver.reconcile(c.desired).await {
                Ok(events) => {
                    for e in events {
                        if e.is_fault() {
                            c.faults += 1;
                            tracing::warn!(canary = %version, event = %e, "canary replica fault");
                        } else {
                            tracing::info!(canary = %version, event = %e, "canary replica");
                        }
                        c.events.push(e);
                    }
                    let n = c.events.len();
                    if n > 64 {
                        c.events.drain(..n - 64);
                    }
                }
                Err(e) => {
                    c.faults += 1;
                    tracing::warn!(canary = %version, error = %e, "canary driver failed");
                }
            }
        }
        *fleet.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = snapshot_of(&inner);
        result
    }

    fn replicas(&self) -> Vec<ReplicaInfo> {
        match self.0.inner.try_lock() {
            Ok(inner) => inner.primary.driver.replicas(),
            Err(_) => self
                .0
                .snapshot
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .filter(|r| !r.canary)
                .map(|r| r.info.clone())
                .collect(),
        }
    }

    async fn shutdown(&mut self) -> Vec<ReplicaEvent> {
        let mut inner = self.0.inner.lock().await;
        let mut events = inner.primary.driver.shutdown().await;
        if let Some(mut c) = inner.canary.take() {
            events.extend(c.member.driver.shutdown().await);
        }
        while inner.retiring.join_next().await.is_some() {}
        self.0
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        events
    }
}
