//! [`prefetch`]: a hint that a value will be read soon.
//!
//! The scheduling path reads tables far larger than the caches (a fleet's prefix index):
//! starting the loads of the next few entries before the first is used overlaps their
//! cache misses.

/// Starts loading the cache line at `p`. It reads nothing into the program, has no
/// effect on its results and never faults, whatever the address.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is only a hint: it cannot fault, whatever the address, and
        // `sse` (which it needs) is part of every x86_64 target.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
