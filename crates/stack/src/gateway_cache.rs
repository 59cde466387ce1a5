//! The dashboard's gateway cache panel: per tenant, the share of cacheable requests that
//! a cache answered (`x-strata-cache: hit` or `semantic`) since the previous reading,
//! from the gateway's `strata_gateway_cache_outcomes_total{tenant, outcome}` counters.
//!
//! Pure: the dashboard's collector hands in the gateway's `/metrics` text each tick.

use std::collections::{BTreeMap, HashMap, VecDeque};

use strata_api::prometheus::{counter_delta, parse_sample};

/// The gateway counter this panel reads (defined by `strata_gateway::metrics`).
pub const CACHE_OUTCOMES: &str = "strata_gateway_cache_outcomes_total";

/// Per tenant: (answered by a cache, all cacheable) requests so far.
pub fn parse_cache_outcomes(text: &str) -> HashMap<String, (f64, f64)> {
    let mut out: HashMap<String, (f64, f64)> = HashMap::new();
    for line in text.lines() {
        let Some(m) = parse_sample(line) else {
            continue;
        };
        if m.name != CACHE_OUTCOMES {
            continue;
        }
        let (Some(tenant), Some(outcome)) = (m.label("tenant"), m.label("outcome")) else {
            continue;
        };
        let e = out.entry(tenant.to_string()).or_default();
        if outcome == "hit" || outcome == "semantic" {
            e.0 += m.value;
        }
        e.1 += m.value;
    }
    out
}

/// Hit rate series per tenant, aligned with the dashboard's time axis.
#[derive(Debug, Default)]
pub struct CacheRates {
    last: HashMap<String, (f64, f64)>,
    /// Per tenant, oldest point first; `None` where no cacheable request came.
    pub series: BTreeMap<String, VecDeque<Option<f64>>>,
}

impl CacheRates {
    /// One reading (`None`: no gateway, or no page this tick). `points` is the length of
    /// the time axis after this tick, so every series ends at the same instant.
    pub fn tick(&mut self, page: Option<&str>, points: usize) {
        let now = page.map(parse_cache_outcomes).unwrap_or_default();
        for tenant in now.keys() {
            // A tenant seen for the first time has had no readings so far.
            self.series
                .entry(tenant.clone())
                .or_insert_with(|| std::iter::repeat_n(None, points.saturating_sub(1)).collect());
        }
        for (tenant, series) in self.series.iter_mut() {
            let rate = match (now.get(tenant), self.last.get(tenant)) {
                (Some(&(h, n)), Some(&(h0, n0))) => {
                    let (dh, dn) = (counter_delta(h, h0), counter_delta(n, n0));
                    (dn > 0.0).then(|| (dh / dn).min(1.0))
                }
                _ => None,
            };
            // The axis length bounds every series (the dashboard keeps a bounded history).
            series.push_back(rate);
            while series.len() > points.max(1) {
                series.pop_front();
            }
        }
        self.last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(a: (u32, u32, u32), b_miss: u32) -> String {
        format!(
            "# TYPE strata_gateway_cache_outcomes counter\n\
             strata_gateway_cache_outcomes_total{{tenant=\"a\",outcome=\"hit\"}} {}\n\
             strata_gateway_cache_outcomes_total{{tenant=\"a\",outcome=\"semantic\"}} {}\n\
             strata_gateway_cache_outcomes_total{{tenant=\"a\",outcome=\"miss\"}} {}\n\
             strata_gateway_cache_outcomes_total{{tenant=\"b\",outcome=\"miss\"}} {b_miss}\n\
             strata_gateway_cache_total{{result=\"hit\"}} 99\n",
            a.0, a.1, a.2
        )
    }

    #[test]
    fn outcomes_are_summed_per_tenant() {
        let p = parse_cache_outcomes(&page((2, 3, 5), 4));
        assert_eq!(p["a"], (5.0, 10.0));
        assert_eq!(p["b"], (0.0, 4.0));
        assert_eq!(p.len(), 2, "other gateway counters are not read");
    }

    #[test]
    fn rates_come_from_deltas_and_stay_aligned() {
        let mut r = CacheRates::default();
        r.tick(None, 1);
        assert!(r.series.is_empty(), "no gateway, no tenants");
        r.tick(Some(&page((0, 0, 0), 0)), 2);
        assert_eq!(r.series["a"], [None, None]);
        // a: 1 hit + 2 semantic out of 4 new requests; b: none new.
        r.tick(Some(&page((1, 2, 1), 0)), 3);
        assert_eq!(r.series["a"].back(), Some(&Some(0.75)));
        assert_eq!(r.series["b"].back(), Some(&None));
        // A gateway restart (counters went down) counts from zero, never negative.
        r.tick(Some(&page((0, 1, 1), 2)), 4);
        assert_eq!(r.series["a"].back(), Some(&Some(0.5)));
        assert_eq!(r.series["b"].back(), Some(&Some(0.0)));
        // The page missing for a tick is a gap, not a zero.
        r.tick(None, 5);
        assert_eq!(r.series["a"].back(), Some(&None));
        assert!(r.series.values().all(|s| s.len() == 5));
        // The axis stops growing at the dashboard's history; so does every series.
        const AXIS: usize = 300;
        for i in 0..(AXIS + 10) {
            r.tick(Some(&page((0, 1, 1), 2)), (6 + i).min(AXIS));
        }
        assert!(r.series.values().all(|s| s.len() == AXIS));
    }
}
