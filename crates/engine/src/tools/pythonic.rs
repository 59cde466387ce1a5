//! Pythonic calls (Llama 3.2 / 4): the whole output is a Python list of calls,
//! `[get_weather(city="Paris"), get_time()]`, with keyword arguments that are Python
//! literals. Arguments become JSON objects, so a call is sent whole once its `)` closes.

use serde_json::{Map, Number, Value};

use super::json_scan::skip_ws;
use super::{CallView, View};

/// Why a literal could not be read.
#[derive(Debug, PartialEq)]
enum Lit {
    /// The text ends inside it.
    Incomplete,
    /// It is not a Python literal.
    Bad,
}

pub(super) fn view(text: &str, done: bool) -> View {
    let start = skip_ws(text, 0);
    if start == text.len() && !done {
        return View::default();
    }
    if !text[start..].starts_with('[') {
        return View {
            content: text.to_string(),
            ..View::default()
        };
    }
    let mut view = View::default();
    let b = text.as_bytes();
    let mut pos = start + 1;
    let mut closed = false;
    loop {
        pos = skip_ws(text, pos);
        if b.get(pos) == Some(&b',') {
            pos += 1;
            continue;
        }
        match b.get(pos) {
            None => break,
            Some(b']') => {
                closed = skip_ws(text, pos + 1) == text.len();
                break;
            }
            Some(_) => {}
        }
        view.opened += 1;
        match call(text, pos) {
            Ok((c, end)) => {
                view.calls.push(c);
                pos = end;
            }
            Err(_) => break,
        }
    }
    if done && !closed {
        // Not a closed list of calls: the final check turns it into content.
        view.opened += 1;
    }
    view
}

/// `name(k=v, ...)` at `i`.
fn call(s: &str, i: usize) -> Result<(CallView, usize), Lit> {
    let b = s.as_bytes();
    let mut j = i;
    while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_' || b[j] == b'.') {
        j += 1;
    }
    if j == b.len() {
        return Err(Lit::Incomplete);
    }
    if j == i || b[j] != b'(' {
        return Err(Lit::Bad);
    }
    let name = s[i..j].to_string();
    let mut args = Map::new();
    let mut pos = j + 1;
    loop {
        pos = skip_ws(s, pos);
        match b.get(pos) {
            None => return Err(Lit::Incomplete),
            Some(b')') => {
                let call = CallView {
                    name,
                    arguments: Value::Object(args).to_string(),
                    done: true,
                };
                return Ok((call, pos + 1));
            }
            Some(b',') => {
                pos += 1;
                continue;
            }
            Some(_) => {}
        }
        let k0 = pos;
        while pos < b.len() && (b[pos].is_ascii_alphanumeric() || b[pos] == b'_') {
            pos += 1;
        }
        let key = s[k0..pos].to_string();
        pos = skip_ws(s, pos);
        match b.get(pos) {
            None => return Err(Lit::Incomplete),
            Some(b'=') if !key.is_empty() => {}
            Some(_) => return Err(Lit::Bad),
        }
        let (v, end) = literal(s, skip_ws(s, pos + 1))?;
        args.insert(key, v);
        pos = end;
    }
}

/// A whole text that is one Python literal, as JSON (`None` when it is not one).
pub(super) fn literal_text(s: &str) -> Option<Value> {
    // A bare word is complete only before a delimiter.
    let padded = format!("{s} ");
    match literal(&padded, skip_ws(&padded, 0)) {
        Ok((v, end)) if skip_ws(&padded, end) == padded.len() => Some(v),
        _ => None,
    }
}

/// A Python literal at `i` as JSON: strings, numbers, `True`/`False`/`None`, lists,
/// tuples and dicts.
fn literal(s: &str, i: usize) -> Result<(Value, usize), Lit> {
    let b = s.as_bytes();
    match b.get(i) {
        None => Err(Lit::Incomplete),
        Some(&q @ (b'"' | b'\'')) => string(s, i, q),
        Some(b'[') => sequence(s, i + 1, b']'),
        Some(b'(') => sequence(s, i + 1, b')'),
        Some(b'{') => dict(s, i + 1),
        Some(_) => {
            let mut j = i;
            while j < b.len() && !b",)]}: \t\r\n".contains(&b[j]) {
                j += 1;
            }
            if j == b.len() {
                return Err(Lit::Incomplete);
            }
            let word = &s[i..j];
            let v = match word {
                "True" => Value::Bool(true),
                "False" => Value::Bool(false),
                "None" => Value::Null,
                _ => {
                    if let Ok(n) = word.parse::<i64>() {
                        Value::from(n)
                    } else {
                        let f: f64 = word.parse().map_err(|_| Lit::Bad)?;
                        Value::Number(Number::from_f64(f).ok_or(Lit::Bad)?)
                    }
                }
            };
            Ok((v, j))
        }
    }
}

fn string(s: &str, i: usize, quote: u8) -> Result<(Value, usize), Lit> {
    let mut out = String::new();
    let mut chars = s[i + 1..].char_indices();
    while let Some((k, c)) = chars.next() {
        match c {
            '\\' => {
                let Some((_, e)) = chars.next() else {
                    return Err(Lit::Incomplete);
                };
                out.push(match e {
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    '0' => '\0',
                    other => other,
                });
            }
            c if c as u32 == quote as u32 => return Ok((Value::String(out), i + 1 + k + 1)),
            c => out.push(c),
        }
    }
    Err(Lit::Incomplete)
}

fn sequence(s: &str, mut pos: usize, close: u8) -> Result<(Value, usize), Lit> {
    let b = s.as_bytes();
    let mut items = Vec::new();
    loop {
        pos = skip_ws(s, pos);
        match b.get(pos) {
            None => return Err(Lit::Incomplete),
            Some(&c) if c == close => return Ok((Value::Array(items), pos + 1)),
            Some(b',') => pos += 1,
            Some(_) => {
                let (v, end) = literal(s, pos)?;
                items.push(v);
                pos = end;
            }
        }
    }
}

fn dict(s: &str, mut pos: usize) -> Result<(Value, usize), Lit> {
    let b = s.as_bytes();
    let mut map = Map::new();
    loop {
        pos = skip_ws(s, pos);
        match b.get(pos) {
            None => return Err(Lit::Incomplete),
            Some(b'}') => return Ok((Value::Object(map), pos + 1)),
            Some(b',') => pos += 1,
            Some(_) => {
                let (k, end) = literal(s, pos)?;
                let Value::String(k) = k else {
                    return Err(Lit::Bad);
                };
                pos = skip_ws(s, end);
                match b.get(pos) {
                    None => return Err(Lit::Incomplete),
                    Some(b':') => {}
                    Some(_) => return Err(Lit::Bad),
                }
                let (v, end) = literal(s, skip_ws(s, pos + 1))?;
                map.insert(k, v);
                pos = end;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::check_all_chunkings;
    use super::super::ToolParser;
    use serde_json::{json, Value};

    fn args(a: &str) -> Value {
        serde_json::from_str(a).expect("arguments are JSON")
    }

    #[test]
    fn calls_with_python_literals() {
        let text = "[get_weather(city='Paris', days=3, metric=True), search(q=\"a, b)\", tags=['x', \"y\"], opts={'k': None, 'f': 1.5})]";
        let p = check_all_chunkings(ToolParser::Pythonic, text);
        assert_eq!(p.content, None);
        assert_eq!(p.calls.len(), 2);
        assert_eq!(
            args(&p.calls[0].arguments),
            json!({"city": "Paris", "days": 3, "metric": true})
        );
        assert_eq!(p.calls[1].name, "search");
        assert_eq!(
            args(&p.calls[1].arguments),
            json!({"q": "a, b)", "tags": ["x", "y"], "opts": {"k": null, "f": 1.5}})
        );
    }

    #[test]
    fn no_arguments() {
        let p = check_all_chunkings(ToolParser::Pythonic, "[now()]");
        assert_eq!(p.calls[0].arguments, "{}");
    }

    #[test]
    fn text_and_broken_lists_are_content() {
        let p = check_all_chunkings(ToolParser::Pythonic, "Paris is sunny.");
        assert_eq!(p.content.as_deref(), Some("Paris is sunny."));
        let p = ToolParser::Pythonic.parse("[1, 2, 3]", &[], || "id".into());
        assert!(p.calls.is_empty());
        assert_eq!(p.content.as_deref(), Some("[1, 2, 3]"));
        let p = ToolParser::Pythonic.parse("[f(a=1)", &[], || "id".into());
        assert!(p.calls.is_empty());
    }
}
