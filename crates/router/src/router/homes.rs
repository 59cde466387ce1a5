//! Stored responses' homes: the router remembers which endpoint made each Responses API
//! answer it relayed, and a request that needs one is picked there, alone
//! ([`Router::pick_home`]), since only that replica holds it.

use std::sync::Arc;

use super::pool::refresh_ready;
use super::{Picked, Router};
use crate::scheduling::{PdChoice, PickDecision};
use crate::telemetry::RouterMetrics;

impl Router {
    /// Remembers that the endpoint at `url` holds the stored response `id`.
    pub fn remember_response(&self, id: &str, url: &str) {
        self.inner
            .homes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), Arc::from(url));
    }

    /// The pick for a request that needs the stored response `id`: the endpoint that
    /// made it, alone, when it is still registered and ready (draining or not: only it
    /// can answer). `None` when the router does not know the response or its endpoint is
    /// gone: the request is then scheduled as any other (and that replica answers).
    pub fn pick_home(&self, id: &str) -> Option<Picked> {
        let url = self
            .inner
            .homes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()?;
        let now = self.now();
        let mut pool = self.inner.lock_pool();
        refresh_ready(&mut pool, now);
        let c = pool
            .cands
            .iter_mut()
            .find(|c| *c.spec.url == *url && c.ready)?;
        c.sent_since_scrape = c.sent_since_scrape.saturating_add(1);
        let id = c.id;
        drop(pool);
        self.inner
            .metrics
            .picks
            .get_or_create(&RouterMetrics::endpoint(&url))
            .inc();
        Some(Picked {
            decision: PickDecision {
                profile: "response-home".into(),
                ranked: vec![crate::scheduling::Scored { id, score: 1.0 }],
            },
            ranked: vec![(id, url)],
            prefill: None,
            pd: PdChoice::Single,
        })
    }
}
