//! Server-Sent Events: encoding for our responses, decoding for upstream streams.
//!
//! OpenAI-style streaming uses only a sliver of SSE (`data: {json}\n\n` per chunk, then
//! `data: [DONE]\n\n`), so encoding is a few string functions. Decoding is where care is
//! needed: the router and benchmarks read streams from servers we do not control, and
//! network reads split them anywhere: inside a UTF-8 character, between `\r` and `\n`, in
//! the middle of a field name. [`SseDecoder`] follows the WHATWG "event stream
//! interpretation" rules byte by byte, so feeding a stream in any chunking yields exactly
//! the events of feeding it whole:
//!
//! * lines end in `\n`, `\r\n` or `\r`; a blank line dispatches the event;
//! * `field: value` with at most one space stripped after the colon; a line without a colon
//!   is a field with an empty value; lines starting with `:` are comments;
//! * `data` lines accumulate, joined by `"\n"`; `event`, `id` and `retry` are honoured and
//!   unknown fields ignored; an event with no `data` is not dispatched;
//! * a leading byte-order mark is skipped; invalid UTF-8 becomes U+FFFD.
//!
//! Two deliberate departures: [`SseDecoder::finish`] dispatches an unterminated final event
//! (a browser drops it; a proxy would rather see it and decide), and the decoder refuses to
//! buffer more than a configurable limit (default [`DEFAULT_MAX_BUFFER`], 16 MiB) of an
//! unfinished event, so a peer that never sends a newline cannot exhaust memory.

use serde::Serialize;

/// The stream terminator OpenAI-compatible servers send last.
pub const DONE: &str = "data: [DONE]\n\n";
/// The `data` payload of the terminator event.
pub const DONE_DATA: &str = "[DONE]";
/// Default bound on bytes held for one unfinished event.
pub const DEFAULT_MAX_BUFFER: usize = 16 * 1024 * 1024;

/// Encodes `data` as one event. Line breaks inside `data` (there are none in compact JSON)
/// become separate `data:` lines, which decoders join back with `"\n"`.
pub fn encode_data(data: &str) -> String {
    let mut out = String::with_capacity(data.len() + 8);
    for line in split_lines(data) {
        out.push_str("data: ");
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    out
}

/// Serializes `value` as compact JSON and encodes it as one event.
pub fn encode_json<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    serde_json::to_string(value).map(|json| encode_data(&json))
}

/// A comment line (`: text`), for keep-alives through proxies that close idle streams.
/// Decoders ignore it. Line breaks in `text` are replaced by spaces.
pub fn encode_comment(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 4);
    out.push_str(": ");
    out.extend(
        text.chars()
            .map(|c| if c == '\r' || c == '\n' { ' ' } else { c }),
    );
    out.push_str("\n\n");
    out
}

/// Splits on `\r\n`, `\n` or `\r`, SSE's three line endings.
fn split_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = Some(text);
    std::iter::from_fn(move || {
        let current = rest?;
        match current.find(['\r', '\n']) {
            None => {
                rest = None;
                Some(current)
            }
            Some(pos) => {
                let (line, tail) = current.split_at(pos);
                let skip = if tail.starts_with("\r\n") { 2 } else { 1 };
                rest = Some(&tail[skip..]);
                Some(line)
            }
        }
    })
}

/// One dispatched event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field; `None` means the default type, `message`.
    pub event: Option<String>,
    /// The `data:` lines joined with `"\n"`.
    pub data: String,
    /// The last event id seen in the stream so far (ids persist across events, per the
    /// SSE specification); `None` if no `id:` field has been seen.
    pub id: Option<String>,
}

impl SseEvent {
    /// True for the OpenAI terminator `data: [DONE]`.
    pub fn is_done(&self) -> bool {
        self.data.trim() == DONE_DATA
    }

    /// The event type, `message` when none was given.
    pub fn event_type(&self) -> &str {
        self.event.as_deref().unwrap_or("message")
    }

    /// Parses `data` as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.data)
    }
}

/// Decoding failures.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An unfinished event grew past the buffer limit. The decoder stays failed.
    #[error("SSE event exceeds the buffer limit of {limit} bytes")]
    TooLarge {
        /// The configured limit.
        limit: usize,
    },
}

/// Incremental SSE decoder. Feed it bytes as they arrive; it returns completed events.
#[derive(Debug, Clone)]
pub struct SseDecoder {
    /// Bytes of the current, unterminated line.
    line: Vec<u8>,
    /// `data` of the event being built, each line followed by `\n`.
    data: String,
    /// `event` of the event being built.
    event: Option<String>,
    /// Last event id; persists across events.
    last_id: Option<String>,
    /// Last valid `retry` value.
    retry: Option<u64>,
    /// The previous feed ended in `\r`: a leading `\n` in the next one is its partner.
    skip_lf: bool,
    /// No line has been processed yet (a BOM may lead it).
    at_start: bool,
    max_buffer: usize,
    failed: Option<SseError>,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl SseDecoder {
    /// A decoder with the default buffer limit.
    pub fn new() -> Self {
        Self::with_max_buffer(DEFAULT_MAX_BUFFER)
    }

    /// A decoder that fails once an unfinished event (its partial line, `data` and `event`
    /// together) exceeds `max_buffer` bytes.
    pub fn with_max_buffer(max_buffer: usize) -> Self {
        SseDecoder {
            line: Vec::new(),
            data: String::new(),
            event: None,
            last_id: None,
            retry: None,
            skip_lf: false,
            at_start: true,
            max_buffer,
            failed: None,
        }
    }

    /// The last `id:` seen, if any.
    pub fn last_event_id(&self) -> Option<&str> {
        self.last_id.as_deref()
    }

    /// The last valid `retry:` value (milliseconds), if any.
    pub fn retry(&self) -> Option<u64> {
        self.retry
    }

    /// Consumes `bytes` and returns the events they complete, in order.
    ///
    /// After an error every later call returns the same error; events completed earlier in
    /// the failing call are dropped with it.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let mut events = Vec::new();
        let mut rest = bytes;
        if self.skip_lf {
            if let Some((&first, tail)) = rest.split_first() {
                if first == b'\n' {
                    rest = tail;
                }
                self.skip_lf = false;
            }
        }
        while let Some(pos) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            let (head, tail) = rest.split_at(pos);
            let ended_by_cr = tail.first() == Some(&b'\r');
            rest = tail.get(1..).unwrap_or_default();
            if ended_by_cr {
                match rest.split_first() {
                    Some((&b'\n', after)) => rest = after,
                    Some(_) => {}
                    None => self.skip_lf = true,
                }
            }
            if self.line.is_empty() {
                self.process_line(head, &mut events);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(head);
                self.process_line(&line, &mut events);
                // Reuse the allocation for the next partial line.
                line.clear();
                self.line = line;
            }
            self.check_size()?;
        }
        self.line.extend_from_slice(rest);
        self.check_size()?;
        Ok(events)
    }

    /// Ends the stream: a trailing unterminated line is processed and a pending event with
    /// data is returned (browsers would drop it). The decoder is then reset, keeping its
    /// limit, and can read a new stream.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let mut events = Vec::new();
        if self.failed.is_none() {
            let line = std::mem::take(&mut self.line);
            if !line.is_empty() {
                self.process_line(&line, &mut events);
            }
            self.dispatch(&mut events);
        }
        *self = Self::with_max_buffer(self.max_buffer);
        events.pop()
    }

    fn check_size(&mut self) -> Result<(), SseError> {
        let held = self.line.len() + self.data.len() + self.event.as_ref().map_or(0, String::len);
        if held > self.max_buffer {
            let err = SseError::TooLarge {
                limit: self.max_buffer,
            };
            // Release the memory; the decoder is unusable from here on.
            *self = Self::with_max_buffer(self.max_buffer);
            self.failed = Some(err.clone());
            return Err(err);
        }
        Ok(())
    }

    fn process_line(&mut self, raw: &[u8], events: &mut Vec<SseEvent>) {
        let decoded = String::from_utf8_lossy(raw);
        let mut line: &str = &decoded;
        if self.at_start {
            self.at_start = false;
            line = line.strip_prefix('\u{FEFF}').unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch(events);
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
            }
            "event" => self.event = Some(value.to_string()),
            "id" if !value.contains('\0') => self.last_id = Some(value.to_string()),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                if let Ok(ms) = value.parse() {
                    self.retry = Some(ms);
                }
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, events: &mut Vec<SseEvent>) {
        let event = self.event.take();
        if self.data.is_empty() {
            return;
        }
        let mut data = std::mem::take(&mut self.data);
        if data.ends_with('\n') {
            data.pop();
        }
        events.push(SseEvent {
            event,
            data,
            id: self.last_id.clone(),
        });
    }
}

/// Watches an OpenAI-style event stream that passes through a proxy untouched: it decodes the
/// bytes as SSE events (so a terminator split across network chunks is still seen, and text
/// that merely contains `[DONE]` is not mistaken for it) and remembers what a proxy needs to
/// judge the stream when it ends: whether `data: [DONE]` arrived, and the last `usage`.
///
/// A stream that is not SSE at all, or whose event outgrows the decoder's limit, leaves the
/// watch [`StreamWatch::undecidable`]: a proxy cannot tell how it ended and should not blame
/// the upstream for it.
#[derive(Debug, Clone, Default)]
pub struct StreamWatch {
    decoder: SseDecoder,
    done: bool,
    undecidable: bool,
    events: u64,
    usage: Option<crate::types::Usage>,
}

impl StreamWatch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads one chunk of the stream; returns how many data events it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> usize {
        if self.undecidable {
            return 0;
        }
        match self.decoder.feed(chunk) {
            Ok(events) => {
                for ev in &events {
                    self.event(ev);
                }
                events.len()
            }
            Err(_) => {
                self.undecidable = true;
                0
            }
        }
    }

    /// The stream ended: an unterminated last event still counts (a proxy would rather see
    /// it than drop it).
    pub fn finish(&mut self) {
        if self.undecidable {
            return;
        }
        if let Some(ev) = self.decoder.finish() {
            self.event(&ev);
        }
    }

    fn event(&mut self, ev: &SseEvent) {
        self.events += 1;
        if ev.is_done() {
            self.done = true;
        } else if !self.done && ev.data.contains("\"usage\"") {
            #[derive(serde::Deserialize)]
            struct WithUsage {
                usage: Option<crate::types::Usage>,
            }
            if let Ok(WithUsage { usage: Some(u) }) = ev.json::<WithUsage>() {
                self.usage = Some(u);
            }
        }
    }

    /// `data: [DONE]` has arrived.
    pub fn saw_done(&self) -> bool {
        self.done
    }

    /// The bytes were not an event stream the decoder could follow.
    pub fn undecidable(&self) -> bool {
        self.undecidable
    }

    /// Whether a stream that has ended now ended the way a finished one does: with
    /// `[DONE]`, or in a form that cannot be judged.
    pub fn ended_well(&self) -> bool {
        self.done || self.undecidable
    }

    /// Events seen so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// The last `usage` object the stream carried (`stream_options.include_usage`).
    pub fn usage(&self) -> Option<&crate::types::Usage> {
        self.usage.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(input: &[u8]) -> Vec<SseEvent> {
        let mut d = SseDecoder::new();
        let mut events = d.feed(input).unwrap();
        events.extend(d.finish());
        events
    }

    fn data(s: &str) -> SseEvent {
        SseEvent {
            data: s.to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn encode_data_and_done() {
        assert_eq!(encode_data(r#"{"a":1}"#), "data: {\"a\":1}\n\n");
        assert_eq!(encode_data("a\nb\r\nc"), "data: a\ndata: b\ndata: c\n\n");
        assert_eq!(encode_data(""), "data: \n\n");
        assert_eq!(DONE, "data: [DONE]\n\n");
    }

    #[test]
    fn encode_json_compact() {
        let text = encode_json(&serde_json::json!({"x": [1, 2]})).unwrap();
        assert_eq!(text, "data: {\"x\":[1,2]}\n\n");
    }

    #[test]
    fn encode_comment_is_ignored_by_decoder() {
        let c = encode_comment("keep\nalive");
        assert_eq!(c, ": keep alive\n\n");
        assert!(decode_all(c.as_bytes()).is_empty());
    }

    #[test]
    fn multiline_data_round_trips() {
        let events = decode_all(encode_data("a\nb\n").as_bytes());
        assert_eq!(events, vec![data("a\nb\n")]);
    }

    #[test]
    fn line_endings_cr_crlf_lf() {
        let events = decode_all(b"data: a\r\rdata: b\r\n\r\ndata: c\n\n");
        assert_eq!(events, vec![data("a"), data("b"), data("c")]);
    }

    #[test]
    fn fields_event_id_retry() {
        let mut d = SseDecoder::new();
        let events = d
            .feed(b"event: update\nid: 7\nretry: 1500\ndata:x\n\ndata: y\n\n")
            .unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].event_type(), "update");
        assert_eq!(events[0].data, "x");
        assert_eq!(events[0].id.as_deref(), Some("7"));
        // id persists; event type does not.
        assert_eq!(events[1].event_type(), "message");
        assert_eq!(events[1].id.as_deref(), Some("7"));
        assert_eq!(d.retry(), Some(1500));
        assert_eq!(d.last_event_id(), Some("7"));
    }

    #[test]
    fn invalid_retry_and_nul_id_ignored() {
        let mut d = SseDecoder::new();
        d.feed(b"retry: 1x\nid: a\0b\ndata: z\n\n").unwrap();
        assert_eq!(d.retry(), None);
        assert_eq!(d.last_event_id(), None);
    }

    #[test]
    fn only_one_space_stripped_and_colonless_field() {
        let events = decode_all(b"data:  two\ndata\n\n");
        assert_eq!(events, vec![data(" two\n")]);
    }

    #[test]
    fn event_without_data_is_not_dispatched() {
        assert!(decode_all(b"event: ping\n\n: comment\n\n").is_empty());
        let events = decode_all(b"event: ping\n\ndata: x\n\n");
        assert_eq!(events, vec![data("x")], "event type must reset");
    }

    #[test]
    fn bom_skipped_once() {
        let events = decode_all(b"\xEF\xBB\xBFdata: a\n\n\xEF\xBB\xBFdata: b\n\n");
        assert_eq!(events.len(), 1, "second BOM makes an unknown field");
        assert_eq!(events[0].data, "a");
    }

    #[test]
    fn done_detection() {
        let events = decode_all(DONE.as_bytes());
        assert!(events[0].is_done());
        assert!(!data("[DONE]x").is_done());
    }

    #[test]
    fn finish_flushes_unterminated_event_then_resets() {
        let mut d = SseDecoder::new();
        assert!(d.feed(b"id: 1\ndata: partial").unwrap().is_empty());
        let ev = d.finish().unwrap();
        assert_eq!(ev.data, "partial");
        assert_eq!(d.last_event_id(), None);
        assert!(d.finish().is_none());
    }

    #[test]
    fn cr_at_chunk_end_then_lf() {
        let mut d = SseDecoder::new();
        assert!(d.feed(b"data: a\r").unwrap().is_empty());
        assert!(d.feed(b"").unwrap().is_empty());
        let events = d.feed(b"\n\n").unwrap();
        assert_eq!(events, vec![data("a")]);
    }

    #[test]
    fn split_inside_utf8_char() {
        let bytes = "data: héllo 👋\n\n".as_bytes();
        for cut in 0..bytes.len() {
            let mut d = SseDecoder::new();
            let mut events = d.feed(&bytes[..cut]).unwrap();
            events.extend(d.feed(&bytes[cut..]).unwrap());
            assert_eq!(events, vec![data("héllo 👋")], "cut at {cut}");
        }
    }

    #[test]
    fn buffer_limit_errors_and_sticks() {
        let mut d = SseDecoder::with_max_buffer(16);
        assert!(d.feed(b"data: 0123456789").is_ok());
        let err = d.feed(b"abcdef").unwrap_err();
        assert_eq!(err, SseError::TooLarge { limit: 16 });
        assert_eq!(d.feed(b"\n\n").unwrap_err(), err);
        assert!(d.finish().is_none());
    }

    #[test]
    fn buffer_limit_counts_accumulated_data_lines() {
        let mut d = SseDecoder::with_max_buffer(16);
        let err = d.feed(b"data: 0123456789\ndata: 0123456789\n").unwrap_err();
        assert_eq!(err, SseError::TooLarge { limit: 16 });
    }

    #[test]
    fn invalid_utf8_replaced() {
        let events = decode_all(b"data: \xFF\n\n");
        assert_eq!(events, vec![data("\u{FFFD}")]);
    }

    fn watch_bytewise(stream: &[u8]) -> StreamWatch {
        let mut w = StreamWatch::new();
        for b in stream {
            w.feed(std::slice::from_ref(b));
        }
        w.finish();
        w
    }

    #[test]
    fn watch_sees_a_terminator_split_at_every_byte() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\ndata: [DONE]\n\n";
        for split in 0..stream.len() {
            let mut w = StreamWatch::new();
            w.feed(&stream[..split]);
            w.feed(&stream[split..]);
            w.finish();
            assert!(w.saw_done(), "split at {split}");
            assert_eq!(w.usage().map(|u| u.total_tokens), Some(5));
        }
        let w = watch_bytewise(stream);
        assert!(w.saw_done() && w.ended_well());
        assert_eq!(w.events(), 3);
    }

    #[test]
    fn watch_is_not_fooled_by_done_inside_text() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"say [DONE] now\"}}]}\n\n";
        let w = watch_bytewise(stream);
        assert!(!w.saw_done());
        assert!(
            !w.ended_well(),
            "a stream cut after a chunk that quotes [DONE] broke"
        );
    }

    #[test]
    fn watch_gives_up_on_what_is_not_sse() {
        let mut w = StreamWatch::new();
        w.decoder = SseDecoder::with_max_buffer(8);
        w.feed(b"0123456789abcdef");
        assert!(w.undecidable() && w.ended_well() && !w.saw_done());
    }
}
