//! LoRA adapters for the llama model (PROTOCOLS §8): PEFT adapters read and checked
//! against the base model, the per-row low-rank update, and the registry behind
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
//!
//! Not yet wired into [`crate::model::Llama::forward`] or the server: [`apply_rows`] is the
//! piece the forward calls after each targeted projection, with one adapter (or none) per
//! row of the step, so one batch can mix adapters and the base model.
//!
//! - [`adapter`]: `adapter_config.json` + `adapter_model.safetensors` into f32 `A`/`B`
//!   pairs per (layer, module), every shape checked; `scale · B(A x)`; the merged
//!   `W + scale·B·A` used as the reference in tests.
//! - [`registry`]: which adapters are loaded, vLLM's request shapes and errors.

pub mod adapter;
pub mod registry;

pub use adapter::{apply_rows, LoraAdapter, LoraError, Module};
pub use registry::{LoadLoraRequest, LoraRegistry, UnloadLoraRequest};
