//! What `strata up` prints on this terminal: each pool as it starts, and once every pool
//! has its minimum ready, where the stack answers (API, dashboard, controller, gateway).

use std::net::SocketAddr;
use std::time::Duration;

use strata_controller::autoscale::AutoscaleConfig;
use strata_controller::driver::ReplicaPhase;

use super::pool::Pool;
use crate::fleet::Fleet;
use crate::pools::PoolSpec;

/// The start lines: each pool's count (or bounds) and model.
pub(super) fn print_pools(specs: &[PoolSpec]) {
    for p in specs {
        let a = &p.autoscale;
        if let Some(role) = &p.role {
            eprintln!("strata up: {} x {} ({role})", a.min_replicas, p.model);
        } else if a.min_replicas == a.max_replicas {
            eprintln!("strata up: {} x {}", a.min_replicas, p.model);
        } else {
            eprintln!(
                "strata up: {}..{} x {} (autoscaling)",
                a.min_replicas, a.max_replicas, p.model
            );
        }
    }
}

/// One pool in the "Strata is up" banner.
struct PoolLine {
    name: String,
    /// `N replica(s)` and the autoscaling bounds, if any.
    count: String,
    scaling: String,
    adapters: Vec<String>,
    /// Its replicas, and how many must be ready before the stack is up.
    fleet: Fleet,
    min_ready: u32,
}

/// The "Strata is up" banner, printed once every pool has its minimum ready.
pub(super) struct Banner {
    front: SocketAddr,
    disaggregated: bool,
    pools: Vec<PoolLine>,
    /// The served names the front answers for.
    names: Vec<String>,
    /// The gateway's URL and the API key generated for this run.
    gateway: Option<(String, String)>,
    /// With `--tls`: the CA file clients verify the stack with.
    ca: Option<std::path::PathBuf>,
}

impl Banner {
    pub fn new(
        front: SocketAddr,
        disaggregated: bool,
        pools: &[Pool],
        names: Vec<String>,
    ) -> Banner {
        let pools = pools
            .iter()
            .map(|p| {
                let (count, scaling) = bounds(&p.spec.autoscale);
                PoolLine {
                    name: p.spec.name.clone(),
                    count,
                    scaling,
                    adapters: p.spec.adapter_names(),
                    fleet: p.fleet.clone(),
                    min_ready: p.spec.autoscale.min_replicas,
                }
            })
            .collect();
        Banner {
            front,
            disaggregated,
            pools,
            names,
            gateway: None,
            ca: None,
        }
    }

    /// Every URL `https://`, and the CA file to verify them with.
    pub fn with_tls(mut self, ca: std::path::PathBuf) -> Banner {
        self.ca = Some(ca);
        self
    }

    /// Names the gateway once it listens (its port may have been picked at bind time).
    pub fn with_gateway(mut self, url: String, key: String) -> Banner {
        self.gateway = Some((url, key));
        self
    }

    /// Waits until every pool has its minimum of ready replicas, then prints the banner.
    pub async fn print_when_ready(&self) {
        while self.pools.iter().any(|p| {
            let ready = p
                .fleet
                .replicas()
                .iter()
                .filter(|r| !r.canary && r.info.phase == ReplicaPhase::Ready)
                .count();
            (ready as u32) < p.min_ready
        }) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.print();
    }

    fn print(&self) {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        let front = format!("{scheme}://{}", self.front);
        let with = |adapters: &[String]| {
            if adapters.is_empty() {
                String::new()
            } else {
                format!(" (adapters: {})", adapters.join(", "))
            }
        };
        match (self.disaggregated, self.pools.as_slice()) {
            (true, [decode, prefill]) => {
                let n = |s: &str| s.trim_end_matches(" replica(s)").to_string();
                let name = &decode.name;
                println!(
                    "Strata is up: {} prefill + {} decode replica(s) of {name} (disaggregated)",
                    n(&prefill.count),
                    n(&decode.count)
                );
                println!("  OpenAI API: {front}/v1   (model \"{name}\")");
            }
            (_, [p]) => {
                println!(
                    "Strata is up: {} of {}{}{}",
                    p.count,
                    p.name,
                    p.scaling,
                    with(&p.adapters)
                );
                println!("  OpenAI API: {front}/v1   (model \"{}\")", p.name);
            }
            _ => {
                println!("Strata is up: {} models", self.pools.len());
                for p in &self.pools {
                    println!(
                        "  model {}: {}{}{}",
                        p.name,
                        p.count,
                        p.scaling,
                        with(&p.adapters)
                    );
                }
                println!(
                    "  OpenAI API: {front}/v1   (models: {})",
                    self.names.join(", ")
                );
            }
        }
        println!("  dashboard:  {front}/ui");
        match &self.ca {
            Some(ca) => println!(
                "  controller: {front}/controller/status   (rollouts: strata rollout --url {front} --ca-file {})",
                ca.display()
            ),
            None => println!(
                "  controller: {front}/controller/status   (rollouts: strata rollout --url {front})"
            ),
        }
        if let Some((url, key)) = &self.gateway {
            println!("  gateway:    {url}/v1   (API key: {key})");
        }
        if let Some(ca) = &self.ca {
            println!("  TLS CA:     {}   (e.g. curl --cacert it)", ca.display());
        }
    }
}

/// `N replica(s)`, and the bounds when it autoscales: the banner's words for a pool.
fn bounds(a: &AutoscaleConfig) -> (String, String) {
    let count = format!("{} replica(s)", a.min_replicas);
    if a.min_replicas == a.max_replicas {
        (count, String::new())
    } else {
        (
            count,
            format!(", autoscaling {}..{}", a.min_replicas, a.max_replicas),
        )
    }
}
