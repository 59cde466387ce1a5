//! A tolerant scanner over JSON text that may still be growing: where a value ends (or
//! that it has not ended yet), and the `{"name": ..., "arguments": ...}` call objects the
//! JSON-based parsers share. Arguments are kept as the model wrote them, so a streamed
//! prefix is always a prefix of the final string.

use serde_json::Value;

use super::{CallView, View};

/// Where a value starting at some index ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scan {
    /// The value ends before this byte index.
    Complete(usize),
    /// The text ends inside the value.
    Partial,
}

/// The first index at or after `i` that is not JSON whitespace.
pub(super) fn skip_ws(s: &str, mut i: usize) -> usize {
    let b = s.as_bytes();
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\r' | b'\n') {
        i += 1;
    }
    i
}

/// The end of the value starting at `start`. A bare scalar (number, `true`, ...) running
/// to the end of the text is complete only when the text is (`done`).
pub(super) fn value_end(s: &str, start: usize, done: bool) -> Scan {
    let b = s.as_bytes();
    let Some(&first) = b.get(start) else {
        return Scan::Partial;
    };
    match first {
        b'"' => string_end(b, start),
        b'{' | b'[' => nested_end(b, start),
        _ => {
            let mut i = start;
            while i < b.len() && !b",}]; \t\r\n)".contains(&b[i]) {
                i += 1;
            }
            if i == b.len() && !done {
                Scan::Partial
            } else {
                Scan::Complete(i)
            }
        }
    }
}

fn string_end(b: &[u8], start: usize) -> Scan {
    let mut i = start + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Scan::Complete(i + 1),
            _ => i += 1,
        }
    }
    Scan::Partial
}

fn nested_end(b: &[u8], start: usize) -> Scan {
    let mut depth = 0usize;
    let mut i = start;
    while i < b.len() {
        match b[i] {
            b'"' => match string_end(b, i) {
                Scan::Complete(e) => {
                    i = e;
                    continue;
                }
                Scan::Partial => return Scan::Partial,
            },
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Scan::Complete(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    Scan::Partial
}

/// A call object `{"name": "f", "arguments"|"parameters": {...}}` starting at `i` (after
/// whitespace): the call as far as it is known (`None` until its name is), and the index
/// past its closing brace once it has one.
pub(super) fn scan_call(s: &str, i: usize, done: bool) -> (Option<CallView>, Option<usize>) {
    let b = s.as_bytes();
    let mut i = skip_ws(s, i);
    if b.get(i) != Some(&b'{') {
        return (None, None);
    }
    i += 1;
    let mut name: Option<String> = None;
    let mut arguments: Option<String> = None;
    let mut end = None;
    loop {
        i = skip_ws(s, i);
        match b.get(i) {
            None => break,
            Some(b'}') => {
                end = Some(i + 1);
                break;
            }
            Some(b',') => {
                i += 1;
                continue;
            }
            Some(_) => {}
        }
        let Scan::Complete(key_end) = value_end(s, i, done) else {
            break;
        };
        let key: String = match serde_json::from_str(&s[i..key_end]) {
            Ok(k) => k,
            Err(_) => break,
        };
        i = skip_ws(s, key_end);
        if b.get(i) != Some(&b':') {
            break;
        }
        i = skip_ws(s, i + 1);
        if i >= b.len() {
            break;
        }
        let scan = value_end(s, i, done);
        match (key.as_str(), scan) {
            ("name", Scan::Complete(e)) => {
                match serde_json::from_str::<Value>(&s[i..e]) {
                    Ok(Value::String(n)) => name = Some(n),
                    _ => break,
                }
                i = e;
            }
            ("arguments" | "parameters", Scan::Complete(e)) => {
                arguments = Some(s[i..e].to_string());
                i = e;
            }
            ("arguments" | "parameters", Scan::Partial) => {
                if matches!(b[i], b'{' | b'[' | b'"') {
                    arguments = Some(s[i..].to_string());
                }
                break;
            }
            (_, Scan::Complete(e)) => i = e,
            (_, Scan::Partial) => break,
        }
    }
    let call = name.map(|name| CallView {
        name,
        arguments: match (&arguments, end) {
            (Some(a), _) => a.clone(),
            (None, Some(_)) => "{}".to_string(),
            (None, None) => String::new(),
        },
        done: end.is_some(),
    });
    (call, end)
}

/// Splits `text` at the first `start` tag: `Ok` with a view whose content is the text
/// before it and the offset just after the tag, or `Err` with the whole answer when there
/// is no tag (all of it content, less a tail that could still become the tag while `text`
/// is not `done`).
pub(super) fn split_at_start(text: &str, start: &str, done: bool) -> Result<(View, usize), View> {
    let Some(first) = text.find(start) else {
        let held = if done { 0 } else { partial_tag(text, start) };
        return Err(View {
            content: text[..text.len() - held].to_string(),
            ..View::default()
        });
    };
    let view = View {
        content: text[..first].to_string(),
        ..View::default()
    };
    Ok((view, first + start.len()))
}

/// How many bytes at the end of `text` could be the start of `tag` (held back from
/// streamed content until the next text settles it).
pub(super) fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_ends() {
        assert_eq!(value_end(r#"{"a": "}"}x"#, 0, false), Scan::Complete(10));
        assert_eq!(value_end(r#"{"a": [1, 2"#, 0, false), Scan::Partial);
        assert_eq!(value_end("12", 0, false), Scan::Partial);
        assert_eq!(value_end("12", 0, true), Scan::Complete(2));
        assert_eq!(value_end(r#""a\"b" "#, 0, false), Scan::Complete(6));
    }

    #[test]
    fn calls_scan_partially() {
        let s = r#"{"name": "f", "arguments": {"x": "ab"#;
        let (c, end) = scan_call(s, 0, false);
        let c = c.expect("name known");
        assert_eq!(
            (c.name.as_str(), c.arguments.as_str()),
            ("f", r#"{"x": "ab"#)
        );
        assert_eq!(end, None);
        let (c, end) = scan_call(r#" {"arguments": {}, "name": "g"} tail"#, 0, false);
        assert_eq!(c.map(|c| c.name), Some("g".into()));
        assert_eq!(end, Some(31));
    }

    #[test]
    fn tags_held_back() {
        assert_eq!(partial_tag("hello <tool", "<tool_call>"), 5);
        assert_eq!(partial_tag("hello", "<tool_call>"), 0);
    }
}
