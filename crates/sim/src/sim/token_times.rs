//! Every request's token times, kept compactly, and what the report reads from them.
//!
//! `strata bench`'s report takes two things from a request's token times: the gaps
//! between consecutive ones (the ITL samples, and an ITL objective's test) and, for the
//! timeline, the bucket each token time falls in. A million simulated requests of 128
//! tokens would keep 128 M `Duration`s (2 GB) for that.
//!
//! A running request gets a token from every step of its replica, so its token times are
//! that replica's step ends from its first token's step on. Here each replica keeps the
//! gap before each of its step ends (`u32` nanoseconds; a gap of 4.29 s or more goes to
//! a side map, marked by `u32::MAX`), and a request keeps only where its tokens began and
//! how many gaps followed: 12 bytes, where its own list of gaps took half a kilobyte. A
//! request whose tokens skip a step of its replica (preempted, or left out of a step)
//! keeps its own list of gaps from then on. Its token times are its first token's time
//! plus the running sums of its gaps, the same whole nanoseconds the simulation measured.
//! At the end the report is built without token times and its ITL summary, ITL CDF and
//! timeline tokens are computed from the gaps by the report's own rules, to the bit
//! (`report_parts_equal_those_from_full_token_times`).

use std::collections::HashMap;
use std::time::Duration;

use strata_bench::report::{Report, CDF_POINTS};

use super::itl::ItlSamples;
use strata_engine::prefetch::prefetch;

/// A gap too long for `u32` nanoseconds: its value is in a side map.
const LONG: u32 = u32::MAX;
/// [`Run::n`] of a request whose gaps are its own list.
const OWN: u32 = u32::MAX;

/// Where a request's gaps are: the `n` step gaps of `replica` after step `first`, or
/// (`n == OWN`) its own list.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    replica: u32,
    first: u32,
    n: u32,
}

/// One replica's steps.
#[derive(Default)]
struct ReplicaSteps {
    /// Its last step's end.
    last_end: Duration,
    /// The gap before each of its step ends (by step number).
    gaps: Vec<u32>,
}

/// Token-time gaps of every request, by request id.
#[derive(Default)]
pub(super) struct TokenGaps {
    /// Per replica, its steps' gaps.
    steps: Vec<ReplicaSteps>,
    /// Long step gaps, by (replica, step).
    step_long: HashMap<(u32, u32), u64>,
    /// Per request; `None` before its first token.
    runs: Vec<Option<Run>>,
    /// The gaps of requests whose run broke.
    own: HashMap<u32, Vec<u32>>,
    /// Their long gaps, in order.
    own_long: HashMap<u32, Vec<u64>>,
}

/// What the timeline needs of one request besides its gaps.
pub(super) struct TimelineRequest {
    /// Its first token's time as the simulation records token times (`None`: no token).
    pub first: Option<Duration>,
    pub ok: bool,
    /// The output tokens the report counts for it (`RequestRecord::output_tokens`).
    pub output_tokens: u32,
}

fn nanos(gap: Duration) -> u64 {
    u64::try_from(gap.as_nanos()).unwrap_or(u64::MAX)
}

impl TokenGaps {
    /// Records that `replica` ended a step at `now`; the step's number.
    pub(super) fn step(&mut self, replica: u32, now: Duration) -> u32 {
        let r = replica as usize;
        if self.steps.len() <= r {
            self.steps.resize_with(r + 1, ReplicaSteps::default);
        }
        let rs = &mut self.steps[r];
        let ns = nanos(now.saturating_sub(rs.last_end));
        rs.last_end = now;
        let v = &mut rs.gaps;
        if v.len() == v.capacity() {
            // A quarter more, not double: a fleet's replicas keep tens of millions.
            v.reserve_exact(v.len() / 4 + 64);
        }
        let step = u32::try_from(v.len()).unwrap_or(u32::MAX);
        match u32::try_from(ns) {
            Ok(g) if g != LONG => v.push(g),
            _ => {
                v.push(LONG);
                self.step_long.insert((replica, step), ns);
            }
        }
        step
    }

    /// Records request `id`'s first token, at the end of `replica`'s step `step`.
    pub(super) fn first(&mut self, id: u32, replica: u32, step: u32) {
        let i = id as usize;
        if self.runs.len() <= i {
            self.runs.resize(i + 1, None);
        }
        self.runs[i] = Some(Run {
            replica,
            first: step,
            n: 0,
        });
    }

    /// Records request `id`'s next token, `gap` after its last, at the end of
    /// `replica`'s step `step`; `expect` is how many gaps it may have in all (a list of
    /// its own reserves that much room once).
    pub(super) fn record(
        &mut self,
        id: u32,
        replica: u32,
        step: u32,
        gap: Duration,
        expect: usize,
    ) {
        let i = id as usize;
        if let Some(Some(run)) = self.runs.get_mut(i) {
            if run.n != OWN
                && run.replica == replica
                && u64::from(run.first) + u64::from(run.n) + 1 == u64::from(step)
                && run.n + 1 != OWN
            {
                run.n += 1;
                return;
            }
        }
        self.record_own(id, gap, expect);
    }

    /// Request `id`'s gap in its own list, its run's gaps moved there first.
    fn record_own(&mut self, id: u32, gap: Duration, expect: usize) {
        let i = id as usize;
        if self.runs.len() <= i {
            self.runs.resize(i + 1, None);
        }
        let run = self.runs[i].unwrap_or(Run {
            replica: 0,
            first: 0,
            n: 0,
        });
        let moved: Vec<u64> = self.run_gaps(run).collect();
        let list = self.own.entry(id).or_default();
        if run.n != OWN {
            list.reserve_exact(expect.max(moved.len() + 1));
            self.runs[i] = Some(Run { n: OWN, ..run });
        }
        for ns in moved.into_iter().chain([nanos(gap)]) {
            push_gap(list, self.own_long.entry(id), ns);
        }
    }

    /// Starts loading request `id`'s run (its next [`TokenGaps::record`] is near).
    #[inline]
    pub(super) fn prefetch(&self, id: u32) {
        if let Some(r) = self.runs.get(id as usize) {
            prefetch(r);
        }
    }

    /// The gaps of a run in nanoseconds (none for a run of its own list).
    fn run_gaps(&self, run: Run) -> impl Iterator<Item = u64> + '_ {
        let n = if run.n == OWN { 0 } else { run.n as usize };
        let from = run.first as usize + 1;
        let steps = self
            .steps
            .get(run.replica as usize)
            .and_then(|v| v.gaps.get(from..from + n))
            .unwrap_or(&[]);
        (from..)
            .zip(steps)
            .map(move |(step, &g)| expand(g, || self.step_long.get(&(run.replica, step as u32))))
    }

    /// Request `id`'s gaps in nanoseconds, in token order.
    pub(super) fn of(&self, id: u32) -> Box<dyn Iterator<Item = u64> + '_> {
        match self.runs.get(id as usize).copied().flatten() {
            None => Box::new(std::iter::empty()),
            Some(run) if run.n != OWN => Box::new(self.run_gaps(run)),
            Some(_) => {
                let long = self.own_long.get(&id).map_or(&[][..], Vec::as_slice);
                let mut next_long = long.iter();
                let own = self.own.get(&id).map_or(&[][..], Vec::as_slice);
                Box::new(own.iter().map(move |&g| expand(g, || next_long.next())))
            }
        }
    }

    /// How many gaps request `id` has.
    fn count(&self, id: u32) -> usize {
        match self.runs.get(id as usize).copied().flatten() {
            None => 0,
            Some(run) if run.n != OWN => run.n as usize,
            Some(_) => self.own.get(&id).map_or(0, Vec::len),
        }
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
            let chunks = 1 + self.count(id);
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

    /// Every gap, for the ITL summary: each replica step's gap once, with how many
    /// requests' runs took a token at its end; the gaps of lists of their own one by one.
    pub(super) fn into_itl(self) -> ItlSamples {
        let mut itl = ItlSamples::default();
        // Per replica and step, the runs starting there minus those ending before it.
        let mut starts: Vec<Vec<u32>> = self
            .steps
            .iter()
            .map(|s| vec![0; s.gaps.len() + 1])
            .collect();
        for (id, run) in self.runs.iter().enumerate() {
            match run {
                Some(run) if run.n == OWN => self.of(id as u32).for_each(|ns| itl.push_ns(ns)),
                Some(run) if run.n > 0 => {
                    let from = run.first as usize + 1;
                    let to = from + run.n as usize;
                    // `run_gaps`' rule: a run past its replica's steps has no gaps.
                    if let Some(s) = starts
                        .get_mut(run.replica as usize)
                        .filter(|s| to < s.len())
                    {
                        s[from] = s[from].wrapping_add(1);
                        s[to] = s[to].wrapping_sub(1);
                    }
                }
                _ => {}
            }
        }
        for ((r, steps), starts) in self.steps.iter().enumerate().zip(&starts) {
            let mut running = 0u32;
            for (step, (&g, &d)) in steps.gaps.iter().zip(starts).enumerate() {
                running = running.wrapping_add(d);
                if running > 0 {
                    let ns = expand(g, || self.step_long.get(&(r as u32, step as u32)));
                    itl.push_many(ns, running);
                }
            }
        }
        itl
    }
}

/// A stored gap in nanoseconds: `g`, or for [`LONG`] the value `long` gives.
fn expand<'a>(g: u32, long: impl FnOnce() -> Option<&'a u64>) -> u64 {
    if g == LONG {
        long().copied().unwrap_or(u64::MAX)
    } else {
        u64::from(g)
    }
}

/// Appends a gap to a list, a long one to its side list.
fn push_gap(
    list: &mut Vec<u32>,
    long: std::collections::hash_map::Entry<'_, u32, Vec<u64>>,
    ns: u64,
) {
    match u32::try_from(ns) {
        Ok(g) if g != LONG => list.push(g),
        _ => {
            list.push(LONG);
            long.or_default().push(ns);
        }
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
        // Four replicas' step ends, long gaps and zero gaps among them.
        let replicas = 4u32;
        let mut ends: Vec<Vec<Duration>> = vec![Vec::new(); replicas as usize];
        for (r, ends) in ends.iter_mut().enumerate() {
            let mut t = Duration::from_millis(rng.random_range(1..3_000));
            for _ in 0..300 {
                let ns = match rng.random_range(0..40) {
                    0 => rng.random_range(4_300_000_000..6_000_000_000u64),
                    1 => 0,
                    _ => rng.random_range(1_000_000..90_000_000u64),
                };
                t += Duration::from_nanos(ns);
                let step = gaps.step(r as u32, t);
                assert_eq!(step as usize, ends.len());
                ends.push(t);
            }
        }
        let mut full = Vec::new();
        let mut compact = Vec::new();
        let mut lean = Vec::new();
        for id in 0..300u32 {
            let start = Duration::from_millis(rng.random_range(0..20_000));
            let failed = id % 37 == 5;
            let tokens = if failed { 0 } else { rng.random_range(0..40) };
            let replica = rng.random_range(0..replicas);
            let ends = &ends[replica as usize];
            let mut step = rng.random_range(0..200u32);
            let mut times = Vec::new();
            for k in 0..tokens {
                if k == 0 {
                    gaps.first(id, replica, step);
                } else {
                    // Mostly the next step; now and then a request misses some (its
                    // gaps move to a list of its own).
                    let last = ends[step as usize];
                    step += if rng.random_range(0..15) == 0 {
                        rng.random_range(2..4)
                    } else {
                        1
                    };
                    gaps.record(id, replica, step, ends[step as usize] - last, 40);
                }
                times.push(ends[step as usize]);
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
        assert!(!gaps.own.is_empty() && !gaps.step_long.is_empty() && !gaps.own_long.is_empty());
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
