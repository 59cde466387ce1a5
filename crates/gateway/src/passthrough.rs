//! Which generation APIs an upstream serves itself, and so whether a request on
//! `/v1/messages` or `/v1/responses` is passed through or translated to chat.
//!
//! An upstream lists them in `apis:` (`[messages, responses]` for vLLM 0.32; chat is
//! always served). A request is passed through only when every upstream it could reach
//! — each target of its model and of the models in its `fallbacks` — lists the API, so a
//! fallback never receives a body it cannot read; a cascade model is always translated,
//! and so is every request while guardrails are configured: the guardrails read chat's
//! fields (messages, choices) and its chunks, so a Messages or Responses body, answer or
//! stream passed as is would escape them (`system`, `tool_result`, `instructions`,
//! `content[]`, `output[]`), and re-encoding a passed-through stream would drop its
//! `event:` names. Translated through chat, the guardrails apply in full.
//! Anything else (the default: a Strata engine, any OpenAI-compatible server) is
//! translated to chat and back ([`crate::translate`]).

pub use crate::apis::Api;
use crate::config::Resolved;
use crate::provider::Provider;
use crate::state::Gateway;

/// True when every upstream that a request for `model` may reach speaks `api` and no
/// guardrails are configured (see the module doc).
pub fn speaks(gw: &Gateway, model: &str, api: Api) -> bool {
    speaks_in(&gw.config.get(), model, api)
}

/// [`speaks`] over one config.
pub fn speaks_in(resolved: &Resolved, model: &str, api: Api) -> bool {
    if !resolved.guardrails.is_empty() {
        return false;
    }
    let Some(m) = resolved.model(model) else {
        return false;
    };
    let models = std::iter::once(m).chain(m.fallbacks.iter().filter_map(|f| resolved.model(f)));
    let mut any = false;
    for m in models {
        if m.cascade.is_some() {
            return false;
        }
        for t in &m.targets {
            let listed = resolved
                .config
                .upstreams
                .iter()
                .find(|u| u.name == t.upstream)
                .is_some_and(|u| u.apis.contains(&api));
            if !listed {
                return false;
            }
            any = true;
        }
    }
    any
}

/// True when every upstream that a request for `model` may reach is a hosted Anthropic
/// provider (`provider: anthropic`): its `count_tokens` is Anthropic's own
/// `/v1/messages/count_tokens`, since it has no `/tokenize`.
pub fn all_anthropic_in(resolved: &Resolved, model: &str) -> bool {
    let Some(m) = resolved.model(model) else {
        return false;
    };
    let models = std::iter::once(m).chain(m.fallbacks.iter().filter_map(|f| resolved.model(f)));
    let mut any = false;
    for m in models {
        if m.cascade.is_some() {
            return false;
        }
        for t in &m.targets {
            let anthropic = resolved
                .upstreams
                .get(&t.upstream)
                .is_some_and(|u| u.provider == Some(Provider::Anthropic));
            if !anthropic {
                return false;
            }
            any = true;
        }
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn resolved(yaml: &str) -> Resolved {
        let cfg: Config = serde_yaml::from_str(yaml).unwrap();
        Resolved::new(cfg).unwrap()
    }

    #[test]
    fn passed_through_only_when_every_reachable_upstream_lists_the_api() {
        let r = resolved(
            r#"
upstreams:
  - {name: vllm, base_url: "http://127.0.0.1:1", apis: [messages, responses]}
  - {name: strata, base_url: "http://127.0.0.1:2"}
models:
  - {name: a, targets: [{upstream: vllm}]}
  - {name: b, targets: [{upstream: vllm}, {upstream: strata}]}
  - {name: c, targets: [{upstream: vllm}], fallbacks: [d]}
  - {name: d, targets: [{upstream: strata}]}
"#,
        );
        assert!(speaks_in(&r, "a", Api::Messages));
        assert!(speaks_in(&r, "a", Api::Responses));
        assert!(!speaks_in(&r, "b", Api::Messages), "one target cannot");
        assert!(!speaks_in(&r, "c", Api::Messages), "its fallback cannot");
        assert!(!speaks_in(&r, "d", Api::Messages));
        assert!(!speaks_in(&r, "nope", Api::Messages));
    }

    #[test]
    fn count_tokens_goes_to_anthropic_when_every_upstream_is_anthropic() {
        std::env::set_var("STRATA_GW_PASSTHROUGH_TEST_KEY", "sk-ant-test");
        let r = resolved(
            r#"
upstreams:
  - {name: an, provider: anthropic, api_key_env: STRATA_GW_PASSTHROUGH_TEST_KEY}
  - {name: strata, base_url: "http://127.0.0.1:2"}
models:
  - {name: a, targets: [{upstream: an, model: claude}]}
  - {name: b, targets: [{upstream: an}, {upstream: strata}]}
  - {name: c, targets: [{upstream: an}], fallbacks: [d]}
  - {name: d, targets: [{upstream: strata}]}
"#,
        );
        assert!(all_anthropic_in(&r, "a"));
        assert!(!all_anthropic_in(&r, "b"));
        assert!(!all_anthropic_in(&r, "c"));
        assert!(!all_anthropic_in(&r, "d"));
        assert!(!all_anthropic_in(&r, "nope"));
        assert!(!speaks_in(&r, "a", Api::Messages), "no `apis:` listed");
    }

    #[test]
    fn guardrails_turn_pass_through_into_translation() {
        let r = resolved(
            r#"
upstreams:
  - {name: vllm, base_url: "http://127.0.0.1:1", apis: [messages, responses]}
models:
  - {name: a, targets: [{upstream: vllm}]}
guardrails:
  patterns: [{kind: custom, regex: "secret", action: block}]
"#,
        );
        assert!(!speaks_in(&r, "a", Api::Messages));
        assert!(!speaks_in(&r, "a", Api::Responses));
    }
}
