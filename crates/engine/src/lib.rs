//! Strata's engine: serves Llama-family GGUF models through the OpenAI-compatible API.
//!
//! The request path inside one process: [`server`] validates and tokenizes, [`engine`]
//! runs the step loop on its own thread ([`scheduler`] plans each step, [`model`] runs one
//! batched forward over the paged [`kv`] cache, [`sampler`] and [`stop`] finish each token),
//! and each sequence's events flow back to its handler. See `docs/ARCHITECTURE.md`.

pub mod attention;
pub mod chat_template;
pub mod engine;
pub mod gguf;
pub mod kernels;
pub mod kv;
pub mod kv_events;
pub mod metrics;
pub mod model;
pub mod model_cache;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod server;
pub mod stop;
pub mod tokenizer;
