//! Stop-string detection on streamed, incrementally detokenized text (vLLM semantics).
//!
//! Text is pushed as it is detokenized, a few characters at a time. A stop string may span
//! several pushes, so any tail of the pending text that could still be the beginning of a
//! stop string is held back until it either completes a stop string or is known not to.
//! Everything else is emitted immediately.
//!
//! Which match wins: the occurrence that **completes first** in the stream (smallest end
//! offset) — the same decision vLLM makes when it stops as soon as a stop string appears.
//! Among occurrences completing at the same offset, the one starting earliest (the
//! longest) wins, then the first in the list. Because the decision never depends on how
//! the text was split into pushes, streaming gives exactly the one-shot result: the text
//! truncated before the winning occurrence (or after it, with
//! `include_stop_str_in_output`). Empty stop strings are ignored. All offsets are on
//! `char` boundaries; a UTF-8 character is never split.

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is now safe to stream to the client.
    pub emit: String,
    /// The stop string that matched; generation must stop. Set on exactly one step.
    pub stopped: Option<String>,
}

/// Incremental stop-string matcher for one sequence.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    include_stop_str_in_output: bool,
    /// Text received but not yet emitted (a possible stop-string prefix).
    held: String,
    /// Longest stop string in bytes.
    max_len: usize,
    stopped: bool,
}

impl StopMatcher {
    /// `stops`: stop strings (empty ones are ignored). `include_stop_str_in_output`: on a
    /// match, the stop string itself is emitted too.
    pub fn new(stops: Vec<String>, include_stop_str_in_output: bool) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            include_stop_str_in_output,
            held: String::new(),
            max_len,
            stopped: false,
        }
    }

    /// Whether a stop string has matched. After that, `push` and `flush` return nothing.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Text currently held back as a possible stop-string prefix.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Appends newly detokenized `text` and returns what can be emitted now, and the stop
    /// string if one matched (the matcher is then finished).
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.stopped {
            return StopStep::default();
        }
        self.held.push_str(text);

        if let Some((start, idx)) = self.first_match() {
            let stop = self.stops[idx].clone();
            let end = if self.include_stop_str_in_output {
                start + stop.len()
            } else {
                start
            };
            let mut emit = std::mem::take(&mut self.held);
            emit.truncate(end);
            self.stopped = true;
            return StopStep {
                emit,
                stopped: Some(stop),
            };
        }

        let keep_from = self.partial_match_start();
        let rest = self.held.split_off(keep_from);
        let emit = std::mem::replace(&mut self.held, rest);
        StopStep {
            emit,
            stopped: None,
        }
    }

    /// Releases the held-back text when generation ends for another reason (EOS, length).
    /// Returns an empty string once a stop string has matched.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Start offset and stop index of the winning complete match in `held`, if any.
    fn first_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(idx, stop)| {
                // The first occurrence of a given stop also ends first.
                self.held
                    .find(stop.as_str())
                    .map(|start| (start + stop.len(), start, idx))
            })
            .min()
            .map(|(_, start, idx)| (start, idx))
    }

    /// Smallest char boundary `q` such that `held[q..]` is a non-empty prefix of some stop
    /// string (`held.len()` if none). Called only when `held` contains no complete match.
    fn partial_match_start(&self) -> usize {
        let len = self.held.len();
        let lowest = len.saturating_sub(self.max_len.saturating_sub(1));
        (lowest..len)
            .filter(|&q| self.held.is_char_boundary(q))
            .find(|&q| {
                let tail = &self.held[q..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn matcher(stops: &[&str], include: bool) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect(), include)
    }

    /// Pushes every piece; returns the concatenated output (plus flush if no stop) and the
    /// stop string. Checks that nothing is emitted after the stop.
    fn run(m: &mut StopMatcher, pieces: &[&str]) -> (String, Option<String>) {
        let mut out = String::new();
        let mut stopped = None;
        for p in pieces {
            let step = m.push(p);
            if stopped.is_some() {
                assert_eq!(step, StopStep::default());
            }
            out.push_str(&step.emit);
            if step.stopped.is_some() {
                stopped = step.stopped;
            }
        }
        if stopped.is_none() {
            out.push_str(&m.flush());
        } else {
            assert_eq!(m.flush(), "");
        }
        (out, stopped)
    }

    #[test]
    fn stop_within_one_push() {
        let mut m = matcher(&["STOP"], false);
        let step = m.push("hello STOP world");
        assert_eq!(step.emit, "hello ");
        assert_eq!(step.stopped.as_deref(), Some("STOP"));
        assert!(m.is_stopped());
        assert_eq!(m.push("more"), StopStep::default());
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn stop_spanning_pushes_is_held_back() {
        let mut m = matcher(&["</end>"], false);
        assert_eq!(m.push("abc<").emit, "abc");
        assert_eq!(m.held(), "<");
        let s = m.push("/e");
        assert_eq!((s.emit.as_str(), s.stopped), ("", None));
        assert_eq!(m.held(), "</e");
        let s = m.push("nd");
        assert_eq!((s.emit.as_str(), s.stopped), ("", None));
        let s = m.push(">tail");
        assert_eq!(s.emit, "");
        assert_eq!(s.stopped.as_deref(), Some("</end>"));
    }

    #[test]
    fn false_prefix_released_later() {
        let mut m = matcher(&["abc"], false);
        assert_eq!(m.push("xa").emit, "x");
        assert_eq!(m.push("b").emit, "");
        // "abd" is not "abc": the held "ab" is released together with "d".
        let s = m.push("dab");
        assert_eq!(s.emit, "abd");
        assert_eq!(s.stopped, None);
        assert_eq!(m.held(), "ab");
        // Generation ends for another reason: the held text is flushed.
        assert_eq!(m.flush(), "ab");
        assert_eq!(m.held(), "");
    }

    #[test]
    fn overlapping_prefix_restarts_inside_held_text() {
        // "aab" : the held "aa" fails as a start at 0 but "ab" at 1 completes it.
        let mut m = matcher(&["ab"], false);
        assert_eq!(m.push("a").emit, "");
        assert_eq!(m.push("a").emit, "a");
        let s = m.push("b");
        assert_eq!(s.emit, "");
        assert_eq!(s.stopped.as_deref(), Some("ab"));
    }

    #[test]
    fn include_stop_str_in_output() {
        let mut m = matcher(&["STOP"], true);
        assert_eq!(m.push("hi ST").emit, "hi ");
        let s = m.push("OP and more");
        assert_eq!(s.emit, "STOP");
        assert_eq!(s.stopped.as_deref(), Some("STOP"));
    }

    #[test]
    fn multiple_stops_first_completed_wins() {
        let mut m = matcher(&["world", "lo"], false);
        let s = m.push("hello world");
        assert_eq!(s.emit, "hel");
        assert_eq!(s.stopped.as_deref(), Some("lo"));
        // "b" completes before "abc" could: it wins even though "abc" starts earlier.
        let (out, stop) = run(&mut matcher(&["abc", "b"], false), &["a", "bc"]);
        assert_eq!((out.as_str(), stop.as_deref()), ("a", Some("b")));
        // Same end: the longer (earlier-starting) one wins, regardless of list order.
        for pieces in [&["xab"][..], &["xa", "b"][..], &["x", "a", "b"][..]] {
            let (out, stop) = run(&mut matcher(&["b", "ab"], false), pieces);
            assert_eq!((out.as_str(), stop.as_deref()), ("x", Some("ab")));
        }
        // A newline completes before a double newline can.
        let (out, stop) = run(&mut matcher(&["\n\n", "\n"], false), &["x\n\ny"]);
        assert_eq!((out.as_str(), stop.as_deref()), ("x", Some("\n")));
    }

    #[test]
    fn unicode_stops() {
        let mut m = matcher(&["😀!", "終わり"], false);
        // Emoji is 4 bytes; the held text is the whole char.
        assert_eq!(m.push("hé😀").emit, "hé");
        assert_eq!(m.held(), "😀");
        assert_eq!(m.push("?").emit, "😀?");
        assert_eq!(m.push("日本語終わ").emit, "日本語");
        assert_eq!(m.held(), "終わ");
        let s = m.push("りです");
        assert_eq!(s.emit, "");
        assert_eq!(s.stopped.as_deref(), Some("終わり"));

        let mut m = matcher(&["😀!"], true);
        assert_eq!(m.push("a😀").emit, "a");
        let s = m.push("!b");
        assert_eq!(s.emit, "😀!");
    }

    #[test]
    fn no_stops_pass_everything_through() {
        let mut m = matcher(&[], false);
        assert_eq!(m.push("abc").emit, "abc");
        assert_eq!(m.push("").emit, "");
        assert_eq!(m.held(), "");
        // Empty strings are ignored rather than matching everywhere.
        let mut m = matcher(&[""], true);
        let s = m.push("abc");
        assert_eq!((s.emit.as_str(), s.stopped), ("abc", None));
    }

    /// Independent reference: scan end offsets in order; at the first end offset where some
    /// stop ends, take the longest such stop (then first in the list).
    fn reference(text: &str, stops: &[String], include: bool) -> (String, Option<String>) {
        let ends = text.char_indices().map(|(i, c)| i + c.len_utf8());
        for end in ends {
            let mut best: Option<&String> = None;
            for s in stops.iter().filter(|s| !s.is_empty()) {
                if text[..end].ends_with(s.as_str()) && best.is_none_or(|b| s.len() > b.len()) {
                    best = Some(s);
                }
            }
            if let Some(s) = best {
                let cut = if include { end } else { end - s.len() };
                return (text[..cut].to_string(), Some(s.clone()));
            }
        }
        (text.to_string(), None)
    }

    fn alphabet_string(max: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                Just('a'),
                Just('b'),
                Just('c'),
                Just('é'),
                Just('中'),
                Just('😀')
            ],
            0..max,
        )
        .prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        #[test]
        fn streaming_equals_one_shot_and_reference(
            text in alphabet_string(40),
            stops in proptest::collection::vec(alphabet_string(5), 0..4),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
            include in any::<bool>(),
        ) {
            let chars: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
            let mut offsets: Vec<usize> = cuts
                .iter()
                .filter(|_| !chars.is_empty())
                .map(|ix| chars[ix.index(chars.len())])
                .collect();
            offsets.push(0);
            offsets.push(text.len());
            offsets.sort_unstable();
            offsets.dedup();
            let pieces: Vec<&str> = offsets.windows(2).map(|w| &text[w[0]..w[1]]).collect();

            let streamed = run(&mut StopMatcher::new(stops.clone(), include), &pieces);
            let one_shot = run(&mut StopMatcher::new(stops.clone(), include), &[text.as_str()]);
            let want = reference(&text, &stops, include);
            prop_assert_eq!(&streamed, &one_shot);
            prop_assert_eq!(&streamed, &want);
        }
    }
}
