//! Turning parsed requests into typed, checked values.
//!
//! Following TGI's router, requests are validated once, at the edge, into types that
//! cannot hold a bad value ([`SamplingParams`], [`ValidatedChat`], [`ValidatedCompletion`]);
//! everything after this point trusts them. Every rejection is an [`ApiError`] 400 whose
//! `param` names the field at fault (`top_p`, `messages[2].role`, ...), so a client can
//! tell what to fix without reading server logs.
//!
//! The flow for an HTTP handler is:
//!
//! 1. [`parse_json`] the body into a request type from [`crate::types`];
//! 2. [`validate_chat`] / [`validate_completion`] / [`validate_tokenize`];
//! 3. tokenize (outside this crate), then [`check_context`] for the effective `max_tokens`.
//!
//! What is *not* checked here, because it needs the model: whether the model name is
//! served, token ids against the vocabulary, and the context length.
//!
//! [`ApiError`]: crate::error::ApiError

mod chat;
mod completion;
mod context;
mod embeddings;
mod json;
mod sampling;
mod shared;
mod structured;

pub use chat::{
    validate_chat, validate_messages, validate_tokenize, ChatMessage, TokenizeInput, ValidatedChat,
    ValidatedTokenize,
};
pub use completion::{validate_completion, PromptInput, ValidatedCompletion};
pub use context::check_context;
pub use embeddings::{
    validate_embeddings, EmbeddingInput, Truncation, ValidatedEmbeddings, MAX_EMBEDDING_INPUTS,
};
pub use json::parse_json;
pub use sampling::{SamplingParams, MAX_LOGIT_BIAS, MAX_N, MAX_STOP, MAX_TOP_LOGPROBS};
pub use structured::{
    StructuredOutput, MAX_CHOICES, MAX_CHOICE_BYTES, MAX_REGEX_BYTES, MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
};
