//! What the score tiles share: keys are taken four positions at a time, and each row's
//! four scores are stored back, all four or the ones inside the context.

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
