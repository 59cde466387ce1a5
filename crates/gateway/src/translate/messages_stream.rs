//! A chat stream's chunks as a Messages stream: `message_start`, then for each text run
//! or tool call a `content_block_start`, its deltas (`text_delta`, `input_json_delta`)
//! and `content_block_stop`, then `message_delta` (stop reason, usage) and
//! `message_stop`.

use serde_json::json;
use strata_api::anthropic::{
    BlockDelta, ContentBlock, MessageDelta, MessageRole, MessagesResponse, MessagesUsage,
    StopReason, StreamEvent, OBJECT_MESSAGE,
};
use strata_api::types::{FinishReason, StopReason as ChatStop};
use strata_api::ChatCompletionChunk;

use super::messages::stop_reason_of;

/// The block open in the stream.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Open {
    None,
    Text,
    /// A tool call, by its index among the chat stream's tool calls.
    Tool(u64),
}

/// Turns chat chunks into Messages events; [`ChatToMessagesEvents::finish`] at `[DONE]`.
#[derive(Debug)]
pub struct ChatToMessagesEvents {
    id: String,
    model: String,
    stop_sequences: Vec<String>,
    started: bool,
    open: Open,
    /// Blocks started so far (the next block's index).
    blocks: u32,
    finish: Option<FinishReason>,
    matched: Option<ChatStop>,
    usage: MessagesUsage,
    finished: bool,
}

impl ChatToMessagesEvents {
    /// `id`: the message id the client sees; `stop_sequences`: the request's.
    pub fn new(id: &str, model: &str, stop_sequences: Vec<String>) -> ChatToMessagesEvents {
        ChatToMessagesEvents {
            id: id.to_string(),
            model: model.to_string(),
            stop_sequences,
            started: false,
            open: Open::None,
            blocks: 0,
            finish: None,
            matched: None,
            usage: MessagesUsage::default(),
            finished: false,
        }
    }

    fn start(&mut self, out: &mut Vec<StreamEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        out.push(StreamEvent::MessageStart {
            message: MessagesResponse {
                id: self.id.clone(),
                kind: OBJECT_MESSAGE.into(),
                role: MessageRole::Assistant,
                content: Vec::new(),
                model: self.model.clone(),
                stop_reason: None,
                stop_sequence: None,
                usage: self.usage,
            },
        });
    }

    fn close(&mut self, out: &mut Vec<StreamEvent>) {
        if self.open != Open::None {
            out.push(StreamEvent::ContentBlockStop {
                index: self.blocks - 1,
            });
            self.open = Open::None;
        }
    }

    fn open(&mut self, block: ContentBlock, which: Open, out: &mut Vec<StreamEvent>) {
        self.close(out);
        out.push(StreamEvent::ContentBlockStart {
            index: self.blocks,
            content_block: block,
        });
        self.blocks += 1;
        self.open = which;
    }

    /// The events for one chunk.
    pub fn push(&mut self, chunk: &ChatCompletionChunk) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        if self.model.is_empty() {
            self.model = chunk.model.clone();
        }
        if let Some(u) = &chunk.usage {
            self.usage.input_tokens = u.prompt_tokens.into();
            self.usage.output_tokens = u.completion_tokens.into();
        }
        self.start(&mut out);
        let Some(choice) = chunk.choices.iter().find(|c| c.index == 0) else {
            return out;
        };
        if let Some(text) = choice.delta.content.as_deref().filter(|t| !t.is_empty()) {
            if self.open != Open::Text {
                let block = ContentBlock::Text {
                    text: String::new(),
                };
                self.open(block, Open::Text, &mut out);
            }
            out.push(StreamEvent::ContentBlockDelta {
                index: self.blocks - 1,
                delta: BlockDelta::TextDelta { text: text.into() },
            });
        }
        for call in choice.delta.tool_calls.iter().flatten() {
            self.tool_fragment(call, &mut out);
        }
        if choice.finish_reason.is_some() {
            self.finish = choice.finish_reason;
            self.matched = choice.stop_reason.clone();
        }
        out
    }

    /// One fragment of a streamed tool call: its first names it (a new `tool_use`
    /// block), the rest carry pieces of its arguments.
    fn tool_fragment(&mut self, call: &serde_json::Value, out: &mut Vec<StreamEvent>) {
        let index = call.get("index").and_then(|v| v.as_u64()).unwrap_or(0);
        let function = call.get("function");
        if self.open != Open::Tool(index) {
            let id = call.get("id").and_then(|v| v.as_str()).unwrap_or_default();
            let name = function
                .and_then(|f| f.get("name"))
                .and_then(|v| v.as_str())
                .unwrap_or_default();
            let block = ContentBlock::ToolUse {
                id: id.into(),
                name: name.into(),
                input: json!({}),
            };
            self.open(block, Open::Tool(index), out);
        }
        let args = function
            .and_then(|f| f.get("arguments"))
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        if !args.is_empty() {
            out.push(StreamEvent::ContentBlockDelta {
                index: self.blocks - 1,
                delta: BlockDelta::InputJsonDelta {
                    partial_json: args.into(),
                },
            });
        }
    }

    /// The closing events (once): the open block's stop, `message_delta`, `message_stop`.
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        self.finished = true;
        self.start(&mut out);
        let tool_used = matches!(self.open, Open::Tool(_));
        self.close(&mut out);
        let (mut stop_reason, stop_sequence) =
            stop_reason_of(self.finish, self.matched.as_ref(), &self.stop_sequences);
        if tool_used && stop_reason == StopReason::EndTurn {
            stop_reason = StopReason::ToolUse;
        }
        out.push(StreamEvent::MessageDelta {
            delta: MessageDelta {
                stop_reason: Some(stop_reason),
                stop_sequence,
            },
            usage: self.usage,
        });
        out.push(StreamEvent::MessageStop);
        out
    }

    /// The usage reported so far (prompt and output tokens).
    pub fn usage(&self) -> MessagesUsage {
        self.usage
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn chunk(v: Value) -> ChatCompletionChunk {
        let mut base = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": []});
        for (k, x) in v.as_object().unwrap() {
            base[k] = x.clone();
        }
        serde_json::from_value(base).unwrap()
    }

    fn names(evs: &[StreamEvent]) -> Vec<&'static str> {
        evs.iter().map(StreamEvent::name).collect()
    }

    #[test]
    fn text_then_a_tool_call_then_usage() {
        let mut t = ChatToMessagesEvents::new("msg_1", "m", vec![]);
        let mut evs = Vec::new();
        evs.extend(t.push(&chunk(
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        )));
        evs.extend(t.push(&chunk(
            json!({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
        )));
        evs.extend(t.push(&chunk(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": ""}}]}}]}))));
        evs.extend(t.push(&chunk(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":1}"}}]}, "finish_reason": "tool_calls"}]}))));
        evs.extend(t.push(&chunk(
            json!({"usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}),
        )));
        evs.extend(t.finish());
        assert_eq!(
            names(&evs),
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(
            serde_json::to_value(&evs[4]).unwrap(),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "call_1", "name": "get", "input": {}}})
        );
        assert_eq!(
            serde_json::to_value(&evs[7]).unwrap(),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"input_tokens": 5, "output_tokens": 4}})
        );
        assert!(t.finish().is_empty(), "finishes once");
    }
}
