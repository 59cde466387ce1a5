//! Pickers: order the scored candidates, best first. Every picker returns all candidates
//! (the tail is the proxy's retry order).

use rand::seq::SliceRandom;
use rand::{Rng, RngCore};

use super::{Picker, Scored};

/// Highest total wins; ties broken at random (PROTOCOLS §6). The rest follow by score.
#[derive(Debug, Clone, Copy, Default)]
pub struct MaxScore;

impl Picker for MaxScore {
    fn pick(&self, scored: &mut Vec<Scored>, rng: &mut dyn RngCore) {
        scored.sort_by(|a, b| b.score.total_cmp(&a.score));
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
