//! `POST /v1/chat/completions`: the messages rendered through the model's chat template
//! and tokenized, then the generation core; answers as `chat.completion` or
//! `chat.completion.chunk` objects.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;
use strata_api::sse;
use strata_api::types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, FinishReason as ApiFinish,
    KvTransferParams, ResponseMessage, Role, TopLogprob, Usage,
};
use strata_api::validate::{check_context, parse_json, validate_chat};
use strata_api::ApiError;

use super::chat_tools::{self, split_answer, RawTools};
use super::generate::{
    api_finish, generate, stop_reason, token_text, AnswerHead, AnswerShape, Collected, Generation,
    Received,
};
use super::http::{json_response, read_body, ApiResult};
use super::spans::trace_span;
use super::state::AppState;
use super::submit::check_sampling_ids;
use super::tokenize::render_messages;
use crate::reasoning::{ReasoningParser, ReasoningStream};
use crate::sequence::{FinishReason, TokenLogprob};
use crate::tokenizer::Tokenizer;
use crate::tools::{Function, StreamDelta, ToolParser, ToolStream};

const ROUTE: &str = "/v1/chat/completions";

pub(super) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> ApiResult {
    let span = trace_span(req.headers(), ROUTE);
    let (headers, body) = read_body(&state, req).await?;
    let mut parsed: ChatCompletionRequest = parse_json(&body)?;
    state.generation_defaults.apply_chat(&mut parsed);
    let kv_params = parsed.kv_transfer_params.take();
    let raw_tools = RawTools::take(&mut parsed);
    let chat = validate_chat(parsed)?;
    let lora = state.resolve_model(chat.model.as_deref())?;
    check_sampling_ids(&state, &chat.sampling)?;
    let tools = chat_tools::prepare(&state, raw_tools, &chat)?;
    let prompt_text = render_messages(
        &state,
        &tools.messages,
        chat.add_generation_prompt,
        &tools.extras,
    )?;
    let prompt = state
        .tokenizer
        .encode(&prompt_text, chat.add_special_tokens, true)
        .map_err(|e| ApiError::invalid("messages", format!("Cannot tokenize: {e}")))?;
    let max_tokens = check_context(
        prompt.len(),
        chat.sampling.max_tokens,
        state.max_model_len,
        "messages",
    )?;
    // With `echo`, a trailing assistant message is the start of the answer.
    let echo_prefix = match (chat.echo, chat.messages.last()) {
        (true, Some(m)) if m.role == Role::Assistant => m.content.clone(),
        _ => String::new(),
    };
    let grammar = tools.grammar;
    let generation = Generation {
        route: ROUTE,
        id_prefix: "chatcmpl",
        prompt,
        max_tokens: max_tokens as usize,
        sampling: chat.sampling,
        lora,
        stream: chat.stream,
        include_usage: chat.include_usage,
        kv_params,
        tool_grammar: grammar,
    };
    let received = Received {
        span,
        headers,
        body,
    };
    let shape = ChatShape {
        echo_prefix,
        parser: tools.plan.parser,
        functions: tools.plan.functions.into(),
        reasoning: state.tools.reasoning_parser,
        streams: Vec::new(),
    };
    generate(&state, received, generation, shape).await
}

/// Chat's answer shapes: the assistant message (after the echoed prefix), and chunks of
/// deltas that open with the assistant role.
struct ChatShape {
    echo_prefix: String,
    /// The tool-call parser, when the request's calls are parsed.
    parser: Option<ToolParser>,
    /// The request's functions (the parser types XML values by their schemas).
    functions: Arc<[Function]>,
    /// `--reasoning-parser`.
    reasoning: Option<ReasoningParser>,
    /// Per streamed choice, its parsers' state.
    streams: Vec<Option<ChoiceStream>>,
}

/// A streamed choice's parsers: reasoning first, then tool calls on the content.
struct ChoiceStream {
    reasoning: Option<ReasoningStream>,
    tools: Option<ToolStream>,
}

impl ChoiceStream {
    /// The delta for new text (`end`: the output is over).
    fn step(&mut self, text: &str, end: bool) -> (String, StreamDelta) {
        let (reasoning, content) = match &mut self.reasoning {
            Some(r) => {
                let (mut dr, mut dc) = r.push(text);
                if end {
                    let (er, ec) = r.finish();
                    dr.push_str(&er);
                    dc.push_str(&ec);
                }
                (dr, dc)
            }
            None => (String::new(), text.to_string()),
        };
        let delta = match &mut self.tools {
            Some(t) => {
                let mut d = t.push(&content);
                if end {
                    let rest = t.finish();
                    d.content.push_str(&rest.content);
                    d.tool_calls.extend(rest.tool_calls);
                }
                d
            }
            None => StreamDelta {
                content,
                tool_calls: Vec::new(),
            },
        };
        (reasoning, delta)
    }
}

impl ChatShape {
    /// The parsers of a streamed choice, when its output is parsed at all.
    fn choice_stream(&mut self, choice: usize) -> Option<&mut ChoiceStream> {
        if self.parser.is_none() && self.reasoning.is_none() {
            return None;
        }
        if self.streams.len() <= choice {
            self.streams.resize_with(choice + 1, || None);
        }
        let (parser, reasoning) = (self.parser, self.reasoning);
        let functions = self.functions.clone();
        Some(self.streams[choice].get_or_insert_with(|| ChoiceStream {
            reasoning: reasoning.map(ReasoningStream::new),
            tools: parser.map(|p| ToolStream::new(p, functions)),
        }))
    }

    fn chunk(head: &AnswerHead, choice: ChatChunkChoice) -> String {
        sse::encode_json(&ChatCompletionChunk::new(
            head.id.clone(),
            head.created,
            head.model.clone(),
            vec![choice],
        ))
        .unwrap_or_default()
    }
}

impl AnswerShape for ChatShape {
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
            .map(|(i, c)| {
                let mut text = format!("{}{}", self.echo_prefix, c.text);
                let reasoning = self.reasoning.map(|r| {
                    let (reasoning, content) = r.view(&text, true);
                    text = content;
                    reasoning
                });
                let finish = c.finish.as_ref().map(api_finish);
                let (mut message, finish_reason) = match self.parser {
                    Some(parser) => split_answer(parser, &self.functions, &text, finish),
                    None => (ResponseMessage::assistant(text), finish),
                };
                message.reasoning_content = reasoning.filter(|r| !r.is_empty());
                if message.reasoning_content.is_some() && message.content.as_deref() == Some("") {
                    message.content = None;
                }
                ChatChoice {
                    index: i as u32,
                    message,
                    logprobs: head
                        .logprobs
                        .then(|| chat_logprobs(&head.tokenizer, &c.tokens, &c.logprobs)),
                    finish_reason,
                    stop_reason: stop_reason(&c.stop),
                }
            })
            .collect();
        let mut resp = ChatCompletionResponse::new(
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
        let prefix = self.echo_prefix.clone();
        let delta = match self.choice_stream(choice) {
            // The echoed prefix is the output's start: parsed like the rest.
            Some(stream) => {
                let (reasoning, d) = stream.step(&prefix, false);
                ChatDelta {
                    content: Some(d.content),
                    ..tool_delta(
                        reasoning,
                        StreamDelta {
                            content: String::new(),
                            ..d
                        },
                    )
                }
            }
            None => ChatDelta {
                content: Some(prefix),
                ..Default::default()
            },
        };
        Some(Self::chunk(
            head,
            ChatChunkChoice {
                index: choice as u32,
                delta: ChatDelta {
                    role: Some(Role::Assistant),
                    ..delta
                },
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            },
        ))
    }

    fn token(
        &mut self,
        head: &AnswerHead,
        choice: usize,
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    ) -> String {
        let delta = match self.choice_stream(choice) {
            Some(stream) => {
                let (reasoning, d) = stream.step(&text, false);
                if reasoning.is_empty() && d.is_empty() && logprob.is_none() {
                    return String::new();
                }
                tool_delta(reasoning, d)
            }
            None => ChatDelta {
                content: Some(text),
                ..Default::default()
            },
        };
        Self::chunk(
            head,
            ChatChunkChoice {
                index: choice as u32,
                delta,
                logprobs: logprob.map(|lp| chat_logprobs(&head.tokenizer, &[token], &[lp])),
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
        let mut finish = api_finish(reason);
        let delta = match self.choice_stream(choice) {
            Some(stream) => {
                let (reasoning, d) = stream.step(&text, true);
                let called = stream.tools.as_ref().is_some_and(ToolStream::called);
                if called && finish == ApiFinish::Stop {
                    finish = ApiFinish::ToolCalls;
                }
                tool_delta(reasoning, d)
            }
            None => ChatDelta {
                content: (!text.is_empty()).then_some(text),
                ..Default::default()
            },
        };
        Self::chunk(
            head,
            ChatChunkChoice {
                index: choice as u32,
                delta,
                logprobs: None,
                finish_reason: Some(finish),
                stop_reason: stop_reason(&stop),
            },
        )
    }

    fn usage(&self, head: &AnswerHead, usage: Usage) -> String {
        sse::encode_json(&ChatCompletionChunk::usage_only(
            head.id.clone(),
            head.created,
            head.model.clone(),
            usage,
        ))
        .unwrap_or_default()
    }
}

/// A parsed step as a chunk's delta: new reasoning, content and call fragments.
fn tool_delta(reasoning: String, d: StreamDelta) -> ChatDelta {
    ChatDelta {
        reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
        content: (!d.content.is_empty()).then_some(d.content),
        tool_calls: (!d.tool_calls.is_empty()).then_some(d.tool_calls),
        ..Default::default()
    }
}

/// Chat's logprobs: one entry per token, with its bytes and top alternatives.
fn chat_logprobs(tok: &Tokenizer, tokens: &[u32], lps: &[TokenLogprob]) -> ChatLogprobs {
    let content = tokens
        .iter()
        .zip(lps)
        .map(|(&id, lp)| ChatTokenLogprob {
            token: token_text(tok, id),
            logprob: strata_api::types::finite_logprob(lp.logprob),
            bytes: tok.token_bytes(id).ok(),
            top_logprobs: lp
                .top
                .iter()
                .map(|&(t, l)| TopLogprob {
                    token: token_text(tok, t),
                    logprob: strata_api::types::finite_logprob(l),
                    bytes: tok.token_bytes(t).ok(),
                })
                .collect(),
        })
        .collect();
    ChatLogprobs {
        content: Some(content),
    }
}
