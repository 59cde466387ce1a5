//! The encoder's tokenizer: `tokenizer.json` through the `tokenizers` crate (WordPiece with
//! BERT's normaliser and pre-tokenizer, `[CLS] … [SEP]` added by its post-processor).
//!
//! The file ships with fixed padding to 128 and truncation at 128 (what it was exported
//! with); both are switched off, because the ragged batch needs no padding and a silent
//! truncation would embed a different text than the one sent. The server decides what is
//! too long, and truncates only when the request asks for it.

use std::path::{Path, PathBuf};

use tokenizers::utils::truncation::{truncate_encodings, TruncationParams, TruncationStrategy};
use tokenizers::{PostProcessor, TruncationDirection};

use super::input::EncoderInput;
use super::EmbedError;

pub struct EmbedTokenizer {
    inner: tokenizers::Tokenizer,
    /// Special tokens the post-processor adds around one input.
    added: usize,
    /// Special tokens it adds around a pair (`[CLS] a [SEP] b [SEP]`: 3).
    pair_added: usize,
}

impl EmbedTokenizer {
    pub fn from_file(path: &Path) -> Result<Self, EmbedError> {
        let bad = |reason: String| EmbedError::Tokenizer {
            path: PathBuf::from(path),
            reason,
        };
        if !path.is_file() {
            return Err(bad("no such file".into()));
        }
        let mut inner = tokenizers::Tokenizer::from_file(path).map_err(|e| bad(e.to_string()))?;
        inner
            .with_truncation(None)
            .map_err(|e| bad(e.to_string()))?;
        inner.with_padding(None);
        let added = inner
            .get_post_processor()
            .map(|p| p.added_tokens(false))
            .unwrap_or(0);
        let pair_added = inner
            .get_post_processor()
            .map(|p| p.added_tokens(true))
            .unwrap_or(0);
        Ok(Self {
            inner,
            added,
            pair_added,
        })
    }

    /// Token ids of `text`; with `truncate = Some(k)` the text's own tokens are cut so that
    /// the result, special tokens included, has at most `k` ids (the end of the text goes,
    /// `[CLS]` and `[SEP]` stay, as sentence-transformers truncates).
    pub fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
        truncate: Option<usize>,
    ) -> Result<Vec<u32>, EmbedError> {
        let mut enc = self
            .inner
            .encode(text, false)
            .map_err(|e| EmbedError::Encode(e.to_string()))?;
        let added = if add_special_tokens { self.added } else { 0 };
        if let Some(k) = truncate {
            enc.truncate(k.saturating_sub(added), 0, TruncationDirection::Right);
        }
        let enc = self
            .inner
            .post_process(enc, None, add_special_tokens)
            .map_err(|e| EmbedError::Encode(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(k) = truncate {
            // Only reachable when `k` leaves no room for the special tokens themselves.
            ids.truncate(k);
        }
        Ok(ids)
    }

    /// A pair as a cross-encoder reads it, `[CLS] first [SEP] second [SEP]` with `second`
    /// (and its `[SEP]`) as token type 1, by the file's own pair template. With
    /// `truncate = Some(k)` the texts' tokens are cut so that the result has at most `k`
    /// ids, the longer text first, as transformers' `truncation=True` does for a pair.
    pub fn encode_pair(
        &self,
        first: &str,
        second: &str,
        truncate: Option<usize>,
    ) -> Result<EncoderInput, EmbedError> {
        let encode = |text: &str| {
            self.inner
                .encode(text, false)
                .map_err(|e| EmbedError::Encode(e.to_string()))
        };
        let (mut a, mut b) = (encode(first)?, Some(encode(second)?));
        if let Some(k) = truncate {
            let params = TruncationParams {
                max_length: k.saturating_sub(self.pair_added),
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            };
            (a, b) =
                truncate_encodings(a, b, &params).map_err(|e| EmbedError::Encode(e.to_string()))?;
        }
        let enc = self
            .inner
            .post_process(a, b, true)
            .map_err(|e| EmbedError::Encode(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(k) = truncate {
            // Only reachable when `k` leaves no room for the special tokens themselves.
            ids.truncate(k);
        }
        let second_segment = enc
            .get_type_ids()
            .iter()
            .position(|&t| t != 0)
            .unwrap_or(enc.get_type_ids().len())
            .min(ids.len());
        Ok(EncoderInput::pair(ids, second_segment))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, EmbedError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| EmbedError::Encode(e.to_string()))
    }
}
