//! Submitting a validated job to the engine thread: one [`GenerationRequest`] per choice,
//! each with its own random stream and compiled grammar, or nothing at all.

use std::sync::Arc;
use std::time::Instant;

use strata_api::validate::{SamplingParams, StructuredOutput};
use strata_api::ApiError;
use tokio::sync::mpsc::{self, UnboundedReceiver};

use super::state::AppState;
use crate::engine::SubmitError;
use crate::kv::transfer::BlockData;
use crate::lora::LoraAdapter;
use crate::sampler::SamplingConfig;
use crate::sequence::{GenerationRequest, SeqEvent};
use crate::structured::GrammarState;

/// A validated generation, ready to submit: one sequence per choice.
pub(super) struct Job {
    pub id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// The adapter `model` named; `None` for the base model.
    pub lora: Option<Arc<LoraAdapter>>,
    /// Prefill for a remote decoder: the pin its blocks are kept under.
    pub pin: Option<String>,
    /// The lark grammar that enforces tool calls (`tool_choice` required or named).
    pub tool_grammar: Option<String>,
}

/// The request's stop token ids and `logit_bias` keys, checked against the vocabulary.
pub(super) fn check_sampling_ids(state: &AppState, p: &SamplingParams) -> Result<(), ApiError> {
    state.check_token_ids(&p.stop_token_ids, "stop_token_ids")?;
    let bias_ids: Vec<u32> = p.logit_bias.iter().map(|(t, _)| *t).collect();
    state.check_token_ids(&bias_ids, "logit_bias")
}

/// Submits every choice; on failure nothing stays queued (dropping the receivers aborts
/// any that were accepted).
///
/// `imported` (blocks fetched from a peer or the tier) ride with the first choice: the
/// others find them cached once it is admitted.
pub(super) fn submit(
    state: &AppState,
    job: &Job,
    mut imported: Vec<BlockData>,
) -> Result<Vec<UnboundedReceiver<SeqEvent>>, ApiError> {
    // Compile every choice's grammar before queueing anything, so a schema that cannot be
    // enforced is a 400 with nothing submitted.
    let mut grammars = Vec::new();
    if let Some(lark) = &job.tool_grammar {
        for _ in 0..job.sampling.n {
            grammars.push(Box::new(compile_tool_grammar(state, lark)?));
        }
    } else if let Some(constraint) = &job.sampling.structured {
        for _ in 0..job.sampling.n {
            grammars.push(Box::new(compile_constraint(state, constraint)?));
        }
    }
    let mut grammars = grammars.into_iter();
    let mut receivers = Vec::with_capacity(job.sampling.n as usize);
    for i in 0..job.sampling.n {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut sampling = sampling_config(&job.sampling);
        // Each choice gets its own stream of randomness, reproducible under a seed.
        sampling.seed = job.sampling.seed.map(|s| s.wrapping_add(i as u64));
        let req = GenerationRequest {
            request_id: format!("{}-{i}", job.id),
            prompt: job.prompt.clone(),
            sampling,
            max_tokens: job.max_tokens,
            stop: job.sampling.stop.clone(),
            include_stop_str_in_output: job.sampling.include_stop_str_in_output,
            skip_special_tokens: job.sampling.skip_special_tokens,
            priority: job.sampling.priority,
            cache_salt: job.sampling.cache_salt.clone(),
            arrival: Instant::now(),
            events: tx,
            grammar: grammars.next(),
            speculative: job.sampling.speculative,
            lora: job.lora.clone(),
            imported: std::mem::take(&mut imported),
            pin: job.pin.clone(),
        };
        state.engine.submit(req).map_err(|e| match e {
            SubmitError::QueueFull(_) => ApiError::rate_limited(
                "The server is overloaded: too many requests are waiting. Retry later.",
            ),
            SubmitError::ShuttingDown => ApiError::unavailable("The server is shutting down."),
        })?;
        receivers.push(rx);
    }
    state
        .metrics
        .record_params(job.sampling.n as usize, job.max_tokens);
    Ok(receivers)
}

/// A request's structured-output constraint, compiled for this model; what cannot be
/// enforced is a 400 naming it.
fn compile_constraint(
    state: &AppState,
    constraint: &StructuredOutput,
) -> Result<GrammarState, ApiError> {
    let param = match constraint {
        StructuredOutput::JsonObject | StructuredOutput::JsonSchema { .. } => "response_format",
        StructuredOutput::Regex(_) => "guided_regex",
        StructuredOutput::Choice(_) => "guided_choice",
    };
    let Some(compiler) = &state.grammar else {
        return Err(ApiError::invalid(
            param,
            "Structured outputs are not available for this model's tokenizer.",
        ));
    };
    compiler
        .compile(constraint)
        .map_err(|e| ApiError::invalid(param, format!("This constraint cannot be enforced: {e}")))
}

/// A tool-call grammar, compiled for this model; one that cannot be enforced (a schema
/// llguidance refuses) is a 400 on `tools`.
fn compile_tool_grammar(state: &AppState, lark: &str) -> Result<GrammarState, ApiError> {
    let Some(compiler) = &state.grammar else {
        return Err(ApiError::invalid(
            "tool_choice",
            "Enforced tool calls are not available for this model's tokenizer.",
        ));
    };
    compiler
        .compile_lark(lark)
        .map_err(|e| ApiError::invalid("tools", format!("The tool calls cannot be enforced: {e}")))
}

fn sampling_config(p: &SamplingParams) -> SamplingConfig {
    SamplingConfig {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        logprobs: p.logprobs,
        ignore_eos: p.ignore_eos,
        min_tokens: p.min_tokens,
        stop_token_ids: p.stop_token_ids.clone(),
        logit_bias: p.logit_bias.clone(),
    }
}
