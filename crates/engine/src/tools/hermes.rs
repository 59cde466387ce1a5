//! Hermes / Qwen 2.5: `<tool_call>\n{"name": "f", "arguments": {..}}\n</tool_call>`,
//! one block per call; content is the text before the first block.

use super::json_scan::{scan_call, split_at_start};
use super::View;

pub(super) const START: &str = "<tool_call>";
pub(super) const END: &str = "</tool_call>";

pub(super) fn view(text: &str, done: bool) -> View {
    let (mut view, mut pos) = match split_at_start(text, START, done) {
        Ok(split) => split,
        Err(all_content) => return all_content,
    };
    loop {
        view.opened += 1;
        let close = text[pos..].find(END).map(|e| pos + e);
        let body = &text[pos..close.unwrap_or(text.len())];
        let (call, _) = scan_call(body, 0, done || close.is_some());
        if let Some(mut call) = call {
            call.done &= close.is_some();
            view.calls.push(call);
        }
        let Some(close) = close else { break };
        pos = close + END.len();
        match text[pos..].find(START) {
            Some(next) => pos += next + START.len(),
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
    fn one_call_with_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>";
        let p = check_all_chunkings(ToolParser::Hermes, text);
        assert_eq!(p.content.as_deref(), Some("Let me check.\n"));
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].name, "get_weather");
        assert_eq!(p.calls[0].arguments, r#"{"city": "Paris", "unit": "c"}"#);
    }

    #[test]
    fn parallel_calls_and_no_content() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": \"}\"}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let p = check_all_chunkings(ToolParser::Hermes, text);
        assert_eq!(p.content, None);
        let names: Vec<&str> = p.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(p.calls[0].arguments, r#"{"x": [1, {"y": "}"}]}"#);
    }

    #[test]
    fn plain_text_and_text_that_looks_like_a_tag() {
        let p = check_all_chunkings(ToolParser::Hermes, "a < b, and <tool is a word");
        assert_eq!(p.content.as_deref(), Some("a < b, and <tool is a word"));
        assert!(p.calls.is_empty());
    }

    #[test]
    fn vllm_recorded_truncated_call_is_content() {
        // vLLM 0.32's `required` answer on the 135M model (fixtures/.../tool_required.json).
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"Paris\"}\n</";
        let p = ToolParser::Hermes.parse(text, &[], || "id".into());
        assert!(p.calls.is_empty());
        assert_eq!(p.content.as_deref(), Some(text));
    }

    #[test]
    fn arguments_that_are_not_an_object_are_not_a_call() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": \"Paris\"}\n</tool_call>";
        let p = ToolParser::Hermes.parse(text, &[], || "id".into());
        assert!(p.calls.is_empty());
    }
}
