//! The classifier guardrails on the request path ([`crate::guardrails::classifier`]): the
//! texts of a generating request (its prompt, after the pattern guardrails) are sent to
//! each input rule's model as one `/classify` call, and so are the texts of an answer for
//! each output rule, before the answer is returned: a whole answer here, a streamed one
//! held until it ends ([`super::classify_stream`]).
//!
//! The call goes where the rule's model is served, as the semantic cache's embedding call
//! does: the model's plan of targets in order, one try each, directly or through an
//! embedded router. Texts longer than the classifier's limit are cut to it
//! (`truncate_prompt_tokens: -1`); the latest [`MAX_TEXTS`] texts are classified.

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use serde_json::{json, Value};
use strata_api::ApiError;

use super::headers::hv;
use super::refusal::Refusal;
use super::route::Route;
use super::side_call::{self, SideCall};
use super::values::Admitted;
use crate::config::Resolved;
use crate::guardrails::classifier::{ClassifierRule, OnError};
use crate::state::Gateway;

/// Most texts one check classifies (the latest of a long conversation).
pub const MAX_TEXTS: usize = 256;
/// Largest `/classify` answer read.
const ANSWER_LIMIT: usize = 1 << 20;

/// Which side of the model a check reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Input,
    Output,
}

/// Who is asking, for the classifier's own call (its router placement and logs).
struct Caller<'a> {
    headers: &'a HeaderMap,
    tenant: &'a str,
    request_id: HeaderValue,
}

/// The input rules over a generating request's texts: `Err` when one blocks it, or when
/// its classifier cannot answer and its `on_error` is `closed`.
pub(crate) async fn check_input(
    gw: &Gateway,
    resolved: &Resolved,
    route: Route,
    body: &Value,
    headers: &HeaderMap,
    tenant: &str,
) -> Result<(), Refusal> {
    let rules = &resolved.config.guardrails.classifiers;
    if !route.generates() || !rules.iter().any(|r| r.input) {
        return Ok(());
    }
    let texts = request_texts(body);
    let caller = Caller {
        headers,
        tenant,
        request_id: hv(gw.next_request_id()),
    };
    for rule in rules.iter().filter(|r| r.input) {
        match run_rule(gw, resolved, rule, &texts, &caller, Side::Input).await {
            Ok(None) => {}
            Ok(Some(reason)) => return Err(Refusal::GuardrailBlocked(reason)),
            Err(error) => {
                return Err(Refusal::BackendUnavailable {
                    what: "The guardrail classifier",
                    error,
                })
            }
        }
    }
    Ok(())
}

/// Whether an output rule reads this request's answer (a generating route, and a rule
/// with `output: true`).
pub(crate) fn classifies_output(req: &Admitted) -> bool {
    req.route.generates()
        && req
            .resolved
            .config
            .guardrails
            .classifiers
            .iter()
            .any(|r| r.output)
}

/// The output rules over a whole answer's texts: `Err` is the error to send instead (a
/// 400 naming the label, or a 503 when a `closed` rule's classifier cannot answer).
pub(crate) async fn check_output(
    gw: &Gateway,
    req: &Admitted,
    answer: &[u8],
) -> Result<(), ApiError> {
    if !classifies_output(req) {
        return Ok(());
    }
    let Ok(body) = serde_json::from_slice::<Value>(answer) else {
        return Ok(());
    };
    check_output_texts(gw, req, &answer_texts(&body)).await
}

/// The output rules over an answer's `texts` (a whole answer's, or a held stream's).
pub(crate) async fn check_output_texts(
    gw: &Gateway,
    req: &Admitted,
    texts: &[String],
) -> Result<(), ApiError> {
    let rules = &req.resolved.config.guardrails.classifiers;
    let caller = Caller {
        headers: &req.headers,
        tenant: &req.key.record.tenant,
        request_id: req.request_id.clone(),
    };
    for rule in rules.iter().filter(|r| r.output) {
        match run_rule(gw, &req.resolved, rule, texts, &caller, Side::Output).await {
            Ok(None) => {}
            Ok(Some(reason)) => {
                return Err(ApiError::invalid_no_param(format!(
                    "The response was withheld: {reason}"
                ))
                .with_code("guardrail_blocked"))
            }
            Err(error) => {
                return Err(ApiError::unavailable(format!(
                    "The guardrail classifier is unavailable: {error}."
                )))
            }
        }
    }
    Ok(())
}

/// One rule over `texts`: the reason to block, if any; `Err` when its classifier failed
/// and the rule fails closed (an open rule's failure passes, counted and logged).
async fn run_rule(
    gw: &Gateway,
    resolved: &Resolved,
    rule: &ClassifierRule,
    texts: &[String],
    caller: &Caller<'_>,
    side: Side,
) -> Result<Option<String>, String> {
    if texts.is_empty() {
        return Ok(None);
    }
    let verdict = match classify(gw, resolved, &rule.model, texts, caller).await {
        Ok(answer) => rule.verdict(&answer, texts.len()),
        Err(e) => Err(e),
    };
    match verdict {
        Ok(v) => Ok(v),
        Err(error) => {
            gw.metrics.backend_error("guardrail_classifier");
            tracing::warn!(model = %rule.model, ?side, %error, "guardrail classifier failed");
            match rule.on_error {
                OnError::Open => Ok(None),
                OnError::Closed => Err(format!("model `{}`: {error}", rule.model)),
            }
        }
    }
}

/// `/classify` of `texts` by `model` ([`side_call::call_model`]): the first successful
/// answer, or the last failure.
async fn classify(
    gw: &Gateway,
    resolved: &Resolved,
    model: &str,
    texts: &[String],
    caller: &Caller<'_>,
) -> Result<Bytes, String> {
    let call = SideCall {
        route: Route::Classify,
        headers: caller.headers,
        tenant: caller.tenant,
        request_id: &caller.request_id,
        answer_limit: ANSWER_LIMIT,
    };
    let body = |upstream_model: &str| {
        let payload =
            json!({"model": upstream_model, "input": texts, "truncate_prompt_tokens": -1});
        Bytes::from(payload.to_string())
    };
    side_call::call_model(gw, resolved, model, &call, body, |answer| {
        Some(answer.clone())
    })
    .await
}

/// A request's texts: `system`, `instructions`, `prompt`, `input` and `messages`, each a
/// string, a list, or objects with `text` or `content` (chat, Messages and Responses
/// shapes alike).
fn request_texts(body: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for field in ["system", "instructions", "prompt", "input", "messages"] {
        collect_texts(body.get(field), &mut out);
    }
    latest(out)
}

/// A whole answer's texts: chat's and completions' `choices`, the Messages API's
/// `content`, the Responses API's `output`.
fn answer_texts(body: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(choices) = body.get("choices").and_then(Value::as_array) {
        for c in choices {
            collect_texts(c.get("message"), &mut out);
            collect_texts(c.get("text"), &mut out);
        }
    }
    collect_texts(body.get("content"), &mut out);
    collect_texts(body.get("output"), &mut out);
    latest(out)
}

fn collect_texts(v: Option<&Value>, out: &mut Vec<String>) {
    match v {
        Some(Value::String(s)) if !s.trim().is_empty() => out.push(s.clone()),
        Some(Value::Array(items)) => items.iter().for_each(|it| collect_texts(Some(it), out)),
        Some(Value::Object(o)) => {
            collect_texts(o.get("text"), out);
            collect_texts(o.get("content"), out);
        }
        _ => {}
    }
}

/// The last [`MAX_TEXTS`] texts.
pub(super) fn latest(mut texts: Vec<String>) -> Vec<String> {
    if texts.len() > MAX_TEXTS {
        texts.drain(..texts.len() - MAX_TEXTS);
    }
    texts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_of_every_api_shape() {
        let chat = json!({"model": "m", "messages": [
            {"role": "system", "content": "be kind"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": "   "}
        ]});
        assert_eq!(request_texts(&chat), ["be kind", "hello"]);
        let messages = json!({"system": [{"type": "text", "text": "sys"}], "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(request_texts(&messages), ["sys", "hi"]);
        let responses = json!({"instructions": "ins", "input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}]});
        assert_eq!(request_texts(&responses), ["ins", "q"]);
        assert_eq!(request_texts(&json!({"prompt": ["a", "b"]})), ["a", "b"]);
        let answer = json!({"choices": [{"message": {"role": "assistant", "content": "out"}}, {"text": "done"}]});
        assert_eq!(answer_texts(&answer), ["out", "done"]);
        let anthropic = json!({"content": [{"type": "text", "text": "claude"}]});
        assert_eq!(answer_texts(&anthropic), ["claude"]);
        let many: Vec<Value> = (0..300)
            .map(|i| json!({"role": "user", "content": format!("m{i}")}))
            .collect();
        let texts = request_texts(&json!({"messages": many}));
        assert_eq!(texts.len(), MAX_TEXTS);
        assert_eq!(texts.last().map(String::as_str), Some("m299"));
    }
}
