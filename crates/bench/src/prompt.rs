//! Prompts of a chosen token length, built without a tokenizer.
//!
//! A prompt is a list of [`Segment`]s, each a seeded run of `len` tokens. Two segments with
//! the same seed and length render identically, which is how workloads express reuse: a
//! shared system prompt, a trace's `hash_ids` blocks, a conversation's history.
//!
//! * Text mode renders each token as one word from [`WORDS`], each with a leading space.
//!   The words are frequent English words that the byte-pair vocabularies of common model
//!   families (GPT-2 style, Llama, Qwen, Mistral) hold as a single token with a leading
//!   space, so `len` words are close to `len` tokens; the server's `usage.prompt_tokens`
//!   is what reports count.
//! * Token-id mode renders each token as an id in [`TOKEN_ID_RANGE`], exact lengths for
//!   servers that accept a token-id prompt on `/v1/completions`.

use std::ops::Range;

/// Words that are one token (with a leading space) in common BPE vocabularies.
pub const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "out",
    "up",
    "into",
    "than",
    "them",
    "only",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "place",
    "small",
    "found",
    "part",
    "general",
    "high",
    "upon",
    "school",
    "every",
    "does",
    "got",
    "united",
    "left",
    "number",
    "course",
    "war",
    "until",
    "always",
    "away",
    "something",
    "fact",
    "though",
    "water",
    "less",
    "public",
    "put",
    "think",
    "almost",
    "hand",
    "enough",
    "far",
    "took",
    "head",
    "yet",
    "government",
    "system",
    "better",
    "set",
    "told",
    "nothing",
    "night",
    "end",
    "why",
    "called",
    "team",
    "eyes",
    "find",
    "going",
    "look",
    "asked",
    "later",
    "point",
    "knew",
    "city",
    "next",
    "program",
    "business",
    "give",
    "group",
    "toward",
    "young",
    "let",
    "room",
    "side",
    "social",
    "present",
    "given",
    "several",
    "order",
    "national",
    "second",
    "possible",
    "rather",
    "per",
    "face",
    "among",
    "form",
    "important",
    "often",
    "things",
    "looked",
    "early",
    "white",
    "case",
    "large",
    "become",
    "big",
    "need",
    "four",
    "within",
    "felt",
    "along",
    "children",
    "saw",
    "best",
    "church",
    "ever",
    "least",
    "power",
    "development",
    "light",
    "thought",
    "family",
    "interest",
    "want",
    "members",
    "others",
    "mind",
    "country",
    "area",
    "done",
    "turned",
    "help",
    "open",
    "service",
    "certain",
    "kind",
    "problem",
    "began",
    "different",
    "door",
    "thus",
    "seemed",
    "whole",
    "sense",
    "money",
    "music",
];

/// Token ids used in token-id mode: clear of the special and byte tokens that sit at the
/// start of most vocabularies, and inside any vocabulary of 32k or more.
pub const TOKEN_ID_RANGE: Range<u32> = 1000..9000;

/// A seeded run of `len` tokens. Equal segments render equally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Content seed.
    pub seed: u64,
    /// Length in tokens.
    pub len: u32,
}

impl Segment {
    /// A segment of `len` tokens with content seed `seed`.
    pub fn new(seed: u64, len: u32) -> Self {
        Segment { seed, len }
    }

    /// Appends the segment as text: `len` words, each preceded by a space.
    pub fn render_text(&self, out: &mut String) {
        let mut rng = SplitMix64(self.seed);
        for _ in 0..self.len {
            out.push(' ');
            out.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        }
    }

    /// Appends the segment as `len` token ids from [`TOKEN_ID_RANGE`].
    pub fn render_ids(&self, out: &mut Vec<u32>) {
        let mut rng = SplitMix64(self.seed);
        let span = u64::from(TOKEN_ID_RANGE.end - TOKEN_ID_RANGE.start);
        // A counted range: the list grows once, not once per token.
        out.extend((0..self.len).map(|_| TOKEN_ID_RANGE.start + rng.below(span) as u32));
    }
}

/// Renders segments as one text.
pub fn text_of(segments: &[Segment]) -> String {
    let mut out = String::with_capacity(segments.iter().map(|s| s.len as usize * 6).sum());
    for s in segments {
        s.render_text(&mut out);
    }
    out
}

/// Renders segments as one token-id list.
pub fn ids_of(segments: &[Segment]) -> Vec<u32> {
    let mut out = Vec::with_capacity(segments.iter().map(|s| s.len as usize).sum());
    for s in segments {
        s.render_ids(&mut out);
    }
    out
}

/// Mixes values into one seed (SplitMix64 finalizer over a running hash), so seeds derived
/// from (run seed, group, index) do not collide in practice.
pub fn mix(parts: &[u64]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for &p in parts {
        h = SplitMix64(h ^ p).next();
    }
    h
}

/// SplitMix64: a tiny, stable generator, so prompt content depends only on the seed and
/// never on a library version.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (multiply-shift; the bias is negligible for small `n`).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_has_one_word_per_token() {
        let text = text_of(&[Segment::new(1, 50), Segment::new(2, 7)]);
        assert_eq!(text.split_whitespace().count(), 57);
        assert!(text.starts_with(' '));
    }

    #[test]
    fn equal_segments_render_equally_and_seeds_differ() {
        let a = text_of(&[Segment::new(42, 100)]);
        let b = text_of(&[Segment::new(42, 100)]);
        let c = text_of(&[Segment::new(43, 100)]);
        assert_eq!(a, b);
        assert_ne!(a, c);
        // A prefix segment is a prefix of the longer prompt.
        let long = text_of(&[Segment::new(42, 100), Segment::new(7, 10)]);
        assert!(long.starts_with(&a));
    }

    #[test]
    fn ids_are_exact_length_and_in_range() {
        let ids = ids_of(&[Segment::new(9, 300), Segment::new(10, 12)]);
        assert_eq!(ids.len(), 312);
        assert!(ids.iter().all(|id| TOKEN_ID_RANGE.contains(id)));
    }

    #[test]
    fn words_are_unique_and_plain() {
        let mut w: Vec<_> = WORDS.to_vec();
        w.sort_unstable();
        w.dedup();
        assert_eq!(w.len(), WORDS.len());
        assert!(WORDS
            .iter()
            .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase())));
    }

    #[test]
    fn mix_separates_inputs() {
        assert_ne!(mix(&[1, 2]), mix(&[2, 1]));
        assert_ne!(mix(&[0]), mix(&[0, 0]));
    }
}
