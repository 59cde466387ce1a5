//! The context-length check, done after tokenization (only then is the prompt length
//! known). Messages follow vLLM's so that clients which parse them (to retry with a shorter
//! prompt or a smaller `max_tokens`) keep working.

use crate::error::ApiError;

/// Checks that the prompt leaves room in the context and returns the effective
/// `max_tokens`.
///
/// * `prompt_tokens >= context_len`: 400 naming `prompt_param` (`"messages"` for chat,
///   `"prompt"` for completions): at least one token must remain for the output.
/// * `prompt_tokens + max_tokens > context_len`: 400 naming `max_tokens`.
/// * `max_tokens == None`: the rest of the context, `context_len - prompt_tokens`
///   (saturated to `u32::MAX`).
pub fn check_context(
    prompt_tokens: usize,
    max_tokens: Option<u32>,
    context_len: usize,
    prompt_param: &str,
) -> Result<u32, ApiError> {
    let what = if prompt_param == "messages" {
        "messages"
    } else {
        "prompt"
    };
    if prompt_tokens >= context_len {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "This model's maximum context length is {context_len} tokens. However, your \
                 request has {prompt_tokens} input tokens, which leaves no room for the \
                 completion. Please reduce the length of the {what}."
            ),
        ));
    }
    let room = context_len - prompt_tokens;
    match max_tokens {
        None => Ok(u32::try_from(room).unwrap_or(u32::MAX)),
        Some(max) if (max as usize) <= room => Ok(max),
        Some(max) => Err(ApiError::invalid(
            "max_tokens",
            format!(
                "This model's maximum context length is {context_len} tokens. However, you \
                 requested {} tokens ({prompt_tokens} in the {what}, {max} in the \
                 completion). Please reduce the length of the {what} or completion.",
                prompt_tokens.saturating_add(max as usize)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remaining_context_when_unset() {
        assert_eq!(check_context(100, None, 4096, "messages").unwrap(), 3996);
    }

    #[test]
    fn exact_fit_is_allowed() {
        assert_eq!(check_context(4000, Some(96), 4096, "prompt").unwrap(), 96);
    }

    #[test]
    fn one_over_is_rejected_with_vllm_message() {
        let err = check_context(4000, Some(97), 4096, "messages").unwrap_err();
        assert_eq!(err.status, 400);
        assert_eq!(err.param.as_deref(), Some("max_tokens"));
        assert_eq!(
            err.message,
            "This model's maximum context length is 4096 tokens. However, you requested 4097 \
             tokens (4000 in the messages, 97 in the completion). Please reduce the length of \
             the messages or completion."
        );
    }

    #[test]
    fn prompt_filling_context_is_rejected() {
        for prompt in [4096, 5000] {
            let err = check_context(prompt, None, 4096, "prompt").unwrap_err();
            assert_eq!(err.param.as_deref(), Some("prompt"));
            assert!(err.message.contains("maximum context length is 4096"));
            assert!(err.message.contains(&format!("{prompt} input tokens")));
        }
        let err = check_context(10, Some(1), 10, "messages").unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages"));
    }

    #[test]
    fn huge_context_saturates() {
        let big = u32::MAX as usize + 10;
        assert_eq!(check_context(1, None, big, "prompt").unwrap(), u32::MAX);
        assert_eq!(
            check_context(1, Some(u32::MAX), big, "prompt").unwrap(),
            u32::MAX
        );
    }
}
