//! Cascade routing: a public model whose plan is "the cheapest model first, a larger one
//! when needed". Two pure decisions, no I/O, unit-tested as a scenario table:
//!
//! * [`CascadePolicy::start`], over the request: which model to try first. A prompt
//!   longer than `escalate_prompt_chars`, or a last user message matching one of
//!   `escalate_patterns`, goes straight to the last (largest) model.
//! * [`CascadePolicy::judge`], over an answer of a model that is not the last: accept
//!   it, or escalate to the next model because the answer looks weak: empty output, a
//!   refusal, cut by `max_tokens` (`finish_reason: length`), or a mean token logprob
//!   below `min_mean_logprob` (the gateway then asks the earlier models for logprobs).
//!
//! The proxy ([`crate::proxy`]) runs the tries, charges every one of them and names the
//! model that answered and why in `x-strata-cascade: <model>;<reason>`.

use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `models[].cascade` in `gateway.yaml`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CascadeConfig {
    /// Public model names, cheapest first (at least two; none a cascade itself).
    pub models: Vec<String>,
    /// Prompts longer than this (characters) go straight to the last model.
    #[serde(default)]
    pub escalate_prompt_chars: Option<usize>,
    /// Regexes over the last user message; a match goes straight to the last model.
    #[serde(default)]
    pub escalate_patterns: Vec<String>,
    /// Escalate an answer whose mean token logprob is below this (e.g. -1.0).
    #[serde(default)]
    pub min_mean_logprob: Option<f64>,
    /// Escalate answers that refuse (see `refusal_patterns`).
    #[serde(default = "yes")]
    pub escalate_on_refusal: bool,
    /// Escalate empty answers (no text and no tool call).
    #[serde(default = "yes")]
    pub escalate_on_empty: bool,
    /// Escalate answers cut by `max_tokens`.
    #[serde(default = "yes")]
    pub escalate_on_length: bool,
    /// Regexes that mark a refusal at the start of an answer; empty: a built-in list.
    #[serde(default)]
    pub refusal_patterns: Vec<String>,
}

fn yes() -> bool {
    true
}

/// How refusals usually open (case-insensitive, at the start of the answer).
const DEFAULT_REFUSALS: &[&str] = &[
    r"(?i)^\s*(i'?m sorry|i am sorry|sorry,)",
    r"(?i)^\s*i (can(no|')t|cannot|am unable to|'m unable to|won'?t be able to)",
    r"(?i)^\s*as an ai\b",
];

/// Why a cascade's answer came from the model it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CascadeReason {
    /// The first model answered and its answer passed every check.
    Accepted,
    /// The prompt is longer than `escalate_prompt_chars`.
    PromptLength,
    /// The last user message matched an `escalate_patterns` rule.
    Pattern,
    /// An earlier answer's mean logprob was below `min_mean_logprob`.
    LowLogprob,
    /// An earlier answer refused.
    Refusal,
    /// An earlier answer was empty.
    Empty,
    /// An earlier answer was cut by `max_tokens`.
    Length,
    /// Every try of an earlier model failed.
    Failed,
}

impl CascadeReason {
    /// The label in `x-strata-cascade` and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            CascadeReason::Accepted => "accepted",
            CascadeReason::PromptLength => "prompt_length",
            CascadeReason::Pattern => "pattern",
            CascadeReason::LowLogprob => "low_logprob",
            CascadeReason::Refusal => "refusal",
            CascadeReason::Empty => "empty",
            CascadeReason::Length => "length",
            CascadeReason::Failed => "failed",
        }
    }
}

/// What the request classifier looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    pub prompt_chars: usize,
    pub last_user: &'a str,
}

/// What the answer check looks at.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AnswerFacts {
    pub text: String,
    pub has_tool_calls: bool,
    pub finish_reason: Option<String>,
    /// Mean of the answer's token logprobs, when it carries them.
    pub mean_logprob: Option<f64>,
}

/// The answer check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    Escalate(CascadeReason),
}

/// A [`CascadeConfig`] with its regexes compiled (at load).
#[derive(Debug, Clone)]
pub struct CascadePolicy {
    pub models: Vec<String>,
    prompt_chars: Option<usize>,
    patterns: Vec<Regex>,
    refusals: Vec<Regex>,
    pub min_mean_logprob: Option<f64>,
    on_refusal: bool,
    on_empty: bool,
    on_length: bool,
}

impl CascadePolicy {
    pub fn new(c: &CascadeConfig) -> Result<CascadePolicy, String> {
        if c.models.len() < 2 {
            return Err("a cascade needs at least two models".into());
        }
        let compile = |list: &[String]| -> Result<Vec<Regex>, String> {
            list.iter()
                .map(|p| Regex::new(p).map_err(|e| format!("bad cascade pattern `{p}`: {e}")))
                .collect()
        };
        let refusals = if c.refusal_patterns.is_empty() {
            let defaults: Vec<String> = DEFAULT_REFUSALS.iter().map(|s| s.to_string()).collect();
            compile(&defaults)?
        } else {
            compile(&c.refusal_patterns)?
        };
        if c.min_mean_logprob.is_some_and(|t| !t.is_finite()) {
            return Err("min_mean_logprob must be a finite number".into());
        }
        Ok(CascadePolicy {
            models: c.models.clone(),
            prompt_chars: c.escalate_prompt_chars,
            patterns: compile(&c.escalate_patterns)?,
            refusals,
            min_mean_logprob: c.min_mean_logprob,
            on_refusal: c.escalate_on_refusal,
            on_empty: c.escalate_on_empty,
            on_length: c.escalate_on_length,
        })
    }

    fn last(&self) -> usize {
        self.models.len() - 1
    }

    /// The index of the model to try first, and why.
    pub fn start(&self, req: &RequestFacts<'_>) -> (usize, CascadeReason) {
        if self.prompt_chars.is_some_and(|max| req.prompt_chars > max) {
            return (self.last(), CascadeReason::PromptLength);
        }
        if self.patterns.iter().any(|p| p.is_match(req.last_user)) {
            return (self.last(), CascadeReason::Pattern);
        }
        (0, CascadeReason::Accepted)
    }

    /// Whether the answer of model `stage` stands. The last model's answer always does.
    pub fn judge(&self, stage: usize, answer: &AnswerFacts) -> Verdict {
        if stage >= self.last() {
            return Verdict::Accept;
        }
        let text = answer.text.trim();
        if self.on_empty && text.is_empty() && !answer.has_tool_calls {
            return Verdict::Escalate(CascadeReason::Empty);
        }
        if self.on_refusal && self.refusals.iter().any(|r| r.is_match(text)) {
            return Verdict::Escalate(CascadeReason::Refusal);
        }
        if self.on_length && answer.finish_reason.as_deref() == Some("length") {
            return Verdict::Escalate(CascadeReason::Length);
        }
        if let (Some(min), Some(mean)) = (self.min_mean_logprob, answer.mean_logprob) {
            if mean < min {
                return Verdict::Escalate(CascadeReason::LowLogprob);
            }
        }
        Verdict::Accept
    }
}

/// The facts of an OpenAI chat or text completion (its first choice).
pub fn answer_facts(answer: &Value) -> AnswerFacts {
    let choice = answer.pointer("/choices/0");
    let get = |p: &str| choice.and_then(|c| c.pointer(p));
    let text = get("/message/content")
        .or_else(|| get("/text"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let has_tool_calls = get("/message/tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty());
    let finish_reason = get("/finish_reason")
        .and_then(Value::as_str)
        .map(str::to_string);
    // Chat: logprobs.content[].logprob; completions: logprobs.token_logprobs[].
    let values: Vec<f64> = match get("/logprobs/content").and_then(Value::as_array) {
        Some(items) => items
            .iter()
            .filter_map(|t| t.get("logprob").and_then(Value::as_f64))
            .collect(),
        None => get("/logprobs/token_logprobs")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default(),
    };
    let mean_logprob =
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
    AnswerFacts {
        text,
        has_tool_calls,
        finish_reason,
        mean_logprob,
    }
}

/// The text of the last user message (chat), or the prompt (completions).
pub fn last_user_text(body: &Value) -> String {
    fn text(v: &Value) -> String {
        match v {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(" "),
            _ => String::new(),
        }
    }
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        return msgs
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
            .and_then(|m| m.get("content"))
            .map(text)
            .unwrap_or_default();
    }
    body.get("prompt").map(text).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy() -> CascadePolicy {
        CascadePolicy::new(&CascadeConfig {
            models: vec!["small".into(), "medium".into(), "large".into()],
            escalate_prompt_chars: Some(100),
            escalate_patterns: vec![r"(?i)\bprove\b".into()],
            min_mean_logprob: Some(-1.0),
            escalate_on_refusal: true,
            escalate_on_empty: true,
            escalate_on_length: true,
            refusal_patterns: vec![],
        })
        .unwrap()
    }

    fn answer(text: &str, finish: &str, mean: Option<f64>) -> AnswerFacts {
        AnswerFacts {
            text: text.into(),
            has_tool_calls: false,
            finish_reason: Some(finish.into()),
            mean_logprob: mean,
        }
    }

    #[test]
    fn request_classifier_scenarios() {
        let p = policy();
        let long = "x".repeat(101);
        let cases: &[(usize, &str, (usize, CascadeReason))] = &[
            (10, "what is 2+2?", (0, CascadeReason::Accepted)),
            (100, "at the limit", (0, CascadeReason::Accepted)),
            (101, &long, (2, CascadeReason::PromptLength)),
            (
                20,
                "Prove that primes are infinite",
                (2, CascadeReason::Pattern),
            ),
            (20, "improve my essay", (0, CascadeReason::Accepted)),
        ];
        for (chars, text, want) in cases {
            let got = p.start(&RequestFacts {
                prompt_chars: *chars,
                last_user: text,
            });
            assert_eq!(got, *want, "{text}");
        }
    }

    #[test]
    fn answer_check_scenarios() {
        let p = policy();
        let cases = [
            (0, answer("Paris.", "stop", Some(-0.2)), Verdict::Accept),
            (0, answer("Paris.", "stop", None), Verdict::Accept),
            (
                0,
                answer("  ", "stop", None),
                Verdict::Escalate(CascadeReason::Empty),
            ),
            (
                1,
                answer("I'm sorry, I can't help with that.", "stop", None),
                Verdict::Escalate(CascadeReason::Refusal),
            ),
            (
                0,
                answer("I cannot do that", "stop", None),
                Verdict::Escalate(CascadeReason::Refusal),
            ),
            (
                0,
                answer("The answer is", "length", None),
                Verdict::Escalate(CascadeReason::Length),
            ),
            (
                0,
                answer("Maybe 7?", "stop", Some(-2.5)),
                Verdict::Escalate(CascadeReason::LowLogprob),
            ),
            // A refusal mid-answer is not a refusal.
            (
                0,
                answer("Yes. I can't stress this enough.", "stop", None),
                Verdict::Accept,
            ),
            // The last model's answer always stands.
            (2, answer("", "length", Some(-9.0)), Verdict::Accept),
        ];
        for (stage, a, want) in cases {
            assert_eq!(p.judge(stage, &a), want, "{a:?}");
        }
    }

    #[test]
    fn checks_can_be_turned_off_and_tool_calls_are_not_empty() {
        let p = CascadePolicy::new(&CascadeConfig {
            models: vec!["a".into(), "b".into()],
            escalate_prompt_chars: None,
            escalate_patterns: vec![],
            min_mean_logprob: None,
            escalate_on_refusal: false,
            escalate_on_empty: true,
            escalate_on_length: false,
            refusal_patterns: vec![],
        })
        .unwrap();
        assert_eq!(
            p.judge(0, &answer("I'm sorry", "length", Some(-9.0))),
            Verdict::Accept
        );
        let tool = AnswerFacts {
            has_tool_calls: true,
            ..Default::default()
        };
        assert_eq!(p.judge(0, &tool), Verdict::Accept);
    }

    #[test]
    fn bad_configs_are_refused() {
        let mut c = CascadeConfig {
            models: vec!["only".into()],
            escalate_prompt_chars: None,
            escalate_patterns: vec![],
            min_mean_logprob: None,
            escalate_on_refusal: true,
            escalate_on_empty: true,
            escalate_on_length: true,
            refusal_patterns: vec![],
        };
        assert!(CascadePolicy::new(&c).is_err());
        c.models.push("two".into());
        c.escalate_patterns = vec!["(".into()];
        assert!(CascadePolicy::new(&c).is_err());
    }

    #[test]
    fn facts_are_read_from_chat_and_completion_answers() {
        let chat = json!({"choices": [{"message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop",
            "logprobs": {"content": [{"token": "hi", "logprob": -1.0}, {"token": "!", "logprob": -3.0}]}}]});
        let f = answer_facts(&chat);
        assert_eq!(f.text, "hi");
        assert_eq!(f.finish_reason.as_deref(), Some("stop"));
        assert_eq!(f.mean_logprob, Some(-2.0));
        let text = json!({"choices": [{"text": "x", "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.5, -1.5]}}]});
        assert_eq!(answer_facts(&text).mean_logprob, Some(-1.0));
        let tools =
            json!({"choices": [{"message": {"content": null, "tool_calls": [{"id": "1"}]}}]});
        assert!(answer_facts(&tools).has_tool_calls);
        assert_eq!(answer_facts(&json!({})), AnswerFacts::default());
        let body = json!({"messages": [{"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "second"}]}]});
        assert_eq!(last_user_text(&body), "second");
        assert_eq!(last_user_text(&json!({"prompt": "p"})), "p");
    }
}
