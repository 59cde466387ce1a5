//! Building the stack: every piece made and wired together, in the order each needs the
//! ones before it, and nothing serving yet. With `--tls` the certificates first
//! ([`super::tls`]), then the KV tier (every engine is told where
//! it is), then the models (pulled once, before any replica could race to pull them), the
//! engines' keys and the router that sends them, one [`Pool`] per model with its control loop, canary rollouts over the first
//! pool, the front port (bound, so the gateway knows its upstream), the gateway, and the
//! app the front serves: the router's proxy behind the front layer, the dashboard at
//! `/ui`, the controller at `/controller`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use strata_controller::controller::Status;
use strata_controller::metrics::ControllerMetrics;
use strata_router::Router;
use tokio::net::TcpListener;

use super::banner::{self, Banner};
use super::config::StackConfig;
use super::engine_keys::EngineKeys;
use super::gateway::StackGateway;
use super::kv_tier::KvTier;
use super::pool::{Pool, PoolBuilder, PoolController};
use super::routing;
use super::tls::StackTls;
use super::view::View;
use crate::dashboard::Dashboard;
use crate::fleet::GroupMap;
use crate::front::{Front, VersionStatsBook};
use crate::pools::{PoolSet, PoolSpec};
use crate::pull::pull_model;
use crate::rollout::{RolloutParts, Rollouts};

/// A stack built and not yet started.
pub(super) struct Stack {
    /// Kept until the replicas have stopped.
    pub tier: Option<KvTier>,
    /// With `--tls`: the certificates, removed once everything has stopped.
    pub tls: Option<StackTls>,
    pub controllers: Vec<PoolController>,
    pub listener: TcpListener,
    /// The front's certificate, with `--tls`.
    pub front_tls: Option<strata_api::tls::TlsFiles>,
    pub app: axum::Router,
    pub dashboard: Dashboard,
    pub gateway: Option<StackGateway>,
    pub banner: Banner,
    /// How long shutting down waits for requests in flight.
    pub grace: Duration,
}

impl Stack {
    pub async fn build(cfg: &StackConfig) -> anyhow::Result<Stack> {
        let mut specs = cfg.pools()?;
        let tls = cfg.tls.then(|| StackTls::generate(&cfg.host)).transpose()?;
        let tier = start_tier(cfg, &mut specs, tls.as_ref()).await?;
        if let Some(t) = &tls {
            t.share_with(&mut specs, tier.is_some());
        }
        banner::print_pools(&specs);
        pull_models(&specs).await?;
        // The engines require a key the router sends them (`engine_keys.rs`).
        let mut router_cfg = routing::router_config(cfg)?;
        let keys = EngineKeys::for_stack(&cfg.engine_args, router_cfg.engine_api_key.as_deref());
        router_cfg.engine_api_key = Some(keys.api().to_string());
        // With `--tls` the engines are `https://`, verified against the stack's CA.
        if let Some(t) = &tls {
            router_cfg.upstream_tls.ca = Some(t.ca.clone());
        }
        let router = Router::new(router_cfg)?;
        let groups = GroupMap::default();
        let metrics = Arc::new(ControllerMetrics::new());
        let (pools, controllers) = PoolBuilder {
            cfg,
            router: &router,
            groups: &groups,
            metrics: &metrics,
            keys: &keys,
            ca: tls.as_ref().map(|t| t.ca.as_path()),
        }
        .build_all(specs)?;
        let Some(first) = pools.first() else {
            anyhow::bail!("no model to serve");
        };
        // Canary rollouts replace the first pool's version.
        let book = Arc::new(VersionStatsBook::default());
        let rollouts = Rollouts::new(RolloutParts {
            fleet: first.fleet.clone(),
            router: router.clone(),
            book: book.clone(),
            groups: groups.clone(),
            held: first.held.clone(),
            metrics: metrics.clone(),
            cfg: cfg.rollout.clone(),
            template: first.canary_template(cfg.canary_replicas),
            interval: Duration::from_secs_f64(cfg.controller_interval_secs),
        });
        let pool_set = Arc::new(front_pools(&pools));
        let listener = bind_front(cfg).await?;
        let front_addr = listener.local_addr()?;
        let gateway = StackGateway::build(cfg, front_addr, pool_set.names(), tls.as_ref())?;
        let view = Arc::new(View::new(
            router.clone(),
            &pools,
            rollouts.clone(),
            gateway.as_ref().map(|g| g.gateway.clone()),
        ));
        let dashboard = Dashboard::new(view.clone());
        let front = Front {
            router: router.clone(),
            pools: pool_set.clone(),
            hold_timeout: Duration::from_secs_f64(
                cfg.hold_timeout_secs.unwrap_or(cfg.ready_timeout_secs),
            ),
            groups,
            book,
        };
        let controller = controller_routes(metrics, first.status.clone(), view, &rollouts);
        let app = strata_router::proxy::app(router)
            .layer(axum::middleware::from_fn_with_state(
                front,
                crate::front::layer,
            ))
            .merge(dashboard.routes())
            .nest("/controller", controller);
        let mut banner = Banner::new(front_addr, cfg.disaggregated(), &pools, pool_set.names());
        if let Some(t) = &tls {
            banner = banner.with_tls(t.ca.clone());
        }
        Ok(Stack {
            tier,
            front_tls: tls.as_ref().map(|t| t.front.server()),
            tls,
            controllers,
            listener,
            app,
            dashboard,
            gateway,
            banner,
            grace: Duration::from_secs(cfg.shutdown_grace_secs),
        })
    }
}

/// The shared KV tier, if configured, started and shared with every pool's engines.
async fn start_tier(
    cfg: &StackConfig,
    specs: &mut [PoolSpec],
    tls: Option<&StackTls>,
) -> anyhow::Result<Option<KvTier>> {
    let Some(bytes) = cfg.kv_tier_bytes else {
        return Ok(None);
    };
    let tier = KvTier::start(bytes, cfg.log_dir.as_deref(), tls).await?;
    eprintln!("strata up: KV tier at {} ({bytes} bytes)", tier.addr);
    tier.share_with(specs);
    Ok(Some(tier))
}

/// Each pool's model once (mock engines load none), before any replica starts.
async fn pull_models(specs: &[PoolSpec]) -> anyhow::Result<()> {
    let mut pulls: Vec<String> = Vec::new();
    for p in specs.iter().filter(|p| !p.mock()) {
        if !pulls.contains(&p.model) {
            pulls.push(p.model.clone());
        }
    }
    for pull in pulls {
        tokio::task::spawn_blocking(move || pull_model(&pull))
            .await
            .context("model pull task")??;
    }
    Ok(())
}

/// The pools as the front tells requests apart: a prefill group is no pool of its own
/// to clients (its model is the decode group's).
fn front_pools(pools: &[Pool]) -> PoolSet {
    PoolSet(
        pools
            .iter()
            .filter(|p| p.spec.role.as_deref() != Some("prefill"))
            .map(Pool::route)
            .collect(),
    )
}

/// The front port (router + dashboard + controller), bound.
async fn bind_front(cfg: &StackConfig) -> anyhow::Result<TcpListener> {
    let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port)
        .parse()
        .with_context(|| format!("bad front address {}:{}", cfg.host, cfg.port))?;
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))
}

/// `/controller/...`: the first pool's status and the controllers' metrics, every pool's
/// view at `/pools`, and the rollout API.
fn controller_routes(
    metrics: Arc<ControllerMetrics>,
    status: Arc<Mutex<Status>>,
    view: Arc<View>,
    rollouts: &Rollouts,
) -> axum::Router {
    strata_controller::http::router(metrics, status)
        .route(
            "/pools",
            axum::routing::get(move || {
                let v = view.clone();
                async move { axum::Json(v.pool_views()) }
            }),
        )
        .nest("/rollout", rollouts.routes())
}
