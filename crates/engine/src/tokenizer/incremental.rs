//! Streaming detokenization, and the SPM dummy-prefix strip it shares with `decode`.

use super::{Result, Tokenizer};

/// Tracks the removal of an SPM dummy-prefix space at the start of a sequence.
#[derive(Debug, Clone, Copy)]
pub(super) struct StripState {
    pending: bool,
}

impl StripState {
    pub(super) fn new(enabled: bool) -> Self {
        Self { pending: enabled }
    }

    pub(super) fn apply<'a>(&mut self, tok: &Tokenizer, id: u32, piece: &'a [u8]) -> &'a [u8] {
        if !self.pending || !tok.add_space_prefix {
            return piece;
        }
        if Some(id) == tok.bos {
            return piece;
        }
        self.pending = false;
        piece.strip_prefix(b" ").unwrap_or(piece)
    }
}

/// Streaming detokenizer: turns ids into text as they arrive, emitting only
/// complete UTF-8 characters. Constant work per token.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    skip_special: bool,
    strip: StripState,
    pending: Vec<u8>,
}

impl IncrementalDecoder {
    /// Decodes a sequence from its start: the concatenated output equals
    /// [`Tokenizer::decode`] of the same ids.
    pub fn new(skip_special: bool) -> Self {
        Self {
            skip_special,
            strip: StripState::new(true),
            pending: Vec::new(),
        }
    }

    /// Decodes tokens that continue earlier text (e.g. generated after a prompt):
    /// no SPM dummy-prefix space is removed.
    pub fn continuing(skip_special: bool) -> Self {
        Self {
            strip: StripState::new(false),
            ..Self::new(skip_special)
        }
    }

    /// Adds one token; returns the text completed by it (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        let piece = tok.piece(id)?;
        let piece = self.strip.apply(tok, id, piece);
        if self.skip_special && tok.is_special(id) {
            return Ok(String::new());
        }
        self.pending.extend_from_slice(piece);
        Ok(self.drain_complete())
    }

    /// Whatever is still held (an incomplete character), lossily replaced.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back because they do not yet form a complete character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&rest[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed += valid + bad;
                        }
                        None => {
                            // Incomplete character at the end: hold it.
                            consumed += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }
}
