//! Pickers: order the scored candidates, best first. Every picker returns all candidates
//! (the tail is the proxy's retry order).

use rand::seq::SliceRandom;
use rand::{Rng, RngCore};
use smallvec::SmallVec;

use super::{Picker, Scored};

/// Highest total wins; ties broken at random (PROTOCOLS §6). The rest follow by score.
#[derive(Debug, Clone, Copy, Default)]
pub struct MaxScore;

impl Picker for MaxScore {
    fn pick(&self, scored: &mut Vec<Scored>, rng: &mut dyn RngCore) {
        sort_by_score_stable(scored);
        // One draw among the best: the tie group is at the front after sorting. Ties in
        // the tail (fallback order) keep slot order.
        let Some(best) = scored.first().map(|s| s.score) else {
            return;
        };
        let ties = scored.iter().take_while(|s| s.score == best).count();
        if ties > 1 {
            let i = rng.random_range(0..ties);
            scored.swap(0, i);
        }
    }

    /// The pick without sorting: the best score's first candidate, or, among several
    /// equal to it, the draw's one in the order the sort would give them.
    fn pick_first(&self, scored: &mut Vec<Scored>, rng: &mut dyn RngCore) {
        // The sort's first: the highest key, the first position among equal keys.
        let Some(head) = scored.first() else {
            return;
        };
        let (mut first, mut best_key) = (0, total_key(head.score));
        for (i, s) in scored.iter().enumerate().skip(1) {
            let k = total_key(s.score);
            if k > best_key {
                (first, best_key) = (i, k);
            }
        }
        let best = scored[first].score;
        // The tie group `pick` counts (`== best` from the front of the sorted order): the
        // best key's candidates by position, then, for a best of +0.0, those of -0.0
        // (next in the sort, and `==` to it). A NaN best has none.
        let ties = scored.iter().filter(|s| s.score == best).count();
        let chosen = if ties > 1 {
            let i = rng.random_range(0..ties);
            let same_key = scored.iter().filter(|s| total_key(s.score) == best_key);
            let rest = scored
                .iter()
                .filter(|s| s.score == best && total_key(s.score) != best_key);
            same_key.chain(rest).nth(i).copied()
        } else {
            None
        };
        let chosen = chosen.unwrap_or(scored[first]);
        scored.clear();
        scored.push(chosen);
    }
}

/// `f64::total_cmp`'s order as an unsigned integer (the transform `f64::total_cmp` uses,
/// then the sign bit flipped so that unsigned order is signed order).
fn total_key(x: f64) -> u64 {
    let bits = x.to_bits() as i64;
    (bits ^ ((((bits >> 63) as u64) >> 1) as i64)) as u64 ^ (1 << 63)
}

/// Sorts by score, highest first, equal scores keeping their order: the order of a
/// stable `sort_by(|a, b| b.score.total_cmp(&a.score))`, computed as an unstable sort
/// of one integer per candidate (score key and position packed so that integer order is
/// the wanted order), which is cheaper than a stable sort of the candidates, one
/// comparison being one integer compare, even at a thousand candidates per decision;
/// nothing is allocated for up to 64 of them.
fn sort_by_score_stable(scored: &mut [Scored]) {
    // Highest score first: the inverted key ascends; then the position ascends.
    let mut keys: SmallVec<[u128; 64]> = scored
        .iter()
        .enumerate()
        .map(|(i, s)| (u128::from(!total_key(s.score)) << 64) | i as u128)
        .collect();
    keys.sort_unstable();
    let sorted: SmallVec<[Scored; 64]> =
        keys.iter().map(|&k| scored[(k as u64) as usize]).collect();
    scored.copy_from_slice(&sorted);
}

/// Draws in proportion to score (without replacement, so the tail is a weighted order
/// too). All-zero scores draw uniformly.
#[derive(Debug, Clone, Copy, Default)]
pub struct WeightedRandom;

impl Picker for WeightedRandom {
    fn pick(&self, scored: &mut Vec<Scored>, rng: &mut dyn RngCore) {
        // Efraimidis–Spirakis: key = u^(1/w); sorting by key descending samples without
        // replacement with probabilities proportional to w.
        let all_zero = scored.iter().all(|s| s.score <= 0.0);
        let mut keyed: Vec<(f64, Scored)> = scored
            .iter()
            .map(|s| {
                let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                let w = if all_zero { 1.0 } else { s.score.max(0.0) };
                let key = if w > 0.0 { u.powf(1.0 / w) } else { -u };
                (key, *s)
            })
            .collect();
        keyed.sort_by(|a, b| b.0.total_cmp(&a.0));
        scored.clear();
        scored.extend(keyed.into_iter().map(|(_, s)| s));
    }
}

/// Uniformly random order, scores ignored.
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomPicker;

impl Picker for RandomPicker {
    fn pick(&self, scored: &mut Vec<Scored>, rng: &mut dyn RngCore) {
        scored.shuffle(rng);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointId;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn s(v: &[f64]) -> Vec<Scored> {
        v.iter()
            .enumerate()
            .map(|(i, &score)| Scored {
                id: EndpointId(i as u32),
                score,
            })
            .collect()
    }

    #[test]
    fn max_score_orders_and_breaks_ties_randomly() {
        let mut rng = StdRng::seed_from_u64(0);
        let mut v = s(&[0.1, 3.0, 2.0]);
        MaxScore.pick(&mut v, &mut rng);
        assert_eq!(v.iter().map(|x| x.id.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        let mut firsts = std::collections::HashSet::new();
        for _ in 0..50 {
            let mut v = s(&[1.0, 1.0, 1.0, 0.5]);
            MaxScore.pick(&mut v, &mut rng);
            assert_ne!(v[0].id.0, 3);
            assert_eq!(v[3].id.0, 3);
            firsts.insert(v[0].id.0);
        }
        assert_eq!(firsts.len(), 3);
    }

    #[test]
    fn weighted_random_follows_weights() {
        let mut rng = StdRng::seed_from_u64(42);
        let mut counts = [0u32; 3];
        for _ in 0..4000 {
            let mut v = s(&[1.0, 3.0, 0.0]);
            WeightedRandom.pick(&mut v, &mut rng);
            assert_eq!(v.len(), 3);
            counts[v[0].id.0 as usize] += 1;
        }
        assert_eq!(
            counts[2], 0,
            "zero weight never first while others are positive"
        );
        let ratio = f64::from(counts[1]) / f64::from(counts[0]);
        assert!((2.4..3.6).contains(&ratio), "{counts:?}");
        let mut v = s(&[0.0, 0.0]);
        WeightedRandom.pick(&mut v, &mut rng);
        assert_eq!(v.len(), 2);
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use crate::endpoint::EndpointId;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn score_sort_equals_a_stable_sort(
            raw in proptest::collection::vec((0u32..1000, prop_oneof![
                (0u8..4).prop_map(f64::from),
                Just(-0.0),
                Just(f64::NAN),
                Just(-f64::NAN),
                Just(f64::INFINITY),
                -10.0f64..10.0,
            ]), 0..80),
        ) {
            let scored: Vec<Scored> = raw
                .iter()
                .map(|&(id, score)| Scored { id: EndpointId(id), score })
                .collect();
            let mut want = scored.clone();
            want.sort_by(|a, b| b.score.total_cmp(&a.score));
            let mut got = scored;
            sort_by_score_stable(&mut got);
            let bits = |v: &[Scored]| v.iter().map(|s| (s.id, s.score.to_bits())).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got), bits(&want));
        }

        /// `pick_first` picks what `pick` puts first, after the same draws, for every
        /// picker (ties, signed zeros and NaNs included).
        #[test]
        fn pick_first_equals_the_first_of_pick(
            raw in proptest::collection::vec(prop_oneof![
                (0u8..3).prop_map(f64::from),
                Just(0.0),
                Just(-0.0),
                Just(f64::NAN),
                -2.0f64..2.0,
            ], 0..40),
            seed in 0u64..1000,
        ) {
            use rand::{rngs::StdRng, RngCore, SeedableRng};
            let scored: Vec<Scored> = raw
                .iter()
                .enumerate()
                .map(|(i, &score)| Scored { id: EndpointId(i as u32), score })
                .collect();
            let pickers: [&dyn Picker; 3] = [&MaxScore, &WeightedRandom, &RandomPicker];
            for p in pickers {
                let (mut a, mut b) = (StdRng::seed_from_u64(seed), StdRng::seed_from_u64(seed));
                let mut full = scored.clone();
                p.pick(&mut full, &mut a);
                let mut first = scored.clone();
                p.pick_first(&mut first, &mut b);
                let bits = |v: &[Scored]| v.iter().map(|s| (s.id, s.score.to_bits())).collect::<Vec<_>>();
                prop_assert_eq!(bits(&first), bits(&full[..full.len().min(1)]));
                prop_assert_eq!(a.next_u64(), b.next_u64(), "the same draws");
            }
        }
    }
}
