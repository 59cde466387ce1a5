//! The router's flow control in the simulation: the same pure layer the live router runs
//! (`strata_router::scheduling::flow`), fed the same room (the saturation thresholds over
//! the scraped metrics and what was sent and finished since) and run at the same moments:
//! on arrival, on every scrape, finished request and ready replica, and at deadlines.

use strata_bench::record::FailureKind;
use strata_router::scheduling::flow::{Admit, FlowController, FlowRequest};
use strata_router::scheduling::SchedRequest;

use super::{Ev, Held, Sim};

impl Sim<'_> {
    /// The router's flow control, when on: the request is sent, queued in its tenant's
    /// flow, or refused (429); without it, it goes straight to the pick.
    pub(super) fn admit(
        &mut self,
        id: u32,
        req: SchedRequest,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) {
        let Some(flow) = self.flow.as_mut() else {
            return self.pending_submit(id, req, prompt, max_tokens);
        };
        // The room is a pass over every endpoint: measured only when flow control asks.
        let view = self.router.pool_view(self.now);
        let tenant = self.reqs[id as usize].tenant;
        let ticket = FlowRequest {
            id: u64::from(id),
            flow: self.tenants.name(tenant).to_string(),
            priority: req.priority,
            // The body's size: about 4 bytes of text a token.
            bytes: prompt.len() as u64 * 4,
            arrived: self.now,
            ttl: None,
        };
        match flow.enqueue(ticket, &view) {
            Admit::Dispatch => {
                self.pending_submit(id, req, prompt, max_tokens);
                self.placed();
            }
            Admit::Queued => {
                self.flow_waiting.insert(
                    id,
                    Held {
                        id,
                        req,
                        prompt,
                        max_tokens,
                    },
                );
                self.arm_flow_deadline();
            }
            Admit::Refused(r) => self.fail(
                id,
                FailureKind::HttpStatus(429),
                format!("flow control refused the request: {}", r.as_str()),
            ),
        }
    }

    /// A dispatched request was picked: the pool's room counts it now.
    fn placed(&mut self) {
        if let Some(f) = self.flow.as_mut() {
            f.placed();
        }
    }

    /// Flow control's round (a scrape, a finished request, a ready replica, a deadline):
    /// evictions answered 503, dispatches picked in order.
    pub(super) fn pump_flow(&mut self) {
        if self.flow.as_ref().is_none_or(|f| f.queued() == 0) {
            return;
        }
        // Measured only with requests waiting: it is a pass over every endpoint, and this
        // runs after every step of every replica.
        let view = self.router.pool_view(self.now);
        let Some(flow) = self.flow.as_mut() else {
            return;
        };
        let step = flow.dispatch(self.now, &view);
        for (id, reason) in step.evicted {
            let id = id as u32;
            self.flow_waiting.remove(&id);
            self.fail(
                id,
                FailureKind::HttpStatus(503),
                format!("waited past its time to live ({})", reason.as_str()),
            );
        }
        for (id, _) in step.dispatched {
            if let Some(h) = self.flow_waiting.remove(&(id as u32)) {
                self.pending_submit(h.id, h.req, h.prompt, h.max_tokens);
            }
            self.placed();
        }
        self.arm_flow_deadline();
    }

    fn arm_flow_deadline(&mut self) {
        let Some(d) = self.flow.as_ref().and_then(FlowController::next_deadline) else {
            return;
        };
        if self.flow_armed.is_none_or(|a| d < a) {
            self.flow_armed = Some(d);
            self.push(d.max(self.now), Ev::FlowDeadline);
        }
    }
}
