//! The load driver: turns a workload and a load shape into timed requests.
//!
//! Three shapes: a fixed number of concurrent users (`--concurrency`), an open-loop
//! arrival process (`--rate` with constant or Poisson gaps, optionally capped by
//! `--max-concurrency`), and a trace's own timestamps. A multi-turn conversation occupies
//! one user for all its turns, think time included; under `--rate` conversations (not
//! turns) arrive at the rate. The run stops issuing when the request budget or the
//! duration is spent, or when stopped from outside; requests in flight then finish
//! (each bounded by the client timeout) and count.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use crate::client::{Client, ClientConfig, Prompt};
use crate::error::BenchError;
use crate::record::RequestRecord;
use crate::report::{Report, Slo};
use crate::workload::{Session, SessionSource, Workload};

/// Gaps between arrivals under `--rate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Arrival {
    /// Exactly `1 / rate` apart.
    Constant,
    /// Exponential gaps with mean `1 / rate` (a Poisson process).
    Poisson,
}

/// How requests are offered.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "kebab-case")]
pub enum LoadShape {
    /// `users` closed-loop users, each sending its next request when the last one ends.
    Concurrency {
        /// Number of users.
        users: usize,
    },
    /// Open loop: sessions arrive at `rate` per second.
    Rate {
        /// Arrivals per second.
        rate: f64,
        /// Gap distribution.
        arrival: Arrival,
        /// Optional cap on sessions in flight; arrivals wait for a free slot.
        max_concurrency: Option<usize>,
    },
    /// Trace replay at the trace's timestamps (divided by its speed factor).
    Recorded {
        /// Optional cap on requests in flight.
        max_concurrency: Option<usize>,
    },
}

/// When the run stops issuing requests. At least one limit should be set; a trace also
/// stops when it runs out of lines.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StopCondition {
    /// Most requests to send (every turn counts).
    pub max_requests: Option<u64>,
    /// Stop issuing after this long.
    #[serde(serialize_with = "opt_secs")]
    pub duration: Option<Duration>,
}

/// Everything a run needs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadConfig {
    /// Server, model, route and connection settings.
    pub client: ClientConfig,
    /// What to send.
    pub workload: Workload,
    /// How to offer it.
    pub load: LoadShape,
    /// When to stop.
    pub stop: StopCondition,
    /// Seed for lengths, content and arrival gaps.
    pub seed: u64,
    /// Service-level objective for goodput.
    pub slo: Slo,
    /// Name for this run in reports and plots.
    pub label: String,
}

/// A handle that stops a running benchmark from outside (e.g. on Ctrl-C): no new requests
/// are issued; requests in flight finish and are reported.
#[derive(Debug, Clone, Default)]
pub struct StopHandle(Arc<AtomicBool>);

impl StopHandle {
    /// A handle that has not fired.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stops issuing.
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// True once [`StopHandle::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Runs the benchmark and builds its report.
pub async fn run_load(config: &LoadConfig) -> Result<Report, BenchError> {
    run_load_with(config, &|_| {}, &StopHandle::new()).await
}

/// Runs the benchmark, calling `observe` with each finished request as it lands (for a
/// progress bar), until the stop condition or `stop` fires.
pub async fn run_load_with(
    config: &LoadConfig,
    observe: &(dyn Fn(&RequestRecord) + Sync),
    stop: &StopHandle,
) -> Result<Report, BenchError> {
    let client = Client::new(config.client.clone())?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let started_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let run_start = Instant::now();
    let shared = Arc::new(Shared {
        client,
        source: Mutex::new(SessionSource::new(config.workload.clone(), config.seed)),
        budget: Budget {
            issued: AtomicU64::new(0),
            max: config.stop.max_requests,
            deadline: config.stop.duration.map(|d| run_start + d),
            stop: stop.clone(),
        },
        run_start,
        tx,
    });
    let dispatcher = tokio::spawn(dispatch(
        shared,
        config.load.clone(),
        StdRng::seed_from_u64(config.seed ^ 0x5eed_a771_0a1d),
    ));
    let mut records = Vec::new();
    while let Some(record) = rx.recv().await {
        observe(&record);
        records.push(record);
    }
    // The channel closes when the dispatcher and every session task have dropped their
    // handles; a panic in one of them would surface here.
    if let Err(e) = dispatcher.await {
        tracing::error!("load dispatcher failed: {e}");
    }
    let duration = run_start.elapsed();
    Ok(config.report(&records, duration, started_at))
}

impl LoadConfig {
    /// The report of a finished run of this configuration (stored in it as run). Here
    /// rather than in [`crate::report`], so the report knows records and objectives and
    /// never the driver's configuration: the dependency points one way.
    pub fn report(
        &self,
        records: &[RequestRecord],
        duration: Duration,
        started_at_unix_s: f64,
    ) -> Report {
        let config_json = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        let mut report =
            Report::from_records(&self.label, config_json, records, duration, &self.slo);
        report.started_at_unix_s = started_at_unix_s;
        report
    }
}

/// State shared by the dispatcher and session tasks.
struct Shared {
    client: Client,
    source: Mutex<SessionSource>,
    budget: Budget,
    run_start: Instant,
    tx: mpsc::UnboundedSender<RequestRecord>,
}

impl Shared {
    fn next_session(&self) -> Option<Session> {
        match self.source.lock() {
            Ok(mut source) => source.next_session(),
            Err(poisoned) => poisoned.into_inner().next_session(),
        }
    }
}

/// The request budget: a count, a deadline and an outside stop.
struct Budget {
    issued: AtomicU64,
    max: Option<u64>,
    deadline: Option<Instant>,
    stop: StopHandle,
}

impl Budget {
    /// True while more requests may be issued.
    fn open(&self) -> bool {
        !self.stop.is_stopped()
            && self.deadline.is_none_or(|d| Instant::now() < d)
            && self
                .max
                .is_none_or(|m| self.issued.load(Ordering::SeqCst) < m)
    }

    /// Takes one request ticket; false when the budget is spent.
    fn take(&self) -> bool {
        if self.stop.is_stopped() || self.deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        let n = self.issued.fetch_add(1, Ordering::SeqCst);
        self.max.is_none_or(|m| n < m)
    }
}

/// Offers sessions according to the load shape, then waits for all of them.
async fn dispatch(shared: Arc<Shared>, load: LoadShape, mut rng: StdRng) {
    let mut tasks = JoinSet::new();
    match load {
        LoadShape::Concurrency { users } => {
            for _ in 0..users.max(1) {
                let shared = shared.clone();
                tasks.spawn(async move {
                    while shared.budget.take() {
                        let Some(session) = shared.next_session() else {
                            break;
                        };
                        run_session(&shared, session).await;
                    }
                });
            }
        }
        LoadShape::Rate {
            rate,
            arrival,
            max_concurrency,
        } => {
            let slots = max_concurrency.map(|n| Arc::new(Semaphore::new(n.max(1))));
            let mut next = Duration::ZERO;
            loop {
                if !sleep_until_or_closed(&shared, shared.run_start + next).await {
                    break;
                }
                let permit = match &slots {
                    Some(s) => match s.clone().acquire_owned().await {
                        Ok(p) => Some(p),
                        Err(_) => break,
                    },
                    None => None,
                };
                if !shared.budget.take() {
                    break;
                }
                let Some(session) = shared.next_session() else {
                    break;
                };
                let task_shared = shared.clone();
                tasks.spawn(async move {
                    run_session(&task_shared, session).await;
                    drop(permit);
                });
                next += gap(rate, arrival, &mut rng);
            }
        }
        LoadShape::Recorded { max_concurrency } => {
            let slots = max_concurrency.map(|n| Arc::new(Semaphore::new(n.max(1))));
            while let Some(session) = shared.next_session() {
                let at = shared.run_start + session.arrival.unwrap_or_default();
                if !sleep_until_or_closed(&shared, at).await {
                    break;
                }
                let permit = match &slots {
                    Some(s) => match s.clone().acquire_owned().await {
                        Ok(p) => Some(p),
                        Err(_) => break,
                    },
                    None => None,
                };
                if !shared.budget.take() {
                    break;
                }
                let task_shared = shared.clone();
                tasks.spawn(async move {
                    run_session(&task_shared, session).await;
                    drop(permit);
                });
            }
        }
    }
    drop(shared);
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = done {
            tracing::error!("benchmark session task failed: {e}");
        }
    }
}

/// Sleeps until `at`, waking early to give up when the budget closes (deadline or stop).
/// Returns whether the budget is still open.
async fn sleep_until_or_closed(shared: &Shared, at: Instant) -> bool {
    const TICK: Duration = Duration::from_millis(50);
    loop {
        if !shared.budget.open() {
            return false;
        }
        let now = Instant::now();
        if now >= at {
            return true;
        }
        tokio::time::sleep((at - now).min(TICK)).await;
    }
}

/// The gap to the next arrival.
pub fn gap(rate: f64, arrival: Arrival, rng: &mut StdRng) -> Duration {
    let mean = 1.0 / rate;
    let secs = match arrival {
        Arrival::Constant => mean,
        Arrival::Poisson => {
            let u: f64 = rng.random();
            -(1.0 - u).ln() * mean
        }
    };
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

/// Sends a session's turns in order. The caller already took the first turn's ticket;
/// later turns take their own. A conversation ends at its first failure.
async fn run_session(shared: &Shared, session: Session) {
    let mut history: Vec<(Vec<crate::prompt::Segment>, String)> = Vec::new();
    let turns = session.turns.len();
    for (i, turn) in session.turns.into_iter().enumerate() {
        if i > 0 {
            if !session.think_time.is_zero() {
                let wake = Instant::now() + session.think_time;
                if !sleep_until_or_closed(shared, wake).await {
                    return;
                }
            }
            if !shared.budget.take() {
                return;
            }
        }
        let prompt = Prompt {
            system: &session.system,
            history: &history,
            user: &turn.user,
            session: session.id,
        };
        let body = shared.client.body(&prompt, turn.max_tokens);
        let mut record = shared
            .client
            .send(
                &body,
                prompt.planned_tokens(),
                session.id,
                shared.run_start,
                i + 1 < turns,
            )
            .await;
        let ok = record.ok();
        let reply = std::mem::take(&mut record.text);
        if shared.tx.send(record).is_err() || !ok {
            return;
        }
        history.push((turn.user, reply));
    }
}

fn opt_secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_gaps_have_the_right_mean() {
        let mut rng = StdRng::seed_from_u64(1);
        let n = 20_000;
        let total: f64 = (0..n)
            .map(|_| gap(10.0, Arrival::Poisson, &mut rng).as_secs_f64())
            .sum();
        let mean = total / f64::from(n);
        assert!((mean - 0.1).abs() < 0.005, "mean gap {mean}");
        assert_eq!(
            gap(4.0, Arrival::Constant, &mut rng),
            Duration::from_millis(250)
        );
    }

    #[test]
    fn budget_counts_and_stops() {
        let b = Budget {
            issued: AtomicU64::new(0),
            max: Some(2),
            deadline: None,
            stop: StopHandle::new(),
        };
        assert!(b.open());
        assert!(b.take());
        assert!(b.take());
        assert!(!b.take());
        assert!(!b.open());
        let s = StopHandle::new();
        let b = Budget {
            issued: AtomicU64::new(0),
            max: None,
            deadline: None,
            stop: s.clone(),
        };
        assert!(b.take());
        s.stop();
        assert!(!b.take());
    }
}
