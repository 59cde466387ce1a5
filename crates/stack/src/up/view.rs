//! The stack as the dashboard and `/controller/pools` see it: every pool's replicas (both
//! versions of the first pool during a rollout) joined with the router's view of them,
//! and each pool's controller status.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_controller::controller::Status;
use strata_router::Router;

use super::pool::Pool;
use crate::dashboard::{PoolView, ReplicaView, StackView};
use crate::fleet::Fleet;
use crate::pools::PoolSpec;
use crate::rollout::Rollouts;

/// One pool as the dashboard and `/controller/pools` see it.
struct PoolHandle {
    spec: PoolSpec,
    fleet: Fleet,
    status: Arc<Mutex<Status>>,
}

/// What the dashboard shows: every pool's replicas (both versions of the first pool during
/// a rollout) joined with the router's view, and the controllers' desired vs ready counts.
pub(super) struct View {
    router: Router,
    pools: Vec<PoolHandle>,
    rollouts: Rollouts,
    /// The gateway in front of the router, if the stack runs one.
    gateway: Option<Arc<strata_gateway::Gateway>>,
}

impl View {
    pub fn new(
        router: Router,
        pools: &[Pool],
        rollouts: Rollouts,
        gateway: Option<Arc<strata_gateway::Gateway>>,
    ) -> View {
        let pools = pools
            .iter()
            .map(|p| PoolHandle {
                spec: p.spec.clone(),
                fleet: p.fleet.clone(),
                status: p.status.clone(),
            })
            .collect();
        View {
            router,
            pools,
            rollouts,
            gateway,
        }
    }

    pub fn pool_views(&self) -> Vec<PoolView> {
        self.pools
            .iter()
            .map(|p| {
                let s = p.status.lock().unwrap_or_else(|e| e.into_inner());
                PoolView {
                    name: match &p.spec.role {
                        Some(role) => format!("{} ({role})", p.spec.name),
                        None => p.spec.name.clone(),
                    },
                    model: p.spec.model.clone(),
                    adapters: p.spec.adapter_names(),
                    min_replicas: p.spec.autoscale.min_replicas,
                    max_replicas: p.spec.autoscale.max_replicas,
                    desired: s.desired,
                    ready: s.ready,
                    reason: s.last.as_ref().and_then(|l| {
                        serde_json::to_value(l.decision.reason)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_string))
                    }),
                }
            })
            .collect()
    }
}

impl StackView for View {
    fn replicas(&self) -> Vec<ReplicaView> {
        let routed = self.router.status();
        let several = self.pools.len() > 1;
        let mut out: Vec<ReplicaView> = Vec::new();
        for pool in &self.pools {
            // Replica ids restart at 1 in every pool: the pool's name tells them apart.
            let label = |id: &str| match &pool.spec.role {
                Some(role) => format!("{role} {id}"),
                None if several => format!("{} {id}", pool.spec.name),
                None => id.to_string(),
            };
            out.extend(pool.fleet.replicas().into_iter().map(|r| {
                let s = routed.iter().find(|s| s.spec.url == r.info.url);
                ReplicaView {
                    name: if r.canary {
                        format!("canary {}", label(&r.info.id))
                    } else {
                        label(&r.info.id)
                    },
                    url: r.info.url.clone(),
                    state: serde_json::to_value(r.info.phase)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_string))
                        .unwrap_or_default(),
                    ready: s.is_some_and(|s| s.ready),
                    model: r.version.clone(),
                    adapters: s.map(|s| s.spec.lora.clone()).unwrap_or_default(),
                    pool: pool.spec.name.clone(),
                }
            }));
            let backing_off = pool
                .status
                .lock()
                .map(|s| s.backing_off)
                .unwrap_or_default();
            for i in 0..backing_off {
                out.push(ReplicaView {
                    name: label(&format!("(replacement {})", i + 1)),
                    url: String::new(),
                    state: "restarting".to_string(),
                    ready: false,
                    model: String::new(),
                    adapters: Vec::new(),
                    pool: pool.spec.name.clone(),
                });
            }
        }
        out
    }

    fn router_metrics(&self) -> Option<String> {
        Some(self.router.metrics().encode())
    }

    fn gateway_metrics(&self) -> Option<String> {
        self.gateway.as_ref().map(|g| g.metrics.render())
    }

    fn load(&self, url: &str) -> Option<Arc<strata_api::model_server::LoadSample>> {
        // The dashboard ticks once a second; a page older than a few ticks is no reading.
        self.router
            .load_sample(url)
            .filter(|(_, age)| *age <= Duration::from_secs(3))
            .map(|(load, _)| load)
    }

    /// The pools' desired and ready counts summed; the reason and signal are the first
    /// pool's (each pool's own are in [`StackView::pools`]).
    fn controller(&self) -> Option<serde_json::Value> {
        let (mut desired, mut ready) = (0u32, 0u32);
        let mut first = None;
        for (i, p) in self.pools.iter().enumerate() {
            let s = p.status.lock().ok()?;
            desired = desired.saturating_add(s.desired);
            ready = ready.saturating_add(s.ready);
            if i == 0 {
                first = s
                    .last
                    .as_ref()
                    .map(|l| (l.decision.reason, l.decision.signal));
            }
        }
        let rollout = self.rollouts.view().map(|v| {
            serde_json::json!({
                "canary": v.canary,
                "baseline": v.baseline,
                "phase": v.state.phase,
                "weight": v.state.weight,
            })
        });
        Some(serde_json::json!({
            "desired": desired,
            "ready": ready,
            "reason": first.map(|f| f.0),
            "signal": first.map(|f| f.1),
            "rollout": rollout,
        }))
    }

    fn pools(&self) -> Vec<PoolView> {
        self.pool_views()
    }
}
