//! One pool as `strata up` builds it: the engine command line its replicas run, their
//! local driver (logs apart per pool), the [`Fleet`] over it, and the controller loop that
//! scales it on the router's view of its replicas' load.

use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_controller::autoscale::AutoscaleConfig;
use strata_controller::controller::{Controller, Status};
use strata_controller::driver::local::{LocalDriver, LocalDriverConfig};
use strata_controller::driver::DriverError;
use strata_controller::metrics::ControllerMetrics;
use strata_router::Router;

use super::config::StackConfig;
use super::engine_keys::EngineKeys;
use crate::fleet::{Fleet, FleetDriver, GroupMap, Member, RouterRegistrar};
use crate::pools::{PoolRoute, PoolSpec};
use crate::rollout::CanaryTemplate;
use crate::signals::RouterSignals;

/// How old a replica's last `/metrics` page may be and still count as its load.
const SIGNAL_MAX_AGE: Duration = Duration::from_secs(1);
/// Replacements of crashed replicas wait 1 s, doubling up to 30 s.
const FAULT_BACKOFF: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// A pool that cannot be built.
#[derive(Debug, thiserror::Error)]
pub(super) enum PoolError {
    #[error("creating {}", dir.display())]
    LogDir {
        dir: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error(transparent)]
    Driver(#[from] DriverError),
}

/// The control loop of one pool.
pub(super) type PoolController = Controller<FleetDriver, RouterSignals>;

/// One pool after it is built.
pub(super) struct Pool {
    pub spec: PoolSpec,
    pub fleet: Fleet,
    /// Requests the front holds for this pool (its autoscaler's activation signal).
    pub held: Arc<AtomicU32>,
    pub status: Arc<Mutex<Status>>,
    engine_args: Vec<String>,
    driver_cfg: LocalDriverConfig,
    log_dir: Option<PathBuf>,
}

/// What every pool of a stack shares.
pub(super) struct PoolBuilder<'a> {
    pub cfg: &'a StackConfig,
    pub router: &'a Router,
    pub groups: &'a GroupMap,
    /// The first pool's metrics are the controller's `/metrics`.
    pub metrics: &'a Arc<ControllerMetrics>,
    /// Every replica's API and admin keys (its environment).
    pub keys: &'a EngineKeys,
    /// With `--tls`: the CA the replicas' certificates are verified against (they are
    /// `https://`).
    pub ca: Option<&'a std::path::Path>,
}

impl PoolBuilder<'_> {
    /// Every pool of the stack, in order, and their control loops.
    pub fn build_all(
        &self,
        specs: Vec<PoolSpec>,
    ) -> Result<(Vec<Pool>, Vec<PoolController>), PoolError> {
        let mut pools = Vec::with_capacity(specs.len());
        let mut controllers = Vec::with_capacity(specs.len());
        for (index, spec) in specs.into_iter().enumerate() {
            let (pool, controller) = self.build(index, spec)?;
            pools.push(pool);
            controllers.push(controller);
        }
        Ok((pools, controllers))
    }

    /// The `index`th pool of the stack and its control loop; nothing starts yet.
    fn build(&self, index: usize, spec: PoolSpec) -> Result<(Pool, PoolController), PoolError> {
        let cfg = self.cfg;
        let held = Arc::new(AtomicU32::new(0));
        let registrar = Arc::new(
            RouterRegistrar::new(
                self.router.clone(),
                spec.name.clone(),
                spec.model.clone(),
                self.groups.clone(),
                held.clone(),
            )
            .with_adapters(spec.adapter_names())
            .with_role(spec.role.clone()),
        );
        let engine_args = engine_command(&spec, cfg.shutdown_grace_secs);
        let log_dir = log_dir_of(cfg, index, &spec)?;
        let driver_cfg = LocalDriverConfig {
            args: engine_args.clone(),
            model: spec.model.clone(),
            host: "127.0.0.1".to_string(),
            ready_timeout_secs: cfg.ready_timeout_secs,
            // The engine drains what it accepted for `shutdown_grace_secs` after SIGTERM: the
            // driver must not kill it sooner.
            stop_grace_secs: cfg.shutdown_grace_secs as f64 + 5.0,
            drain_timeout_secs: cfg.shutdown_grace_secs as f64,
            log_dir: log_dir.clone(),
            env: self.keys.env(),
            https: self.ca.is_some(),
            ca_file: self.ca.map(std::path::Path::to_path_buf),
            ..LocalDriverConfig::default()
        };
        let driver = LocalDriver::new(driver_cfg.clone(), registrar.clone())?;
        let fleet = Fleet::new(Member::new(spec.model.clone(), driver));
        let metrics = if index == 0 {
            self.metrics.clone()
        } else {
            Arc::new(ControllerMetrics::new())
        };
        let controller = Controller::new(
            spec.autoscale.clone(),
            Duration::from_secs_f64(cfg.controller_interval_secs),
            fleet.driver(),
            // The router's scraper is the one reader of each replica's /metrics.
            RouterSignals::new(self.router.clone(), SIGNAL_MAX_AGE),
            registrar,
            metrics,
        )
        .with_fault_backoff(FAULT_BACKOFF.0, FAULT_BACKOFF.1);
        let status = controller.status();
        let pool = Pool {
            spec,
            fleet,
            held,
            status,
            engine_args,
            driver_cfg,
            log_dir,
        };
        Ok((pool, controller))
    }
}

impl Pool {
    /// How the front tells this pool's requests apart and holds them while it is cold.
    pub fn route(&self) -> PoolRoute {
        PoolRoute {
            name: self.spec.name.clone(),
            model: self.spec.model.clone(),
            adapters: self.spec.adapters.clone(),
            held: self.held.clone(),
            retry_after_secs: retry_after(&self.spec.autoscale),
        }
    }

    /// Canary replicas of a new version of this pool: its command line and driver
    /// settings, with the version as `{model}`.
    pub fn canary_template(&self, canary_replicas: u32) -> CanaryTemplate {
        CanaryTemplate {
            args: self.engine_args.clone(),
            base: self.driver_cfg.clone(),
            served_model: self.spec.name.clone(),
            canary_replicas,
            log_dir: self.log_dir.clone(),
            mock: self.spec.mock(),
            adapters: self.spec.adapter_names(),
        }
    }
}

/// Where the `index`th pool's replicas log (created): replica ids restart in every pool,
/// so the second and later pools log apart.
fn log_dir_of(
    cfg: &StackConfig,
    index: usize,
    spec: &PoolSpec,
) -> Result<Option<PathBuf>, PoolError> {
    let Some(base) = &cfg.log_dir else {
        return Ok(None);
    };
    let dir = if index == 0 {
        base.clone()
    } else {
        match &spec.role {
            Some(role) => base.join(role),
            None => base.join(format!("pool-{}", spec.slug())),
        }
    };
    match std::fs::create_dir_all(&dir) {
        Ok(()) => Ok(Some(dir)),
        Err(error) => Err(PoolError::LogDir { dir, error }),
    }
}

/// `Retry-After` for a request that found its pool still cold: about one cold start.
fn retry_after(a: &AutoscaleConfig) -> u64 {
    if a.cold_start_secs.is_finite() && a.cold_start_secs >= 1.0 {
        a.cold_start_secs.ceil().min(300.0) as u64
    } else {
        5
    }
}

/// The engine command line every replica of `pool` runs (`{model}` is the version).
fn engine_command(pool: &PoolSpec, shutdown_grace_secs: u64) -> Vec<String> {
    let mut args: Vec<String> = [
        "engine",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--model",
        "{model}",
        "--served-model-name",
    ]
    .map(String::from)
    .to_vec();
    args.push(pool.name.clone());
    args.push("--kv-cache-memory".into());
    args.push(pool.kv_cache_memory.to_string());
    let has = |flag: &str| {
        pool.engine_args
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    // A stopped replica finishes what it accepted within this grace (the driver's SIGKILL
    // comes only after it), unless the engine arguments say otherwise.
    if !has("--shutdown-grace-secs") {
        args.push("--shutdown-grace-secs".into());
        args.push(shutdown_grace_secs.to_string());
    }
    if !pool.adapters.is_empty() {
        if !has("--enable-lora") {
            args.push("--enable-lora".into());
        }
        // Room for every configured adapter at once, unless the pool says otherwise.
        if !has("--max-loras") {
            args.push("--max-loras".into());
            args.push(pool.adapters.len().to_string());
        }
        for a in &pool.adapters {
            args.push("--lora-modules".into());
            args.push(format!("{}={}", a.name, a.path.display()));
        }
    }
    args.extend(pool.engine_args.iter().cloned());
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::up::args::UpArgs;
    use crate::up::routing::pd_router_config;
    use strata_router::RouterConfig;

    #[test]
    fn engines_get_the_stop_grace_unless_their_args_set_one() {
        let mut c = StackConfig {
            shutdown_grace_secs: 42,
            ..StackConfig::default()
        };
        let pool = |c: &StackConfig| c.pools().unwrap().remove(0);
        let args = engine_command(&pool(&c), c.shutdown_grace_secs);
        let i = args
            .iter()
            .position(|a| a == "--shutdown-grace-secs")
            .unwrap();
        assert_eq!(args[i + 1], "42");
        c.engine_args = vec!["--shutdown-grace-secs=7".into()];
        let args = engine_command(&pool(&c), c.shutdown_grace_secs);
        assert!(!args.iter().any(|a| a == "--shutdown-grace-secs"));
        assert_eq!(args.last().unwrap(), "--shutdown-grace-secs=7");
    }

    #[test]
    fn models_make_one_pool_each_and_adapters_reach_the_engine_command() {
        let dir = std::env::temp_dir().join(format!("strata-up-models-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("strata.yaml");
        std::fs::write(
            &file,
            "engine_args: [--max-num-seqs, '4']\nmodels:\n\
             - model: chat\n  replicas: 2\n  adapters: [{name: a, path: /ad/a}, {name: b, path: /ad/b}]\n\
             - model: /m/enc.gguf\n  autoscale: {minReplicas: 0, maxReplicas: 2}\n",
        )
        .unwrap();
        let args = UpArgs {
            config: Some(file.clone()),
            ..UpArgs::default()
        };
        let c = StackConfig::load(&args).unwrap();
        let pools = c.pools().unwrap();
        assert_eq!(pools.len(), 2);
        assert_eq!(pools[1].name, "enc");
        let cmd = engine_command(&pools[0], 30);
        let at = |flag: &str| cmd.iter().position(|a| a == flag).unwrap();
        assert_eq!(cmd[at("--served-model-name") + 1], "chat");
        assert_eq!(cmd[at("--max-loras") + 1], "2");
        assert!(cmd.contains(&"--enable-lora".to_string()));
        let modules: Vec<&String> = cmd
            .iter()
            .enumerate()
            .filter(|(i, _)| *i > 0 && cmd[i - 1] == "--lora-modules")
            .map(|(_, a)| a)
            .collect();
        assert_eq!(modules, ["a=/ad/a", "b=/ad/b"]);
        assert_eq!(cmd[cmd.len() - 2..], ["--max-num-seqs", "4"]);
        // No adapters: no LoRA flags.
        let cmd = engine_command(&pools[1], 30);
        assert!(!cmd.iter().any(|a| a.contains("lora")), "{cmd:?}");
        // The single-model flags conflict with `models:`.
        for bad in [
            UpArgs {
                model: Some("x".into()),
                ..args.clone()
            },
            UpArgs {
                replicas: Some(1),
                ..args.clone()
            },
        ] {
            let e = StackConfig::load(&bad).unwrap_err();
            assert!(format!("{e:#}").contains("per entry"), "{e:#}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn disaggregated_layout_two_fixed_groups_with_roles() {
        let args = UpArgs {
            prefill_replicas: Some(2),
            decode_replicas: Some(3),
            pd_threshold: Some(32),
            engine_args: vec!["--mock".into()],
            ..UpArgs::default()
        };
        let c = StackConfig::load(&args).unwrap();
        assert!(c.disaggregated());
        let pools = c.pools().unwrap();
        assert_eq!(pools.len(), 2);
        let (decode, prefill) = (&pools[0], &pools[1]);
        assert_eq!(decode.role.as_deref(), Some("decode"));
        assert_eq!(prefill.role.as_deref(), Some("prefill"));
        assert_eq!(decode.name, prefill.name, "one served model");
        for (p, n) in [(decode, 3), (prefill, 2)] {
            let a = &p.autoscale;
            assert_eq!((a.min_replicas, a.max_replicas, a.warm_spares), (n, n, 0));
        }
        let cmd = engine_command(prefill, 30);
        let at = |cmd: &[String], flag: &str| cmd.iter().position(|a| a == flag).unwrap();
        assert_eq!(cmd[at(&cmd, "--kv-role") + 1], "prefill");
        assert_eq!(cmd[at(&cmd, "--kv-transfer-port") + 1], "{free_port}");
        assert!(cmd.contains(&"--mock".to_string()));
        let cmd = engine_command(decode, 30);
        assert_eq!(cmd[at(&cmd, "--kv-role") + 1], "decode");
        assert!(!cmd.iter().any(|a| a == "--kv-transfer-port"));
        // The router runs the profile pair at the threshold, unless its file says otherwise.
        let rc = pd_router_config(&c, RouterConfig::default());
        let picker = rc.picker_config().build().unwrap();
        assert_eq!(picker.pd().unwrap().decider.non_cached_tokens, 32);
        let custom = RouterConfig {
            scheduling: Some(strata_router::EndpointPickerConfig::default_config()),
            ..RouterConfig::default()
        };
        assert!(pd_router_config(&c, custom)
            .picker_config()
            .build()
            .unwrap()
            .pd()
            .is_none());
        // Colocated: one pool, no role, no pair.
        let plain = StackConfig::default();
        assert_eq!(plain.pools().unwrap()[0].role, None);
        assert!(pd_router_config(&plain, RouterConfig::default())
            .scheduling
            .is_none());
    }
}
