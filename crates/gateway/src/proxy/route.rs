//! Which route a request came in on: its upstream path (the same path, so vLLM's three
//! rerank paths each reach their own), its name in cache keys and metrics, and what kind
//! of answer it gets (text generated, or not).

/// The routes the gateway forwards: OpenAI's, and vLLM's others that take a JSON body
/// naming a `model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Chat,
    Completions,
    Embeddings,
    /// vLLM `/tokenize` (an answer without usage; no tokens charged).
    Tokenize,
    /// vLLM `/detokenize` (likewise).
    Detokenize,
    /// vLLM `/rerank`, `/v1/rerank` and `/v2/rerank` (Jina and Cohere shapes).
    Rerank,
    RerankV1,
    RerankV2,
    /// vLLM `/score` and `/v1/score`.
    Score,
    ScoreV1,
    /// vLLM `/pooling`.
    Pooling,
    /// vLLM `/classify`.
    Classify,
    /// vLLM `/v1/chat/completions/batch` (a list of conversations, one answer).
    ChatBatch,
    /// Anthropic's `/v1/messages`, passed through to an upstream that speaks it (not in
    /// [`Route::ALL`]: [`crate::anthropic`] serves the path and picks this route or chat).
    Messages,
    /// `/v1/messages/count_tokens`, passed through likewise (no tokens charged).
    CountTokens,
    /// OpenAI's `/v1/responses`, passed through likewise ([`crate::responses`]).
    Responses,
    /// `/v1/audio/transcriptions` and `/v1/audio/translations`: a multipart form
    /// ([`super::form`]) passed through as sent.
    Transcriptions,
    Translations,
}

impl Route {
    /// Every route, in [`crate::config::ROUTE_PATHS`] order.
    pub const ALL: [Route; 15] = [
        Route::Chat,
        Route::Completions,
        Route::Embeddings,
        Route::Tokenize,
        Route::Detokenize,
        Route::Rerank,
        Route::RerankV1,
        Route::RerankV2,
        Route::Score,
        Route::ScoreV1,
        Route::Pooling,
        Route::Classify,
        Route::ChatBatch,
        Route::Transcriptions,
        Route::Translations,
    ];

    /// Index into [`crate::config::ROUTE_PATHS`] and
    /// [`crate::config::ResolvedUpstream::route_urls`].
    pub(crate) fn index(self) -> usize {
        match self {
            Route::Chat => 0,
            Route::Completions => 1,
            Route::Embeddings => 2,
            Route::Tokenize => 3,
            Route::Detokenize => 4,
            Route::Rerank => 5,
            Route::RerankV1 => 6,
            Route::RerankV2 => 7,
            Route::Score => 8,
            Route::ScoreV1 => 9,
            Route::Pooling => 10,
            Route::Classify => 11,
            Route::ChatBatch => 12,
            Route::Messages => 13,
            Route::CountTokens => 14,
            Route::Responses => 15,
            Route::Transcriptions => 16,
            Route::Translations => 17,
        }
    }

    pub fn path(self) -> &'static str {
        crate::config::ROUTE_PATHS[self.index()]
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Route::Chat => "chat",
            Route::Completions => "completions",
            Route::Embeddings => "embeddings",
            Route::Tokenize => "tokenize",
            Route::Detokenize => "detokenize",
            Route::Rerank | Route::RerankV1 | Route::RerankV2 => "rerank",
            Route::Score | Route::ScoreV1 => "score",
            Route::Pooling => "pooling",
            Route::Classify => "classify",
            Route::ChatBatch => "chat_batch",
            Route::Messages => "messages",
            Route::CountTokens => "count_tokens",
            Route::Responses => "responses",
            Route::Transcriptions => "transcriptions",
            Route::Translations => "translations",
        }
    }

    /// True for the routes that generate text: they may stream, are estimated with
    /// `max_tokens`, and can be cascaded.
    pub(crate) fn generates(self) -> bool {
        matches!(
            self,
            Route::Chat
                | Route::Completions
                | Route::ChatBatch
                | Route::Messages
                | Route::Responses
        )
    }

    /// False for the passed-through routes of other APIs: their streamed answers are not
    /// chat chunks, which is what the caches store and replay.
    pub(crate) fn cacheable(self) -> bool {
        !matches!(
            self,
            Route::Messages
                | Route::CountTokens
                | Route::Responses
                | Route::Transcriptions
                | Route::Translations
        )
    }

    /// True for the routes whose body is a multipart form (audio), not JSON.
    pub(crate) fn multipart(self) -> bool {
        matches!(self, Route::Transcriptions | Route::Translations)
    }

    /// True for the routes a cascade model may answer in turns (judged by its text).
    pub(crate) fn cascades(self) -> bool {
        matches!(self, Route::Chat | Route::Completions)
    }

    /// True for the routes whose answers carry no usage by design (tokenizer calls):
    /// they are charged no tokens (request limits still apply).
    pub(crate) fn free(self) -> bool {
        matches!(
            self,
            Route::Tokenize | Route::Detokenize | Route::CountTokens
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_has_its_own_path() {
        let indices: Vec<_> = Route::ALL.iter().map(|r| r.index()).collect();
        assert!(indices.windows(2).all(|w| w[0] < w[1]), "{indices:?}");
        let mut paths: Vec<_> = Route::ALL.iter().map(|r| r.path()).collect();
        paths.sort();
        paths.dedup();
        assert_eq!(paths.len(), Route::ALL.len());
    }
}
