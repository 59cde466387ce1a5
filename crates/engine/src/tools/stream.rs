//! A streamed output's tool-call deltas, as OpenAI sends them: a call's first delta
//! carries its index, id, type and name; later ones carry argument fragments.

use std::sync::Arc;

use serde_json::{json, Value};

use super::{new_call_id, Function, ToolParser, View};

/// What one step of the stream adds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamDelta {
    /// New content ("" when none).
    pub content: String,
    /// New tool-call fragments (`delta.tool_calls`).
    pub tool_calls: Vec<Value>,
}

impl StreamDelta {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.tool_calls.is_empty()
    }
}

/// One choice's stream through a parser.
#[derive(Debug)]
pub struct ToolStream {
    parser: ToolParser,
    /// The request's functions (the XML format types values by their schemas).
    functions: Arc<[Function]>,
    text: String,
    sent_content: usize,
    /// Per call sent: its id and how much of its arguments went out.
    sent_calls: Vec<(String, usize)>,
}

impl ToolStream {
    pub fn new(parser: ToolParser, functions: Arc<[Function]>) -> Self {
        Self {
            parser,
            functions,
            text: String::new(),
            sent_content: 0,
            sent_calls: Vec::new(),
        }
    }

    /// Adds generated text; returns what can be sent of it.
    pub fn push(&mut self, chunk: &str) -> StreamDelta {
        self.text.push_str(chunk);
        let view = self.parser.view(&self.text, false, &self.functions);
        self.diff(view)
    }

    /// The output ended: what is left to send. An output cut inside a call (its calls do
    /// not all parse, so the whole answer of the same text is content) sends nothing more
    /// once calls went out: what was sent cannot be taken back, and the text again as
    /// content would say the calls twice.
    pub fn finish(&mut self) -> StreamDelta {
        let view = self.parser.final_view(&self.text, &self.functions);
        if view.calls.is_empty() && self.called() {
            return StreamDelta::default();
        }
        self.diff(view)
    }

    /// Whether any call was sent.
    pub fn called(&self) -> bool {
        !self.sent_calls.is_empty()
    }

    fn diff(&mut self, view: View) -> StreamDelta {
        let mut delta = StreamDelta::default();
        if view.content.len() > self.sent_content
            && view.content.is_char_boundary(self.sent_content)
        {
            delta.content = view.content[self.sent_content..].to_string();
            self.sent_content = view.content.len();
        }
        for (i, call) in view.calls.iter().enumerate() {
            if i == self.sent_calls.len() && !call.arguments.trim_start().starts_with('{') {
                // Not yet an arguments object (or never one: then the whole answer is
                // content, and so is the stream's end).
                break;
            }
            if i == self.sent_calls.len() {
                let id = new_call_id();
                delta.tool_calls.push(json!({
                    "index": i,
                    "id": id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }));
                self.sent_calls.push((id, 0));
            }
            let sent = &mut self.sent_calls[i].1;
            if call.arguments.len() > *sent && call.arguments.is_char_boundary(*sent) {
                let fragment = &call.arguments[*sent..];
                *sent = call.arguments.len();
                match delta.tool_calls.last_mut() {
                    Some(last) if last["index"] == i => {
                        last["function"]["arguments"] = Value::from(fragment);
                    }
                    _ => delta.tool_calls.push(json!({
                        "index": i,
                        "function": {"arguments": fragment},
                    })),
                }
            }
        }
        delta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_cut_inside_a_call_keeps_the_calls_it_sent() {
        let mut stream = ToolStream::new(ToolParser::Hermes, Vec::new().into());
        let first = stream.push("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {\"b\": ");
        assert_eq!(first.tool_calls.len(), 2, "{first:?}");
        assert!(first.content.is_empty());
        assert!(stream.finish().is_empty());
        // The same text whole is content, as vLLM answers it.
        let text = stream.text.clone();
        assert!(ToolParser::Hermes
            .parse(&text, &[], || "id".into())
            .calls
            .is_empty());
    }
}
