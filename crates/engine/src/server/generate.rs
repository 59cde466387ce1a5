//! The generation core both routes share: a route shapes its request into a
//! [`Generation`] (the prompt, its limits, its sampling), then [`generate`] runs the same
//! steps for both:
//!
//! 1. name the job (`x-request-id` or a random id, under the route's prefix);
//! 2. prepare its KV: check `kv_transfer_params` and fetch what blocks it can
//!    ([`super::disagg`]);
//! 3. submit one sequence per choice ([`submit`]);
//! 4. answer: collect every choice and let the route shape the whole answer, or stream the
//!    events and let the route shape each chunk.
//!
//! What differs between the routes past step 1 is only the shape of the answer, the
//! [`AnswerShape`] a route passes in.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::Response;
use strata_api::types::{FinishReason as ApiFinish, KvTransferParams, StopReason, Usage};
use strata_api::validate::SamplingParams;
use strata_api::ApiError;
use tokio::sync::mpsc::UnboundedReceiver;

use super::disagg;
use super::http::{random_id, request_id, unix_now, ApiResult};
use super::spans::trace_phases;
use super::state::AppState;
use super::stream::sse_response;
use super::submit::{submit, Job};
use crate::kv::transfer::BlockData;
use crate::lora::LoraAdapter;
use crate::sequence::{FinishReason, SeqEvent, SeqTimes, TokenLogprob};
use crate::tokenizer::Tokenizer;

/// A generation request as its route shaped it, ready for the core.
pub(super) struct Generation {
    /// The route's path (phase 1 of a remote prefill posts to the same one).
    pub route: &'static str,
    /// The id prefix of the route's answers (`chatcmpl`, `cmpl`).
    pub id_prefix: &'static str,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// The adapter `model` named; `None` for the base model.
    pub lora: Option<Arc<LoraAdapter>>,
    pub stream: bool,
    /// Streams only: end with a usage chunk.
    pub include_usage: bool,
    pub kv_params: Option<KvTransferParams>,
    /// The lark grammar that enforces tool calls, if the request requires them.
    pub tool_grammar: Option<String>,
}

/// The request as it arrived: its span, and the headers and body a phase-1 call forwards.
pub(super) struct Received {
    pub span: tracing::Span,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// What every chunk and answer of a request repeats.
pub(super) struct AnswerHead {
    pub id: String,
    pub created: u64,
    /// What was asked for: the adapter, or the base model.
    pub model: String,
    /// Whether the request asked for logprobs.
    pub logprobs: bool,
    pub tokenizer: Arc<Tokenizer>,
}

/// How a route answers: the whole answer at once, or chunk by chunk.
pub(super) trait AnswerShape: Send + 'static {
    /// The answer of a request that did not stream; `kv` is the prefill answer's
    /// `kv_transfer_params`.
    fn answer(
        &self,
        head: &AnswerHead,
        collected: &[Collected],
        usage: Usage,
        kv: Option<KvTransferParams>,
    ) -> Response;

    /// The chunk a choice's stream opens with, before its first event, if any.
    fn opening(&mut self, head: &AnswerHead, choice: usize) -> Option<String>;

    /// A token's chunk; called only when there is text or a logprob to send (`logprob`
    /// only when the request asked for logprobs). `""` sends nothing.
    fn token(
        &mut self,
        head: &AnswerHead,
        choice: usize,
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    ) -> String;

    /// A choice's last chunk: the text held back until the end, and why it ended.
    fn finish(
        &mut self,
        head: &AnswerHead,
        choice: usize,
        text: String,
        reason: &FinishReason,
        stop: Option<String>,
    ) -> String;

    /// The usage chunk before `[DONE]` (`stream_options.include_usage`).
    fn usage(&self, head: &AnswerHead, usage: Usage) -> String;
}

/// Runs a shaped request: names it, prepares its KV, submits it and answers in `shape`.
pub(super) async fn generate(
    state: &AppState,
    received: Received,
    generation: Generation,
    shape: impl AnswerShape,
) -> ApiResult {
    let Received {
        span,
        headers,
        body,
    } = received;
    let mut job = Job {
        id: request_id(&headers)
            .map(|r| format!("{}-{r}", generation.id_prefix))
            .unwrap_or_else(|| random_id(generation.id_prefix)),
        prompt: generation.prompt,
        max_tokens: generation.max_tokens,
        sampling: generation.sampling,
        lora: generation.lora,
        pin: None,
        tool_grammar: generation.tool_grammar,
    };
    let imported = prepare_kv(
        state,
        &mut job,
        generation.kv_params.as_ref(),
        &headers,
        generation.stream,
        generation.route,
        &body,
    )
    .await?;
    let receivers = submit(state, &job, imported)?;
    let head = AnswerHead {
        id: job.id.clone(),
        created: unix_now(),
        model: served_name(state, &job),
        logprobs: job.sampling.logprobs.is_some(),
        tokenizer: state.tokenizer.clone(),
    };
    if !generation.stream {
        let collected = collect_all(&span, receivers).await?;
        let usage = usage_of(&collected);
        let kv = prefill_answer(state, &job, &collected);
        return Ok(shape.answer(&head, &collected, usage, kv));
    }
    Ok(stream_answer(
        span,
        head,
        receivers,
        generation.include_usage,
        shape,
    ))
}

/// Checks the request's `kv_transfer_params` / `x-prefiller-host-port` (a 400 for what
/// this engine cannot honour), then fetches what it can of the prompt's KV: from the
/// prefill engine named, or from the tier. Sets the job's pin for a remote decoder.
async fn prepare_kv(
    state: &AppState,
    job: &mut Job,
    params: Option<&KvTransferParams>,
    headers: &HeaderMap,
    stream: bool,
    path: &str,
    body: &Bytes,
) -> Result<Vec<BlockData>, ApiError> {
    let plan = disagg::plan(state, params, headers, stream, job.sampling.n, &job.id)?;
    let prompt = disagg::PromptRef {
        tokens: &job.prompt,
        salt: job.sampling.cache_salt.as_deref(),
        lora: job.lora.as_ref().map(|a| a.name.as_str()),
        path,
        body,
    };
    let prepared = disagg::prepare(state, &plan, prompt).await;
    job.pin = prepared.pin;
    Ok(prepared.imported)
}

/// The top-level `kv_transfer_params` of a request prefilled for a remote decoder.
fn prefill_answer(
    state: &AppState,
    job: &Job,
    collected: &[Collected],
) -> Option<KvTransferParams> {
    let pin = job.pin.as_deref()?;
    let blocks = collected
        .first()
        .map(|c| c.pinned_blocks.as_slice())
        .unwrap_or_default();
    Some(disagg::prefill_answer(state, pin, blocks))
}

fn served_name(state: &AppState, job: &Job) -> String {
    job.lora
        .as_ref()
        .map_or_else(|| state.model_name.clone(), |a| a.name.clone())
}

/// One choice's collected output.
#[derive(Default)]
pub(super) struct Collected {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishReason>,
    pub stop: Option<String>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub times: Option<SeqTimes>,
    /// Blocks kept for a remote decoder (`do_remote_decode`).
    pub pinned_blocks: Vec<u32>,
}

/// Every choice to its end, each one's phases traced; a choice the engine failed is the
/// request's 500.
async fn collect_all(
    span: &tracing::Span,
    receivers: Vec<UnboundedReceiver<SeqEvent>>,
) -> Result<Vec<Collected>, ApiError> {
    let mut collected = Vec::new();
    for rx in receivers {
        collected.push(collect(rx).await);
    }
    for (i, c) in collected.iter().enumerate() {
        if let Some(t) = &c.times {
            trace_phases(
                span,
                i,
                t,
                c.prompt_tokens,
                c.completion_tokens,
                c.cached_tokens,
            );
        }
    }
    if let Some(e) = collected.iter().find_map(|c| match &c.finish {
        Some(FinishReason::Error(e)) => Some(e.clone()),
        _ => None,
    }) {
        return Err(ApiError::internal(format!("generation failed: {e}")));
    }
    Ok(collected)
}

async fn collect(mut rx: UnboundedReceiver<SeqEvent>) -> Collected {
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token {
                token,
                text,
                logprob,
            } => {
                c.text.push_str(&text);
                c.tokens.push(token);
                if let Some(lp) = logprob {
                    c.logprobs.push(lp);
                }
            }
            SeqEvent::Finished {
                reason,
                stop,
                text,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                times,
                pinned_blocks,
            } => {
                c.pinned_blocks = pinned_blocks;
                c.text.push_str(&text);
                c.times = Some(times);
                c.finish = Some(reason);
                c.stop = stop;
                c.prompt_tokens = prompt_tokens;
                c.completion_tokens = completion_tokens;
                c.cached_tokens = cached_tokens;
                break;
            }
        }
    }
    if c.finish.is_none() {
        c.finish = Some(FinishReason::Error("the engine stopped".into()));
    }
    c
}

fn usage_of(collected: &[Collected]) -> Usage {
    let prompt = collected.first().map(|c| c.prompt_tokens).unwrap_or(0);
    let completion: usize = collected.iter().map(|c| c.completion_tokens).sum();
    let cached = collected.first().map(|c| c.cached_tokens).unwrap_or(0);
    let usage = Usage::new(prompt as u32, completion as u32);
    if cached > 0 {
        usage.with_cached_tokens(cached as u32)
    } else {
        usage
    }
}

/// The choices' events as SSE chunks in `shape`: each choice opens once, sends a chunk per
/// token with something in it, and ends with its finish chunk; the usage chunk (when
/// asked for) counts what the finished choices reported.
fn stream_answer(
    span: tracing::Span,
    head: AnswerHead,
    receivers: Vec<UnboundedReceiver<SeqEvent>>,
    include_usage: bool,
    mut shape: impl AnswerShape,
) -> Response {
    let mut opened = vec![false; receivers.len()];
    let mut prompt_tokens = 0usize;
    let mut completion_tokens = 0usize;
    let encode = move |event: Option<(usize, SeqEvent)>| -> Vec<String> {
        let Some((i, ev)) = event else {
            if !include_usage {
                return Vec::new();
            }
            let usage = Usage::new(prompt_tokens as u32, completion_tokens as u32);
            return vec![shape.usage(&head, usage)];
        };
        let mut out = Vec::new();
        if !opened[i] {
            opened[i] = true;
            out.extend(shape.opening(&head, i));
        }
        match ev {
            SeqEvent::Token {
                token,
                text,
                logprob,
            } => {
                let logprob = logprob.filter(|_| head.logprobs);
                if !text.is_empty() || logprob.is_some() {
                    // A shape may hold text back (a tool call's tag not yet whole).
                    let chunk = shape.token(&head, i, token, text, logprob);
                    if !chunk.is_empty() {
                        out.push(chunk);
                    }
                }
            }
            SeqEvent::Finished {
                reason,
                stop,
                text,
                prompt_tokens: p,
                completion_tokens: c,
                cached_tokens,
                times,
                ..
            } => {
                trace_phases(&span, i, &times, p, c, cached_tokens);
                prompt_tokens = p;
                completion_tokens += c;
                out.push(shape.finish(&head, i, text, &reason, stop));
            }
        }
        out
    };
    sse_response(receivers, encode)
}

/// The wire's finish reason for the engine's.
pub(super) fn api_finish(r: &FinishReason) -> ApiFinish {
    match r {
        FinishReason::Stop => ApiFinish::Stop,
        FinishReason::Length => ApiFinish::Length,
        FinishReason::Abort => ApiFinish::Abort,
        FinishReason::Error(_) => ApiFinish::Error,
    }
}

/// The stop string that ended a choice, as vLLM's `stop_reason`.
pub(super) fn stop_reason(stop: &Option<String>) -> Option<StopReason> {
    stop.as_ref().map(|s| StopReason::Text(s.clone()))
}

/// One token's text, for logprobs and `return_token_strs`.
pub(super) fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}
