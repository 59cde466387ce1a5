//! Legacy completion requests into typed values.

use super::sampling::{completion_logprobs, SamplingParams};
use super::shared::SharedChecks;
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
pub fn validate_completion(mut req: CompletionRequest) -> Result<ValidatedCompletion, ApiError> {
    let fields = req.take_sampling_fields();
    let prompt = single_prompt(req.prompt)?;
    let shared = SharedChecks::output(fields)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported."));
    }
    let shared = shared.sampling(completion_logprobs(req.logprobs)?)?;

    if let Some(best_of) = req.best_of {
        if best_of != i64::from(shared.sampling.n) {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "best_of is not supported; omit it or set it equal to n ({}).",
                    shared.sampling.n
                ),
            ));
        }
    }

    Ok(ValidatedCompletion {
        model: req.model,
        prompt,
        sampling: shared.sampling,
        stream: shared.stream,
        include_usage: shared.include_usage,
        continuous_usage_stats: shared.continuous_usage_stats,
        echo: req.echo.unwrap_or(false),
        add_special_tokens: req.add_special_tokens.unwrap_or(true),
        user: shared.user,
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
