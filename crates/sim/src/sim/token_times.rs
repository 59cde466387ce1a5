//! Every request's token times, kept compactly, and what the report reads from them.
//!
//! `strata bench`'s report takes two things from a request's token times: the gaps
//! between consecutive ones (the ITL samples, and an ITL objective's test) and, for the
//! timeline, the bucket each token time falls in. A million simulated requests of 128
//! tokens would keep 128 M `Duration`s (2 GB) for that. Here a request keeps its gaps
//! as `u32` nanoseconds (a gap of 4.29 s or more goes to a side list, marked by
//! `u32::MAX`): its token times are its first token's time plus the running sums of its
//! gaps, the same whole nanoseconds the simulation measured. At the end the report is
//! built without token times and its ITL summary, ITL CDF and timeline tokens are
//! computed from the gaps by the report's own rules, to the bit
//! (`report_parts_equal_those_from_full_token_times`).

use std::collections::HashMap;
use std::time::Duration;

use strata_bench::report::{Report, CDF_POINTS};

use super::itl::ItlSamples;
use crate::prefetch::prefetch;

/// A gap too long for `u32` nanoseconds: the next entry of the request's side list.
const LONG: u32 = u32::MAX;

/// Token-time gaps of every request, by request id.
#[derive(Default)]
pub(super) struct TokenGaps {
    gaps: Vec<Vec<u32>>,
    long: HashMap<u32, Vec<u64>>,
}

/// What the timeline needs of one request besides its gaps.
pub(super) struct TimelineRequest {
    /// Its first token's time as the simulation records token times (`None`: no token).
    pub first: Option<Duration>,
    pub ok: bool,
    /// The output tokens the report counts for it (`RequestRecord::output_tokens`).
    pub output_tokens: u32,
}

impl TokenGaps {
    /// Records the gap before request `id`'s next token; `expect` is how many gaps it may
    /// have in all (its first gap reserves that much room once).
    pub(super) fn record(&mut self, id: u32, gap: Duration, expect: usize) {
        let i = id as usize;
        if self.gaps.len() <= i {
            self.gaps.resize_with(i + 1, Vec::new);
        }
        let v = &mut self.gaps[i];
        if v.capacity() == 0 {
            v.reserve_exact(expect.max(1));
        }
        let ns = u64::try_from(gap.as_nanos()).unwrap_or(u64::MAX);
        match u32::try_from(ns) {
            Ok(g) if g != LONG => v.push(g),
            _ => {
                v.push(LONG);
                self.long.entry(id).or_default().push(ns);
            }
        }
    }

    /// Starts loading request `id`'s list (its next [`TokenGaps::record`] is near).
    #[inline]
    pub(super) fn prefetch(&self, id: u32) {
        if let Some(v) = self.gaps.get(id as usize) {
            prefetch(v);
        }
    }

    /// Request `id`'s gaps in nanoseconds, in token order.
    pub(super) fn of(&self, id: u32) -> impl Iterator<Item = u64> + '_ {
        let long = self.long.get(&id).map_or(&[][..], Vec::as_slice);
        let mut next_long = long.iter();
        self.gaps
            .get(id as usize)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .map(move |&g| {
                if g == LONG {
                    next_long.next().copied().unwrap_or(u64::MAX)
                } else {
                    u64::from(g)
                }
            })
    }

    /// The longest gap of request `id`, if it has one.
    pub(super) fn max_of(&self, id: u32) -> Option<Duration> {
        self.of(id).max().map(Duration::from_nanos)
    }

    /// Fills the report's timeline tokens (built without token times) as the report
    /// would from every request's token times: for each request in order, each token
    /// time adds `output_tokens / chunks` (1 for a failed request) to its bucket.
    pub(super) fn fill_timeline(&self, report: &mut Report, requests: &[TimelineRequest]) {
        let bucket = report.timeline_bucket_s;
        let n = report.timeline.len();
        if n == 0 {
            return;
        }
        let points = &mut report.timeline;
        points.iter_mut().for_each(|p| p.output_tokens = 0.0);
        let index = |t: Duration| ((t.as_secs_f64() / bucket) as usize).min(n - 1);
        for (id, r) in requests.iter().enumerate() {
            let Some(first) = r.first else { continue };
            let id = id as u32;
            let chunks = 1 + self.gaps.get(id as usize).map_or(0, Vec::len);
            let per_chunk = if r.ok {
                f64::from(r.output_tokens) / chunks as f64
            } else {
                1.0
            };
            let mut t = first;
            points[index(t)].output_tokens += per_chunk;
            for g in self.of(id) {
                t += Duration::from_nanos(g);
                points[index(t)].output_tokens += per_chunk;
            }
        }
    }

    /// Every gap, for the ITL summary (each request's list is freed as it is taken).
    pub(super) fn into_itl(mut self) -> ItlSamples {
        let mut itl = ItlSamples::with_capacity(self.gaps.iter().map(Vec::len).sum());
        for (id, v) in self.gaps.iter_mut().enumerate() {
            let v = std::mem::take(v);
            let mut long = self
                .long
                .remove(&(id as u32))
                .unwrap_or_default()
                .into_iter();
            for g in v {
                if g == LONG {
                    itl.push_ns(long.next().unwrap_or(u64::MAX));
                } else {
                    itl.push_ns(u64::from(g));
                }
            }
        }
        itl
    }
}

/// Sets the report's ITL summary and CDF from every gap.
pub(super) fn fill_itl(report: &mut Report, itl: ItlSamples) {
    let (summary, cdf) = itl.summarize(CDF_POINTS);
    report.latency_ms.itl = summary;
    report.cdf_ms.itl = cdf;
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use strata_bench::{RequestRecord, Slo};

    #[test]
    fn report_parts_equal_those_from_full_token_times() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut gaps = TokenGaps::default();
        let mut full = Vec::new();
        let mut compact = Vec::new();
        let mut lean = Vec::new();
        for id in 0..300u32 {
            let start = Duration::from_millis(rng.random_range(0..20_000));
            let failed = id % 37 == 5;
            let tokens = if failed { 0 } else { rng.random_range(0..40) };
            let mut times = Vec::new();
            let mut t = Duration::from_millis(rng.random_range(1..3_000));
            for k in 0..tokens {
                if k > 0 {
                    let ns = match rng.random_range(0..20) {
                        0 => rng.random_range(4_300_000_000..6_000_000_000u64),
                        1 => 0,
                        _ => rng.random_range(1_000_000..90_000_000u64),
                    };
                    let gap = Duration::from_nanos(ns);
                    gaps.record(id, gap, 40);
                    t += gap;
                }
                times.push(t);
            }
            // Some requests report fewer tokens than they streamed chunks.
            let out = if id % 11 == 0 { tokens / 2 } else { tokens };
            let e2e = times.last().copied().unwrap_or_default() + Duration::from_millis(1);
            let record = RequestRecord {
                start,
                ttft: times.first().copied(),
                e2e,
                token_times: times.clone(),
                completion_tokens: (!failed).then_some(out),
                prompt_tokens: (!failed).then_some(10),
                failure: failed.then(|| strata_bench::record::Failure {
                    kind: strata_bench::FailureKind::HttpStatus(400),
                    message: "too long".into(),
                }),
                ..Default::default()
            };
            compact.push(TimelineRequest {
                first: times.first().copied(),
                ok: !failed,
                output_tokens: record.output_tokens(),
            });
            let max = gaps.max_of(id);
            let want_max = record.itls().max();
            assert_eq!(max, want_max, "request {id}");
            lean.push(RequestRecord {
                token_times: Vec::new(),
                ..record.clone()
            });
            full.push(record);
        }
        let end = Duration::from_secs(30);
        let slo = Slo::default();
        let want = Report::from_records("x", serde_json::Value::Null, &full, end, &slo);
        let mut got = Report::from_records("x", serde_json::Value::Null, &lean, end, &slo);
        assert_ne!(got.latency_ms.itl, want.latency_ms.itl);
        gaps.fill_timeline(&mut got, &compact);
        fill_itl(&mut got, gaps.into_itl());
        assert_eq!(
            serde_json::to_string(&got).unwrap(),
            serde_json::to_string(&want).unwrap()
        );
    }
}
