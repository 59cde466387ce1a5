//! Filters: each narrows the candidate list. A filter that would leave nobody and is only
//! a preference (queue, LoRA) keeps the list as it was; a hard one (role) may empty it.

use super::{Candidate, Context, Filter, SchedRequest};

/// Keeps endpoints whose `role` label is the given one (or `both`, or unlabelled).
#[derive(Debug, Clone)]
pub struct RoleFilter {
    pub role: String,
}

impl Filter for RoleFilter {
    fn filter<'c>(
        &self,
        _: &Context,
        _: &SchedRequest,
        cands: Vec<&'c Candidate>,
    ) -> Vec<&'c Candidate> {
        cands
            .into_iter()
            .filter(|c| match c.spec.role.as_deref() {
                None | Some("both") => true,
                Some(r) => r == self.role,
            })
            .collect()
    }
}

/// Keeps only endpoints whose `role` label is exactly the given one: the prefill side of a
/// disaggregated pair, where an unlabelled or `both` replica is a decoder, not a prefill
/// engine that keeps blocks for others.
#[derive(Debug, Clone)]
pub struct StrictRoleFilter {
    pub role: String,
}

impl Filter for StrictRoleFilter {
    fn filter<'c>(
        &self,
        _: &Context,
        _: &SchedRequest,
        cands: Vec<&'c Candidate>,
    ) -> Vec<&'c Candidate> {
        cands
            .into_iter()
            .filter(|c| c.spec.role.as_deref() == Some(self.role.as_str()))
            .collect()
    }
}

/// Keeps endpoints whose queue is at most `threshold` (fresh metrics only); keeps all when
/// none qualifies.
#[derive(Debug, Clone)]
pub struct LowQueueFilter {
    pub threshold: f64,
}

impl Filter for LowQueueFilter {
    fn filter<'c>(
        &self,
        ctx: &Context,
        _: &SchedRequest,
        cands: Vec<&'c Candidate>,
    ) -> Vec<&'c Candidate> {
        let kept: Vec<&Candidate> = cands
            .iter()
            .copied()
            .filter(|c| {
                c.fresh_metrics(ctx.now, ctx.stale_after)
                    .is_some_and(|m| m.waiting <= self.threshold)
            })
            .collect();
        if kept.is_empty() {
            cands
        } else {
            kept
        }
    }
}

/// For a LoRA request: keeps endpoints with the adapter loaded (running or waiting); else
/// those with a free adapter slot; else everyone.
#[derive(Debug, Clone, Default)]
pub struct LoraAffinityFilter;

impl Filter for LoraAffinityFilter {
    fn filter<'c>(
        &self,
        _: &Context,
        req: &SchedRequest,
        cands: Vec<&'c Candidate>,
    ) -> Vec<&'c Candidate> {
        let Some(adapter) = req.lora.as_deref() else {
            return cands;
        };
        let loaded: Vec<&Candidate> = cands
            .iter()
            .copied()
            .filter(|c| {
                c.metrics.as_ref().is_some_and(|m| {
                    m.lora_running
                        .iter()
                        .chain(&m.lora_waiting)
                        .any(|a| a == adapter)
                })
            })
            .collect();
        if !loaded.is_empty() {
            return loaded;
        }
        let free: Vec<&Candidate> = cands
            .iter()
            .copied()
            .filter(|c| c.metrics.as_ref().is_some_and(has_free_slot))
            .collect();
        if free.is_empty() {
            cands
        } else {
            free
        }
    }
}

pub(crate) fn has_free_slot(m: &super::EndpointMetrics) -> bool {
    m.max_lora
        .is_some_and(|max| (m.lora_running.len() + m.lora_waiting.len()) < max as usize)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use std::sync::Arc;

    fn ids(v: &[&Candidate]) -> Vec<u32> {
        v.iter().map(|c| c.id.0).collect()
    }

    #[test]
    fn role_is_hard() {
        let mut cs = [cand(0, 0.0, 0.0), cand(1, 0.0, 0.0), cand(2, 0.0, 0.0)];
        Arc::make_mut(&mut cs[0].spec).role = Some("prefill".into());
        Arc::make_mut(&mut cs[1].spec).role = Some("decode".into());
        let f = RoleFilter {
            role: "decode".into(),
        };
        let out = f.filter(
            &Context::at(now()),
            &SchedRequest::default(),
            cs.iter().collect(),
        );
        assert_eq!(ids(&out), vec![1, 2]);
        let f = RoleFilter { role: "x".into() };
        let out = f.filter(
            &Context::at(now()),
            &SchedRequest::default(),
            cs[..2].iter().collect(),
        );
        assert!(out.is_empty());
        let strict = StrictRoleFilter {
            role: "prefill".into(),
        };
        let out = strict.filter(
            &Context::at(now()),
            &SchedRequest::default(),
            cs.iter().collect(),
        );
        assert_eq!(ids(&out), vec![0], "unlabelled is no prefill engine");
    }

    #[test]
    fn low_queue_is_soft_and_ignores_stale() {
        let mut cs = [cand(0, 1.0, 0.0), cand(1, 50.0, 0.0), cand(2, 0.0, 0.0)];
        cs[2].metrics.as_mut().unwrap().updated = std::time::Duration::ZERO; // stale
        let f = LowQueueFilter { threshold: 10.0 };
        let out = f.filter(
            &Context::at(now()),
            &SchedRequest::default(),
            cs.iter().collect(),
        );
        assert_eq!(ids(&out), vec![0]);
        let out = f.filter(
            &Context::at(now()),
            &SchedRequest::default(),
            cs[1..].iter().collect(),
        );
        assert_eq!(ids(&out), vec![1, 2], "nobody qualifies: keep all");
    }

    #[test]
    fn lora_prefers_loaded_then_free_slots() {
        let mut cs = vec![cand(0, 0.0, 0.0), cand(1, 0.0, 0.0), cand(2, 0.0, 0.0)];
        for c in &mut cs {
            c.metrics.as_mut().unwrap().max_lora = Some(1);
        }
        cs[0].metrics.as_mut().unwrap().lora_running = vec!["other".into()];
        cs[1].metrics.as_mut().unwrap().lora_waiting = vec!["a".into()];
        let f = LoraAffinityFilter;
        let req = SchedRequest {
            lora: Some("a".into()),
            ..Default::default()
        };
        let ctx = Context::at(now());
        assert_eq!(ids(&f.filter(&ctx, &req, cs.iter().collect())), vec![1]);
        let req_b = SchedRequest {
            lora: Some("b".into()),
            ..Default::default()
        };
        assert_eq!(
            ids(&f.filter(&ctx, &req_b, cs.iter().collect())),
            vec![2],
            "free slot"
        );
        assert_eq!(
            ids(&f.filter(&ctx, &SchedRequest::default(), cs.iter().collect())),
            vec![0, 1, 2]
        );
    }
}
