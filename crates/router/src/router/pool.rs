//! The candidate set and its state: the endpoints the scheduler reads ([`Candidate`]s),
//! beside each one's runtime state the scheduler does not read (circuit, readiness,
//! background tasks), the slots they hold, the approximate index, the split and the RNG.
//! All of it sits behind the router's one pool mutex.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use strata_api::model_server::LoadSample;
use tokio::task::JoinHandle;

use crate::circuit::Circuit;
use crate::endpoint::EndpointId;
use crate::prefix::approx::ApproxIndex;
use crate::scheduling::{Candidate, TrafficSplit};

/// Per-endpoint state that the scheduler does not read directly.
#[derive(Debug)]
pub(super) struct Runtime {
    pub(super) circuit: Circuit,
    pub(super) health_ok: bool,
    pub(super) last_error: Option<String>,
    pub(super) tasks: Vec<JoinHandle<()>>,
    /// The whole of the last readable `/metrics` page (counters and histograms too), for
    /// readers besides the scheduler: inside `strata up` this router's scrape is the only
    /// one, and the controller and dashboard read it here.
    pub(super) last_load: Option<Arc<LoadSample>>,
    /// Said once in the log that this endpoint's load is unknown.
    pub(super) warned_unknown_load: bool,
    /// Said once that its KV events' block size disagrees with its metrics or the config.
    pub(super) warned_block_size: bool,
}

/// The endpoints, `runtime[i]` beside `cands[i]`, and what a decision draws on.
pub(super) struct Pool {
    pub(super) cands: Vec<Candidate>,
    pub(super) runtime: Vec<Runtime>,
    pub(super) free_slots: Vec<u32>,
    pub(super) next_slot: u32,
    pub(super) approx: ApproxIndex,
    pub(super) split: TrafficSplit,
    pub(super) rng: StdRng,
}

impl Pool {
    pub(super) fn index_of(&self, url: &str) -> Option<usize> {
        self.cands.iter().position(|c| c.spec.url == url)
    }
    pub(super) fn index_of_id(&self, id: EndpointId, url: &str) -> Option<usize> {
        self.cands
            .iter()
            .position(|c| c.id == id && c.spec.url == url)
    }
}

/// Whether `model` names a LoRA adapter some endpoint advertises (rather than a base
/// model it serves).
pub(super) fn names_adapter(cands: &[Candidate], model: &str) -> bool {
    !model.is_empty()
        && cands.iter().any(|c| {
            c.spec.model.as_deref() != Some(model)
                && (c.spec.lora.iter().any(|a| a == model)
                    || c.metrics.as_ref().is_some_and(|x| {
                        x.lora_running
                            .iter()
                            .chain(&x.lora_waiting)
                            .any(|a| a == model)
                    }))
        })
}

/// Recomputes every candidate's readiness at `now`: its last readiness check passed and
/// its circuit admits. Runs before every read of `ready`.
pub(super) fn refresh_ready(pool: &mut Pool, now: Duration) {
    let Pool { cands, runtime, .. } = pool;
    for (c, rt) in cands.iter_mut().zip(runtime.iter()) {
        c.ready = rt.health_ok && rt.circuit.admits(now);
    }
}
