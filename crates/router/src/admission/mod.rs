//! Admission through flow control, for both transports and the embedding gateway: a
//! request's [`Ticket`] (priority, flow, size, deadline) is read from its headers, then
//! [`Router::admit_flow`] refuses it (429), lets it through, or queues it until the flow
//! controller dispatches it (room appeared: a scrape, a readiness change, a finished
//! request) or evicts it (its time to live ran out: 503).
//!
//! The order is the pure [`crate::scheduling::flow`] layer's; this module delivers it
//! ([`gate`]) and exports it ([`metrics`]).

pub mod gate;
pub mod metrics;

use std::time::Duration;

pub use gate::{Admitted, Ticket};

use crate::intake::Headers;
use crate::router::{RouteError, Router};
use gate::Arrival;

/// Longest flow id kept (longer ones are cut at a character boundary): it names a queue
/// and a metric series.
pub const MAX_FLOW_ID: usize = 256;

impl Ticket {
    /// The ticket of a request for `model` with `bytes` of body: its priority (the
    /// objective header, else the objective `admission.model_objectives` maps the model
    /// to, else the body's `priority`, else 0), its flow (the first of
    /// `flow_control.flow_headers` present) and its deadline (`flow_control.deadline_header`,
    /// in milliseconds, when shorter than the default time to live).
    pub fn read(
        router: &Router,
        headers: &(impl Headers + ?Sized),
        model: &str,
        body_priority: Option<i32>,
        bytes: usize,
    ) -> Ticket {
        let cfg = router.config();
        let by_model = headers
            .header(crate::headers::OBJECTIVE)
            .is_none()
            .then(|| cfg.admission.model_objectives.get(model))
            .flatten()
            .and_then(|o| router.objective_priority(o));
        let priority =
            by_model.unwrap_or_else(|| crate::intake::priority(router, headers, body_priority));
        let flow = cfg
            .flow_control
            .flow_headers
            .iter()
            .find_map(|h| headers.header(h))
            .map(|f| cut(f, MAX_FLOW_ID).to_string())
            .unwrap_or_default();
        let ttl = cfg
            .flow_control
            .deadline_header
            .as_deref()
            .and_then(|h| headers.header(h))
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis);
        Ticket {
            priority,
            flow,
            bytes: bytes as u64,
            ttl,
        }
    }
}

fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Router {
    /// Flow control: returns once the request may be scheduled, with the permission to
    /// drop once it is picked. Sheddable requests are refused while the pool is saturated
    /// and any request past a bound is refused (both 429); the others wait in their band
    /// and flow until the pool has room, or are evicted when their time to live ends (503).
    /// With no ready endpoint a request is held, up to its time to live, and counted in
    /// [`Router::held_requests`].
    pub async fn admit_flow(&self, ticket: &Ticket) -> Result<Admitted, RouteError> {
        let gate = self.inner.flow.clone();
        let now = self.now();
        let view = self.inner.pool_view(now);
        let mut waiting = match gate.arrive(ticket, now, &view) {
            Arrival::Go(a) => return Ok(a),
            Arrival::Refused(r) => {
                if r == crate::scheduling::flow::Refusal::Shed {
                    self.inner.metrics.shed.inc();
                }
                return Err(RouteError::Refused(r));
            }
            Arrival::Wait(w) => w,
        };
        self.inner.metrics.queued.inc();
        loop {
            // Woken by the gate (a scrape, a readiness change, a finished request), or at
            // the deadline to have the gate evict it.
            let left = waiting.deadline().saturating_sub(self.now());
            let tick = tokio::time::sleep(left + Duration::from_millis(1));
            tokio::select! {
                v = waiting.verdict() => {
                    return v.map_err(RouteError::Evicted);
                }
                _ = tick => self.inner.pump_flows(),
            }
        }
    }

    /// Requests held because the pool has no ready endpoint: the activation signal for
    /// scale from zero (also `strata_router_flow_held_requests{pool}`).
    pub fn held_requests(&self) -> usize {
        self.inner.flow.held()
    }

    /// `/debug/flows`: what waits, by band and flow.
    pub fn flows_json(&self) -> serde_json::Value {
        let now = self.now();
        let view = self.inner.pool_view(now);
        let snap = self.inner.flow.snapshot(now);
        serde_json::json!({
            "pool": self.config().flow_control.pool,
            "ready": view.ready,
            "room": view.room,
            "flows": snap,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_flow_ids_are_cut_at_a_character_boundary() {
        assert_eq!(cut("abc", 5), "abc");
        assert_eq!(cut("abcdef", 3), "abc");
        assert_eq!(cut("aé", 2), "a");
    }
}
