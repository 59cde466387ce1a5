//! `lora-affinity-scorer`: endpoints that run, or have room for, the request's adapter.

use std::sync::Arc;

use rand::RngCore;

use crate::scheduling::filters::has_free_slot;
use crate::scheduling::params::BadParameters;
use crate::scheduling::{Candidate, Context, SchedRequest, Scorer};

/// LoRA affinity: 1.0 adapter running, 0.8 free slot, 0.6 adapter waiting, else 0. A
/// request without an adapter scores every candidate 1.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoraAffinityScorer;

impl Scorer for LoraAffinityScorer {
    fn score(
        &self,
        _: &Context,
        req: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        _: &mut dyn RngCore,
    ) {
        let Some(adapter) = req.lora.as_deref() else {
            out.iter_mut().for_each(|o| *o = 1.0);
            return;
        };
        for (o, c) in out.iter_mut().zip(cands) {
            *o = match &c.metrics {
                None => 0.0,
                Some(m) if m.lora_running.iter().any(|a| a == adapter) => 1.0,
                Some(m) if has_free_slot(m) => 0.8,
                Some(m) if m.lora_waiting.iter().any(|a| a == adapter) => 0.6,
                Some(_) => 0.0,
            };
        }
    }
}

/// The `lora-affinity-scorer` plugin (no parameters read).
pub(super) fn build(_: Option<&serde_json::Value>) -> Result<Arc<dyn Scorer>, BadParameters> {
    Ok(Arc::new(LoraAffinityScorer))
}
