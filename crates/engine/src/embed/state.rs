//! What the handlers of an engine serving an encoder share, and the count of requests in
//! flight (for draining and `vllm:num_requests_running`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::classifier::ClassifierConfig;
use super::tokenizer::EmbedTokenizer;
use super::worker::EmbedHandle;
use crate::auth::Gate;
use crate::metrics::EngineMetrics;

/// What the handlers share.
pub struct EmbedState {
    pub model_name: String,
    pub tokenizer: EmbedTokenizer,
    pub worker: EmbedHandle,
    pub metrics: Arc<EngineMetrics>,
    /// Longest input, special tokens included.
    pub max_len: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub max_body_bytes: usize,
    pub created: u64,
    /// The API key every route but `/health`, `/version` and `/metrics` is checked against
    /// (`crate::auth`; this front has no admin routes).
    pub gate: Arc<Gate>,
    /// The labels of a sequence-classification model (a cross-encoder has one); `None`
    /// for a sentence encoder.
    pub classifier: Option<ClassifierConfig>,
    pub(super) in_flight: AtomicUsize,
}

/// Counts a request in flight for as long as it lives, whatever way it ends.
pub(super) struct InFlight<'a>(&'a EmbedState);

impl<'a> InFlight<'a> {
    pub(super) fn new(state: &'a EmbedState) -> Self {
        let n = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        state.metrics.num_requests_running.set(n as i64);
        Self(state)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let n = self
            .0
            .in_flight
            .fetch_sub(1, Ordering::SeqCst)
            .saturating_sub(1);
        self.0.metrics.num_requests_running.set(n as i64);
    }
}
