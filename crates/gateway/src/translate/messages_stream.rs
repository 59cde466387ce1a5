//! A chat stream's chunks as a Messages stream: `message_start`, then for each text run
//! or tool call a `content_block_start`, its deltas (`text_delta`, `input_json_delta`)
//! and `content_block_stop`, then `message_delta` (stop reason, usage) and
//! `message_stop`.
//!
//! Each chat tool call (by its `index`) is one `tool_use` block. Blocks follow one another
//! (a block is stopped before the next starts), so only one tool call can be streamed
//! live: the first. Fragments of any other call, and text that comes after a call began,
//! are held and sent as whole blocks at the end (each call's block in the order the calls
//! started, then the text), so interleaved fragments (index 0 after index 1 began) never
//! open a second block for one call.

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

/// A tool call held until the end (not the one streamed live).
#[derive(Debug, Default)]
struct HeldTool {
    index: u64,
    id: String,
    name: String,
    arguments: String,
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
    /// The chat index of the tool call streamed live, once one began.
    live_tool: Option<u64>,
    /// Other tool calls, in the order they began.
    held_tools: Vec<HeldTool>,
    /// Text that came after a tool call began.
    held_text: String,
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
            live_tool: None,
            held_tools: Vec::new(),
            held_text: String::new(),
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
            if self.live_tool.is_some() {
                // A block already stopped cannot take it: sent after the tool calls.
                self.held_text.push_str(text);
            } else if self.open != Open::Text {
                let block = ContentBlock::Text {
                    text: String::new(),
                };
                self.open(block, Open::Text, &mut out);
            }
            if self.live_tool.is_none() {
                out.push(StreamEvent::ContentBlockDelta {
                    index: self.blocks - 1,
                    delta: BlockDelta::TextDelta { text: text.into() },
                });
            }
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

    /// One fragment of a streamed tool call: the first call's first fragment names it (a
    /// new `tool_use` block, streamed live), the rest carry pieces of its arguments; any
    /// other call is held whole until [`ChatToMessagesEvents::finish`].
    fn tool_fragment(&mut self, call: &serde_json::Value, out: &mut Vec<StreamEvent>) {
        let index = call.get("index").and_then(|v| v.as_u64()).unwrap_or(0);
        let function = call.get("function");
        let id = call.get("id").and_then(|v| v.as_str()).unwrap_or_default();
        let name = function
            .and_then(|f| f.get("name"))
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        let args = function
            .and_then(|f| f.get("arguments"))
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        match self.live_tool {
            None => {
                self.live_tool = Some(index);
                let block = ContentBlock::ToolUse {
                    id: id.into(),
                    name: name.into(),
                    input: json!({}),
                };
                self.open(block, Open::Tool(index), out);
            }
            Some(live) if live == index => {}
            Some(_) => {
                let pos = match self.held_tools.iter().position(|t| t.index == index) {
                    Some(pos) => pos,
                    None => {
                        self.held_tools.push(HeldTool {
                            index,
                            ..HeldTool::default()
                        });
                        self.held_tools.len() - 1
                    }
                };
                let held = &mut self.held_tools[pos];
                if held.id.is_empty() {
                    held.id = id.to_string();
                }
                if held.name.is_empty() {
                    held.name = name.to_string();
                }
                held.arguments.push_str(args);
                return;
            }
        }
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
        let tool_used = self.live_tool.is_some();
        self.close(&mut out);
        for held in std::mem::take(&mut self.held_tools) {
            let block = ContentBlock::ToolUse {
                id: held.id,
                name: held.name,
                input: json!({}),
            };
            self.open(block, Open::Tool(held.index), &mut out);
            if !held.arguments.is_empty() {
                out.push(StreamEvent::ContentBlockDelta {
                    index: self.blocks - 1,
                    delta: BlockDelta::InputJsonDelta {
                        partial_json: held.arguments,
                    },
                });
            }
            self.close(&mut out);
        }
        let text = std::mem::take(&mut self.held_text);
        if !text.is_empty() {
            let block = ContentBlock::Text {
                text: String::new(),
            };
            self.open(block, Open::Text, &mut out);
            out.push(StreamEvent::ContentBlockDelta {
                index: self.blocks - 1,
                delta: BlockDelta::TextDelta { text },
            });
            self.close(&mut out);
        }
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

    /// Tool-call fragments interleaved across chat indices (index 0 after index 1 began,
    /// text after a call began): one `tool_use` block per call, each with its own id,
    /// name and whole arguments, blocks never overlapping, nothing lost.
    #[test]
    fn interleaved_tool_call_deltas_keep_one_block_per_call() {
        let mut t = ChatToMessagesEvents::new("msg_1", "m", vec![]);
        let call =
            |v: Value| chunk(json!({"choices": [{"index": 0, "delta": {"tool_calls": [v]}}]}));
        let mut evs = Vec::new();
        evs.extend(t.push(&call(json!({"index": 0, "id": "call_a", "type": "function", "function": {"name": "get", "arguments": "{\"a\""}}))));
        evs.extend(t.push(&call(json!({"index": 1, "id": "call_b", "type": "function", "function": {"name": "put", "arguments": "{\"b\""}}))));
        evs.extend(t.push(&call(json!({"index": 0, "function": {"arguments": ":1}"}}))));
        evs.extend(t.push(&chunk(
            json!({"choices": [{"index": 0, "delta": {"content": "done"}}]}),
        )));
        evs.extend(t.push(&chunk(json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": ":2}"}}]}, "finish_reason": "tool_calls"}]}))));
        evs.extend(t.finish());
        // Blocks open and stop in turn, each index once.
        let mut open: Option<u32> = None;
        let mut started = Vec::new();
        for ev in &evs {
            match ev {
                StreamEvent::ContentBlockStart { index, .. } => {
                    assert!(open.is_none(), "overlapping blocks: {evs:?}");
                    assert!(!started.contains(index), "block {index} twice");
                    started.push(*index);
                    open = Some(*index);
                }
                StreamEvent::ContentBlockDelta { index, .. } => {
                    assert_eq!(open, Some(*index), "delta outside its block: {evs:?}")
                }
                StreamEvent::ContentBlockStop { index } => {
                    assert_eq!(open.take(), Some(*index))
                }
                _ => {}
            }
        }
        // What a client accumulating by block index rebuilds.
        let mut blocks: Vec<Value> = Vec::new();
        for ev in &evs {
            match ev {
                StreamEvent::ContentBlockStart { content_block, .. } => {
                    let mut b = serde_json::to_value(content_block).unwrap();
                    b["partial"] = json!("");
                    blocks.push(b);
                }
                StreamEvent::ContentBlockDelta { index, delta } => {
                    let b = &mut blocks[*index as usize];
                    match delta {
                        BlockDelta::InputJsonDelta { partial_json } => {
                            b["partial"] =
                                json!(format!("{}{partial_json}", b["partial"].as_str().unwrap()))
                        }
                        BlockDelta::TextDelta { text } => {
                            b["text"] = json!(format!("{}{text}", b["text"].as_str().unwrap()))
                        }
                        _ => {}
                    }
                }
                _ => {}
            }
        }
        let summary: Vec<(Value, Value, Value)> = blocks
            .iter()
            .map(|b| {
                (
                    b["type"].clone(),
                    b["name"].clone(),
                    if b["type"] == "text" {
                        b["text"].clone()
                    } else {
                        b["partial"].clone()
                    },
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (json!("tool_use"), json!("get"), json!("{\"a\":1}")),
                (json!("tool_use"), json!("put"), json!("{\"b\":2}")),
                (json!("text"), Value::Null, json!("done")),
            ]
        );
        assert_eq!(blocks[1]["id"], "call_b");
        let StreamEvent::MessageDelta { delta, .. } = &evs[evs.len() - 2] else {
            panic!("message_delta before message_stop");
        };
        assert_eq!(delta.stop_reason, Some(StopReason::ToolUse));
    }
}
