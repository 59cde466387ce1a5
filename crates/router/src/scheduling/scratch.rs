//! Buffers a caller that decides again and again keeps between decisions
//! ([`super::EndpointPicker::schedule_first`]): the eligible candidates, the scores and
//! the scored list. A pool of a thousand endpoints needs tens of kilobytes of them per
//! decision, which the allocator otherwise hands out and takes back every time.

use super::{Candidate, Scored};

/// See the module documentation. Empty between decisions (it holds no candidate).
#[derive(Debug, Default)]
pub struct PickScratch {
    cands: Vec<&'static Candidate>,
    pub(super) totals: Vec<f64>,
    pub(super) scored: Vec<Scored>,
}

impl PickScratch {
    /// The candidates list, empty, with the room of the last decision's.
    pub(super) fn take_cands<'c>(&mut self) -> Vec<&'c Candidate> {
        recycle(std::mem::take(&mut self.cands))
    }

    /// Keeps `cands`' room for the next decision.
    pub(super) fn put_cands(&mut self, cands: Vec<&Candidate>) {
        self.cands = recycle(cands);
    }
}

/// `v` emptied, as a list of references of another lifetime. The standard library
/// collects an emptied list into one of the same layout in place, so its room is kept
/// (were it not, this would only allocate).
#[allow(clippy::unnecessary_filter_map)] // a `filter` could not change the lifetime
fn recycle<'b>(mut v: Vec<&Candidate>) -> Vec<&'b Candidate> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::testutil::cand;

    #[test]
    fn a_recycled_list_is_empty_and_keeps_its_room() {
        let pool = [cand(0, 0.0, 0.0), cand(1, 0.0, 0.0)];
        let mut scratch = PickScratch::default();
        let mut cands = scratch.take_cands();
        cands.extend(pool.iter());
        cands.reserve(100);
        let room = cands.capacity();
        scratch.put_cands(cands);
        let again = scratch.take_cands();
        assert!(again.is_empty());
        assert_eq!(again.capacity(), room);
    }
}
