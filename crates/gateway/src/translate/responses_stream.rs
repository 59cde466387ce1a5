//! A chat stream's chunks as a Responses stream: `response.created` and
//! `response.in_progress`, then per output item its `output_item.added`, its deltas
//! (`output_text.delta` inside a content part, or `function_call_arguments.delta`) and
//! its `.done` events, and last `response.completed` carrying the whole response (status
//! `incomplete` when the model ran out of tokens, as vLLM sends it).

use strata_api::responses::{ContentPart, InputRole, OutputItem, Response, StreamEvent};
use strata_api::types::FinishReason;
use strata_api::ChatCompletionChunk;

use super::responses::{status_of, usage_of, ResponseIds};

/// The item open in the stream.
#[derive(Debug, Clone, PartialEq)]
enum Open {
    None,
    Text {
        text: String,
    },
    /// A function call, by its index among the chat stream's tool calls.
    Call {
        chat_index: u64,
    },
}

/// Turns chat chunks into Responses events; [`ChatToResponseEvents::finish`] at
/// `[DONE]` gives the last events and the whole response.
#[derive(Debug)]
pub struct ChatToResponseEvents {
    ids: ResponseIds,
    response: Response,
    seq: u64,
    started: bool,
    open: Open,
    calls: usize,
    /// The function call item being streamed.
    pending: Option<OutputItem>,
    finish: Option<FinishReason>,
    finished: bool,
}

impl ChatToResponseEvents {
    /// `skeleton`: [`super::response_skeleton`] of the request.
    pub fn new(ids: ResponseIds, skeleton: Response) -> ChatToResponseEvents {
        ChatToResponseEvents {
            ids,
            response: skeleton,
            seq: 0,
            started: false,
            open: Open::None,
            calls: 0,
            pending: None,
            finish: None,
            finished: false,
        }
    }

    fn next_seq(&mut self) -> u64 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    /// The next event's `sequence_number`, taken (for an event made outside this
    /// translation: the `error` that ends a broken stream).
    pub fn next_sequence_number(&mut self) -> u64 {
        self.next_seq()
    }

    fn start(&mut self, out: &mut Vec<StreamEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        let response = self.response.clone();
        let sequence_number = self.next_seq();
        out.push(StreamEvent::Created {
            response: response.clone(),
            sequence_number,
        });
        let sequence_number = self.next_seq();
        out.push(StreamEvent::InProgress {
            response,
            sequence_number,
        });
    }

    fn output_index(&self) -> u32 {
        u32::try_from(self.response.output.len()).unwrap_or(u32::MAX)
    }

    /// Closes the open item: its `.done` events, and the item joins `output`.
    fn close(&mut self, out: &mut Vec<StreamEvent>) {
        let output_index = self.output_index();
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => {}
            Open::Text { text } => {
                let item_id = self.ids.message();
                let part = ContentPart::output_text(text.clone());
                let seq = self.next_seq();
                out.push(StreamEvent::OutputTextDone {
                    item_id: item_id.clone(),
                    output_index,
                    content_index: 0,
                    text,
                    logprobs: Vec::new(),
                    sequence_number: seq,
                });
                let seq = self.next_seq();
                out.push(StreamEvent::ContentPartDone {
                    item_id: item_id.clone(),
                    output_index,
                    content_index: 0,
                    part: part.clone(),
                    sequence_number: seq,
                });
                self.push_done(
                    OutputItem::Message {
                        id: item_id,
                        role: InputRole::Assistant,
                        status: "completed".into(),
                        content: vec![part],
                    },
                    out,
                );
            }
            Open::Call { .. } => {
                let Some(OutputItem::FunctionCall {
                    id,
                    call_id,
                    name,
                    arguments,
                    ..
                }) = self.pending.take()
                else {
                    return;
                };
                let seq = self.next_seq();
                out.push(StreamEvent::FunctionCallArgumentsDone {
                    item_id: id.clone(),
                    output_index,
                    arguments: arguments.clone(),
                    sequence_number: seq,
                });
                self.push_done(
                    OutputItem::FunctionCall {
                        id,
                        call_id,
                        name,
                        arguments,
                        status: "completed".into(),
                    },
                    out,
                );
            }
        }
    }

    fn push_done(&mut self, item: OutputItem, out: &mut Vec<StreamEvent>) {
        let output_index = self.output_index();
        let seq = self.next_seq();
        out.push(StreamEvent::OutputItemDone {
            output_index,
            item: item.clone(),
            sequence_number: seq,
        });
        self.response.output.push(item);
    }

    /// The events for one chunk.
    pub fn push(&mut self, chunk: &ChatCompletionChunk) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        self.start(&mut out);
        if let Some(u) = &chunk.usage {
            self.response.usage = Some(usage_of(
                u.prompt_tokens.into(),
                u.completion_tokens.into(),
                u.prompt_tokens_details
                    .map_or(0, |d| d.cached_tokens.into()),
            ));
        }
        if !chunk.model.is_empty() {
            self.response.model = chunk.model.clone();
        }
        let Some(choice) = chunk.choices.iter().find(|c| c.index == 0) else {
            return out;
        };
        if let Some(text) = choice.delta.content.as_deref().filter(|t| !t.is_empty()) {
            self.text_delta(text, &mut out);
        }
        for call in choice.delta.tool_calls.iter().flatten() {
            self.call_fragment(call, &mut out);
        }
        if choice.finish_reason.is_some() {
            self.finish = choice.finish_reason;
        }
        out
    }

    fn text_delta(&mut self, delta: &str, out: &mut Vec<StreamEvent>) {
        if !matches!(self.open, Open::Text { .. }) {
            self.close(out);
            let item_id = self.ids.message();
            let output_index = self.output_index();
            let seq = self.next_seq();
            out.push(StreamEvent::OutputItemAdded {
                output_index,
                item: OutputItem::Message {
                    id: item_id.clone(),
                    role: InputRole::Assistant,
                    status: "in_progress".into(),
                    content: Vec::new(),
                },
                sequence_number: seq,
            });
            let seq = self.next_seq();
            out.push(StreamEvent::ContentPartAdded {
                item_id,
                output_index,
                content_index: 0,
                // An empty part, `logprobs: []` as OpenAI and vLLM send it.
                part: ContentPart::OutputText {
                    text: String::new(),
                    annotations: Vec::new(),
                    logprobs: Some(serde_json::Value::Array(Vec::new())),
                },
                sequence_number: seq,
            });
            self.open = Open::Text {
                text: String::new(),
            };
        }
        if let Open::Text { text } = &mut self.open {
            text.push_str(delta);
        }
        let output_index = self.output_index();
        let seq = self.next_seq();
        out.push(StreamEvent::OutputTextDelta {
            item_id: self.ids.message(),
            output_index,
            content_index: 0,
            delta: delta.into(),
            logprobs: Vec::new(),
            sequence_number: seq,
        });
    }

    fn call_fragment(&mut self, call: &serde_json::Value, out: &mut Vec<StreamEvent>) {
        let chat_index = call.get("index").and_then(|v| v.as_u64()).unwrap_or(0);
        let function = call.get("function");
        let same = matches!(self.open, Open::Call { chat_index: c } if c == chat_index);
        if !same {
            self.close(out);
            let n = self.calls;
            self.calls += 1;
            let s = |v: Option<&serde_json::Value>| {
                v.and_then(|v| v.as_str()).unwrap_or_default().to_string()
            };
            let item = OutputItem::FunctionCall {
                id: self.ids.function_call(n),
                call_id: s(call.get("id")),
                name: s(function.and_then(|f| f.get("name"))),
                arguments: String::new(),
                status: "in_progress".into(),
            };
            let output_index = self.output_index();
            let seq = self.next_seq();
            out.push(StreamEvent::OutputItemAdded {
                output_index,
                item: item.clone(),
                sequence_number: seq,
            });
            self.pending = Some(item);
            self.open = Open::Call { chat_index };
        }
        let args = function
            .and_then(|f| f.get("arguments"))
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        if args.is_empty() {
            return;
        }
        let Some(OutputItem::FunctionCall { id, arguments, .. }) = &mut self.pending else {
            return;
        };
        arguments.push_str(args);
        let item_id = id.clone();
        let output_index = self.output_index();
        let seq = self.next_seq();
        out.push(StreamEvent::FunctionCallArgumentsDelta {
            item_id,
            output_index,
            delta: args.into(),
            sequence_number: seq,
        });
    }

    /// The closing events (once) and the whole response as `response.completed` sent it.
    pub fn finish(&mut self) -> (Vec<StreamEvent>, Response) {
        let mut out = Vec::new();
        if self.finished {
            return (out, self.response.clone());
        }
        self.finished = true;
        self.start(&mut out);
        self.close(&mut out);
        let (status, incomplete) = status_of(self.finish);
        self.response.status = status.into();
        self.response.incomplete_details = incomplete;
        if self.response.usage.is_none() {
            self.response.usage = Some(usage_of(0, 0, 0));
        }
        let seq = self.next_seq();
        out.push(StreamEvent::Completed {
            response: self.response.clone(),
            sequence_number: seq,
        });
        (out, self.response.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::response_skeleton;
    use serde_json::{json, Value};

    fn chunk(v: Value) -> ChatCompletionChunk {
        let mut base = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": []});
        for (k, x) in v.as_object().unwrap() {
            base[k] = x.clone();
        }
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn text_then_a_function_call_streams_as_items() {
        let req = serde_json::from_value(json!({"model": "m", "input": "hi"})).unwrap();
        let ids = ResponseIds::new("x");
        let mut t = ChatToResponseEvents::new(ids.clone(), response_skeleton(&req, &ids, 3));
        let mut evs = Vec::new();
        evs.extend(t.push(&chunk(
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "A"}}]}),
        )));
        evs.extend(t.push(&chunk(
            json!({"choices": [{"index": 0, "delta": {"content": "B"}}]}),
        )));
        evs.extend(t.push(&chunk(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{\"a\""}}]}}]}))));
        evs.extend(t.push(&chunk(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}))));
        evs.extend(t.push(&chunk(
            json!({"usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}),
        )));
        let (end, whole) = t.finish();
        evs.extend(end);
        let names: Vec<_> = evs.iter().map(StreamEvent::name).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let seqs: Vec<u64> = evs
            .iter()
            .map(|e| {
                serde_json::to_value(e).unwrap()["sequence_number"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(seqs, (0..evs.len() as u64).collect::<Vec<_>>());
        assert_eq!(whole.output_text(), "AB");
        assert_eq!(
            serde_json::to_value(&whole.output[1]).unwrap(),
            json!({"type": "function_call", "id": "fc_x_0", "call_id": "call_1", "name": "f", "arguments": "{\"a\":1}", "status": "completed"})
        );
        assert_eq!(whole.status, "completed");
        assert_eq!(whole.usage.unwrap().output_tokens, 5);
    }
}
