//! The ITL summary and CDF from every inter-token gap in whole nanoseconds.
//!
//! `strata bench`'s report converts each gap to milliseconds, sorts them and summarizes.
//! Here the gaps stay integers (a `u32` each; a `u64` past 4.29 s, rare), are sorted as
//! integers (the same order as their milliseconds), and the mean (summed in that order)
//! and the percentiles (the same linear rule) are computed from them converted one at a
//! time: the report's numbers to the bit (`itl_summary_equals_the_reports`), at a
//! quarter of the memory.

use std::time::Duration;

use strata_bench::record::ms;
use strata_bench::stats::Summary;

/// Every inter-token gap of the run, in nanoseconds.
#[derive(Default)]
pub(super) struct ItlSamples {
    small: Vec<u32>,
    /// Gaps of `u32::MAX` nanoseconds or more; all sort after every small one.
    large: Vec<u64>,
}

impl ItlSamples {
    pub(super) fn with_capacity(n: usize) -> Self {
        ItlSamples {
            small: Vec::with_capacity(n),
            large: Vec::new(),
        }
    }

    #[cfg(test)]
    fn push(&mut self, gap: Duration) {
        self.push_ns(u64::try_from(gap.as_nanos()).unwrap_or(u64::MAX));
    }

    pub(super) fn push_ns(&mut self, ns: u64) {
        match u32::try_from(ns) {
            Ok(v) if v != u32::MAX => self.small.push(v),
            _ => self.large.push(ns),
        }
    }

    fn len(&self) -> usize {
        self.small.len() + self.large.len()
    }

    /// The `i`-th smallest gap in milliseconds, as the report computes it (after sorting).
    fn at(&self, i: usize) -> f64 {
        let ns = match self.small.get(i) {
            Some(&v) => u64::from(v),
            None => self.large[i - self.small.len()],
        };
        ms(Duration::from_nanos(ns))
    }

    /// `strata_bench::stats::percentile` over the sorted gaps.
    fn percentile(&self, p: f64) -> f64 {
        let n = self.len();
        let p = p.clamp(0.0, 100.0);
        let rank = p / 100.0 * (n - 1) as f64;
        let lo = rank.floor() as usize;
        let hi = (lo + 1).min(n - 1);
        let frac = rank - lo as f64;
        let (a, b) = (self.at(lo), self.at(hi));
        a + frac * (b - a)
    }

    /// The report's ITL summary and its CDF of `points` quantiles (`None` and empty with
    /// no gap), as `Summary::of` and `stats::quantiles` give them over the same samples.
    pub(super) fn summarize(mut self, points: usize) -> (Option<Summary>, Vec<f64>) {
        let count = self.len();
        if count == 0 {
            return (None, Vec::new());
        }
        radix_sort(&mut self.small);
        self.large.sort_unstable();
        let mean = self
            .small
            .iter()
            .map(|&v| u64::from(v))
            .chain(self.large.iter().copied())
            .map(|ns| ms(Duration::from_nanos(ns)))
            .sum::<f64>()
            / count as f64;
        let summary = Summary {
            count,
            mean,
            min: self.at(0),
            p50: self.percentile(50.0),
            p90: self.percentile(90.0),
            p99: self.percentile(99.0),
            max: self.at(count - 1),
        };
        let cdf = if points < 2 {
            Vec::new()
        } else {
            (0..points)
                .map(|i| self.percentile(100.0 * i as f64 / (points - 1) as f64))
                .collect()
        };
        (Some(summary), cdf)
    }
}

/// Sorts ascending, as `sort_unstable` does (equal integers are indistinguishable): a
/// least-significant-digit radix sort, three passes of 11 bits through one scratch copy,
/// for the hundred million gaps of a large run, where a comparison sort takes seconds.
fn radix_sort(v: &mut Vec<u32>) {
    const BITS: u32 = 11;
    const BUCKETS: usize = 1 << BITS;
    if v.len() < 1 << 14 {
        v.sort_unstable();
        return;
    }
    let digit = |x: u32, pass: u32| ((x >> (BITS * pass)) as usize) & (BUCKETS - 1);
    let mut counts = vec![[0usize; BUCKETS]; 3];
    for &x in v.iter() {
        for (pass, c) in counts.iter_mut().enumerate() {
            c[digit(x, pass as u32)] += 1;
        }
    }
    let mut src = std::mem::take(v);
    let mut dst = vec![0u32; src.len()];
    for (pass, c) in counts.iter().enumerate() {
        // A digit every value shares orders nothing.
        if c.contains(&src.len()) {
            continue;
        }
        let mut next = [0usize; BUCKETS];
        let mut sum = 0;
        for (n, &k) in next.iter_mut().zip(c.iter()) {
            *n = sum;
            sum += k;
        }
        for &x in &src {
            let d = digit(x, pass as u32);
            dst[next[d]] = x;
            next[d] += 1;
        }
        std::mem::swap(&mut src, &mut dst);
    }
    *v = src;
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use strata_bench::stats::quantiles;

    #[test]
    fn radix_sort_equals_sort_unstable() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for n in [0usize, 1, 100, 20_000, 70_000] {
            let v: Vec<u32> = (0..n)
                .map(|i| match i % 4 {
                    0 => rng.random(),
                    1 => rng.random_range(0..5000),
                    2 => 12_345_678,
                    _ => rng.random_range(1_000_000..90_000_000),
                })
                .collect();
            let mut want = v.clone();
            want.sort_unstable();
            let mut got = v;
            radix_sort(&mut got);
            assert_eq!(got, want, "{n} values");
        }
        // Every value sharing the high digits (passes skipped).
        let mut small: Vec<u32> = (0..30_000u32).rev().map(|i| i % 2000).collect();
        let mut want = small.clone();
        want.sort_unstable();
        radix_sort(&mut small);
        assert_eq!(small, want);
    }

    #[test]
    fn itl_summary_equals_the_reports() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for n in [1usize, 2, 3, 10, 1000, 20_000] {
            let mut samples = ItlSamples::default();
            let mut reference = Vec::new();
            for _ in 0..n {
                let ns: u64 = match rng.random_range(0..10) {
                    // Repeated step times, sub-millisecond ones, and gaps past u32.
                    0 => 12_345_678,
                    1 => rng.random_range(0..1_000_000),
                    2 => rng.random_range(4_000_000_000..9_000_000_000),
                    _ => rng.random_range(1_000_000..200_000_000),
                };
                let gap = Duration::from_nanos(ns);
                samples.push(gap);
                reference.push(ms(gap));
            }
            let want = Summary::of(&mut reference);
            let want_cdf = quantiles(&reference, 101);
            let (got, cdf) = samples.summarize(101);
            assert_eq!(got, want, "{n} samples");
            assert_eq!(cdf.len(), 101);
            // Bit for bit, not approximately.
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&cdf), bits(&want_cdf), "{n} samples");
        }
        assert_eq!(ItlSamples::default().summarize(101), (None, Vec::new()));
    }
}
