//! Guardrails run before the model (on prompt text) and after it (on non-streamed answers).
//!
//! Each guardrail is a [`Guardrail`]: it sees one piece of text and either passes it,
//! rewrites it (redaction) or blocks the request. Built-ins are the maximum prompt size and
//! pattern detectors for secrets and personal data (API keys, private keys, card numbers
//! checked with Luhn, email addresses, or a custom regex). Adding one means a new type
//! implementing the trait and a line in [`Guardrails::new`].
//!
//! Guardrails that call a model (`classifiers`: a classifier served on the platform, the
//! labels that block) are async and run on the request path; their rule is in
//! [`classifier`].

pub mod classifier;

use std::borrow::Cow;

use regex::Regex;
use serde::{Deserialize, Serialize};

/// What a pattern guardrail does to a match: rewrite it, or refuse the request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardAction {
    #[default]
    Redact,
    Block,
}

/// One built-in detector and what to do when it fires.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatternRule {
    /// `api_key`, `private_key`, `card_number`, `email`, or `custom` with `regex`.
    pub kind: String,
    #[serde(default)]
    pub action: GuardAction,
    /// Required for `custom`.
    #[serde(default)]
    pub regex: Option<String>,
    /// Apply to prompts (default true).
    #[serde(default = "yes")]
    pub input: bool,
    /// Apply to responses, streamed or not (default true).
    #[serde(default = "yes")]
    pub output: bool,
}

fn yes() -> bool {
    true
}

/// `gateway.yaml`'s `guardrails` section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardrailsConfig {
    /// Largest prompt accepted, in characters (all message contents together).
    #[serde(default)]
    pub max_prompt_chars: Option<usize>,
    #[serde(default)]
    pub patterns: Vec<PatternRule>,
    /// Rules that classify texts with a model ([`classifier::ClassifierRule`]).
    #[serde(default)]
    pub classifiers: Vec<classifier::ClassifierRule>,
}

/// Where in the request's life a text is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Input,
    Output,
}

/// What a guardrail decided about one text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<'a> {
    Pass,
    /// Replace the text with this one.
    Rewrite(Cow<'a, str>),
    /// Refuse the request; the reason is shown to the client.
    Block(String),
}

/// One pluggable check.
pub trait Guardrail: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &str;
    fn check<'a>(&self, stage: Stage, text: &'a str) -> Verdict<'a>;
}

/// A detector built from a regex, with an optional extra validation of each match.
#[derive(Debug)]
pub struct PatternGuard {
    kind: String,
    regex: Regex,
    action: GuardAction,
    input: bool,
    output: bool,
    luhn: bool,
}

const API_KEY: &str = r"\b(?:sk-[A-Za-z0-9_\-]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,}|xox[abprs]-[A-Za-z0-9\-]{10,}|AIza[0-9A-Za-z_\-]{35})";
const PRIVATE_KEY: &str =
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)";
const CARD: &str = r"\b(?:\d[ \-]?){12,18}\d\b";
const EMAIL: &str = r"\b[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}\b";

fn builtin(kind: &str) -> Option<&'static str> {
    Some(match kind {
        "api_key" => API_KEY,
        "private_key" => PRIVATE_KEY,
        "card_number" => CARD,
        "email" => EMAIL,
        _ => return None,
    })
}

/// Checks one rule without building it (config validation).
pub fn validate_rule(rule: &PatternRule) -> Result<(), String> {
    PatternGuard::new(rule).map(|_| ())
}

impl PatternGuard {
    pub fn new(rule: &PatternRule) -> Result<PatternGuard, String> {
        let source = match (rule.kind.as_str(), &rule.regex) {
            ("custom", Some(re)) => re.clone(),
            ("custom", None) => return Err("guardrail `custom` needs `regex`".into()),
            (kind, None) => builtin(kind)
                .ok_or_else(|| format!("unknown guardrail kind `{kind}`"))?
                .to_string(),
            (kind, Some(_)) => return Err(format!("guardrail `{kind}` takes no `regex`")),
        };
        let regex = regex::RegexBuilder::new(&source)
            .size_limit(1 << 20)
            .build()
            .map_err(|e| format!("guardrail `{}`: {e}", rule.kind))?;
        Ok(PatternGuard {
            kind: rule.kind.clone(),
            regex,
            action: rule.action,
            input: rule.input,
            output: rule.output,
            luhn: rule.kind == "card_number",
        })
    }

    fn accepts(&self, matched: &str) -> bool {
        !self.luhn || luhn_valid(matched)
    }
}

impl Guardrail for PatternGuard {
    fn name(&self) -> &str {
        &self.kind
    }

    fn check<'a>(&self, stage: Stage, text: &'a str) -> Verdict<'a> {
        let applies = match stage {
            Stage::Input => self.input,
            Stage::Output => self.output,
        };
        if !applies {
            return Verdict::Pass;
        }
        let found = self.regex.find_iter(text).any(|m| self.accepts(m.as_str()));
        if !found {
            return Verdict::Pass;
        }
        match self.action {
            GuardAction::Block => Verdict::Block(format!(
                "request blocked by guardrail `{}`: the text contains a {}",
                self.kind,
                self.kind.replace('_', " ")
            )),
            GuardAction::Redact => {
                let label = format!("[REDACTED:{}]", self.kind);
                let out = self.regex.replace_all(text, |caps: &regex::Captures<'_>| {
                    let m = caps.get(0).map(|m| m.as_str()).unwrap_or("");
                    if self.accepts(m) {
                        label.clone()
                    } else {
                        m.to_string()
                    }
                });
                Verdict::Rewrite(Cow::Owned(out.into_owned()))
            }
        }
    }
}

/// Luhn checksum over the digits of `s` (separators ignored).
pub fn luhn_valid(s: &str) -> bool {
    let digits: Vec<u32> = s.chars().filter_map(|c| c.to_digit(10)).collect();
    if !(13..=19).contains(&digits.len()) {
        return false;
    }
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &d)| {
            if i % 2 == 1 {
                let x = d * 2;
                if x > 9 {
                    x - 9
                } else {
                    x
                }
            } else {
                d
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

/// The configured set, applied in order.
#[derive(Debug, Default)]
pub struct Guardrails {
    pub max_prompt_chars: Option<usize>,
    guards: Vec<Box<dyn Guardrail>>,
}

/// Outcome of running every guardrail over a text.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Unchanged,
    Rewritten(String),
    Blocked(String),
}

impl Guardrails {
    pub fn new(config: &GuardrailsConfig) -> Result<Guardrails, String> {
        let mut guards: Vec<Box<dyn Guardrail>> = Vec::new();
        for rule in &config.patterns {
            guards.push(Box::new(PatternGuard::new(rule)?));
        }
        Ok(Guardrails {
            max_prompt_chars: config.max_prompt_chars,
            guards,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.guards.is_empty()
    }

    /// Runs every guardrail over `text`, feeding each the previous one's rewrite.
    pub fn apply(&self, stage: Stage, text: &str) -> Outcome {
        let mut current: Option<String> = None;
        for g in &self.guards {
            let input = current.as_deref().unwrap_or(text);
            match g.check(stage, input) {
                Verdict::Pass => {}
                Verdict::Rewrite(new) => current = Some(new.into_owned()),
                Verdict::Block(reason) => return Outcome::Blocked(reason),
            }
        }
        match current {
            Some(s) if s != text => Outcome::Rewritten(s),
            _ => Outcome::Unchanged,
        }
    }

    /// Applies the guardrails to every string leaf of a request's text fields
    /// (`messages[].content` as string or text parts, the arguments of earlier turns'
    /// `tool_calls`, `prompt`, `input`) in place. Returns `Err(reason)` when blocked.
    pub fn apply_request(&self, body: &mut serde_json::Value) -> Result<bool, String> {
        if self.guards.is_empty() {
            return Ok(false);
        }
        let mut changed = false;
        let mut visit = |v: &mut serde_json::Value| -> Result<(), String> {
            if let serde_json::Value::String(s) = v {
                match self.apply(Stage::Input, s) {
                    Outcome::Unchanged => {}
                    Outcome::Rewritten(new) => {
                        *s = new;
                        changed = true;
                    }
                    Outcome::Blocked(reason) => return Err(reason),
                }
            }
            Ok(())
        };
        if let Some(messages) = body.get_mut("messages").and_then(|m| m.as_array_mut()) {
            for m in messages {
                match m.get_mut("content") {
                    Some(serde_json::Value::Array(parts)) => {
                        for p in parts {
                            if let Some(t) = p.get_mut("text") {
                                visit(t)?;
                            }
                        }
                    }
                    Some(c) => visit(c)?,
                    None => {}
                }
            }
        }
        for field in ["prompt", "input"] {
            match body.get_mut(field) {
                Some(serde_json::Value::Array(items)) => {
                    for it in items {
                        visit(it)?;
                    }
                }
                Some(v) => visit(v)?,
                None => {}
            }
        }
        if let Some(messages) = body.get_mut("messages").and_then(|m| m.as_array_mut()) {
            for m in messages {
                changed |= self.apply_tool_calls(Stage::Input, m.get_mut("tool_calls"))?;
            }
        }
        Ok(changed)
    }

    /// Applies output guardrails to a non-streamed response's texts
    /// (`choices[].message.content`, the arguments of `choices[].message.tool_calls`,
    /// `choices[].text`).
    pub fn apply_response(&self, body: &mut serde_json::Value) -> Result<bool, String> {
        if self.guards.is_empty() {
            return Ok(false);
        }
        let mut changed = false;
        if let Some(choices) = body.get_mut("choices").and_then(|c| c.as_array_mut()) {
            for c in choices {
                if let Some(m) = c.get_mut("message") {
                    changed |= self.apply_tool_calls(Stage::Output, m.get_mut("tool_calls"))?;
                }
                let slot = match c.get_mut("message") {
                    Some(m) => m.get_mut("content"),
                    None => c.get_mut("text"),
                };
                if let Some(serde_json::Value::String(s)) = slot {
                    match self.apply(Stage::Output, s) {
                        Outcome::Unchanged => {}
                        Outcome::Rewritten(new) => {
                            *s = new;
                            changed = true;
                        }
                        Outcome::Blocked(reason) => return Err(reason),
                    }
                }
            }
        }
        Ok(changed)
    }

    /// The guardrails over each call's `function.arguments` in a `tool_calls` list: an
    /// arguments string that is JSON is checked value by value (every string, keys
    /// included) and written back as JSON, so a redaction never breaks it; one that is
    /// not JSON is checked as text.
    fn apply_tool_calls(
        &self,
        stage: Stage,
        calls: Option<&mut serde_json::Value>,
    ) -> Result<bool, String> {
        let Some(serde_json::Value::Array(calls)) = calls else {
            return Ok(false);
        };
        let mut changed = false;
        for call in calls {
            let Some(serde_json::Value::String(args)) = call
                .get_mut("function")
                .and_then(|f| f.get_mut("arguments"))
            else {
                continue;
            };
            let new = match serde_json::from_str::<serde_json::Value>(args) {
                Ok(mut parsed) => {
                    if self.apply_json(stage, &mut parsed)? {
                        Some(parsed.to_string())
                    } else {
                        None
                    }
                }
                Err(_) => match self.apply(stage, args) {
                    Outcome::Unchanged => None,
                    Outcome::Rewritten(new) => Some(new),
                    Outcome::Blocked(reason) => return Err(reason),
                },
            };
            if let Some(new) = new {
                *args = new;
                changed = true;
            }
        }
        Ok(changed)
    }

    /// The guardrails over every string in a JSON value (object keys included), in place.
    fn apply_json(&self, stage: Stage, v: &mut serde_json::Value) -> Result<bool, String> {
        let mut changed = false;
        match v {
            serde_json::Value::String(s) => match self.apply(stage, s) {
                Outcome::Unchanged => {}
                Outcome::Rewritten(new) => {
                    *s = new;
                    changed = true;
                }
                Outcome::Blocked(reason) => return Err(reason),
            },
            serde_json::Value::Array(items) => {
                for it in items {
                    changed |= self.apply_json(stage, it)?;
                }
            }
            serde_json::Value::Object(map) => {
                let old = std::mem::take(map);
                for (k, mut item) in old {
                    changed |= self.apply_json(stage, &mut item)?;
                    let key = match self.apply(stage, &k) {
                        Outcome::Unchanged => k,
                        Outcome::Rewritten(new) => {
                            changed = true;
                            new
                        }
                        Outcome::Blocked(reason) => return Err(reason),
                    };
                    map.insert(key, item);
                }
            }
            _ => {}
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(kinds: &[(&str, GuardAction)]) -> Guardrails {
        Guardrails::new(&GuardrailsConfig {
            max_prompt_chars: None,
            classifiers: Vec::new(),
            patterns: kinds
                .iter()
                .map(|(k, a)| PatternRule {
                    kind: k.to_string(),
                    action: *a,
                    regex: None,
                    input: true,
                    output: true,
                })
                .collect(),
        })
        .unwrap()
    }

    #[test]
    fn redacts_each_builtin_kind() {
        let g = rules(&[
            ("api_key", GuardAction::Redact),
            ("email", GuardAction::Redact),
            ("card_number", GuardAction::Redact),
            ("private_key", GuardAction::Redact),
        ]);
        let text = "key sk-abcdefghijklmnopqrstuvwx mail bob@example.com card 4111 1111 1111 1111 \
                    -----BEGIN RSA PRIVATE KEY-----\nMIIB\n-----END RSA PRIVATE KEY----- end";
        let Outcome::Rewritten(out) = g.apply(Stage::Input, text) else {
            panic!("expected a rewrite");
        };
        assert!(!out.contains("sk-abc"), "{out}");
        assert!(!out.contains("bob@example.com"), "{out}");
        assert!(!out.contains("4111"), "{out}");
        assert!(!out.contains("MIIB"), "{out}");
        assert!(out.contains("[REDACTED:api_key]"));
        assert!(out.contains("[REDACTED:email]"));
        assert!(out.contains("[REDACTED:card_number]"));
        assert!(out.contains("[REDACTED:private_key]"));
        assert!(out.ends_with(" end"));
    }

    #[test]
    fn card_numbers_need_a_valid_luhn_digit() {
        let g = rules(&[("card_number", GuardAction::Block)]);
        assert_eq!(
            g.apply(Stage::Input, "order 1234 5678 9012 3456"),
            Outcome::Unchanged
        );
        assert!(matches!(
            g.apply(Stage::Input, "pay with 4242424242424242"),
            Outcome::Blocked(_)
        ));
        assert!(luhn_valid("4111-1111-1111-1111"));
        assert!(!luhn_valid("4111-1111-1111-1112"));
    }

    #[test]
    fn request_and_response_walkers_touch_text_only() {
        let g = rules(&[("email", GuardAction::Redact)]);
        let mut body = serde_json::json!({
            "model": "a@b.co",
            "messages": [
                {"role": "user", "content": "write to a@b.co"},
                {"role": "user", "content": [{"type": "text", "text": "or c@d.org"}]}
            ]
        });
        assert!(g.apply_request(&mut body).unwrap());
        assert_eq!(body["model"], "a@b.co");
        assert_eq!(body["messages"][0]["content"], "write to [REDACTED:email]");
        assert_eq!(
            body["messages"][1]["content"][0]["text"],
            "or [REDACTED:email]"
        );
        let mut resp = serde_json::json!({"choices": [{"message": {"content": "x@y.io"}}]});
        assert!(g.apply_response(&mut resp).unwrap());
        assert_eq!(resp["choices"][0]["message"]["content"], "[REDACTED:email]");
    }

    #[test]
    fn tool_call_arguments_are_checked_and_stay_json() {
        let g = rules(&[("email", GuardAction::Redact)]);
        let call = |args: &str| {
            serde_json::json!([{"id": "c", "type": "function",
                "function": {"name": "send", "arguments": args}}])
        };
        let mut resp = serde_json::json!({"choices": [{"message": {"content": null,
            "tool_calls": call(r#"{"to": "x@y.io", "cc": ["a@b.co"], "n": 1}"#)}}]});
        assert!(g.apply_response(&mut resp).unwrap());
        let args = resp["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        let args: serde_json::Value = serde_json::from_str(args).expect("still JSON");
        assert_eq!(
            args,
            serde_json::json!({"to": "[REDACTED:email]", "cc": ["[REDACTED:email]"], "n": 1})
        );
        // Arguments that are not JSON are checked as text.
        let mut resp =
            serde_json::json!({"choices": [{"message": {"tool_calls": call("to x@y.io")}}]});
        assert!(g.apply_response(&mut resp).unwrap());
        assert_eq!(
            resp["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "to [REDACTED:email]"
        );
        // An earlier turn's call in the history is input.
        let block = rules(&[("api_key", GuardAction::Block)]);
        let mut req = serde_json::json!({"messages": [
            {"role": "assistant", "content": null,
             "tool_calls": call(r#"{"key": "AKIAABCDEFGHIJKLMNOP"}"#)}]});
        assert!(block
            .apply_request(&mut req)
            .unwrap_err()
            .contains("api_key"));
        let mut clean = serde_json::json!({"choices": [{"message": {"tool_calls": call("{}")}}]});
        assert!(!block.apply_response(&mut clean).unwrap());
    }

    #[test]
    fn block_reports_the_guardrail() {
        let g = rules(&[("api_key", GuardAction::Block)]);
        let mut body = serde_json::json!({"prompt": "AKIAABCDEFGHIJKLMNOP"});
        let err = g.apply_request(&mut body).unwrap_err();
        assert!(err.contains("api_key"));
    }

    #[test]
    fn bad_rules_are_refused() {
        let mut rule = PatternRule {
            kind: "custom".into(),
            action: GuardAction::Block,
            regex: None,
            input: true,
            output: true,
        };
        assert!(validate_rule(&rule).is_err());
        rule.regex = Some("(".into());
        assert!(validate_rule(&rule).is_err());
        rule.regex = Some("secret-\\d+".into());
        assert!(validate_rule(&rule).is_ok());
        rule.kind = "nope".into();
        rule.regex = None;
        assert!(validate_rule(&rule).is_err());
    }
}
