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
    // The logprob check needs logprobs from the earlier models; the client did not
    // necessarily ask for them, so they are asked for here and removed again.
    let client_logprobs = req
        .body
        .get("logprobs")
        .is_some_and(|v| v != &Value::Bool(false));
    let add_logprobs = policy.min_mean_logprob.is_some() && !req.stream && !client_logprobs;
    let resolved = req.resolved.clone();
    let last = policy.models.len() - 1;
    loop {
        let is_last = stage == last;
        let Some(model) = resolved.model(&policy.models[stage]) else {
            return Err(Refusal::UnknownModel(policy.models[stage].clone()));
        };
        if add_logprobs {
            if let Some(obj) = req.body.as_object_mut() {
                if is_last {
                    obj.remove("logprobs");
                } else {
                    obj.insert("logprobs".into(), Value::Bool(true));
                }
                req.rewritten = true;
            }
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
            escalate(gw, &policy.models[stage], CascadeReason::Failed);
            (stage, reason) = (stage + 1, CascadeReason::Failed);
            continue;
        }
        let tried = try_plan(gw, req, &tries, started, deadline).await;
        let tried = match tried {
            Tried::Failed(_) if !is_last && Instant::now() < deadline => {
                escalate(gw, &policy.models[stage], CascadeReason::Failed);
                (stage, reason) = (stage + 1, CascadeReason::Failed);
                continue;
            }
            Tried::Whole {
                status,
                content_type,
                bytes,
                served,
            } if !is_last => {
                let answer = serde_json::from_slice::<Value>(&bytes).unwrap_or(Value::Null);
                match policy.judge(stage, &answer_facts(&answer)) {
                    Verdict::Escalate(why) => {
                        let att = &served.attempt;
                        settle
                            .charge_extra_try(
                                usage_from_json(&bytes),
                                &att.upstream,
                                &att.model,
                                att.price,
                            )
                            .await;
                        escalate(gw, &policy.models[stage], why);
                        (stage, reason) = (stage + 1, why);
                        continue;
                    }
                    Verdict::Accept => {
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
                }
            }
            other => other,
        };
        if !matches!(tried, Tried::Failed(_)) {
            let answered = &policy.models[stage];
            req.extra.insert(
                CASCADE_HEADER,
                hv(format!("{answered};{}", reason.as_str())),
            );
            gw.metrics
                .cascade
                .get_or_create(&vec![
                    ("model", answered.clone()),
                    ("reason", reason.as_str().to_string()),
                ])
                .inc();
        }
        return Ok(tried);
    }
}

fn escalate(gw: &Gateway, from: &str, why: CascadeReason) {
    gw.metrics
        .cascade_escalations
        .get_or_create(&vec![
            ("from", from.to_string()),
            ("reason", why.as_str().to_string()),
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
