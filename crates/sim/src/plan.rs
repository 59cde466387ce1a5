//! `strata plan`: the cheapest fleet (replica count × tensor parallelism) whose simulated
//! percentiles meet a latency objective.
//!
//! For each tensor-parallel size that fits the model, the replica count is searched by
//! doubling until the objective holds, then by bisection between the last failing and the
//! first passing count (more replicas never make a percentile worse in this model, up to
//! routing noise). The cheapest passing fleet in GPUs wins; ties go to the better p-values.

use std::time::Duration;

use serde::Serialize;
use strata_bench::stats::Summary;
use strata_bench::Report;

use crate::error::SimError;
use crate::sim::{simulate, SimConfig};

/// Which latency an objective bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    Ttft,
    Tpot,
    Itl,
    E2e,
}

/// One objective: `metric` at percentile `p` (50, 90 or 99) at most `limit`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Objective {
    pub metric: Metric,
    pub percentile: u32,
    #[serde(serialize_with = "secs")]
    pub limit: Duration,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Parses `ttft_p90=2s,itl_p99=50ms` (a bare number is seconds, as `strata bench`
/// durations).
pub fn parse_objectives(text: &str) -> Result<Vec<Objective>, String> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}` is not metric_pNN=duration (e.g. ttft_p90=2s)"))?;
        let (metric, pct) = key
            .trim()
            .split_once("_p")
            .ok_or_else(|| format!("`{key}` is not metric_pNN (e.g. ttft_p90)"))?;
        let metric = match metric {
            "ttft" => Metric::Ttft,
            "tpot" => Metric::Tpot,
            "itl" => Metric::Itl,
            "e2e" => Metric::E2e,
            other => return Err(format!("unknown metric `{other}` (ttft, tpot, itl, e2e)")),
        };
        let percentile: u32 = match pct.parse() {
            Ok(p @ (50 | 90 | 99)) => p,
            _ => return Err(format!("percentile `p{pct}` must be p50, p90 or p99")),
        };
        let limit = strata_bench::args::parse_duration(value)?;
        if limit.is_zero() {
            return Err(format!("objective `{part}` must be positive"));
        }
        out.push(Objective {
            metric,
            percentile,
            limit,
        });
    }
    if out.is_empty() {
        return Err("give at least one objective, e.g. ttft_p90=2s,itl_p99=50ms".into());
    }
    Ok(out)
}

impl Objective {
    /// The report's value for this objective, seconds (`None`: no samples).
    pub fn value(&self, report: &Report) -> Option<f64> {
        let l = &report.latency_ms;
        let s: &Summary = match self.metric {
            Metric::Ttft => l.ttft.as_ref(),
            Metric::Tpot => l.tpot.as_ref(),
            Metric::Itl => l.itl.as_ref(),
            Metric::E2e => l.e2e.as_ref(),
        }?;
        let ms = match self.percentile {
            50 => s.p50,
            90 => s.p90,
            _ => s.p99,
        };
        Some(ms / 1000.0)
    }

    /// Met when there are samples, every request completed and the percentile is within
    /// the limit.
    pub fn met(&self, report: &Report) -> bool {
        report.requests.failed == 0
            && self
                .value(report)
                .is_some_and(|v| v <= self.limit.as_secs_f64())
    }

    pub fn name(&self) -> String {
        let m = match self.metric {
            Metric::Ttft => "ttft",
            Metric::Tpot => "tpot",
            Metric::Itl => "itl",
            Metric::E2e => "e2e",
        };
        format!("{m}_p{}", self.percentile)
    }
}

/// One fleet tried.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trial {
    pub tp: u32,
    pub replicas: u32,
    pub gpus: u32,
    pub met: bool,
    /// Each objective's simulated value, seconds.
    pub values: Vec<(String, Option<f64>)>,
    pub output_tokens_per_s: f64,
}

/// The search's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub objectives: Vec<Objective>,
    pub best: Option<Trial>,
    pub trials: Vec<Trial>,
}

fn trial(base: &SimConfig, tp: u32, replicas: u32, goals: &[Objective]) -> Result<Trial, SimError> {
    let mut cfg = base.clone();
    cfg.step.tp = tp;
    cfg.replicas = replicas;
    let out = simulate(&cfg)?;
    Ok(Trial {
        tp,
        replicas,
        gpus: tp * replicas,
        met: goals.iter().all(|g| g.met(&out.report)),
        values: goals
            .iter()
            .map(|g| (g.name(), g.value(&out.report)))
            .collect(),
        output_tokens_per_s: out.report.throughput.output_tokens_per_s,
    })
}

/// Searches replica counts up to `max_replicas` for each of `tps` (sizes that do not fit
/// the model are skipped).
pub fn plan(
    base: &SimConfig,
    tps: &[u32],
    max_replicas: u32,
    goals: &[Objective],
) -> Result<Plan, SimError> {
    let mut trials = Vec::new();
    let mut best: Option<Trial> = None;
    for &tp in tps {
        let mut probe = base.step.clone();
        probe.tp = tp;
        if crate::profile::StepModel::new(probe.hardware.clone(), probe.model.clone(), tp).is_err()
            || (base.engine.num_blocks.is_none()
                && probe.num_blocks(base.engine.block_size).is_err())
        {
            continue;
        }
        // Doubling, then bisection.
        let mut lo = 0u32; // known failing (0 = none tried)
        let mut hi = None;
        let mut n = 1u32;
        while n <= max_replicas {
            let t = trial(base, tp, n, goals)?;
            let met = t.met;
            trials.push(t);
            if met {
                hi = Some(n);
                break;
            }
            lo = n;
            if n == max_replicas {
                break;
            }
            n = (n * 2).min(max_replicas);
        }
        let Some(mut hi) = hi else { continue };
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            let t = trial(base, tp, mid, goals)?;
            let met = t.met;
            trials.push(t);
            if met {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        if let Some(t) = trials
            .iter()
            .find(|t| t.tp == tp && t.replicas == hi && t.met)
            .cloned()
        {
            let better = match &best {
                None => true,
                Some(b) => t.gpus < b.gpus,
            };
            if better {
                best = Some(t);
            }
        }
    }
    Ok(Plan {
        objectives: goals.to_vec(),
        best,
        trials,
    })
}

impl Plan {
    pub fn render_text(&self) -> String {
        let mut s = String::new();
        let names: Vec<String> = self.objectives.iter().map(Objective::name).collect();
        s.push_str(&format!(
            "objectives: {}\n",
            self.objectives
                .iter()
                .map(|o| format!("{} <= {:.3}s", o.name(), o.limit.as_secs_f64()))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        s.push_str(&format!(
            "{:>4} {:>9} {:>5} {:>5}  {}  out tok/s\n",
            "tp",
            "replicas",
            "gpus",
            "met",
            names.iter().map(|n| format!("{n:>10}")).collect::<String>()
        ));
        for t in &self.trials {
            let vals: String = t
                .values
                .iter()
                .map(|(_, v)| match v {
                    Some(v) => format!("{:>9.3}s", v),
                    None => format!("{:>10}", "-"),
                })
                .collect();
            s.push_str(&format!(
                "{:>4} {:>9} {:>5} {:>5}  {}  {:.0}\n",
                t.tp,
                t.replicas,
                t.gpus,
                if t.met { "yes" } else { "no" },
                vals,
                t.output_tokens_per_s
            ));
        }
        match &self.best {
            Some(b) => s.push_str(&format!(
                "cheapest: {} replicas x tp {} = {} GPUs\n",
                b.replicas, b.tp, b.gpus
            )),
            None => s.push_str("no fleet within --max-replicas meets the objectives\n"),
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objectives_parse_and_reject_nonsense() {
        let o = parse_objectives("ttft_p90=2s, itl_p99=50ms").unwrap();
        assert_eq!(o.len(), 2);
        assert_eq!(o[0].metric, Metric::Ttft);
        assert_eq!(o[0].percentile, 90);
        assert_eq!(o[0].limit, Duration::from_secs(2));
        assert_eq!(o[1].limit, Duration::from_millis(50));
        for bad in [
            "",
            "ttft=2s",
            "ttft_p95=1s",
            "foo_p90=1s",
            "ttft_p90=",
            "ttft_p90=0",
        ] {
            assert!(parse_objectives(bad).is_err(), "{bad}");
        }
    }
}
