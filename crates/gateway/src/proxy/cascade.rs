//! Stages 3 and 4 for a cascade model ([`crate::cascade`]): the policy picks the first
//! model from the request, each model's own plan is tried, and a whole answer of any
//! model but the last is judged; an answer that escalates is charged (its own ledger
//! row) and the same request goes to the next model. A model whose every try failed
//! escalates too. Streamed requests are judged on the request only (an answer already
//! streaming cannot be taken back). The answer sent names its model and the reason in
//! `x-strata-cascade`.

use std::time::Instant;

use axum::body::Bytes;
use serde_json::Value;

use super::account::Settle;
use super::attempt::try_plan;
use super::headers::{hv, CASCADE_HEADER};
use super::refusal::Refusal;
use super::shape::usage_from_json;
use super::values::{Admitted, Tried};
use crate::cascade::{
    answer_facts, last_user_text, CascadePolicy, CascadeReason, RequestFacts, Verdict,
};
use crate::routing;
use crate::state::Gateway;

/// Runs the cascade for `req` until `deadline`.
pub(crate) async fn try_cascade(
    gw: &Gateway,
    req: &mut Admitted,
    policy: &CascadePolicy,
    settle: &mut Settle,
    started: Instant,
    deadline: Instant,
) -> Result<Tried, Refusal> {
    let last_user = last_user_text(&req.body);
    let (mut stage, mut reason) = policy.start(&RequestFacts {
        prompt_chars: req.prompt_chars,
        last_user: &last_user,
    });
    let add_logprobs = adds_logprobs(req, policy);
    let resolved = req.resolved.clone();
    let last = policy.models.len() - 1;
    loop {
        let is_last = stage == last;
        let Some(model) = resolved.model(&policy.models[stage]) else {
            return Err(Refusal::UnknownModel(policy.models[stage].clone()));
        };
        if add_logprobs {
            ask_logprobs(req, !is_last);
        }
        let tries = {
            let mut rng = gw.rng.lock();
            routing::plan(&resolved, model, req.estimate, &mut *rng)
        };
        if tries.is_empty() {
            if is_last {
                return Err(Refusal::ContextTooLong {
                    max: model.context_length.unwrap_or(0),
                    needed: req.estimate,
                });
            }
            (stage, reason) = escalate(gw, policy, stage, CascadeReason::Failed);
            continue;
        }
        let tried = try_plan(gw, req, &tries, started, deadline).await;
        let tried = match tried {
            Tried::Failed(_) if !is_last && Instant::now() < deadline => {
                (stage, reason) = escalate(gw, policy, stage, CascadeReason::Failed);
                continue;
            }
            Tried::Whole {
                status,
                content_type,
                bytes,
                served,
            } if !is_last => {
                let answer = serde_json::from_slice::<Value>(&bytes).unwrap_or(Value::Null);
                if let Verdict::Escalate(why) = policy.judge(stage, &answer_facts(&answer)) {
                    let att = &served.attempt;
                    let usage = usage_from_json(&bytes);
                    settle
                        .charge_extra_try(usage, &att.upstream, &att.model, att.price)
                        .await;
                    (stage, reason) = escalate(gw, policy, stage, why);
                    continue;
                }
                let bytes = if add_logprobs {
                    without_logprobs(answer).unwrap_or(bytes)
                } else {
                    bytes
                };
                Tried::Whole {
                    status,
                    content_type,
                    bytes,
                    served,
                }
            }
            other => other,
        };
        if !matches!(tried, Tried::Failed(_)) {
            mark_answered(gw, req, &policy.models[stage], reason);
        }
        return Ok(tried);
    }
}

/// Whether the gateway asks the earlier models for logprobs on the client's behalf: the
/// logprob check needs them, and the client did not necessarily ask for them (they are
/// removed again from the answer sent).
fn adds_logprobs(req: &Admitted, policy: &CascadePolicy) -> bool {
    let client_logprobs = req
        .body
        .get("logprobs")
        .is_some_and(|v| v != &Value::Bool(false));
    policy.min_mean_logprob.is_some() && !req.stream && !client_logprobs
}

/// Asks the model for logprobs (`on`), or not (the last model, whose answer is not
/// judged).
fn ask_logprobs(req: &mut Admitted, on: bool) {
    if let Some(obj) = req.body.as_object_mut() {
        if on {
            obj.insert("logprobs".into(), Value::Bool(true));
        } else {
            obj.remove("logprobs");
        }
        req.rewritten = true;
    }
}

/// Counts an escalation away from model `stage` and returns the next stage with its
/// reason.
fn escalate(
    gw: &Gateway,
    policy: &CascadePolicy,
    stage: usize,
    why: CascadeReason,
) -> (usize, CascadeReason) {
    gw.metrics
        .cascade_escalations
        .get_or_create(&vec![
            ("from", policy.models[stage].clone()),
            ("reason", why.as_str().to_string()),
        ])
        .inc();
    (stage + 1, why)
}

/// Names the model that answered and why it was asked in `x-strata-cascade`, and counts
/// the answer.
fn mark_answered(gw: &Gateway, req: &mut Admitted, answered: &str, reason: CascadeReason) {
    req.extra.insert(
        CASCADE_HEADER,
        hv(format!("{answered};{}", reason.as_str())),
    );
    gw.metrics
        .cascade
        .get_or_create(&vec![
            ("model", answered.to_string()),
            ("reason", reason.as_str().to_string()),
        ])
        .inc();
}

/// The answer without the logprobs the gateway asked for on the client's behalf.
fn without_logprobs(mut answer: Value) -> Option<Bytes> {
    for choice in answer.get_mut("choices")?.as_array_mut()? {
        if let Some(c) = choice.as_object_mut() {
            c.insert("logprobs".into(), Value::Null);
        }
    }
    serde_json::to_vec(&answer).ok().map(Bytes::from)
}
