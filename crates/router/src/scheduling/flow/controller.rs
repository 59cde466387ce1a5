//! [`FlowController`]: the bands, the bounds, the deadlines and the requests in transit.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use super::band::{Band, Queued};
use super::config::FlowConfig;
use super::outcome::{Admit, Eviction, Refusal, Step};
use super::request::{FlowRequest, PoolView};
use super::snapshot::{BandSnapshot, FlowSnapshot, FlowsSnapshot};

/// The waiting requests of one pool and what decides their order.
#[derive(Debug)]
pub struct FlowController {
    cfg: FlowConfig,
    /// Highest priority first.
    bands: BTreeMap<Reverse<i32>, Band>,
    /// Queued id → (band, flow).
    index: HashMap<u64, (i32, String)>,
    /// (deadline, id) of every queued request, soonest first.
    deadlines: BTreeSet<(Duration, u64)>,
    requests: usize,
    bytes: u64,
    /// Dispatched and not yet placed on an endpoint (the room does not show them yet).
    in_transit: u32,
    /// Whether the pool had a ready endpoint at the last decision.
    ready: bool,
}

impl FlowController {
    pub fn new(cfg: FlowConfig) -> Self {
        FlowController {
            cfg,
            bands: BTreeMap::new(),
            index: HashMap::new(),
            deadlines: BTreeSet::new(),
            requests: 0,
            bytes: 0,
            in_transit: 0,
            ready: true,
        }
    }

    pub fn config(&self) -> &FlowConfig {
        &self.cfg
    }

    /// Requests queued (held ones included).
    pub fn queued(&self) -> usize {
        self.requests
    }

    pub fn queued_bytes(&self) -> u64 {
        self.bytes
    }

    /// Requests waiting while the pool had no ready endpoint at the last decision.
    pub fn held(&self) -> usize {
        if self.ready {
            0
        } else {
            self.requests
        }
    }

    pub fn in_transit(&self) -> u32 {
        self.in_transit
    }

    /// The soonest deadline of a queued request: the caller runs
    /// [`FlowController::dispatch`] then, at the latest.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// Whether request `id` is queued.
    pub fn contains(&self, id: u64) -> bool {
        self.index.contains_key(&id)
    }

    /// A request arrives. Sheddable while saturated: refused. Room, and nothing of its
    /// band or above waiting: dispatched at once (and in transit until
    /// [`FlowController::placed`]). Otherwise it is queued if the bounds allow.
    pub fn enqueue(&mut self, req: FlowRequest, pool: &PoolView) -> Admit {
        self.ready = pool.ready;
        if req.priority < 0 && pool.saturated() {
            return Admit::Refused(Refusal::Shed);
        }
        if pool.room > self.in_transit && !self.waiting_at_or_above(req.priority) {
            self.in_transit += 1;
            return Admit::Dispatch;
        }
        let band_limits = self.cfg.band_limits(req.priority);
        let (band_requests, band_bytes) = self
            .bands
            .get(&Reverse(req.priority))
            .map_or((0, 0), |b| (b.requests(), b.bytes()));
        if !self.cfg.total.admits(self.requests, self.bytes, req.bytes)
            || !band_limits.admits(band_requests, band_bytes, req.bytes)
            || self.index.contains_key(&req.id)
        {
            return Admit::Refused(Refusal::Capacity);
        }
        let ttl = req.ttl.unwrap_or(self.cfg.default_ttl);
        let deadline = req.arrived.saturating_add(ttl);
        let q = Queued {
            id: req.id,
            bytes: req.bytes,
            arrived: req.arrived,
            deadline,
        };
        self.bands
            .entry(Reverse(req.priority))
            .or_default()
            .push(&req.flow, q);
        self.deadlines.insert((deadline, req.id));
        self.index.insert(req.id, (req.priority, req.flow));
        self.requests += 1;
        self.bytes = self.bytes.saturating_add(req.bytes);
        Admit::Queued
    }

    /// One round at `now`: evict what outlived its time to live, then dispatch while the
    /// pool has room beyond the requests in transit, highest band first, round-robin
    /// across the flows of a band.
    pub fn dispatch(&mut self, now: Duration, pool: &PoolView) -> Step {
        self.ready = pool.ready;
        let mut step = Step::default();
        let reason = if pool.ready {
            Eviction::Ttl
        } else {
            Eviction::HeldTtl
        };
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            if self.take(id).is_some() {
                step.evicted.push((id, reason));
            }
        }
        while pool.room > self.in_transit {
            let Some((&Reverse(priority), band)) =
                self.bands.iter_mut().find(|(_, b)| !b.is_empty())
            else {
                break;
            };
            let cfg = &self.cfg;
            let Some((_, q)) = band.pop(|f| cfg.weight(f)) else {
                break;
            };
            if band.is_empty() {
                self.bands.remove(&Reverse(priority));
            }
            self.forget(&q);
            self.in_transit += 1;
            step.dispatched.push((q.id, now.saturating_sub(q.arrived)));
        }
        step
    }

    /// A dispatched request was placed on an endpoint (or abandoned): the pool's room
    /// counts it from now on.
    pub fn placed(&mut self) {
        self.in_transit = self.in_transit.saturating_sub(1);
    }

    /// Takes a queued request out (its client went away). Whether it was queued.
    pub fn cancel(&mut self, id: u64) -> bool {
        self.take(id).is_some()
    }

    /// Every band and flow with requests, at `now`.
    pub fn snapshot(&self, now: Duration) -> FlowsSnapshot {
        let bands = self
            .bands
            .iter()
            .filter(|(_, b)| !b.is_empty())
            .map(|(Reverse(p), b)| BandSnapshot {
                priority: *p,
                requests: b.requests(),
                bytes: b.bytes(),
                flows: b
                    .flows()
                    .map(|(flow, requests, bytes, oldest)| FlowSnapshot {
                        flow: flow.to_string(),
                        requests,
                        bytes,
                        weight: self.cfg.weight(flow),
                        oldest_wait_ms: oldest
                            .map_or(0, |a| now.saturating_sub(a).as_millis() as u64),
                    })
                    .collect(),
            })
            .collect();
        FlowsSnapshot {
            requests: self.requests,
            bytes: self.bytes,
            held: self.held(),
            in_transit: self.in_transit,
            bands,
        }
    }

    fn waiting_at_or_above(&self, priority: i32) -> bool {
        self.bands
            .range(..=Reverse(priority))
            .any(|(_, b)| !b.is_empty())
    }

    fn take(&mut self, id: u64) -> Option<Queued> {
        let (priority, flow) = self.index.get(&id)?.clone();
        let band = self.bands.get_mut(&Reverse(priority))?;
        let q = band.remove(&flow, id)?;
        if band.is_empty() {
            self.bands.remove(&Reverse(priority));
        }
        self.forget(&q);
        Some(q)
    }

    /// Drops a request that left its band from the index, deadlines and totals.
    fn forget(&mut self, q: &Queued) {
        self.index.remove(&q.id);
        self.deadlines.remove(&(q.deadline, q.id));
        self.requests -= 1;
        self.bytes = self.bytes.saturating_sub(q.bytes);
    }
}
