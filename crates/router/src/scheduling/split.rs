//! Traffic splits between endpoint groups (canaries): `{group: weight}`, applied before
//! the filters. An endpoint's group is its `group` label (`""` when unlabelled).
//!
//! One group is drawn per request with probability weight / (sum of the weights of the
//! groups that have an eligible endpoint right now), so a group with no ready endpoint
//! never swallows traffic. Groups not named in the split get no traffic while any named
//! group is available; when none is, the split is ignored rather than failing requests.

use std::collections::BTreeMap;

use rand::{Rng, RngCore};

use super::Candidate;

/// Weights per group; weights ≤ 0 take no traffic.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrafficSplit(pub BTreeMap<String, f64>);

impl TrafficSplit {
    pub fn is_empty(&self) -> bool {
        self.0.values().all(|w| *w <= 0.0 || !w.is_finite())
    }

    /// Narrows `cands` to one group drawn by weight.
    pub fn apply<'c>(
        &self,
        cands: Vec<&'c Candidate>,
        rng: &mut dyn RngCore,
    ) -> Vec<&'c Candidate> {
        if self.is_empty() {
            return cands;
        }
        let group_of = |c: &Candidate| c.spec.group.clone().unwrap_or_default();
        let live: Vec<(&String, f64)> = self
            .0
            .iter()
            .filter(|(g, w)| **w > 0.0 && w.is_finite() && cands.iter().any(|c| group_of(c) == **g))
            .map(|(g, w)| (g, *w))
            .collect();
        let total: f64 = live.iter().map(|(_, w)| w).sum();
        if live.is_empty() || total <= 0.0 {
            return cands;
        }
        let mut x = rng.random::<f64>() * total;
        let mut chosen = live[live.len() - 1].0;
        for (g, w) in &live {
            if x < *w {
                chosen = g;
                break;
            }
            x -= w;
        }
        cands
            .into_iter()
            .filter(|c| group_of(c) == *chosen)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use std::sync::Arc;

    #[test]
    fn draws_groups_by_weight_and_skips_empty_groups() {
        let mut cs = [cand(0, 0.0, 0.0), cand(1, 0.0, 0.0), cand(2, 0.0, 0.0)];
        Arc::make_mut(&mut cs[0].spec).group = Some("stable".into());
        Arc::make_mut(&mut cs[1].spec).group = Some("stable".into());
        Arc::make_mut(&mut cs[2].spec).group = Some("canary".into());
        let split = TrafficSplit(BTreeMap::from([
            ("stable".to_string(), 9.0),
            ("canary".to_string(), 1.0),
            ("ghost".to_string(), 100.0),
        ]));
        let mut rng = StdRng::seed_from_u64(5);
        let mut canary = 0;
        for _ in 0..5000 {
            let out = split.apply(cs.iter().collect(), &mut rng);
            let groups: std::collections::HashSet<_> =
                out.iter().map(|c| c.spec.group.clone()).collect();
            assert_eq!(groups.len(), 1);
            if out[0].id.0 == 2 {
                canary += 1;
            }
        }
        assert!((350..650).contains(&canary), "{canary}");
        // Only unnamed groups available: the split steps aside.
        let only = TrafficSplit(BTreeMap::from([("ghost".to_string(), 1.0)]));
        assert_eq!(only.apply(cs.iter().collect(), &mut rng).len(), 3);
        assert!(TrafficSplit::default().is_empty());
        let zero = TrafficSplit(BTreeMap::from([
            ("canary".to_string(), 0.0),
            ("stable".to_string(), 1.0),
        ]));
        for _ in 0..50 {
            assert!(zero
                .apply(cs.iter().collect(), &mut rng)
                .iter()
                .all(|c| c.id.0 != 2));
        }
    }
}
