//! Strata's engine: serves GGUF models (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3
//! architectures; [`model::arch`]) through the OpenAI-compatible API.
//!
//! The request path inside one process: [`server`] validates and tokenizes, [`engine`]
//! runs the step loop on its own thread ([`planner`] plans each step, [`model`] runs one
//! batched forward over the paged [`kv`] cache, [`sampler`] and [`stop`] finish each token),
//! and each sequence's events flow back to its handler. See `docs/ARCHITECTURE.md`.

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
pub mod attention;
pub mod auth;
pub mod chat_template;
pub mod cli;
pub mod embed;
pub mod engine;
pub mod generation_config;
pub mod gguf;
pub mod kernels;
pub mod kv;
pub mod kv_events;
pub mod lora;
pub mod metrics;
pub mod model;
pub mod model_cache;
pub mod options;
pub mod planner;
pub mod prefetch;
pub mod reasoning;
pub mod sampler;
pub mod sequence;
pub mod serve;
pub mod server;
pub mod spec_decode;
pub mod stop;
pub mod structured;
pub mod tokenizer;
pub mod tools;
