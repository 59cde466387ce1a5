//! Which API a path asks for, read from its suffix (a gateway may mount the API under a
//! prefix), and what that means for routing: how its body is read, whether it must name
//! a model, how its streams end.
//!
//! The table covers what vLLM serves (its `/openapi.json`) and what its embedding,
//! reranking and speech builds add. A path not in it is [`Api::Other`]: routed by the
//! body's `model` when the body is JSON that names one, else to any ready replica. The
//! table only decides what to read; it never refuses a path.

use super::view::Shape;

/// The API a path belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    ChatBatch,
    Completions,
    Responses,
    /// `/v1/responses/{id}` (and `/{id}/cancel`, ...): a stored response.
    ResponseById,
    Messages,
    CountTokens,
    Embeddings,
    Pooling,
    Classify,
    Score,
    Rerank,
    GenerativeScoring,
    Tokenize,
    Detokenize,
    /// `/v1/audio/transcriptions`, `/v1/audio/translations`: `multipart/form-data`.
    Transcription,
    Speech,
    Other,
}

/// How a body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyForm {
    /// A JSON object; anything else is refused (400).
    Json,
    /// `multipart/form-data` with a `model` field.
    Multipart,
    /// Whatever it is: JSON naming a `model` is routed by it, anything else goes on as is.
    Any,
}

/// Suffixes, most specific first.
const TABLE: &[(&str, Api)] = &[
    ("/chat/completions/batch", Api::ChatBatch),
    ("/chat/completions", Api::Chat),
    ("/completions", Api::Completions),
    ("/messages/count_tokens", Api::CountTokens),
    ("/messages", Api::Messages),
    ("/responses", Api::Responses),
    ("/embeddings", Api::Embeddings),
    ("/pooling", Api::Pooling),
    ("/classify", Api::Classify),
    ("/score", Api::Score),
    ("/rerank", Api::Rerank),
    ("/generative_scoring", Api::GenerativeScoring),
    ("/detokenize", Api::Detokenize),
    ("/tokenize", Api::Tokenize),
    ("/audio/transcriptions", Api::Transcription),
    ("/audio/translations", Api::Transcription),
    ("/audio/speech", Api::Speech),
];

/// A path's API, and the stored response it names (for [`Api::ResponseById`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route<'a> {
    pub api: Api,
    pub response_id: Option<&'a str>,
}

/// The route of `path` (a query string is ignored, and a trailing `/`).
pub fn route(path: &str) -> Route<'_> {
    let path = path.split('?').next().unwrap_or("").trim_end_matches('/');
    for (suffix, api) in TABLE {
        if path.ends_with(suffix) {
            return Route {
                api: *api,
                response_id: None,
            };
        }
    }
    if let Some((_, rest)) = path.split_once("/responses/") {
        if let Some(id) = rest.split('/').next().filter(|id| !id.is_empty()) {
            return Route {
                api: Api::ResponseById,
                response_id: Some(id),
            };
        }
    }
    Route {
        api: Api::Other,
        response_id: None,
    }
}

impl Api {
    /// How the body of a POST is read.
    pub fn form(self) -> BodyForm {
        match self {
            Api::Transcription => BodyForm::Multipart,
            Api::Other | Api::ResponseById => BodyForm::Any,
            _ => BodyForm::Json,
        }
    }

    /// What the routing view reads from a JSON body.
    pub fn shape(self) -> Shape {
        match self {
            Api::Chat => Shape::Chat,
            Api::ChatBatch => Shape::ChatBatch,
            Api::Completions => Shape::Completion,
            Api::Responses => Shape::Responses,
            Api::Messages | Api::CountTokens => Shape::Messages,
            _ => Shape::ModelOnly,
        }
    }

    /// Whether a POST must name a `model`: the APIs that run a model (the pool's replicas
    /// may serve different ones). Tokenizing, speech and unknown paths go to any replica
    /// when they name none.
    pub fn needs_model(self) -> bool {
        !matches!(
            self,
            Api::Tokenize
                | Api::Detokenize
                | Api::Transcription
                | Api::Speech
                | Api::ResponseById
                | Api::Other
        )
    }

    /// Whether its event streams end with `data: [DONE]` (the OpenAI completions
    /// protocols); other streams (Responses, Messages) end when their body ends.
    pub fn ends_with_done(self) -> bool {
        matches!(self, Api::Chat | Api::Completions)
    }

    /// Whether prefill/decode disaggregation can split it (PROTOCOLS §11: the phase-1
    /// body is a chat or completion request).
    pub fn disaggregable(self) -> bool {
        matches!(self, Api::Chat | Api::Completions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_comes_from_the_path_suffix() {
        let api = |p| route(p).api;
        assert_eq!(api("/v1/chat/completions"), Api::Chat);
        assert_eq!(api("/v1/chat/completions/batch"), Api::ChatBatch);
        assert_eq!(api("/v1/completions?x=1"), Api::Completions);
        assert_eq!(api("/v1/embeddings"), Api::Embeddings);
        assert_eq!(api("/v1/responses/"), Api::Responses);
        assert_eq!(api("/v1/messages"), Api::Messages);
        assert_eq!(api("/v1/messages/count_tokens"), Api::CountTokens);
        assert_eq!(api("/tokenize"), Api::Tokenize);
        assert_eq!(api("/detokenize"), Api::Detokenize);
        assert_eq!(api("/v2/rerank"), Api::Rerank);
        assert_eq!(api("/score"), Api::Score);
        assert_eq!(api("/generative_scoring"), Api::GenerativeScoring);
        assert_eq!(api("/v1/audio/transcriptions"), Api::Transcription);
        assert_eq!(api("/llm/v1/chat/completions"), Api::Chat);
        assert_eq!(api("/invocations"), Api::Other);
        assert_eq!(api("/load"), Api::Other);
    }

    #[test]
    fn stored_responses_are_named_by_the_path() {
        let r = route("/v1/responses/resp_1");
        assert_eq!((r.api, r.response_id), (Api::ResponseById, Some("resp_1")));
        let r = route("/v1/responses/resp_2/cancel?x=1");
        assert_eq!((r.api, r.response_id), (Api::ResponseById, Some("resp_2")));
    }

    #[test]
    fn only_the_completions_protocols_end_with_done() {
        assert!(Api::Chat.ends_with_done() && Api::Completions.ends_with_done());
        assert!(!Api::Responses.ends_with_done() && !Api::Messages.ends_with_done());
        assert!(Api::Chat.needs_model() && !Api::Other.needs_model());
    }
}
