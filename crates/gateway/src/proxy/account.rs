//! A request's accounting, exactly once per admitted request.
//!
//! [`Settle`] travels from stage to stage beside the values of [`super::values`]: it is
//! created when a request passes admission (its token-limit charge is an estimate from
//! then on) and is consumed by [`Settle::finish`]: the token limits are reconciled with
//! the real usage, cost is priced, metrics counted and one ledger row queued. Every way
//! out of the request path finishes it once:
//! * a whole answer, a cache hit, a refusal after admission and a failed plan finish it
//!   before the response is returned;
//! * a streamed answer hands it to the stream watcher, which finishes it when the stream
//!   ends or the client goes away;
//! * a client that goes away *before* the answer (the request future is dropped mid-try)
//!   drops it unfinished: the drop queues the finish with status
//!   [`CLIENT_CLOSED`], so the ledger keeps the row and the estimate is refunded.

use std::sync::Arc;

use crate::config::Price;
use crate::ratelimit::LimitCheck;
use crate::state::Gateway;
use crate::store::UsageEvent;

/// Ledger status of a request whose client went away before the answer (nginx's 499).
pub const CLIENT_CLOSED: u16 = 499;

/// What the accounting of one request needs (see the module doc).
pub(crate) struct Settle {
    account: Option<Account>,
}

struct Account {
    gw: Arc<Gateway>,
    /// The ledger row's id (also the id of the request's budget hold, if any).
    id: String,
    token_checks: Vec<LimitCheck>,
    estimate: u64,
    prompt_estimate: u64,
    key_id: String,
    tenant: String,
    /// The user charged besides key and tenant (empty: none).
    user: String,
    model: String,
    upstream: String,
    price: Price,
    /// Tries charged besides the answer sent (cascade escalations).
    extra_tries: u32,
}

impl Settle {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        gw: Arc<Gateway>,
        id: String,
        token_checks: Vec<LimitCheck>,
        estimate: u64,
        prompt_estimate: u64,
        key_id: String,
        tenant: String,
        user: String,
        model: String,
        price: Price,
    ) -> Settle {
        Settle {
            account: Some(Account {
                gw,
                id,
                token_checks,
                estimate,
                prompt_estimate,
                key_id,
                tenant,
                user,
                model,
                upstream: String::new(),
                price,
                extra_tries: 0,
            }),
        }
    }

    /// Charges what answered: the upstream, the model group and its price.
    pub(crate) fn served_by(&mut self, upstream: &str, model: &str, price: Price) {
        if let Some(a) = &mut self.account {
            a.upstream = upstream.to_string();
            a.model = model.to_string();
            a.price = price;
        }
    }

    /// Marks the answer as coming from a cache (no model work, no cost).
    pub(crate) fn answered_by_cache(&mut self) {
        if let Some(a) = &mut self.account {
            a.upstream = "cache".into();
        }
    }

    /// Charges a try whose answer was not the one sent (a cascade escalated past it): its
    /// own ledger row (`<id>-<n>`) at its model's price, and its tokens on the token
    /// limits (the admission estimate covers only the answer that is sent).
    pub(crate) async fn charge_extra_try(
        &mut self,
        usage: Option<(u64, u64)>,
        upstream: &str,
        model: &str,
        price: Price,
    ) {
        let Some(a) = &mut self.account else { return };
        a.extra_tries += 1;
        let (input, output) = usage.unwrap_or((a.prompt_estimate, a.estimate - a.prompt_estimate));
        let tokens = (input + output) as i64;
        a.gw.limiter.adjust(&a.token_checks, tokens).await;
        let cost = price.cost_micros(input, output);
        count_tokens_and_cost(&a.gw, &a.tenant, model, input, output, cost);
        a.gw.record_usage(UsageEvent {
            id: format!("{}-{}", a.id, a.extra_tries),
            ts: a.gw.now(),
            key_id: a.key_id.clone(),
            tenant: a.tenant.clone(),
            user: a.user.clone(),
            model: model.to_string(),
            upstream: upstream.to_string(),
            input_tokens: input,
            output_tokens: output,
            cost_micros: cost,
            cached: false,
            status: 200,
        });
    }

    /// Reconciles the token limits with real usage, records cost and the ledger row.
    pub(crate) async fn finish(mut self, usage: Option<(u64, u64)>, status: u16, cached: bool) {
        if let Some(a) = self.account.take() {
            a.finish(usage, status, cached).await;
        }
    }
}

impl Drop for Settle {
    fn drop(&mut self) {
        if let Some(a) = self.account.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(a.finish(None, CLIENT_CLOSED, false));
            }
        }
    }
}

impl Account {
    async fn finish(self, usage: Option<(u64, u64)>, status: u16, cached: bool) {
        let (input, output) = match (usage, cached) {
            (_, true) => (0, 0),
            (Some(u), false) => u,
            // No usage reported: charge the estimate rather than nothing.
            (None, false) if status < 300 => {
                (self.prompt_estimate, self.estimate - self.prompt_estimate)
            }
            (None, false) => (0, 0),
        };
        let delta = (input + output) as i64 - self.estimate as i64;
        self.gw.limiter.adjust(&self.token_checks, delta).await;
        let cost = if cached {
            0
        } else {
            self.price.cost_micros(input, output)
        };
        count_tokens_and_cost(&self.gw, &self.tenant, &self.model, input, output, cost);
        self.gw.record_usage(UsageEvent {
            id: self.id,
            ts: self.gw.now(),
            key_id: self.key_id,
            tenant: self.tenant,
            user: self.user,
            model: self.model,
            upstream: self.upstream,
            input_tokens: input,
            output_tokens: output,
            cost_micros: cost,
            cached,
            status,
        });
    }
}

fn count_tokens_and_cost(
    gw: &Gateway,
    tenant: &str,
    model: &str,
    input: u64,
    output: u64,
    cost: i64,
) {
    let m = &gw.metrics;
    if input + output > 0 {
        for (kind, n) in [("input", input), ("output", output)] {
            m.tokens
                .get_or_create(&vec![
                    ("tenant", tenant.to_string()),
                    ("model", model.to_string()),
                    ("kind", kind.to_string()),
                ])
                .inc_by(n);
        }
    }
    if cost > 0 {
        m.cost
            .get_or_create(&vec![
                ("tenant", tenant.to_string()),
                ("model", model.to_string()),
            ])
            .inc_by(cost as f64 / 1e6);
    }
}
