//! Output guardrails on streamed answers.
//!
//! A secret can arrive split over several SSE chunks (`"sk-ab"`, `"cd12..."`), so chunks
//! cannot be checked one by one. [`StreamGuard`] keeps, per choice, the text not yet sent
//! and runs the guardrails over it each time it grows; it sends everything but the last
//! [`HOLD_BACK_CHARS`] characters (the hold-back window), which stay until more text
//! arrives or the choice finishes. A match up to that length is therefore whole inside the
//! held text when it completes, and is redacted (or blocks the stream) before any of it
//! leaves. `block` ends the stream with an OpenAI-shaped `data: {"error": ...}` event;
//! `redact` rewrites the `delta.content` (chat) or `text` (completions) of the chunks.
//!
//! Pure: bytes in, bytes out; no clock or I/O. Events that carry no text (role, usage,
//! errors, `[DONE]`) pass through, after any held text has been flushed ahead of them.

use std::sync::Arc;

use serde_json::Value;
use strata_api::{sse, ApiError, SseDecoder};

use crate::config::Resolved;
use crate::guardrails::{Outcome, Stage};

/// Characters of each choice's text held back until more arrives: the longest match that
/// is guaranteed never to be sent in part.
pub const HOLD_BACK_CHARS: usize = 256;

/// Rewrites one SSE stream (see the module docs).
pub struct StreamGuard {
    resolved: Arc<Resolved>,
    decoder: SseDecoder,
    /// Text received but not yet sent, per choice index.
    pending: Vec<String>,
    /// The first text chunk, used as the shape of chunks that flush held text.
    template: Option<Value>,
    blocked: Option<String>,
}

impl StreamGuard {
    /// A guard applying `resolved`'s guardrails (output stage).
    pub fn new(resolved: Arc<Resolved>) -> StreamGuard {
        StreamGuard {
            resolved,
            decoder: SseDecoder::new(),
            pending: Vec::new(),
            template: None,
            blocked: None,
        }
    }

    /// Why the stream was blocked, once it was.
    pub fn blocked(&self) -> Option<&str> {
        self.blocked.as_deref()
    }

    /// Takes upstream bytes; returns what may be sent to the client now (possibly
    /// nothing). After a block it returns the error event once, then nothing.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        if self.blocked.is_some() {
            return out;
        }
        match self.decoder.feed(bytes) {
            Ok(events) => {
                for ev in events {
                    self.event(&ev.data, ev.is_done(), &mut out);
                    if self.blocked.is_some() {
                        break;
                    }
                }
            }
            // Not SSE: nothing can be checked, so nothing more is sent.
            Err(_) => self.block("the stream could not be checked".into(), &mut out),
        }
        out
    }

    /// The upstream ended: sends whatever is still held (checked).
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.blocked.is_some() {
            return out;
        }
        if let Some(ev) = self.decoder.finish() {
            self.event(&ev.data, ev.is_done(), &mut out);
        }
        if self.blocked.is_none() {
            self.flush_all(&mut out);
        }
        out
    }

    fn block(&mut self, reason: String, out: &mut Vec<u8>) {
        let err = ApiError::invalid_no_param(format!("The response was withheld: {reason}"))
            .with_code("guardrail_blocked");
        out.extend_from_slice(sse::encode_data(&err.to_json_string()).as_bytes());
        self.pending.clear();
        self.blocked = Some(reason);
    }

    fn event(&mut self, data: &str, done: bool, out: &mut Vec<u8>) {
        let parsed = if done {
            None
        } else {
            serde_json::from_str::<Value>(data).ok()
        };
        let Some(mut v) = parsed else {
            // `[DONE]` or something that is not a chunk: flush, then pass it on.
            self.flush_all(out);
            out.extend_from_slice(sse::encode_data(data).as_bytes());
            return;
        };
        let has_choices = v
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty());
        if !has_choices {
            // Usage chunk, error object, ...: no text of its own.
            self.flush_all(out);
            out.extend_from_slice(sse::encode_data(data).as_bytes());
            return;
        }
        if self.template.is_none() {
            self.template = Some(v.clone());
        }
        let guardrails = &self.resolved.guardrails;
        let mut blocked = None;
        if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
            for (pos, c) in choices.iter_mut().enumerate() {
                let idx = c
                    .get("index")
                    .and_then(Value::as_u64)
                    .map_or(pos, |i| i as usize)
                    .min(1024);
                if self.pending.len() <= idx {
                    self.pending.resize(idx + 1, String::new());
                }
                let finishing = c.get("finish_reason").is_some_and(|f| !f.is_null());
                let slot = text_slot(c);
                let Some(slot) = slot else {
                    continue;
                };
                let held = &mut self.pending[idx];
                if let Some(Value::String(s)) = slot.as_ref() {
                    held.push_str(s);
                }
                match guardrails.apply(Stage::Output, held) {
                    Outcome::Unchanged => {}
                    Outcome::Rewritten(new) => *held = new,
                    Outcome::Blocked(reason) => {
                        blocked = Some(reason);
                        break;
                    }
                }
                let send = if finishing {
                    std::mem::take(held)
                } else {
                    take_all_but_tail(held, HOLD_BACK_CHARS)
                };
                match slot {
                    SlotRef::Existing(v) => *v = Value::String(send),
                    SlotRef::Missing(delta) => {
                        if !send.is_empty() {
                            delta.insert("content".into(), Value::String(send));
                        }
                    }
                }
            }
        }
        if let Some(reason) = blocked {
            self.block(reason, out);
            return;
        }
        match serde_json::to_string(&v) {
            Ok(text) => out.extend_from_slice(sse::encode_data(&text).as_bytes()),
            Err(_) => self.block("a chunk could not be re-encoded".into(), out),
        }
    }

    /// Sends every choice's held text in chunks shaped like the first one.
    fn flush_all(&mut self, out: &mut Vec<u8>) {
        let Some(template) = &self.template else {
            self.pending.clear();
            return;
        };
        let chat = template
            .get("choices")
            .and_then(|c| c.get(0))
            .is_some_and(|c| c.get("delta").is_some());
        for (idx, held) in self.pending.iter_mut().enumerate() {
            if held.is_empty() {
                continue;
            }
            let text = std::mem::take(held);
            let choice = if chat {
                serde_json::json!({"index": idx, "delta": {"content": text}, "finish_reason": null})
            } else {
                serde_json::json!({"index": idx, "text": text, "finish_reason": null})
            };
            let mut chunk = template.clone();
            chunk["choices"] = Value::Array(vec![choice]);
            if let Some(o) = chunk.as_object_mut() {
                o.remove("usage");
            }
            if let Ok(s) = serde_json::to_string(&chunk) {
                out.extend_from_slice(sse::encode_data(&s).as_bytes());
            }
        }
    }
}

/// Where a choice's text lives: `delta.content` (chat) or `text` (completions).
enum SlotRef<'a> {
    Existing(&'a mut Value),
    /// A chat delta without `content` (e.g. the finish chunk): held text goes here.
    Missing(&'a mut serde_json::Map<String, Value>),
}

impl SlotRef<'_> {
    fn as_ref(&self) -> Option<&Value> {
        match self {
            SlotRef::Existing(v) => Some(v),
            SlotRef::Missing(_) => None,
        }
    }
}

fn text_slot(choice: &mut Value) -> Option<SlotRef<'_>> {
    if choice.get("text").is_some_and(Value::is_string) {
        return choice.get_mut("text").map(SlotRef::Existing);
    }
    let delta = choice.get_mut("delta")?.as_object_mut()?;
    if delta.get("content").is_some_and(Value::is_string) {
        delta.get_mut("content").map(SlotRef::Existing)
    } else {
        Some(SlotRef::Missing(delta))
    }
}

/// Removes and returns all of `s` but its last `keep` characters.
fn take_all_but_tail(s: &mut String, keep: usize) -> String {
    let chars = s.chars().count();
    if chars <= keep {
        return String::new();
    }
    let cut = s
        .char_indices()
        .nth(chars - keep)
        .map_or(s.len(), |(i, _)| i);
    let rest = s.split_off(cut);
    std::mem::replace(s, rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn resolved(action: &str) -> Arc<Resolved> {
        let yaml = format!(
            "guardrails:\n  patterns:\n    - {{kind: email, action: {action}}}\n    - {{kind: api_key, action: {action}}}\n"
        );
        Arc::new(Resolved::new(Config::from_yaml(&yaml).unwrap()).unwrap())
    }

    fn chunk(text: &str) -> String {
        let v = serde_json::json!({"id": "c1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
        sse::encode_data(&v.to_string())
    }

    fn finish_chunk() -> String {
        let v = serde_json::json!({"id": "c1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        sse::encode_data(&v.to_string())
    }

    /// The text the client sees: every `delta.content` in order, and any error events.
    fn client_text(bytes: &[u8]) -> (String, Vec<Value>) {
        let mut dec = SseDecoder::new();
        let mut text = String::new();
        let mut errors = Vec::new();
        for ev in dec.feed(bytes).unwrap() {
            if ev.is_done() {
                text.push_str("<DONE>");
                continue;
            }
            let v: Value = serde_json::from_str(&ev.data).unwrap();
            if v.get("error").is_some() {
                errors.push(v);
                continue;
            }
            for c in v["choices"].as_array().unwrap() {
                if let Some(s) = c["delta"]["content"].as_str() {
                    text.push_str(s);
                }
            }
        }
        (text, errors)
    }

    fn run(guard: &mut StreamGuard, parts: &[String]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in parts {
            // Split inside the SSE framing too, not only between events.
            let (a, b) = p.as_bytes().split_at(p.len() / 2);
            out.extend(guard.feed(a));
            out.extend(guard.feed(b));
        }
        out.extend(guard.finish());
        out
    }

    #[test]
    fn a_secret_split_over_two_chunks_is_redacted() {
        let mut g = StreamGuard::new(resolved("redact"));
        let parts = [
            chunk("Write to alice.sm"),
            chunk("ith@example.com today. "),
            chunk("Bye."),
            finish_chunk(),
            sse::encode_data("[DONE]"),
        ];
        let (text, errors) = client_text(&run(&mut g, &parts));
        assert!(errors.is_empty());
        assert_eq!(text, "Write to [REDACTED:email] today. Bye.<DONE>");
        assert!(!text.contains("example.com"));
    }

    #[test]
    fn a_secret_split_over_two_chunks_blocks_the_stream() {
        let mut g = StreamGuard::new(resolved("block"));
        let parts = [
            chunk("key: sk-proj-abcdefgh"),
            chunk("ijklmnopqrstuvwxyz0123456789 ok"),
            finish_chunk(),
            sse::encode_data("[DONE]"),
        ];
        let out = run(&mut g, &parts);
        let (text, errors) = client_text(&out);
        assert!(g.blocked().is_some());
        assert_eq!(errors.len(), 1, "{text}");
        assert_eq!(errors[0]["error"]["code"], "guardrail_blocked");
        assert!(!text.contains("sk-proj"), "{text}");
        assert!(!text.contains("<DONE>"), "the stream ends at the error");
        assert!(g.feed(chunk("more").as_bytes()).is_empty());
    }

    #[test]
    fn clean_text_is_sent_whole_and_only_the_window_is_held() {
        let mut g = StreamGuard::new(resolved("redact"));
        let long = "a".repeat(HOLD_BACK_CHARS + 10);
        let first = g.feed(chunk(&long).as_bytes());
        let (sent, _) = client_text(&first);
        assert_eq!(sent.len(), 10, "all but the hold-back window goes at once");
        let rest = run(&mut g, &[finish_chunk(), sse::encode_data("[DONE]")]);
        let (text, _) = client_text(&rest);
        assert_eq!(text, format!("{}<DONE>", "a".repeat(HOLD_BACK_CHARS)));
    }

    #[test]
    fn held_text_is_flushed_before_usage_and_at_an_end_without_done() {
        let mut g = StreamGuard::new(resolved("redact"));
        let usage = sse::encode_data(
            r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#,
        );
        let out = run(&mut g, &[chunk("hello "), chunk("world"), usage]);
        let s = String::from_utf8(out.clone()).unwrap();
        let (text, _) = client_text(&out);
        assert_eq!(text, "hello world");
        assert!(s.find("world").unwrap() < s.find("usage").unwrap());
        let mut g = StreamGuard::new(resolved("redact"));
        let (text, _) = client_text(&run(&mut g, &[chunk("cut off")]));
        assert_eq!(text, "cut off");
    }

    #[test]
    fn tail_split_respects_char_boundaries() {
        let mut s = "ééééé".to_string();
        assert_eq!(take_all_but_tail(&mut s, 2), "ééé");
        assert_eq!(s, "éé");
        assert_eq!(take_all_but_tail(&mut s, 5), "");
    }
}
