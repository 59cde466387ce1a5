//! The checks of the fields chat and completions share ([`SamplingFields`]), written once.
//!
//! They run in two stages with each endpoint's own checks between them, in the order the
//! endpoints have always checked their fields: a request with several faults is still told
//! about the same one first.

use super::sampling::{sampling_params, SamplingParams};
use super::structured::{structured_output, StructuredOutput};
use crate::error::ApiError;
use crate::types::sampling::SamplingFields;
use crate::types::StreamOptions;

/// The shared fields after the first stage; [`SharedChecks::sampling`] finishes them.
#[derive(Debug)]
pub(crate) struct SharedChecks {
    fields: SamplingFields,
    stream: bool,
    include_usage: bool,
    continuous_usage_stats: bool,
    structured: Option<StructuredOutput>,
}

/// The shared fields, checked.
#[derive(Debug)]
pub(crate) struct CheckedShared {
    /// Sampling and output controls, structured output and `speculative` included.
    pub sampling: SamplingParams,
    /// Stream Server-Sent Events.
    pub stream: bool,
    /// Streaming only: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Streaming only: put running usage in every chunk.
    pub continuous_usage_stats: bool,
    /// End-user id, for logs.
    pub user: Option<String>,
}

impl SharedChecks {
    /// First stage: `stream` and `stream_options`, then the structured-output constraint
    /// (`response_format`, `guided_*`, `structured_outputs`).
    pub(crate) fn output(mut fields: SamplingFields) -> Result<SharedChecks, ApiError> {
        let stream = fields.stream.unwrap_or(false);
        let (include_usage, continuous_usage_stats) =
            stream_flags(stream, fields.stream_options.as_ref())?;
        let structured = structured_output(&mut fields)?;
        Ok(SharedChecks {
            fields,
            stream,
            include_usage,
            continuous_usage_stats,
            structured,
        })
    }

    /// Second stage: every sampling range and default. `logprobs` comes resolved, since the
    /// two endpoints spell it differently.
    pub(crate) fn sampling(mut self, logprobs: Option<u32>) -> Result<CheckedShared, ApiError> {
        let user = self.fields.user.take();
        Ok(CheckedShared {
            sampling: sampling_params(self.fields, logprobs, self.structured)?,
            stream: self.stream,
            include_usage: self.include_usage,
            continuous_usage_stats: self.continuous_usage_stats,
            user,
        })
    }
}

/// `stream_options` is only allowed with `stream: true` (OpenAI rejects it otherwise).
fn stream_flags(stream: bool, options: Option<&StreamOptions>) -> Result<(bool, bool), ApiError> {
    match options {
        None => Ok((false, false)),
        Some(_) if !stream => Err(ApiError::invalid(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        )),
        Some(o) => Ok((
            o.include_usage.unwrap_or(false),
            o.continuous_usage_stats.unwrap_or(false),
        )),
    }
}
