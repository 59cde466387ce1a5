//! Guardrails that call a model: a `classifiers` rule names a model served on the platform
//! (an ordinary `models` entry whose upstream answers vLLM's `/classify`), the labels that
//! block and a threshold. The request path ([`crate::proxy::classify_guard`]) sends the
//! texts and hands the answer here; this file holds the rule and its pure decision.
//!
//! A text is blocked when its most probable label is one of `block` and that label's
//! probability reaches `threshold`. A classifier that cannot answer (no target reachable,
//! an error status, an answer that is not `/classify`'s shape) follows `on_error`:
//! `closed` (the default: a guardrail that cannot run refuses) or `open`.

use serde::{Deserialize, Serialize};

/// What a rule does when its classifier cannot answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Let the request through (counted in `strata_gateway_backend_errors_total`).
    Open,
    /// Refuse it with 503.
    #[default]
    Closed,
}

/// One entry of `guardrails.classifiers`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifierRule {
    /// The `models` entry that classifies (its targets serve `/classify`).
    pub model: String,
    /// Labels (the model's `id2label` names) that block.
    pub block: Vec<String>,
    /// The probability a blocking label needs, in (0, 1].
    #[serde(default = "default_threshold")]
    pub threshold: f32,
    /// Classify prompts (default true).
    #[serde(default = "yes")]
    pub input: bool,
    /// Classify whole (non-streamed) answers (default false).
    #[serde(default)]
    pub output: bool,
    #[serde(default)]
    pub on_error: OnError,
}

fn default_threshold() -> f32 {
    0.5
}

fn yes() -> bool {
    true
}

impl ClassifierRule {
    /// Checks the rule against the configured model names.
    pub fn validate(&self, is_model: impl Fn(&str) -> bool) -> Result<(), String> {
        if !is_model(&self.model) {
            return Err(format!(
                "guardrails.classifiers: model `{}` is not a model",
                self.model
            ));
        }
        if self.block.is_empty() {
            return Err(format!(
                "guardrails.classifiers (`{}`): `block` needs at least one label",
                self.model
            ));
        }
        if !(self.threshold > 0.0 && self.threshold <= 1.0) {
            return Err(format!(
                "guardrails.classifiers (`{}`): threshold must be in (0, 1]",
                self.model
            ));
        }
        if !self.input && !self.output {
            return Err(format!(
                "guardrails.classifiers (`{}`): neither input nor output is checked",
                self.model
            ));
        }
        Ok(())
    }

    /// The reason to block, if the answer's texts say so. `Err` when the answer is not
    /// `/classify`'s shape for `texts` texts.
    pub fn verdict(&self, answer: &[u8], texts: usize) -> Result<Option<String>, String> {
        let parsed: ClassifyAnswer =
            serde_json::from_slice(answer).map_err(|e| format!("not a /classify answer: {e}"))?;
        if parsed.data.len() != texts {
            return Err(format!(
                "{} classifications for {texts} texts",
                parsed.data.len()
            ));
        }
        for item in &parsed.data {
            let p = item.probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if p >= self.threshold && self.block.contains(&item.label) {
                return Ok(Some(format!(
                    "request blocked by guardrail `classifier` (model `{}`): the text was \
                     classified `{}` with probability {p:.3} (threshold {})",
                    self.model, item.label, self.threshold
                )));
            }
        }
        Ok(None)
    }
}

/// The part of vLLM's `/classify` answer a rule reads.
#[derive(Deserialize)]
struct ClassifyAnswer {
    data: Vec<ClassifyItem>,
}

#[derive(Deserialize)]
struct ClassifyItem {
    label: String,
    probs: Vec<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> ClassifierRule {
        serde_yaml::from_str("{model: guard, block: [toxic, spam], threshold: 0.6}").unwrap()
    }

    #[test]
    fn defaults_and_validation() {
        let r = rule();
        assert!(r.input && !r.output);
        assert_eq!(r.on_error, OnError::Closed);
        assert!(r.validate(|m| m == "guard").is_ok());
        assert!(r.validate(|_| false).unwrap_err().contains("not a model"));
        let none = ClassifierRule {
            block: vec![],
            ..rule()
        };
        assert!(none.validate(|_| true).is_err());
        let high = ClassifierRule {
            threshold: 1.5,
            ..rule()
        };
        assert!(high.validate(|_| true).is_err());
        assert!(
            serde_yaml::from_str::<ClassifierRule>("{model: g, block: [a], extra: 1}").is_err()
        );
        let open: ClassifierRule =
            serde_yaml::from_str("{model: g, block: [a], on_error: open}").unwrap();
        assert_eq!(open.on_error, OnError::Open);
    }

    #[test]
    fn blocks_on_a_blocking_label_at_the_threshold() {
        let r = rule();
        let answer = |label: &str, probs: &str| {
            format!(
                r#"{{"data":[{{"index":0,"label":"safe","probs":[0.9,0.05,0.05],"num_classes":3}},{{"index":1,"label":"{label}","probs":{probs},"num_classes":3}}]}}"#
            )
        };
        let blocked = r
            .verdict(answer("toxic", "[0.2,0.7,0.1]").as_bytes(), 2)
            .unwrap()
            .expect("blocked");
        assert!(
            blocked.contains("`toxic`") && blocked.contains("guard"),
            "{blocked}"
        );
        // Below the threshold, or a label that does not block: passes.
        assert_eq!(
            r.verdict(answer("toxic", "[0.3,0.5,0.2]").as_bytes(), 2),
            Ok(None)
        );
        assert_eq!(
            r.verdict(answer("safe", "[0.8,0.1,0.1]").as_bytes(), 2),
            Ok(None)
        );
        // Not the answer asked for.
        assert!(r.verdict(b"{}", 2).is_err());
        assert!(r
            .verdict(answer("toxic", "[0.2,0.7,0.1]").as_bytes(), 3)
            .is_err());
    }
}
