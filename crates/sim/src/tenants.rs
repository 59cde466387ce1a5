//! Tenants: a workload's sessions shared among named tenants by weight
//! (`--tenants noisy=10,quiet=1`: each session belongs to a tenant drawn with probability
//! ∝ its weight, from its own seeded stream), so an open-loop rate `R` becomes independent
//! arrivals at `R × w / Σw` per tenant. Each tenant is its own flow in flow control, and
//! the report gives each its TTFT and end-to-end percentiles.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::error::SimError;

/// `--tenants`: names and weights, in the order given.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantSpec(pub Vec<(String, f64)>);

/// `--tenants`' parser.
pub fn parse_tenant_spec(spec: &str) -> Result<TenantSpec, SimError> {
    parse_tenants(spec).map(TenantSpec)
}

/// `name=weight[,name=weight...]`.
pub fn parse_tenants(spec: &str) -> Result<Vec<(String, f64)>, SimError> {
    let bad = |m: String| SimError::config("--tenants", m);
    let mut out: Vec<(String, f64)> = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, w) = part
            .split_once('=')
            .ok_or_else(|| bad(format!("`{part}` is not name=weight")))?;
        let name = name.trim();
        let w: f64 = w
            .trim()
            .parse()
            .map_err(|_| bad(format!("`{w}` is not a number")))?;
        if name.is_empty() || !(w.is_finite() && w > 0.0) {
            return Err(bad(format!(
                "`{part}`: a tenant needs a name and a positive weight"
            )));
        }
        if out.iter().any(|(n, _)| n == name) {
            return Err(bad(format!("tenant `{name}` is named twice")));
        }
        out.push((name.to_string(), w));
    }
    if out.is_empty() {
        return Err(bad("name at least one tenant".into()));
    }
    Ok(out)
}

/// Draws each new session's tenant.
#[derive(Debug)]
pub struct TenantDraw {
    names: Vec<String>,
    /// Cumulative weights.
    cum: Vec<f64>,
    rng: StdRng,
}

impl TenantDraw {
    /// `tenants` as parsed; the draw's own stream from `seed`, so adding tenants changes
    /// no other random choice of the run.
    pub fn new(tenants: &[(String, f64)], seed: u64) -> Self {
        let mut total = 0.0;
        let cum = tenants
            .iter()
            .map(|(_, w)| {
                total += w;
                total
            })
            .collect();
        TenantDraw {
            names: tenants.iter().map(|(n, _)| n.clone()).collect(),
            cum,
            rng: StdRng::seed_from_u64(seed ^ 0x7e4a_47d5_f10c),
        }
    }

    /// A tenant's index (0 with a single tenant).
    pub fn draw(&mut self) -> u16 {
        let Some(&total) = self.cum.last() else {
            return 0;
        };
        if self.cum.len() == 1 {
            return 0;
        }
        let x = self.rng.random::<f64>() * total;
        self.cum
            .iter()
            .position(|&c| x < c)
            .unwrap_or(self.cum.len() - 1) as u16
    }

    pub fn name(&self, i: u16) -> &str {
        self.names.get(usize::from(i)).map_or("", String::as_str)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// One tenant's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantLine {
    pub tenant: String,
    pub requests: u64,
    pub failed: u64,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub e2e_p90_s: Option<f64>,
}

/// The nearest-rank percentile `q` (0..1) of `v` (sorted here).
fn percentile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len());
    Some(v[i - 1])
}

/// Per-tenant lines from `(tenant, ttft seconds, e2e seconds, failed)` per request.
pub fn tenant_lines(
    draw: &TenantDraw,
    reqs: impl Iterator<Item = (u16, Option<f64>, f64, bool)>,
) -> Vec<TenantLine> {
    let n = draw.len();
    let mut ttft: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut e2e: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut counts = vec![(0u64, 0u64); n];
    for (t, f, e, failed) in reqs {
        let i = usize::from(t).min(n.saturating_sub(1));
        counts[i].0 += 1;
        if failed {
            counts[i].1 += 1;
            continue;
        }
        if let Some(f) = f {
            ttft[i].push(f);
        }
        e2e[i].push(e);
    }
    (0..n)
        .map(|i| TenantLine {
            tenant: draw.name(i as u16).to_string(),
            requests: counts[i].0,
            failed: counts[i].1,
            ttft_p50_s: percentile(&mut ttft[i], 0.5),
            ttft_p90_s: percentile(&mut ttft[i], 0.9),
            e2e_p90_s: percentile(&mut e2e[i], 0.9),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_are_errors() {
        assert_eq!(
            parse_tenants("noisy=10, quiet=1").unwrap(),
            vec![("noisy".into(), 10.0), ("quiet".into(), 1.0)]
        );
        for bad in ["", "a", "a=0", "a=-1", "a=x", "=2", "a=1,a=2", "a=inf"] {
            assert!(parse_tenants(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn draws_follow_the_weights_and_the_seed() {
        let t = parse_tenants("noisy=10,quiet=1").unwrap();
        let mut d = TenantDraw::new(&t, 3);
        let draws: Vec<u16> = (0..11_000).map(|_| d.draw()).collect();
        let quiet = draws.iter().filter(|&&i| i == 1).count();
        assert!((800..1200).contains(&quiet), "{quiet}");
        let mut again = TenantDraw::new(&t, 3);
        assert!(draws.iter().all(|&i| i == again.draw()));
        let mut one = TenantDraw::new(&parse_tenants("only=1").unwrap(), 3);
        assert_eq!(one.draw(), 0);
    }

    #[test]
    fn lines_per_tenant() {
        let t = parse_tenants("a=1,b=1").unwrap();
        let d = TenantDraw::new(&t, 0);
        let reqs = vec![
            (0, Some(1.0), 2.0, false),
            (0, Some(3.0), 4.0, false),
            (1, None, 0.5, true),
        ];
        let l = tenant_lines(&d, reqs.into_iter());
        assert_eq!(l[0].requests, 2);
        assert_eq!(l[0].ttft_p50_s, Some(1.0));
        assert_eq!(l[0].ttft_p90_s, Some(3.0));
        assert_eq!((l[1].requests, l[1].failed, l[1].ttft_p90_s), (1, 1, None));
    }
}
