//! A JSON scanner that checks a body's structure and reads only what routing needs.
//!
//! The router must refuse a body that is not JSON, and it reads a handful of fields
//! (`model`, the prompt text, a few flags); everything else goes to the engine as it came.
//! Building a full tree (or typed request) costs an allocation per string and a copy of
//! every byte; this scanner instead walks the text once, checks its syntax (RFC 8259:
//! tokens and structure, strings terminated with no raw control characters and only valid
//! escapes, numbers that follow the grammar, nothing after the value), and hands back
//! borrowed spans of the few values asked for. Values nobody asked for are skipped without
//! recursion, so nesting depth costs a bit of stack per level, not a call frame. String
//! bodies are scanned 16 bytes at a time (SSE2 on x86-64, eight at a time elsewhere).
//!
//! What is checked is what routing relies on. The bytes inside a string are the engine's
//! to judge like any other value: the UTF-8 of a string is checked (and repaired with
//! U+FFFD) only where the router decodes it (`model`, roles, the prompt text within the
//! prefix window), not across a megabyte of prompt it never reads. Outside strings, only
//! ASCII is valid JSON, and anything else is refused. Where Python's `json` (what vLLM
//! parses with) and the RFC differ, the scanner sides with Python: duplicate keys are all
//! visited (the reader keeps the last), and a lone UTF-16 surrogate in a `\u` escape is
//! accepted (decoded as U+FFFD).

use std::borrow::Cow;

use smallvec::SmallVec;

/// Why a body is not JSON, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} at byte {offset}")]
pub struct SyntaxError {
    pub offset: usize,
    pub what: &'static str,
}

pub type Scan<T> = Result<T, SyntaxError>;

/// The JSON type of the next value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Object,
    Array,
    String,
    Number,
    Bool,
    Null,
}

/// A string value as it appears in the text (between the quotes, escapes undecoded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonStr<'a> {
    raw: &'a [u8],
    escaped: bool,
}

impl<'a> JsonStr<'a> {
    /// The bytes between the quotes, escapes undecoded.
    pub fn raw(&self) -> &'a [u8] {
        self.raw
    }

    /// Whether the string equals `s` (with its escapes decoded).
    pub fn is(&self, s: &str) -> bool {
        if self.escaped {
            self.decode() == s
        } else {
            self.raw == s.as_bytes()
        }
    }

    /// The decoded string; borrowed when it has no escapes and is valid UTF-8.
    pub fn decode(&self) -> Cow<'a, str> {
        if !self.escaped {
            return String::from_utf8_lossy(self.raw);
        }
        let mut out = String::with_capacity(self.raw.len());
        self.decode_into(&mut out, usize::MAX);
        Cow::Owned(out)
    }

    /// Appends the decoded string to `out`, stopping before `out` would exceed `max` bytes
    /// (at a character boundary). Only what is appended is read: the bytes are gathered,
    /// then checked as UTF-8 once.
    pub fn decode_into(&self, out: &mut String, max: usize) {
        let room = max.saturating_sub(out.len());
        if room == 0 {
            return;
        }
        let b = self.raw;
        if !self.escaped {
            push_utf8(out, &b[..b.len().min(room)], room);
            return;
        }
        let mut buf: Vec<u8> = Vec::with_capacity(b.len().min(room));
        let mut i = 0;
        while i < b.len() && buf.len() < room {
            let rel = b[i..]
                .iter()
                .position(|&c| c == b'\\')
                .unwrap_or(b.len() - i);
            let take = rel.min(room - buf.len());
            buf.extend_from_slice(&b[i..i + take]);
            i += rel;
            if i >= b.len() || buf.len() >= room {
                break;
            }
            // The scanner checked every escape: `\` is followed by one of `"\/bfnrtu`.
            let (ch, used) = match b.get(i + 1) {
                Some(b'"') => ('"', 2),
                Some(b'\\') => ('\\', 2),
                Some(b'/') => ('/', 2),
                Some(b'b') => ('\u{8}', 2),
                Some(b'f') => ('\u{c}', 2),
                Some(b'n') => ('\n', 2),
                Some(b'r') => ('\r', 2),
                Some(b't') => ('\t', 2),
                _ => unicode_escape(b, i),
            };
            if buf.len() + ch.len_utf8() > room {
                break;
            }
            let mut tmp = [0u8; 4];
            buf.extend_from_slice(ch.encode_utf8(&mut tmp).as_bytes());
            i += used;
        }
        push_utf8(out, &buf, room);
    }
}

/// Appends at most `max` bytes of `bytes` to `out` as text: whole characters only, and
/// U+FFFD for what is not UTF-8.
fn push_utf8(out: &mut String, bytes: &[u8], max: usize) {
    let mut rest = bytes;
    let start = out.len();
    while !rest.is_empty() {
        let room = max.saturating_sub(out.len() - start);
        if room == 0 {
            return;
        }
        match std::str::from_utf8(rest) {
            Ok(text) => {
                out.push_str(prefix_within(text, room));
                return;
            }
            Err(e) => {
                let (good, bad) = rest.split_at(e.valid_up_to());
                // `good` is valid UTF-8 by `valid_up_to`.
                let good = std::str::from_utf8(good).unwrap_or("");
                if good.len() >= room {
                    out.push_str(prefix_within(good, room));
                    return;
                }
                out.push_str(good);
                if out.len() - start + 3 > max {
                    return;
                }
                out.push('\u{fffd}');
                let skip = e.error_len().unwrap_or(bad.len()).max(1);
                rest = &bad[skip.min(bad.len())..];
            }
        }
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends at a character boundary.
fn prefix_within(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn hex4(b: &[u8]) -> Option<u32> {
    let mut v = 0u32;
    for &c in b.get(..4)? {
        v = v * 16 + char::from(c).to_digit(16)?;
    }
    Some(v)
}

/// A `\uXXXX` escape at `i` (and its low surrogate, when it starts a pair): the character
/// and the bytes it took.
fn unicode_escape(b: &[u8], i: usize) -> (char, usize) {
    let Some(hi) = b.get(i + 2..).and_then(hex4) else {
        return ('\u{fffd}', 2);
    };
    if (0xD800..0xDC00).contains(&hi) && b.get(i + 6) == Some(&b'\\') && b.get(i + 7) == Some(&b'u')
    {
        if let Some(lo) = b.get(i + 8..).and_then(hex4) {
            if (0xDC00..0xE000).contains(&lo) {
                let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                return (char::from_u32(c).unwrap_or('\u{fffd}'), 12);
            }
        }
    }
    (char::from_u32(hi).unwrap_or('\u{fffd}'), 6)
}

/// Where the next `"`, `\\` or control character (below 0x20) is, at or after `i`: the
/// bytes a string scan must stop at (`b.len()` when there is none).
#[cfg(target_arch = "x86_64")]
#[inline]
fn string_stop(b: &[u8], i: usize) -> usize {
    // SAFETY: SSE2 is part of the x86-64 baseline: every CPU this code runs on has it.
    unsafe { string_stop_sse2(b, i) }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn string_stop_sse2(b: &[u8], mut i: usize) -> usize {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };
    // SSE2 is part of every x86-64 CPU.
    let quote = _mm_set1_epi8(b'"' as i8);
    let backslash = _mm_set1_epi8(b'\\' as i8);
    let control = _mm_set1_epi8(0x1f);
    while let Some(chunk) = b.get(i..i + 16) {
        // SAFETY: `chunk` is 16 readable bytes, and an unaligned load reads exactly those.
        let x = unsafe { _mm_loadu_si128(chunk.as_ptr().cast()) };
        let hits = _mm_or_si128(
            _mm_or_si128(_mm_cmpeq_epi8(x, quote), _mm_cmpeq_epi8(x, backslash)),
            // min(x, 0x1f) == x exactly when x <= 0x1f (unsigned).
            _mm_cmpeq_epi8(_mm_min_epu8(x, control), x),
        );
        let mask = _mm_movemask_epi8(hits);
        if mask != 0 {
            return i + mask.trailing_zeros() as usize;
        }
        i += 16;
    }
    string_stop_bytes(b, i)
}

/// [`string_stop`] eight bytes at a time, for other targets.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn string_stop(b: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    // The high bit of each byte that is zero, with no false positives.
    let zero = |x: u64| !(((x & LOW7).wrapping_add(LOW7)) | x | LOW7);
    while let Some(chunk) = b.get(i..i + 8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        let x = u64::from_le_bytes(w);
        let hits = zero(x ^ (u64::from(b'"') * ONES))
            | zero(x ^ (u64::from(b'\\') * ONES))
            | zero(x & (0xe0 * ONES));
        if hits != 0 {
            return i + (hits.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    string_stop_bytes(b, i)
}

fn string_stop_bytes(b: &[u8], i: usize) -> usize {
    b[i.min(b.len())..]
        .iter()
        .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
        .map_or(b.len(), |p| i + p)
}

/// A cursor over one JSON text.
pub struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    /// A scanner over `body`.
    pub fn new(body: &'a [u8]) -> Scan<Scanner<'a>> {
        Ok(Scanner { b: body, i: 0 })
    }

    fn err<T>(&self, what: &'static str) -> Scan<T> {
        Err(SyntaxError {
            offset: self.i,
            what,
        })
    }

    /// Where the cursor is.
    pub fn offset(&self) -> usize {
        self.i
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    fn expect(&mut self, c: u8, what: &'static str) -> Scan<()> {
        self.ws();
        if self.b.get(self.i) == Some(&c) {
            self.i += 1;
            Ok(())
        } else {
            self.err(what)
        }
    }

    /// The type of the next value.
    pub fn kind(&mut self) -> Scan<Kind> {
        self.ws();
        Ok(match self.b.get(self.i) {
            Some(b'{') => Kind::Object,
            Some(b'[') => Kind::Array,
            Some(b'"') => Kind::String,
            Some(b't' | b'f') => Kind::Bool,
            Some(b'n') => Kind::Null,
            Some(b'-' | b'0'..=b'9') => Kind::Number,
            Some(_) => return self.err("expected a value"),
            None => return self.err("unexpected end"),
        })
    }

    /// Nothing but whitespace is left.
    pub fn end(&mut self) -> Scan<()> {
        self.ws();
        if self.i == self.b.len() {
            Ok(())
        } else {
            self.err("trailing characters")
        }
    }

    /// A string value.
    pub fn string(&mut self) -> Scan<JsonStr<'a>> {
        self.expect(b'"', "expected a string")?;
        let start = self.i;
        let escaped = self.string_body()?;
        Ok(JsonStr {
            raw: &self.b[start..self.i - 1],
            escaped,
        })
    }

    /// After an opening quote: to just past the closing one. Returns whether the string
    /// has escapes.
    fn string_body(&mut self) -> Scan<bool> {
        let b = self.b;
        let mut i = self.i;
        let mut escaped = false;
        loop {
            i = string_stop(b, i);
            match b.get(i) {
                None => {
                    self.i = i;
                    return self.err("unterminated string");
                }
                Some(b'"') => {
                    self.i = i + 1;
                    return Ok(escaped);
                }
                Some(b'\\') => {
                    escaped = true;
                    match b.get(i + 1) {
                        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 2,
                        Some(b'u') if b.get(i + 2..).and_then(hex4).is_some() => i += 6,
                        _ => {
                            self.i = i;
                            return self.err("invalid escape");
                        }
                    }
                }
                Some(_) => {
                    self.i = i;
                    return self.err("control character in a string");
                }
            }
        }
    }

    /// A number, as its text.
    pub fn number(&mut self) -> Scan<&'a str> {
        self.ws();
        let start = self.i;
        let b = self.b;
        let digits = |i: &mut usize| {
            let s = *i;
            while b.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            *i > s
        };
        let mut i = self.i;
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                digits(&mut i);
            }
            _ => {
                self.i = i;
                return self.err("invalid number");
            }
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            if !digits(&mut i) {
                self.i = i;
                return self.err("invalid number");
            }
        }
        if let Some(b'e' | b'E') = b.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = b.get(i) {
                i += 1;
            }
            if !digits(&mut i) {
                self.i = i;
                return self.err("invalid number");
            }
        }
        self.i = i;
        // Only ASCII digits, signs, `.` and `e` were taken.
        Ok(std::str::from_utf8(&b[start..i]).unwrap_or("0"))
    }

    fn literal(&mut self) -> Scan<Kind> {
        self.ws();
        for (lit, kind) in [
            (&b"true"[..], Kind::Bool),
            (b"false", Kind::Bool),
            (b"null", Kind::Null),
        ] {
            if self.b[self.i..].starts_with(lit) {
                self.i += lit.len();
                return Ok(kind);
            }
        }
        self.err("invalid literal")
    }

    /// A `true` or `false`; `None` (and the value skipped) for anything else.
    pub fn bool_or_skip(&mut self) -> Scan<Option<bool>> {
        self.ws();
        if self.b[self.i..].starts_with(b"true") {
            self.i += 4;
            Ok(Some(true))
        } else if self.b[self.i..].starts_with(b"false") {
            self.i += 5;
            Ok(Some(false))
        } else {
            self.skip().map(|()| None)
        }
    }

    /// A string; `None` (and the value skipped) for anything else.
    pub fn str_or_skip(&mut self) -> Scan<Option<JsonStr<'a>>> {
        if self.kind()? == Kind::String {
            self.string().map(Some)
        } else {
            self.skip().map(|()| None)
        }
    }

    /// An integer; `None` (and the value skipped) for anything else, fractions and
    /// out-of-range numbers included.
    pub fn int_or_skip(&mut self) -> Scan<Option<i64>> {
        if self.kind()? == Kind::Number {
            Ok(self.number()?.parse().ok())
        } else {
            self.skip().map(|()| None)
        }
    }

    /// Skips one value of any type, checking its syntax.
    pub fn skip(&mut self) -> Scan<()> {
        // `true` for an object, `false` for an array: what closes each open container.
        let mut open: SmallVec<[bool; 32]> = SmallVec::new();
        'value: loop {
            match self.kind()? {
                Kind::Object => {
                    self.i += 1;
                    self.ws();
                    if self.b.get(self.i) == Some(&b'}') {
                        self.i += 1;
                    } else {
                        open.push(true);
                        self.key()?;
                        continue 'value;
                    }
                }
                Kind::Array => {
                    self.i += 1;
                    self.ws();
                    if self.b.get(self.i) == Some(&b']') {
                        self.i += 1;
                    } else {
                        open.push(false);
                        continue 'value;
                    }
                }
                Kind::String => {
                    self.i += 1;
                    self.string_body()?;
                }
                Kind::Number => {
                    self.number()?;
                }
                Kind::Bool | Kind::Null => {
                    self.literal()?;
                }
            }
            // A value ended: close what ends with it, or move to the next member.
            loop {
                let Some(&is_object) = open.last() else {
                    return Ok(());
                };
                self.ws();
                match self.b.get(self.i) {
                    Some(b',') => {
                        self.i += 1;
                        if is_object {
                            self.key()?;
                        }
                        continue 'value;
                    }
                    Some(b'}') if is_object => {
                        self.i += 1;
                        open.pop();
                    }
                    Some(b']') if !is_object => {
                        self.i += 1;
                        open.pop();
                    }
                    _ => return self.err("expected `,` or the container's end"),
                }
            }
        }
    }

    /// An object key and its colon.
    fn key(&mut self) -> Scan<JsonStr<'a>> {
        let k = self.string()?;
        self.expect(b':', "expected `:`")?;
        Ok(k)
    }

    /// The bytes from `start` (an earlier [`Scanner::offset`]) to the cursor.
    pub fn since(&self, start: usize) -> &'a [u8] {
        self.b.get(start..self.i).unwrap_or_default()
    }

    /// Skips one value and returns its bytes.
    pub fn span(&mut self) -> Scan<&'a [u8]> {
        self.ws();
        let start = self.i;
        self.skip()?;
        Ok(&self.b[start..self.i])
    }

    /// An object: `member` is called with each key and must consume its value.
    pub fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, JsonStr<'a>) -> Scan<()>,
    ) -> Scan<()> {
        self.expect(b'{', "expected an object")?;
        self.ws();
        if self.b.get(self.i) == Some(&b'}') {
            self.i += 1;
            return Ok(());
        }
        loop {
            let k = self.key()?;
            member(self, k)?;
            self.ws();
            match self.b.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return self.err("expected `,` or `}`"),
            }
        }
    }

    /// An array: `element` is called with each index and must consume the element.
    pub fn array(&mut self, mut element: impl FnMut(&mut Self, usize) -> Scan<()>) -> Scan<()> {
        self.expect(b'[', "expected an array")?;
        self.ws();
        if self.b.get(self.i) == Some(&b']') {
            self.i += 1;
            return Ok(());
        }
        let mut n = 0;
        loop {
            element(self, n)?;
            n += 1;
            self.ws();
            match self.b.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return self.err("expected `,` or `]`"),
            }
        }
    }
}

/// Whether `body` is one JSON value and nothing else.
pub fn is_json(body: &[u8]) -> bool {
    Scanner::new(body)
        .and_then(|mut s| {
            s.skip()?;
            s.end()
        })
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn agrees_with_serde(text: &str) {
        let ours = is_json(text.as_bytes());
        let serde = serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok();
        assert_eq!(ours, serde, "{text:?}");
    }

    #[test]
    fn accepts_and_refuses_like_a_json_parser() {
        for t in [
            "{}",
            "[]",
            " {\"a\": [1, -2.5e3, true, false, null, \"x\\n\\u00e9\"]} ",
            "\"\"",
            "0",
            "-0.0E+1",
            "{\"a\":{\"b\":{\"c\":[[[]]]}}}",
            "{",
            "{\"a\"}",
            "{\"a\":}",
            "[1,]",
            "{\"a\":1,}",
            "01",
            "1.",
            "-",
            ".5",
            "1e",
            "tru",
            "nul",
            "\"\\x\"",
            "\"\\u12\"",
            "\"a\u{1}b\"",
            "{} x",
            "",
            "   ",
            "[1 2]",
            "{\"a\" 1}",
            "{1:2}",
        ] {
            agrees_with_serde(t);
        }
    }

    #[test]
    fn string_bytes_are_read_only_where_decoded() {
        // Invalid UTF-8 inside a string is the engine's to judge; outside, it is not JSON.
        assert!(is_json(b"{\"prompt\": \"a\xffb\"}"));
        assert!(!is_json(b"{\"prompt\": 1\xff}"));
        let mut s = Scanner::new(b"\"a\xffb\\n\"").unwrap();
        assert_eq!(s.string().unwrap().decode(), "a\u{fffd}b\n");
        // Every stop byte is found wherever it falls in a 16-byte block.
        for at in 0..40 {
            let mut text = vec![b'"'];
            text.extend(std::iter::repeat_n(b'x', at));
            text.push(b'"');
            let mut s = Scanner::new(&text).unwrap();
            assert_eq!(s.string().unwrap().raw().len(), at);
            text.insert(1 + at / 2, 0x01);
            assert!(!is_json(&text), "a control character at {at}");
        }
    }

    #[test]
    fn deep_nesting_is_skipped_without_recursion() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(is_json(deep.as_bytes()));
        let unbalanced = format!("{}{}", "[".repeat(1000), "]".repeat(999));
        assert!(!is_json(unbalanced.as_bytes()));
    }

    #[test]
    fn strings_decode_and_compare() {
        let mut s = Scanner::new(br#""a\"b\\c\u00e9\ud83d\ude00\n""#).unwrap();
        let j = s.string().unwrap();
        assert_eq!(j.decode(), "a\"b\\c\u{e9}\u{1f600}\n");
        assert!(j.is("a\"b\\c\u{e9}\u{1f600}\n"));
        let mut s = Scanner::new(br#""mod\u0065l""#).unwrap();
        assert!(s.string().unwrap().is("model"));
        // A lone surrogate is accepted, as Python's json accepts it.
        let mut s = Scanner::new(br#""\ud800x""#).unwrap();
        assert_eq!(s.string().unwrap().decode(), "\u{fffd}x");
    }

    #[test]
    fn decoding_stops_at_the_bound_on_a_character_boundary() {
        let mut s = Scanner::new("\"h\u{e9}llo\\nw\"".as_bytes()).unwrap();
        let j = s.string().unwrap();
        let mut out = String::new();
        j.decode_into(&mut out, 2);
        assert_eq!(out, "h");
        let mut out = String::new();
        j.decode_into(&mut out, 7);
        assert_eq!(out, "h\u{e9}llo\n");
        let mut out = String::new();
        j.decode_into(&mut out, 100);
        assert_eq!(out, "h\u{e9}llo\nw");
    }

    #[test]
    fn objects_arrays_and_spans() {
        let body = br#"{"model": "m", "n": [1, 2], "x": {"y": null}}"#;
        let mut s = Scanner::new(body).unwrap();
        let mut seen = Vec::new();
        s.object(|s, k| {
            match &*k.decode() {
                "model" => seen.push(format!("model={}", s.string()?.decode())),
                "n" => s.array(|s, i| {
                    seen.push(format!("n{i}={}", s.number()?));
                    Ok(())
                })?,
                k => seen.push(format!("{k}={}", String::from_utf8_lossy(s.span()?))),
            }
            Ok(())
        })
        .unwrap();
        s.end().unwrap();
        assert_eq!(seen, ["model=m", "n0=1", "n1=2", r#"x={"y": null}"#]);
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i64>().prop_map(|n| serde_json::json!(n)),
            (-1e6f64..1e6).prop_map(|f| serde_json::json!(f)),
            ".{0,12}".prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                prop::collection::btree_map(".{0,6}", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn every_serialized_value_is_json_and_every_cut_agrees(v in json_value(), cut in 0usize..200) {
            let text = serde_json::to_string_pretty(&v).unwrap();
            prop_assert!(is_json(text.as_bytes()));
            let mut end = cut.min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            agrees_with_serde(&text[..end]);
        }

        #[test]
        fn arbitrary_text_agrees_with_serde(t in "[\\[\\]{}\",:0-9a-z.eE+\\- \\\\]{0,24}") {
            agrees_with_serde(&t);
        }

        #[test]
        fn decoded_strings_equal_serde(s in ".{0,40}") {
            let text = serde_json::to_string(&s).unwrap();
            let mut sc = Scanner::new(text.as_bytes()).unwrap();
            prop_assert_eq!(sc.string().unwrap().decode(), s);
        }
    }
}
