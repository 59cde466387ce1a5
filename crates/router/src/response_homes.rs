//! Stored responses and the replica that holds each. An engine keeps a Responses API
//! answer (`store`, `background`) in its own memory: a later `GET /v1/responses/{id}`, a
//! cancel, or a request that continues it (`previous_response_id`) can only be answered
//! there. The router remembers, for each response id it relayed, the endpoint that made
//! it, in a bounded table (oldest forgotten first).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Response ids remembered at most.
pub const MAX_HOMES: usize = 65_536;
/// Bytes of an answer's start searched for its id.
const MAX_ID_SCAN: usize = 64 << 10;

/// Response id → the base URL of the endpoint that holds it.
#[derive(Debug)]
pub struct ResponseHomes {
    homes: HashMap<String, Arc<str>>,
    order: VecDeque<String>,
    capacity: usize,
}

impl Default for ResponseHomes {
    fn default() -> Self {
        ResponseHomes::new(MAX_HOMES)
    }
}

impl ResponseHomes {
    pub fn new(capacity: usize) -> ResponseHomes {
        ResponseHomes {
            homes: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    pub fn insert(&mut self, id: String, url: Arc<str>) {
        if self.homes.insert(id.clone(), url).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.homes.remove(&old);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<&Arc<str>> {
        self.homes.get(id)
    }

    pub fn len(&self) -> usize {
        self.homes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.homes.is_empty()
    }
}

/// Finds a response's id at the start of its answer: the first `"id"` member, which is
/// the response's own in a JSON answer (`{"id":"resp_…"`) and in a stream's first event
/// (`{"response":{"id":"resp_…"`).
#[derive(Debug, Default)]
pub struct ResponseIdScan {
    buf: Vec<u8>,
    done: bool,
}

impl ResponseIdScan {
    /// Feeds the next chunk; the id once it has been seen (then nothing more).
    pub fn feed(&mut self, chunk: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        self.buf.extend_from_slice(chunk);
        let found = first_id(&self.buf);
        if found.is_some() || self.buf.len() > MAX_ID_SCAN {
            self.done = true;
            self.buf = Vec::new();
        }
        found
    }
}

/// The value of the first `"id": "…"` member in `text`, when it is complete.
fn first_id(text: &[u8]) -> Option<String> {
    const KEY: &[u8] = b"\"id\"";
    let at = text.windows(KEY.len()).position(|w| w == KEY)?;
    let rest = text[at + KEY.len()..]
        .trim_ascii_start()
        .strip_prefix(b":")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
    let end = rest.iter().position(|&c| c == b'"' || c == b'\\')?;
    if rest[end] != b'"' || end == 0 {
        return None;
    }
    std::str::from_utf8(&rest[..end]).ok().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_home_is_forgotten_first() {
        let mut h = ResponseHomes::new(2);
        h.insert("a".into(), "http://x".into());
        h.insert("b".into(), "http://y".into());
        h.insert("a".into(), "http://z".into());
        h.insert("c".into(), "http://w".into());
        assert!(h.get("a").is_none());
        assert_eq!(h.get("b").map(|u| &**u), Some("http://y"));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn the_id_is_found_across_chunks_in_json_and_streams() {
        let mut s = ResponseIdScan::default();
        assert_eq!(s.feed(b"{\"id\": \"resp_"), None);
        assert_eq!(
            s.feed(b"12\",\"object\":\"response\"}").as_deref(),
            Some("resp_12")
        );
        assert_eq!(s.feed(b"{\"id\":\"other\"}"), None);
        let mut s = ResponseIdScan::default();
        let sse = b"event: response.created\ndata: {\"response\":{\"id\":\"resp_a8e2\",\"created_at\":1},\"type\":\"response.created\"}\n\n";
        assert_eq!(s.feed(sse).as_deref(), Some("resp_a8e2"));
    }
}
