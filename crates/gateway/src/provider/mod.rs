//! Hosted providers: an upstream's `provider:` says whose API it speaks, which fixes its
//! default base URL, the routes it serves, the path each route goes to, how its key is
//! sent and whether a chat request is translated on the way ([`anthropic`]).
//!
//! * `openai`: OpenAI's API (`https://api.openai.com` unless `base_url` says otherwise),
//!   `Authorization: Bearer <key>`; chat, completions, embeddings and audio.
//! * `anthropic`: Anthropic's Messages API (`https://api.anthropic.com`), `x-api-key:
//!   <key>` and `anthropic-version`; a chat request is translated to a Messages request
//!   and the answer (whole or streamed) back to a chat completion.
//! * `openai-compatible`: any other server speaking OpenAI's API (its `base_url` is
//!   required, its key optional), `Authorization: Bearer`.
//!
//! An upstream without `provider:` is a Strata engine, router or vLLM server: every route
//! passes through, with `Authorization: Bearer` when it has a key.

use crate::proxy::route::Route;

pub mod anthropic;
pub mod key;
pub mod kind;

pub use key::{auth_headers, read_key, ApiKey};
pub use kind::{Provider, DEFAULT_ANTHROPIC_VERSION};

impl Provider {
    /// Whether a request on `route` can go to this provider (a plan skips the targets on
    /// upstreams that cannot take it, so a vLLM-only route never leaves for a provider).
    /// Messages and Responses requests reach a provider only passed through, when its
    /// upstream lists the API in `apis:` ([`crate::passthrough`]).
    pub fn serves(self, route: Route) -> bool {
        match self {
            Provider::Anthropic => {
                matches!(route, Route::Chat | Route::Messages | Route::CountTokens)
            }
            Provider::Openai => matches!(
                route,
                Route::Chat
                    | Route::Completions
                    | Route::Embeddings
                    | Route::Responses
                    | Route::Transcriptions
                    | Route::Translations
            ),
            Provider::OpenaiCompatible => matches!(
                route,
                Route::Chat
                    | Route::Completions
                    | Route::Embeddings
                    | Route::Messages
                    | Route::CountTokens
                    | Route::Responses
                    | Route::Transcriptions
                    | Route::Translations
            ),
        }
    }

    /// Whether a chat request and its answer are translated for this provider.
    pub fn translates(self, route: Route) -> bool {
        self == Provider::Anthropic && route == Route::Chat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_and_paths() {
        assert!(Provider::Anthropic.serves(Route::Chat));
        assert!(!Provider::Anthropic.serves(Route::Embeddings));
        assert!(!Provider::Openai.serves(Route::Tokenize));
        assert!(Provider::Anthropic.serves(Route::Messages));
        assert!(!Provider::Openai.serves(Route::Messages));
        assert!(Provider::Openai.serves(Route::Responses));
        assert!(Provider::Openai.serves(Route::Transcriptions));
        assert!(!Provider::Anthropic.serves(Route::Translations));
        assert_eq!(Provider::Anthropic.path(Route::Chat.path()), "/v1/messages");
        assert_eq!(
            Provider::Openai.path(Route::Chat.path()),
            "/v1/chat/completions"
        );
        assert!(Provider::Anthropic.translates(Route::Chat));
        assert!(!Provider::OpenaiCompatible.translates(Route::Chat));
    }

    #[test]
    fn names_round_trip_through_yaml() {
        for p in [
            Provider::Openai,
            Provider::Anthropic,
            Provider::OpenaiCompatible,
        ] {
            let parsed: Provider = serde_yaml::from_str(p.name()).unwrap();
            assert_eq!(parsed, p);
        }
        assert!(serde_yaml::from_str::<Provider>("azure").is_err());
    }
}
