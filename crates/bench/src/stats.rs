//! Percentiles and summaries of latency samples.
//!
//! Definition (the one `numpy.percentile` uses by default, "linear"): sort the `n` samples
//! ascending as `x[0..n]`; the `p`-th percentile sits at fractional rank `h = p/100 * (n-1)`
//! and is `x[floor(h)] + (h - floor(h)) * (x[floor(h)+1] - x[floor(h)])`. So p0 is the
//! minimum, p100 the maximum, p50 of an even count the mean of the two middle samples, and
//! a single sample is every percentile. Non-finite samples are never recorded.

use serde::{Deserialize, Serialize};

/// The `p`-th percentile (0..=100) of `sorted`, which must be sorted ascending.
/// `None` for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let p = p.clamp(0.0, 100.0);
    let rank = p / 100.0 * (n - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    let frac = rank - lo as f64;
    Some(sorted[lo] + frac * (sorted[hi] - sorted[lo]))
}

/// Count, mean, extremes and the standard percentiles of one metric, in the unit the
/// samples were given in (the report uses milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Smallest sample.
    pub min: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Summary {
    /// Summarizes `samples` (sorted in place). `None` when empty.
    pub fn of(samples: &mut [f64]) -> Option<Summary> {
        sort(samples);
        let count = samples.len();
        let first = *samples.first()?;
        let last = *samples.last()?;
        let mean = samples.iter().sum::<f64>() / count as f64;
        Some(Summary {
            count,
            mean,
            min: first,
            p50: percentile(samples, 50.0)?,
            p90: percentile(samples, 90.0)?,
            p99: percentile(samples, 99.0)?,
            max: last,
        })
    }

    /// The named percentile (`p50`, `p90`, `p99`), the mean, or the extremes.
    pub fn get(&self, stat: Stat) -> f64 {
        match stat {
            Stat::Mean => self.mean,
            Stat::P50 => self.p50,
            Stat::P90 => self.p90,
            Stat::P99 => self.p99,
        }
    }
}

/// The statistics plots and comparisons pick from a [`Summary`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stat {
    /// Arithmetic mean.
    Mean,
    /// Median.
    P50,
    /// 90th percentile.
    P90,
    /// 99th percentile.
    P99,
}

impl Stat {
    /// Short label.
    pub fn name(self) -> &'static str {
        match self {
            Stat::Mean => "mean",
            Stat::P50 => "p50",
            Stat::P90 => "p90",
            Stat::P99 => "p99",
        }
    }
}

/// Sorts ascending; samples are finite, NaN (never recorded) would sort last.
pub fn sort(samples: &mut [f64]) {
    samples.sort_by(|a, b| a.total_cmp(b));
}

/// `points` evenly spaced percentiles (0, 100/(points-1), ..., 100) of `sorted`: enough to
/// redraw a CDF from a saved report without keeping every sample.
pub fn quantiles(sorted: &[f64], points: usize) -> Vec<f64> {
    if sorted.is_empty() || points < 2 {
        return Vec::new();
    }
    (0..points)
        .filter_map(|i| percentile(sorted, 100.0 * i as f64 / (points - 1) as f64))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_matches_numpy_linear() {
        // numpy.percentile([1, 2, 3, 4], [0, 25, 50, 90, 99, 100])
        //   -> [1.0, 1.75, 2.5, 3.7, 3.97, 4.0]
        let x = [1.0, 2.0, 3.0, 4.0];
        let want = [
            (0.0, 1.0),
            (25.0, 1.75),
            (50.0, 2.5),
            (90.0, 3.7),
            (99.0, 3.97),
            (100.0, 4.0),
        ];
        for (p, v) in want {
            let got = percentile(&x, p).unwrap();
            assert!((got - v).abs() < 1e-9, "p{p}: got {got}, want {v}");
        }
    }

    #[test]
    fn percentile_of_one_and_none() {
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn percentile_of_hundred_samples() {
        // numpy.percentile(range(1, 101), [50, 90, 99]) -> [50.5, 90.1, 99.01]
        let x: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((percentile(&x, 50.0).unwrap() - 50.5).abs() < 1e-9);
        assert!((percentile(&x, 90.0).unwrap() - 90.1).abs() < 1e-9);
        assert!((percentile(&x, 99.0).unwrap() - 99.01).abs() < 1e-9);
    }

    #[test]
    fn summary_sorts_and_summarizes() {
        let mut x = vec![4.0, 1.0, 3.0, 2.0];
        let s = Summary::of(&mut x).unwrap();
        assert_eq!(s.count, 4);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 4.0);
        assert!((s.mean - 2.5).abs() < 1e-12);
        assert!((s.p50 - 2.5).abs() < 1e-12);
        assert!(Summary::of(&mut []).is_none());
    }

    #[test]
    fn quantiles_span_min_to_max() {
        let x: Vec<f64> = (0..=10).map(f64::from).collect();
        let q = quantiles(&x, 11);
        assert_eq!(q, x);
        assert!(quantiles(&[], 11).is_empty());
    }
}
