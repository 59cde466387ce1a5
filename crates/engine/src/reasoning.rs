//! `--reasoning-parser`: a reasoning model's `<think>…</think>` as vLLM splits it,
//! `message.reasoning_content` apart from `content` (and `delta.reasoning_content` in
//! streams; the text after the reasoning then goes through the tool-call parser).

const START: &str = "<think>";
const END: &str = "</think>";

/// The parsers, by vLLM's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// Everything before `</think>` is reasoning (the template may have opened the
    /// block); no `</think>` means the output is all reasoning.
    DeepSeekR1,
    /// Reasoning only inside an output that opens with `<think>`.
    Qwen3,
}

impl ReasoningParser {
    pub const NAMES: [&'static str; 2] = ["deepseek_r1", "qwen3"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "deepseek_r1" => Some(Self::DeepSeekR1),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// `(reasoning, content)` of the text so far; `done` when no more will come. Text
    /// that may be the start of a tag is held back while not `done`.
    pub fn view(self, text: &str, done: bool) -> (String, String) {
        let lead = text.len() - text.trim_start().len();
        let opened = text[lead..].starts_with(START);
        let body_start = if opened { lead + START.len() } else { 0 };
        if let Some(e) = text[body_start..].find(END).map(|e| body_start + e) {
            if self == Self::Qwen3 && !opened {
                return (String::new(), text.to_string());
            }
            return (
                text[body_start..e].to_string(),
                text[e + END.len()..].to_string(),
            );
        }
        let maybe_opening = !done && START.starts_with(&text[lead..]);
        match self {
            Self::Qwen3 if maybe_opening => (String::new(), String::new()),
            Self::Qwen3 if !opened => (String::new(), text.to_string()),
            _ if maybe_opening => (String::new(), String::new()),
            _ => {
                let held = if done { 0 } else { held_back(text, END) };
                let end = (text.len() - held).max(body_start);
                (text[body_start..end].to_string(), String::new())
            }
        }
    }
}

fn held_back(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// One streamed choice through a reasoning parser.
#[derive(Debug)]
pub struct ReasoningStream {
    parser: ReasoningParser,
    text: String,
    sent_reasoning: usize,
    sent_content: usize,
}

impl ReasoningStream {
    pub fn new(parser: ReasoningParser) -> Self {
        Self {
            parser,
            text: String::new(),
            sent_reasoning: 0,
            sent_content: 0,
        }
    }

    /// Adds text; returns the new `(reasoning, content)`.
    pub fn push(&mut self, chunk: &str) -> (String, String) {
        self.text.push_str(chunk);
        let view = self.parser.view(&self.text, false);
        self.diff(view)
    }

    /// The output ended: what is left.
    pub fn finish(&mut self) -> (String, String) {
        let view = self.parser.view(&self.text, true);
        self.diff(view)
    }

    fn diff(&mut self, (reasoning, content): (String, String)) -> (String, String) {
        let take = |s: &str, sent: &mut usize| {
            if s.len() > *sent && s.is_char_boundary(*sent) {
                let d = s[*sent..].to_string();
                *sent = s.len();
                d
            } else {
                String::new()
            }
        };
        (
            take(&reasoning, &mut self.sent_reasoning),
            take(&content, &mut self.sent_content),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(p: ReasoningParser, text: &str, size: usize) -> (String, String) {
        let mut s = ReasoningStream::new(p);
        let (mut r, mut c) = (String::new(), String::new());
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(size) {
            let (dr, dc) = s.push(&chunk.iter().collect::<String>());
            r.push_str(&dr);
            c.push_str(&dc);
        }
        let (dr, dc) = s.finish();
        (r + &dr, c + &dc)
    }

    fn check(p: ReasoningParser, text: &str, want: (&str, &str)) {
        assert_eq!(p.view(text, true), (want.0.to_string(), want.1.to_string()));
        for size in [1, 2, 5, 100] {
            let (r, c) = streamed(p, text, size);
            assert_eq!(
                (r.as_str(), c.as_str()),
                want,
                "{text:?} in chunks of {size}"
            );
        }
    }

    #[test]
    fn deepseek_r1() {
        let p = ReasoningParser::DeepSeekR1;
        check(p, "<think>hmm, 2+2</think>4", ("hmm, 2+2", "4"));
        check(
            p,
            "opened by the template</think>done",
            ("opened by the template", "done"),
        );
        check(p, "still thinking <", ("still thinking <", ""));
    }

    #[test]
    fn qwen3() {
        let p = ReasoningParser::Qwen3;
        check(
            p,
            "<think>\nplan\n</think>\n\nanswer",
            ("\nplan\n", "\n\nanswer"),
        );
        check(p, "no thinking here", ("", "no thinking here"));
        check(p, "<think>cut off", ("cut off", ""));
    }
}
