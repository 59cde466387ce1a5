//! One input of an encoder forward: its token ids and where its second segment starts.
//!
//! A sentence embedding or a classification reads one segment (token type 0 throughout).
//! A cross-encoder reads a pair, `[CLS] query [SEP] document [SEP]`, whose document part
//! (its first token through the last `[SEP]`) is token type 1, as BERT was trained on
//! sentence pairs; the tokenizer's pair template says where that part starts.

/// Token ids with the position where token type 1 starts.
pub trait Segmented {
    fn ids(&self) -> &[u32];
    /// The first position of token type 1; `ids().len()` when there is one segment.
    fn second_segment(&self) -> usize;
}

/// A plain list of ids is one segment (what `/v1/embeddings` sends).
impl Segmented for Vec<u32> {
    #[inline]
    fn ids(&self) -> &[u32] {
        self
    }

    #[inline]
    fn second_segment(&self) -> usize {
        self.len()
    }
}

/// An input the worker runs: one segment or a pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncoderInput {
    pub ids: Vec<u32>,
    /// Where token type 1 starts (`ids.len()` for one segment).
    pub second_segment: usize,
}

impl EncoderInput {
    /// One segment.
    pub fn single(ids: Vec<u32>) -> Self {
        let second_segment = ids.len();
        Self {
            ids,
            second_segment,
        }
    }

    /// A pair whose second part starts at `second_segment`.
    pub fn pair(ids: Vec<u32>, second_segment: usize) -> Self {
        Self {
            ids,
            second_segment,
        }
    }
}

impl Segmented for EncoderInput {
    #[inline]
    fn ids(&self) -> &[u32] {
        &self.ids
    }

    #[inline]
    fn second_segment(&self) -> usize {
        self.second_segment
    }
}
