//! What the generation server's handlers share, and the checks every route makes against
//! it (which model a request names, whether its token ids are in the vocabulary).

use std::sync::{Arc, Mutex, MutexGuard};

use strata_api::ApiError;

use super::kv_state::KvState;
use crate::auth::Gate;
use crate::chat_template::ChatTemplate;
use crate::engine::EngineHandle;
use crate::generation_config::GenerationDefaults;
use crate::lora::{LoraAdapter, LoraRegistry};
use crate::metrics::EngineMetrics;
use crate::structured::GrammarCompiler;
use crate::tokenizer::Tokenizer;

/// What the handlers share.
pub struct AppState {
    pub model_name: String,
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub engine: EngineHandle,
    pub metrics: Arc<EngineMetrics>,
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub max_body_bytes: usize,
    pub created: u64,
    /// Structured-output compiler for this model's tokenizer; `None` when the tokenizer
    /// cannot back one (such requests are then refused).
    pub grammar: Option<Arc<GrammarCompiler>>,
    /// Sampling defaults for fields a request leaves out.
    pub generation_defaults: GenerationDefaults,
    /// The loaded LoRA adapters; `None` when LoRA is off.
    pub lora: Option<Mutex<LoraRegistry>>,
    /// Disaggregation role, transfer endpoint and tier.
    pub kv: KvState,
    /// The API and admin keys every route is checked against (`auth.rs`).
    pub gate: Arc<Gate>,
    /// `--enable-auto-tool-choice` and `--tool-call-parser`.
    pub tools: crate::options::ToolOptions,
}

impl AppState {
    /// The adapter registry, or the 400 that says LoRA is off.
    pub(super) fn lora_registry(&self) -> Result<MutexGuard<'_, LoraRegistry>, ApiError> {
        let Some(r) = &self.lora else {
            return Err(ApiError::invalid(
                "lora_name",
                "LoRA is not enabled on this engine; start it with --enable-lora.",
            ));
        };
        Ok(r.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// What a request's `model` names: the base model (`None`, or its name) or a loaded
    /// adapter; anything else is a 404 like vLLM's.
    pub(super) fn resolve_model(
        &self,
        model: Option<&str>,
    ) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
        match model {
            None => Ok(None),
            Some(m) if m == self.model_name => Ok(None),
            Some(m) => self
                .lora
                .as_ref()
                .and_then(|r| r.lock().unwrap_or_else(|e| e.into_inner()).get(m))
                .map(Some)
                .ok_or_else(|| ApiError::model_not_found(m)),
        }
    }

    /// A 404 unless `model` names the base model or a loaded adapter.
    pub(super) fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        self.resolve_model(model).map(|_| ())
    }

    /// A 400 naming `param` for the first id outside the vocabulary.
    pub(super) fn check_token_ids(&self, ids: &[u32], param: &str) -> Result<(), ApiError> {
        match ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            Some(bad) => Err(ApiError::invalid(
                param,
                format!(
                    "Token id {bad} is out of vocabulary (size {}).",
                    self.vocab_size
                ),
            )),
            None => Ok(()),
        }
    }
}
