//! OpenAI-compatible wire types, validation into typed values, OpenAI-shaped errors and SSE.
//!
//! `strata-api` sits at the bottom of Strata's dependency graph: the engine, the router and
//! the gateway all speak the same client API (see `docs/PROTOCOLS.md` §1), so its shapes live
//! here once. The crate does no I/O and has no async; it only turns bytes into checked
//! values and values into bytes:
//!
//! * [`error`]: [`ApiError`], the one error type every front answers with, serialized in
//!   OpenAI's `{"error": {"message", "type", "param", "code"}}` shape with its HTTP status.
//! * [`types`]: serde types for `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
//!   `/v1/embeddings`, `/tokenize` and `/detokenize`, their streaming chunks, usage and
//!   logprobs. Requests are lenient (unknown fields ignored), responses exact.
//! * [`validate`]: [`parse_json`] with field-level error reporting, then
//!   [`validate_chat`] / [`validate_completion`] into [`SamplingParams`] and friends, and
//!   [`check_context`] once the prompt is tokenized.
//! * [`sse`]: Server-Sent Events encoding for responses, an incremental decoder for
//!   reading upstream streams, and [`sse::StreamWatch`], which judges a passing stream.
//! * [`prometheus`]: the text exposition format and histogram arithmetic;
//!   [`model_server`]: engine kinds, their metric names (vLLM's defined once) and the one
//!   [`model_server::LoadSample`] every reader of `/metrics` makes.
//! * [`kv_events`], [`block_hash`]: vLLM's KV-event wire codec and prefix-cache hashes.
//! * [`stats`]: the one sample-percentile definition.
//! * [`anthropic`], [`responses`]: Anthropic's Messages API and OpenAI's Responses API
//!   (requests, answers, streamed events), which the gateway serves by translation.
//! * [`trace`]: W3C `traceparent` and the hook the binary's trace exporter plugs into.
//! * `http` (feature `http`): `IntoResponse for ApiError`, route fallbacks, the shutdown
//!   signal, shared by every HTTP front; `edge`, the HTTP server they all run; `tls`,
//!   rustls configurations for servers (reloaded with their files) and clients.

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
pub mod anthropic;
pub mod block_hash;
#[cfg(feature = "http")]
pub mod edge;
pub mod error;
#[cfg(feature = "http")]
pub mod http;
pub mod kv_events;
pub mod model_server;
pub mod prometheus;
pub mod responses;
pub mod sse;
pub mod stats;
#[cfg(feature = "http")]
pub mod tls;
pub mod trace;
pub mod types;
pub mod validate;

pub use error::{ApiError, ErrorDetail, ErrorKind, ErrorResponse};
pub use sse::{SseDecoder, SseError, SseEvent, StreamWatch};
pub use types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, CompletionChoice,
    CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, EmbeddingRequest, EmbeddingResponse, FinishReason, ModelCard, ModelList,
    Prompt, RequestMessage, ResponseMessage, Role, StopReason, TokenizeRequest, TokenizeResponse,
    TopLogprob, TopLogprobMap, Usage,
};
pub use validate::{
    check_context, parse_json, validate_chat, validate_completion, validate_tokenize, ChatMessage,
    PromptInput, SamplingParams, TokenizeInput, ValidatedChat, ValidatedCompletion,
    ValidatedTokenize, MAX_N, MAX_STOP, MAX_TOP_LOGPROBS,
};
