//! Row-parallel loops over a step's activations.

use rayon::prelude::*;

/// Rows at and above which row-wise work is split over the pool.
const PAR_MIN_ROWS: usize = 8;

/// Calls `f(t, row)` for each row of `out` (`width` floats each); rows are independent, so
/// they run in parallel when there are enough of them.
pub fn for_rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if out.len() >= PAR_MIN_ROWS * width {
        out.par_chunks_mut(width)
            .enumerate()
            .for_each(|(t, row)| f(t, row));
    } else {
        for (t, row) in out.chunks_mut(width).enumerate() {
            f(t, row);
        }
    }
}
