//! The one definition of a sample percentile, shared by the benchmark reports, the rollout
//! analysis and every other place that summarises latency samples: numpy's default
//! ("linear"). Sort the `n` samples ascending as `x[0..n]`; the `p`-th percentile sits at
//! fractional rank `h = p/100 · (n-1)` and is `x[⌊h⌋] + (h - ⌊h⌋) · (x[⌊h⌋+1] - x[⌊h⌋])`. So
//! p0 is the minimum, p100 the maximum, and a single sample is every percentile.
//!
//! Quantiles of *histograms* (what a `/metrics` page holds) are a different estimate, with
//! PromQL's definition: [`crate::prometheus::histogram_quantile`].

/// The `p`-th percentile (0..=100) of `sorted`, which must be sorted ascending.
/// `None` for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let p = if p.is_nan() { 0.0 } else { p.clamp(0.0, 100.0) };
    let rank = p / 100.0 * (n - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    let frac = rank - lo as f64;
    Some(sorted[lo] + frac * (sorted[hi] - sorted[lo]))
}

/// The `q`-quantile (0..=1) of samples in any order (copied and sorted; NaN sorts last).
pub fn quantile(samples: &[f64], q: f64) -> Option<f64> {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    percentile(&v, q * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_numpy_linear() {
        // numpy.percentile([1, 2, 3, 4], [0, 25, 50, 90, 99, 100])
        let x = [1.0, 2.0, 3.0, 4.0];
        for (p, want) in [
            (0.0, 1.0),
            (25.0, 1.75),
            (50.0, 2.5),
            (90.0, 3.7),
            (99.0, 3.97),
            (100.0, 4.0),
        ] {
            let got = percentile(&x, p).unwrap();
            assert!((got - want).abs() < 1e-12, "p{p}: {got} != {want}");
        }
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 90.0), Some(7.0));
        assert_eq!(quantile(&[4.0, 1.0, 3.0, 2.0], 0.5), Some(2.5));
    }
}
