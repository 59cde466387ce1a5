//! `POST /v1/completions`: a text prompt tokenized (or token ids checked against the
//! vocabulary), then the generation core; answers as `text_completion` objects, whole or
//! in chunks, with logprobs' text offsets counted from the start of the answer.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;
use strata_api::sse;
use strata_api::types::{
    CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse,
    KvTransferParams, TopLogprobMap, Usage,
};
use strata_api::validate::{check_context, parse_json, validate_completion, PromptInput};
use strata_api::ApiError;

use super::generate::{
    api_finish, generate, stop_reason, token_text, AnswerHead, AnswerShape, Collected, Generation,
    Received,
};
use super::http::{json_response, read_body, ApiResult};
use super::spans::trace_span;
use super::state::AppState;
use super::submit::check_sampling_ids;
use crate::sequence::{FinishReason, TokenLogprob};
use crate::tokenizer::Tokenizer;

const ROUTE: &str = "/v1/completions";

/// `max_tokens` when a request sends none (OpenAI's default for this route).
const DEFAULT_MAX_TOKENS: u32 = 16;

pub(super) async fn completions(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let span = trace_span(req.headers(), ROUTE);
    let (headers, body) = read_body(&state, req).await?;
    let mut parsed: CompletionRequest = parse_json(&body)?;
    state.generation_defaults.apply_completion(&mut parsed);
    let kv_params = parsed.kv_transfer_params.take();
    let c = validate_completion(parsed)?;
    let lora = state.resolve_model(c.model.as_deref())?;
    check_sampling_ids(&state, &c.sampling)?;
    let prompt = match &c.prompt {
        PromptInput::Text(t) => state
            .tokenizer
            .encode(t, c.add_special_tokens, false)
            .map_err(|e| ApiError::invalid("prompt", format!("Cannot tokenize: {e}")))?,
        PromptInput::Tokens(ids) => {
            state.check_token_ids(ids, "prompt")?;
            ids.clone()
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "The prompt is empty after tokenization.").into());
    }
    let max_tokens = check_context(
        prompt.len(),
        c.sampling.max_tokens.or(Some(DEFAULT_MAX_TOKENS)),
        state.max_model_len,
        "prompt",
    )?;
    let echo_text = if c.echo {
        match &c.prompt {
            PromptInput::Text(t) => t.clone(),
            PromptInput::Tokens(ids) => state.tokenizer.decode(ids, false).unwrap_or_default(),
        }
    } else {
        String::new()
    };
    let shape = CompletionShape {
        offsets: vec![echo_text.len(); c.sampling.n as usize],
        echo_text,
    };
    let generation = Generation {
        route: ROUTE,
        id_prefix: "cmpl",
        prompt,
        max_tokens: max_tokens as usize,
        sampling: c.sampling,
        lora,
        stream: c.stream,
        include_usage: c.include_usage,
        kv_params,
        tool_grammar: None,
    };
    let received = Received {
        span,
        headers,
        body,
    };
    generate(&state, received, generation, shape).await
}

/// Completions' answer shapes: the echoed prompt then the text, and chunks of text whose
/// logprob offsets run on from what each choice has sent.
struct CompletionShape {
    echo_text: String,
    /// Per choice: where the next token's text starts in the answer.
    offsets: Vec<usize>,
}

impl CompletionShape {
    fn chunk(head: &AnswerHead, choice: CompletionChoice) -> String {
        sse::encode_json(&CompletionChunk::new(
            head.id.clone(),
            head.created,
            head.model.clone(),
            vec![choice],
        ))
        .unwrap_or_default()
    }
}

impl AnswerShape for CompletionShape {
    fn answer(
        &self,
        head: &AnswerHead,
        collected: &[Collected],
        usage: Usage,
        kv: Option<KvTransferParams>,
    ) -> Response {
        let choices = collected
            .iter()
            .enumerate()
            .map(|(i, col)| CompletionChoice {
                index: i as u32,
                text: format!("{}{}", self.echo_text, col.text),
                logprobs: head.logprobs.then(|| {
                    completion_logprobs(
                        &head.tokenizer,
                        &col.tokens,
                        &col.logprobs,
                        self.echo_text.len(),
                    )
                }),
                finish_reason: col.finish.as_ref().map(api_finish),
                stop_reason: stop_reason(&col.stop),
            })
            .collect();
        let mut resp = CompletionResponse::new(
            head.id.clone(),
            head.created,
            head.model.clone(),
            choices,
            usage,
        );
        resp.kv_transfer_params = kv;
        json_response(&resp)
    }

    fn opening(&mut self, head: &AnswerHead, choice: usize) -> Option<String> {
        (!self.echo_text.is_empty()).then(|| {
            Self::chunk(
                head,
                CompletionChoice {
                    index: choice as u32,
                    text: self.echo_text.clone(),
                    logprobs: None,
                    finish_reason: None,
                    stop_reason: None,
                },
            )
        })
    }

    fn token(
        &mut self,
        head: &AnswerHead,
        choice: usize,
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    ) -> String {
        let offset = &mut self.offsets[choice];
        let logprobs =
            logprob.map(|lp| completion_logprobs(&head.tokenizer, &[token], &[lp], *offset));
        *offset += text.len();
        Self::chunk(
            head,
            CompletionChoice {
                index: choice as u32,
                text,
                logprobs,
                finish_reason: None,
                stop_reason: None,
            },
        )
    }

    fn finish(
        &mut self,
        head: &AnswerHead,
        choice: usize,
        text: String,
        reason: &FinishReason,
        stop: Option<String>,
    ) -> String {
        Self::chunk(
            head,
            CompletionChoice {
                index: choice as u32,
                text,
                logprobs: None,
                finish_reason: Some(api_finish(reason)),
                stop_reason: stop_reason(&stop),
            },
        )
    }

    fn usage(&self, head: &AnswerHead, usage: Usage) -> String {
        sse::encode_json(&CompletionChunk::usage_only(
            head.id.clone(),
            head.created,
            head.model.clone(),
            usage,
        ))
        .unwrap_or_default()
    }
}

/// Completions' logprobs: parallel lists of tokens, logprobs, top alternatives and each
/// token's offset in the answer text, starting at `offset`.
fn completion_logprobs(
    tok: &Tokenizer,
    tokens: &[u32],
    lps: &[TokenLogprob],
    offset: usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut at = offset;
    for (&id, lp) in tokens.iter().zip(lps) {
        let text = token_text(tok, id);
        out.text_offset.push(at as u32);
        at += text.len();
        out.tokens.push(text);
        out.token_logprobs
            .push(Some(strata_api::types::finite_logprob(lp.logprob)));
        out.top_logprobs.push(Some(TopLogprobMap(
            lp.top
                .iter()
                .map(|&(t, l)| (token_text(tok, t), strata_api::types::finite_logprob(l)))
                .collect(),
        )));
    }
    out
}
