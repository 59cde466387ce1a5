//! The live side of flow control: the pure [`FlowController`] behind one mutex, the
//! waiters its decisions wake, and the gauges it keeps current. Nothing here decides an
//! order; it delivers the controller's decisions.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

use super::metrics::{FlowMetrics, Shown, DISPATCH_IMMEDIATE, DISPATCH_QUEUED, EVICT_CANCELLED};
use crate::scheduling::flow::{
    Admit, Eviction, FlowConfig, FlowController, FlowRequest, FlowsSnapshot, PoolView, Refusal,
};

/// One request as it arrives at the gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    pub priority: i32,
    /// The fairness id (`""`: the shared flow of requests that name none).
    pub flow: String,
    /// Body bytes, against the byte bounds.
    pub bytes: u64,
    /// Its own deadline, when it brought one; else the configured default.
    pub ttl: Option<Duration>,
}

impl Ticket {
    /// A request known only by its priority (the embedding gateway's admission).
    pub fn priority_only(priority: i32) -> Ticket {
        Ticket {
            priority,
            flow: String::new(),
            bytes: 0,
            ttl: None,
        }
    }
}

/// What a waiting request is told.
enum Verdict {
    Go(Admitted),
    Evicted(Eviction),
}

/// Permission to schedule one request. While it lives the request counts as in transit
/// (dispatched, not yet on an endpoint); drop it once the request is picked.
pub struct Admitted {
    gate: Arc<FlowGate>,
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Admitted")
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.gate.lock().ctl.placed();
    }
}

/// The outcome of an arrival.
pub(crate) enum Arrival {
    Go(Admitted),
    Wait(Waiting),
    Refused(Refusal),
}

/// A queued request's end of the line. Dropping it before its verdict (the client went
/// away) takes the request out of its queue.
pub(crate) struct Waiting {
    gate: Arc<FlowGate>,
    id: u64,
    deadline: Duration,
    rx: Option<oneshot::Receiver<Verdict>>,
}

impl Waiting {
    /// When its time to live ends (the router's clock).
    pub(crate) fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The verdict, once the gate gives one.
    pub(crate) async fn verdict(&mut self) -> Result<Admitted, Eviction> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(Eviction::Ttl);
        };
        let v = rx.await;
        self.rx = None;
        match v {
            Ok(Verdict::Go(a)) => Ok(a),
            Ok(Verdict::Evicted(e)) => Err(e),
            // The gate always answers before it forgets a waiter; treat a lost answer
            // as the end of its time.
            Err(_) => Err(Eviction::Ttl),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(rx) = self.rx.take() else {
            return;
        };
        let cancelled = {
            let mut st = self.gate.lock();
            let cancelled = st.ctl.cancel(self.id);
            st.waiters.remove(&self.id);
            if cancelled {
                self.gate.queued.store(st.ctl.queued(), Ordering::Release);
                self.gate.show(&mut st);
            }
            cancelled
        };
        if cancelled {
            FlowMetrics::count(&self.gate.metrics.evicted, EVICT_CANCELLED);
        }
        // A verdict already sent (an `Admitted`) is dropped here, outside the lock.
        drop(rx);
    }
}

struct GateState {
    ctl: FlowController,
    waiters: HashMap<u64, oneshot::Sender<Verdict>>,
    shown: Shown,
}

/// Flow control for one pool.
pub(crate) struct FlowGate {
    state: Mutex<GateState>,
    /// Requests queued, readable without the lock (a pump with none is free).
    queued: AtomicUsize,
    next_id: AtomicU64,
    metrics: FlowMetrics,
    pool: String,
    default_ttl: Duration,
}

impl FlowGate {
    pub(crate) fn new(cfg: FlowConfig, pool: String, metrics: FlowMetrics) -> Arc<FlowGate> {
        Arc::new(FlowGate {
            default_ttl: cfg.default_ttl,
            state: Mutex::new(GateState {
                ctl: FlowController::new(cfg),
                waiters: HashMap::new(),
                shown: Shown::default(),
            }),
            queued: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            metrics,
            pool,
        })
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether any request waits.
    pub(crate) fn has_queued(&self) -> bool {
        self.queued.load(Ordering::Acquire) > 0
    }

    /// A request arrives at `now` with the pool as `pool`.
    pub(crate) fn arrive(self: &Arc<Self>, t: &Ticket, now: Duration, pool: &PoolView) -> Arrival {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let req = FlowRequest {
            id,
            flow: t.flow.clone(),
            priority: t.priority,
            bytes: t.bytes,
            arrived: now,
            ttl: t.ttl,
        };
        let mut st = self.lock();
        match st.ctl.enqueue(req, pool) {
            Admit::Dispatch => {
                drop(st);
                FlowMetrics::count(&self.metrics.dispatched, DISPATCH_IMMEDIATE);
                Arrival::Go(Admitted { gate: self.clone() })
            }
            Admit::Refused(r) => {
                drop(st);
                FlowMetrics::count(&self.metrics.refused, r.as_str());
                Arrival::Refused(r)
            }
            Admit::Queued => {
                let (tx, rx) = oneshot::channel();
                st.waiters.insert(id, tx);
                self.queued.store(st.ctl.queued(), Ordering::Release);
                self.show(&mut st);
                Arrival::Wait(Waiting {
                    gate: self.clone(),
                    id,
                    deadline: now.saturating_add(t.ttl.unwrap_or(self.default_ttl)),
                    rx: Some(rx),
                })
            }
        }
    }

    /// One dispatch round at `now`: evictions and dispatches delivered to their waiters.
    pub(crate) fn pump(self: &Arc<Self>, now: Duration, pool: &PoolView) {
        let mut undelivered: Vec<Verdict> = Vec::new();
        let mut st = self.lock();
        let held_before = st.ctl.held();
        let step = st.ctl.dispatch(now, pool);
        if step.is_empty() && held_before == st.ctl.held() {
            return;
        }
        for (id, waited) in step.dispatched {
            FlowMetrics::count(&self.metrics.dispatched, DISPATCH_QUEUED);
            self.metrics.queue_seconds.observe(waited.as_secs_f64());
            let v = Verdict::Go(Admitted { gate: self.clone() });
            match st.waiters.remove(&id) {
                Some(tx) => {
                    if let Err(v) = tx.send(v) {
                        undelivered.push(v);
                    }
                }
                None => undelivered.push(v),
            }
        }
        for (id, reason) in step.evicted {
            FlowMetrics::count(&self.metrics.evicted, reason.as_str());
            if let Some(tx) = st.waiters.remove(&id) {
                let _ = tx.send(Verdict::Evicted(reason));
            }
        }
        self.queued.store(st.ctl.queued(), Ordering::Release);
        self.show(&mut st);
        drop(st);
        // Permissions nobody took: released (each takes the lock) after it is let go.
        drop(undelivered);
    }

    fn show(&self, st: &mut GateState) {
        let snap = st.ctl.snapshot(Duration::ZERO);
        let GateState { shown, .. } = st;
        self.metrics.show(&snap, &self.pool, shown);
    }

    /// Every band and flow waiting, at `now`.
    pub(crate) fn snapshot(&self, now: Duration) -> FlowsSnapshot {
        self.lock().ctl.snapshot(now)
    }

    /// Requests held while the pool has no ready endpoint.
    pub(crate) fn held(&self) -> usize {
        self.lock().ctl.held()
    }
}
