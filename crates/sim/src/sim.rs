//! The discrete-event loop: a virtual clock, one priority queue of events, and the
//! actors around it: the workload's users (`strata bench`'s sessions and load shapes),
//! the router ([`SimRouter`]), the replicas ([`SimEngine`]) and the autoscaler
//! (`strata_controller::autoscale::decide`), each acting at the virtual times the live
//! system would.
//!
//! Events are small `Copy` values in a binary heap ordered by (time, insertion number), so
//! equal times resolve in the order they were scheduled and a run is a pure function of
//! its configuration and seed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;
use strata_bench::load::{gap, LoadShape};
use strata_bench::prompt::ids_of;
use strata_bench::record::{Failure, FailureKind};
use strata_bench::workload::{Session, SessionSource, Workload};
use strata_bench::{LoadConfig, Report, RequestRecord};
use strata_controller::autoscale::{self, AutoscaleConfig, Load, Signals, State};
use strata_engine::options::EngineOptions;
use strata_engine::sequence::SeqEvent;
use strata_router::endpoint::EndpointId;
use strata_router::scheduling::flow::FlowController;
use strata_router::scheduling::{PreciseBlocks, SchedRequest, ScheduleError};
use strata_router::RouterConfig;

use crate::error::SimError;
use crate::profile::StepModel;
use crate::replica::{wire_hashes, SimEngine, StepResult};
use crate::routing::{Scrape, SimRouter};
use crate::tenants::{tenant_lines, TenantDraw, TenantLine};
use strata_engine::prefetch::prefetch;

mod flow;
mod itl;
mod token_times;

use token_times::{fill_itl, TimelineRequest, TokenGaps};

/// The autoscaler's part: its policy settings, how often the controller ticks, and how
/// long a new replica takes to become ready.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoscaleSetup {
    pub config: AutoscaleConfig,
    pub interval: Duration,
    pub cold_start: Duration,
}

/// Everything one simulation needs.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The workload, load shape, stop condition, seed and SLO, exactly as `strata bench`.
    pub load: LoadConfig,
    pub step: StepModel,
    /// Every replica's engine settings: the `strata engine` flags the simulator takes
    /// (block size, `--num-blocks`, batch limits, policy, prefix caching, step-time
    /// target), the rest at their defaults.
    pub engine: EngineOptions,
    /// Replicas at the start (with autoscaling, the policy moves this).
    pub replicas: u32,
    pub router: RouterConfig,
    /// How often the router reads each replica's metrics.
    pub scrape_interval: Duration,
    /// How long a KV event takes from a replica to the router's index.
    pub kv_event_delay: Duration,
    pub autoscale: Option<AutoscaleSetup>,
    /// Keep every token's time (ITL percentiles); off saves memory at scale.
    pub keep_token_times: bool,
    /// The router runs flow control (`router.flow_control`): requests wait in its queues
    /// for room instead of going straight to a replica's queue.
    pub flow_control: bool,
    /// Tenants sharing the workload by weight (empty: one), each its own flow.
    pub tenants: Vec<(String, f64)>,
}

/// What the run looked like from inside.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SimStats {
    pub events: u64,
    pub steps: u64,
    pub preemptions: u64,
    pub picks: u64,
    pub virtual_s: f64,
    pub wall_s: f64,
    pub events_per_s: f64,
    /// Replicas alive (starting, ready or draining) integrated over time.
    pub replica_seconds: f64,
    pub gpu_seconds: f64,
    pub max_replicas: u32,
    pub num_blocks_per_replica: usize,
    /// Autoscaler decisions that changed the count or its reason.
    pub decisions: Vec<DecisionLine>,
    /// Per tenant, when the run names tenants.
    pub tenants: Vec<TenantLine>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionLine {
    pub t_s: f64,
    pub desired: u32,
    pub previous: u32,
    pub ready: u32,
    pub reason: String,
}

/// The report (`strata bench`'s format) and the simulation's own numbers.
#[derive(Debug, Clone)]
pub struct SimOutcome {
    pub report: Report,
    pub stats: SimStats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A closed-loop user starts its next session.
    UserNext(u32),
    /// The next open-loop arrival.
    RateArrival,
    /// The next trace line's arrival.
    TraceArrival,
    /// A session sends its next turn (after think time).
    Turn(u32),
    StepDone(u32),
    Scrape,
    Autoscale,
    Ready(u32),
    /// A request in flow control reaches its time to live.
    FlowDeadline,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Starting,
    Ready,
    Draining,
    Gone,
}

struct Replica {
    engine: SimEngine,
    phase: Phase,
    slot: EndpointId,
    launched: Duration,
    stopped: Option<Duration>,
}

struct Req {
    start: Duration,
    first: Option<Duration>,
    /// The last token's time (the send until the first).
    last: Duration,
    prompt: u32,
    planned: u32,
    max_tokens: u32,
    out: u32,
    cached: u32,
    replica: u32,
    session: u32,
    tenant: u16,
    failure: Option<Failure>,
}

struct Held {
    id: u32,
    req: SchedRequest,
    prompt: Vec<u32>,
    max_tokens: usize,
}

struct SessionSlot {
    session: Session,
    next_turn: usize,
    /// System prompt, then every earlier turn and reply, as token ids.
    history: Vec<u32>,
    user: Option<u32>,
    /// Holds one of `--max-concurrency`'s slots.
    permit: bool,
    tenant: u16,
}

const NS: f64 = 1e9;

fn dur(secs: f64) -> Duration {
    Duration::from_nanos((secs * NS).round().max(0.0) as u64)
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    now: Duration,
    queue: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    order: u64,
    events: u64,
    router: SimRouter,
    replicas: Vec<Replica>,
    /// Slot → replica index, for slots in use.
    slot_owner: Vec<Option<u32>>,
    free_slots: Vec<u32>,
    num_blocks: usize,
    max_model_len: usize,
    events_tx: tokio::sync::mpsc::UnboundedSender<SeqEvent>,
    reqs: Vec<Req>,
    sessions: Vec<Option<SessionSlot>>,
    free_sessions: Vec<u32>,
    source: SessionSource,
    issued: u64,
    deadline: Option<Duration>,
    rate_rng: StdRng,
    rate_next: Duration,
    rate_blocked: bool,
    trace_next: Option<Session>,
    trace_blocked: bool,
    permits_free: Option<usize>,
    open_sessions: usize,
    in_flight: usize,
    /// Requests the router holds while no replica is ready (activation).
    held: VecDeque<Held>,
    /// The router's flow control, when on, and the requests waiting in it by id.
    flow: Option<FlowController>,
    flow_waiting: HashMap<u32, Held>,
    /// The deadline a [`Ev::FlowDeadline`] is queued for.
    flow_armed: Option<Duration>,
    tenants: TenantDraw,
    result: StepResult,
    // Autoscaling.
    scale_state: Option<State>,
    ttfts: Vec<f64>,
    /// Every request's token-time gaps, when token times are kept
    /// (`SimConfig::keep_token_times`).
    gaps: TokenGaps,
    stats: SimStats,
}

/// Runs one simulation to the end of its workload: the configuration checked and sized,
/// the actors set up at time zero, the first replicas and the workload started, then the
/// event loop to the end and the report.
pub fn simulate(cfg: &SimConfig) -> Result<SimOutcome, SimError> {
    let wall = Instant::now();
    let sizing = Sizing::check(cfg)?;
    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut sim = Sim::new(cfg, &sizing, events_tx)?;
    sim.start(sizing.initial);
    sim.run();
    drop(events_rx);
    Ok(sim.finish(wall))
}

/// What a checked configuration sizes: each replica's KV blocks and the replicas at the
/// start.
struct Sizing {
    num_blocks: usize,
    initial: u32,
}

impl Sizing {
    /// Checks `cfg` (each bad setting an error that names it) and sizes the fleet.
    fn check(cfg: &SimConfig) -> Result<Sizing, SimError> {
        let block_size = cfg.engine.block_size;
        if block_size == 0 || cfg.engine.max_num_seqs == 0 || cfg.engine.max_num_batched_tokens == 0
        {
            return Err(SimError::config(
                "engine",
                "--kv-block-size, --max-num-seqs and --max-num-batched-tokens must be at least 1",
            ));
        }
        if cfg.scrape_interval.is_zero() {
            return Err(SimError::config("--scrape-interval", "must be positive"));
        }
        let num_blocks = match cfg.engine.num_blocks {
            Some(n) if n > 0 => n,
            Some(_) => return Err(SimError::config("--num-blocks", "must be at least 1")),
            None => cfg.step.num_blocks(block_size)?,
        };
        if let Some(a) = &cfg.autoscale {
            a.config
                .validate()
                .map_err(|e| SimError::config("autoscale config", e.to_string()))?;
            if a.interval.is_zero() {
                return Err(SimError::config(
                    "controller intervalSecs",
                    "must be positive",
                ));
            }
        }
        let initial = match &cfg.autoscale {
            Some(a) => cfg
                .replicas
                .clamp(a.config.min_replicas, a.config.max_replicas),
            None => cfg.replicas,
        };
        if initial == 0 && cfg.autoscale.is_none() {
            return Err(SimError::config("--replicas", "must be at least 1"));
        }
        Ok(Sizing {
            num_blocks,
            initial,
        })
    }
}

impl<'a> Sim<'a> {
    /// Every actor at time zero, before anything happened: no replica, no request.
    fn new(
        cfg: &'a SimConfig,
        sizing: &Sizing,
        events_tx: tokio::sync::mpsc::UnboundedSender<SeqEvent>,
    ) -> Result<Sim<'a>, SimError> {
        let num_blocks = sizing.num_blocks;
        let max_model_len =
            (cfg.step.model.context_len as usize).min(num_blocks * cfg.engine.block_size);
        let permits_free = match &cfg.load.load {
            LoadShape::Rate {
                max_concurrency, ..
            }
            | LoadShape::Recorded { max_concurrency } => max_concurrency.map(|n| n.max(1)),
            LoadShape::Concurrency { .. } => None,
        };
        Ok(Sim {
            cfg,
            now: Duration::ZERO,
            queue: BinaryHeap::new(),
            order: 0,
            events: 0,
            router: SimRouter::new(&cfg.router, cfg.load.seed, cfg.kv_event_delay)?,
            replicas: Vec::new(),
            slot_owner: Vec::new(),
            free_slots: Vec::new(),
            num_blocks,
            max_model_len,
            events_tx,
            reqs: Vec::new(),
            sessions: Vec::new(),
            free_sessions: Vec::new(),
            source: SessionSource::new(cfg.load.workload.clone(), cfg.load.seed),
            issued: 0,
            deadline: cfg.load.stop.duration,
            // `strata bench` draws its arrival gaps from this seed (crates/bench/src/load.rs).
            rate_rng: StdRng::seed_from_u64(cfg.load.seed ^ 0x5eed_a771_0a1d),
            rate_next: Duration::ZERO,
            rate_blocked: false,
            trace_next: None,
            trace_blocked: false,
            permits_free,
            open_sessions: 0,
            in_flight: 0,
            held: VecDeque::new(),
            flow: cfg
                .flow_control
                .then(|| FlowController::new(cfg.router.flow_config())),
            flow_waiting: HashMap::new(),
            flow_armed: None,
            tenants: TenantDraw::new(&cfg.tenants, cfg.load.seed),
            result: StepResult::default(),
            scale_state: cfg.autoscale.as_ref().map(|_| State::new(sizing.initial)),
            ttfts: Vec::new(),
            gaps: TokenGaps::default(),
            stats: SimStats {
                num_blocks_per_replica: num_blocks,
                ..Default::default()
            },
        })
    }

    /// Time zero: `initial` replicas ready at once, the router's index sized for the
    /// workload, the first arrivals and the periodic ticks queued.
    fn start(&mut self, initial: u32) {
        let cfg = self.cfg;
        for _ in 0..initial {
            let r = self.launch();
            self.make_ready(r);
        }
        // Random prompts share nothing, so how many chunk hashes the router will record is
        // known up front.
        if let (Workload::Random(spec), Some(n)) = (&cfg.load.workload, cfg.load.stop.max_requests)
        {
            let endpoints = match &cfg.autoscale {
                Some(a) => a.config.max_replicas.max(initial),
                None => initial,
            };
            self.router.reserve_prompt_chunks(
                usize::try_from(n).unwrap_or(usize::MAX),
                spec.input_len as usize,
                endpoints as usize,
            );
        }
        self.start_workload();
        self.push(cfg.scrape_interval, Ev::Scrape);
        if let Some(a) = &cfg.autoscale {
            self.push(a.interval, Ev::Autoscale);
        }
    }
}

impl Sim<'_> {
    fn push(&mut self, at: Duration, ev: Ev) {
        let t = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX);
        self.queue.push(Reverse((t, self.order, ev)));
        self.order += 1;
    }

    fn run(&mut self) {
        while let Some(Reverse((t, _, ev))) = self.queue.pop() {
            self.now = Duration::from_nanos(t);
            self.events += 1;
            match ev {
                Ev::UserNext(u) => self.user_next(u),
                Ev::RateArrival => self.rate_arrival(),
                Ev::TraceArrival => self.trace_arrival(),
                Ev::Turn(s) => self.send_turn(s),
                Ev::StepDone(r) => self.step_done(r),
                Ev::Scrape => self.scrape(),
                Ev::Autoscale => self.autoscale_tick(),
                Ev::Ready(r) => {
                    if self.replicas[r as usize].phase == Phase::Starting {
                        self.make_ready(r);
                        self.release_held();
                        self.pump_flow();
                    }
                }
                Ev::FlowDeadline => {
                    self.flow_armed = None;
                    self.pump_flow();
                }
            }
        }
    }

    /// Whether anything is left to happen besides the periodic ticks.
    fn active(&self) -> bool {
        self.in_flight > 0
            || self.open_sessions > 0
            || !self.held.is_empty()
            || self.flow.as_ref().is_some_and(|f| f.queued() > 0)
            || self.queue.iter().any(|Reverse((_, _, e))| {
                !matches!(
                    e,
                    Ev::Scrape | Ev::Autoscale | Ev::StepDone(_) | Ev::Ready(_) | Ev::FlowDeadline
                )
            })
    }

    // ---- replicas ----

    fn launch(&mut self) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slot_owner.push(None);
                (self.slot_owner.len() - 1) as u32
            }
        };
        let index = self.replicas.len() as u32;
        self.slot_owner[slot as usize] = Some(index);
        let mut engine = SimEngine::new(
            &self.cfg.engine,
            self.num_blocks,
            self.cfg.step.model.context_len as usize,
            self.events_tx.clone(),
        );
        // Without the precise index the router drops every KV event: none are made.
        engine.set_kv_events(self.router.uses_precise());
        self.replicas.push(Replica {
            engine,
            phase: Phase::Starting,
            slot: EndpointId(slot),
            launched: self.now,
            stopped: None,
        });
        let alive = self
            .replicas
            .iter()
            .filter(|r| r.phase != Phase::Gone)
            .count() as u32;
        self.stats.max_replicas = self.stats.max_replicas.max(alive);
        index
    }

    fn make_ready(&mut self, r: u32) {
        let rep = &mut self.replicas[r as usize];
        rep.phase = Phase::Ready;
        let slot = rep.slot;
        self.router.add(slot);
    }

    fn retire(&mut self, r: u32) {
        let rep = &mut self.replicas[r as usize];
        if rep.phase == Phase::Gone {
            return;
        }
        let was_listed = rep.phase != Phase::Starting;
        rep.phase = Phase::Gone;
        rep.stopped = Some(self.now);
        let slot = rep.slot;
        if was_listed {
            self.router.remove(slot);
        }
        self.slot_owner[slot.0 as usize] = None;
        self.free_slots.push(slot.0);
    }

    fn kick(&mut self, r: u32) {
        let rep = &mut self.replicas[r as usize];
        if rep.engine.busy() {
            return;
        }
        if let Some(dt) = rep.engine.start_step(&self.cfg.step) {
            let at = self.now + dur(dt);
            self.push(at, Ev::StepDone(r));
        } else if rep.phase == Phase::Draining && !rep.engine.has_work() {
            self.retire(r);
        }
    }

    fn step_done(&mut self, r: u32) {
        let now = self.now;
        let slot = self.replicas[r as usize].slot;
        let mut result = std::mem::take(&mut self.result);
        self.replicas[r as usize].engine.finish_step(&mut result);
        if !result.kv.is_empty() {
            self.router.announce(slot, now, result.kv.drain(..));
        }
        let keep_times = self.cfg.keep_token_times;
        let step = if keep_times {
            self.gaps.step(r, now)
        } else {
            0
        };
        // The step's requests were last touched about a thousand events ago: start
        // loading all of them before the first is read.
        for &(id, _) in &result.tokens {
            if let Some(req) = self.reqs.get(id as usize) {
                prefetch(req);
            }
            self.gaps.prefetch(id as u32);
        }
        for &(id, n) in &result.tokens {
            let req = &mut self.reqs[id as usize];
            if req.first.is_none() {
                req.first = Some(now);
                self.ttfts.push((now - req.start).as_secs_f64());
                if keep_times {
                    self.gaps.first(id as u32, r, step);
                }
            } else if keep_times {
                // The gap between consecutive token times (`(now - start) - (last -
                // start)`: the same whole nanoseconds).
                let gap = now - req.last;
                let expect = req.max_tokens.saturating_sub(1) as usize;
                self.gaps.record(id as u32, r, step, gap, expect);
            }
            req.out = n;
            req.last = now;
        }
        let finished = std::mem::take(&mut result.finished);
        for seq in finished {
            let id = seq.arrival_seq as u32;
            {
                let req = &mut self.reqs[id as usize];
                req.cached = seq.cached_tokens as u32;
                req.prompt = seq.prompt_len as u32;
            }
            self.router.finished(slot);
            self.in_flight -= 1;
            let session = self.reqs[id as usize].session;
            self.turn_done(session, Some(seq.output()));
        }
        self.result = result;
        self.kick(r);
        // Finished requests: room for waiting ones.
        self.pump_flow();
    }

    fn scrape(&mut self) {
        let now = self.now;
        for rep in &self.replicas {
            if matches!(rep.phase, Phase::Ready | Phase::Draining) {
                let m = Scrape {
                    waiting: rep.engine.waiting() as f64,
                    running: rep.engine.running() as f64,
                    kv: rep.engine.kv_usage(),
                    block_size: self.cfg.engine.block_size as u32,
                    num_blocks: self.num_blocks as u64,
                };
                self.router.scraped(rep.slot, now, &m);
            }
        }
        self.pump_flow();
        if self.active() {
            self.push(now + self.cfg.scrape_interval, Ev::Scrape);
        }
    }

    fn autoscale_tick(&mut self) {
        let Some(setup) = &self.cfg.autoscale else {
            return;
        };
        let Some(state) = self.scale_state.take() else {
            return;
        };
        let now = self.now;
        let block_size = self.cfg.engine.block_size as f64;
        let mut load = Load::default();
        let mut kv_sum = 0.0;
        let mut tokens = 0.0;
        let mut ready = 0u32;
        for rep in self.replicas.iter().filter(|r| r.phase == Phase::Ready) {
            ready += 1;
            load.waiting += rep.engine.waiting() as f64;
            load.running += rep.engine.running() as f64;
            let kv = rep.engine.kv_usage();
            kv_sum += kv;
            tokens += kv * self.num_blocks as f64 * block_size;
        }
        if ready > 0 {
            load.kv_usage = Some(kv_sum / f64::from(ready));
            load.inflight_tokens = Some(tokens);
        }
        // The controller reads TTFT p90 from the histograms' growth since its last
        // scrape; here, the exact p90 of the TTFTs since the last tick.
        if !self.ttfts.is_empty() {
            self.ttfts.sort_by(f64::total_cmp);
            let i = ((self.ttfts.len() as f64 * 0.9).ceil() as usize).clamp(1, self.ttfts.len());
            load.ttft_p90_secs = Some(self.ttfts[i - 1]);
            self.ttfts.clear();
        }
        let signals = Signals {
            ready,
            load: Some(load),
            partial: None,
            held_requests: u32::try_from(
                self.held.len() + self.flow.as_ref().map_or(0, FlowController::held),
            )
            .unwrap_or(u32::MAX),
        };
        let previous_reason = self.stats.decisions.last().map(|d| d.reason.clone());
        let (decision, state) = autoscale::decide(&setup.config, &state, &signals, now);
        self.scale_state = Some(state);
        let reason = format!("{:?}", decision.reason);
        if decision.desired != decision.previous || previous_reason.as_ref() != Some(&reason) {
            self.stats.decisions.push(DecisionLine {
                t_s: now.as_secs_f64(),
                desired: decision.desired,
                previous: decision.previous,
                ready,
                reason,
            });
        }
        self.reconcile(decision.desired, setup.cold_start);
        if self.active() {
            self.push(now + setup.interval, Ev::Autoscale);
        }
    }

    /// The local driver's reconcile: start what is missing; stop what is extra, starting
    /// replicas first, then the newest ready ones (drained: they finish what they hold).
    fn reconcile(&mut self, desired: u32, cold_start: Duration) {
        let live: Vec<u32> = (0..self.replicas.len() as u32)
            .filter(|&r| {
                matches!(
                    self.replicas[r as usize].phase,
                    Phase::Starting | Phase::Ready
                )
            })
            .collect();
        let have = live.len() as u32;
        if have < desired {
            for _ in have..desired {
                let r = self.launch();
                self.push(self.now + cold_start, Ev::Ready(r));
            }
        } else if have > desired {
            let mut victims = live;
            victims.sort_by_key(|&r| {
                (
                    self.replicas[r as usize].phase == Phase::Ready,
                    Reverse(self.replicas[r as usize].launched),
                    Reverse(r),
                )
            });
            for r in victims.into_iter().take((have - desired) as usize) {
                match self.replicas[r as usize].phase {
                    Phase::Starting => self.retire(r),
                    _ => {
                        let slot = self.replicas[r as usize].slot;
                        self.replicas[r as usize].phase = Phase::Draining;
                        self.router.set_draining(slot, true);
                        self.kick(r);
                    }
                }
            }
        }
    }

    // ---- workload ----

    fn start_workload(&mut self) {
        match &self.cfg.load.load {
            LoadShape::Concurrency { users } => {
                for u in 0..(*users).max(1) as u32 {
                    self.push(Duration::ZERO, Ev::UserNext(u));
                }
            }
            LoadShape::Rate { .. } => self.push(Duration::ZERO, Ev::RateArrival),
            LoadShape::Recorded { .. } => {
                self.trace_next = self.source.next_session();
                if let Some(s) = &self.trace_next {
                    let at = s.arrival.unwrap_or_default();
                    self.push(at, Ev::TraceArrival);
                }
            }
        }
    }

    fn budget_open(&self) -> bool {
        self.deadline.is_none_or(|d| self.now < d)
            && self
                .cfg
                .load
                .stop
                .max_requests
                .is_none_or(|m| self.issued < m)
    }

    fn take_ticket(&mut self) -> bool {
        if self.deadline.is_some_and(|d| self.now >= d) {
            return false;
        }
        let n = self.issued;
        self.issued += 1;
        self.cfg.load.stop.max_requests.is_none_or(|m| n < m)
    }

    fn open_session(&mut self, session: Session, user: Option<u32>, permit: bool) {
        let mut history = Vec::new();
        if !session.system.is_empty() {
            history = ids_of(&session.system);
        }
        let slot = SessionSlot {
            session,
            next_turn: 0,
            history,
            user,
            permit,
            tenant: self.tenants.draw(),
        };
        let id = match self.free_sessions.pop() {
            Some(i) => {
                self.sessions[i as usize] = Some(slot);
                i
            }
            None => {
                self.sessions.push(Some(slot));
                (self.sessions.len() - 1) as u32
            }
        };
        self.open_sessions += 1;
        self.send_turn(id);
    }

    fn user_next(&mut self, u: u32) {
        if !self.take_ticket() {
            return;
        }
        if let Some(session) = self.source.next_session() {
            self.open_session(session, Some(u), false);
        }
    }

    fn rate_arrival(&mut self) {
        if !self.budget_open() {
            return;
        }
        if self.permits_free == Some(0) {
            self.rate_blocked = true;
            return;
        }
        if !self.take_ticket() {
            return;
        }
        let Some(session) = self.source.next_session() else {
            return;
        };
        let permit = self.take_permit();
        self.open_session(session, None, permit);
        if let LoadShape::Rate { rate, arrival, .. } = &self.cfg.load.load {
            self.rate_next += gap(*rate, *arrival, &mut self.rate_rng);
            let at = self.rate_next.max(self.now);
            self.push(at, Ev::RateArrival);
        }
    }

    fn trace_arrival(&mut self) {
        if !self.budget_open() {
            return;
        }
        if self.permits_free == Some(0) {
            self.trace_blocked = true;
            return;
        }
        if !self.take_ticket() {
            return;
        }
        let Some(session) = self.trace_next.take() else {
            return;
        };
        let permit = self.take_permit();
        self.open_session(session, None, permit);
        self.trace_next = self.source.next_session();
        if let Some(s) = &self.trace_next {
            let at = s.arrival.unwrap_or_default().max(self.now);
            self.push(at, Ev::TraceArrival);
        }
    }

    fn take_permit(&mut self) -> bool {
        match &mut self.permits_free {
            Some(n) => {
                *n -= 1;
                true
            }
            None => false,
        }
    }

    /// Sends session `s`'s next turn now: builds the prompt, asks the router, submits.
    fn send_turn(&mut self, s: u32) {
        let later_turn = match &self.sessions[s as usize] {
            Some(slot) => slot.next_turn > 0,
            None => return,
        };
        // A later turn needs its own ticket; think time past the deadline ends the
        // conversation.
        if later_turn && !self.take_ticket() {
            return self.close_session(s);
        }
        let (prompt, max_tokens, planned, session_key, tenant) = {
            let Some(slot) = self.sessions[s as usize].as_ref() else {
                return;
            };
            let turn = &slot.session.turns[slot.next_turn];
            let user_len: usize = turn.user.iter().map(|x| x.len as usize).sum();
            // Room for the reply too: the engine appends every generated token to it.
            let mut prompt =
                Vec::with_capacity(slot.history.len() + user_len + turn.max_tokens as usize);
            prompt.extend_from_slice(&slot.history);
            let planned = (slot.session.system.iter().map(|x| x.len).sum::<u32>())
                + slot.session.turns[..=slot.next_turn]
                    .iter()
                    .map(|t| t.user.iter().map(|x| x.len).sum::<u32>())
                    .sum::<u32>();
            // The user's turn rendered in place (`ids_of` without its own list).
            for seg in &turn.user {
                seg.render_ids(&mut prompt);
            }
            (
                prompt,
                turn.max_tokens,
                planned,
                slot.session.id,
                slot.tenant,
            )
        };
        let id = self.reqs.len() as u32;
        self.reqs.push(Req {
            start: self.now,
            first: None,
            last: self.now,
            prompt: prompt.len() as u32,
            planned,
            max_tokens,
            out: 0,
            cached: 0,
            replica: u32::MAX,
            session: s,
            tenant,
            failure: None,
        });
        self.in_flight += 1;
        if prompt.len() + max_tokens as usize > self.max_model_len {
            let message = format!(
                "this model's maximum context length is {} tokens; the request asks for {}",
                self.max_model_len,
                prompt.len() + max_tokens as usize
            );
            return self.fail(id, FailureKind::HttpStatus(400), message);
        }
        let mut req = SchedRequest {
            model: self.cfg.load.client.model.clone(),
            session: session_key.map(|k| k.to_string()),
            ..Default::default()
        };
        req.approx_blocks = self.router.approx_blocks(&req.model, &prompt);
        if self.router.uses_precise() {
            let bs = self.cfg.engine.block_size;
            req.precise_blocks = Some(PreciseBlocks::single(bs as u32, wire_hashes(&prompt, bs)));
        }
        self.admit(id, req, prompt, max_tokens as usize);
    }

    fn pending_submit(
        &mut self,
        id: u32,
        mut req: SchedRequest,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) {
        match self.router.pick(self.now, &mut req) {
            Ok(decision) => {
                self.stats.picks += 1;
                let slot = decision.pick();
                let Some(Some(r)) = self.slot_owner.get(slot.0 as usize).copied() else {
                    return self.fail(
                        id,
                        FailureKind::HttpStatus(503),
                        "picked a gone endpoint".into(),
                    );
                };
                self.reqs[id as usize].replica = r;
                self.replicas[r as usize]
                    .engine
                    .submit(u64::from(id), prompt, max_tokens);
                self.kick(r);
            }
            Err(ScheduleError::NoReadyEndpoint) if self.cfg.autoscale.is_some() => {
                // Activation: the router holds the request until a replica is ready.
                self.held.push_back(Held {
                    id,
                    req,
                    prompt,
                    max_tokens,
                });
            }
            Err(e) => self.fail(id, FailureKind::HttpStatus(503), e.to_string()),
        }
    }

    fn release_held(&mut self) {
        while self.router.any_ready() {
            let Some(h) = self.held.pop_front() else {
                break;
            };
            self.pending_submit(h.id, h.req, h.prompt, h.max_tokens);
        }
    }

    fn fail(&mut self, id: u32, kind: FailureKind, message: String) {
        let req = &mut self.reqs[id as usize];
        req.failure = Some(Failure { kind, message });
        req.last = self.now;
        self.in_flight -= 1;
        let s = req.session;
        self.turn_done(s, None);
    }

    /// A turn of session `s` ended (`reply`: its generated tokens, `None` on failure).
    fn turn_done(&mut self, s: u32, reply: Option<&[u32]>) {
        let now = self.now;
        let Some(slot) = self.sessions[s as usize].as_mut() else {
            return;
        };
        let Some(reply) = reply else {
            return self.close_session(s);
        };
        slot.next_turn += 1;
        if slot.next_turn >= slot.session.turns.len() {
            // No later turn reads the history.
            return self.close_session(s);
        }
        for seg in &slot.session.turns[slot.next_turn - 1].user {
            seg.render_ids(&mut slot.history);
        }
        slot.history.extend_from_slice(reply);
        let at = now + slot.session.think_time;
        self.push(at, Ev::Turn(s));
    }

    fn close_session(&mut self, s: u32) {
        let Some(slot) = self.sessions[s as usize].take() else {
            return;
        };
        self.free_sessions.push(s);
        self.open_sessions -= 1;
        if let Some(u) = slot.user {
            self.push(self.now, Ev::UserNext(u));
        }
        if slot.permit {
            if let Some(n) = &mut self.permits_free {
                *n += 1;
            }
            if self.rate_blocked {
                self.rate_blocked = false;
                self.push(self.now, Ev::RateArrival);
            }
            if self.trace_blocked {
                self.trace_blocked = false;
                self.push(self.now, Ev::TraceArrival);
            }
        }
    }

    // ---- the end ----

    fn finish(mut self, wall: Instant) -> SimOutcome {
        let end = self.reqs.iter().map(|r| r.last).max().unwrap_or_default();
        let mut gpu_tp = 0.0;
        for rep in &self.replicas {
            let until = rep.stopped.unwrap_or(end).min(end);
            let alive = until.saturating_sub(rep.launched).as_secs_f64();
            self.stats.replica_seconds += alive;
            gpu_tp += alive * f64::from(self.cfg.step.tp);
            self.stats.steps += rep.engine.steps;
            self.stats.preemptions += rep.engine.preemptions;
        }
        self.stats.gpu_seconds = gpu_tp;
        if !self.cfg.tenants.is_empty() {
            self.stats.tenants = tenant_lines(
                &self.tenants,
                self.reqs.iter().map(|r| {
                    (
                        r.tenant,
                        r.first.map(|f| (f - r.start).as_secs_f64()),
                        (r.last - r.start).as_secs_f64(),
                        r.failure.is_some(),
                    )
                }),
            );
        }
        self.stats.events = self.events;
        self.stats.virtual_s = end.as_secs_f64();
        // The fleet's state is no longer needed: free it before the report is built.
        drop(std::mem::take(&mut self.replicas));
        self.router.free_indexes();
        // The report reads token times for ITL only. Its summary and CDF come from the
        // gaps kept in `itl` (below); a per-request ITL objective needs only each
        // request's longest gap, which a two-entry list carries exactly.
        let itl_slo = self.cfg.load.slo.itl_ms.is_some();
        let keep_times = self.cfg.keep_token_times;
        let gaps = std::mem::take(&mut self.gaps);
        let mut timeline = Vec::with_capacity(if keep_times { self.reqs.len() } else { 0 });
        let mut records: Vec<RequestRecord> = Vec::with_capacity(self.reqs.len());
        for (id, r) in self.reqs.drain(..).enumerate() {
            let record = RequestRecord {
                start: r.start,
                ttft: r.first.map(|f| f - r.start),
                e2e: r.last - r.start,
                token_times: match gaps.max_of(id as u32) {
                    Some(g) if itl_slo => vec![Duration::ZERO, g],
                    _ => Vec::new(),
                },
                prompt_tokens: r.failure.is_none().then_some(r.prompt),
                planned_prompt_tokens: r.planned,
                completion_tokens: r.failure.is_none().then_some(r.out),
                cached_tokens: r.failure.is_none().then_some(r.cached),
                served_by: (r.replica != u32::MAX).then(|| format!("replica-{}", r.replica)),
                text: String::new(),
                failure: r.failure,
            };
            if keep_times {
                // Token times as the simulation has always recorded them: from the
                // request's send (`strata bench`'s live client counts from the run's
                // start, so simulated timelines put tokens early; ITL is the same).
                // Changing it changes reports: a change of its own.
                timeline.push(TimelineRequest {
                    first: r.first.map(|f| f - r.start),
                    ok: record.ok(),
                    output_tokens: record.completion_tokens.unwrap_or(0),
                });
            }
            records.push(record);
        }
        self.stats.wall_s = wall.elapsed().as_secs_f64();
        self.stats.events_per_s = self.events as f64 / self.stats.wall_s.max(1e-9);
        let mut config = serde_json::to_value(&self.cfg.load).unwrap_or(serde_json::Value::Null);
        if let serde_json::Value::Object(map) = &mut config {
            map.insert("sim".into(), self.describe());
        }
        let mut report = Report::from_records(
            &self.cfg.load.label,
            config,
            &records,
            end,
            &self.cfg.load.slo,
        );
        report.started_at_unix_s = 0.0;
        if keep_times {
            drop(records);
            gaps.fill_timeline(&mut report, &timeline);
            drop(timeline);
            fill_itl(&mut report, gaps.into_itl());
        }
        SimOutcome {
            report,
            stats: self.stats,
        }
    }

    fn describe(&self) -> serde_json::Value {
        let s = &self.cfg.step;
        serde_json::json!({
            "hardware": s.hardware,
            "model": s.model,
            "tp": s.tp,
            "replicas": self.cfg.replicas,
            "engine": {
                "block_size": self.cfg.engine.block_size,
                "num_blocks": self.num_blocks,
                "max_num_seqs": self.cfg.engine.max_num_seqs,
                "max_num_batched_tokens": self.cfg.engine.max_num_batched_tokens,
                "prefix_caching": self.cfg.engine.prefix_caching,
            },
            "scrape_interval_s": self.cfg.scrape_interval.as_secs_f64(),
            "kv_event_delay_s": self.cfg.kv_event_delay.as_secs_f64(),
            "flow_control": self.cfg.flow_control,
            "tenants": self.stats.tenants,
            "autoscale": self.cfg.autoscale.as_ref().map(|a| serde_json::json!({
                "config": a.config,
                "interval_s": a.interval.as_secs_f64(),
                "cold_start_s": a.cold_start.as_secs_f64(),
            })),
            // The simulator's own wall time is left out: a report depends only on its
            // configuration and seed.
            "stats": {
                "events": self.stats.events,
                "steps": self.stats.steps,
                "preemptions": self.stats.preemptions,
                "picks": self.stats.picks,
                "virtual_s": self.stats.virtual_s,
                "replica_seconds": self.stats.replica_seconds,
                "gpu_seconds": self.stats.gpu_seconds,
                "max_replicas": self.stats.max_replicas,
                "decisions": self.stats.decisions,
            },
        })
    }
}
