//! What the score tiles share: keys are taken four positions at a time, each row's four
//! scores are stored back, all four or the ones inside the context, and the tiles (the
//! value pass too) ask for the entries they will read [`AHEAD`] positions in advance.

use std::arch::x86_64::*;

/// Where the keys of positions `j..j + 4` start; past the last position, the last key
/// again (its scores are computed and not stored).
///
/// # Safety
/// `offs[i]` is within the allocation `base` points into, for every `i`; `j < offs.len()`.
#[inline(always)]
pub(super) unsafe fn four_keys<T>(base: *const T, offs: &[usize], j: usize) -> [*const T; 4] {
    let last = offs.len() - 1;
    let mut k = [base; 4];
    for (kk, p) in k.iter_mut().enumerate() {
        *p = base.add(offs[(j + kk).min(last)]);
    }
    k
}

/// Stores the scores of positions `j..j + 4` into `row`, only those below `n_ctx`.
///
/// # Safety
/// SSE; `row` holds `n_ctx` floats; `j < n_ctx`.
#[inline(always)]
pub(super) unsafe fn store_four(four: __m128, row: *mut f32, j: usize, n_ctx: usize) {
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), four);
    std::ptr::copy_nonoverlapping(out.as_ptr(), row.add(j), (n_ctx - j).min(4));
}

/// How many positions ahead of the one being read the tiles ask for keys and values.
/// A task reads one head's slice of each slot (a stride through a block), and a
/// sequence's blocks are scattered over the cache, so the hardware prefetchers lose the
/// trail at every block boundary and the tiles wait on memory. Measured on a 2-vCPU Zen 3
/// (`attention_bench --streams 16 --ctx 384`, three interleaved rounds): 16 ahead took
/// the f16 step from 23.5–27.7 ms to 14.6–16.2, 24 and 32 did no better, 8 and 64 worse.
pub(super) const AHEAD: usize = 16;

/// Asks for the `bytes` at `offs[j + AHEAD]` (elements of `base`) to be brought into the
/// cache, if that position exists. Only a hint: it reads nothing and cannot fault.
///
/// # Safety
/// SSE; as [`four_keys`] for the positions that exist.
#[inline(always)]
pub(super) unsafe fn prefetch_ahead<T>(base: *const T, offs: &[usize], j: usize, bytes: usize) {
    if let Some(&off) = offs.get(j + AHEAD) {
        let p = base.add(off) as *const i8;
        let mut at = 0;
        while at < bytes {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at));
            at += 64;
        }
        // An entry that does not start on a line ends in one more.
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(bytes.saturating_sub(1)));
    }
}
