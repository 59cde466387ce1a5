//! Tool calling as vLLM serves it: parsers that find the calls in a model's text, in the
//! wire format each model family was trained on, whole or while it streams.
//!
//! Every parser gives a [`View`] of the text so far: the content it may show, and the
//! calls as far as they are known. The non-streamed answer is the view of the whole text
//! ([`ToolParser::parse`]); a stream ([`ToolStream`]) sends what each new view adds to the
//! last, so its deltas reassemble to the same answer. Arguments are kept as the model
//! wrote them (the grammars in [`grammar`] make them compact JSON), so a streamed prefix
//! is a prefix of the final string.

mod grammar;
mod hermes;
mod json_scan;
mod lark;
mod llama3_json;
mod mistral;
mod plan;
mod pythonic;
mod qwen3_xml;
#[cfg(test)]
mod recorded;
mod stream;
mod xml_grammar;

pub use grammar::{after_reasoning, auto_grammar, call_grammar};
pub use plan::{plan_tools, Function, ToolMode, ToolPlan, MAX_TOOLS, MAX_TOOLS_BYTES};
pub use stream::{StreamDelta, ToolStream};

use serde_json::{json, Value};

/// One parsed call, as `message.tool_calls[i]` carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments object as a JSON string.
    pub arguments: String,
}

impl ToolCall {
    /// The OpenAI shape: `{"id", "type": "function", "function": {"name", "arguments"}}`.
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }
}

/// A whole output, split.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Parsed {
    /// The text that is not a call (`None` when there is none besides calls).
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// A call as far as the text shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallView {
    pub name: String,
    /// The arguments written so far.
    pub arguments: String,
    /// Whether the call's text is closed.
    pub done: bool,
}

/// What a parser makes of the text so far.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct View {
    /// Content that is safe to show (nothing that may yet turn out to be a call).
    pub content: String,
    pub calls: Vec<CallView>,
    /// How many calls the text opened (a whole text whose opened calls do not all parse
    /// is content, as in vLLM).
    pub opened: usize,
}

/// The parsers, by their vLLM names (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParser {
    /// `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (Hermes, Qwen 2.5).
    Hermes,
    /// `{"name": .., "parameters": {..}}`, several joined by `; ` (Llama 3.x).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]` (Mistral).
    Mistral,
    /// `[f(a=1), g(b="x")]` (Llama 3.2 / 4 pythonic).
    Pythonic,
    /// `<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>`
    /// (Qwen3-Coder), values typed by the function's schema.
    Qwen3Xml,
}

impl ToolParser {
    pub const NAMES: [&'static str; 5] =
        ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"];

    /// The parser of a vLLM name (`llama4_json` is an alias of `llama3_json`, `qwen3_coder`
    /// of `qwen3_xml`: vLLM's two parsers of the same format).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hermes" => Some(Self::Hermes),
            "llama3_json" | "llama4_json" => Some(Self::Llama3Json),
            "mistral" => Some(Self::Mistral),
            "pythonic" => Some(Self::Pythonic),
            "qwen3_xml" | "qwen3_coder" => Some(Self::Qwen3Xml),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
            Self::Pythonic => "pythonic",
            Self::Qwen3Xml => "qwen3_xml",
        }
    }

    /// The view of `text`; `done` when no more text will come. `functions` are the
    /// request's (the XML format types its values by their schemas).
    pub fn view(self, text: &str, done: bool, functions: &[Function]) -> View {
        match self {
            Self::Hermes => hermes::view(text, done),
            Self::Llama3Json => llama3_json::view(text, done),
            Self::Mistral => mistral::view(text, done),
            Self::Pythonic => pythonic::view(text, done),
            Self::Qwen3Xml => qwen3_xml::view(text, done, functions),
        }
    }

    /// The whole output split into content and calls; an output whose calls do not all
    /// parse (an argument that is not JSON, an unclosed call) is all content. Call ids
    /// come from `new_id`.
    pub fn parse(
        self,
        text: &str,
        functions: &[Function],
        mut new_id: impl FnMut() -> String,
    ) -> Parsed {
        let view = self.final_view(text, functions);
        let calls: Vec<ToolCall> = view
            .calls
            .into_iter()
            .map(|c| ToolCall {
                id: new_id(),
                name: c.name,
                arguments: c.arguments,
            })
            .collect();
        let content = (!view.content.trim().is_empty() || calls.is_empty())
            .then_some(view.content)
            .filter(|c| !c.is_empty() || calls.is_empty());
        Parsed { content, calls }
    }

    /// The view of the whole text, or all of it as content when its calls do not parse.
    pub(crate) fn final_view(self, text: &str, functions: &[Function]) -> View {
        let view = self.view(text, true, functions);
        let valid = view.calls.len() == view.opened
            && view.calls.iter().all(|c| {
                c.done
                    && !c.name.is_empty()
                    && serde_json::from_str::<Value>(&c.arguments).is_ok_and(|v| v.is_object())
            });
        if valid {
            view
        } else {
            View {
                content: text.to_string(),
                calls: Vec::new(),
                opened: 0,
            }
        }
    }
}

/// A fresh call id, as vLLM spells them.
pub fn new_call_id() -> String {
    use rand::Rng;
    let n: u64 = rand::rng().random();
    format!("chatcmpl-tool-{n:016x}")
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::*;

    /// Functions with these names and parameter schemas.
    pub fn schema_functions(list: &[(&str, Value)]) -> Vec<Function> {
        list.iter()
            .map(|(name, parameters)| Function {
                name: name.to_string(),
                parameters: parameters.clone(),
                strict: false,
            })
            .collect()
    }

    /// Streams `text` in chunks of `size` chars and checks the deltas reassemble to the
    /// non-streamed answer; returns that answer.
    pub fn check_stream(
        parser: ToolParser,
        text: &str,
        size: usize,
        functions: &[Function],
    ) -> Parsed {
        let whole = parser.parse(text, functions, || "id".into());
        let mut stream = ToolStream::new(parser, functions.to_vec().into());
        let chars: Vec<char> = text.chars().collect();
        let mut deltas = Vec::new();
        for chunk in chars.chunks(size) {
            deltas.push(stream.push(&chunk.iter().collect::<String>()));
        }
        deltas.push(stream.finish());
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for d in deltas {
            content.push_str(&d.content);
            for tc in d.tool_calls {
                let i = tc["index"].as_u64().expect("index") as usize;
                if i == calls.len() {
                    assert_eq!(tc["type"], "function", "first delta of a call: {tc}");
                    assert!(tc["id"].is_string(), "first delta has an id: {tc}");
                    let name = tc["function"]["name"].as_str().expect("name");
                    calls.push((name.to_string(), String::new()));
                }
                if let Some(a) = tc["function"]["arguments"].as_str() {
                    calls[i].1.push_str(a);
                }
            }
        }
        let want: Vec<(String, String)> = whole
            .calls
            .iter()
            .map(|c| (c.name.clone(), c.arguments.clone()))
            .collect();
        assert_eq!(
            calls, want,
            "streamed calls of {text:?} in chunks of {size}"
        );
        assert_eq!(
            content,
            whole.content.clone().unwrap_or_default(),
            "streamed content of {text:?} in chunks of {size}"
        );
        whole
    }

    /// `check_stream` at several chunk sizes.
    pub fn check_all_chunkings(parser: ToolParser, text: &str) -> Parsed {
        check_all_chunkings_with(parser, text, &[])
    }

    /// `check_all_chunkings` with the request's functions.
    pub fn check_all_chunkings_with(
        parser: ToolParser,
        text: &str,
        functions: &[Function],
    ) -> Parsed {
        for size in [1, 2, 3, 7, 1000] {
            check_stream(parser, text, size, functions);
        }
        parser.parse(text, functions, || "id".into())
    }
}
