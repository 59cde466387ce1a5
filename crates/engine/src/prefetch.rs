//! A hint to start loading memory the next lines will touch.
//!
//! Hot loops over scattered state (the block pool's per-block entries and prefix table,
//! the simulator's per-request and per-sequence state, each a cache miss) issue the misses
//! of a whole batch first, so they overlap instead of waiting on each in turn.

/// Starts loading the cache line at `p` (any address: a prefetch reads nothing into the
/// program and never faults).
#[inline]
pub fn prefetch<T>(p: *const T) {
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
