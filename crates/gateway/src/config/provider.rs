//! An upstream's provider settings (`provider`, its key, `anthropic_version`,
//! `connect_timeout_ms`, `prices`), checked without reading anything: the key itself is
//! read when the config is resolved ([`super::Resolved`]), where a missing variable or
//! file is refused naming the upstream.

use super::{invalid, ConfigError, UpstreamConfig, UpstreamKind};

/// Longest connect timeout accepted, in ms.
const MAX_CONNECT_TIMEOUT_MS: u64 = 120_000;

/// Checks a fixed-URL upstream's provider fields.
pub(super) fn validate_provider_upstream(u: &UpstreamConfig) -> Result<(), ConfigError> {
    let name = &u.name;
    if u.api_key_env.is_some() && u.api_key_file.is_some() {
        return Err(invalid(format!(
            "upstream `{name}`: give `api_key_env` or `api_key_file`, not both"
        )));
    }
    if let Some(p) = u.provider {
        if u.kind != UpstreamKind::Openai {
            return Err(invalid(format!(
                "upstream `{name}`: `provider` is for fixed-URL upstreams (no `kind`)"
            )));
        }
        if p.needs_key() && u.api_key_env.is_none() && u.api_key_file.is_none() {
            return Err(invalid(format!(
                "upstream `{name}`: provider `{}` needs `api_key_env` or `api_key_file`",
                p.name()
            )));
        }
        if u.base_url().is_empty() {
            return Err(invalid(format!(
                "upstream `{name}`: provider `{}` needs a `base_url`",
                p.name()
            )));
        }
        if u.base_url().trim_end_matches('/').ends_with("/v1") {
            return Err(invalid(format!(
                "upstream `{name}`: write base_url without the `/v1` suffix (the gateway adds \
                 each route's path)"
            )));
        }
    }
    if u.anthropic_version.is_some()
        && u.provider != Some(crate::provider::kind::Provider::Anthropic)
    {
        return Err(invalid(format!(
            "upstream `{name}`: `anthropic_version` needs `provider: anthropic`"
        )));
    }
    if let Some(v) = &u.anthropic_version {
        if v.is_empty() || axum::http::HeaderValue::from_str(v).is_err() {
            return Err(invalid(format!(
                "upstream `{name}`: `anthropic_version` `{v}` cannot be sent in a header"
            )));
        }
    }
    if let Some(ms) = u.connect_timeout_ms {
        if ms == 0 || ms > MAX_CONNECT_TIMEOUT_MS {
            return Err(invalid(format!(
                "upstream `{name}`: connect_timeout_ms must be in 1..={MAX_CONNECT_TIMEOUT_MS}"
            )));
        }
    }
    for (model, price) in &u.prices {
        let ok = |p: f64| p.is_finite() && p >= 0.0;
        if model.is_empty() || !(ok(price.input_per_1m) && ok(price.output_per_1m)) {
            return Err(invalid(format!(
                "upstream `{name}`: prices of `{model}` must name a model and be finite and >= 0"
            )));
        }
    }
    Ok(())
}
