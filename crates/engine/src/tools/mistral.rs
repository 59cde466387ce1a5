//! Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {..}}, ..]`; content is the text
//! before the marker. (`[TOOL_CALLS]` is a special token in Mistral's tokenizers: serve
//! with `skip_special_tokens: false` so it reaches the parser.)

use super::json_scan::{scan_call, skip_ws, split_at_start};
use super::View;

pub(super) const START: &str = "[TOOL_CALLS]";

pub(super) fn view(text: &str, done: bool) -> View {
    let (mut view, after) = match split_at_start(text, START, done) {
        Ok(split) => split,
        Err(all_content) => return all_content,
    };
    let b = text.as_bytes();
    let mut pos = skip_ws(text, after);
    if b.get(pos) == Some(&b'[') {
        pos += 1;
    }
    loop {
        pos = skip_ws(text, pos);
        while pos < b.len() && b[pos] == b',' {
            pos = skip_ws(text, pos + 1);
        }
        if pos >= b.len() || b[pos] == b']' {
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
    fn list_of_calls() {
        let text = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
        let p = check_all_chunkings(ToolParser::Mistral, text);
        assert_eq!(p.content, None);
        let names: Vec<&str> = p.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["get_weather", "get_time"]);
    }

    #[test]
    fn content_before_the_marker() {
        let text = "Sure. [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"q\": \"[x]\"}}]";
        let p = check_all_chunkings(ToolParser::Mistral, text);
        assert_eq!(p.content.as_deref(), Some("Sure. "));
        assert_eq!(p.calls[0].arguments, r#"{"q": "[x]"}"#);
    }

    #[test]
    fn no_marker_is_content() {
        let p = check_all_chunkings(ToolParser::Mistral, "[1, 2] is a list");
        assert_eq!(p.content.as_deref(), Some("[1, 2] is a list"));
    }
}
