//! Saturation detection and admission (PROTOCOLS §6): pure functions of the candidates'
//! metrics, `now` and the request's priority.

use std::time::Duration;

use super::Candidate;

/// When an endpoint counts as saturated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationConfig {
    /// Waiting requests at or above which an endpoint is saturated.
    pub queue_threshold: f64,
    /// KV use at or above which an endpoint is saturated.
    pub kv_threshold: f64,
    /// Metrics older than this count as saturated.
    pub stale_after: Duration,
    /// An endpoint whose load is unknown (never any readable metrics) is saturated once
    /// this router has this many requests in flight there.
    pub unknown_load_max_in_flight: u32,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        SaturationConfig {
            queue_threshold: 5.0,
            kv_threshold: 0.8,
            stale_after: Duration::from_millis(200),
            unknown_load_max_in_flight: 64,
        }
    }
}

/// Whether one endpoint is saturated at `now`. Metrics that went stale count as saturated
/// (the endpoint stopped saying how it is); an endpoint that has never said (its load is
/// unknown: no `/metrics`, or not one this router can read) is judged by this router's own
/// requests in flight there, so a pool of plain OpenAI-compatible backends still routes.
pub fn endpoint_saturated(c: &Candidate, now: Duration, cfg: &SaturationConfig) -> bool {
    if c.load_unknown() {
        return c.in_flight >= cfg.unknown_load_max_in_flight;
    }
    match c.fresh_metrics(now, cfg.stale_after) {
        None => true,
        Some(m) => {
            m.waiting >= cfg.queue_threshold || m.kv_use.is_some_and(|kv| kv >= cfg.kv_threshold)
        }
    }
}

/// Whether the whole pool is saturated: every ready, non-draining endpoint is (or there
/// is none).
pub fn pool_saturated(cands: &[Candidate], now: Duration, cfg: &SaturationConfig) -> bool {
    cands
        .iter()
        .filter(|c| c.ready && !c.draining)
        .all(|c| endpoint_saturated(c, now, cfg))
}

/// How many more requests one endpoint can take at `now` before it counts as saturated,
/// by the same thresholds as [`endpoint_saturated`]: an endpoint whose load is unknown by
/// its free in-flight slots; one with stale metrics, or KV use at the threshold, none;
/// otherwise the queue threshold less its waiting requests as last scraped, plus those
/// this router sent there since that scrape, less those that finished there since (each
/// finish lets one waiting request run).
pub fn endpoint_room(c: &Candidate, now: Duration, cfg: &SaturationConfig) -> u32 {
    if c.load_unknown() {
        return cfg.unknown_load_max_in_flight.saturating_sub(c.in_flight);
    }
    let Some(m) = c.fresh_metrics(now, cfg.stale_after) else {
        return 0;
    };
    if m.kv_use.is_some_and(|kv| kv >= cfg.kv_threshold) {
        return 0;
    }
    let since = f64::from(c.sent_since_scrape) - f64::from(c.done_since_scrape);
    let waiting = (m.waiting.max(0.0) + since).max(0.0);
    let room = (cfg.queue_threshold - waiting).ceil();
    if room.is_finite() && room > 0.0 {
        room.min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

/// The pool's room: the sum of [`endpoint_room`] over its ready, non-draining endpoints
/// (0 when there is none). Flow control dispatches while it is above the requests already
/// dispatched and not yet placed.
pub fn pool_room(cands: &[Candidate], now: Duration, cfg: &SaturationConfig) -> u32 {
    cands
        .iter()
        .filter(|c| c.ready && !c.draining)
        .fold(0u32, |acc, c| {
            acc.saturating_add(endpoint_room(c, now, cfg))
        })
}

/// What to do with a request on arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Schedule it now.
    Dispatch,
    /// Wait (bounded) for capacity.
    Queue,
    /// Refuse with 429: sheddable while the pool is saturated.
    Shed,
}

/// Sheddable (priority < 0) requests are shed while the pool is saturated; others wait.
pub fn admit(priority: i32, saturated: bool) -> Admission {
    match (saturated, priority < 0) {
        (false, _) => Admission::Dispatch,
        (true, true) => Admission::Shed,
        (true, false) => Admission::Queue,
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    #[test]
    fn thresholds_and_staleness() {
        let cfg = SaturationConfig::default();
        let n = now();
        assert!(!endpoint_saturated(&cand(0, 4.0, 0.79), n, &cfg));
        assert!(endpoint_saturated(&cand(0, 5.0, 0.0), n, &cfg));
        assert!(endpoint_saturated(&cand(0, 0.0, 0.8), n, &cfg));
        let c = cand(0, 0.0, 0.0);
        assert!(!endpoint_saturated(
            &c,
            n + Duration::from_millis(200),
            &cfg
        ));
        assert!(
            endpoint_saturated(&c, n + Duration::from_millis(201), &cfg),
            "stale"
        );
        // Load unknown (never any metrics): judged by in-flight requests.
        let mut unknown = cand(0, 0.0, 0.0);
        unknown.metrics = None;
        assert!(!endpoint_saturated(&unknown, n, &cfg));
        unknown.in_flight = cfg.unknown_load_max_in_flight;
        assert!(endpoint_saturated(&unknown, n, &cfg));
    }

    #[test]
    fn pool_is_saturated_only_when_every_ready_endpoint_is() {
        let cfg = SaturationConfig::default();
        let mut cs = vec![cand(0, 9.0, 0.0), cand(1, 0.0, 0.1)];
        assert!(!pool_saturated(&cs, now(), &cfg));
        cs[1].draining = true;
        assert!(pool_saturated(&cs, now(), &cfg));
        cs[1].draining = false;
        cs[1].ready = false;
        assert!(pool_saturated(&cs, now(), &cfg));
        assert!(pool_saturated(&[], now(), &cfg));
    }

    #[test]
    fn room_follows_the_saturation_thresholds_and_what_was_sent_since() {
        let cfg = SaturationConfig::default();
        let n = now();
        // queue_threshold 5: 2 waiting leaves 3.
        let mut c = cand(0, 2.0, 0.1);
        assert_eq!(endpoint_room(&c, n, &cfg), 3);
        assert!(!endpoint_saturated(&c, n, &cfg));
        // Two sent since the scrape, one finished since: 2 + 2 - 1 = 3 waiting, room 2.
        c.sent_since_scrape = 2;
        c.done_since_scrape = 1;
        assert_eq!(endpoint_room(&c, n, &cfg), 2);
        // More finished than sent: never below the scraped queue's complement... nor above
        // the threshold.
        c.sent_since_scrape = 0;
        c.done_since_scrape = 9;
        assert_eq!(endpoint_room(&c, n, &cfg), 5);
        // Saturated by queue, by KV, stale: none.
        assert_eq!(endpoint_room(&cand(0, 5.0, 0.0), n, &cfg), 0);
        assert_eq!(endpoint_room(&cand(0, 0.0, 0.8), n, &cfg), 0);
        assert_eq!(
            endpoint_room(&cand(0, 0.0, 0.0), n + Duration::from_secs(1), &cfg),
            0
        );
        // Unknown load: free in-flight slots.
        let mut u = cand(0, 0.0, 0.0);
        u.metrics = None;
        u.in_flight = 60;
        assert_eq!(endpoint_room(&u, n, &cfg), 4);
        // The pool sums ready, non-draining endpoints; a fresh scrape resets the counts.
        let mut cs = vec![cand(0, 2.0, 0.1), cand(1, 0.0, 0.1), cand(2, 0.0, 0.1)];
        cs[2].draining = true;
        assert_eq!(pool_room(&cs, n, &cfg), 3 + 5);
        cs[1].ready = false;
        assert_eq!(pool_room(&cs, n, &cfg), 3);
        cs[0].sent_since_scrape = 3;
        assert_eq!(pool_room(&cs, n, &cfg), 0);
        let m = cs[0].metrics.clone().unwrap();
        cs[0].scraped(m);
        assert_eq!(pool_room(&cs, n, &cfg), 3);
        assert_eq!(pool_room(&[], n, &cfg), 0);
    }

    #[test]
    fn admission_table() {
        assert_eq!(admit(-1, false), Admission::Dispatch);
        assert_eq!(admit(-1, true), Admission::Shed);
        assert_eq!(admit(0, true), Admission::Queue);
        assert_eq!(admit(5, false), Admission::Dispatch);
    }
}
