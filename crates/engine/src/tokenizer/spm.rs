//! SentencePiece tokenization as llama.cpp does it: greedy merges by the merged piece's
//! score, with byte fallback for characters outside the vocabulary.

use std::collections::{BinaryHeap, HashMap};

use super::{Result, Tokenizer};

impl Tokenizer {
    /// llama.cpp's SPM algorithm: start from single characters, repeatedly merge the
    /// adjacent pair whose concatenation is the best-scoring vocabulary entry
    /// (leftmost on ties), then emit pieces, with byte fallback for characters
    /// missing from the vocabulary.
    pub(super) fn spm_encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut st = SpmState {
            text,
            syms: Vec::with_capacity(text.len()),
            heap: BinaryHeap::new(),
            rev_merge: HashMap::new(),
        };
        for (start, c) in text.char_indices() {
            let idx = st.syms.len();
            st.syms.push(SpmSymbol {
                start,
                len: c.len_utf8(),
                prev: idx.checked_sub(1),
                next: None,
            });
            if idx > 0 {
                st.syms[idx - 1].next = Some(idx);
            }
        }
        if st.syms.is_empty() {
            return Ok(());
        }
        for i in 1..st.syms.len() {
            self.spm_try_add(&mut st, Some(i - 1), Some(i));
        }
        while let Some(b) = st.heap.pop() {
            let (l, r) = (b.left, b.right);
            let (ll, rl) = (st.syms[l].len, st.syms[r].len);
            // Skip pairs whose symbols changed since the pair was queued.
            if ll == 0 || rl == 0 || ll + rl != b.size {
                continue;
            }
            st.syms[l].len += rl;
            st.syms[r].len = 0;
            let after = st.syms[r].next;
            st.syms[l].next = after;
            if let Some(a) = after {
                st.syms[a].prev = Some(l);
            }
            let before = st.syms[l].prev;
            self.spm_try_add(&mut st, before, Some(l));
            self.spm_try_add(&mut st, Some(l), after);
        }

        let mut cur = Some(0usize);
        let mut stack = Vec::new();
        while let Some(i) = cur {
            stack.push(i);
            while let Some(k) = stack.pop() {
                let sym = &st.syms[k];
                let piece = &text[sym.start..sym.start + sym.len];
                if let Some(&id) = self.token_to_id.get(piece) {
                    out.push(id);
                } else if let Some(&(l, r)) = st.rev_merge.get(piece) {
                    stack.push(r);
                    stack.push(l);
                } else {
                    for &byte in piece.as_bytes() {
                        out.push(self.byte_token(byte)?);
                    }
                }
            }
            cur = st.syms[i].next;
        }
        Ok(())
    }

    /// Queues the pair (left, right) if their concatenation is a vocabulary entry.
    fn spm_try_add<'t>(&self, st: &mut SpmState<'t>, left: Option<usize>, right: Option<usize>) {
        let (Some(l), Some(r)) = (left, right) else {
            return;
        };
        let start = st.syms[l].start;
        let end = st.syms[r].start + st.syms[r].len;
        let text: &'t str = st.text;
        let Some(piece) = text.get(start..end) else {
            return;
        };
        if let Some(&id) = self.token_to_id.get(piece) {
            st.heap.push(SpmBigram {
                score: self.scores[id as usize],
                left: l,
                right: r,
                size: end - start,
            });
            st.rev_merge.insert(piece, (l, r));
        }
    }
}

struct SpmSymbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct SpmBigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for SpmBigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for SpmBigram {}

impl PartialOrd for SpmBigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for SpmBigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Working state of one SPM tokenization.
struct SpmState<'t> {
    text: &'t str,
    syms: Vec<SpmSymbol>,
    heap: BinaryHeap<SpmBigram>,
    /// Which pair produced a piece (last one wins, as in llama.cpp).
    rev_merge: HashMap<&'t str, (usize, usize)>,
}
