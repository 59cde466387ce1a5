//! Serde types for the OpenAI-compatible wire format (plus vLLM's extensions).
//!
//! Requests are deliberately *loose*: every field a client may send is present, optional
//! where OpenAI or vLLM treat it as optional, and numbers keep the widest JSON type
//! (`f64`, `i64`) so that an out-of-range value reaches [`crate::validate`] and earns a
//! precise "`top_k` must be ..." message instead of a generic type error. Unknown fields are
//! ignored (no `deny_unknown_fields`), because clients routinely send fields from newer API
//! versions. Turning a request into checked values is `validate`'s job, not these types'.
//!
//! Responses are *exact*: they serialize `null` where OpenAI's clients expect a present-but-
//! null field (`logprobs`, `finish_reason` in non-final chunks, `content` of an assistant
//! message, `param`/`code` of errors) and omit fields that OpenAI omits (`usage` in
//! streaming chunks unless it is the usage chunk). Responses also derive `Deserialize` so
//! the router and benchmarks can parse what an upstream server sends.
//!
//! One file per endpoint family: [`chat`], [`completion`], [`embeddings`], [`models`],
//! [`tokenize`]; shapes shared by several live in [`common`] and [`logprobs`], and the
//! sampling fields that chat and completion requests share are declared once, in
//! `sampling`.

pub mod chat;
pub mod common;
pub mod completion;
pub mod embeddings;
pub mod logprobs;
pub mod models;
pub(crate) mod sampling;
pub mod tokenize;

pub use chat::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ContentPart, MessageContent, RequestMessage,
    ResponseMessage, Role,
};
pub use common::{
    FinishReason, KvTransferParams, Prompt, PromptTokensDetails, ResponseFormat, Stop, StopReason,
    StreamOptions, Usage,
};
pub use completion::{CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse};
pub use embeddings::{
    EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, EmbeddingVector,
    EncodingFormat,
};
pub use logprobs::{
    finite_logprob, ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob, TopLogprobMap,
    LOGPROB_FLOOR,
};
pub use models::{ModelCard, ModelList};
pub use tokenize::{DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse};

/// `object` of a non-streaming chat completion.
pub const OBJECT_CHAT_COMPLETION: &str = "chat.completion";
/// `object` of a streaming chat completion chunk.
pub const OBJECT_CHAT_COMPLETION_CHUNK: &str = "chat.completion.chunk";
/// `object` of a legacy completion, streaming or not (OpenAI uses one name for both).
pub const OBJECT_TEXT_COMPLETION: &str = "text_completion";
/// `object` of list envelopes (`/v1/models`, `/v1/embeddings`).
pub const OBJECT_LIST: &str = "list";
/// `object` of a model card.
pub const OBJECT_MODEL: &str = "model";
/// `object` of one embedding.
pub const OBJECT_EMBEDDING: &str = "embedding";
