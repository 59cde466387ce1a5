//! Legacy completion requests into typed values.

use super::chat::stream_flags;
use super::sampling::{completion_logprobs, RawSampling, SamplingParams};
use super::structured::{structured_output, GuidedFields};
use crate::error::ApiError;
use crate::types::{CompletionRequest, Prompt};

/// A single checked prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Text to tokenize (non-empty).
    Text(String),
    /// Token ids, used as they are (non-empty). The engine checks them against its
    /// vocabulary.
    Tokens(Vec<u32>),
}

/// A checked `/v1/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedCompletion {
    /// Requested model; `None` means "the default model".
    pub model: Option<String>,
    /// The one prompt.
    pub prompt: PromptInput,
    /// Sampling and output controls (`logprobs` from the integer `logprobs` field).
    pub sampling: SamplingParams,
    /// Stream Server-Sent Events.
    pub stream: bool,
    /// Streaming only: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Streaming only: put running usage in every chunk.
    pub continuous_usage_stats: bool,
    /// Return the prompt in front of the completion. Default false.
    pub echo: bool,
    /// Add BOS etc. when tokenizing a text prompt. Default true.
    pub add_special_tokens: bool,
    /// End-user id, for logs.
    pub user: Option<String>,
}

/// Checks a completion request: exactly one non-empty prompt, sampling, streaming flags and
/// unsupported features (`suffix`, `best_of` other than `n`), and any structured-output
/// constraint.
pub fn validate_completion(req: CompletionRequest) -> Result<ValidatedCompletion, ApiError> {
    let prompt = single_prompt(req.prompt)?;
    let stream = req.stream.unwrap_or(false);
    let (include_usage, continuous_usage_stats) =
        stream_flags(stream, req.stream_options.as_ref())?;
    let structured = structured_output(
        req.response_format.as_ref(),
        GuidedFields {
            guided_json: req.guided_json,
            guided_regex: req.guided_regex,
            guided_choice: req.guided_choice,
            guided_grammar: req.guided_grammar,
            structured_outputs: req.structured_outputs,
        },
    )?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported."));
    }

    let mut sampling = RawSampling {
        temperature: req.temperature,
        top_p: req.top_p,
        n: req.n,
        stop: req.stop,
        max_tokens: req.max_tokens,
        max_completion_tokens: req.max_completion_tokens,
        seed: req.seed,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        logit_bias: req.logit_bias,
        top_k: req.top_k,
        min_p: req.min_p,
        repetition_penalty: req.repetition_penalty,
        stop_token_ids: req.stop_token_ids,
        include_stop_str_in_output: req.include_stop_str_in_output,
        ignore_eos: req.ignore_eos,
        min_tokens: req.min_tokens,
        skip_special_tokens: req.skip_special_tokens,
        spaces_between_special_tokens: req.spaces_between_special_tokens,
        priority: req.priority,
        cache_salt: req.cache_salt,
        logprobs: completion_logprobs(req.logprobs)?,
    }
    .validate()?;
    sampling.structured = structured;
    sampling.speculative = req.speculative.unwrap_or(true);

    if let Some(best_of) = req.best_of {
        if best_of != i64::from(sampling.n) {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "best_of is not supported; omit it or set it equal to n ({}).",
                    sampling.n
                ),
            ));
        }
    }

    Ok(ValidatedCompletion {
        model: req.model,
        prompt,
        sampling,
        stream,
        include_usage,
        continuous_usage_stats,
        echo: req.echo.unwrap_or(false),
        add_special_tokens: req.add_special_tokens.unwrap_or(true),
        user: req.user,
    })
}

/// Reduces the four prompt forms to one checked prompt.
fn single_prompt(prompt: Prompt) -> Result<PromptInput, ApiError> {
    let batch_error = |count: usize| {
        ApiError::invalid(
            "prompt",
            format!("Batch prompts are not supported; send one prompt per request (got {count})."),
        )
    };
    let input = match prompt {
        Prompt::Text(text) => PromptInput::Text(text),
        Prompt::Tokens(ids) => PromptInput::Tokens(token_ids(ids)?),
        Prompt::TextBatch(mut texts) => match texts.len() {
            1 => PromptInput::Text(texts.swap_remove(0)),
            0 => PromptInput::Text(String::new()),
            n => return Err(batch_error(n)),
        },
        Prompt::TokenBatch(mut lists) => match lists.len() {
            1 => PromptInput::Tokens(token_ids(lists.swap_remove(0))?),
            0 => PromptInput::Tokens(Vec::new()),
            n => return Err(batch_error(n)),
        },
    };
    let empty = match &input {
        PromptInput::Text(t) => t.is_empty(),
        PromptInput::Tokens(t) => t.is_empty(),
    };
    if empty {
        return Err(ApiError::invalid("prompt", "prompt must not be empty."));
    }
    Ok(input)
}

fn token_ids(ids: Vec<i64>) -> Result<Vec<u32>, ApiError> {
    ids.into_iter()
        .map(|id| {
            u32::try_from(id).map_err(|_| {
                ApiError::invalid(
                    "prompt",
                    format!("prompt contains {id}, which is not a valid token id."),
                )
            })
        })
        .collect()
}
