//! Which provider an upstream is ([`Provider`]), as `gateway.yaml` names it: the type
//! the config holds, apart from what each provider does with a route ([`super`]).

use serde::{Deserialize, Serialize};

/// Where Anthropic serves its Messages API.
pub const MESSAGES_PATH: &str = "/v1/messages";

/// The `anthropic-version` sent when the upstream names none.
pub const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

/// Whose API an upstream speaks (`upstreams[].provider`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Provider {
    Openai,
    Anthropic,
    OpenaiCompatible,
}

impl Provider {
    /// The name written in `gateway.yaml`.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Openai => "openai",
            Provider::Anthropic => "anthropic",
            Provider::OpenaiCompatible => "openai-compatible",
        }
    }

    /// The provider's own base URL, used when `base_url` is not given.
    pub fn default_base_url(self) -> Option<&'static str> {
        match self {
            Provider::Openai => Some("https://api.openai.com"),
            Provider::Anthropic => Some("https://api.anthropic.com"),
            Provider::OpenaiCompatible => None,
        }
    }

    /// Whether the upstream cannot be called without a key.
    pub fn needs_key(self) -> bool {
        matches!(self, Provider::Openai | Provider::Anthropic)
    }

    /// The path a request that came in on `route_path` is sent to: Anthropic takes chat
    /// at its Messages path; every other path is the same.
    pub fn path(self, route_path: &str) -> &str {
        match self {
            Provider::Anthropic if route_path == "/v1/chat/completions" => MESSAGES_PATH,
            _ => route_path,
        }
    }
}
