//! The ITL summary and CDF from every inter-token gap in whole nanoseconds.
//!
//! `strata bench`'s report converts each gap to milliseconds, sorts them and summarizes.
//! Here the gaps stay integers (a `u32` each; a `u64` past 4.29 s, rare), are sorted as
//! integers (the same order as their milliseconds), and the mean (summed in that order)
//! and the percentiles (the same linear rule) are computed from them converted one at a
//! time: the report's numbers to the bit (`itl_summary_equals_the_reports`).
//!
//! A gap is kept once with how many times it occurred: every request running in a step
//! of a replica gets a token at its end, so a run's hundred million gaps are a few dozen
//! million step gaps, each with its count.

use std::time::Duration;

use strata_bench::record::ms;
use strata_bench::stats::Summary;

/// Every inter-token gap of the run, in nanoseconds.
#[derive(Default)]
pub(super) struct ItlSamples {
    /// `gap << 32 | count`: `count` gaps of `gap` nanoseconds, each under `u32::MAX`.
    small: Vec<u64>,
    /// How many gaps `small` holds in all.
    small_len: usize,
    /// Gaps of `u32::MAX` nanoseconds or more, one entry each; all sort after every
    /// small one.
    large: Vec<u64>,
}

/// The small gaps sorted: each distinct one, and how many gaps are it or smaller.
struct Sorted {
    values: Vec<u32>,
    ends: Vec<u64>,
}

impl ItlSamples {
    #[cfg(test)]
    fn push(&mut self, gap: Duration) {
        self.push_ns(u64::try_from(gap.as_nanos()).unwrap_or(u64::MAX));
    }

    pub(super) fn push_ns(&mut self, ns: u64) {
        self.push_many(ns, 1);
    }

    /// `count` gaps of `ns` nanoseconds.
    pub(super) fn push_many(&mut self, ns: u64, count: u32) {
        if count == 0 {
            return;
        }
        match u32::try_from(ns) {
            Ok(v) if v != u32::MAX => {
                self.small.push((u64::from(v) << 32) | u64::from(count));
                self.small_len += count as usize;
            }
            _ => self.large.extend(std::iter::repeat_n(ns, count as usize)),
        }
    }

    fn len(&self) -> usize {
        self.small_len + self.large.len()
    }

    /// The report's ITL summary and its CDF of `points` quantiles (`None` and empty with
    /// no gap), as `Summary::of` and `stats::quantiles` give them over the same samples.
    pub(super) fn summarize(mut self, points: usize) -> (Option<Summary>, Vec<f64>) {
        let count = self.len();
        if count == 0 {
            return (None, Vec::new());
        }
        radix_sort_by_high_half(&mut self.small);
        self.large.sort_unstable();
        let sorted = Sorted::merge(std::mem::take(&mut self.small));
        // Every gap in ascending order, one addition each, as the report sums them.
        let mean = sorted
            .values
            .iter()
            .zip(sorted.counts())
            .flat_map(|(&v, n)| std::iter::repeat_n(ms(Duration::from_nanos(u64::from(v))), n))
            .chain(self.large.iter().map(|&ns| ms(Duration::from_nanos(ns))))
            .sum::<f64>()
            / count as f64;
        let at = |i: usize| {
            sorted
                .at(i)
                .unwrap_or_else(|| self.large[i - self.small_len])
        };
        let at = |i: usize| ms(Duration::from_nanos(at(i)));
        let percentile = |p: f64| percentile(count, p, at);
        let summary = Summary {
            count,
            mean,
            min: at(0),
            p50: percentile(50.0),
            p90: percentile(90.0),
            p99: percentile(99.0),
            max: at(count - 1),
        };
        let cdf = if points < 2 {
            Vec::new()
        } else {
            (0..points)
                .map(|i| percentile(100.0 * i as f64 / (points - 1) as f64))
                .collect()
        };
        (Some(summary), cdf)
    }
}

/// `strata_bench::stats::percentile` over `n` sorted values, the `i`-th being `at(i)`.
fn percentile(n: usize, p: f64, at: impl Fn(usize) -> f64) -> f64 {
    let p = p.clamp(0.0, 100.0);
    let rank = p / 100.0 * (n - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    let frac = rank - lo as f64;
    let (a, b) = (at(lo), at(hi));
    a + frac * (b - a)
}

impl Sorted {
    /// From `gap << 32 | count` entries sorted by gap.
    fn merge(entries: Vec<u64>) -> Sorted {
        let mut values: Vec<u32> = Vec::new();
        let mut ends: Vec<u64> = Vec::new();
        let mut total = 0u64;
        for e in entries {
            let (v, n) = ((e >> 32) as u32, e & u64::from(u32::MAX));
            total += n;
            if values.last() == Some(&v) {
                if let Some(end) = ends.last_mut() {
                    *end = total;
                }
            } else {
                values.push(v);
                ends.push(total);
            }
        }
        Sorted { values, ends }
    }

    /// How many gaps each distinct value stands for.
    fn counts(&self) -> impl Iterator<Item = usize> + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        self.ends.iter().zip(starts).map(|(&e, s)| (e - s) as usize)
    }

    /// The `i`-th smallest small gap, if there are more than `i`.
    fn at(&self, i: usize) -> Option<u64> {
        let k = self.ends.partition_point(|&e| e <= i as u64);
        self.values.get(k).map(|&v| u64::from(v))
    }
}

/// Sorts by the high 32 bits, ascending (the order among equal high halves is left
/// open): a least-significant-digit radix sort, three passes of 11 bits through one
/// scratch copy, for the tens of millions of gaps of a large run, where a comparison
/// sort takes seconds.
fn radix_sort_by_high_half(v: &mut Vec<u64>) {
    const BITS: u32 = 11;
    const BUCKETS: usize = 1 << BITS;
    if v.len() < 1 << 14 {
        v.sort_unstable_by_key(|&x| x >> 32);
        return;
    }
    let digit = |x: u64, pass: u32| ((x >> (32 + BITS * pass)) as usize) & (BUCKETS - 1);
    let mut counts = vec![[0usize; BUCKETS]; 3];
    for &x in v.iter() {
        for (pass, c) in counts.iter_mut().enumerate() {
            c[digit(x, pass as u32)] += 1;
        }
    }
    let mut src = std::mem::take(v);
    let mut dst = vec![0u64; src.len()];
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
    fn radix_sort_orders_by_the_high_half() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let high = |v: &[u64]| v.iter().map(|x| x >> 32).collect::<Vec<_>>();
        for n in [0usize, 1, 100, 20_000, 70_000] {
            let v: Vec<u64> = (0..n)
                .map(|i| {
                    let gap: u32 = match i % 4 {
                        0 => rng.random(),
                        1 => rng.random_range(0..5000),
                        2 => 12_345_678,
                        _ => rng.random_range(1_000_000..90_000_000),
                    };
                    (u64::from(gap) << 32) | u64::from(rng.random_range(1..9u32))
                })
                .collect();
            let mut want = v.clone();
            want.sort_unstable();
            let mut got = v;
            radix_sort_by_high_half(&mut got);
            assert_eq!(high(&got), high(&want), "{n} values");
            got.sort_unstable();
            assert_eq!(got, want, "the same entries");
        }
        // Every value sharing the high digits (passes skipped).
        let mut small: Vec<u64> = (0..30_000u64).rev().map(|i| (i % 2000) << 32 | 1).collect();
        let mut want = small.clone();
        want.sort_unstable();
        radix_sort_by_high_half(&mut small);
        assert_eq!(small, want);
    }

    #[test]
    fn a_counted_gap_is_that_many_gaps() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (mut counted, mut one_by_one) = (ItlSamples::default(), ItlSamples::default());
        for _ in 0..3000 {
            let ns: u64 = match rng.random_range(0..8) {
                0 => 5_000_000_000,
                1 => 7_000_000,
                _ => rng.random_range(1_000_000..30_000_000),
            };
            let n = rng.random_range(0..6u32);
            counted.push_many(ns, n);
            (0..n).for_each(|_| one_by_one.push_ns(ns));
        }
        let bits = |(s, cdf): (Option<Summary>, Vec<f64>)| {
            let s = s.unwrap();
            let mut v = vec![s.count as u64];
            v.extend([s.mean, s.min, s.p50, s.p90, s.p99, s.max].map(f64::to_bits));
            v.extend(cdf.iter().map(|x| x.to_bits()));
            v
        };
        assert_eq!(
            bits(counted.summarize(101)),
            bits(one_by_one.summarize(101))
        );
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
