//! A Messages upstream's stream as a chat stream: each event becomes the chat chunk that
//! says the same (role first, text and tool-call deltas, the finish reason), and
//! `message_stop` the usage chunk; the caller ends the stream with `[DONE]`.

use serde_json::json;
use strata_api::anthropic::{BlockDelta, ContentBlock, StreamEvent};
use strata_api::types::{ChatDelta, Role};
use strata_api::{ChatChunkChoice, ChatCompletionChunk, Usage};

use super::messages_upstream::finish_of;

/// Turns Messages events into chat chunks.
#[derive(Debug)]
pub struct MessagesToChatChunks {
    id: String,
    model: String,
    created: u64,
    /// Tool calls started so far (the next one's index in `tool_calls`).
    tools: u64,
    input_tokens: u64,
    output_tokens: u64,
}

impl MessagesToChatChunks {
    /// `created`: the chunks' Unix time.
    pub fn new(created: u64) -> MessagesToChatChunks {
        MessagesToChatChunks {
            id: String::new(),
            model: String::new(),
            created,
            tools: 0,
            input_tokens: 0,
            output_tokens: 0,
        }
    }

    fn chunk(&self, delta: ChatDelta) -> ChatCompletionChunk {
        ChatCompletionChunk::new(
            self.id.clone(),
            self.created,
            self.model.clone(),
            vec![ChatChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }],
        )
    }

    /// The chunks for one event (none for `ping`, block stops and the like).
    pub fn push(&mut self, ev: &StreamEvent) -> Vec<ChatCompletionChunk> {
        match ev {
            StreamEvent::MessageStart { message } => {
                self.id = message.id.clone();
                self.model = message.model.clone();
                self.input_tokens = message.usage.input_tokens;
                vec![self.chunk(ChatDelta {
                    role: Some(Role::Assistant),
                    content: Some(String::new()),
                    ..Default::default()
                })]
            }
            StreamEvent::ContentBlockStart {
                content_block: ContentBlock::ToolUse { id, name, .. },
                ..
            } => {
                let index = self.tools;
                self.tools += 1;
                vec![self.chunk(ChatDelta {
                    tool_calls: Some(vec![json!({
                        "index": index, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}
                    })]),
                    ..Default::default()
                })]
            }
            StreamEvent::ContentBlockDelta { delta, .. } => match delta {
                BlockDelta::TextDelta { text } => vec![self.chunk(ChatDelta {
                    content: Some(text.clone()),
                    ..Default::default()
                })],
                BlockDelta::InputJsonDelta { partial_json } => vec![self.chunk(ChatDelta {
                    tool_calls: Some(vec![json!({
                        "index": self.tools.saturating_sub(1),
                        "function": {"arguments": partial_json}
                    })]),
                    ..Default::default()
                })],
                BlockDelta::ThinkingDelta { thinking } => vec![self.chunk(ChatDelta {
                    reasoning_content: Some(thinking.clone()),
                    ..Default::default()
                })],
                BlockDelta::SignatureDelta { .. } => Vec::new(),
            },
            StreamEvent::MessageDelta { delta, usage } => {
                self.output_tokens = usage.output_tokens;
                if usage.input_tokens > 0 {
                    self.input_tokens = usage.input_tokens;
                }
                let (finish, matched) =
                    finish_of(delta.stop_reason, delta.stop_sequence.as_deref());
                let mut c = self.chunk(ChatDelta::default());
                c.choices[0].finish_reason = Some(finish);
                c.choices[0].stop_reason = matched;
                vec![c]
            }
            StreamEvent::MessageStop => vec![ChatCompletionChunk::usage_only(
                self.id.clone(),
                self.created,
                self.model.clone(),
                Usage::new(
                    u32::try_from(self.input_tokens).unwrap_or(u32::MAX),
                    u32::try_from(self.output_tokens).unwrap_or(u32::MAX),
                ),
            )],
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::ChatToMessagesEvents;
    use strata_api::types::FinishReason;

    /// vLLM's recorded Messages stream, as chat chunks, then back to Messages events: the
    /// same events come out.
    #[test]
    fn the_recorded_vllm_stream_round_trips() {
        let text = include_str!("../../../../tests/fixtures/vllm-0.32/api/messages-stream.sse");
        let mut dec = strata_api::SseDecoder::new();
        let events: Vec<StreamEvent> = dec
            .feed(text.as_bytes())
            .unwrap()
            .iter()
            .map(|e| e.json().unwrap())
            .collect();
        let mut to_chat = MessagesToChatChunks::new(1);
        let chunks: Vec<ChatCompletionChunk> =
            events.iter().flat_map(|e| to_chat.push(e)).collect();
        let last_choice = chunks.iter().rev().find(|c| !c.choices.is_empty()).unwrap();
        assert_eq!(
            last_choice.choices[0].finish_reason,
            Some(FinishReason::Length)
        );
        assert_eq!(chunks.last().unwrap().usage, Some(Usage::new(33, 8)));
        let mut back = ChatToMessagesEvents::new("chatcmpl-93dd42566c7cb3c3", "", vec![]);
        let mut again: Vec<StreamEvent> = chunks.iter().flat_map(|c| back.push(c)).collect();
        again.extend(back.finish());
        // The message_start carries the input tokens only once the usage chunk came (at
        // the end of a chat stream): compare it apart.
        let (StreamEvent::MessageStart { message: a }, StreamEvent::MessageStart { message: b }) =
            (&events[0], &again[0])
        else {
            panic!("message_start first");
        };
        assert_eq!((&a.id, &a.model, &a.content), (&b.id, &b.model, &b.content));
        assert_eq!(events[1..], again[1..]);
    }
}
