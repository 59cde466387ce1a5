//! Token usage read out of an answer as it passes through, whatever the API: the last
//! `usage` object of a JSON answer or of any event of a stream. Its counts are
//! `prompt_tokens` / `completion_tokens` (OpenAI chat and completions) or `input_tokens` /
//! `output_tokens` (Responses, where it sits inside `response`, and Anthropic Messages).

/// Largest JSON answer kept whole to find `usage` in it.
pub const MAX_USAGE_SCAN: usize = 4 << 20;

/// Reads `usage` out of an answer fed chunk by chunk.
#[derive(Debug, Default)]
pub struct UsageScan {
    sse: bool,
    /// SSE: the unfinished last line. JSON: the body so far (bounded).
    buf: Vec<u8>,
    overflow: bool,
    usage: Option<(u64, u64)>,
}

impl UsageScan {
    /// A scan of an event stream (`sse`) or of a JSON answer.
    pub fn new(sse: bool) -> UsageScan {
        UsageScan {
            sse,
            ..Default::default()
        }
    }

    /// Whether the answer is an event stream (known once its headers are).
    pub fn set_sse(&mut self, sse: bool) {
        self.sse = sse;
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.overflow {
            return;
        }
        if self.sse {
            // Only the unfinished line is kept: whole lines are read and dropped.
            let mut rest = chunk;
            while let Some(i) = rest.iter().position(|&b| b == b'\n') {
                if self.buf.is_empty() {
                    self.line(&rest[..=i]);
                } else {
                    self.buf.extend_from_slice(&rest[..=i]);
                    let line = std::mem::take(&mut self.buf);
                    self.line(&line);
                }
                rest = &rest[i + 1..];
            }
            self.buf.extend_from_slice(rest);
        } else {
            self.buf.extend_from_slice(chunk);
        }
        if self.buf.len() > MAX_USAGE_SCAN {
            self.overflow = true;
            self.buf = Vec::new();
        }
    }

    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        if !memmem(data, b"\"usage\"") {
            return;
        }
        if let Some(u) = usage_of(data) {
            self.usage = Some(u);
        }
    }

    /// The answer ended: the last usage seen, as (prompt, completion) tokens.
    pub fn finish(&mut self) -> Option<(u64, u64)> {
        if !self.overflow {
            let rest = std::mem::take(&mut self.buf);
            if self.sse {
                self.line(&rest);
            } else if let Some(u) = usage_of(&rest) {
                self.usage = Some(u);
            }
        }
        self.usage
    }
}

#[derive(serde::Deserialize)]
struct Usage {
    #[serde(default, alias = "input_tokens")]
    prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    completion_tokens: u64,
}

/// The `usage` object of a JSON text, read without parsing the rest: the last `"usage"`
/// key (an escaped quote inside a string can never form it) and the one value after it.
pub fn usage_of(json: &[u8]) -> Option<(u64, u64)> {
    const KEY: &[u8] = b"\"usage\"";
    let mut end = json.len();
    while let Some(i) = json[..end].windows(KEY.len()).rposition(|w| w == KEY) {
        if let Some(rest) = json[i + KEY.len()..].trim_ascii_start().strip_prefix(b":") {
            let mut de = serde_json::Deserializer::from_slice(rest);
            let u: Option<Usage> = serde::Deserialize::deserialize(&mut de).ok()?;
            return u.map(|u| (u.prompt_tokens, u.completion_tokens));
        }
        end = i;
    }
    None
}

fn memmem(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_from_sse_split_across_chunks() {
        let mut u = UsageScan::new(true);
        let stream = b"data: {\"choices\":[{\"text\":\" tok\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n";
        for c in stream.chunks(5) {
            u.feed(c);
        }
        assert_eq!(u.finish(), Some((7, 3)));
    }

    #[test]
    fn usage_from_json_and_absent() {
        let mut u = UsageScan::default();
        u.feed(br#"{"choices":[],"usage":{"prompt_tokens":2,"#);
        u.feed(br#""completion_tokens":5}}"#);
        assert_eq!(u.finish(), Some((2, 5)));
        let mut u = UsageScan::default();
        u.feed(b"not json");
        assert_eq!(u.finish(), None);
    }

    #[test]
    fn usage_is_read_from_its_key_only() {
        // A quoted "usage" inside text is escaped and never taken for the key.
        let body = br#"{"choices":[{"text":"say \"usage\": 5"}],"usage":{"prompt_tokens":4,"completion_tokens":6,"total_tokens":10}}"#;
        assert_eq!(usage_of(body), Some((4, 6)));
        assert_eq!(usage_of(br#"{"object":"usage","usage":null}"#), None);
        assert_eq!(usage_of(br#"{"choices":[]}"#), None);
    }

    #[test]
    fn responses_and_messages_usage_is_read_too() {
        let responses = br#"{"id":"resp_1","output":[],"usage":{"input_tokens":42,"input_tokens_details":{"cached_tokens":0},"output_tokens":8,"total_tokens":50}}"#;
        assert_eq!(usage_of(responses), Some((42, 8)));
        let mut u = UsageScan::new(true);
        for line in [
            &b"event: response.created\ndata: {\"response\":{\"id\":\"r\",\"usage\":null},\"type\":\"response.created\"}\n\n"[..],
            b"event: response.completed\ndata: {\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":33,\"output_tokens\":8}},\"type\":\"response.completed\"}\n\n",
        ] {
            u.feed(line);
        }
        assert_eq!(u.finish(), Some((33, 8)));
        let mut u = UsageScan::new(true);
        u.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":33,\"output_tokens\":0}}}\n\n");
        u.feed(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":33,\"output_tokens\":8}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
        assert_eq!(u.finish(), Some((33, 8)));
    }
}
