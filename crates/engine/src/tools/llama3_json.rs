//! Llama 3.x JSON calls: the whole output is `{"name": "f", "parameters": {..}}`
//! (optionally after `<|python_tag|>`), several joined by `; `. Output that does not open
//! with a call is content.

use super::json_scan::{scan_call, skip_ws};
use super::View;

pub(super) const PYTHON_TAG: &str = "<|python_tag|>";

pub(super) fn view(text: &str, done: bool) -> View {
    let start = skip_ws(text, 0);
    let rest = &text[start..];
    if rest.is_empty() || (!done && PYTHON_TAG.starts_with(rest)) {
        // Nothing yet says whether this is a call.
        return View {
            content: if done {
                text.to_string()
            } else {
                String::new()
            },
            ..View::default()
        };
    }
    let body_start = match rest.strip_prefix(PYTHON_TAG) {
        Some(_) => start + PYTHON_TAG.len(),
        None if rest.starts_with('{') => start,
        None => {
            return View {
                content: text.to_string(),
                ..View::default()
            }
        }
    };
    let mut view = View::default();
    let b = text.as_bytes();
    let mut pos = body_start;
    loop {
        pos = skip_ws(text, pos);
        while pos < b.len() && matches!(b[pos], b';' | b',') {
            pos = skip_ws(text, pos + 1);
        }
        if pos >= b.len() {
            break;
        }
        view.opened += 1;
        let (call, end) = scan_call(text, pos, done);
        view.calls.extend(call);
        match end {
            Some(e) => pos = e,
            None => break,
        }
    }
    view
}

#[cfg(test)]
mod tests {
    use super::super::test_util::check_all_chunkings;
    use super::super::ToolParser;

    #[test]
    fn calls_joined_by_semicolons() {
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {\"tz\": \"CET\"}}";
        let p = check_all_chunkings(ToolParser::Llama3Json, text);
        assert_eq!(p.content, None);
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[1].name, "get_time");
        assert_eq!(p.calls[1].arguments, r#"{"tz": "CET"}"#);
    }

    #[test]
    fn python_tag_prefix() {
        let text = "<|python_tag|>{\"name\": \"f\", \"arguments\": {\"a\": 1}}";
        let p = check_all_chunkings(ToolParser::Llama3Json, text);
        assert_eq!(p.calls[0].arguments, r#"{"a": 1}"#);
    }

    #[test]
    fn text_is_content() {
        let p = check_all_chunkings(ToolParser::Llama3Json, "The weather is {mild}.");
        assert_eq!(p.content.as_deref(), Some("The weather is {mild}."));
        let p = check_all_chunkings(ToolParser::Llama3Json, "{\"answer\": 42}");
        assert!(p.calls.is_empty(), "JSON that is not a call stays content");
    }
}
