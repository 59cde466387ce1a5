//! A streamed answer and a whole one, each turned into the other, so the caches can hold
//! one form (the whole JSON body) for both kinds of request:
//! * [`Assembler`] reads the events of a streamed chat or text completion as the client
//!   received them and builds the body a non-streamed request would have got (content
//!   joined per choice, the finish reason, `usage`). Anything it cannot rebuild faithfully
//!   (tool-call deltas, logprobs, a choice that never finished) makes it give up, and the
//!   answer is simply not cached.
//! * [`to_sse`] writes a stored body back as the events of a stream: one content chunk per
//!   choice, one chunk with the finish reasons, the `usage` chunk (the gateway always asks
//!   upstreams for it, so streamed clients always get one), then `[DONE]`.
//!
//! Both are pure; the stream watcher and the cache-hit reply call them.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};
use strata_api::sse::{encode_json, DONE};

/// Delta fields the assembler understands; any other non-null field stops it.
const DELTA_FIELDS: &[&str] = &["role", "content"];

#[derive(Default)]
struct Choice {
    role: Option<String>,
    text: String,
    finish_reason: Option<Value>,
}

/// Rebuilds a whole answer from a stream's events (see the module doc).
pub struct Assembler {
    /// `chat.completion.chunk` or `text_completion`, from the first chunk.
    object: Option<String>,
    head: Map<String, Value>,
    choices: BTreeMap<u64, Choice>,
    usage: Option<Value>,
    /// Bytes of content held; past `limit` the answer is too large to cache.
    held: usize,
    limit: usize,
    broken: bool,
}

impl Assembler {
    /// `limit`: the largest answer worth keeping (bytes of content).
    pub fn new(limit: usize) -> Assembler {
        Assembler {
            object: None,
            head: Map::new(),
            choices: BTreeMap::new(),
            usage: None,
            held: 0,
            limit,
            broken: false,
        }
    }

    /// True once the stream held something that cannot be rebuilt.
    pub fn broken(&self) -> bool {
        self.broken
    }

    /// One event's `data` (not `[DONE]`).
    pub fn feed(&mut self, data: &str) {
        if self.broken {
            return;
        }
        if self.take(data).is_none() {
            self.broken = true;
        }
    }

    fn take(&mut self, data: &str) -> Option<()> {
        let v: Value = serde_json::from_str(data).ok()?;
        let obj = v.as_object()?;
        if obj.contains_key("error") {
            return None;
        }
        let object = obj.get("object").and_then(Value::as_str)?;
        if object != "chat.completion.chunk" && object != "text_completion" {
            return None;
        }
        match &self.object {
            None => {
                self.object = Some(object.to_string());
                for f in ["id", "created", "model", "system_fingerprint"] {
                    if let Some(x) = obj.get(f).filter(|x| !x.is_null()) {
                        self.head.insert(f.to_string(), x.clone());
                    }
                }
            }
            Some(o) if o != object => return None,
            Some(_) => {}
        }
        if let Some(u) = obj.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(u.clone());
        }
        let chat = object == "chat.completion.chunk";
        for c in obj.get("choices").and_then(Value::as_array)? {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            if c.get("logprobs").is_some_and(|l| !l.is_null()) {
                return None;
            }
            let choice = self.choices.entry(index).or_default();
            if chat {
                if let Some(delta) = c.get("delta").and_then(Value::as_object) {
                    for (k, x) in delta {
                        if x.is_null() {
                            continue;
                        }
                        if !DELTA_FIELDS.contains(&k.as_str()) {
                            return None;
                        }
                    }
                    if let Some(r) = delta.get("role").and_then(Value::as_str) {
                        choice.role = Some(r.to_string());
                    }
                    if let Some(t) = delta.get("content").and_then(Value::as_str) {
                        choice.text.push_str(t);
                        self.held += t.len();
                    }
                }
            } else if let Some(t) = c.get("text").and_then(Value::as_str) {
                choice.text.push_str(t);
                self.held += t.len();
            }
            if let Some(f) = c.get("finish_reason").filter(|f| !f.is_null()) {
                choice.finish_reason = Some(f.clone());
            }
        }
        (self.held <= self.limit).then_some(())
    }

    /// The whole answer, when every choice finished and nothing was left out.
    pub fn finish(self) -> Option<Value> {
        if self.broken || self.choices.is_empty() {
            return None;
        }
        let object = self.object?;
        let chat = object == "chat.completion.chunk";
        let mut choices = Vec::with_capacity(self.choices.len());
        for (index, c) in self.choices {
            let finish = c.finish_reason?;
            choices.push(if chat {
                json!({
                    "index": index,
                    "message": {"role": c.role.unwrap_or_else(|| "assistant".into()), "content": c.text},
                    "logprobs": null,
                    "finish_reason": finish,
                })
            } else {
                json!({"index": index, "text": c.text, "logprobs": null, "finish_reason": finish})
            });
        }
        let mut out = self.head;
        out.insert(
            "object".into(),
            Value::String(
                if chat {
                    "chat.completion"
                } else {
                    "text_completion"
                }
                .into(),
            ),
        );
        out.insert("choices".into(), Value::Array(choices));
        if let Some(u) = self.usage {
            out.insert("usage".into(), u);
        }
        Some(Value::Object(out))
    }
}

/// A stored whole answer as SSE events ending in `[DONE]` (see the module doc); `None`
/// when the body is not a chat or text completion.
pub fn to_sse(answer: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(answer).ok()?;
    let obj = v.as_object()?;
    let chat = match obj.get("object").and_then(Value::as_str)? {
        "chat.completion" => true,
        "text_completion" => false,
        _ => return None,
    };
    let mut head = Map::new();
    for f in ["id", "created", "model", "system_fingerprint"] {
        if let Some(x) = obj.get(f) {
            head.insert(f.to_string(), x.clone());
        }
    }
    head.insert(
        "object".into(),
        Value::String(
            if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            }
            .into(),
        ),
    );
    let chunk = |choices: Vec<Value>, usage: Option<&Value>| {
        let mut c = head.clone();
        c.insert("choices".into(), Value::Array(choices));
        if let Some(u) = usage {
            c.insert("usage".into(), u.clone());
        }
        encode_json(&Value::Object(c)).ok()
    };
    let choices = obj.get("choices").and_then(Value::as_array)?;
    let mut content = Vec::with_capacity(choices.len());
    let mut finish = Vec::with_capacity(choices.len());
    for (i, c) in choices.iter().enumerate() {
        let index = c.get("index").cloned().unwrap_or(json!(i));
        let reason = c.get("finish_reason").cloned().unwrap_or(Value::Null);
        if chat {
            let msg = c.get("message")?;
            let role = msg.get("role").cloned().unwrap_or(json!("assistant"));
            let text = msg.get("content").cloned().unwrap_or(json!(""));
            content.push(
                json!({"index": index, "delta": {"role": role, "content": text},
                "logprobs": null, "finish_reason": null}),
            );
            finish.push(json!({"index": index, "delta": {}, "logprobs": null,
                "finish_reason": reason}));
        } else {
            let text = c.get("text").cloned().unwrap_or(json!(""));
            content.push(json!({"index": index, "text": text, "logprobs": null,
                "finish_reason": null}));
            finish.push(json!({"index": index, "text": "", "logprobs": null,
                "finish_reason": reason}));
        }
    }
    let mut out = chunk(content, None)?;
    out.push_str(&chunk(finish, None)?);
    if let Some(u) = obj.get("usage").filter(|u| !u.is_null()) {
        out.push_str(&chunk(Vec::new(), Some(u))?);
    }
    out.push_str(DONE);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_api::SseDecoder;

    fn events(sse: &str) -> Vec<String> {
        let mut d = SseDecoder::new();
        d.feed(sse.as_bytes())
            .unwrap()
            .into_iter()
            .map(|e| e.data)
            .collect()
    }

    fn assemble(sse: &str) -> Option<Value> {
        let mut a = Assembler::new(1 << 20);
        for e in events(sse) {
            if e != "[DONE]" {
                a.feed(&e);
            }
        }
        a.finish()
    }

    const CHAT: &str = concat!(
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"m\",",
        "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"m\",",
        "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Par\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"m\",",
        "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"is\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"m\",",
        "\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n",
        "data: [DONE]\n\n"
    );

    #[test]
    fn a_chat_stream_becomes_the_whole_answer_and_back() {
        let whole = assemble(CHAT).unwrap();
        assert_eq!(whole["object"], "chat.completion");
        assert_eq!(whole["id"], "c1");
        assert_eq!(whole["choices"][0]["message"]["content"], "Paris");
        assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
        assert_eq!(whole["choices"][0]["finish_reason"], "stop");
        assert_eq!(whole["usage"]["total_tokens"], 5);
        // Back to a stream, and assembled again: the same answer.
        let sse = to_sse(whole.to_string().as_bytes()).unwrap();
        assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
        assert_eq!(assemble(&sse).unwrap(), whole);
    }

    #[test]
    fn a_text_completion_stream_round_trips() {
        let sse = concat!(
            "data: {\"id\":\"t\",\"object\":\"text_completion\",\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"a \",\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"t\",\"object\":\"text_completion\",\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"b\",\"finish_reason\":\"length\"}]}\n\n",
            "data: [DONE]\n\n"
        );
        let whole = assemble(sse).unwrap();
        assert_eq!(whole["object"], "text_completion");
        assert_eq!(whole["choices"][0]["text"], "a b");
        assert_eq!(whole["choices"][0]["finish_reason"], "length");
        let again = to_sse(whole.to_string().as_bytes()).unwrap();
        assert_eq!(assemble(&again).unwrap(), whole);
    }

    #[test]
    fn what_cannot_be_rebuilt_is_not_cached() {
        let unfinished = CHAT.replace("\"finish_reason\":\"stop\"", "\"finish_reason\":null");
        assert!(assemble(&unfinished).is_none(), "no finish reason");
        let tools = CHAT.replace(
            "{\"content\":\"Par\"}",
            "{\"tool_calls\":[{\"index\":0,\"id\":\"x\"}]}",
        );
        assert!(assemble(&tools).is_none(), "tool-call deltas");
        let logprobs = CHAT.replace(
            "\"delta\":{\"content\":\"is\"}",
            "\"logprobs\":{\"content\":[]},\"delta\":{\"content\":\"is\"}",
        );
        assert!(assemble(&logprobs).is_none(), "logprobs");
        let mut a = Assembler::new(1 << 20);
        a.feed("not json");
        assert!(a.broken() && a.finish().is_none());
        let mut a = Assembler::new(1 << 20);
        a.feed(r#"{"error":{"message":"boom"}}"#);
        assert!(a.finish().is_none(), "an error event");
        let mut small = Assembler::new(3);
        for e in events(CHAT) {
            if e != "[DONE]" {
                small.feed(&e);
            }
        }
        assert!(small.finish().is_none(), "larger than the limit");
        assert!(Assembler::new(10).finish().is_none(), "nothing streamed");
    }

    #[test]
    fn only_completions_become_streams() {
        assert!(to_sse(br#"{"object":"list","data":[]}"#).is_none());
        assert!(to_sse(b"not json").is_none());
        assert!(to_sse(br#"{"object":"chat.completion","choices":[{"index":0}]}"#).is_none());
    }
}
