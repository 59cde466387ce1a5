//! Policy tables: each test is a sequence of arrivals and dispatch rounds and the order
//! (or refusal, or eviction) they must produce.

use std::time::Duration;

use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn req(id: u64, flow: &str, priority: i32, at: u64) -> FlowRequest {
    FlowRequest {
        id,
        flow: flow.into(),
        priority,
        bytes: 100,
        arrived: ms(at),
        ttl: None,
    }
}

const FULL: PoolView = PoolView {
    ready: true,
    room: 0,
};
const EMPTY_POOL: PoolView = PoolView {
    ready: false,
    room: 0,
};

fn room(n: u32) -> PoolView {
    PoolView {
        ready: true,
        room: n,
    }
}

/// Dispatches one at a time (room 1, placed at once) until nothing is left; the ids in
/// order.
fn drain(fc: &mut FlowController, now: Duration) -> Vec<u64> {
    let mut out = Vec::new();
    loop {
        let step = fc.dispatch(now, &room(1));
        if step.dispatched.is_empty() {
            return out;
        }
        for (id, _) in step.dispatched {
            out.push(id);
            fc.placed();
        }
    }
}

#[test]
fn room_and_nothing_waiting_dispatches_at_once_and_counts_in_transit() {
    let mut fc = FlowController::new(FlowConfig::default());
    assert_eq!(fc.enqueue(req(1, "a", 0, 0), &room(2)), Admit::Dispatch);
    assert_eq!(fc.enqueue(req(2, "a", 0, 0), &room(2)), Admit::Dispatch);
    // Both in transit: the room of 2 is spoken for until they are placed.
    assert_eq!(fc.enqueue(req(3, "a", 0, 0), &room(2)), Admit::Queued);
    assert_eq!(fc.in_transit(), 2);
    fc.placed();
    fc.placed();
    // Placed, the pool's room (now 1, as the caller measures it) takes the queued one.
    let step = fc.dispatch(ms(5), &room(1));
    assert_eq!(step.dispatched, vec![(3, ms(5))]);
    assert_eq!(fc.queued(), 0);
}

#[test]
fn strict_priority_between_bands() {
    let mut fc = FlowController::new(FlowConfig::default());
    for (id, p) in [(1, 0), (2, 5), (3, -1), (4, 10), (5, 0), (6, 5)] {
        assert_eq!(fc.enqueue(req(id, "a", p, id), &EMPTY_POOL), Admit::Queued);
    }
    assert_eq!(drain(&mut fc, ms(10)), vec![4, 2, 6, 1, 5, 3]);
    // A request may jump the queue only when nothing of its band or above waits.
    fc.enqueue(req(7, "a", 0, 20), &FULL);
    assert_eq!(fc.enqueue(req(8, "a", 5, 20), &room(1)), Admit::Dispatch);
    assert_eq!(fc.enqueue(req(9, "a", 0, 20), &room(2)), Admit::Queued);
}

#[test]
fn round_robin_across_flows_fcfs_within_one() {
    let mut fc = FlowController::new(FlowConfig::default());
    // The noisy flow queues ten before the quiet one's two arrive.
    for id in 1..=10 {
        fc.enqueue(req(id, "noisy", 0, id), &FULL);
    }
    fc.enqueue(req(100, "quiet", 0, 11), &FULL);
    fc.enqueue(req(101, "quiet", 0, 12), &FULL);
    fc.enqueue(req(200, "third", 0, 13), &FULL);
    assert_eq!(
        drain(&mut fc, ms(20)),
        vec![1, 100, 200, 2, 101, 3, 4, 5, 6, 7, 8, 9, 10]
    );
}

#[test]
fn weighted_flows_get_their_weight_per_turn() {
    let cfg = FlowConfig {
        weights: [("gold".to_string(), 3)].into(),
        ..Default::default()
    };
    let mut fc = FlowController::new(cfg);
    for id in 1..=7 {
        fc.enqueue(req(id, "gold", 0, id), &FULL);
    }
    for id in 11..=14 {
        fc.enqueue(req(id, "plain", 0, id), &FULL);
    }
    assert_eq!(
        drain(&mut fc, ms(20)),
        vec![1, 2, 3, 11, 4, 5, 6, 12, 7, 13, 14]
    );
}

#[test]
fn ttl_eviction_default_and_per_request() {
    let cfg = FlowConfig {
        default_ttl: ms(100),
        ..Default::default()
    };
    let mut fc = FlowController::new(cfg);
    fc.enqueue(req(1, "a", 0, 0), &FULL);
    let mut short = req(2, "b", 0, 10);
    short.ttl = Some(ms(20));
    fc.enqueue(short, &FULL);
    fc.enqueue(req(3, "a", 0, 50), &FULL);
    assert_eq!(fc.next_deadline(), Some(ms(30)));
    assert!(fc.dispatch(ms(29), &FULL).is_empty());
    assert_eq!(fc.dispatch(ms(30), &FULL).evicted, vec![(2, Eviction::Ttl)]);
    assert_eq!(fc.next_deadline(), Some(ms(100)));
    let step = fc.dispatch(ms(120), &FULL);
    assert_eq!(step.evicted, vec![(1, Eviction::Ttl)]);
    assert_eq!(fc.queued(), 1);
    // Expired requests are evicted before room is handed out: one past its deadline is
    // never dispatched.
    let step = fc.dispatch(ms(150), &room(5));
    assert_eq!(step.evicted, vec![(3, Eviction::Ttl)]);
    assert!(step.dispatched.is_empty());
    assert_eq!((fc.queued(), fc.queued_bytes()), (0, 0));
}

#[test]
fn request_and_byte_bounds_per_band_and_in_total() {
    let cfg = FlowConfig {
        total: Limits {
            max_requests: Some(4),
            max_bytes: Some(1000),
        },
        per_band: Limits {
            max_requests: Some(3),
            max_bytes: None,
        },
        bands: [(
            9,
            Limits {
                max_requests: None,
                max_bytes: Some(250),
            },
        )]
        .into(),
        ..Default::default()
    };
    let mut fc = FlowController::new(cfg);
    for id in 1..=3 {
        assert_eq!(fc.enqueue(req(id, "a", 0, 0), &FULL), Admit::Queued);
    }
    // Band 0 holds 3 requests: the fourth is refused, though the total has room.
    assert_eq!(
        fc.enqueue(req(4, "b", 0, 0), &FULL),
        Admit::Refused(Refusal::Capacity)
    );
    // Band 9 is bounded by bytes: 100 + 100 fit in 250, a third 100 does not.
    assert_eq!(fc.enqueue(req(5, "a", 9, 0), &FULL), Admit::Queued);
    let mut big = req(6, "a", 9, 0);
    big.bytes = 151;
    assert_eq!(fc.enqueue(big, &FULL), Admit::Refused(Refusal::Capacity));
    // The total's request bound (4) is reached.
    assert_eq!(
        fc.enqueue(req(7, "a", 9, 0), &FULL),
        Admit::Refused(Refusal::Capacity)
    );
    // The total's byte bound: after one leaves, 300 bytes wait; 701 more do not fit in
    // 1000, 600 do.
    fc.cancel(1);
    let mut huge = req(8, "c", 1, 0);
    huge.bytes = 701;
    assert_eq!(fc.enqueue(huge, &FULL), Admit::Refused(Refusal::Capacity));
    let mut fits = req(9, "c", 1, 0);
    fits.bytes = 600;
    assert_eq!(fc.enqueue(fits, &FULL), Admit::Queued);
    assert_eq!((fc.queued(), fc.queued_bytes()), (4, 900));
    // A duplicate id is refused, never queued twice.
    assert_eq!(
        fc.enqueue(req(9, "c", 1, 0), &FULL),
        Admit::Refused(Refusal::Capacity)
    );
}

#[test]
fn sheddable_refused_only_while_saturated() {
    let mut fc = FlowController::new(FlowConfig::default());
    assert_eq!(
        fc.enqueue(req(1, "a", -1, 0), &FULL),
        Admit::Refused(Refusal::Shed)
    );
    assert_eq!(fc.enqueue(req(2, "a", -1, 0), &room(1)), Admit::Dispatch);
    assert_eq!(fc.enqueue(req(3, "a", 0, 0), &FULL), Admit::Queued);
    // An empty pool is not saturated: a sheddable request is held like any other.
    assert_eq!(fc.enqueue(req(4, "a", -1, 0), &EMPTY_POOL), Admit::Queued);
}

#[test]
fn held_while_the_pool_is_empty_then_dispatched_when_an_endpoint_appears() {
    let cfg = FlowConfig {
        default_ttl: ms(1000),
        ..Default::default()
    };
    let mut fc = FlowController::new(cfg);
    assert_eq!(fc.enqueue(req(1, "a", 0, 0), &EMPTY_POOL), Admit::Queued);
    assert_eq!(fc.enqueue(req(2, "b", 3, 5), &EMPTY_POOL), Admit::Queued);
    assert_eq!(fc.held(), 2);
    assert!(fc.dispatch(ms(500), &EMPTY_POOL).is_empty());
    assert_eq!(fc.held(), 2);
    // An endpoint is ready with room for both: the very next round sends them, band
    // order first.
    let step = fc.dispatch(ms(600), &room(4));
    assert_eq!(step.dispatched, vec![(2, ms(595)), (1, ms(600))]);
    assert_eq!((fc.held(), fc.queued()), (0, 0));
    // Held past its TTL: evicted as held.
    fc.enqueue(req(3, "a", 0, 700), &EMPTY_POOL);
    assert_eq!(
        fc.dispatch(ms(1700), &EMPTY_POOL).evicted,
        vec![(3, Eviction::HeldTtl)]
    );
}

#[test]
fn cancel_removes_a_request_and_keeps_the_turns() {
    let mut fc = FlowController::new(FlowConfig::default());
    for (id, f) in [(1, "a"), (2, "a"), (3, "b"), (4, "c")] {
        fc.enqueue(req(id, f, 0, id), &FULL);
    }
    assert!(fc.cancel(3));
    assert!(!fc.cancel(3));
    assert!(!fc.contains(3));
    assert_eq!(drain(&mut fc, ms(10)), vec![1, 4, 2]);
}

#[test]
fn snapshot_lists_bands_and_flows() {
    let cfg = FlowConfig {
        weights: [("b".to_string(), 2)].into(),
        ..Default::default()
    };
    let mut fc = FlowController::new(cfg);
    fc.enqueue(req(1, "a", 0, 0), &FULL);
    fc.enqueue(req(2, "b", 0, 10), &FULL);
    fc.enqueue(req(3, "b", 7, 20), &FULL);
    let s = fc.snapshot(ms(50));
    assert_eq!((s.requests, s.bytes, s.held), (3, 300, 0));
    assert_eq!(
        s.bands.iter().map(|b| b.priority).collect::<Vec<_>>(),
        vec![7, 0]
    );
    let b0 = &s.bands[1];
    assert_eq!(b0.requests, 2);
    assert_eq!(
        b0.flows
            .iter()
            .map(|f| (f.flow.as_str(), f.weight, f.oldest_wait_ms))
            .collect::<Vec<_>>(),
        vec![("a", 1, 50), ("b", 2, 40)]
    );
}

mod properties {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashSet};

    #[derive(Debug, Clone)]
    enum Op {
        Arrive {
            flow: u8,
            priority: i8,
            bytes: u16,
            ttl: Option<u16>,
        },
        Dispatch {
            room: u8,
            ready: bool,
        },
        Placed,
        Cancel(u8),
        Tick(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..4, -1i8..3, 0u16..500, proptest::option::of(1u16..300))
                .prop_map(|(flow, priority, bytes, ttl)| Op::Arrive { flow, priority, bytes, ttl }),
            3 => (0u8..4, any::<bool>()).prop_map(|(room, ready)| Op::Dispatch { room, ready }),
            1 => Just(Op::Placed),
            1 => any::<u8>().prop_map(Op::Cancel),
            2 => (1u16..200).prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Against a plain model: every dispatch is the oldest request of its flow, from
        /// the highest band with requests, within the room left; nothing past its deadline
        /// is ever dispatched; bounds hold; each request leaves exactly once.
        #[test]
        fn dispatches_respect_priority_fcfs_room_deadlines_and_bounds(ops in proptest::collection::vec(op(), 1..200)) {
            let cfg = FlowConfig {
                total: Limits { max_requests: Some(12), max_bytes: Some(3000) },
                per_band: Limits { max_requests: Some(6), max_bytes: None },
                default_ttl: ms(250),
                weights: [("f1".to_string(), 2)].into(),
                ..Default::default()
            };
            let mut fc = FlowController::new(cfg);
            // (priority, flow) → ids in arrival order; id → (priority, flow, bytes, deadline).
            let mut queues: BTreeMap<(i32, String), Vec<u64>> = BTreeMap::new();
            let mut meta: BTreeMap<u64, (i32, String, u64, Duration)> = BTreeMap::new();
            let mut gone: HashSet<u64> = HashSet::new();
            let mut now = ms(0);
            let mut next = 0u64;
            for op in ops {
                match op {
                    Op::Arrive { flow, priority, bytes, ttl } => {
                        let r = FlowRequest {
                            id: next,
                            flow: format!("f{flow}"),
                            priority: i32::from(priority),
                            bytes: u64::from(bytes),
                            arrived: now,
                            ttl: ttl.map(|t| ms(u64::from(t))),
                        };
                        next += 1;
                        let view = PoolView { ready: true, room: 0 };
                        let deadline = now + r.ttl.unwrap_or(ms(250));
                        match fc.enqueue(r.clone(), &view) {
                            Admit::Queued => {
                                queues.entry((r.priority, r.flow.clone())).or_default().push(r.id);
                                meta.insert(r.id, (r.priority, r.flow, r.bytes, deadline));
                            }
                            Admit::Refused(Refusal::Shed) => prop_assert!(r.priority < 0),
                            Admit::Refused(Refusal::Capacity) => {
                                let band: usize = queues.iter().filter(|((p, _), _)| *p == r.priority).map(|(_, q)| q.len()).sum();
                                let bytes: u64 = meta.values().map(|m| m.2).sum();
                                prop_assert!(meta.len() >= 12 || band >= 6 || bytes + r.bytes > 3000);
                            }
                            Admit::Dispatch => prop_assert!(false, "no room, yet dispatched"),
                        }
                    }
                    Op::Dispatch { room, ready } => {
                        let before = fc.in_transit();
                        let step = fc.dispatch(now, &PoolView { ready, room: u32::from(room) });
                        for (id, _) in &step.evicted {
                            prop_assert!(meta[id].3 <= now, "evicted before its deadline");
                            let (p, f, _, _) = meta.remove(id).unwrap();
                            queues.get_mut(&(p, f)).unwrap().retain(|x| x != id);
                            prop_assert!(gone.insert(*id));
                        }
                        prop_assert!(meta.values().all(|m| m.3 > now), "a request outlived its deadline");
                        prop_assert!(step.dispatched.len() as u32 <= u32::from(room).saturating_sub(before));
                        for (id, _) in &step.dispatched {
                            let (p, f, _, _) = meta.remove(id).unwrap();
                            let top = queues.iter().filter(|(_, q)| !q.is_empty()).map(|((p, _), _)| *p).max();
                            prop_assert_eq!(Some(p), top, "strict priority");
                            let q = queues.get_mut(&(p, f)).unwrap();
                            prop_assert_eq!(q.first(), Some(id), "FCFS within a flow");
                            q.remove(0);
                            prop_assert!(gone.insert(*id));
                        }
                    }
                    Op::Placed => fc.placed(),
                    Op::Cancel(i) => {
                        let id = u64::from(i) % next.max(1);
                        let queued = meta.contains_key(&id);
                        prop_assert_eq!(fc.cancel(id), queued);
                        if let Some((p, f, _, _)) = meta.remove(&id) {
                            queues.get_mut(&(p, f)).unwrap().retain(|x| *x != id);
                            prop_assert!(gone.insert(id));
                        }
                    }
                    Op::Tick(d) => now += ms(u64::from(d)),
                }
                prop_assert_eq!(fc.queued(), meta.len());
                prop_assert_eq!(fc.queued_bytes(), meta.values().map(|m| m.2).sum::<u64>());
                let snap = fc.snapshot(now);
                prop_assert_eq!(snap.bands.iter().map(|b| b.requests).sum::<usize>(), meta.len());
            }
        }
    }
}
