//! Min-max normalization, which the queue and least-request scorers share: the least
//! value scores 1, the greatest 0.

use smallvec::SmallVec;

/// `(max - x) / (max - min)` over the known values, 1 when all equal; unknown gets 0.
/// `value(i)` is the `i`-th value, read once: known values wait in `out` (a bit each
/// marks them; an unknown one waits as NaN, which `f64::min` and `f64::max` pass over,
/// as they pass over a known NaN) while the minimum and maximum are found, then become
/// scores in place, by the same operations as reading them twice. A pool of a thousand
/// endpoints is one pass over their records instead of two, and allocates nothing.
pub(super) fn min_max_inverse(value: impl Fn(usize) -> Option<f64>, out: &mut [f64]) {
    let mut known: SmallVec<[u64; 16]> = SmallVec::from_elem(0, out.len().div_ceil(64));
    for ((w, chunk), word) in out.chunks_mut(64).enumerate().zip(known.iter_mut()) {
        let mut bits = 0u64;
        for (j, o) in chunk.iter_mut().enumerate() {
            *o = match value(w * 64 + j) {
                Some(v) => {
                    bits |= 1 << j;
                    v
                }
                None => f64::NAN,
            };
        }
        *word = bits;
    }
    let (min, max) = min_max(out);
    if max <= min {
        for (i, o) in out.iter_mut().enumerate() {
            *o = if (known[i / 64] >> (i % 64)) & 1 == 0 {
                0.0
            } else {
                1.0
            };
        }
        return;
    }
    // Every entry divided (a loop the compiler vectorizes), then the unknown ones, a
    // bit each, set to 0.
    let range = max - min;
    out.iter_mut().for_each(|o| *o = (max - *o) / range);
    for (w, &bits) in known.iter().enumerate() {
        let mut unknown = !bits;
        while unknown != 0 {
            let i = w * 64 + unknown.trailing_zeros() as usize;
            match out.get_mut(i) {
                Some(o) => *o = 0.0,
                None => break,
            }
            unknown &= unknown - 1;
        }
    }
}

/// The least and greatest of `values`, NaNs passed over (infinite when there is no
/// other). Four of each run side by side, which a pass in order cannot: the minimum of a
/// set is the same in any order, but for a zero's sign. That sign changes no score of a
/// set without negative values (queues and counts; `min_max_inverse_equals_two_passes_bit_for_bit`),
/// and otherwise only a zero score's sign, which a weighted total never shows (a sum
/// that starts at +0 is never -0).
fn min_max(values: &[f64]) -> (f64, f64) {
    let mut min = [f64::INFINITY; 4];
    let mut max = [f64::NEG_INFINITY; 4];
    let chunks = values.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..4 {
            min[k] = min[k].min(c[k]);
            max[k] = max[k].max(c[k]);
        }
    }
    for (k, &v) in rest.iter().enumerate() {
        min[k] = min[k].min(v);
        max[k] = max[k].max(v);
    }
    (
        min[0].min(min[1]).min(min[2].min(min[3])),
        max[0].max(max[1]).max(max[2].max(max[3])),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-pass form `min_max_inverse` replaces.
    fn min_max_two_passes(values: &[Option<f64>]) -> Vec<f64> {
        let (min, max) = values
            .iter()
            .flatten()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        values
            .iter()
            .map(|v| match *v {
                None => 0.0,
                Some(_) if max <= min => 1.0,
                Some(v) => (max - v) / (max - min),
            })
            .collect()
    }

    proptest::proptest! {
        #[test]
        fn min_max_inverse_equals_two_passes_bit_for_bit(
            values in proptest::collection::vec(
                proptest::option::weighted(0.8, proptest::prop_oneof![
                    6 => 0.0f64..50.0,
                    1 => proptest::sample::select(vec![0.0, -0.0, f64::NAN, f64::INFINITY, 3.0]),
                ]),
                0..1100,
            ),
        ) {
            let mut out = vec![7.0; values.len()];
            min_max_inverse(|i| values[i], &mut out);
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits(&out), bits(&min_max_two_passes(&values)));
        }
    }
}
