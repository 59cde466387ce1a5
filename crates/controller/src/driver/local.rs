//! The local driver: replicas are `strata engine` processes on this machine, each on a
//! free loopback port.
//!
//! Life of a replica: *started* (process spawned) → *ready* (`GET /health` answers 200;
//! only now registered with the router) → on scale-in *draining* (deregistered first, then
//! waits until its `/metrics` show no running or waiting request, its process ends, or
//! `drainTimeoutSecs`)
//! → SIGTERM → SIGKILL if still alive after `stopGraceSecs`. A replica that is not ready
//! within `readyTimeoutSecs` is killed and reported; one that exits on its own is
//! reported; both are replaced by the next reconcile, which starts whatever is missing.
//!
//! Readiness is watched by one small task per starting replica, so a replica is
//! registered as soon as it answers, not at the next control tick. Draining runs in its
//! own task too: `reconcile` never waits for a drain.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::{Driver, DriverError, ReplicaEvent, ReplicaInfo, ReplicaPhase, ReplicaRegistrar};
use crate::signals::{EngineKind, MetricsScraper};

/// Settings of the local driver (`driver: {kind: local, ...}` in `controller.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalDriverConfig {
    /// The program to run (default: this `strata` executable).
    pub command: Option<PathBuf>,
    /// Its arguments. `{host}`, `{port}`, `{model}` and `{id}` are replaced, and
    /// `{free_port}` by a second free port of the replica's own (a side endpoint, such as
    /// an engine's KV-transfer port).
    pub args: Vec<String>,
    /// Extra environment, with the same replacements.
    pub env: BTreeMap<String, String>,
    /// The model each replica serves (`{model}`).
    pub model: String,
    /// The address replicas listen on.
    pub host: String,
    /// The readiness path.
    pub health_path: String,
    /// A replica not ready after this many seconds is killed and replaced.
    pub ready_timeout_secs: f64,
    /// How often a starting replica's health is polled, in milliseconds.
    pub health_poll_ms: u64,
    /// Longest wait for a draining replica's requests to finish.
    pub drain_timeout_secs: f64,
    /// Seconds between SIGTERM and SIGKILL.
    pub stop_grace_secs: f64,
    /// Where each replica's output goes (`<id>.log`); absent: the controller's own output.
    pub log_dir: Option<PathBuf>,
    /// Replicas serve HTTPS (their arguments give them a certificate): they are reached
    /// at `https://`, for health checks, drains and the router alike.
    pub https: bool,
    /// With `https`: the CA (PEM) replicas' certificates are verified against, on top of
    /// the system's roots.
    pub ca_file: Option<PathBuf>,
}

impl Default for LocalDriverConfig {
    fn default() -> Self {
        LocalDriverConfig {
            command: None,
            args: [
                "engine", "--host", "{host}", "--port", "{port}", "--model", "{model}",
            ]
            .map(String::from)
            .to_vec(),
            env: BTreeMap::new(),
            model: "smollm2-135m-instruct".to_string(),
            host: "127.0.0.1".to_string(),
            health_path: "/health".to_string(),
            ready_timeout_secs: 300.0,
            health_poll_ms: 250,
            drain_timeout_secs: 30.0,
            stop_grace_secs: 10.0,
            log_dir: None,
            https: false,
            ca_file: None,
        }
    }
}

/// A local-driver setting that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("driver.{key}: {message}")]
pub struct ConfigError {
    pub key: &'static str,
    pub message: String,
}

impl LocalDriverConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key, message: &str| ConfigError {
            key,
            message: message.to_string(),
        };
        for (key, v) in [
            ("readyTimeoutSecs", self.ready_timeout_secs),
            ("drainTimeoutSecs", self.drain_timeout_secs),
            ("stopGraceSecs", self.stop_grace_secs),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(key, "must be zero or more seconds"));
            }
        }
        if self.health_poll_ms == 0 {
            return Err(bad("healthPollMs", "must be at least 1"));
        }
        if !self.health_path.starts_with('/') {
            return Err(bad("healthPath", "must start with /"));
        }
        if self.ca_file.is_some() && !self.https {
            return Err(bad("caFile", "needs `https: true`"));
        }
        if self.host.parse::<std::net::IpAddr>().is_err() {
            return Err(bad("host", "must be an IP address, e.g. 127.0.0.1"));
        }
        Ok(())
    }
}

/// Where a started replica is, shared with its readiness watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watch {
    Starting,
    Ready,
    /// The watcher gave up waiting.
    NeverReady,
    /// The driver took it away (stopping or exited); the watcher must not register it.
    Gone,
}

struct Replica {
    id: String,
    url: String,
    child: Child,
    watch: Arc<Mutex<Watch>>,
}

impl Replica {
    fn watch(&self) -> Watch {
        self.watch.lock().map(|w| *w).unwrap_or(Watch::Gone)
    }

    fn info(&self, phase: ReplicaPhase) -> ReplicaInfo {
        ReplicaInfo {
            id: self.id.clone(),
            url: self.url.clone(),
            phase,
        }
    }
}

/// Runs replicas as child processes. See the module docs.
pub struct LocalDriver {
    cfg: LocalDriverConfig,
    program: PathBuf,
    registrar: Arc<dyn ReplicaRegistrar>,
    client: reqwest::Client,
    next_id: u64,
    /// Starting and ready replicas, oldest first.
    replicas: BTreeMap<u64, Replica>,
    /// Draining replicas (id → url), for [`Driver::replicas`].
    draining: Arc<Mutex<BTreeMap<String, String>>>,
    drains: JoinSet<()>,
    events_tx: mpsc::UnboundedSender<ReplicaEvent>,
    events_rx: mpsc::UnboundedReceiver<ReplicaEvent>,
}

impl LocalDriver {
    /// A driver with no replicas yet.
    pub fn new(
        cfg: LocalDriverConfig,
        registrar: Arc<dyn ReplicaRegistrar>,
    ) -> Result<LocalDriver, DriverError> {
        let program = match &cfg.command {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .map_err(|e| DriverError::Spawn(format!("cannot find this executable: {e}")))?,
        };
        let client = crate::tls_client::http_client(cfg.ca_file.as_deref())
            .map_err(|e| DriverError::Config(format!("driver.caFile: {e}")))?;
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        Ok(LocalDriver {
            cfg,
            program,
            registrar,
            client,
            next_id: 1,
            replicas: BTreeMap::new(),
            draining: Arc::new(Mutex::new(BTreeMap::new())),
            drains: JoinSet::new(),
            events_tx,
            events_rx,
        })
    }

    fn free_port(&self) -> Result<u16, DriverError> {
        let l = std::net::TcpListener::bind((self.cfg.host.as_str(), 0))
            .map_err(|e| DriverError::Port(e.to_string()))?;
        let port = l
            .local_addr()
            .map_err(|e| DriverError::Port(e.to_string()))?
            .port();
        Ok(port)
    }

    fn start_one(&mut self) -> Result<ReplicaEvent, DriverError> {
        let n = self.next_id;
        self.next_id += 1;
        let id = format!("local-{n}");
        let port = self.free_port()?;
        let wants_second = self.cfg.args.iter().any(|a| a.contains("{free_port}"));
        let second = if wants_second {
            // The kernel may hand the same free port out twice in a row.
            let mut p = self.free_port()?;
            if p == port {
                p = self.free_port()?;
            }
            p.to_string()
        } else {
            String::new()
        };
        let fill = |s: &str| {
            s.replace("{host}", &self.cfg.host)
                .replace("{port}", &port.to_string())
                .replace("{free_port}", &second)
                .replace("{model}", &self.cfg.model)
                .replace("{id}", &id)
        };
        let mut cmd = Command::new(&self.program);
        cmd.args(self.cfg.args.iter().map(|a| fill(a)));
        for (k, v) in &self.cfg.env {
            cmd.env(k, fill(v));
        }
        cmd.stdin(Stdio::null()).kill_on_drop(true);
        if let Some(dir) = &self.cfg.log_dir {
            let path = dir.join(format!("{id}.log"));
            let out = std::fs::File::create(&path)
                .map_err(|e| DriverError::Spawn(format!("{}: {e}", path.display())))?;
            let err = out
                .try_clone()
                .map_err(|e| DriverError::Spawn(format!("{}: {e}", path.display())))?;
            cmd.stdout(out).stderr(err);
        }
        let child = cmd
            .spawn()
            .map_err(|e| DriverError::Spawn(format!("{}: {e}", self.program.display())))?;
        let host = if self.cfg.host.contains(':') {
            format!("[{}]", self.cfg.host)
        } else {
            self.cfg.host.clone()
        };
        let scheme = if self.cfg.https { "https" } else { "http" };
        let url = format!("{scheme}://{host}:{port}");
        let watch = Arc::new(Mutex::new(Watch::Starting));
        tokio::spawn(watch_ready(
            self.client.clone(),
            ReplicaInfo {
                id: id.clone(),
                url: url.clone(),
                phase: ReplicaPhase::Ready,
            },
            format!("{url}{}", self.cfg.health_path),
            watch.clone(),
            self.registrar.clone(),
            Duration::from_millis(self.cfg.health_poll_ms),
            Duration::from_secs_f64(self.cfg.ready_timeout_secs),
            self.events_tx.clone(),
        ));
        self.replicas.insert(
            n,
            Replica {
                id: id.clone(),
                url: url.clone(),
                child,
                watch,
            },
        );
        Ok(ReplicaEvent::Started { id, url })
    }

    /// Takes a replica out of service and stops it in the background.
    fn stop(&mut self, key: u64, events: &mut Vec<ReplicaEvent>) {
        let Some(r) = self.replicas.remove(&key) else {
            return;
        };
        let was = match r.watch.lock() {
            Ok(mut w) => std::mem::replace(&mut *w, Watch::Gone),
            Err(_) => Watch::Gone,
        };
        let drain = was == Watch::Ready;
        if drain {
            self.registrar.deregister(&r.id);
        }
        if let Ok(mut d) = self.draining.lock() {
            d.insert(r.id.clone(), r.url.clone());
        }
        events.push(ReplicaEvent::Draining { id: r.id.clone() });
        let draining = self.draining.clone();
        let tx = self.events_tx.clone();
        let drain_timeout = Duration::from_secs_f64(self.cfg.drain_timeout_secs);
        let grace = Duration::from_secs_f64(self.cfg.stop_grace_secs);
        let poll = Duration::from_millis(self.cfg.health_poll_ms);
        let client = self.client.clone();
        self.drains.spawn(async move {
            let Replica {
                id, url, mut child, ..
            } = r;
            if drain {
                // A replica whose process has ended holds no request: its drain is over,
                // not a wait until `drain_timeout` (`strata up` stops its engines before
                // the controller, and a replica may crash while draining).
                tokio::select! {
                    _ = wait_idle(client, &url, drain_timeout, poll) => {}
                    _ = child.wait() => {}
                }
            }
            let forced = terminate(child, grace).await;
            if let Ok(mut d) = draining.lock() {
                d.remove(&id);
            }
            let _ = tx.send(ReplicaEvent::Stopped { id, forced });
        });
    }
}

/// Polls `/health` until it answers 200 (then registers the replica) or the timeout.
#[allow(clippy::too_many_arguments)]
async fn watch_ready(
    client: reqwest::Client,
    info: ReplicaInfo,
    health_url: String,
    watch: Arc<Mutex<Watch>>,
    registrar: Arc<dyn ReplicaRegistrar>,
    poll: Duration,
    timeout: Duration,
    tx: mpsc::UnboundedSender<ReplicaEvent>,
) {
    let started = Instant::now();
    loop {
        if watch.lock().map(|w| *w != Watch::Starting).unwrap_or(true) {
            return;
        }
        let per_try = poll.max(Duration::from_millis(500));
        let ok = matches!(
            tokio::time::timeout(per_try, client.get(&health_url).send()).await,
            Ok(Ok(resp)) if resp.status().is_success()
        );
        if ok {
            let Ok(mut w) = watch.lock() else { return };
            if *w == Watch::Starting {
                *w = Watch::Ready;
                // Registered under the lock: a concurrent stop either sees Ready (and
                // deregisters) or has already taken the replica away.
                registrar.register(&info);
                let _ = tx.send(ReplicaEvent::Ready {
                    id: info.id.clone(),
                    url: info.url.clone(),
                    after_secs: started.elapsed().as_secs_f64(),
                });
            }
            return;
        }
        if started.elapsed() >= timeout {
            if let Ok(mut w) = watch.lock() {
                if *w == Watch::Starting {
                    *w = Watch::NeverReady;
                }
            }
            return;
        }
        tokio::time::sleep(poll).await;
    }
}

/// Waits until the replica reports nothing running or waiting, or the timeout. A replica
/// whose metrics cannot be read is taken as idle only once the timeout passes.
async fn wait_idle(client: reqwest::Client, url: &str, timeout: Duration, poll: Duration) {
    let scraper = MetricsScraper::with_client(
        EngineKind::Vllm,
        poll.max(Duration::from_millis(500)),
        client,
    );
    let deadline = Instant::now() + timeout;
    // Requests the router sent just before deregistering the replica may still be in
    // transit (accepted, not yet queued in the engine's scheduler, so not in its gauges):
    // idle must be seen on two polls in a row, the first one a poll after deregistration.
    tokio::time::sleep(poll).await;
    let mut idle_once = false;
    while Instant::now() < deadline {
        match scraper.scrape(url).await {
            Ok(m) if m.running + m.waiting <= 0.0 => {
                if idle_once {
                    return;
                }
                idle_once = true;
            }
            _ => idle_once = false,
        }
        tokio::time::sleep(poll).await;
    }
}

/// SIGTERM, then SIGKILL after `grace`. Returns whether it had to kill.
async fn terminate(mut child: Child, grace: Duration) -> bool {
    if let Ok(Some(_)) = child.try_wait() {
        return false;
    }
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(_) => false,
        Err(_) => {
            let _ = child.kill().await;
            true
        }
    }
}

impl Driver for LocalDriver {
    fn name(&self) -> &'static str {
        "local"
    }

    async fn reconcile(&mut self, desired: u32) -> Result<Vec<ReplicaEvent>, DriverError> {
        let mut events = Vec::new();
        while let Ok(e) = self.events_rx.try_recv() {
            events.push(e);
        }
        // Reap finished drains.
        while self.drains.try_join_next().is_some() {}

        // Crashed and never-ready replicas leave the set (and are replaced below).
        let keys: Vec<u64> = self.replicas.keys().copied().collect();
        for key in keys {
            let Some(r) = self.replicas.get_mut(&key) else {
                continue;
            };
            if let Ok(Some(status)) = r.child.try_wait() {
                let was = r
                    .watch
                    .lock()
                    .map(|mut w| std::mem::replace(&mut *w, Watch::Gone))
                    .unwrap_or(Watch::Gone);
                if was == Watch::Ready {
                    self.registrar.deregister(&r.id);
                }
                events.push(ReplicaEvent::Exited {
                    id: r.id.clone(),
                    status: status.to_string(),
                });
                self.replicas.remove(&key);
                continue;
            }
            if r.watch() == Watch::NeverReady {
                events.push(ReplicaEvent::NeverReady {
                    id: r.id.clone(),
                    waited_secs: self.cfg.ready_timeout_secs,
                });
                if let Some(mut r) = self.replicas.remove(&key) {
                    let _ = r.child.start_kill();
                    self.drains.spawn(async move {
                        let _ = r.child.wait().await;
                    });
                }
            }
        }

        let have = self.replicas.len();
        let want = desired as usize;
        if have < want {
            for _ in have..want {
                match self.start_one() {
                    Ok(e) => events.push(e),
                    Err(err) => {
                        for e in events {
                            log_event(&e);
                        }
                        return Err(err);
                    }
                }
            }
        } else if have > want {
            // Stop the replicas that serve least: starting ones first, then the newest.
            let mut victims: Vec<(bool, u64)> = self
                .replicas
                .iter()
                .map(|(k, r)| (r.watch() == Watch::Ready, *k))
                .collect();
            victims.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            for (_, key) in victims.into_iter().take(have - want) {
                self.stop(key, &mut events);
            }
        }
        Ok(events)
    }

    fn replicas(&self) -> Vec<ReplicaInfo> {
        let mut out: Vec<ReplicaInfo> = self
            .replicas
            .values()
            .map(|r| {
                let phase = if r.watch() == Watch::Ready {
                    ReplicaPhase::Ready
                } else {
                    ReplicaPhase::Starting
                };
                r.info(phase)
            })
            .collect();
        if let Ok(d) = self.draining.lock() {
            out.extend(d.iter().map(|(id, url)| ReplicaInfo {
                id: id.clone(),
                url: url.clone(),
                phase: ReplicaPhase::Draining,
            }));
        }
        out
    }

    async fn shutdown(&mut self) -> Vec<ReplicaEvent> {
        let mut events = Vec::new();
        let keys: Vec<u64> = self.replicas.keys().copied().collect();
        for key in keys {
            self.stop(key, &mut events);
        }
        while self.drains.join_next().await.is_some() {}
        while let Ok(e) = self.events_rx.try_recv() {
            events.push(e);
        }
        events
    }
}

/// Logs an event at a level that fits it.
pub(crate) fn log_event(e: &ReplicaEvent) {
    if e.is_fault() {
        tracing::warn!(event = e.kind(), "{e}");
    } else {
        tracing::info!(event = e.kind(), "{e}");
    }
}
