//! Where a request goes: the ordered list of tries for a public model name.
//!
//! Pure: the plan is a function of the config, the request's estimated size and a seeded
//! RNG. Each try is priced by its upstream's `prices` table when it names the model sent,
//! else by the public model's `price`. The order is the model's targets (weighted random order: the first is a weighted
//! pick, the rest follow by weighted sampling without replacement; weight-0 targets only as
//! a last resort), then each fallback model's targets the same way. Fallbacks are followed
//! one level deep, in the order written. A model whose `context_length` is smaller than the
//! estimated prompt + output is skipped before any call is made.

use std::time::Duration;

use rand::Rng;

use crate::config::{ModelConfig, Price, Resolved};

/// One upstream call in the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    /// The public model (group) this target belongs to.
    pub model: String,
    pub upstream: String,
    /// The `model` value sent upstream.
    pub upstream_model: String,
    pub price: Price,
    pub retries: u32,
    pub backoff_ms: u64,
    pub try_timeout: Duration,
}

/// Orders `model`'s targets and its fallbacks'. Empty when every model is too small.
pub fn plan(
    resolved: &Resolved,
    model: &ModelConfig,
    needed_tokens: u64,
    rng: &mut impl Rng,
) -> Vec<Attempt> {
    let mut out = Vec::new();
    let mut seen: Vec<&str> = Vec::new();
    let groups =
        std::iter::once(model).chain(model.fallbacks.iter().filter_map(|f| resolved.model(f)));
    for m in groups {
        if seen.contains(&m.name.as_str()) {
            continue;
        }
        seen.push(&m.name);
        if m.context_length.is_some_and(|c| c < needed_tokens) {
            continue;
        }
        for i in weighted_order(&m.targets.iter().map(|t| t.weight).collect::<Vec<_>>(), rng) {
            let t = &m.targets[i];
            out.push(Attempt {
                model: m.name.clone(),
                upstream: t.upstream.clone(),
                price: target_price(resolved, m, &t.upstream, t.model.as_deref()),
                upstream_model: t.model.clone().unwrap_or_else(|| m.name.clone()),
                retries: m.retries,
                backoff_ms: m.backoff_ms,
                try_timeout: Duration::from_millis(m.try_timeout_ms),
            });
        }
    }
    out
}

/// What an answer of `upstream` for model group `m` costs: the upstream's price for the
/// model it is sent (its `prices` table, e.g. a provider's list prices), else the public
/// model's `price`.
pub fn target_price(
    resolved: &Resolved,
    m: &ModelConfig,
    upstream: &str,
    upstream_model: Option<&str>,
) -> Price {
    let sent = upstream_model.unwrap_or(&m.name);
    resolved
        .upstreams
        .get(upstream)
        .and_then(|u| u.prices.get(sent))
        .copied()
        .unwrap_or(m.price)
}

/// The highest input and output prices any try of `model` may be charged at (its targets
/// and its fallbacks', each at [`target_price`]): what a budget hold reserves before it is
/// known who answers.
pub fn max_price(resolved: &Resolved, model: &ModelConfig) -> Price {
    let groups =
        std::iter::once(model).chain(model.fallbacks.iter().filter_map(|f| resolved.model(f)));
    let mut out = model.price;
    for m in groups {
        for t in &m.targets {
            let p = target_price(resolved, m, &t.upstream, t.model.as_deref());
            out.input_per_1m = out.input_per_1m.max(p.input_per_1m);
            out.output_per_1m = out.output_per_1m.max(p.output_per_1m);
        }
    }
    out
}

/// Indices ordered by weighted sampling without replacement; zero weights go last in
/// their written order.
pub fn weighted_order(weights: &[u32], rng: &mut impl Rng) -> Vec<usize> {
    let mut left: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0).collect();
    let mut out = Vec::with_capacity(weights.len());
    while !left.is_empty() {
        let total: u64 = left.iter().map(|&i| u64::from(weights[i])).sum();
        let mut pick = rng.random_range(0..total);
        let mut chosen = 0;
        for (pos, &i) in left.iter().enumerate() {
            let w = u64::from(weights[i]);
            if pick < w {
                chosen = pos;
                break;
            }
            pick -= w;
        }
        out.push(left.remove(chosen));
    }
    out.extend((0..weights.len()).filter(|&i| weights[i] == 0));
    out
}

/// Why one try failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    Connect,
    /// The upstream's certificate was refused (unknown issuer, expired, another host's
    /// name) or its TLS handshake broke: the reason's class ([`tls_reason`]; the whole
    /// error, which may name internal hosts, goes to the log only).
    Tls(String),
    Timeout,
    /// A provider refused the gateway's own key (its 401 or 403, the status kept): the
    /// same key is refused again, so the plan moves to the next target at once, and the
    /// client never receives that status (its own credentials were not sent).
    KeyRefused(u16),
    /// An HTTP status from the upstream with its (possibly truncated) body.
    Status(u16, String),
}

/// What to do after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Try the same target again (if retries remain), else move on.
    Retry,
    /// Move to the next target without retrying this one.
    NextTarget,
    /// Give the upstream's answer to the client: falling back would not help.
    Relay,
}

/// The policy for a failure (pure; [`crate::retry::decide`] adds the retry budget and
/// the waits). A refused certificate and a provider refusing the gateway's key move on at
/// once. Of the 4xx, only 408 and 429 are retried (the
/// upstream was busy, another try or target may not be); a context-length error and a 404
/// (an upstream without the model) move on at once, because a fallback with a larger
/// window or another target may serve it; every other 4xx is the request's own fault and
/// goes to the client as is.
pub fn classify(f: &Failure) -> Next {
    match f {
        Failure::Connect | Failure::Timeout => Next::Retry,
        // The same certificate (or key) is refused again; another upstream may answer.
        Failure::Tls(_) | Failure::KeyRefused(_) => Next::NextTarget,
        Failure::Status(status, body) => match *status {
            408 | 429 | 500..=599 => Next::Retry,
            400 | 413 | 422 if is_context_length_error(body) => Next::NextTarget,
            404 => Next::NextTarget,
            _ => Next::Relay,
        },
    }
}

/// Whether an upstream's status, when it is the last failure, goes to the client as that
/// status: every 4xx. Turning one into a 503 would make a client that retries 503s resend,
/// forever, a request that can never succeed (a prompt over the context window).
pub fn is_client_error(status: u16) -> bool {
    (400..=499).contains(&status)
}

/// Recognises the context-window errors of OpenAI, vLLM and llama.cpp-style servers.
pub fn is_context_length_error(body: &str) -> bool {
    let b = body.to_ascii_lowercase();
    b.contains("context_length_exceeded")
        || b.contains("context length")
        || b.contains("maximum context")
        || b.contains("context window")
        || b.contains("exceeds the available context")
        || b.contains("prompt is too long")
}

/// The class of a refused TLS handshake, in fixed words a client may read: a rustls
/// error's text names hosts and certificate details that stay in the log.
pub fn tls_reason(error: &str) -> &'static str {
    let squashed: String = error
        .chars()
        .filter(|c| c.is_alphanumeric())
        .collect::<String>()
        .to_lowercase();
    if squashed.contains("unknownissuer") {
        "certificate from an unknown issuer"
    } else if squashed.contains("expired") || squashed.contains("notvalidyet") {
        "certificate expired or not yet valid"
    } else if squashed.contains("notvalidforname") {
        "certificate not valid for name"
    } else {
        "handshake refused"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tls_failure_reaches_clients_as_its_class_only() {
        assert_eq!(
            tls_reason("invalid peer certificate: UnknownIssuer"),
            "certificate from an unknown issuer"
        );
        assert_eq!(
            tls_reason("invalid peer certificate: certificate expired: verification time 1 (UNIX), but certificate is not valid after 0"),
            "certificate expired or not yet valid"
        );
        let name = tls_reason(
            "invalid peer certificate: certificate not valid for name \"internal.corp\"; certificate is only valid for DnsName(\"other.test\")",
        );
        assert_eq!(name, "certificate not valid for name");
        assert!(!name.contains("internal"));
        assert_eq!(tls_reason("received corrupt message"), "handshake refused");
    }
    use crate::config::Config;
    use rand::SeedableRng;

    fn resolved() -> Resolved {
        Resolved::new(
            Config::from_yaml(
                r#"
upstreams:
  - {name: a, base_url: "http://127.0.0.1:1"}
  - {name: b, base_url: "http://127.0.0.1:2"}
models:
  - name: big
    targets: [{upstream: a, weight: 3}, {upstream: b, weight: 1}]
    fallbacks: [small, big]
    context_length: 100
  - name: small
    targets: [{upstream: b, model: tiny}]
    context_length: 50
"#,
            )
            .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn plan_orders_targets_then_fallbacks() {
        let r = resolved();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let p = plan(&r, r.model("big").unwrap(), 10, &mut rng);
        assert_eq!(p.len(), 3, "{p:?}");
        assert_eq!(p[2].model, "small");
        assert_eq!(p[2].upstream_model, "tiny");
        let mut ups: Vec<_> = p[..2].iter().map(|a| a.upstream.as_str()).collect();
        ups.sort();
        assert_eq!(ups, ["a", "b"]);
    }

    #[test]
    fn an_upstream_price_table_wins_over_the_model_price() {
        let r = Resolved::new(
            Config::from_yaml(
                r#"
upstreams:
  - {name: local, base_url: "http://127.0.0.1:1"}
  - name: hosted
    base_url: "http://127.0.0.1:2"
    prices: {big-v2: {input_per_1m: 3, output_per_1m: 15}}
models:
  - name: m
    targets: [{upstream: local, weight: 0}, {upstream: hosted, model: big-v2}]
    fallbacks: [n]
    price: {input_per_1m: 0.1, output_per_1m: 0.2}
  - name: n
    targets: [{upstream: hosted}]
    price: {input_per_1m: 1, output_per_1m: 2}
"#,
            )
            .unwrap(),
        )
        .unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let p = plan(&r, r.model("m").unwrap(), 10, &mut rng);
        let prices: Vec<_> = p
            .iter()
            .map(|a| {
                (
                    a.upstream.as_str(),
                    a.upstream_model.as_str(),
                    a.price.input_per_1m,
                )
            })
            .collect();
        // The hosted table prices `big-v2`; `n` is sent as `n`, which it does not list.
        assert_eq!(
            prices,
            [
                ("hosted", "big-v2", 3.0),
                ("local", "m", 0.1),
                ("hosted", "n", 1.0)
            ]
        );
        // A budget hold reserves the dearest of them.
        let max = max_price(&r, r.model("m").unwrap());
        assert_eq!((max.input_per_1m, max.output_per_1m), (3.0, 15.0));
    }

    #[test]
    fn plan_skips_models_too_small() {
        let r = resolved();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let p = plan(&r, r.model("big").unwrap(), 80, &mut rng);
        assert!(p.iter().all(|a| a.model == "big"));
        assert!(plan(&r, r.model("big").unwrap(), 500, &mut rng).is_empty());
    }

    #[test]
    fn weighted_split_follows_weights() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(42);
        let mut first = [0u32; 3];
        for _ in 0..4000 {
            first[weighted_order(&[3, 1, 0], &mut rng)[0]] += 1;
        }
        assert_eq!(first[2], 0, "weight 0 is never first");
        let share = f64::from(first[0]) / 4000.0;
        assert!((0.70..0.80).contains(&share), "{share}");
        assert_eq!(weighted_order(&[0, 0], &mut rng), vec![0, 1]);
    }

    #[test]
    fn failure_classes() {
        assert_eq!(classify(&Failure::Connect), Next::Retry);
        assert_eq!(classify(&Failure::Status(503, String::new())), Next::Retry);
        assert_eq!(
            classify(&Failure::Status(
                400,
                r#"{"error":{"message":"This model's maximum context length is 8192 tokens"}}"#
                    .into()
            )),
            Next::NextTarget
        );
        assert_eq!(classify(&Failure::Status(400, "bad".into())), Next::Relay);
        assert_eq!(classify(&Failure::Status(401, String::new())), Next::Relay);
        assert_eq!(classify(&Failure::Status(408, String::new())), Next::Retry);
        assert_eq!(classify(&Failure::Tls("expired".into())), Next::NextTarget);
        assert_eq!(classify(&Failure::KeyRefused(401)), Next::NextTarget);
        assert_eq!(classify(&Failure::KeyRefused(403)), Next::NextTarget);
        let anthropic_ctx = r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#;
        assert_eq!(
            classify(&Failure::Status(400, anthropic_ctx.into())),
            Next::NextTarget
        );
        assert!(is_client_error(400) && is_client_error(429) && is_client_error(499));
        assert!(!is_client_error(500) && !is_client_error(302));
    }
}
